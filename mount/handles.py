"""Open-file handles of the FUSE layer: what an open file reads from and writes to.

Each handle is a snapshot or a staging area; the core is called at open (to draw a
batch or fetch a value) and at flush (to commit), never per read or write chunk.
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING, Awaitable, Callable

from distorefs import clientwire as wire
from distorefs.batch import Batch, BatchFile
from distorefs.buffer import Buffer
from distorefs.clientsession import ClientSession, DatasetSession
from distorefs.errors import DistorefsError, InvalidArgument, NotPermitted, TooLarge
from distorefs.names import parse_priorities
from distorefs.ratelimit import InsertTicket
from distorefs.waiting import Outcome

from . import backing, interpose

if TYPE_CHECKING:
    from distorefs.checkpoints import Memory

    from .nodes import EntryNode, Node


class Handle:
    direct_io = False
    keep_cache = False
    nonseekable = False
    flush_tracked = False  # says after each write whether its close has anything to do
    # Its release may run after the RELEASE was answered: nothing a caller waits for happens
    # there (close() returned at the FLUSH), so the library's front answers it and Python
    # releases the handle before its next request (mount/operations.py release_taken).
    release_deferred = False
    node: Node | None = None  # the node opened (mount/operations.py sets it if the handle did not)
    fh: int | None = None  # its number (mount/operations.py sets it)
    backing_id = 0  # a file the kernel reads for this handle itself (FUSE passthrough); 0: none

    def nothing_at_flush(self) -> bool:
        """(flush_tracked handles) Whether flush() would do nothing now."""
        return False

    def opened(self) -> None:
        """Its number is given (`fh`), the open not yet answered: what of its requests the
        library's front may take from here on."""

    def chunk_filled(self, index: int, data: Memory, filled: int) -> bool:
        """A chunk buffer lent to the front for this handle came back filled whole (mount/
        interpose.py chunks_full). False: not this handle's (the caller gives it back)."""
        return False

    async def read(self, off: int, size: int) -> bytes | memoryview:
        raise NotPermitted("not open for reading")

    async def write(self, off: int, buf: bytes) -> int:
        raise NotPermitted("not open for writing")

    async def flush(self) -> None:
        pass

    async def fsync(self) -> None:
        """fsync(): after flush and the store's sync, wait for what this handle keeps itself."""

    async def release(self) -> None:
        pass


class BytesReader(Handle):
    """A fixed value: an entry's content, or a rendered control file."""

    def __init__(self, data: bytes, *, cacheable: bool) -> None:
        self.data = data
        self.view = memoryview(data)
        self.keep_cache = cacheable
        self.direct_io = not cacheable

    async def read(self, off: int, size: int) -> memoryview:
        return self.view[off:off + size]  # pyfuse3 replies from any buffer: no copy


class SampleReader(Handle):
    """`sample/N` or `batch/N.npz`: a batch fixed for the life of the handle, its file
    gathered from the entries' values at each READ (distorefs/batch.py). Read through the
    page cache (its inode has no other open batch, and an open without keep_cache starts
    the cache empty), so the kernel's read-ahead asks for 1 MiB at a time, not the
    reader's 128-256 KiB pieces."""

    # One gather buffer for every batch READ, reused (no fresh 1 MiB, page-faulted, per
    # READ). Shared safely: the event loop thread fills it and pyfuse3 replies from it
    # before any other task runs (no await between the gather and the reply).
    scratch = bytearray(1 << 20)  # the kernel's largest READ (max_pages 256)

    def __init__(self, buffer: Buffer, batch: Batch, content: BatchFile) -> None:
        self.buffer = buffer
        self.batch = batch
        self.content = content
        self.size = content.size
        self.memfd: backing.Memfd | None = None  # holding its file, when the kernel reads that (`back`)

    async def read(self, off: int, size: int):
        return self.content.read(off, size, SampleReader.scratch)

    def back(self, memfd: backing.Memfd, backing_id: int) -> None:
        """The kernel reads this handle's file from `memfd`, registered as `backing_id`
        (mount/backing.py): both are the handle's until its release."""
        self.memfd, self.backing_id = memfd, backing_id

    async def release(self) -> None:
        self.buffer.release(self.batch)
        if self.backing_id:
            backing.unregister(self.backing_id)
            self.backing_id = 0
        if self.memfd is not None:
            memfd, self.memfd = self.memfd, None
            recycle = getattr(self.node, "recycle_memfd", None)
            if recycle is not None:
                recycle(memfd)
            else:
                memfd.close()


class ClientHandle(Handle):
    """`buffers/NAME/client`, `datasets/NAME/client`: request frames written from offset 0 (one write may carry
    several, and the kernel may split it into several WRITEs), each carried out by the
    session as it completes; the last reply is read back from offset 0."""

    direct_io = True

    def __init__(self, session: ClientSession | DatasetSession) -> None:
        self.session = session
        self.inbox = b""  # the start of a frame not complete yet
        self.received = 0  # bytes of the current write (offsets continue from here)
        self.reply = b""

    async def write(self, off: int, buf: bytes) -> int:
        if off == 0:
            self.inbox, self.received = b"", 0
        elif off != self.received:
            raise InvalidArgument(f"client requests are written in order from offset 0 (got offset {off})")
        self.received += len(buf)
        data = self.inbox + buf if self.inbox else buf
        view = memoryview(data)
        pos = 0
        try:
            while len(data) - pos >= wire.FRAME.size:
                length = wire.frame_length(view[pos:pos + 4])
                if length < wire.FRAME.size:
                    raise InvalidArgument(f"a client request frame of {length} bytes")
                if len(data) - pos < length:
                    break
                try:
                    op, payload = wire.split_frame(view[pos:pos + length])
                    reply = await self.session.request(op, payload)
                except wire.WireError as exc:  # a frame or payload that does not parse
                    raise InvalidArgument(f"client request: {exc}") from None
                if reply is not None:
                    self.reply = wire.reply_frame(reply)
                pos += length
        except BaseException:
            self.inbox, self.received = b"", 0  # the rest of this write is dropped
            raise
        self.inbox = bytes(view[pos:]) if pos < len(data) else b""
        return len(buf)

    async def read(self, off: int, size: int) -> memoryview:
        return memoryview(self.reply)[off:off + size]

    async def release(self) -> None:
        self.session.close()


class StagingWriter(Handle):
    """Bytes written to a handle, kept in memory and committed whole.

    Written data commits at flush (every close()). A handle that only created or
    truncated its file commits at release instead: a shell's `>` closes a dup of the
    descriptor before writing, and that flush must not publish an empty version.
    """

    def __init__(self, initial: bytes, limit: int, readable: bool) -> None:
        self.data: bytes | bytearray = bytearray(initial)
        self.limit = limit
        self.readable = readable
        self.dirty = False  # something to commit
        self.wrote = False  # ... and it came from write() or truncate()
        self.failed: Exception | None = None  # a refused write: close() reports it, nothing commits
        # A refused commit: every later close() of the open file reports it too, until
        # something new is written (np.save closes a duplicate descriptor first, and numpy
        # ignores what that close says: the caller's own close must say it).
        self.refused: Exception | None = None

    async def read(self, off: int, size: int) -> bytes:
        if not self.readable:
            raise NotPermitted("not open for reading")
        return bytes(self.data[off:off + size])

    async def write(self, off: int, buf: bytes) -> int:
        end = off + len(buf)
        if end > self.limit:
            self.failed = TooLarge(f"write up to byte {end} exceeds the limit of {self.limit} bytes")
            raise self.failed
        if not isinstance(self.data, bytearray):  # bytes the front collected
            self.data = bytearray(self.data)
        if off > len(self.data):
            self.data.extend(bytes(off - len(self.data)))
        self.data[off:end] = buf
        self.dirty = self.wrote = True
        self.refused = None
        return len(buf)

    def truncate(self, size: int) -> None:
        if size > self.limit:
            self.failed = TooLarge(f"size {size} exceeds the limit of {self.limit} bytes")
            raise self.failed
        if not isinstance(self.data, bytearray):
            self.data = bytearray(self.data)
        if size < len(self.data):
            del self.data[size:]
        else:
            self.data.extend(bytes(size - len(self.data)))
        self.dirty = self.wrote = True
        self.refused = None

    async def flush(self) -> None:
        if self.failed is not None:
            raise self.failed  # a partial entry is never published
        if self.dirty and self.wrote:
            await self._commit()
        elif self.refused is not None:
            raise self.refused

    async def release(self) -> None:
        if self.dirty and self.failed is None:
            await self._commit()

    async def _commit(self) -> None:
        # Cleared first: a failed commit was reported to close() and is not retried later.
        self.dirty = self.wrote = False
        try:
            await self.apply(bytes(self.data))
        except Exception as exc:
            self.refused = exc
            raise

    async def apply(self, data: bytes) -> None:
        raise NotImplementedError


class EntryWriter(StagingWriter):
    """Insert or rewrite of one entry: visible, whole, when it commits.

    A new entry of a rate-limited buffer (distorefs/ratelimit.py) holds the limiter's ticket
    from its admission until its first commit (or the release of a writer that never
    commits). One the limiter held back at the create is admitted at its first write() or
    close(), which wait for it; if that wait is interrupted nothing of the entry is ever
    published (the writer fails as after a refused write)."""

    node: EntryNode
    # What a release does (the commit of a file created or truncated and closed unwritten,
    # the limiter's ticket, the node's list of writers) is done before Python's next request:
    # every request that could see it (a lookup, a listing, an open) comes after.
    release_deferred = True
    # A close after the one that committed (np.save closes a duplicate descriptor first) has
    # nothing to do: its FLUSH is the library's to answer, until something is written.
    flush_tracked = True

    def __init__(self, node, initial: bytes, limit: int, readable: bool, owner, fresh: bool,
                 ticket: InsertTicket | None = None,
                 admit: Callable[[], Awaitable[InsertTicket | None]] | None = None) -> None:
        super().__init__(initial, limit, readable)
        self.node = node
        self.owner = owner
        self.dirty = fresh  # created or truncated: commits even if nothing is written
        self.ticket = ticket
        self.admit = admit
        self.collecting = False  # the library's front keeps what is written (collect)
        self.named = False  # its inode's name is counted in the front's names of the directory

    def opened(self) -> None:
        """Have the library's front take this writer's WRITEs (mount/interpose.py
        collect_writes): an insert's bytes then reach Python with its close's FLUSH, one
        request, not one more per WRITE. Only a write-only writer with nothing written yet
        and no admission to wait for: each WRITE's answer is then the front's to give."""
        if not self.data and not self.readable and self.admit is None and self.fh is not None:
            o = self.owner  # (and the timeout EntryNode.attributes gives a writer's inode)
            self.collecting = interpose.collect_writes(self.fh, self.limit, self.node.ino, o.mode, o.uid, o.gid,
                                                       self.node.fs.store.config.entry_timeout)

    def nothing_at_flush(self) -> bool:
        return (not self.collecting and self.admit is None and self.failed is None and self.refused is None
                and not (self.dirty and self.wrote))

    def size(self) -> int:
        """The size of what was written (the front may still be collecting it)."""
        if self.collecting and self.fh is not None:
            size = interpose.collected_size(self.fh)
            if size is not None:
                return size
        return len(self.data)

    def take_collected(self) -> None:
        """What the front kept becomes this writer's bytes (before anything reads or changes
        them: every request of the handle, the inode's attributes); it keeps no more."""
        if not self.collecting:
            return
        self.collecting = False
        data = interpose.take_collected(self.fh) if self.fh is not None else None
        if data:
            self.data = data  # (bytes: committed as they are; a later write makes a copy)
            self.dirty = self.wrote = True
            self.refused = None

    async def _admitted(self) -> None:
        if self.admit is None:
            return
        if self.failed is not None:
            raise self.failed
        try:
            self.ticket = await self.admit()
        except DistorefsError as exc:  # Interrupted: the writer is gone or has a signal to take
            self.failed = exc
            raise
        self.admit = None

    async def write(self, off: int, buf: bytes) -> int:
        self.take_collected()
        await self._admitted()
        return await super().write(off, buf)

    def truncate(self, size: int) -> None:
        self.take_collected()
        if self.fh is not None:
            interpose.flush_free(self.fh, False)  # the next close commits it (by path too: setattr)
        super().truncate(size)

    async def flush(self) -> None:
        self.take_collected()
        await self._admitted()
        await super().flush()

    async def apply(self, data: bytes) -> None:
        try:
            await self.node.commit(data, self.owner)
        finally:
            self._release_ticket()  # committed (counted as an insert) or failed

    async def release(self) -> None:
        self.take_collected()
        try:
            await super().release()
        finally:
            self._release_ticket()

    def _release_ticket(self) -> None:
        ticket, self.ticket = self.ticket, None
        if ticket is not None:
            ticket.release()


class ConfigWriter(StagingWriter):
    """config.json: the JSON written is validated and applied (EINVAL keeps the old) by the
    write() after which it is a complete JSON object, so `echo '{...}' > config.json` sees
    the error (shells ignore close()); otherwise at close. `early` False: at close only."""

    def __init__(self, apply, initial: bytes, limit: int = 1 << 20, early: bool = False) -> None:
        super().__init__(initial, limit, True)
        self._apply = apply
        self.early = early

    async def write(self, off: int, buf: bytes) -> int:
        n = await super().write(off, buf)
        if self.early and complete_json_object(self.data):
            try:
                await self._commit()
            except Exception as exc:
                self.failed = exc  # close() reports it again; nothing is applied
                raise
        return n

    async def apply(self, data: bytes) -> None:
        await self._apply(data)


class PrioritiesWriter(Handle):
    """`priorities`: "KEY PRIORITY" lines, applied one write() at a time.

    A line split across two writes is kept until its end arrives (or until close). A write
    with a malformed line fails with EINVAL and applies none of its lines. A write returns
    once its lines are checked and queued for commit; close() returns once they are
    committed. That wait is the libfuse library's: it parks the close's FLUSH until the
    committer's thread says the transaction committed (mount/interpose.py flush_pending),
    so a learner's update costs one trip through Python (the WRITE), and its close is
    answered before the change is applied here (reads that show priorities settle first).
    Without the library's front, the write waits for the commit itself, as before.
    """

    flush_tracked = True

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer
        self.partial = b""
        self.commits: list[Outcome] = []  # queued by writes; flush() waits for them

    async def write(self, off: int, buf: bytes) -> int:
        text = self.partial + buf
        cut = text.rfind(b"\n") + 1
        pairs = parse_priorities(text[:cut])
        if pairs:
            pending, _ = self.buffer.queue_priorities(pairs)  # checked now: EINVAL fails this write
            if pending is not None:
                if self.fh is not None and interpose.flush_pending(self.fh):
                    pending.then(functools.partial(interpose.flush_committed, self.fh))
                    # a long-lived handle keeps only the commits it may still report
                    self.commits = [c for c in self.commits if not c.done.is_set() or c.error is not None]
                    self.commits.append(pending)
                else:
                    await pending.wait()
        self.partial = text[cut:]
        return len(buf)

    def nothing_at_flush(self) -> bool:
        return not self.partial.strip()

    async def flush(self) -> None:
        commits, self.commits = self.commits, []
        for commit in commits:  # what close() acknowledges is committed
            await commit.wait()
        if self.partial.strip():
            line, self.partial = self.partial, b""
            await self.buffer.set_priorities(parse_priorities(line))


def complete_json_object(data: bytes | bytearray) -> bool:
    """Whether `data` is one whole JSON object (only tried when it ends like one)."""
    if not bytes(data[-64:]).rstrip().endswith(b"}"):
        return False
    try:
        return isinstance(json.loads(bytes(data)), dict)
    except (ValueError, RecursionError):
        return False  # not (yet) a document: judged at close


def wants_write(flags: int) -> bool:
    return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


def wants_read(flags: int) -> bool:
    return flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR)

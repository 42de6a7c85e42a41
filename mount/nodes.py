"""The path tree: one node class per kind of path, each translating FUSE calls to core calls.

Nodes hold names and references into the core, never storage logic. A node method does
its one core call and returns attributes, handles or child nodes; errors are the core's
typed exceptions, turned into errno by `operations`.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import json
import logging
import os
import stat
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Hashable, Iterator

import pyfuse3
import trio

from distorefs import __version__
from distorefs.batch import BatchFile, Blob
from distorefs.buffer import Buffer, Reservation
from distorefs.catalog import EntryMeta
from distorefs.config import priority_text
from distorefs.errors import (AlreadyExists, CrossDevice, InvalidArgument, NotFound, NotPermitted,
                              OperationNotPermitted, Stale, Unsupported, WouldBlock)
from distorefs.names import check_name
from distorefs.owner import Owner
from distorefs.ratelimit import InsertTicket

from . import backing, interpose
from .callers import abandoned_by, process_of
from .handles import (BytesReader, ClientHandle, ConfigWriter, EntryWriter, Handle, PrioritiesWriter,
                      SampleReader, wants_read, wants_write)
from .notify import drop_attributes

if TYPE_CHECKING:
    from .operations import Filesystem

XATTR_PREFIX = b"user.distorefs."
log = logging.getLogger(__name__)

DIR_LONG = 3600.0
NO_CACHE = 0.0
# True in the task that takes the front's notes between requests (Filesystem.take_front_notes):
# work done there delays no request's reply. A context variable: each trio task has its own.
BETWEEN_REQUESTS: contextvars.ContextVar[bool] = contextvars.ContextVar("between_requests", default=False)
PASSTHROUGH_MIN = 1 << 20  # a batch file at least this large is read by the kernel from a memfd (passthrough)
LARGE_STREAMS = 64  # processes' streams of large batch files a batch directory keeps (the oldest goes)


def make_attrs(ino: int, mode: int, size: int, uid: int, gid: int, mtime_ns: int,
               timeout: float, nlink: int = 1, entry_timeout: float | None = None) -> pyfuse3.EntryAttributes:
    """Attributes; `timeout` is how long the kernel may cache them (and the name, unless
    `entry_timeout` says otherwise). Every avoided LOOKUP/GETATTR is a daemon round trip."""
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.st_mode = mode
    a.st_nlink = nlink
    a.st_uid = uid
    a.st_gid = gid
    a.st_size = size
    a.st_blksize = 128 << 10
    a.st_blocks = (size + 511) // 512
    a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = mtime_ns
    a.entry_timeout = timeout if entry_timeout is None else entry_timeout
    a.attr_timeout = timeout
    return a


class Node:
    ino: int = 0
    key: Hashable | None = None  # its key in the inode table (mount/inodes.py), None once unnamed
    open_handles = 0
    opens = 0  # handles made here so far (mount/operations.py _adopt)

    def __init__(self, fs: "Filesystem") -> None:
        self.fs = fs

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        """Attributes; `ctx` (the asking process) matters only where content is per open."""
        raise NotImplementedError

    # Whether `released` has work to do at once (the library's front then wakes Python at a
    # RELEASE it answers); else the release waits for Python's next request or a timer.
    release_wakes = False

    def released(self, handle: Handle) -> None:
        """A handle opened on this node was closed."""

    def name_timeout(self, child: "Node") -> float | None:
        """How long the kernel may keep the name it just looked up in this directory
        (None: as long as `child`'s attributes say)."""
        return NO_CACHE if getattr(self, "names_move", False) else None

    # directories override these
    async def lookup(self, name: bytes, ctx=None) -> "Node":
        raise NotFound("not a directory")

    def children(self, start: int) -> Iterator[tuple[bytes, "Node", int]]:
        return iter(())

    async def create(self, name: bytes, mode: int, flags: int, ctx) -> tuple["Node", Handle]:
        raise NotPermitted("files cannot be created here")

    async def mkdir(self, name: bytes, mode: int, ctx) -> "Node":
        raise NotPermitted("directories cannot be created here")

    async def rmdir(self, name: bytes) -> None:
        raise NotPermitted("directories cannot be removed here")

    async def unlink(self, name: bytes) -> None:
        raise NotPermitted("files cannot be removed here")

    async def rename(self, old: bytes, new_parent: "Node", new: bytes, flags: int) -> None:
        raise NotPermitted("cannot rename here")

    async def symlink(self, name: bytes, target: bytes, ctx) -> "Node":
        raise NotPermitted("symlinks live under weights/")

    def readlink(self) -> bytes:
        raise InvalidArgument("not a symlink")

    # files override these
    async def open(self, flags: int, ctx) -> Handle:
        raise NotPermitted("cannot open")

    async def setattr(self, attr, fields, handle: Handle | None, ctx) -> None:
        if fields.update_size:
            raise NotPermitted("cannot truncate")
        # other attribute changes on control paths are accepted and ignored (touch works)

    def xattrs(self) -> dict[bytes, bytes]:
        return {}

    def opened_by_front(self) -> "Handle | None":
        """The library's front answered an open of this node itself (a `once` mark of
        interpose.answer_opens): what the node does at an open. The handle, for an
        `adopted` mark (its requests and release are Python's); None otherwise (made at its
        first request that reaches Python, if one does: `adopt`)."""
        return None

    def listed(self) -> None:
        """A listing made the kernel hold this node's inode (READDIRPLUS), as a LOOKUP would."""

    async def adopt(self, flags: int) -> "Handle":
        """The handle of an open the front answered (interpose.adopt_opened), made at its
        first request that reaches Python."""
        return await self.open(flags, None)

    async def read_xattrs(self) -> dict[bytes, bytes]:
        """xattrs() for getxattr/listxattr; a node whose attributes cost work in proportion to
        its size computes them off the event loop here."""
        return self.xattrs()

    async def warm(self) -> bytes | None:
        """The `warm` attribute (distorefs warmup): load this file's stored values into the
        memory tier and say what was done; None where the memory tier does not serve the
        file's reads (ENODATA)."""
        return None

    async def setxattr(self, name: bytes, value: bytes, ctx=None) -> None:
        if name in self.xattrs():
            raise NotPermitted(f"attribute {name!r} is read-only")
        raise Unsupported(f"no attribute {name!r} here")

    async def fsyncdir(self) -> None:
        """fsync of this directory: wait for what it keeps itself (before the store's sync)."""

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.attributes().st_mode)


class StaticDir(Node):
    """A directory whose children are fixed nodes."""

    def __init__(self, fs: "Filesystem", entries: dict[bytes, Node] | None = None, mode: int = 0o755) -> None:
        super().__init__(fs)
        self.entries = entries or {}
        self.mode = mode

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        return make_attrs(self.ino, stat.S_IFDIR | self.mode, 0, self.fs.uid, self.fs.gid, self.fs.started_ns,
                          DIR_LONG, nlink=2)

    async def lookup(self, name: bytes, ctx=None) -> Node:
        node = self.entries.get(name)
        if node is None:
            raise NotFound(f"no {name!r}")
        return node

    def children(self, start: int):
        for i, (name, node) in enumerate(list(self.entries.items())[start:], start + 1):
            yield name, node, i


class RenderedFile(Node):
    """A read-only control file rendered at open (stats.json, config.json, version).
    `size_known` False (stats.json): size 0, as /proc files, read to the end with direct_io."""

    def __init__(self, fs: "Filesystem", render, size_known: bool = True, owner: Callable[[], Owner] | None = None,
                 write=None, settle: Callable[[], Awaitable[None]] | None = None) -> None:
        """`settle`: awaited before an open renders (a buffer's stats wait for the
        priorities writes acknowledged before, `Buffer.settled`)."""
        super().__init__(fs)
        self.render = render
        self.size_known = size_known
        self.owner = owner
        self.write_fn = write
        self.settle = settle

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        size = len(self.render()) if self.size_known else 0
        mode = 0o644 if self.write_fn else 0o444
        owner = self.owner() if self.owner is not None else None  # the namespace's, as it is now
        if owner is not None:  # a namespace's files follow its mode (chmod 0700 hides them)
            mode &= owner.mode
        uid, gid = (owner.uid, owner.gid) if owner else (self.fs.uid, self.fs.gid)
        # times fixed at mount: a time that moved at every stat made `tar c MNT` see a change
        return make_attrs(self.ino, stat.S_IFREG | mode, size, uid, gid, self.fs.started_ns, NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            if self.write_fn is None:
                raise NotPermitted("read-only file")
            return ConfigWriter(self.write_fn, b"" if flags & os.O_TRUNC else self.render(), early=True)
        if self.settle is not None:
            await self.settle()
        return BytesReader(self.render(), cacheable=False)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        if fields.update_size and self.write_fn is not None:
            if isinstance(handle, ConfigWriter):
                handle.truncate(attr.st_size)
            return  # truncation before a write: the write replaces the content at close
        await super().setattr(attr, fields, handle, ctx)


def _json(data) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=False) + "\n").encode()


class NamespacesDir(Node):
    """buffers/ or banks/: one directory per namespace; mkdir creates, rmdir drops an empty one."""

    def __init__(self, fs: "Filesystem", kind: str) -> None:
        super().__init__(fs)
        self.kind = kind

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        return make_attrs(self.ino, stat.S_IFDIR | 0o755, 0, self.fs.uid, self.fs.gid, self.fs.started_ns,
                          DIR_LONG, nlink=2 + len(self.fs.store.namespaces[self.kind]))

    def _node(self, name: str) -> Node:
        ns: Any = self.fs.store.namespace(self.kind, name)  # a Dataset, Buffer or Bank, as `kind` says
        make: Callable[[Filesystem, Any], Node]
        if self.kind == "datasets":
            from .dataset_nodes import DatasetDir
            make = DatasetDir
        else:
            make = BufferDir if self.kind == "buffers" else BankDir
        return self.fs.inodes.intern(("ns", ns.ns_id), lambda: make(self.fs, ns))

    async def lookup(self, name: bytes, ctx=None) -> Node:
        return self._node(name.decode("utf-8", "surrogateescape"))

    def children(self, start: int):
        names = sorted(self.fs.store.namespaces[self.kind])
        for i, name in enumerate(names[start:], start + 1):
            yield name.encode("utf-8", "surrogateescape"), self._node(name), i

    async def mkdir(self, name: bytes, mode: int, ctx) -> Node:
        check_name(name)
        owner = Owner(stat.S_IFDIR | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)
        await self.fs.store.create(self.kind, name.decode("utf-8", "surrogateescape"), owner)
        return await self.lookup(name)

    async def rmdir(self, name: bytes) -> None:
        text = name.decode("utf-8", "surrogateescape")
        ns = self.fs.store.namespace(self.kind, text)
        await self.fs.store.drop(self.kind, text)
        self.fs.inodes.unname(("ns", ns.ns_id))


class RingDir(Node):
    """A namespace directory: fixed children made on demand (config.json, entries/, ...)."""

    def __init__(self, fs: "Filesystem", ns) -> None:
        super().__init__(fs)
        self.ns = ns
        intern = fs.inodes.intern
        nsid = ns.ns_id

        async def configure(text: bytes) -> None:
            await fs.store.configure(ns.kind, ns.name, text)
            entries = fs.inodes.node_of(("entries", nsid))
            if isinstance(entries, EntriesDir):
                entries.answer_creates()  # a rate limiter now, or another max_entry_bytes

        self.entries = {
            b"config.json": lambda: intern(("config", nsid), lambda: RenderedFile(
                fs, lambda: ns.config.to_json(), owner=lambda: ns.owner, write=configure)),
            b"stats.json": lambda: intern(("stats", nsid), lambda: RenderedFile(
                fs, lambda: _json(ns.stats()), size_known=False, owner=lambda: ns.owner,
                settle=ns.settled if isinstance(ns, Buffer) else None)),
            b"entries": lambda: intern(("entries", nsid), lambda: EntriesDir(fs, ns)),
        }

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.ns.owner
        return make_attrs(self.ino, stat.S_IFDIR | (o.mode & 0o7777), 0, o.uid, o.gid, self.ns.ctime_ns,
                          DIR_LONG, nlink=2 + len(self.entries))

    async def lookup(self, name: bytes, ctx=None) -> Node:
        make = self.entries.get(name)
        if make is None:
            raise NotFound(f"no {name!r}")
        return make()

    def children(self, start: int):
        for i, (name, make) in enumerate(list(self.entries.items())[start:], start + 1):
            yield name, make(), i

    async def setattr(self, attr, fields, handle, ctx) -> None:
        await super().setattr(attr, fields, handle, ctx)
        if not (fields.update_mode or fields.update_uid or fields.update_gid):
            return
        await self.fs.store.set_owner(self.ns.kind, self.ns.name,
                                      mode=attr.st_mode if fields.update_mode else None,
                                      uid=attr.st_uid if fields.update_uid else None,
                                      gid=attr.st_gid if fields.update_gid else None)
        # entries/, at/, sample/ ... take their owner and mode from the namespace: the kernel
        # holds their attributes for DIR_LONG and checks permissions against them, and the
        # library holds those of entries/ and priorities (EntriesDir, PrioritiesFile).
        for name in (b"entries", b"at", b"sample", b"batch", b"priorities", b"client", b"config.json",
                     b"stats.json"):
            ino = self.fs.inodes.ino_of((name.decode().split(".")[0], self.ns.ns_id))
            if ino is None:
                continue
            interpose.forget_attributes(ino)
            if self.fs.invalidator is not None:
                self.fs.invalidator.inode(ino)


class BankDir(RingDir):
    """banks/NAME/: config.json, stats.json, entries/, at/."""

    def __init__(self, fs: "Filesystem", bank) -> None:
        super().__init__(fs, bank)
        self.entries[b"at"] = lambda: fs.inodes.intern(("at", bank.ns_id), lambda: AtDir(fs, bank))


class AtDir(Node):
    """banks/NAME/at/: `at/I` is the entry at FIFO position I (0 = oldest). Positions shift
    as entries come and go, so the kernel must not cache these names (see names_move)."""

    names_move = True

    def __init__(self, fs: "Filesystem", bank) -> None:
        super().__init__(fs)
        self.bank = bank

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.bank.owner
        return make_attrs(self.ino, stat.S_IFDIR | (o.mode & 0o555), 0, o.uid, o.gid, self.bank.ctime_ns, DIR_LONG,
                          nlink=2)

    async def lookup(self, name: bytes, ctx=None) -> Node:
        text = name.decode("ascii", "replace")
        if not text.isdigit() or text != str(int(text)):
            raise NotFound(f"not a position: {text!r}")
        meta = self.bank.at(int(text))
        entries = self.fs.inodes.intern(("entries", self.bank.ns_id), lambda: EntriesDir(self.fs, self.bank))
        return await entries.lookup(meta.key, ctx)  # as entries/KEY (a writer's retry: its own inode)


class BufferDir(RingDir):
    """buffers/NAME/: config.json, stats.json, priorities, entries/, sample/, batch/, client."""

    def __init__(self, fs: "Filesystem", buf: Buffer) -> None:
        super().__init__(fs, buf)
        intern = fs.inodes.intern
        ns = buf.ns_id
        self.entries.update({
            b"priorities": lambda: intern(("priorities", ns), lambda: PrioritiesFile(fs, buf)),
            b"sample": lambda: intern(("sample", ns), lambda: DrawDir(fs, buf, npz=False)),
            b"batch": lambda: intern(("batch", ns), lambda: DrawDir(fs, buf, npz=True)),
            b"client": lambda: intern(("client", ns), lambda: ClientFile(fs, buf)),
        })
        self._sessions = itertools.count(1)

    async def lookup(self, name: bytes, ctx=None) -> Node:
        if name != b"client" or ctx is None:
            return await super().lookup(name, ctx)
        # Every session gets an inode of its own: the kernel lets one write at a time into
        # an inode, and a session's request may wait (min_size_to_sample, the rate
        # limiter): on a shared inode it would hold back every other session of the
        # buffer, the very learner or actor it waits for among them.
        key = ("client", self.ns.ns_id, ctx.pid)
        node = self.fs.inodes.intern(key, lambda: ClientFile(self.fs, self.ns))
        if node.open_handles:
            node = self.fs.inodes.intern(key + (next(self._sessions),), lambda: ClientFile(self.fs, self.ns))
        return node


class BufferControlFile(Node):
    """A buffer's file of size 0 whose reads and writes are requests (priorities, client):
    the kernel keeps its name and attributes (a chmod of the buffer invalidates them), and
    a truncation (`>`, O_TRUNC) truncates nothing."""

    def __init__(self, fs: "Filesystem", buf: Buffer) -> None:
        super().__init__(fs)
        self.buf = buf

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.buf.owner
        return make_attrs(self.ino, stat.S_IFREG | (o.mode & 0o644), 0, o.uid, o.gid, self.buf.ctime_ns, DIR_LONG)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        if fields.update_size:
            return
        await super().setattr(attr, fields, handle, ctx)


class PrioritiesFile(BufferControlFile):
    """priorities: a read renders them, a write updates them."""

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        # They change only with the buffer's owner (BufferDir.setattr forgets them first).
        # A learner's every `open(priorities, "w")` drops them in the kernel (O_TRUNC) and
        # Python's open() stats the file: that GETATTR is answered by the library's thread.
        interpose.hold_attributes(self.ino)
        # And that open itself: a write-only open only makes a PrioritiesWriter (the kernel
        # checks permissions), made at the handle's first WRITE instead. With the store's
        # priority write-ahead file, the front takes that WRITE too (whole, well-formed
        # lines): appended there first, committed by Python a moment later, so the close
        # waits for nothing (mount/interpose.py priority_log). Not for a buffer shared by
        # several nodes, whose updates go through the cluster's log.
        shared = self.buf.ring.shared is not None
        interpose.answer_opens(self.ino, os.O_WRONLY,
                               priorities_of=self.buf.ns_id if self.fs.priority_log_on and not shared else 0)
        return super().attributes(ctx)

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            return PrioritiesWriter(self.buf)
        return BytesReader(await self.buf.priorities_text(), cacheable=False)


class ClientFile(BufferControlFile):
    """client: the channel of the client beside the mount (distorefs/client); each open
    (for reading and writing) is a session of its own (distorefs/clientsession.py), on an
    inode of its own (BufferDir.lookup), so the kernel looks the name up at every open."""

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.buf.owner
        return make_attrs(self.ino, stat.S_IFREG | (o.mode & 0o644), 0, o.uid, o.gid, self.buf.ctime_ns, NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        if not (wants_read(flags) and wants_write(flags)):
            raise InvalidArgument("the client file is opened for reading and writing")
        owner = Owner(stat.S_IFREG | (0o666 & ~ctx.umask), ctx.uid, ctx.gid)
        # the session's waits end when the opener's process goes (any of its threads may ask)
        return ClientHandle(self.fs.store.client_session(self.buf, owner, abandoned_by(process_of(ctx.pid))))


class DrawDir(Node):
    """sample/ or batch/: every name N (or N.npz) is a file that draws a batch when opened.
    Each process gets an inode of its own for a name (see DrawFile). A process that opens
    the name while its inode is still open elsewhere gets another one: one inode never has
    two batches open, so its page cache (each open starts it empty) only ever holds the
    batch being read.

    The kernel keeps one inode per name, whoever asks. While one process alone opens a name
    (a learner's loop), the kernel keeps the name and its opens need no LOOKUP; an open
    that reaches another process's inode, or one with a batch open, is refused with ESTALE
    (DrawFile.open), and the kernel's retry looks the name up again. Once a second process
    asks for the name, it is not kept for CONTENDED_S: each open looks it up, as each would
    otherwise pay a refused OPEN and two LOOKUPs whenever the processes take turns."""

    CONTENDED_S = 10.0

    def __init__(self, fs: "Filesystem", buf: Buffer, npz: bool) -> None:
        super().__init__(fs)
        self.buf = buf
        self.npz = npz
        self._spare = itertools.count(1)
        self._last_asker: dict[int, int] = {}  # N -> the process that looked it up last
        self._contended_until: dict[int, float] = {}  # N -> monotonic time
        self._large: dict[tuple[int, int], backing.LargeBatches] = {}  # (N, pid) -> its stream

    def name_timeout(self, child: Node) -> float | None:
        n = getattr(child, "n", None)
        return DIR_LONG if time.monotonic() >= self._contended_until.get(n, 0.0) else NO_CACHE  # type: ignore[arg-type]

    def _note_asker(self, n: int, pid: int) -> None:
        if self._last_asker.get(n, pid) != pid:
            self._contended_until[n] = time.monotonic() + self.CONTENDED_S
        self._last_asker[n] = pid

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.buf.owner
        return make_attrs(self.ino, stat.S_IFDIR | (o.mode & 0o555), 0, o.uid, o.gid, self.buf.ctime_ns, DIR_LONG,
                          nlink=2)

    async def lookup(self, name: bytes, ctx=None) -> Node:
        text = name.decode("ascii", "replace")
        if self.npz:
            if not text.endswith(".npz"):
                raise NotFound(f"batch files are named N.npz, got {text!r}")
            text = text[:-4]
        if not text.isdigit() or text != str(int(text)):
            raise NotFound(f"not a batch size: {text!r}")
        n = int(text)
        self.buf.check_batch_size(n)
        kind = "batchfile" if self.npz else "samplefile"
        pid = ctx.pid if ctx is not None else 0
        self._note_asker(n, pid)
        node = self.fs.inodes.intern((kind, self.buf.ns_id, n, pid),
                                     lambda: DrawFile(self.fs, self.buf, n, self.npz, pid, self))
        if node.open_handles:  # its batch is still being read: this open gets an inode of its own
            node = self.fs.inodes.intern((kind, self.buf.ns_id, n, pid, next(self._spare)),
                                         lambda: DrawFile(self.fs, self.buf, n, self.npz, pid, self))
        return node

    def large_batches(self, n: int, pid: int) -> "backing.LargeBatches":
        """Process `pid`'s stream of large batch files of `n` (every inode of the
        process's for the name shares it: a lookup that comes before the RELEASE of its
        last batch gets a spare inode)."""
        large = self._large.get((n, pid))
        if large is None:
            assert self.fs.pusher is not None  # (DrawFile.large_batches asks only with one)
            # (not when its inodes are forgotten: the kernel forgets a process's inode as
            # soon as a lookup gave it a spare one, and the stream is the process's)
            for key in [k for k in self._large if not os.path.exists(f"/proc/{k[1]}")]:
                self._large.pop(key).close()  # the process is gone
            large = self._large[(n, pid)] = backing.LargeBatches(self.buf, n, self.fs.pusher)
            while len(self._large) > LARGE_STREAMS:  # the oldest process's goes
                self._large.pop(next(iter(self._large))).close()
        return large


class DrawFile(Node):
    """sample/N or batch/N.npz. Each open has its own content, so its size differs per open:
    the size reported is that of the batch opened last on this inode (zipfile, and so
    np.load, seeks to the end to find the npz directory).

    The kernel keeps one size per inode and trusts it for the rest of the jiffy in which it
    got it, whoever asked: with one inode shared by all processes, a SEEK_END right after
    another process's GETATTR used that process's size (BadZipFile under concurrent np.load).
    So every process (FUSE passes the thread's pid) gets its own inode, opened by it alone
    (DrawDir), and whoever asks for the inode's attributes - another process's path walk
    through a name the kernel kept, say - gets the size of that process's open batch. An
    open drops the inode's attributes so the SEEK_END that follows asks for the new batch's
    size, unless the kernel holds that size already: a buffer's batches of N entries of one
    layout are all one size, and a learner's np.load then costs no GETATTR.

    When a batch/N.npz closes, the next batch built ahead of that size is set aside for
    this inode (Buffer.reserve_ahead) and put into its page cache, and the library's front
    answers the next open by this inode's thread itself (interpose.answer_opens, `once`):
    a learner's loop then sends Python no request for its batches. Python counts the draw
    and makes the handle when it takes the front's notes (`opened_by_front`)."""

    def __init__(self, fs: "Filesystem", buf: Buffer, n: int, npz: bool, pid: int = 0,
                 directory: "DrawDir | None" = None) -> None:
        super().__init__(fs)
        self.buf = buf
        self.n = n
        self.npz = npz
        self.pid = pid
        self.directory = directory
        self.size = 0  # of the batch opened last
        # the size in this inode's last attributes reply, or given to the front for the next
        self.kernel_size: int | None = None
        self.ahead: Reservation | None = None  # the batch in the page cache for the front's next open
        # A batch/N.npz closed sets the next one aside (released): at once, while the learner
        # trains, also for a batch Python opened (without the wake-up, the next open came
        # first and reached Python too, and so on: a learner off the front's path stayed off)
        self.release_wakes = npz

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        self.kernel_size = self.size  # every caller replies with them (LOOKUP, GETATTR)
        if self.size >= PASSTHROUGH_MIN:
            # The kernel asks for them after every read of a passed-through file (the reads
            # mark its atime stale) and the reader's fstat waits: the library's front answers,
            # until a batch of another size drops them (_new_size).
            interpose.hold_attributes(self.ino)
        return self._attrs()

    def _attrs(self) -> pyfuse3.EntryAttributes:
        o = self.buf.owner
        # Cached until an open of another size drops them (below): np.load's stat and seeks
        # cost one GETATTR per batch at most, not one each.
        return make_attrs(self.ino, stat.S_IFREG | (o.mode & 0o444), self.size, o.uid, o.gid, self.buf.ctime_ns,
                          DIR_LONG)

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            raise NotPermitted("sample files are read-only")
        if ctx.pid != self.pid or self.open_handles:
            # reached through a name the kernel kept (DrawDir): the retry looks it up again
            raise Stale(f"{self.n}: the inode of another process or of an open batch")
        reservation, self.ahead = self.ahead, None
        if reservation is not None:
            interpose.forget_attributes(self.ino)  # the front answers no open of it now: this one is ours
            if not reservation.void:  # what the page cache holds already
                return self._hand_out(reservation)
        # (the stream of a process whose batches of this size were large: `size`, the last's)
        large = self.large_batches() if self.size >= PASSTHROUGH_MIN else None
        ready = await large.take() if large is not None else None
        if large is not None and ready is not None:  # the next large batch, written ahead into a memfd
            reservation, memfd, backing_id = ready
            handle = SampleReader(self.buf, self.buf.take_ahead(reservation), reservation.file)
            handle.back(memfd, backing_id)
            self._new_size(handle.size)
            large.prepare_soon(self.buf.spawn)
            return handle
        nonblocking = bool(flags & os.O_NONBLOCK)
        abandoned = abandoned_by(ctx.pid)  # the wait for min_size_to_sample ends if the caller does
        if self.npz:
            batch, content = await self.buf.sample_npz(self.n, nonblocking, abandoned)
        else:
            batch = await self.buf.sample(self.n, nonblocking, abandoned)
            content = BatchFile([Blob(batch.manifest())])
        self.size = content.size
        handle = SampleReader(self.buf, batch, content)
        pusher = self.fs.pusher
        if content.size <= len(SampleReader.scratch) and not self.open_handles and pusher is not None:
            # A small batch (a learner's batch of transitions) goes into the page cache
            # whole before OPEN is answered: its reads need no READ request. The pages stay
            # only if the size the kernel learns next is the one it has (it drops them all
            # on a size change, and the READs then come as before).
            handle.keep_cache = pusher.store_at_open(self.ino, content.read(0, content.size, SampleReader.scratch))
        elif content.size >= PASSTHROUGH_MIN and (large := self.large_batches()) is not None:
            # A large batch file (a learner's batch of frames): the kernel reads it from a
            # memfd itself, not through this inode's page cache, which an open drops and
            # read-ahead fills again page by page for every batch (READs from Python); and
            # the next batch is written into another memfd while this one is read.
            written = await large.write(content)
            if written is not None:
                handle.back(*written)
            large.prepare_soon(self.buf.spawn)
        self._new_size(content.size)
        return handle

    def _new_size(self, size: int) -> None:
        """The batch opened now is `size` bytes: if the kernel holds another size, it is
        made to ask again (while this OPEN is pending: the next stat or seek asks), and the
        front is given the new attributes to answer with (if its table has no room, it
        forgets the ones it held and Python answers)."""
        self.size = size
        # The stat or seek that follows this OPEN asks for them where the size changed (a
        # `sample/N`'s changes with the digits of its lines), or a READ of the batch before
        # marked the atime stale: the front answers it, not a trip through Python per draw.
        given = interpose.give_attributes(self._attrs(), once=True)
        if size != self.kernel_size:
            drop_attributes(self.ino)
            if given:
                self.kernel_size = size
            else:
                interpose.forget_attributes(self.ino)

    def large_batches(self) -> "backing.LargeBatches | None":
        """This process's stream of large batch files of this size (None: passthrough
        off, or not a batch/N.npz)."""
        if not self.npz or self.directory is None or self.fs.pusher is None or not interpose.passthrough():
            return None
        return self.directory.large_batches(self.n, self.pid)

    def recycle_memfd(self, memfd: "backing.Memfd") -> None:
        """(SampleReader.release) The memfd of a batch read on this inode."""
        large = self.large_batches()
        if large is not None:
            large.recycle(memfd)
        else:
            memfd.close()

    def released(self, handle: Handle) -> None:
        if self.npz and not self.open_handles and isinstance(handle, SampleReader):
            self._set_next_aside()

    def _set_next_aside(self) -> None:
        """The next batch built ahead goes into this inode's page cache now, while its
        learner trains, and the front is told to answer this thread's next open. Made on
        the event loop, no handle open: no READ of the inode can be in flight."""
        pusher = self.fs.pusher
        if self.ahead is not None or pusher is None or self.kernel_size is None or not interpose.front()[0]:
            return
        reservation = self.buf.reserve_ahead(self.n, functools.partial(interpose.forget_attributes, self.ino))
        if reservation is None:
            return
        content = reservation.file
        # Another size than the kernel holds (a store past it would change the size, other
        # sizes drop the pages), or no room in the front's tables: the open is Python's.
        if (content.size != self.kernel_size or content.size > len(SampleReader.scratch)
                or not pusher.store_at_open(self.ino, content.read(0, content.size, SampleReader.scratch))
                or not interpose.answer_opens(self.ino, os.O_RDONLY, keep_cache=True, noflush=True, once=True,
                                              adopted=True, pid=self.pid)):
            self.buf.put_back(reservation)
        else:
            self.ahead = reservation
        # The batch after it is drawn and built with the page cache and the front's mark set
        # already: the learner's next open waits for none of it. Between requests, now; in a
        # request's handler (the learner's next open came first, and waits), after its reply.
        self.buf.refill(self.n, now=BETWEEN_REQUESTS.get())

    def opened_by_front(self) -> Handle | None:
        reservation, self.ahead = self.ahead, None
        if reservation is None:
            return None  # (no mark is left without its batch: forget_attributes drops both)
        # Void since is fine: the open came first (a void drops the mark under the front's lock).
        return self._hand_out(reservation)

    def _hand_out(self, reservation: Reservation) -> "SampleReader":
        """The handle of the batch set aside, counted as drawn now; its file is in the page cache."""
        handle = SampleReader(self.buf, self.buf.take_ahead(reservation), reservation.file)
        handle.keep_cache = True
        return handle


class EntriesDir(Node):
    """entries/: one file per entry, listed in FIFO order (readdir offsets are sequence numbers).

    Each name resolves to an inode of its entry's committed version (`EntryNode`); a writer
    of an existing entry gets a private inode of its own, which becomes the name's version
    when its write commits."""

    def __init__(self, fs: "Filesystem", buf: Buffer) -> None:
        super().__init__(fs)
        self.buf = buf
        self._private = itertools.count()
        # Whether the front holds this directory's names (interpose.absent_names), asked at
        # its first lookup or create (its inode number is known then): the ring's keys,
        # kept by the ring's watcher, and one count per writer of an inode made here (a
        # create's is found by name before it commits), so that the front answers the
        # LOOKUP the kernel sends before each create of a new entry.
        self.names_held: bool | None = None
        self.creates_answered = False  # the front answers creates of new entries here

    def _holding_names(self) -> bool:
        """Whether the front holds this directory's names (handed over at the first ask)."""
        if self.names_held is None:
            self.names_held = interpose.absent_names(self.ino, self.buf.ring.by_key)
            if self.names_held:
                self.buf.ring.watch_names(self._name_changed)
                self.answer_creates()
        return self.names_held

    def _creates_wanted(self) -> bool:
        """Whether a new entry's create may be the front's: nothing to decide but its inode
        (no rate limiter to wait for, a store that takes inserts)."""
        limiter = getattr(self.buf, "limiter", None)
        return bool(self.names_held) and not self.fs.store.read_only and not (limiter is not None and limiter.enabled)

    def answer_creates(self) -> None:
        """Let the front answer the creates of new entries here, or no longer (as the buffer's
        configuration says now; mount/interpose.py answer_creates)."""
        wanted = self._creates_wanted()
        if wanted or self.creates_answered:
            self.creates_answered = interpose.answer_creates(self.ino, wanted, self.buf.ring.config.max_entry_bytes,
                                                            self.fs.store.config.entry_timeout)
            if self.creates_answered:
                self.fs.fill_create_inodes()

    def front_created(self, name: bytes, ino: int, flags: int, owner: Owner,
                      pid: int) -> tuple["EntryNode", EntryWriter]:
        """The inode (numbered `ino`) and the writer of a create the front answered: as
        `create` makes them, but the front counted the name held and collects the writer's
        WRITEs already. The front answered only for a name it did not hold: a new entry,
        unless a commit that no create here announced (a client's, another node's) took the
        name meanwhile; then, as when a create loses that race in Python, the writer's close
        rewrites it (O_EXCL could not refuse it any more). Never waits: every create the
        front answered is made before Python's next request (a buffer given a rate limiter
        by another node meanwhile admits this writer at its close instead)."""
        self.fs.take_redirect(self.name_key(name), pid)
        admit = None
        existing = self.buf.ring.by_key.get(name)
        if existing is not None or self._being_created(name) is not None:
            # the name is another's now: the kernel has this create's inode, so it is a private one
            node = self.fs.inodes.intern(self.private_key(name),
                                         lambda: EntryNode(self.fs, self, name, None, base=existing), number=ino)
            node.private = True
        else:
            if not self._creates_wanted():  # the configuration changed on another node: Python's from now on
                self.answer_creates()
                if isinstance(self.buf, Buffer) and self.buf.limiter.enabled:
                    admit = functools.partial(self.buf.admit_insert, False, abandoned_by(process_of(pid)))
            self.fs.inodes.unname(self.name_key(name))
            node = self.fs.inodes.intern(self.name_key(name), lambda: EntryNode(self.fs, self, name, None),
                                         number=ino)
        writer = node.writer(b"", flags, owner, admit=admit, named=True)
        writer.collecting = True
        return node, writer

    def _being_created(self, name: bytes) -> "EntryNode | None":
        """The inode writers are creating `name` through (found by the name before their
        first commit), if any."""
        node = self.fs.inodes.node_of(self.name_key(name))
        return node if node is not None and node.version is None and node.writers else None

    def _name_changed(self, key: bytes, present: bool) -> None:
        interpose.name_counted(self.ino, key, present)

    def writer_named(self, name: bytes) -> bool:
        """A writer of an inode named `name` here began: the front holds the name while it
        writes (its create's inode is found by that name before it commits). True: counted,
        to be given back with `writer_unnamed` when it ends."""
        if not self._holding_names():
            return False
        interpose.name_counted(self.ino, name, True)
        return True

    def writer_unnamed(self, name: bytes) -> None:
        interpose.name_counted(self.ino, name, False)

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        # They change only with the namespace's owner (RingDir.setattr forgets them first).
        # Every insert drops them in the kernel (a create in a directory does) and the next
        # one's path walk asks again: that GETATTR is answered by the library's thread.
        interpose.hold_attributes(self.ino)
        o = self.buf.owner
        return make_attrs(self.ino, stat.S_IFDIR | (o.mode & 0o7777), 0, o.uid, o.gid, self.buf.ctime_ns,
                          DIR_LONG, nlink=2)

    def name_key(self, name: bytes) -> tuple:
        """The inode-table key of the version `name` resolves to."""
        return ("entry", self.buf.ns_id, name)

    def entry_node(self, meta: EntryMeta) -> "EntryNode":
        """The inode of the entry's current version (made when first asked for)."""
        node = self.fs.inodes.node_of(self.name_key(meta.key))
        if node is not None and node.version is not None and node.version.same_content(meta):
            return node
        if node is not None:
            self.fs.inodes.unname(self.name_key(meta.key))  # an older version, or a create that lost a race
        return self.fs.inodes.intern(self.name_key(meta.key), lambda: EntryNode(self.fs, self, meta.key, meta))

    def private_key(self, name: bytes) -> tuple:
        """A fresh inode-table key for a writer's own inode of `name`."""
        return ("entrywriter", self.buf.ns_id, name, next(self._private))

    def private_node(self, name: bytes, base: EntryMeta | None) -> "EntryNode":
        """A writer's own inode for `name` (rewriting `base`, or creating it anew)."""
        node = self.fs.inodes.intern(self.private_key(name), lambda: EntryNode(self.fs, self, name, None, base=base))
        node.private = True
        return node

    async def lookup(self, name: bytes, ctx=None) -> Node:
        check_name(name)
        self._holding_names()
        pid = ctx.pid if ctx is not None else 0
        meta = self.buf.ring.by_key.get(name)
        if self.fs.redirected(self.name_key(name), pid):
            # the retry of a writer refused on a shared inode. If the name is gone meanwhile,
            # an O_CREAT creates it (the redirect holds should it be back at the retry's next
            # lookup); never through the inode of another writer's create, which may commit
            # (and readers share it) before this retry's open: create() decides at once.
            if meta is None:
                raise NotFound(f"no entry {name!r}")
            return self.private_node(name, meta)
        node = self._being_created(name)
        if node is not None:
            return node  # being created by a writer (other openers get ENOENT)
        if meta is None:
            raise NotFound(f"no entry {name!r}")  # pending entries of other writers stay invisible
        return self.entry_node(meta)

    def children(self, start: int):
        for meta in self.buf.ring.iter_from(start):
            yield meta.key, self.entry_node(meta), meta.seq + 1

    async def create(self, name: bytes, mode: int, flags: int, ctx) -> tuple[Node, Handle]:
        self.buf.ring.check_insert(name, 0)
        self.fs.take_redirect(self.name_key(name), ctx.pid)
        existing = self.buf.ring.by_key.get(name)
        ticket, admit = None, None
        if existing is not None:
            if flags & os.O_EXCL:
                raise AlreadyExists(f"entry {name!r} exists")
            node = self.private_node(name, existing)  # committed meanwhile: a rewrite
        else:
            creating = self._being_created(name)
            if creating is not None:
                node = creating  # another writer's create: this one's close rewrites it
            else:  # a new entry
                ticket, admit = await self._admission(flags, ctx)
                self.fs.inodes.unname(self.name_key(name))
                node = self.fs.inodes.intern(self.name_key(name), lambda: EntryNode(self.fs, self, name, None))
        owner = Owner(stat.S_IFREG | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)
        return node, node.writer(b"", flags, owner, ticket=ticket, admit=admit)

    async def _admission(self, flags: int, ctx
                         ) -> tuple[InsertTicket | None, Callable[[], Awaitable[InsertTicket | None]] | None]:
        """A new entry and the rate limiter (distorefs/ratelimit.py): its ticket, or how its
        writer waits for one. The create itself never waits - the kernel holds entries/
        locked through it, so every create, lookup and ls there would wait too - but
        O_NONBLOCK gets EAGAIN here; a writer held back waits at its first write() or close()
        instead, before any of its data is taken."""
        if not isinstance(self.buf, Buffer):
            return None, None  # a bank: no limiter
        if flags & os.O_NONBLOCK or not self.buf.insert_held_back():
            return await self.buf.admit_insert(nonblocking=True), None
        abandoned = abandoned_by(process_of(ctx.pid))  # any thread of the creator may write
        return None, functools.partial(self.buf.admit_insert, False, abandoned)

    async def unlink(self, name: bytes) -> None:
        await self.buf.ring.delete(name)

    async def rename(self, old: bytes, new_parent: Node, new: bytes, flags: int) -> None:
        if new_parent is not self:
            raise CrossDevice("entries move between buffers by copy")
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_EXCHANGE is not supported for entries")
        if flags & pyfuse3.RENAME_NOREPLACE and new in self.buf.ring.by_key:
            raise AlreadyExists(f"entry {new!r} exists")
        await self.buf.ring.rename(old, new)


class EntryNode(Node):
    """entries/KEY as one committed version (`version`): its content never changes, so the
    kernel may keep its pages (keep_cache) and attributes; a rewrite commits as a new
    inode and this one only loses its name, readers of it reading on. Before its first
    commit (a create, or a writer's private inode) `version` is None and the writer's
    staged bytes are what it holds."""

    private = False  # a writer's own inode: its name is not cached by the kernel
    pages_stored = False  # the version's bytes were put into the kernel's page cache once
    # Several writers wrote through it at once: its pages hold their writes interleaved,
    # so no version of theirs is read through it (each gets an inode of its own).
    cowritten = False

    def __init__(self, fs: "Filesystem", parent: EntriesDir, key: bytes, version: EntryMeta | None,
                 base: EntryMeta | None = None) -> None:
        super().__init__(fs)
        self.parent = parent
        self.name = key
        self.buf = parent.buf
        self.version = version
        self.base = base  # the version a private writer's inode rewrites
        self.writers: list[EntryWriter] = []

    def current(self) -> bool:
        """Whether this version is the one the name has now."""
        return self.key is not None and self.version is not None and \
            self.version.same_content(self.buf.ring.by_key.get(self.name))

    def latest(self) -> EntryMeta | None:
        """The version's record as the ring has it now (its value may have moved between
        tiers since this inode was made), or the version as it was if it is not current."""
        meta = self.committed()
        if meta is not None and self.key is not None:
            now = self.buf.ring.by_key.get(self.name)
            if meta.same_content(now):
                self.version = meta = now
        return meta

    def committed(self) -> EntryMeta | None:
        """The version, adopting the one a writer's commit just made: that commit is
        applied before the writer's close resumes, and an open can come in between."""
        if self.version is None and self.key is not None and not self.private and not self.writers:
            self.version = self.buf.ring.by_key.get(self.name)
        return self.version

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        timeout = self.fs.store.config.entry_timeout
        if self.writers:
            w = self.writers[-1]
            o = w.owner
            # The kernel tracks the size of what it writes itself, and drops the size and
            # mtime it holds at each write: cached, these attributes answer the open's
            # permission check and the writer's fstat without a GETATTR each.
            return make_attrs(self.ino, o.mode, w.size(), o.uid, o.gid, time.time_ns(), timeout,
                              entry_timeout=NO_CACHE if self.private else timeout)
        if self.private and self.version is None:  # a writer's inode before its open: what it rewrites
            meta = self.base
            if meta is None:
                raise NotFound("entry is gone")
            return make_attrs(self.ino, meta.mode, meta.size, meta.uid, meta.gid, meta.mtime_ns, NO_CACHE)
        meta = self.committed()
        if meta is None:
            raise NotFound("entry is gone")
        nlink = 1 if self.current() else 0
        return make_attrs(self.ino, meta.mode, meta.size, meta.uid, meta.gid, meta.mtime_ns, timeout, nlink=nlink)

    def writer(self, initial: bytes, flags: int, owner: Owner, fresh: bool = True,
               ticket: InsertTicket | None = None,
               admit: Callable[[], Awaitable[InsertTicket | None]] | None = None,
               named: bool = False) -> EntryWriter:
        """A writer of this inode; a new entry's has the rate limiter's `ticket`, or `admit`
        to wait for one at its first write() or close(). `named`: the front counted the
        name held for it already (a create it answered)."""
        w = EntryWriter(self, initial, self.buf.ring.config.max_entry_bytes, wants_read(flags), owner, fresh,
                        ticket, admit)
        if self.writers:
            self.cowritten = True
        self.writers.append(w)
        w.named = named or self.parent.writer_named(self.name)
        return w

    async def commit(self, data: bytes, owner: Owner) -> None:
        """A writer of this inode closed: its bytes become the entry's next version, and
        this inode the one its name resolves to (unless another inode took the name since,
        or several writers wrote through this one)."""
        current = self.buf.ring.by_key.get(self.name)
        if current is not None:  # a rewrite keeps the entry's owner and mode
            owner = Owner(current.mode, current.uid, current.gid)
        # else: evicted or removed while a writer held it. A writer's close stores what it
        # wrote under the name whatever happened to the name meanwhile (evicted, removed, or
        # another writer's close first: the last close wins), as a queue of values would.
        meta = await self.buf.insert(self.name, data, owner)
        if self.cowritten:
            # Writers that created the name together share this inode: its pages and size are
            # all of theirs (and the others may write on). The version gets an inode of its
            # own, made at the name's next lookup; this one stays the writers'.
            self._leave_name()
            self.base = meta
            drop_attributes(self.ino)
            return
        self.version, self.base = meta, None
        # The kernel holds the writer's attributes (see attributes): the version's mtime
        # replaces them now, before an open pushes its pages (a later mtime change would
        # drop those pages again).
        drop_attributes(self.ino)
        if self.private and self.key is not None:  # the rewrite is the name's version now
            self.fs.inodes.rekey(self.key, self.parent.name_key(self.name))

    def _leave_name(self) -> None:
        """Become a writers' private inode: the kernel's cached name goes, and the name's next
        lookup resolves to the committed version."""
        if self.private:
            return
        self.private = True
        if self.key is not None:
            self.fs.inodes.rekey(self.key, self.parent.private_key(self.name))
            if self.fs.invalidator is not None:
                self.fs.invalidator.entry(self.parent.ino, self.name)

    def writer_closed(self, w: EntryWriter) -> None:
        if w in self.writers:
            self.writers.remove(w)
            if w.named:
                self.parent.writer_unnamed(self.name)

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            pid = ctx.pid if ctx is not None else 0
            if self.version is None and (self.writers or self.base is None):
                # a create's inode, not committed yet (a committed one, even with its writer
                # not released yet, is a version readers share: below)
                self.fs.take_redirect(self.parent.name_key(self.name), pid)
                return self.writer(b"", flags, self.writers[-1].owner if self.writers else
                                   Owner(0o100644, ctx.uid, ctx.gid), bool(flags & os.O_TRUNC))
            redirected = self.fs.take_redirect(self.parent.name_key(self.name), pid)
            if not (redirected and self.private and self.version is None):
                # never write into (or truncate) an inode readers may share: the name's version,
                # an older one, or one its writers left (each reached through a name the kernel
                # still holds). Only the inode this process's redirect gave it is its own: the
                # retry gets it (or creates the entry if it is gone).
                self.fs.redirect_writer(self.parent.name_key(self.name), pid)
            base = self.base
            if base is None:
                raise NotFound("no such entry (not committed yet, or removed)")
            initial = b"" if flags & os.O_TRUNC else await self.buf.ring.read(base)
            return self.writer(initial, flags, Owner(base.mode, base.uid, base.gid), bool(flags & os.O_TRUNC))
        if self.private and self.key is not None:
            # the retry of a reader sent here (a version rewritten since its lookup): its open
            # ends the redirect, as a writer's does, so that this process's next lookup of
            # the name (a truncate(path) right after, say) resolves as everyone's does
            self.fs.take_redirect(self.parent.name_key(self.name), ctx.pid if ctx is not None else 0)
        meta = self.latest()
        if meta is None and self.private and not self.writers:
            # a writer's inode before its open (the lookup of a redirected process that then
            # opened for reading): the version it was looked up as, which its attributes gave
            meta = self.base
        if meta is None:
            raise NotFound("no such entry (not committed yet, or removed)")
        # The version's bytes are taken now (a snapshot: an eviction or rewrite after the
        # open cannot take them away); the kernel keeps the pages it reads for later opens.
        try:
            reader = BytesReader(await self.buf.ring.read(meta, follow_rewrites=False), cacheable=True)
        except NotFound:
            now = self.buf.ring.by_key.get(self.name)
            if now is not None and not meta.same_content(now) and not self.private:
                # Rewritten since the kernel looked this name up (its invalidation of that
                # name may not have landed yet). The kernel looks it up again, and the
                # redirect gives its retry an inode of its own holding the version the name
                # has then (rewritten once more before that retry's open: ENOENT, not a
                # second ESTALE, which would reach the program).
                self.fs.redirect_writer(self.parent.name_key(self.name), ctx.pid if ctx is not None else 0)
            raise
        pusher = self.fs.pusher
        if not (self.pages_stored or self.open_handles or self.private or self.writers or pusher is None):
            # into the page cache before OPEN is answered: the reads of this open, and of
            # later ones while the kernel keeps the pages, need no READ
            self.pages_stored = pusher.store_at_open(self.ino, reader.data)
        return reader

    async def setattr(self, attr, fields, handle, ctx) -> None:
        if fields.update_size:
            if isinstance(handle, EntryWriter):
                handle.truncate(attr.st_size)
            elif self.writers:
                self.writers[-1].truncate(attr.st_size)
            else:
                meta = self.latest()
                if meta is None or not self.current():
                    raise NotFound("entry is gone")
                value = await self.buf.ring.read(meta)
                size = attr.st_size
                self.buf.ring.check_insert(self.name, size)
                data = value[:size] + bytes(max(0, size - len(value)))
                await self.buf.insert(self.name, data, Owner(meta.mode, meta.uid, meta.gid))
        mode = stat.S_IFREG | (attr.st_mode & 0o7777) if fields.update_mode else None
        uid = attr.st_uid if fields.update_uid else None
        gid = attr.st_gid if fields.update_gid else None
        mtime = attr.st_mtime_ns if fields.update_mtime else None
        if mode is None and uid is None and gid is None and mtime is None:
            return
        if self.version is None or self.writers:
            for w in self.writers:  # not committed yet: the attributes go in with the commit
                w.take_collected()  # (the front answers GETATTR with the owner it was given)
                o = w.owner
                w.owner = Owner(o.mode if mode is None else mode, o.uid if uid is None else uid,
                                o.gid if gid is None else gid)
            if self.version is None:
                return
        await self.buf.ring.set_attrs(self.name, mode=mode, uid=uid, gid=gid, mtime_ns=mtime)

    async def read_xattrs(self) -> dict[bytes, bytes]:
        if isinstance(self.buf, Buffer):
            await self.buf.settled()  # a priorities close is answered as it commits, just before it applies
        return self.xattrs()

    def xattrs(self) -> dict[bytes, bytes]:
        meta = self.latest()
        if meta is None:
            return {}
        attrs = {
            b"seq": b"%d" % meta.seq,
            b"tier": meta.value.tier_name.encode(),
            b"size": b"%d" % meta.size,
            b"stored_size": b"%d" % meta.stored_size,
            b"compression": meta.value.codec_name.encode(),
            b"checksum": b"crc32:%08x" % meta.checksum,
        }
        if isinstance(self.buf, Buffer) and self.current():
            s = self.buf.sampler
            attrs[b"priority"] = priority_text(s.priority[meta.slot])  # reads back exactly
            attrs[b"times_sampled"] = b"%d" % s.times[meta.slot]
        return attrs

    async def warm(self) -> bytes | None:
        meta = self.latest()
        if meta is None:
            raise NotFound("entry is gone")
        return (await self.buf.ring.warm(meta)).text()

    async def setxattr(self, name: bytes, value: bytes, ctx=None) -> None:
        if name not in (b"priority", b"times_sampled") or not isinstance(self.buf, Buffer):
            await super().setxattr(name, value, ctx)
        if name == b"times_sampled":
            # a restore's (distorefs import): the count is the sampler's accounting, so only
            # the buffer's owner (or root) may set it, not whoever may write the entry
            if ctx is not None and ctx.uid not in (0, self.buf.owner.uid):
                raise OperationNotPermitted("only the buffer's owner sets times_sampled")
            text = value.strip()
            if not text.isdigit():
                raise InvalidArgument(f"times_sampled must be a whole number, got {value[:40]!r}")
            await self.buf.set_times_sampled(self.name, int(text))
            return
        try:
            priority = float(value.strip())
        except ValueError:
            raise InvalidArgument(f"priority must be a number, got {value[:40]!r}") from None
        await self.buf.set_priorities([(self.name, priority)], strict=True)


def build_tree(fs: "Filesystem") -> StaticDir:
    """The fixed part of the tree; `buffers/` and `banks/` grow below it."""
    from .inodes import ROOT_INODE
    store = fs.store
    from .control import CallerStatsFile
    ctl = StaticDir(fs, {
        b"stats.json": CallerStatsFile(fs, lambda stats: _json(stats)),
        b"config.json": RenderedFile(fs, lambda: store.config.to_json()),
        b"version": RenderedFile(fs, lambda: f"distorefs {__version__}\n".encode()),
    })
    from distorefs.weights import ROOT_ID

    from .control import WaitFile
    from .weights_nodes import WeightsDir
    ctl.entries[b"wait"] = WaitFile(fs)
    # Added after `wait`: the enumeration below gives fixed inodes in this order.
    from distorefs.metrics import prometheus_text
    ctl.entries[b"metrics"] = CallerStatsFile(fs, lambda stats: prometheus_text(stats).encode())
    last_gc: dict = {}

    async def collect(_text: bytes) -> None:
        last_gc.clear()
        last_gc.update(await store.collect())

    # `gc`: any write collects at close (distorefs gc); reading shows what the last one freed.
    ctl.entries[b"gc"] = RenderedFile(fs, lambda: _json(last_gc), write=collect)
    buffers = NamespacesDir(fs, "buffers")
    banks = NamespacesDir(fs, "banks")
    weights = WeightsDir(fs, ROOT_ID)
    root = StaticDir(fs, {b".distorefs": ctl, b"buffers": buffers, b"banks": banks, b"weights": weights})
    fs.inodes.add_fixed(ROOT_INODE, ("root",), root)
    for i, (key, node) in enumerate([(("ctl",), ctl), (("buffers",), buffers), (("banks",), banks),
                                     (("wdir", ROOT_ID), weights)] +
                                    [(("ctl", name), n) for name, n in ctl.entries.items()], 2):
        fs.inodes.add_fixed(i, key, node)
    datasets = NamespacesDir(fs, "datasets")
    root.entries[b"datasets"] = datasets
    fs.inodes.add_fixed(900, ("datasets",), datasets)  # above the enumerated ones, below the dynamic
    from .checkpoint_nodes import checkpoints_root
    key, checkpoints = checkpoints_root(fs)
    root.entries[b"checkpoints"] = checkpoints
    fs.inodes.add_fixed(901, key, checkpoints)
    return root


__all__ = ["build_tree", "Node", "EntryNode", "EntriesDir", "XATTR_PREFIX", "WouldBlock"]

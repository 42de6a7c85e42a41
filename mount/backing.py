"""Memfds the kernel reads a handle's file from itself (FUSE passthrough, mount/interpose.py),
and the stream of large batch files one process draws, written into them ahead of its opens.

A large batch file (`batch/N.npz` of frames: tens of MB) is written into a memfd and
registered on the session as a backing file; the open is answered FOPEN_PASSTHROUGH with
its id, and the reader's reads are the kernel's, from the memfd's pages: no READ request,
and no page of the FUSE inode's, which an open without keep_cache drops and read-ahead
allocates again for every batch (most of what such a batch cost its reader beyond tmpfs).
A memfd is written over again for a later batch of the same inode rather than made anew:
its pages are allocated once (`LargeBatches` keeps one spare). The next batch is drawn
and written while the process reads the one before (`LargeBatches`): its open then waits
for nothing. The bytes a memfd holds count
against the transfer share of `memory_bytes` (the page-cache pusher's): past it, a batch
file is read through the FUSE inode as before. Everything here that is as large as the
file runs in a worker thread.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections import deque

import trio

from distorefs.batch import BatchFile
from distorefs.buffer import Buffer, Reservation

from . import interpose
from .notify import PageCachePusher

log = logging.getLogger(__name__)

IOV_MAX = 1024  # pieces one pwritev takes (Linux UIO_MAXIOV)
made = 0  # memfds made so far (the rest of the batch files written went into spare ones)


class Memfd:
    """A memfd holding a batch file; its bytes count against the pusher's share of
    `memory_bytes` (transfer: what the daemon holds for the kernel) while it is open."""

    def __init__(self, share: PageCachePusher) -> None:
        self.share = share
        self.fd = -1
        self.size = 0

    def fill(self, content: BatchFile) -> None:
        """(a worker thread) Hold `content` now (written over what it held). OSError: over
        the share, or the write failed (a memfd made for it is closed again)."""
        grow = content.size - self.size
        if grow > 0 and not self.share.take_bytes(grow):
            raise OSError(errno.ENOMEM, f"a batch file of {content.size} bytes is over the transfer share of "
                                        f"memory_bytes")
        try:
            self.fd = _write(content, self.fd)
        except BaseException:
            if grow > 0:
                self.share.give_bytes(grow)
            raise
        if grow < 0:  # (truncated to the new size: those pages are gone)
            self.share.give_bytes(-grow)
        self.size = content.size

    def close(self) -> None:
        """Close it in a worker thread (its pages are freed there, not on the event loop)."""
        if self.fd >= 0:
            trio.lowlevel.start_thread_soon(functools.partial(os.close, self.fd), _ignore)
            self.share.give_bytes(self.size)
            self.fd, self.size = -1, 0


def _write(content: BatchFile, fd: int) -> int:
    """`content` written into memfd `fd` (a new one if -1), sized to it; the memfd.
    OSError: nothing is kept (a new memfd is closed, a given one is the caller's)."""
    global made
    new = fd < 0
    if new:
        fd = os.memfd_create("distorefs-batch", os.MFD_CLOEXEC)
        made += 1
    try:
        os.ftruncate(fd, content.size)
        pieces: list = []
        content.gather_all(pieces)
        off = 0
        for i in range(0, len(pieces), IOV_MAX):
            chunk = pieces[i:i + IOV_MAX]
            want = sum(len(p) for p in chunk)
            done = os.pwritev(fd, chunk, off)
            if done != want:  # (tmpfs writes whole or fails: a short write would leave a hole)
                raise OSError(errno.EIO, f"a memfd write of {want} bytes wrote {done}")
            off += done
    except BaseException:
        if new:
            os.close(fd)
        raise
    return fd


def register(fd: int) -> int:
    """The backing-file id of memfd `fd` on the session (OSError: no passthrough, or the
    daemon lacks CAP_SYS_ADMIN)."""
    return interpose.backing_open(fd)


def unregister(backing_id: int) -> None:
    """The id goes; opens that were answered with it keep their file until they close."""
    try:
        interpose.backing_close(backing_id)
    except OSError:
        pass  # (gone with the session)


def _ignore(_outcome) -> None:
    """(the outcome of a thread nobody waits for)"""


AHEAD = 2  # batches a process's stream keeps written ahead of its opens
SPARE_MEMFDS = 1  # memfds a process's stream keeps for its next batches
PREPARE_WAIT_S = 1.0  # an open waits this long at most for its batch being written ahead (then draws its own)


class LargeBatches:
    """The large batch files of one batch size that one process draws (every inode the
    mount gives that process for the name: DrawDir): the next AHEAD batches, drawn ahead
    (Buffer.reserve_large, counted only when an open takes one), written into memfds and
    registered while the process reads the one before (two: a batch that took longer to
    write than its reader took to read the last one does not make the next open wait);
    and the memfds of batches read, kept to be written over."""

    def __init__(self, buf: Buffer, n: int, share: PageCachePusher) -> None:
        self.buf = buf
        self.n = n
        self.share = share
        self.ready: deque[tuple[Reservation, Memfd, int]] = deque()  # (reservation, memfd, backing id)
        self.preparing: trio.Event | None = None
        self.spare: list[Memfd] = []
        self.closed = False

    async def take(self) -> tuple[Reservation, Memfd, int] | None:
        """The batch written ahead for this open (waiting a little for one under way), if
        it still is what a draw would give; None: the open draws (and writes) its own."""
        if not self.ready and self.preparing is not None:
            with trio.move_on_after(PREPARE_WAIT_S):
                await self.preparing.wait()
        while self.ready:
            ready = self.ready.popleft()
            reservation, memfd, backing_id = ready
            if not reservation.void and reservation.ahead.current(self.buf):
                return ready
            self.buf.drop_reserved(reservation)
            unregister(backing_id)
            self.recycle(memfd)
        return None

    async def write(self, content: BatchFile) -> tuple[Memfd, int] | None:
        """`content` in a memfd (a spare one if there is one), registered: (memfd, backing
        id); None when it is not (over the memory share: read through the FUSE inode as
        before). A refused registration (no CAP_SYS_ADMIN, say) stops passthrough."""
        memfd = self.spare.pop() if self.spare else Memfd(self.share)
        try:
            await trio.to_thread.run_sync(memfd.fill, content)
        except OSError as exc:
            log.info("batch/%d.npz read through the FUSE inode: %s", self.n, exc)
            self.recycle(memfd)
            return None
        try:
            return memfd, register(memfd.fd)
        except OSError as exc:
            memfd.close()
            log.warning("batch files will not be passed through to the kernel: %s", exc)
            interpose.stop_passthrough()
            return None

    def prepare_soon(self, spawn) -> None:
        """Draw and write the next batches in the background (`spawn`: the store's
        nursery), for the process's next opens: it reads the one just opened meanwhile."""
        if self.preparing is None and len(self.ready) < AHEAD and not self.closed:
            self.preparing = trio.Event()
            spawn(self._prepare)

    async def _prepare(self) -> None:
        reservation = None
        try:
            while len(self.ready) < AHEAD and not self.closed:
                reservation = await self.buf.reserve_large(self.n)
                if reservation is None:
                    return
                written = await self.write(reservation.file)
                if written is None:
                    return
                if self.closed:
                    unregister(written[1])
                    written[0].close()
                    return
                self.ready.append((reservation, *written))
                reservation = None
                done, self.preparing = self.preparing, trio.Event()  # an open waiting takes this one
                if done is not None:
                    done.set()
        except Exception as exc:  # made ahead or not, an open still gets its batch
            log.info("batch/%d.npz not made ahead: %s", self.n, exc)
        finally:
            if reservation is not None:
                self.buf.drop_reserved(reservation)
            done, self.preparing = self.preparing, None
            if done is not None:
                done.set()

    def recycle(self, memfd: Memfd) -> None:
        """A memfd whose batch was read (or dropped): kept for the next one, or closed."""
        if self.closed or len(self.spare) >= SPARE_MEMFDS or memfd.fd < 0:
            memfd.close()
        else:
            self.spare.append(memfd)

    def close(self) -> None:
        """The process is gone (its inodes forgotten): its memfds and the batch written ahead go."""
        self.closed = True
        for memfd in self.spare:
            memfd.close()
        self.spare.clear()
        while self.ready:
            reservation, memfd, backing_id = self.ready.popleft()
            self.buf.drop_reserved(reservation)
            unregister(backing_id)
            memfd.close()

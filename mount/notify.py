"""Messages to the kernel, each kind sent from one thread of its own.

The kernel must forget a name when the daemon itself removes an entry (eviction,
max_times_sampled) and drop cached pages when an entry is rewritten; prefetched values
are pushed into its page cache. pyfuse3's invalidation and store calls can block until
a related request finishes (a READ waiting for the very value being pushed, say), so
they never run on the event loop or inside a handler: they are queued here, sent in
order, and nothing a request waits for depends on them. The exceptions are
`PageCachePusher.store_at_open`, made inside an OPEN of an inode no handle has open
(so no READ of it can be in flight), and `drop_attributes`, which takes no page or
inode lock.
"""

from __future__ import annotations

import errno
import functools
import logging
import queue
import threading
from typing import Callable, cast

import pyfuse3

log = logging.getLogger(__name__)

# The kernel no longer knows the inode or name, or the mount is going away: nothing to do.
_GONE = (errno.ENOENT, errno.ENOTCONN, errno.EBADF)


class _Sender:
    """A queue of kernel calls and the thread that makes them, in order."""

    def __init__(self, name: str) -> None:
        self.sent = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, fn: Callable, *args, done: Callable[[], None] | None = None,
             then: Callable[[], None] | None = None) -> None:
        """`done()` after the call whatever happened, `then()` after it succeeded."""
        self._queue.put((fn, args, done, then))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, done, then = item
            what = f"{fn.__name__}{args[:2]!r}"
            try:
                fn(*args)
                self.sent += 1
                if then is not None:
                    then()
            except OSError as exc:
                if exc.errno not in _GONE:
                    log.warning("kernel call %s failed: %s", what, exc)
            except Exception:
                log.exception("kernel call %s failed", what)
            finally:
                if done is not None:
                    done()


def drop_attributes(ino: int) -> None:
    """Make the kernel ask for an inode's attributes again, now (inside a handler): only
    the attributes go, so it waits for no page or inode lock, and it is quick."""
    try:
        pyfuse3.invalidate_inode(ino, True)
    except OSError:
        pass  # the kernel does not know the inode (yet): nothing cached to drop


class Invalidator(_Sender):
    def __init__(self) -> None:
        super().__init__("distorefs-invalidate")

    def entry(self, parent_ino: int, name: bytes, deleted_ino: int = 0) -> None:
        self._put(pyfuse3.invalidate_entry, parent_ino, name, deleted_ino)

    def inode(self, ino: int) -> None:
        self._put(pyfuse3.invalidate_inode, ino)

    def attributes(self, ino: int) -> None:
        """Only the attributes (the pages of an immutable version stay valid)."""
        self._put(pyfuse3.invalidate_inode, ino, True)


class PageCachePusher(_Sender):
    """Pushes prefetched values into the kernel page cache (`notify_store`). Values waiting
    here count against `max_bytes`; past it a push is refused (the caller keeps the value
    in memory instead)."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        super().__init__("distorefs-push")
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.stored_at_open = 0
        self._lock = threading.Lock()

    def push(self, ino: int, data: bytes, then: Callable[[], None] | None = None,
             done: Callable[[], None] | None = None) -> bool:
        """Queue `data` for the page cache of `ino`; `then()` runs in the pusher's thread
        once the kernel took it, `done()` after the attempt whatever happened."""
        with self._lock:
            if self.queued_bytes + len(data) > self.max_bytes:
                return False
            self.queued_bytes += len(data)
        self._put(pyfuse3.notify_store, ino, 0, data, done=functools.partial(self._pushed, len(data), done), then=then)
        return True

    def take_bytes(self, n: int) -> bool:
        """Count `n` bytes held for the kernel elsewhere (a batch file's memfd,
        mount/backing.py) against `max_bytes`; False (nothing counted) past it."""
        with self._lock:
            if self.queued_bytes + n > self.max_bytes:
                return False
            self.queued_bytes += n
            return True

    def give_bytes(self, n: int) -> None:
        with self._lock:
            self.queued_bytes -= n

    def _pushed(self, n: int, done: Callable[[], None] | None) -> None:
        with self._lock:
            self.queued_bytes -= n
        if done is not None:
            done()

    def store_at_open(self, ino: int, data: bytes | memoryview) -> bool:
        """Put a value the daemon holds into the page cache of an inode being opened, now,
        before OPEN is answered: the reads that follow are the kernel's, no READ comes.

        Made in the handler, not queued: queued, it would lose the race with the reader's
        first read(). Safe only when the inode has no other open handle: then no READ of it
        is in flight, holding the page locks a store waits for. False when the kernel
        refused (the READ then comes, and is answered from the value as before)."""
        if not data:
            return False
        try:
            pyfuse3.notify_store(ino, 0, cast(bytes, data))  # its stub says bytes: it takes any buffer
        except OSError as exc:
            if exc.errno not in _GONE:
                log.warning("page cache store of inode %d at open failed: %s", ino, exc)
            return False
        self.stored_at_open += 1
        return True

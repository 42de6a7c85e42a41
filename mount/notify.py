"""Kernel cache invalidation, sent from one thread of its own.

The kernel must forget a name when the daemon itself removes an entry (eviction,
max_times_sampled) and drop cached pages when an entry is rewritten. pyfuse3's
invalidation calls can block until a related request finishes, so they never run on
the event loop or inside a handler: they are queued here and sent in order.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading

import pyfuse3

log = logging.getLogger(__name__)


class Invalidator:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="distorefs-invalidate", daemon=True)
        self.sent = 0
        self._thread.start()

    def entry(self, parent_ino: int, name: bytes, deleted_ino: int = 0) -> None:
        self._queue.put((pyfuse3.invalidate_entry, (parent_ino, name, deleted_ino)))

    def inode(self, ino: int) -> None:
        self._queue.put((pyfuse3.invalidate_inode, (ino,)))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
                self.sent += 1
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTCONN, errno.EBADF):
                    log.warning("kernel invalidation %s%r failed: %s", fn.__name__, args, exc)
            except Exception:
                log.exception("kernel invalidation %s%r failed", fn.__name__, args)


class PageCachePusher:
    """Pushes prefetched values into the kernel page cache (`notify_store`) from a thread of
    its own. notify_store waits for the page lock of a READ in progress on that inode, and
    that READ may be waiting for the very value being pushed: so a push is only queued
    where it happens, never awaited, and nothing a request waits for depends on it.
    Values waiting here count against `max_bytes`; past it a push is refused (the caller
    keeps the value in memory instead)."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.pushed = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="distorefs-push", daemon=True)
        self._thread.start()

    def push(self, ino: int, data: bytes) -> bool:
        with self._lock:
            if self.queued_bytes + len(data) > self.max_bytes:
                return False
            self.queued_bytes += len(data)
        self._queue.put((ino, data))
        return True

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ino, data = item
            try:
                pyfuse3.notify_store(ino, 0, data)
                self.pushed += 1
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTCONN, errno.EBADF):
                    log.debug("notify_store %d: %s", ino, exc)
            except Exception:
                log.exception("notify_store %d failed", ino)
            finally:
                with self._lock:
                    self.queued_bytes -= len(data)

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

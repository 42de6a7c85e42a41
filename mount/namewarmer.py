"""Names ahead of a declared order: the daemon lists a dataset's items through its own mount.

A reader's first open of an item costs a LOOKUP before its OPEN, one request in three on a
cold epoch. A directory listed through the mount is answered with READDIRPLUS, a name, an
inode and attributes for a couple of hundred entries per request, and the kernel keeps
them all as if each had been looked up. So when a reader declares an order (a dataset's
`order` file), a thread of the daemon lists that dataset's `items/` tree, the way `ls -R`
would: the reads that follow find their names in the kernel and cost OPEN and RELEASE.
And since the kernel then holds every item's inode, the prefetcher can put each value
into the page cache as soon as it is loaded (mount/notify.py), before its open.

The listing is made by this daemon's own process, so it must never be waited for by a
request handler (the handlers answer it): it runs in threads of its own, and `stop()` is
called while the mount still serves. While a listing runs, the daemon holds a directory
of the mount open, so an unmount made just then is refused as busy (`distorefs umount`
waits for it); a listing takes about a second per 20,000 entries.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

MAX_NAMES = 2_000_000  # per listing: the kernel's dentries and inodes for them, ~1 KB each
AGAIN_AFTER_S = 30.0  # a tree listed this recently is not listed again (DDP ranks declare together)


class NameWarmer:
    def __init__(self, mountpoint: str, max_names: int = MAX_NAMES) -> None:
        self.mountpoint = mountpoint
        self.max_names = max_names
        self.listed = 0  # entries listed, all listings together
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}
        self._finished: dict[str, float] = {}  # tree -> monotonic time its last listing ended
        self._stopping = threading.Event()

    def warm(self, relative: str) -> bool:
        """List the tree at `relative` (below the mount point) in a thread of its own, unless
        it is being listed or was within AGAIN_AFTER_S. True if a listing started."""
        with self._lock:
            if self._stopping.is_set() or relative in self._running:
                return False
            ended = self._finished.get(relative)
            if ended is not None and time.monotonic() - ended < AGAIN_AFTER_S:
                return False
            thread = threading.Thread(target=self._list, args=(relative,), name="distorefs-names", daemon=True)
            self._running[relative] = thread
        thread.start()
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """End the listings (each closes its directory after the request in flight) and wait
        for them. Blocking: call it from a worker thread while the mount still serves."""
        self._stopping.set()
        with self._lock:
            threads = list(self._running.values())
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _list(self, relative: str) -> None:
        pending = [os.path.join(self.mountpoint, relative)]
        listed = 0
        try:
            while pending and listed < self.max_names and not self._stopping.is_set():
                top = pending.pop()
                try:
                    with os.scandir(top) as entries:
                        for entry in entries:
                            listed += 1
                            if entry.is_dir(follow_symlinks=False):
                                pending.append(entry.path)
                            if self._stopping.is_set() or listed >= self.max_names:
                                break
                except OSError as exc:  # removed, renamed or made unreadable meanwhile; unmounted
                    log.debug("listing %s: %s", top, exc)
        except Exception:
            log.exception("listing %s failed", relative)
        finally:
            with self._lock:
                self.listed += listed
                self._running.pop(relative, None)
                self._finished[relative] = time.monotonic()

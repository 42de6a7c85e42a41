"""The store's lock file (STORE/lock): who has a store open, and whether the last holder
closed it cleanly.

Whoever opens a store (a daemon's `Store`, `distorefs verify`, an offline `gc`) takes an
exclusive flock on STORE/lock and writes "pid N [what]" into it, synced. A clean close
empties the file after everything else is synced and closed. So a lock file found
non-empty at open means its last holder was killed (or lost power, or failed) with the
store open, and the store must be recovered before it is used (distorefs/recovery.py).

Crash windows (developer note): the marker is synced before the holder changes anything,
so a store changed on disk always has a marker on disk too. The marker is removed only
after the holder's last sync; a crash between that sync and the truncation leaves a
marker on a consistent store, which costs one needless recovery at the next open.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import StoreLocked


class StoreLock:
    """A held lock on a store directory; `previous` is what the file held when taken."""

    def __init__(self, path: Path, fd: int, previous: str) -> None:
        self.path = path
        self.fd = fd
        self.previous = previous

    @property
    def was_clean(self) -> bool:
        """The previous holder closed the store cleanly (or there was none)."""
        return not self.previous

    def release(self) -> None:
        """A clean close: empty the file (the store is consistent and synced) and let go."""
        try:
            os.ftruncate(self.fd, 0)
            os.fsync(self.fd)
        finally:
            self._close()

    def keep_unclean(self, note: str) -> None:
        """Let go leaving the store marked for recovery: the previous holder's marker if there
        was one (it says who crashed), else `note`."""
        try:
            _write(self.fd, self.previous or note)
        finally:
            self._close()

    def restore(self) -> None:
        """Let go leaving the file as it was found: clean stays clean, unclean stays unclean
        (for holders that changed nothing, such as a check without repair)."""
        if self.was_clean:
            self.release()
        else:
            self.keep_unclean(self.previous)

    def _close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def take_lock(path: Path, what: str = "") -> StoreLock:
    """Take the store's lock and mark it held ("pid N what", synced); StoreLocked if another
    process (a mounted daemon, a running verify) holds it."""
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise StoreLocked(f"store {path} is already in use ({holder})") from None
    try:
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        _write(fd, f"pid {os.getpid()}{' ' + what if what else ''}")
    except BaseException:
        os.close(fd)
        raise
    return StoreLock(path, fd, previous)


def _write(fd: int, text: str) -> None:
    # Overwrite, then cut: the file is never empty in between (empty would mean "clean").
    data = text.encode() + b"\n"
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))
    os.fsync(fd)

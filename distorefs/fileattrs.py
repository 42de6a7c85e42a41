"""Attributes of the general file trees (weights/, checkpoints/, an unsealed dataset's items/):
mode, owner and the three times, and the one set of rules that changes them.

Every tree stamps times the same way, as a local POSIX filesystem does:
- a write or a truncate sets mtime and ctime (`modified`);
- chmod, chown, a rename of the node, a link-count change set ctime (`changed`);
- utimes sets atime and mtime as asked, and ctime to now (`apply_setattr`);
- adding, removing or renaming a name in a directory sets the directory's mtime and ctime.
Permission checks are the kernel's (`default_permissions`), including clearing setuid and
setgid: it sends them as a mode change, which `apply_setattr` applies like any chmod.
"""

from __future__ import annotations

import stat
import time
from dataclasses import dataclass
from typing import Protocol


class Stamped(Protocol):
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


@dataclass(frozen=True)
class AttrChange:
    """What a setattr asks for (None: unchanged). `size` is the tree's to apply (truncate)."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    size: int | None = None

    @property
    def metadata_only(self) -> bool:
        return self.size is None

    def empty(self) -> bool:
        return all(v is None for v in (self.mode, self.uid, self.gid, self.atime_ns, self.mtime_ns, self.size))


def now_ns() -> int:
    return time.time_ns()


def apply_setattr(node: Stamped, change: AttrChange, now: int | None = None) -> bool:
    """Apply the metadata part of `change` to `node` (its file type bits are kept); True if
    anything was asked (ctime is then now, as chmod/chown/utimes do on Linux even when
    the values are the same)."""
    now = now_ns() if now is None else now
    asked = False
    if change.mode is not None:
        node.mode = stat.S_IFMT(node.mode) | (change.mode & 0o7777)
        asked = True
    if change.uid is not None and change.uid != 0xFFFFFFFF:
        node.uid = change.uid
        asked = True
    if change.gid is not None and change.gid != 0xFFFFFFFF:
        node.gid = change.gid
        asked = True
    if change.atime_ns is not None:
        node.atime_ns = change.atime_ns
        asked = True
    if change.mtime_ns is not None:
        node.mtime_ns = change.mtime_ns
        asked = True
    if asked or change.size is not None:
        node.ctime_ns = now
    return asked


def modified(node: Stamped, now: int | None = None) -> None:
    """Content changed (write, truncate): mtime and ctime."""
    node.mtime_ns = node.ctime_ns = now_ns() if now is None else now


def changed(node: Stamped, now: int | None = None) -> None:
    """Metadata changed (a rename of it, a link count): ctime."""
    node.ctime_ns = now_ns() if now is None else now


def without_privileges(mode: int, writer_uid: int) -> AttrChange | None:
    """The mode change a write by `writer_uid` makes (setuid dropped, and setgid when the group
    may execute), as Linux's file_remove_privs; None if nothing changes. The kernel does it
    itself for writes through the page cache; direct-I/O writes come here."""
    if writer_uid == 0:
        return None  # CAP_FSETID
    kill = stat.S_ISUID if mode & stat.S_ISUID else 0
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        kill |= stat.S_ISGID
    return AttrChange(mode=(mode & 0o7777) & ~kill) if kill else None


def dir_nlink(subdirs: int) -> int:
    """A directory's link count: its own name, its `.`, and each subdirectory's `..`."""
    return 2 + subdirs


def times_from(record: dict, fallback: int) -> tuple[int, int, int]:
    """(atime, mtime, ctime) of a stored record; records written before times were kept
    carry only an mtime (`fallback`)."""
    mtime = record.get("mtime_ns", fallback)
    return record.get("atime_ns", mtime), mtime, record.get("ctime_ns", mtime)


__all__ = ["AttrChange", "Stamped", "apply_setattr", "modified", "changed", "dir_nlink", "times_from", "now_ns",
           "without_privileges"]

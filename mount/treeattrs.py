"""FUSE attributes of the general file trees (weights/, checkpoints/, unsealed datasets/):
a node's stamps (distorefs/fileattrs.py) as `EntryAttributes`, and a SETATTR as the core's
`AttrChange`. Shared by the three trees' nodes, so each shows and takes times the same way."""

from __future__ import annotations

import pyfuse3

from distorefs.fileattrs import AttrChange

from .nodes import make_attrs


def stamp_attrs(ino: int, mode: int, size: int, node, timeout: float, nlink: int = 1,
                entry_timeout: float | None = None) -> pyfuse3.EntryAttributes:
    """Attributes of a tree node with its own atime, mtime and ctime."""
    a = make_attrs(ino, mode, size, node.uid, node.gid, node.mtime_ns, timeout, nlink=nlink,
                   entry_timeout=entry_timeout)
    a.st_atime_ns = node.atime_ns
    a.st_ctime_ns = node.ctime_ns
    return a


def attr_change(attr, fields) -> AttrChange:
    """What a SETATTR asks for (the kernel has checked the caller may)."""
    return AttrChange(
        mode=attr.st_mode & 0o7777 if fields.update_mode else None,
        uid=attr.st_uid if fields.update_uid else None,
        gid=attr.st_gid if fields.update_gid else None,
        atime_ns=attr.st_atime_ns if fields.update_atime else None,
        mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        size=attr.st_size if fields.update_size else None,
    )


__all__ = ["stamp_attrs", "attr_change"]

"""The naming rules of the general file trees, in one place: what create, mkdir, remove and
rename may do, and which errno each refusal gets (as Linux filesystems answer).

Each rule takes the nodes involved (whatever a tree stores them as, seen through
`TreeNode`) and raises the core's typed error; the tree applies the change only if no
rule refused it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from .errors import AlreadyExists, InvalidArgument, IsADirectory, NotADirectory, NotEmpty, NotFound
from .names import check_name


class TreeNode(Protocol):
    id: int

    @property
    def is_dir(self) -> bool: ...


def check_create(name: bytes, existing: TreeNode | None, exclusive: bool) -> None:
    """A new name (create, mkdir, symlink): EEXIST if taken (O_EXCL for create)."""
    check_name(name)
    if existing is not None and exclusive:
        raise AlreadyExists(f"{name!r} exists")


def check_remove(node: TreeNode | None, name: bytes, want_dir: bool, empty: Callable[[], bool]) -> None:
    """unlink (want_dir False) or rmdir of `node`."""
    if node is None:
        raise NotFound(f"no {name!r}")
    if want_dir and not node.is_dir:
        raise NotADirectory(f"{name!r} is not a directory")
    if not want_dir and node.is_dir:
        raise IsADirectory(f"{name!r} is a directory")
    if want_dir and not empty():
        raise NotEmpty(f"{name!r} is not empty")


def check_rename(node: TreeNode | None, old: bytes, target: TreeNode | None, new: bytes,
                 dest_ancestors: Iterable[int], *, noreplace: bool, exchange: bool,
                 target_empty: Callable[[], bool]) -> None:
    """rename(old -> new), with RENAME_NOREPLACE or RENAME_EXCHANGE. `dest_ancestors`: the
    ids of the destination directory and every directory above it (a directory cannot move
    below itself). A rename onto itself (the same node) is allowed and does nothing."""
    check_name(new)
    if node is None:
        raise NotFound(f"no {old!r}")
    if noreplace and exchange:
        raise InvalidArgument("RENAME_NOREPLACE and RENAME_EXCHANGE together")
    if node.is_dir and node.id in set(dest_ancestors):
        raise InvalidArgument("cannot move a directory below itself")
    if target is node:
        return
    if exchange:
        if target is None:
            raise NotFound(f"no {new!r} to exchange with")
        return
    if target is None:
        return
    if noreplace:
        raise AlreadyExists(f"{new!r} exists")
    if node.is_dir and not target.is_dir:
        raise NotADirectory(f"{new!r} is not a directory")
    if not node.is_dir and target.is_dir:
        raise IsADirectory(f"{new!r} is a directory")
    if target.is_dir and not target_empty():
        raise NotEmpty(f"{new!r} is not empty")


__all__ = ["check_create", "check_remove", "check_rename", "TreeNode"]

"""The inode table: inode number <-> node, with the kernel's lookup counts.

Fixed nodes (the root, `.distorefs/`, `buffers/`) have fixed numbers. Objects of the
general file trees (weights/, checkpoints/, an unsealed dataset's items/) have a stable
number derived from their own id (`stable_number`): the kernel forgets inodes nobody
holds whenever it likes (dentry cache pressure), and pyfuse3 answers the node number as
`st_ino`, which POSIX keeps for the life of a file (pjdfstest, `find -inum`, tar and git
compare it). Every other node gets a number from a counter when first looked up; those
numbers are never reused, and a stable number only ever names its own object, so a
kernel that still holds an old number can never reach a different object through it. A
node whose object is gone (an evicted entry, a dropped buffer) stays reachable by number
until the kernel forgets it, but no longer by its name.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable, Hashable

import pyfuse3

from distorefs.errors import NotFound

if TYPE_CHECKING:
    from .nodes import Node

ROOT_INODE = pyfuse3.ROOT_INODE

# Kinds of objects with stable numbers (4 bits of the number).
WEIGHTS_DIR, WEIGHTS_LINK, WEIGHTS_FILE = 1, 2, 3
CHECKPOINT_DIR, CHECKPOINT_LINK, CHECKPOINT_FILE = 4, 5, 6
DATASET_DIR, DATASET_LINK, DATASET_FILE = 7, 8, 9

# Above anything the counter reaches, and below 2^53 (tools that hold st_ino in a double
# stay exact).
_STABLE = 1 << 52


def stable_number(kind: int, space: int, obj: int) -> int | None:
    """The inode number of object `obj` of `kind` in `space` (a dataset, a weights file's
    inode generation), the same every time the kernel looks it up; None outside the ranges
    a number holds (16 bits of space, 32 of object id: the counter gives one then)."""
    if not (0 < kind < 16 and 0 <= space < 1 << 16 and 0 <= obj < 1 << 32):
        return None
    return _STABLE | kind << 48 | space << 32 | obj


class InodeTable:
    def __init__(self, on_drop: Callable[[int], None] | None = None) -> None:
        # on_drop(ino): the number left the table (what was kept for it elsewhere goes too)
        self._on_drop = on_drop
        self._nodes: dict[int, object] = {}
        self._by_key: dict[Hashable, int] = {}
        self._lookups: dict[int, int] = {}
        self._fixed: set[int] = set()
        self._next = itertools.count(1000)

    def __len__(self) -> int:
        return len(self._nodes)

    def add_fixed(self, ino: int, key: Hashable, node) -> None:
        node.ino = ino
        self._nodes[ino] = node
        self._by_key[key] = ino
        self._fixed.add(ino)

    def get(self, ino: int):
        node = self._nodes.get(ino)
        if node is None:
            raise NotFound(f"stale inode {ino}")
        return node

    def nodes(self) -> list:
        """Every node in the table now (a copy: the caller may await between them)."""
        return list(self._nodes.values())

    def get_or_none(self, ino: int):
        return self._nodes.get(ino)

    def ino_of(self, key: Hashable) -> int | None:
        return self._by_key.get(key)

    def node_of(self, key: Hashable):
        ino = self._by_key.get(key)
        return None if ino is None else self._nodes[ino]

    def intern(self, key: Hashable, make: Callable[[], object], number: int | None = None):
        """The node for `key`, creating it if new: numbered `number` (a `stable_number`) when
        given and free, else with a fresh number from the counter."""
        ino = self._by_key.get(key)
        if ino is not None:
            return self._nodes[ino]
        node = make()
        ino = number if number is not None and number not in self._nodes else next(self._next)
        node.ino = ino  # type: ignore[attr-defined]
        node.key = key  # type: ignore[attr-defined]
        self._nodes[ino] = node
        self._by_key[key] = ino
        return node

    def reserve(self, n: int) -> list[int]:
        """`n` fresh numbers from the counter, for nodes made later with `intern(number=)` (the
        front's creates: mount/interpose.py create_inodes)."""
        return [next(self._next) for _ in range(n)]

    def rekey(self, old: Hashable, new: Hashable) -> None:
        ino = self._by_key.pop(old, None)
        if ino is not None:
            stale = self._by_key.get(new)
            if stale is not None:
                self._unname(stale)
            self._by_key[new] = ino
            self._nodes[ino].key = new  # type: ignore[attr-defined]

    def unname(self, key: Hashable) -> int | None:
        """Detach `key` from its node (the object is gone); the number lives until forget."""
        ino = self._by_key.get(key)
        if ino is not None:
            self._unname(ino)
        return ino

    def _unname(self, ino: int) -> None:
        node = self._nodes[ino]
        if self._by_key.get(node.key) == ino:  # type: ignore[attr-defined]
            del self._by_key[node.key]  # type: ignore[attr-defined]
        node.key = None  # type: ignore[attr-defined]
        if not self._lookups.get(ino) and ino not in self._fixed:
            self._drop(ino)

    def _drop(self, ino: int) -> None:
        del self._nodes[ino]
        if self._on_drop is not None:
            self._on_drop(ino)

    def known(self, ino: int) -> bool:
        """Whether the kernel holds `ino` (looked up and not forgotten)."""
        return self._lookups.get(ino, 0) > 0

    def looked_up(self, ino: int, n: int = 1) -> None:
        self._lookups[ino] = self._lookups.get(ino, 0) + n

    def forget(self, ino: int, n: int) -> None:
        left = self._lookups.get(ino, 0) - n
        if left > 0:
            self._lookups[ino] = left
            return
        self._lookups.pop(ino, None)
        if ino in self._fixed:
            return
        node = self._nodes.get(ino)
        if node is None:
            return
        if getattr(node, "open_handles", 0):
            return  # forgotten while open (rare): dropped on release instead
        self._drop(ino)
        if node.key is not None and self._by_key.get(node.key) == ino:  # type: ignore[attr-defined]
            del self._by_key[node.key]  # type: ignore[attr-defined]

    def released(self, node: Node) -> None:
        """A handle on `node` closed; drop it if the kernel already forgot it."""
        ino = node.ino
        if not node.open_handles and ino not in self._lookups and ino not in self._fixed:
            if self._nodes.get(ino) is node:
                self._drop(ino)
                if node.key is not None and self._by_key.get(node.key) == ino:
                    del self._by_key[node.key]

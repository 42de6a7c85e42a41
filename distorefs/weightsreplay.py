"""weights/ as a shared store's log alone makes it: what a snapshot of the log keeps of it.

The log's weights records (`wpublish`, `wmkdir`, `wremove`, `wrename`: distorefs/weightslog.py)
grow with every publish. A snapshot (distorefs/logsnapshot.py) replaces them with the
tree they leave: `WeightsReplay` applies them in order to a tree of names, as a node's
follower applies them to its tree (parents made as `WeightsLog` makes them, the naming
rules of distorefs/treerules.py, a version applied only above the file's number, a rename
over a file numbering on from it), and `records()` gives a `wmkdir` per directory and a
`wpublish` of each file's newest version, parents first. Applied to an empty tree they
give the tree the whole log gives. A record a follower would refuse is skipped the same
way. What stays on the node that made it (symlinks, modes changed later, files never
published) is not in the log, so not here either.
"""

from __future__ import annotations

import itertools
import json
from typing import Iterable, Iterator

from .errors import DistorefsError, InvalidArgument, NotFound
from .owner import Owner
from .treerules import check_remove, check_rename

ORIGIN = b"snapshot"  # the origin of a snapshot's records: no node's, so every node applies them
_ids = itertools.count(1)


class _Node:
    __slots__ = ("id", "dir", "owner", "version", "parent", "name", "children")

    def __init__(self, is_dir: bool, owner: Owner, parent: "_Node | None", name: bytes) -> None:
        self.id = next(_ids)
        self.dir = is_dir
        self.owner = owner
        self.version: dict | None = None  # a file's newest version (Version.to_dict())
        self.parent = parent
        self.name = name
        self.children: dict[bytes, _Node] = {}

    @property
    def is_dir(self) -> bool:
        return self.dir

    @property
    def number(self) -> int:
        return self.version["number"] if self.version else 0


def _names(path: str) -> list[bytes]:
    return [p.encode("utf-8", "surrogateescape") for p in path.split("/") if p]


def _owner(f: dict) -> Owner:
    return Owner(int(f.get(b"mode", b"33188")), int(f.get(b"uid", b"0")), int(f.get(b"gid", b"0")))


class WeightsReplay:
    def __init__(self) -> None:
        self.root = _Node(True, Owner(0o40755, 0, 0), None, b"")

    def apply(self, op: str, path: str, f: dict) -> None:
        """One record (`path` below weights/); one a follower would refuse changes nothing."""
        try:
            if op == "wpublish":
                node = self._file(path, _owner(f))
                version = json.loads(f[b"version"])
                if not node.dir and version["number"] > node.number:
                    node.version = version
            elif op == "wmkdir":
                self._dir(_names(path), _owner(f))
            elif op == "wremove":
                removed = self._find(path)
                if removed is not None:
                    check_remove(removed, removed.name, removed.dir, lambda: not removed.children)
                    del removed.parent.children[removed.name]  # type: ignore[union-attr]
            elif op == "wrename":
                moved = self._find(path)
                if moved is not None:
                    to = f[b"to"].decode("utf-8", "surrogateescape").removeprefix("weights/")
                    self._rename(moved, to, bool(int(f.get(b"exchange", b"0"))))
        except (DistorefsError, KeyError, ValueError):  # refused, or a record this version cannot read
            pass

    def records(self) -> Iterator[dict]:
        """The tree as records, parents first."""
        stack = [(self.root, "weights")]
        while stack:
            node, path = stack.pop()
            if node is not self.root:
                fields = {b"op": b"wmkdir" if node.dir else b"wpublish", b"ns": path.encode("utf-8", "surrogateescape"),
                          b"origin": ORIGIN, b"mode": str(node.owner.mode).encode(),
                          b"uid": str(node.owner.uid).encode(), b"gid": str(node.owner.gid).encode()}
                if not node.dir:
                    if node.version is None:
                        continue
                    fields[b"version"] = json.dumps(node.version).encode()
                yield fields
            for name in sorted(node.children, reverse=True):
                stack.append((node.children[name], f"{path}/{name.decode('utf-8', 'surrogateescape')}"))

    # ----- as WeightsLog does it -----------------------------------------------------------------

    def _find(self, path: str) -> _Node | None:
        node = self.root
        for name in _names(path):
            child = node.children.get(name) if node.dir else None
            if child is None:
                return None
            node = child
        return node

    def _dir(self, names: list[bytes], owner: Owner) -> _Node:
        node = self.root
        for name in names:
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _Node(True, owner, node, name)
            if not child.dir:
                raise NotFound("not a directory")
            node = child
        return node

    def _file(self, path: str, owner: Owner) -> _Node:
        names = _names(path)
        if not names:
            raise NotFound("no name")
        parent = self._dir(names[:-1], Owner(0o40755, owner.uid, owner.gid))
        node = parent.children.get(names[-1])
        if node is None:
            node = parent.children[names[-1]] = _Node(False, owner, parent, names[-1])
        return node

    def _rename(self, node: _Node, to: str, exchange: bool) -> None:
        names = _names(to)
        if not names:
            raise NotFound("no name")
        parent = self._dir(names[:-1], Owner(0o40755, 0, 0))
        new = names[-1]
        target = parent.children.get(new)
        check_rename(node, node.name, target, new, self._ancestors(parent), noreplace=False, exchange=exchange,
                     target_empty=lambda: not target.children)  # type: ignore[union-attr]
        old_parent = node.parent
        assert old_parent is not None
        if exchange and node.dir and target is not None and target.id in self._ancestors(old_parent):
            raise InvalidArgument("cannot move a directory below itself")
        if target is node:
            return
        if (not exchange and target is not None and not target.dir and not node.dir and node.version is not None
                and node.number <= target.number):
            node.version = {**node.version, "number": target.number + 1}  # numbers go on from the replaced one
        del old_parent.children[node.name]
        if exchange:
            assert target is not None
            target.parent, target.name = old_parent, node.name
            old_parent.children[node.name] = target
        parent.children[new] = node
        node.parent, node.name = parent, new

    @staticmethod
    def _ancestors(node: _Node) -> set[int]:
        out = set()
        cur: _Node | None = node
        while cur is not None:
            out.add(cur.id)
            cur = cur.parent
        return out


def compact(records: Iterable[tuple[str, str, dict]]) -> list[dict]:
    """The records (op, path below weights/, fields) of weights/, in log order, as the few
    that give the same tree."""
    replay = WeightsReplay()
    for op, path, fields in records:
        replay.apply(op, path, fields)
    return list(replay.records())

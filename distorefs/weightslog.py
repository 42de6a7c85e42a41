"""weights/ of a shared store: what this node tells the others, and what they told it.

A node changes its own tree first (a publish commits here, its chunks already in the
cluster), then appends a record naming the change by path: wpublish (the version: number,
size, checksum, chunk values), wmkdir, wremove, wrename. close() returns once that record
is durable in the cluster. Every other node applies the record to its own tree by path
(`apply`), so a version published on one node is read, whole, on the others: a reader
there opens either the version before it or this one, never a mix, because a version is
one record and its chunks were in the cluster before the record was.

Version numbers are the publishing node's: a node applies a version only above the one it
has, so a record applied twice (a replay) changes nothing. Symlinks, chmod/chown/utimes
and empty files never published stay on the node that made them.
"""

from __future__ import annotations

import json
import logging

import trio

from .clusterlog import Record, SharedLog
from .committer import Committer, Overlay
from .errors import AlreadyExists, NotFound
from .owner import Owner
from .weights import (DIR, FILE, ROOT_ID, MakeNode, Remove, Rename, Version, WeightsTree, WNode, _TreeChange,
                      retire_current)

log = logging.getLogger(__name__)


class ApplyVersion(_TreeChange):
    """A version another node published, as this file's newest (nothing if it has one as new)."""

    def __init__(self, tree: WeightsTree, node: WNode, version: Version) -> None:
        super().__init__(tree)
        self.node, self.version = node, version

    def plan(self, overlay: Overlay) -> None:
        self.skip = not self.node.attached or self.node.number >= self.version.number

    def txn(self, txn) -> None:
        if not self.skip:
            self._put(txn, self.node.copy(versions=[*self.node.versions, self.version]))

    def apply(self) -> None:
        if self.skip:
            return
        node, tree = self.node, self.tree
        # A new inode for the new version, as a local writer gets one when readers hold the
        # file through the page cache: pages cached of the old version never show in it.
        node.gen = node.next_gen
        node.next_gen += 1
        self.version.gen = node.gen
        retire_current(node)
        node.versions.append(self.version)
        tree.counters["versions_applied"] = tree.counters.get("versions_applied", 0) + 1
        tree.collect_unkept(node)


class WeightsLog:
    def __init__(self, tree: WeightsTree, shared: SharedLog, committer: Committer, origin: str) -> None:
        self.tree = tree
        self.log = shared
        self.committer = committer
        self.origin = origin

    async def announce(self, op: str, path: str, **fields) -> None:
        """Tell the other nodes of a change this node made (durable when it returns)."""
        await trio.to_thread.run_sync(lambda: self.log.tree_change(self.origin, op, path, **fields))

    # ----- another node's records ------------------------------------------------------------

    async def apply(self, rec: Record) -> None:
        tree = self.tree
        path = rec.name
        f = rec.fields
        if rec.op == "wpublish":
            node = await self._file(path, _owner(f))
            version = Version.from_dict(json.loads(f[b"version"]))
            await self.committer.submit(ApplyVersion(tree, node, version))
            tree.wake()
        elif rec.op == "wmkdir":
            await self._dir(path, _owner(f))
        elif rec.op == "wremove":
            found = self._find(path)
            if found is not None:
                await self.committer.submit(Remove(tree, found.parent, found.name, found.kind == DIR))
        elif rec.op == "wrename":
            found = self._find(path)
            to = f[b"to"].decode("utf-8", "surrogateescape").removeprefix("weights/")
            if found is not None:
                parent, name = await self._parent_of(to, Owner(0o40755, 0, 0))
                await self.committer.submit(Rename(tree, found.parent, found.name, parent.id, name, False,
                                                   bool(int(f.get(b"exchange", b"0")))))
                tree.wake()
        else:
            log.warning("cluster log: weights record %s of unknown op %r left alone", rec.id.decode(), rec.op)

    def _find(self, path: str) -> WNode | None:
        try:
            return self.tree.resolve(path)
        except NotFound:
            return None

    async def _dir(self, path: str, owner: Owner) -> WNode:
        """The directory at `path`, made (with its parents) if missing."""
        node = self.tree.nodes[ROOT_ID]
        for part in [p for p in path.split("/") if p]:
            name = part.encode("utf-8", "surrogateescape")
            child = self.tree.child_or_none(node.id, name)
            if child is None:
                child = await self._make(node.id, name, DIR, owner)
            if child.kind != DIR:
                raise NotFound(f"weights/{path}: {part} is not a directory here")
            node = child
        return node

    async def _parent_of(self, path: str, owner: Owner) -> tuple[WNode, bytes]:
        head, _, last = path.rstrip("/").rpartition("/")
        return await self._dir(head, Owner(0o40755, owner.uid, owner.gid)), last.encode("utf-8", "surrogateescape")

    async def _file(self, path: str, owner: Owner) -> WNode:
        parent, name = await self._parent_of(path, owner)
        node = self.tree.child_or_none(parent.id, name)
        if node is None:
            node = await self._make(parent.id, name, FILE, owner)
        if node.kind != FILE:  # a directory (or a link of this node's) is not given a version
            raise NotFound(f"weights/{path} is not a file here")
        return node

    async def _make(self, parent_id: int, name: bytes, kind: str, owner: Owner) -> WNode:
        change = MakeNode(self.tree, parent_id, name, kind, owner, b"")
        try:
            await self.committer.submit(change)
        except AlreadyExists:
            pass
        node = self.tree.child_or_none(parent_id, name)
        assert node is not None
        return node


def _owner(f: dict) -> Owner:
    return Owner(int(f.get(b"mode", b"33188")), int(f.get(b"uid", b"0")), int(f.get(b"gid", b"0")))


"""The parameter server (weights/): a tree of directories, symlinks and versioned files.

A file is a list of immutable versions. A writer stages its bytes in a spool file on
disk (memory stays bounded whatever the file size); `publish` turns the spool into the
next version in one transaction (chunks of `chunk_bytes`, each stored and checksummed as
its own value) and only then does the name show the new version. A version stays
readable while any handle holds it; versions beyond the newest `keep_versions` are
collected once no handle holds them. Renames (also over an existing name) are one
transaction, so the `ln -sfn v2 latest.tmp && mv -T latest.tmp latest` idiom publishes
a whole directory at once.

Crash safety: the tree and every version live in LMDB records written in the publishing
transaction; spool files are scratch (removed at open). A kill -9 before the commit leaves
the previous version; after it, the new one, whole.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass, field, replace

import trio

from .committer import Change, Overlay
from .config import WeightsConfig
from .errors import AlreadyExists, InvalidArgument, NotEmpty, NotFound, NotPermitted
from .names import check_name
from .owner import Owner
from .services import Services
from .values import StoredValue

log = logging.getLogger(__name__)

DB_WNODES = b"wnodes"
ROOT_ID = 1
_ID = struct.Struct(">Q")
DIR, FILE, LINK = "dir", "file", "link"


@dataclass(eq=False)
class Version:
    number: int
    size: int
    mtime_ns: int
    chunks: list[StoredValue]
    checksum: int = 0  # CRC-32 of the whole content
    readers: int = 0  # open handles (memory only)

    def to_dict(self) -> dict:
        return {"number": self.number, "size": self.size, "mtime_ns": self.mtime_ns, "checksum": self.checksum,
                "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_dict(cls, d: dict) -> "Version":
        return cls(d["number"], d["size"], d["mtime_ns"],
                   [StoredValue.from_json(c) for c in d["chunks"]], d.get("checksum", 0))


@dataclass
class WNode:
    id: int
    kind: str
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    target: bytes = b""
    versions: list[Version] = field(default_factory=list)  # oldest first; [-1] is current
    children: dict[bytes, int] = field(default_factory=dict)  # memory only
    attached: bool = True  # False once unlinked or replaced (memory only)

    @property
    def current(self) -> Version | None:
        return self.versions[-1] if self.versions else None

    def record(self) -> bytes:
        return json.dumps({"kind": self.kind, "parent": self.parent, "name": self.name.hex(),
                           "mode": self.mode, "uid": self.uid, "gid": self.gid, "mtime_ns": self.mtime_ns,
                           "target": self.target.hex(),
                           "versions": [v.to_dict() for v in self.versions],
                           **({} if self.attached else {"detached": True})}).encode()

    @classmethod
    def from_record(cls, node_id: int, data: bytes) -> "WNode":
        d = json.loads(data)
        return cls(node_id, d["kind"], d["parent"], bytes.fromhex(d["name"]), d["mode"], d["uid"], d["gid"],
                   d["mtime_ns"], bytes.fromhex(d["target"]), [Version.from_dict(v) for v in d["versions"]],
                   attached=not d.get("detached", False))


class WeightsTree:
    kind = "weights"

    def __init__(self, services: Services, config: WeightsConfig) -> None:
        self.values = services.values
        self.committer = services.committer
        self.config = config
        self.nodes: dict[int, WNode] = {}
        self.next_id = ROOT_ID + 1
        self.spool_dir = services.spool_dir
        self.counters = {"publishes": 0, "versions_collected": 0, "bytes_published": 0, "renames": 0}
        self._published = trio.Event()
        self.detached_at_load: list[WNode] = []  # unlinked while read when the daemon last stopped

    # ----- loading -------------------------------------------------------------------

    def load(self, txn) -> None:
        """Rebuild the tree (at store open); create the root on a new store."""
        for k, v in txn.cursor(DB_WNODES):
            node = WNode.from_record(_ID.unpack(bytes(k))[0], bytes(v))
            self.nodes[node.id] = node
            self.next_id = max(self.next_id, node.id + 1)
        if ROOT_ID not in self.nodes:
            self.nodes[ROOT_ID] = WNode(ROOT_ID, DIR, 0, b"", 0o40755, os.getuid(), os.getgid(), time.time_ns())
        for node in self.nodes.values():
            if not node.attached:  # its versions are free now: collect() them once running
                self.detached_at_load.append(node)
            elif node.id != ROOT_ID:
                parent = self.nodes.get(node.parent)
                if parent is None:
                    log.error("weights node %d has no parent %d: left out", node.id, node.parent)
                    continue
                parent.children[node.name] = node.id
        # spool files are scratch of writers that never published
        if self.spool_dir.exists():
            for stale in self.spool_dir.iterdir():
                stale.unlink(missing_ok=True)
        self.spool_dir.mkdir(mode=0o700, exist_ok=True)

    # ----- queries -------------------------------------------------------------------

    def node(self, node_id: int) -> WNode:
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"weights node {node_id} is gone")
        return node

    def child(self, parent_id: int, name: bytes) -> WNode:
        parent = self.node(parent_id)
        if parent.kind != DIR:
            raise NotFound("not a directory")
        child_id = parent.children.get(name)
        if child_id is None:
            raise NotFound(f"no {name!r}")
        return self.nodes[child_id]

    def path_of(self, node: WNode) -> str:
        parts = []
        while node.id != ROOT_ID:
            parts.append(node.name.decode("utf-8", "surrogateescape"))
            node = self.nodes[node.parent]
        return "weights/" + "/".join(reversed(parts))

    def resolve(self, path: str) -> WNode:
        """A node by its path below weights/ (for the wait control file)."""
        node = self.nodes[ROOT_ID]
        for part in [p for p in path.split("/") if p]:
            node = self.child(node.id, part.encode("utf-8", "surrogateescape"))
        return node

    def stats(self) -> dict:
        files = [n for n in self.nodes.values() if n.kind == FILE]
        versions = [v for n in files for v in n.versions]
        return {
            "files": len(files),
            "directories": sum(1 for n in self.nodes.values() if n.kind == DIR),
            "symlinks": sum(1 for n in self.nodes.values() if n.kind == LINK),
            "versions": len(versions),
            "bytes": sum(v.size for v in versions),
            "stored_bytes": sum(c.stored_size for v in versions for c in v.chunks),
            "open_readers": sum(v.readers for v in versions),
            "keep_versions": self.config.keep_versions,
            **self.counters,
        }

    # ----- reads ---------------------------------------------------------------------

    async def read(self, node: WNode, version: Version, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of one version, chunk by chunk through the memory tier."""
        end = min(off + size, version.size)
        if off >= end:
            return b""
        step = self.config.chunk_bytes
        first, last = off // step, (end - 1) // step
        parts = []
        for i in range(first, last + 1):
            data = await self._chunk(node, version, i)
            lo = max(off - i * step, 0)
            hi = min(end - i * step, len(data))
            parts.append(memoryview(data)[lo:hi])
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    async def _chunk(self, node: WNode, version: Version, index: int) -> bytes:
        what = f"{self.path_of(node)} version {version.number} chunk {index}"
        return await self.values.fetch_one(("w", node.id, version.number, index), version.chunks[index], what)

    # ----- writes --------------------------------------------------------------------

    def new_spool(self) -> tuple[int, str]:
        fd, path = tempfile.mkstemp(dir=self.spool_dir, prefix="w-")
        return fd, path

    async def copy_into_spool(self, node: WNode, fd: int) -> int:
        """Fill a writer's spool with the current version (an open for writing without O_TRUNC)."""
        version = node.current
        if version is None:
            return 0
        step = self.config.chunk_bytes
        for i in range(len(version.chunks)):
            data = await self._chunk(node, version, i)
            await trio.to_thread.run_sync(os.pwrite, fd, data, i * step)
        return version.size

    async def publish(self, parent_id: int, name: bytes, owner: Owner, spool_fd: int, size: int,
                      node_id: int | None) -> WNode:
        """Make the spool's bytes the next version of parent/name (creating the file if new)."""
        check_name(name)
        change = Publish(self, parent_id, name, owner, spool_fd, size, node_id)
        await self.committer.submit(change)
        self.counters["publishes"] += 1
        self.counters["bytes_published"] += size
        self._wake()
        return change.node

    async def mkdir(self, parent_id: int, name: bytes, owner: Owner) -> WNode:
        change = MakeNode(self, parent_id, check_name(name), DIR, owner, b"")
        await self.committer.submit(change)
        return change.node

    async def symlink(self, parent_id: int, name: bytes, target: bytes, owner: Owner) -> WNode:
        if not target or b"\0" in target or len(target) > 4095:
            raise InvalidArgument("invalid symlink target")
        change = MakeNode(self, parent_id, check_name(name), LINK, owner, target)
        await self.committer.submit(change)
        return change.node

    async def remove(self, parent_id: int, name: bytes, want_dir: bool) -> WNode:
        change = Remove(self, parent_id, name, want_dir)
        await self.committer.submit(change)
        return change.node

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     noreplace: bool = False, exchange: bool = False) -> tuple[WNode, WNode | None]:
        change = Rename(self, old_parent, old_name, new_parent, check_name(new_name), noreplace, exchange)
        await self.committer.submit(change)
        self.counters["renames"] += 1
        self._wake()
        return change.node, change.replaced

    async def set_attrs(self, node: WNode, mode=None, uid=None, gid=None, mtime_ns=None) -> None:
        await self.committer.submit(SetAttrs(self, node, mode, uid, gid, mtime_ns))

    def collect_detached(self) -> None:
        """Free the versions of files that were unlinked or replaced while still read when
        the daemon stopped (their records were kept so a crash could not leak them)."""
        for node in self.detached_at_load:
            self.committer.submit_nowait(Collect(self, node))
        self.detached_at_load = []

    def opened(self, version: Version) -> None:
        version.readers += 1

    def closed(self, node: WNode, version: Version) -> None:
        version.readers -= 1
        if version.readers == 0 and self.collectable(node):
            self.committer.submit_nowait(Collect(self, node))

    def collectable(self, node: WNode) -> list[Version]:
        """Versions no longer kept: beyond the newest keep_versions (all, once unlinked) and unread."""
        keep = self.config.keep_versions if node.attached else 0
        old = node.versions[:-keep] if keep else list(node.versions)
        return [v for v in old if v.readers == 0]

    # ----- waiting for a newer version -----------------------------------------------

    def _wake(self) -> None:
        self._published.set()
        self._published = trio.Event()

    async def wait_newer(self, path: str, version: int, nonblocking: bool, abandoned=None) -> int:
        """Wait until the file at `path` has a version above `version`; return it (Interrupted
        once `abandoned()` says the caller gave up, distorefs/waiting.py)."""
        from .waiting import wait_event
        from .errors import WouldBlock
        while True:
            try:
                node = self.resolve(path)
                current = node.current.number if node.kind == FILE and node.current else 0
            except NotFound:
                current = 0
            if current > version:
                return current
            if nonblocking:
                raise WouldBlock(f"weights/{path} is at version {current}")
            await wait_event(self._published, abandoned, f"weights/{path}: waiting for a version")


def _key(node_id: int) -> bytes:
    return _ID.pack(node_id)


class _TreeChange(Change):
    def __init__(self, tree: WeightsTree) -> None:
        self.tree = tree
        self.conflict_key = ("weights",)  # tree changes are few: one per group keeps planning simple

    def _put(self, txn, node: WNode) -> None:
        txn.put(_key(node.id), node.record(), db=DB_WNODES)

    def _dir(self, node_id: int) -> WNode:
        node = self.tree.node(node_id)
        if node.kind != DIR:
            raise NotFound("not a directory")
        return node


class Publish(_TreeChange):
    def __init__(self, tree, parent_id, name, owner, spool_fd, size, node_id) -> None:
        super().__init__(tree)
        self.parent_id, self.name, self.owner = parent_id, name, owner
        self.fd, self.size, self.node_id = spool_fd, size, node_id

    def plan(self, overlay: Overlay) -> None:
        tree = self.tree
        parent = self._dir(self.parent_id)
        existing_id = parent.children.get(self.name)
        if self.node_id is not None and self.node_id in tree.nodes and tree.nodes[self.node_id].attached:
            base = tree.nodes[self.node_id]  # the file the writer opened, wherever it is now
        elif existing_id is not None:
            base = tree.nodes[existing_id]
            if base.kind != FILE:
                raise AlreadyExists(f"{self.name!r} exists and is not a file")
        else:
            base = None
        self.base = base
        if base is None:
            self.new_id = tree.next_id
            tree.next_id += 1
        self.number = (base.current.number if base is not None and base.current else 0) + 1
        self.mtime_ns = time.time_ns()
        self.chunks: list[StoredValue] = []

    def txn(self, txn) -> None:
        tree = self.tree
        step = tree.config.chunk_bytes
        # Chunk by chunk from the spool: one chunk in memory at a time. A rerun of the
        # transaction (map growth) stores them again; the first copies are garbage.
        chunks = []
        crc = 0
        node_id = self.base.id if self.base else self.new_id
        for i, off in enumerate(range(0, self.size, step)):
            raw = os.pread(self.fd, min(step, self.size - off), off)
            crc = zlib.crc32(raw, crc)
            # every version's chunks have their own keys: a reader may still hold the old ones
            vkey = b"w" + _key(node_id) + struct.pack(">QI", self.number, i)
            chunks.append(tree.values.put_raw(txn, vkey, raw, tree.config.compression))
        self.chunks = chunks
        self.checksum = crc & 0xFFFFFFFF
        if self.base is not None:
            version = Version(self.number, self.size, self.mtime_ns, self.chunks, self.checksum)
            self.node = replace(self.base, mtime_ns=self.mtime_ns, versions=[*self.base.versions, version])
        else:
            o = self.owner
            self.node = WNode(self.new_id, FILE, self.parent_id, self.name, o.mode, o.uid, o.gid, self.mtime_ns,
                              versions=[Version(1, self.size, self.mtime_ns, self.chunks, self.checksum)])
        self._put(txn, self.node)

    def apply(self) -> None:
        tree = self.tree
        if self.base is not None:
            # keep the live Version objects (their reader counts) and add the new one
            self.base.versions.append(self.node.versions[-1])
            self.base.mtime_ns = self.mtime_ns
            self.node = self.base
        else:
            tree.nodes[self.node.id] = self.node
            tree.nodes[self.parent_id].children[self.name] = self.node.id
        if tree.collectable(self.node):
            tree.committer.submit_nowait(Collect(tree, self.node))


class MakeNode(_TreeChange):
    def __init__(self, tree, parent_id, name, kind, owner, target) -> None:
        super().__init__(tree)
        self.parent_id, self.name, self.kind, self.owner, self.target = parent_id, name, kind, owner, target

    def plan(self, overlay: Overlay) -> None:
        parent = self._dir(self.parent_id)
        if self.name in parent.children:
            raise AlreadyExists(f"{self.name!r} exists")
        o = self.owner
        self.node = WNode(self.tree.next_id, self.kind, self.parent_id, self.name, o.mode, o.uid, o.gid,
                          time.time_ns(), self.target)
        self.tree.next_id += 1

    def txn(self, txn) -> None:
        self._put(txn, self.node)

    def apply(self) -> None:
        self.tree.nodes[self.node.id] = self.node
        self.tree.nodes[self.parent_id].children[self.name] = self.node.id


def _detach_txn(change: _TreeChange, txn, node: WNode) -> None:
    """Remove a node's record; its unread versions' chunks go with it. Versions still read
    wait for their last reader (Collect); until then the record stays, marked detached, so
    that a crash meanwhile leaves a record to free them by (at the next start), not a leak."""
    read = [v for v in node.versions if v.readers > 0]
    for version in node.versions:
        if version.readers == 0:
            change.tree.values.delete_all(txn, version.chunks)
    if read:
        txn.put(_key(node.id), replace(node, versions=read, attached=False).record(), db=DB_WNODES)
    else:
        txn.delete(_key(node.id), db=DB_WNODES)


def _detach_apply(tree: WeightsTree, node: WNode) -> None:
    parent = tree.nodes.get(node.parent)
    if parent is not None and parent.children.get(node.name) == node.id:
        del parent.children[node.name]
    node.attached = False
    node.versions = [v for v in node.versions if v.readers > 0]  # freed when their last reader closes
    if not node.versions:
        tree.nodes.pop(node.id, None)


class Remove(_TreeChange):
    def __init__(self, tree, parent_id, name, want_dir) -> None:
        super().__init__(tree)
        self.parent_id, self.name, self.want_dir = parent_id, name, want_dir

    def plan(self, overlay: Overlay) -> None:
        self.node = self.tree.child(self.parent_id, self.name)
        if self.want_dir:
            if self.node.kind != DIR:
                raise NotPermitted("not a directory")
            if self.node.children:
                raise NotEmpty(f"{self.name!r} is not empty")
        elif self.node.kind == DIR:
            raise NotPermitted("is a directory")

    def txn(self, txn) -> None:
        _detach_txn(self, txn, self.node)

    def apply(self) -> None:
        _detach_apply(self.tree, self.node)


class Rename(_TreeChange):
    def __init__(self, tree, old_parent, old_name, new_parent, new_name, noreplace, exchange) -> None:
        super().__init__(tree)
        self.old_parent, self.old_name = old_parent, old_name
        self.new_parent, self.new_name = new_parent, new_name
        self.noreplace, self.exchange = noreplace, exchange

    def plan(self, overlay: Overlay) -> None:
        tree = self.tree
        self.node = tree.child(self.old_parent, self.old_name)
        self._dir(self.new_parent)
        # a directory cannot move below itself
        p = self.new_parent
        while p:
            if p == self.node.id:
                raise InvalidArgument("cannot move a directory into itself")
            p = tree.nodes[p].parent if p != ROOT_ID else 0
        target_id = tree.nodes[self.new_parent].children.get(self.new_name)
        target = tree.nodes[target_id] if target_id is not None else None
        if target is self.node:
            target = None
        if self.exchange:
            if target is None:
                raise NotFound(f"no {self.new_name!r} to exchange with")
        elif target is not None:
            if self.noreplace:
                raise AlreadyExists(f"{self.new_name!r} exists")
            if (target.kind == DIR) != (self.node.kind == DIR):
                raise NotPermitted("rename between a directory and a non-directory")
            if target.kind == DIR and target.children:
                raise NotEmpty(f"{self.new_name!r} is not empty")
        self.target = target
        self.replaced = None if self.exchange else target

    def txn(self, txn) -> None:
        self._put(txn, replace(self.node, parent=self.new_parent, name=self.new_name))
        if self.exchange:
            self._put(txn, replace(self.target, parent=self.old_parent, name=self.old_name))
        elif self.target is not None:
            _detach_txn(self, txn, self.target)

    def apply(self) -> None:
        tree = self.tree
        old_parent, new_parent = tree.nodes[self.old_parent], tree.nodes[self.new_parent]
        if self.target is not None and not self.exchange:
            _detach_apply(tree, self.target)
        del old_parent.children[self.old_name]
        if self.exchange:
            self.target.parent, self.target.name = self.old_parent, self.old_name
            old_parent.children[self.old_name] = self.target.id
        new_parent.children[self.new_name] = self.node.id
        self.node.parent, self.node.name = self.new_parent, self.new_name


class SetAttrs(_TreeChange):
    def __init__(self, tree, node, mode, uid, gid, mtime_ns) -> None:
        super().__init__(tree)
        self.node = node
        self.values = {"mode": mode, "uid": uid, "gid": gid, "mtime_ns": mtime_ns}

    def txn(self, txn) -> None:
        if self.node.attached:
            self._put(txn, replace(self.node, **{k: v for k, v in self.values.items() if v is not None}))

    def apply(self) -> None:
        for k, v in self.values.items():
            if v is not None:
                setattr(self.node, k, v)


class Collect(_TreeChange):
    """Free versions no longer kept and no longer read."""

    def __init__(self, tree, node) -> None:
        super().__init__(tree)
        self.node = node

    def plan(self, overlay: Overlay) -> None:
        self.victims = self.tree.collectable(self.node)  # may be empty: collected already

    def txn(self, txn) -> None:
        for version in self.victims:
            self.tree.values.delete_all(txn, version.chunks)
        if self.victims:
            keep = [v for v in self.node.versions if v not in self.victims]
            if self.node.attached or keep:
                self._put(txn, replace(self.node, versions=keep))
            else:  # the last version of an unlinked file: its record goes too
                txn.delete(_key(self.node.id), db=DB_WNODES)

    def apply(self) -> None:
        node = self.node
        node.versions = [v for v in node.versions if v not in self.victims]
        self.tree.counters["versions_collected"] += len(self.victims)
        for version in self.victims:
            for i in range(len(version.chunks)):
                self.tree.values.cache.discard(("w", node.id, version.number, i))
        if not node.attached and not node.versions:
            self.tree.nodes.pop(node.id, None)


__all__ = ["WeightsTree", "WNode", "Version", "DIR", "FILE", "LINK", "ROOT_ID", "DB_WNODES"]

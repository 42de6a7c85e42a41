"""The parameter server (weights/): a general file tree whose files are lists of versions.

The tree follows the rules every general file tree here shares (names and renames:
distorefs/treerules.py; modes, owners, times: distorefs/fileattrs.py); this module adds
the weights policy: what readers see of a file is its newest *published* version, whole.

- A file exists from its create (empty, version 0, until something is published).
- Its writers share one draft (distorefs/draft.py: sparse, copy on write over the current
  version); every close() of a writer (a process exiting closes its files the same way),
  every fsync, and a rename of the file publish the draft as the next version, in one
  transaction (only the chunks written are stored; holes stay holes).
- A rename over an existing file is a new version of that name: the file renamed in gets
  a version number above the replaced one's (safetensors writes a temp file, renames it).
- A reader reads the version it opened to its end, whatever is published meanwhile;
  versions beyond the newest `keep_versions` are collected once no handle holds them.
- A file removed while open keeps working for its handles and publishes nothing more.

Inodes (`gen`): a file is one inode for its life. The one exception keeps readers'
cached pages true to their version: a writer that opens a file while another process
holds its published version open through the page cache is given a new inode (`gen`+1,
see `open_write`), which the name moves to at the next publish, as `write tmp; rename`
gives on a local filesystem.

Crash safety: the tree and every version live in LMDB records written in the publishing
transaction; drafts are scratch in spool files (removed at open). A kill -9 before the
commit leaves the previous version; after it, the new one, whole.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, ContextManager, cast

import trio

from .codec import crc32_combine, zeros_crc32
from .committer import Change, Overlay
from .config import WeightsConfig
from .draft import Draft
from .errors import AlreadyExists, InvalidArgument, NotFound, NotPermitted, Stale
from .fileattrs import AttrChange, apply_setattr, changed, modified, now_ns, times_from
from .later import Later
from .names import check_name
from .owner import Owner
from .services import Services
from .treerules import check_create, check_remove, check_rename
from .values import StoredValue, WarmResult

log = logging.getLogger(__name__)

DB_WNODES = b"wnodes"
ROOT_ID = 1
_ID = struct.Struct(">Q")
DIR, FILE, LINK = "dir", "file", "link"
# A shared store: chunks of a version collected here stay in the cluster this long, for
# readers on other nodes that still read that version (past it they get EIO).
SHARED_GRACE_S = 60.0


@dataclass(eq=False)
class Version:
    number: int
    size: int
    mtime_ns: int
    chunks: list[StoredValue | None]  # None: a hole (reads as zeros)
    checksum: int = 0  # CRC-32 of the whole content
    chunk_bytes: int = 0  # 0: every chunk but the last is full (versions before holes)
    readers: int = 0  # open handles and drafts built on it (memory only)
    gen: int = 0  # the inode generation it was published under (memory only)
    # A change that frees it is on its way (memory only): from its planning on, no open takes
    # it (its chunks go in that change's transaction, while the event loop serves opens).
    freeing: bool = False
    # When it stopped being what its name opens: a newer version published, or its file
    # replaced or removed (memory only, time.monotonic(); 0: before this run).
    retired_at: float = 0.0

    def to_dict(self) -> dict:
        return {"number": self.number, "size": self.size, "mtime_ns": self.mtime_ns, "checksum": self.checksum,
                "chunk_bytes": self.chunk_bytes,
                "chunks": [c.to_json() if c is not None else None for c in self.chunks]}

    @classmethod
    def from_dict(cls, d: dict) -> "Version":
        return cls(d["number"], d["size"], d["mtime_ns"],
                   [StoredValue.from_json(c) if c is not None else None for c in d["chunks"]], d.get("checksum", 0),
                   d.get("chunk_bytes", 0))

    def step(self, default: int) -> int:
        if self.chunk_bytes:
            return self.chunk_bytes
        first = next((c for c in self.chunks if c is not None), None)
        return first.size if first is not None and len(self.chunks) > 1 else default


@dataclass(eq=False)
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
    atime_ns: int = 0
    ctime_ns: int = 0
    children: dict[bytes, int] = field(default_factory=dict)  # memory only
    attached: bool = True  # False once unlinked or replaced (memory only)
    subdirs: int = 0  # memory only: for the link count
    # memory only: open files
    gen: int = 0  # the inode the name shows
    next_gen: int = 1
    redirect_gen: int | None = None  # the inode a writer refused on `gen` is sent to
    draft: Draft | None = None
    draft_gen: int = 0
    draft_base: Version | None = None
    writers: int = 0
    handles: int = 0
    cached_readers: dict[int, int] = field(default_factory=dict)  # gen -> read handles using the page cache

    @property
    def current(self) -> Version | None:
        return self.versions[-1] if self.versions else None

    @property
    def is_dir(self) -> bool:
        return self.kind == DIR

    @property
    def number(self) -> int:
        return self.versions[-1].number if self.versions else 0

    def record(self) -> bytes:
        return json.dumps({"kind": self.kind, "parent": self.parent, "name": self.name.hex(),
                           "mode": self.mode, "uid": self.uid, "gid": self.gid, "mtime_ns": self.mtime_ns,
                           "atime_ns": self.atime_ns, "ctime_ns": self.ctime_ns,
                           "target": self.target.hex(),
                           "versions": [v.to_dict() for v in self.versions],
                           **({} if self.attached else {"detached": True})}).encode()

    @classmethod
    def from_record(cls, node_id: int, data: bytes) -> "WNode":
        d = json.loads(data)
        atime, mtime, ctime = times_from(d, d["mtime_ns"])
        return cls(node_id, d["kind"], d["parent"], bytes.fromhex(d["name"]), d["mode"], d["uid"], d["gid"],
                   mtime, bytes.fromhex(d["target"]), [Version.from_dict(v) for v in d["versions"]],
                   atime, ctime, attached=not d.get("detached", False))

    def copy(self, **changes) -> "WNode":
        """A copy for a record written before the change applies (memory-only fields left out)."""
        return replace(self, children={}, draft=None, draft_base=None, cached_readers={}, **changes)


def _crc_of(chunks: list[StoredValue | None], size: int, step: int) -> int:
    """CRC-32 of a content from its chunks' own CRCs; holes and short chunks read as zeros."""
    crc = 0
    for i, c in enumerate(chunks):
        slot = max(0, min(step, size - i * step))
        have = min(c.size, slot) if c is not None else 0
        if have:
            crc = crc32_combine(crc, c.checksum, have)  # type: ignore[union-attr]
        if slot > have:
            crc = crc32_combine(crc, zeros_crc32(slot - have), slot - have)
    return crc


class ReadHandle:
    """A read-only open: the version it opened, read to its end."""

    def __init__(self, tree: "WeightsTree", node: WNode, version: Version | None, gen: int, page_cache: bool) -> None:
        self.tree, self.node, self.version, self.gen, self.page_cache = tree, node, version, gen, page_cache
        node.handles += 1
        if version is not None:
            version.readers += 1
        if page_cache:
            node.cached_readers[gen] = node.cached_readers.get(gen, 0) + 1

    async def read(self, off: int, size: int) -> bytes:
        if self.version is None:
            return b""
        return await self.tree.read(self.node, self.version, off, size)

    def release(self) -> None:
        node = self.node
        node.handles -= 1
        if self.page_cache:
            node.cached_readers[self.gen] -= 1
            if not node.cached_readers[self.gen]:
                del node.cached_readers[self.gen]
        if self.version is not None:
            self.tree.closed(node, self.version)
        self.tree.forget_if_unused(node)


class WriteHandle:
    """An open for writing: reads and writes go to the file's draft, shared by its writers."""

    def __init__(self, tree: "WeightsTree", node: WNode, readable: bool) -> None:
        self.tree, self.node, self.readable = tree, node, readable
        self.failed: Exception | None = None
        node.handles += 1
        node.writers += 1

    @property
    def draft(self) -> Draft:
        assert self.node.draft is not None
        return self.node.draft

    async def read(self, off: int, size: int) -> bytes:
        if not self.readable:
            raise NotPermitted("not open for reading")
        return await self.draft.read(off, size)

    async def write(self, off: int, data) -> int:
        try:
            n = await self.draft.write(off, data)
        except OSError as exc:  # the spool's disk: the close reports it, nothing half is published
            self.failed = exc
            raise
        modified(self.node)
        return n

    async def truncate(self, size: int) -> None:
        await self.draft.truncate(size)
        modified(self.node)

    async def flush(self) -> None:
        """close(): publish what the writers changed (nothing once the file was removed)."""
        if self.failed is not None:
            raise self.failed
        await self.tree.publish(self.node)

    async def release(self) -> None:
        node = self.node
        node.handles -= 1
        node.writers -= 1
        try:
            if node.writers == 0 and self.failed is None:
                await self.tree.publish(node)
        finally:
            if node.writers == 0:
                self.tree.drop_draft(node)
            self.tree.forget_if_unused(node)


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
        # A shared store: entered while a caller waits for a newer version, so the follower
        # applies other nodes' publishes without lingering (distorefs/follower.py).
        self.attending: Callable[[], ContextManager[None]] = nullcontext
        self.detached_at_load: list[WNode] = []  # unlinked while read when the daemon last stopped
        self._later = Later(services.spawn)  # collections waiting out the grace
        # A shared store: tells the other nodes of a change this node made (published,
        # made a directory, removed, renamed: distorefs/weightslog.py), and chunks are
        # stored in the cluster. None on a node-local store.
        self.announce: Callable[..., Awaitable[None]] | None = None

    # ----- loading -------------------------------------------------------------------

    def load(self, txn) -> None:
        """Rebuild the tree (at store open); create the root on a new store."""
        for k, v in txn.cursor(DB_WNODES):
            node = WNode.from_record(_ID.unpack(bytes(k))[0], bytes(v))
            self.nodes[node.id] = node
            self.next_id = max(self.next_id, node.id + 1)
        if ROOT_ID not in self.nodes:
            now = time.time_ns()
            self.nodes[ROOT_ID] = WNode(ROOT_ID, DIR, 0, b"", 0o40755, os.getuid(), os.getgid(), now,
                                        atime_ns=now, ctime_ns=now)
        for node in self.nodes.values():
            if not node.attached:  # its versions are free now: collect() them once running
                self.detached_at_load.append(node)
            elif node.id != ROOT_ID:
                parent = self.nodes.get(node.parent)
                if parent is None:
                    log.error("weights node %d has no parent %d: left out", node.id, node.parent)
                    continue
                parent.children[node.name] = node.id
                if node.kind == DIR:
                    parent.subdirs += 1

    # ----- queries -------------------------------------------------------------------

    def node(self, node_id: int) -> WNode:
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"weights node {node_id} is gone")
        return node

    def dir(self, node_id: int) -> WNode:
        node = self.node(node_id)
        if node.kind != DIR:
            raise NotFound("not a directory")
        if not node.attached:
            raise NotFound("the directory was removed")
        return node

    def child(self, parent_id: int, name: bytes) -> WNode:
        check_name(name)
        child_id = self.dir(parent_id).children.get(name)
        if child_id is None:
            raise NotFound(f"no {name!r}")
        return self.nodes[child_id]

    def child_or_none(self, parent_id: int, name: bytes) -> WNode | None:
        child_id = self.dir(parent_id).children.get(name)
        return None if child_id is None else self.nodes[child_id]

    def path_of(self, node: WNode) -> str:
        parts = []
        while node.id != ROOT_ID and node.parent in self.nodes:
            parts.append(node.name.decode("utf-8", "surrogateescape"))
            node = self.nodes[node.parent]
        return "weights/" + "/".join(reversed(parts))

    def resolve(self, path: str) -> WNode:
        """A node by its path below weights/ (for the wait control file)."""
        node = self.nodes[ROOT_ID]
        for part in [p for p in path.split("/") if p]:
            node = self.child(node.id, part.encode("utf-8", "surrogateescape"))
        return node

    def ancestors(self, node_id: int):
        """node_id and every directory above it."""
        while node_id in self.nodes:
            yield node_id
            if node_id == ROOT_ID:
                return
            node_id = self.nodes[node_id].parent

    def size_of(self, node: WNode, gen: int) -> int:
        """What stat shows through inode `gen` of a file: its draft's size while the draft is
        on that inode, else the version published under it."""
        if node.draft is not None and node.draft_gen == gen:
            return node.draft.size
        if gen == node.redirect_gen:  # the writers' inode, before they open it: what they start from
            gen = node.gen
        version = self.version_at(node, gen)
        return version.size if version is not None else 0

    def settled(self, node: WNode, gen: int) -> bool:
        """Whether what inode `gen` shows can change (a draft on it, or one to come)."""
        return not ((node.draft is not None and node.draft_gen == gen) or gen == node.redirect_gen)

    def version_at(self, node: WNode, gen: int) -> Version | None:
        """The version an open of inode `gen` reads: the current one, or for an inode the
        name has moved on from, the last version published under it."""
        if gen == node.gen:
            return node.current
        for v in reversed(node.versions):
            if v.gen == gen:
                return v
        return None

    def stats(self) -> dict:
        files = [n for n in self.nodes.values() if n.kind == FILE]
        versions = [v for n in files for v in n.versions]
        stored = {(c.tier, c.loc): c.stored_size for v in versions for c in v.chunks if c is not None}
        return {
            "files": len(files),
            "directories": sum(1 for n in self.nodes.values() if n.kind == DIR),
            "symlinks": sum(1 for n in self.nodes.values() if n.kind == LINK),
            "versions": len(versions),
            "bytes": sum(v.size for v in versions),
            "stored_bytes": sum(stored.values()),
            "open_readers": sum(v.readers for v in versions),
            "open_writers": sum(n.writers for n in files),
            "keep_versions": self.config.keep_versions,
            "max_file_bytes": self.config.max_file_bytes,
            **self.counters,
        }

    # ----- reads ---------------------------------------------------------------------

    async def read(self, node: WNode, version: Version, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of one version, chunk by chunk through the memory tier."""
        end = min(off + size, version.size)
        if off >= end:
            return b""
        step = version.step(self.config.chunk_bytes)
        parts: list[bytes | memoryview] = []
        for i in range(off // step, (end - 1) // step + 1):
            lo, hi = max(off - i * step, 0), min(end - i * step, step)
            chunk = version.chunks[i] if i < len(version.chunks) else None
            if chunk is None:
                parts.append(bytes(hi - lo))
                continue
            data = await self._chunk(node, version, i)
            piece = memoryview(data)[lo:hi]
            parts.append(piece if len(piece) == hi - lo else bytes(piece) + bytes(hi - lo - len(piece)))
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)

    async def warm(self, node: WNode, version: Version) -> WarmResult:
        """Load a version's stored chunks into the memory tier (distorefs warmup), under the
        keys its reads look for (holes have nothing to load)."""
        path = self.path_of(node)
        return await self.values.warm([(("wv", c.tier, c.loc), c, f"{path} version {version.number} chunk {i}")
                                       for i, c in enumerate(version.chunks) if c is not None])

    async def _chunk(self, node: WNode, version: Version, index: int) -> bytes:
        chunk = version.chunks[index]
        assert chunk is not None
        what = f"{self.path_of(node)} version {version.number} chunk {index}"
        return await self.values.fetch_one(("wv", chunk.tier, chunk.loc), chunk, what)

    # ----- opening files ---------------------------------------------------------------

    def open_read(self, node: WNode, gen: int) -> ReadHandle:
        if node.kind != FILE:
            raise NotPermitted("not a file")
        version = self.version_at(node, gen)
        if version is not None and version.freeing:
            raise Stale("the version this inode shows is being collected")  # the name's current one is opened instead
        if version is None and not node.attached:
            # Replaced (a rename over it, here or on another node) or removed between the
            # reader's lookup and this open, with no handle holding a version of it: an
            # empty read would be a torn one. The kernel looks the name up again and opens
            # what it names now.
            raise Stale("the file was replaced or removed after it was looked up")
        # The page cache of inode `gen` holds its published content unless a draft is being
        # written through that very inode: readers then read past the cache (direct I/O).
        page_cache = not (node.draft is not None and node.draft_gen == gen)
        return ReadHandle(self, node, version, gen, page_cache)

    async def open_write(self, node: WNode, gen: int, *, truncate: bool, readable: bool,
                         redirect: bool = True) -> WriteHandle:
        """An open for writing through inode `gen`. Stale (the kernel looks the name up
        again, and gets `redirect_gen`) when the writer must not use that inode: other
        processes read its published version through the page cache, which the writer's
        O_TRUNC and writes would change under them."""
        if node.kind != FILE:
            raise NotPermitted("not a file")
        if node.draft is None:
            others = node.cached_readers.get(gen, 0)
            if others and redirect:
                if node.redirect_gen is None:
                    node.redirect_gen = node.next_gen
                    node.next_gen += 1
                raise Stale("the file is read through the page cache: its writer gets an inode of its own")
            draft_gen = gen
            if node.redirect_gen is not None and gen == node.redirect_gen:
                node.redirect_gen = None
            base = self.version_at(node, node.gen)
            step = self.config.chunk_bytes
            chunks: list[StoredValue | None] = []
            if base is not None:
                bstep = base.step(step)
                if bstep == step:
                    chunks = list(base.chunks)
                    base.readers += 1
                    node.draft_base = base
            draft = Draft(self.spool_dir, step, self.config.max_file_bytes, chunks,
                          base.size if base is not None else 0, self._fetcher(node))
            if base is not None and node.draft_base is None and base.size:
                # a version of another chunk size: copied into the draft once
                for off in range(0, base.size, step):
                    await draft.write(off, await self.read(node, base, off, step))
                draft.changes = 0
            node.draft, node.draft_gen = draft, draft_gen
        elif gen != node.draft_gen:
            if redirect:
                node.redirect_gen = node.draft_gen
                raise Stale("the file's writers share an inode of their own")
        handle = WriteHandle(self, node, readable)
        if truncate:
            try:
                await handle.truncate(0)
            except BaseException:
                await handle.release()
                raise
        return handle

    def lookup_gen(self, node: WNode, redirected: bool) -> int:
        """The inode generation a lookup of the file's name answers (a writer refused with
        Stale is sent to the writers' inode)."""
        if redirected and node.draft is not None:
            return node.draft_gen
        if redirected and node.redirect_gen is not None:
            return node.redirect_gen
        return node.gen

    def _fetcher(self, node: WNode):
        async def fetch(index: int, chunk: StoredValue) -> bytes:
            what = f"{self.path_of(node)} chunk {index}"
            return await self.values.fetch_one(("wv", chunk.tier, chunk.loc), chunk, what)
        return fetch

    def drop_draft(self, node: WNode) -> None:
        if node.draft is not None:
            node.draft.close()
            node.draft = None
        if node.draft_base is not None:
            base, node.draft_base = node.draft_base, None
            self.closed(node, base)

    def forget_if_unused(self, node: WNode) -> None:
        if not node.attached and not node.handles and not node.versions:
            self.nodes.pop(node.id, None)

    # ----- publishing ----------------------------------------------------------------

    async def publish(self, node: WNode) -> None:
        """The draft's content as the file's next version (nothing if unchanged, or if the
        file was removed meanwhile)."""
        draft = node.draft
        if draft is None or not draft.changes or not node.attached:
            return
        async with draft.lock:
            if not draft.changes or not node.attached:
                return
            change = Publish(self, node, draft)
            await self.committer.submit(change)
            if self.announce is not None:  # durable in the cluster before close() returns
                await self.announce("wpublish", self.path_of(node), mode=node.mode, uid=node.uid, gid=node.gid,
                                    version=json.dumps(change.version.to_dict()))
        self.counters["publishes"] += 1
        self.counters["bytes_published"] += change.version.size
        self.wake()

    async def write_file(self, parent_id: int, name: bytes, data: bytes, owner: Owner) -> WNode:
        """Create (or rewrite) a file with `data` and publish it, as open/write/close does."""
        node, _ = await self.create(parent_id, name, owner, exclusive=False)
        writer = await self.open_write(node, node.draft_gen if node.draft else node.gen, truncate=True,
                                       readable=False, redirect=False)
        try:
            await writer.write(0, data)
            await writer.flush()
        finally:
            await writer.release()
        return node

    # ----- tree changes --------------------------------------------------------------

    async def create(self, parent_id: int, name: bytes, owner: Owner, exclusive: bool) -> tuple[WNode, bool]:
        """A new empty file, or the file already there (unless `exclusive`); (node, created)."""
        existing = self.child_or_none(parent_id, name)
        check_create(name, existing, exclusive)
        if existing is not None:
            if existing.kind == DIR:
                raise NotPermitted(f"{name!r} is a directory")
            return existing, False
        change = MakeNode(self, parent_id, name, FILE, owner, b"")
        await self.committer.submit(change)
        return change.node, True

    async def mkdir(self, parent_id: int, name: bytes, owner: Owner) -> WNode:
        check_create(name, self.child_or_none(parent_id, name), True)
        change = MakeNode(self, parent_id, name, DIR, owner, b"")
        await self.committer.submit(change)
        if self.announce is not None:
            node = change.node
            await self.announce("wmkdir", self.path_of(node), mode=node.mode, uid=node.uid, gid=node.gid)
        return change.node

    async def symlink(self, parent_id: int, name: bytes, target: bytes, owner: Owner) -> WNode:
        if not target or b"\0" in target or len(target) > 4095:
            raise InvalidArgument("invalid symlink target")
        check_create(name, self.child_or_none(parent_id, name), True)
        change = MakeNode(self, parent_id, name, LINK, owner, target)
        await self.committer.submit(change)
        return change.node

    async def remove(self, parent_id: int, name: bytes, want_dir: bool) -> WNode:
        path = self.path_of(self.child(parent_id, name)) if self.announce is not None else ""
        change = Remove(self, parent_id, name, want_dir)
        await self.committer.submit(change)
        if self.announce is not None:
            await self.announce("wremove", path)
        return change.node

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     noreplace: bool = False, exchange: bool = False) -> tuple[WNode, WNode | None]:
        node = self.child(old_parent, old_name)
        if node.kind == FILE:
            await self.publish(node)  # a file still being written moves with what it holds
        old_path = self.path_of(node)
        change = Rename(self, old_parent, old_name, new_parent, new_name, noreplace, exchange)
        await self.committer.submit(change)
        if self.announce is not None:
            await self.announce("wrename", old_path, to=self.path_of(change.node), exchange=int(exchange))
        self.counters["renames"] += 1
        self.wake()
        return change.node, change.replaced

    async def setattr(self, node: WNode, change: AttrChange, handle: WriteHandle | None = None) -> None:
        """chmod, chown, utimes, and truncate (through the writer's handle, or by path: a
        draft of its own, published at once)."""
        if change.size is not None:
            if node.kind != FILE:
                raise NotPermitted("not a file")
            if handle is not None:
                await handle.truncate(change.size)
            else:
                writer = await self.open_write(node, node.draft_gen if node.draft else node.gen,
                                               truncate=False, readable=False, redirect=False)
                try:
                    await writer.truncate(change.size)
                    await writer.flush()
                finally:
                    await writer.release()
        if not change.metadata_only or not change.empty():
            await self.committer.submit(SetAttrs(self, node, change))

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
        if version.readers == 0:
            self.collect_unkept(node)

    # A version retired this recently is not collected yet: a reader that looked its name up
    # just before a publish or a rename over it (the lookup and the open are two requests,
    # and the kernel retries a Stale open only once) still opens what it looked up.
    RETIRE_GRACE_S = 1.0

    def collect_unkept(self, node: WNode) -> None:
        """Queue the collection of `node`'s versions no longer kept, if it has any: those past
        their retirement grace now, the others once theirs has passed."""
        cutoff = time.monotonic() - self.RETIRE_GRACE_S
        unkept = self._unkept(node)
        if any(v.retired_at <= cutoff for v in unkept):
            self.committer.submit_nowait(Collect(self, node))
        waiting = [v.retired_at for v in unkept if v.retired_at > cutoff]
        if waiting:
            self._later.call(node.id, min(waiting) - cutoff, self.collect_unkept, node)

    def _unkept(self, node: WNode) -> list[Version]:
        """Versions beyond the newest keep_versions (all, once unlinked) that nobody reads."""
        keep = self.config.keep_versions if node.attached else 0
        old = node.versions[:-keep] if keep else list(node.versions)
        return [v for v in old if v.readers == 0]

    def collectable(self, node: WNode) -> list[Version]:
        """Versions no longer kept: unkept (above) and retired longer than the grace."""
        oldest = time.monotonic() - self.RETIRE_GRACE_S
        return [v for v in self._unkept(node) if v.retired_at <= oldest]

    # ----- waiting for a newer version -----------------------------------------------

    def wake(self) -> None:
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
                current = node.number if node.kind == FILE else 0
            except NotFound:
                current = 0
            if current > version:
                return current
            if nonblocking:
                raise WouldBlock(f"weights/{path} is at version {current}")
            with self.attending():
                await wait_event(self._published, abandoned, f"weights/{path}: waiting for a version")


def _key(node_id: int) -> bytes:
    return _ID.pack(node_id)


def _values_of(versions) -> set:
    return {(c.tier, c.loc) for v in versions for c in v.chunks if c is not None}


def free_versions(tree: WeightsTree, txn, victims: list[Version], kept: list[Version]) -> None:
    """Free the chunks of `victims` that no version in `kept` shares (a rewrite keeps the
    chunks it did not change)."""
    keep = _values_of(kept)
    seen: set = set()
    for version in victims:
        for c in version.chunks:
            if c is not None and (c.tier, c.loc) not in keep and (c.tier, c.loc) not in seen:
                seen.add((c.tier, c.loc))
                tree.values.delete(txn, c, grace=SHARED_GRACE_S)


class _TreeChange(Change):
    def __init__(self, tree: WeightsTree) -> None:
        self.tree = tree
        self.conflict_key = ("weights",)  # tree changes are few: one per group keeps planning simple

    def _put(self, txn, node: WNode) -> None:
        txn.put(_key(node.id), node.record(), db=DB_WNODES)

    def _touch_dir(self, txn, dir_id: int, now: int) -> None:
        parent = self.tree.nodes.get(dir_id)
        if parent is not None:
            self._put(txn, parent.copy(mtime_ns=now, ctime_ns=now))

    def _dir(self, node_id: int) -> WNode:
        return self.tree.dir(node_id)


def retire_current(node: WNode) -> None:
    """The version `node`'s name opens stops being that (a newer one is published, or the
    file is replaced or removed): its retirement grace starts."""
    if node.versions:
        node.versions[-1].retired_at = time.monotonic()


class Publish(_TreeChange):
    """A draft as the file's next version: the chunks written are stored, the others kept."""

    def __init__(self, tree: WeightsTree, node: WNode, draft: Draft) -> None:
        super().__init__(tree)
        self.node, self.draft = node, draft

    def plan(self, overlay: Overlay) -> None:
        if not self.node.attached:
            raise NotFound(f"{self.tree.path_of(self.node)} was removed")
        self.layout = self.draft.plan()
        self.size = self.draft.size
        self.number = self.node.number + 1
        self.mtime_ns = self.node.mtime_ns

    def txn(self, txn) -> None:
        tree, draft = self.tree, self.draft
        step = draft.chunk_bytes
        chunks: list[StoredValue | None] = []
        # A rerun of the transaction (map growth) stores them again; the first copies are garbage.
        for i, part in enumerate(self.layout):
            if isinstance(part, int):
                raw = draft.chunk(part)
                if raw is None:
                    chunks.append(None)
                    continue
                # every version's chunks have their own keys: a reader may still hold the old ones
                vkey = b"w" + _key(self.node.id) + struct.pack(">QI", self.number, i)
                chunks.append(tree.values.put_raw(txn, vkey, raw, tree.config.compression,
                                                  shared=tree.announce is not None))
            else:
                chunks.append(part)
        while chunks and chunks[-1] is None:
            chunks.pop()
        self.version = Version(self.number, self.size, self.mtime_ns, chunks, _crc_of(chunks, self.size, step), step)
        self._put(txn, self.node.copy(versions=[*self.node.versions, self.version]))

    def apply(self) -> None:
        tree, node, draft = self.tree, self.node, self.draft
        self.version.gen = node.draft_gen
        retire_current(node)
        node.versions.append(self.version)
        node.gen = node.draft_gen
        # the draft goes on from what was just published
        draft.base = list(self.version.chunks)
        draft.written = set()
        draft.changes = 0
        if node.draft_base is not None:
            old, node.draft_base = node.draft_base, None
            old.readers -= 1
        self.version.readers += 1
        node.draft_base = self.version
        tree.collect_unkept(node)


class MakeNode(_TreeChange):
    def __init__(self, tree, parent_id, name, kind, owner, target) -> None:
        super().__init__(tree)
        self.parent_id, self.name, self.kind, self.owner, self.target = parent_id, name, kind, owner, target

    def plan(self, overlay: Overlay) -> None:
        parent = self._dir(self.parent_id)
        if self.name in parent.children:
            raise AlreadyExists(f"{self.name!r} exists")
        o = self.owner
        self.now = now_ns()
        self.node = WNode(self.tree.next_id, self.kind, self.parent_id, self.name, o.mode, o.uid, o.gid,
                          self.now, self.target, atime_ns=self.now, ctime_ns=self.now)
        self.tree.next_id += 1

    def txn(self, txn) -> None:
        self._put(txn, self.node)
        self._touch_dir(txn, self.parent_id, self.now)

    def apply(self) -> None:
        parent = self.tree.nodes[self.parent_id]
        self.tree.nodes[self.node.id] = self.node
        parent.children[self.name] = self.node.id
        parent.mtime_ns = parent.ctime_ns = self.now
        if self.kind == DIR:
            parent.subdirs += 1


def _detach_txn(change: _TreeChange, txn, node: WNode) -> None:
    """Remove a node from the tree. Its versions are freed by a Collect once it is applied
    (each when no handle reads it): until then the record stays, marked detached, so that a
    crash meanwhile leaves a record to free them by (at the next start), not a leak. Which
    versions are read can only be known on the event loop, where opens take them: a
    transaction that freed the unread ones here would race an open of the name, which still
    names this node until the change is applied."""
    if node.versions:
        txn.put(_key(node.id), node.copy(attached=False).record(), db=DB_WNODES)
    else:
        txn.delete(_key(node.id), db=DB_WNODES)


def _detach_apply(tree: WeightsTree, node: WNode) -> None:
    parent = tree.nodes.get(node.parent)
    if parent is not None and parent.children.get(node.name) == node.id:
        del parent.children[node.name]
        if node.kind == DIR:
            parent.subdirs -= 1
    node.attached = False
    retire_current(node)
    changed(node)
    tree.collect_unkept(node)  # what no handle reads goes now; the rest when its last reader closes
    tree.forget_if_unused(node)


class Remove(_TreeChange):
    def __init__(self, tree, parent_id, name, want_dir) -> None:
        super().__init__(tree)
        self.parent_id, self.name, self.want_dir = parent_id, name, want_dir

    def plan(self, overlay: Overlay) -> None:
        node = self.tree.child_or_none(self.parent_id, self.name)
        # the emptiness test runs only once check_remove found the node
        check_remove(node, self.name, self.want_dir, lambda: not cast(WNode, node).children)
        assert node is not None  # check_remove raised NotFound
        self.node = node
        self.now = now_ns()

    def txn(self, txn) -> None:
        _detach_txn(self, txn, self.node)
        self._touch_dir(txn, self.parent_id, self.now)

    def apply(self) -> None:
        _detach_apply(self.tree, self.node)
        parent = self.tree.nodes[self.parent_id]
        parent.mtime_ns = parent.ctime_ns = self.now


class Rename(_TreeChange):
    def __init__(self, tree, old_parent, old_name, new_parent, new_name, noreplace, exchange) -> None:
        super().__init__(tree)
        self.old_parent, self.old_name = old_parent, old_name
        self.new_parent, self.new_name = new_parent, new_name
        self.noreplace, self.exchange = noreplace, exchange

    def plan(self, overlay: Overlay) -> None:
        tree = self.tree
        node = tree.child_or_none(self.old_parent, self.old_name)
        self._dir(self.new_parent)
        target = tree.child_or_none(self.new_parent, self.new_name)
        # the emptiness test runs only once check_rename has a target
        check_rename(node, self.old_name, target, self.new_name, tree.ancestors(self.new_parent),
                     noreplace=self.noreplace, exchange=self.exchange,
                     target_empty=lambda: not cast(WNode, target).children)
        assert node is not None  # check_rename raised NotFound
        self.node = node
        if self.exchange and node.kind == DIR and target is not None and target.id in set(
                tree.ancestors(self.old_parent)):
            raise InvalidArgument("cannot move a directory below itself")
        if target is node:
            target = None
            self.noop = True
        else:
            self.noop = False
        self.target = target
        self.replaced = None if self.exchange else target
        self.now = now_ns()
        # a rename over a file is a new version of that name: numbers go on from the replaced one's
        self.number = None
        if (not self.exchange and target is not None and target.kind == FILE and node.kind == FILE
                and node.current is not None and node.current.number <= target.number):
            self.number = target.number + 1

    def txn(self, txn) -> None:
        if self.noop:
            return
        node = self.node
        versions = node.versions
        if self.number is not None:
            versions = [*node.versions[:-1], replace(node.versions[-1], number=self.number)]
        self._put(txn, node.copy(parent=self.new_parent, name=self.new_name, versions=versions, ctime_ns=self.now))
        if self.exchange:
            assert self.target is not None  # check_rename refused an exchange with nothing
            self._put(txn, self.target.copy(parent=self.old_parent, name=self.old_name, ctime_ns=self.now))
        elif self.target is not None:
            _detach_txn(self, txn, self.target)
        self._touch_dir(txn, self.old_parent, self.now)
        if self.new_parent != self.old_parent:
            self._touch_dir(txn, self.new_parent, self.now)

    def apply(self) -> None:
        if self.noop:
            return
        tree, node = self.tree, self.node
        old_parent, new_parent = tree.nodes[self.old_parent], tree.nodes[self.new_parent]
        if self.target is not None and not self.exchange:
            _detach_apply(tree, self.target)
        del old_parent.children[self.old_name]
        if self.exchange:
            assert self.target is not None  # check_rename refused an exchange with nothing
            self.target.parent, self.target.name = self.old_parent, self.old_name
            old_parent.children[self.old_name] = self.target.id
            changed(self.target, self.now)
            if self.target.kind == DIR:
                new_parent.subdirs -= 1
                old_parent.subdirs += 1
        new_parent.children[self.new_name] = node.id
        node.parent, node.name = self.new_parent, self.new_name
        if node.kind == DIR:
            old_parent.subdirs -= 1
            new_parent.subdirs += 1
        if self.number is not None:
            node.versions[-1].number = self.number
        changed(node, self.now)
        for d in (old_parent, new_parent):
            d.mtime_ns = d.ctime_ns = self.now


class SetAttrs(_TreeChange):
    def __init__(self, tree, node: WNode, change: AttrChange) -> None:
        super().__init__(tree)
        self.node = node
        self.change = change

    def plan(self, overlay: Overlay) -> None:
        self.updated = self.node.copy()
        apply_setattr(self.updated, self.change)

    def txn(self, txn) -> None:
        if self.node.attached:
            self._put(txn, self.node.copy(mode=self.updated.mode, uid=self.updated.uid, gid=self.updated.gid,
                                          atime_ns=self.updated.atime_ns, mtime_ns=self.updated.mtime_ns,
                                          ctime_ns=self.updated.ctime_ns))

    def apply(self) -> None:
        u = self.updated
        n = self.node
        n.mode, n.uid, n.gid, n.atime_ns, n.mtime_ns, n.ctime_ns = u.mode, u.uid, u.gid, u.atime_ns, u.mtime_ns, u.ctime_ns


class Collect(_TreeChange):
    """Free versions no longer kept and no longer read."""

    def __init__(self, tree, node) -> None:
        super().__init__(tree)
        self.node = node

    def plan(self, overlay: Overlay) -> None:
        self.victims = self.tree.collectable(self.node)  # may be empty: collected already
        for v in self.victims:
            v.freeing = True

    def failed(self) -> None:
        for v in self.victims:
            v.freeing = False

    def txn(self, txn) -> None:
        keep = [v for v in self.node.versions if v not in self.victims]
        free_versions(self.tree, txn, self.victims, keep)
        if self.victims:
            if self.node.attached or keep:
                self._put(txn, self.node.copy(versions=keep))
            else:  # the last version of an unlinked file: its record goes too
                txn.delete(_key(self.node.id), db=DB_WNODES)

    def apply(self) -> None:
        node = self.node
        kept = [v for v in node.versions if v not in self.victims]
        still = _values_of(kept)
        node.versions = kept
        self.tree.counters["versions_collected"] += len(self.victims)
        for version in self.victims:
            for c in version.chunks:
                if c is not None and (c.tier, c.loc) not in still:
                    self.tree.values.cache.discard(("wv", c.tier, c.loc))
        self.tree.forget_if_unused(node)


__all__ = ["WeightsTree", "WNode", "Version", "ReadHandle", "WriteHandle", "DIR", "FILE", "LINK", "ROOT_ID",
           "DB_WNODES"]

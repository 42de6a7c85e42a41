"""checkpoints/ in the path tree: thin nodes over `distorefs.checkpoints`.

    checkpoints/config.json, stats.json     control files (config.json is writable)
    checkpoints/RUN/                        mkdir makes a run
    checkpoints/RUN/STEP/...                mkdir makes a step; any files and sub-directories below
    checkpoints/RUN/latest                  symlink to the newest complete step (absent before one)

Write handles bypass the page cache (direct_io) and hand every write to the core, which
holds it in memory; close() returns once it is held. A write-only writer appending at a
chunk boundary has its WRITEs copied by the library's front into chunk buffers the core
lends (CheckpointWriter.arm), without Python; they are the file's before anything else of
it is handled. fsync of a file waits until that file is durable, fsync of any directory
here until everything written before it is (a step directory is closed by it too). A
write handle's close from a dying process (the kernel closing a killed writer's files)
marks the file cut short, so its step never completes. Removals the core makes by itself
(retention) are pushed to the kernel.
"""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from typing import TYPE_CHECKING

import pyfuse3
import trio

from distorefs.checkpoints import (CONTROL, LATEST, ROOT, ROOT_ID, RUN, CDir, CFile, CLink, CNode, CStep, FileReader,
                                   Memory, checksum_of)
from distorefs.errors import AlreadyExists, CrossDevice, InvalidArgument, IsADirectory, NotFound, NotPermitted, Stale
from distorefs.fileattrs import dir_nlink, without_privileges
from distorefs.owner import Owner

from . import interpose
from .handles import Handle, wants_read, wants_write
from .inodes import CHECKPOINT_DIR, CHECKPOINT_FILE, CHECKPOINT_LINK, stable_number
from .nodes import DIR_LONG, NO_CACHE, Node, RenderedFile, _json, make_attrs
from .treeattrs import attr_change, stamp_attrs

if TYPE_CHECKING:
    from .operations import Filesystem


def _key(node: CNode) -> tuple:
    if isinstance(node, CLink):
        return ("cklink", node.id)
    return ("ckdir", node.id) if isinstance(node, CDir) else ("ckfile", node.id)


LEND_AHEAD = 3  # chunks lent to the front ahead of a writer (24 MiB at the default 8 MiB)


class CheckpointWriter(Handle):
    """An open for writing: every write goes to the core's memory, close() hands it over.
    Write-only opens (torch.save, np.save) bypass the page cache (direct I/O: one copy
    less); read-write opens go through it, so a shared writable mmap works (it needs
    O_RDWR, and FUSE refuses it on a direct-I/O file).

    A write-only writer appending at a chunk boundary is armed (`arm`): the library's
    front copies its WRITEs into chunk buffers the core lends (budgeted, pooled) and
    answers them; each chunk filled whole comes back through the front's notes
    (`chunk_filled`) and is persisted as a written one. Before anything else of the file
    reaches Python (this handle's requests, the file's attributes, opens, truncation,
    reads), `settle` takes every chunk back, the partly filled ones too; a write Python
    handles re-arms it once it ends on a chunk boundary."""

    def __init__(self, fs: "Filesystem", f: CFile, readable: bool, pid: int, uid: int = 0) -> None:
        self.fs = fs
        self.tree, self.f, self.pid, self.uid = fs.store.checkpoints, f, pid, uid
        self.privileges_checked = False
        self.reader = FileReader(self.tree, f) if readable else None
        self.direct_io = not readable
        self.armed = False
        self.armed_at = 0  # where its WRITEs were to start when it was armed
        self.next_lent = 0  # the chunk the next buffer lent is for
        self.lent = 0  # buffers lent and not back

    def opened(self) -> None:
        self.arm()

    def arm(self) -> None:
        """Have the library's front take this writer's WRITEs from the file's end on, if
        that is a chunk boundary with nothing of the file past it (mount/interpose.py
        chunks_arm). Not a reader's (its writes go through the page cache), nor while a
        setuid bit waits for the first write to drop it, nor beside another armed writer."""
        f = self.f
        if self.armed or self.fh is None or not self.direct_io or f.id in self.fs.chunk_writers:
            return
        if not self.privileges_checked and without_privileges(f.mode, self.uid) is not None:
            return
        pos = self.tree.fillable_from(f)
        if pos is None or not interpose.chunks_arm(self.fh, pos, f.chunk_bytes, self.tree.config.max_file_bytes):
            return
        self.armed = True
        self.fs.chunk_writers[f.id] = self
        self.armed_at, self.next_lent, self.lent = pos, pos // f.chunk_bytes, 0
        self._lend()

    def _lend(self) -> None:
        while self.armed and self.fh is not None and self.lent < LEND_AHEAD:
            data = self.tree.lend(self.f)
            if data is None:  # no budget now: the writes come to Python, which waits for it
                return
            if not interpose.chunks_lend(self.fh, self.next_lent, data):
                self.tree.give_back(data)
                return
            self.next_lent += 1
            self.lent += 1

    def chunk_filled(self, index: int, data: Memory, filled: int) -> bool:
        self.lent -= 1
        self.tree.filled(self.f, index, data, filled)
        self._lend()
        return True

    def settle(self, if_written: bool = False) -> None:
        """Take back every chunk lent to the front (what it filled becomes the file's); it
        takes no more of this writer's WRITEs until `arm`. `if_written`: only once the front
        took a WRITE (the attributes of a file just created and armed need nothing of it)."""
        fh = self.fh
        if not self.armed or fh is None or (if_written and interpose.chunks_pos(fh) == self.armed_at):
            return
        self.armed = False
        if self.fs.chunk_writers.get(self.f.id) is self:
            del self.fs.chunk_writers[self.f.id]
        got = interpose.chunks_stop(fh)
        self.lent = 0
        for index, data, filled in sorted(got[1] if got is not None else [], key=lambda t: t[0]):
            self.tree.filled(self.f, index, data, filled)

    async def read(self, off: int, size: int) -> bytes | memoryview:
        if self.reader is None:
            raise NotPermitted("not open for reading")
        return await self.reader.read(off, size)

    async def write(self, off: int, buf: bytes) -> int:
        self.settle()
        if self.direct_io and not self.privileges_checked:  # the kernel drops setuid only for cached writes
            self.privileges_checked = True
            change = without_privileges(self.f.mode, self.uid)
            if change is not None:
                await self.tree.set_attrs(self.f, change)
        n = await self.tree.write(self.f, off, buf)
        if off + n == self.f.size:
            self.arm()
        return n

    async def flush(self) -> None:
        self.settle()
        self.tree.flushed(self.f)

    async def fsync(self) -> None:
        self.settle()
        await self.tree.fsync(self.f)
        self.arm()

    async def release(self) -> None:
        self.settle()
        self.tree.released(self.f, write=True)


def settle_all_writes(fs: "Filesystem") -> None:
    """`settle_writes` of every file (a directory's fsync; a writer waiting for the budget)."""
    for writer in list(fs.chunk_writers.values()):
        if isinstance(writer, CheckpointWriter):
            writer.settle()


def settle_writes(fs: "Filesystem", f: CFile, if_written: bool = False) -> None:
    """What the library's front holds of `f`'s writes becomes the file's (before a request
    of the file that is not its armed writer's: its size, its bytes, a truncation)."""
    writer = fs.chunk_writers.get(f.id)
    if isinstance(writer, CheckpointWriter):
        writer.settle(if_written)


class CheckpointReader(Handle):
    """An open for reading (resume): through the page cache (so mmap works), chunks
    streamed from their tier ahead of the reader."""

    def __init__(self, fs: "Filesystem", f: CFile) -> None:
        self.fs, self.tree, self.f = fs, fs.store.checkpoints, f
        self.tree.open_read(f)
        self.reader = FileReader(self.tree, f)

    async def read(self, off: int, size: int) -> bytes | memoryview:
        settle_writes(self.fs, self.f)  # (a file read while it is written)
        return await self.reader.read(off, size)

    async def release(self) -> None:
        self.reader.close()
        self.tree.released(self.f, write=False)


class CheckpointsDir(Node):
    """checkpoints/ itself, a run, a step, or a directory inside a step."""

    def __init__(self, fs: "Filesystem", node_id: int) -> None:
        super().__init__(fs)
        self.node_id = node_id

    @property
    def tree(self):
        return self.fs.store.checkpoints

    def cnode(self) -> CDir:
        return self.tree.dir(self.node_id)

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n = self.cnode()
        # Cached: a path walk to a checkpoint file asks for every directory on the way (the
        # kernel checks each one's permissions), 4 GETATTRs an open otherwise. The kernel
        # drops them itself when it changes the directory (a create, mkdir, rename, unlink);
        # the tree's own changes drop them through checkpoints_root's dir_listeners.
        a = stamp_attrs(self.ino, stat.S_IFDIR | (n.mode & 0o7777), 0, n, DIR_LONG, entry_timeout=DIR_LONG,
                        nlink=dir_nlink(sum(1 for c in n.children.values() if isinstance(self.tree.nodes[c], CDir))))
        if n.kind == ROOT:
            a.st_uid, a.st_gid = self.fs.uid, self.fs.gid
        return a

    def node_for(self, c: CNode) -> Node:
        intern = self.fs.inodes.intern
        if isinstance(c, CDir):
            return intern(_key(c), lambda: CheckpointsDir(self.fs, c.id), stable_number(CHECKPOINT_DIR, 0, c.id))
        if isinstance(c, CLink):
            return intern(_key(c), lambda: CheckpointLink(self.fs, c), stable_number(CHECKPOINT_LINK, 0, c.id))
        return intern(_key(c), lambda: CheckpointFile(self.fs, c),  # type: ignore[arg-type]
                      stable_number(CHECKPOINT_FILE, 0, c.id))

    def _extra(self, name: bytes) -> Node | None:
        """The names the filesystem makes: control files in checkpoints/, `latest` in a run."""
        kind = self.cnode().kind
        if kind == ROOT and name in CONTROL:
            tree = self.tree
            if name == b"config.json":
                return self.fs.inodes.intern(("ckctl", name), lambda: RenderedFile(
                    self.fs, lambda: tree.config.to_json(), write=tree.configure))
            return self.fs.inodes.intern(("ckctl", name), lambda: RenderedFile(self.fs, lambda: _json(tree.stats()), size_known=False))
        if kind == RUN and name == LATEST:
            if self.tree.latest(self.cnode()) is None:
                raise NotFound("no complete step yet")
            return self.fs.inodes.intern(("cklatest", self.node_id), lambda: LatestLink(self.fs, self.node_id))
        return None

    async def lookup(self, name: bytes, ctx=None) -> Node:
        return self._extra(name) or self.node_for(self.tree.child(self.node_id, name))

    def children(self, start: int):
        n = self.cnode()
        names = ([*CONTROL] if n.kind == ROOT else []) + sorted(n.children)
        if n.kind == RUN and self.tree.latest(n) is not None:
            names.append(LATEST)
        for i, name in enumerate(names[start:], start + 1):
            child_id = n.children.get(name)
            node = self.node_for(self.tree.nodes[child_id]) if child_id is not None else self._extra(name)
            yield name, node, i

    def _reserved(self, name: bytes) -> None:
        kind = self.cnode().kind
        if (kind == ROOT and name in CONTROL) or (kind == RUN and name == LATEST):
            raise NotPermitted(f"{name.decode(errors='replace')} is made by the filesystem")

    async def mkdir(self, name: bytes, mode: int, ctx) -> Node:
        self._reserved(name)
        owner = Owner(stat.S_IFDIR | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)
        return self.node_for(await self.tree.mkdir(self.node_id, name, owner))

    async def symlink(self, name: bytes, target: bytes, ctx) -> Node:
        self._reserved(name)
        return self.node_for(await self.tree.symlink(self.node_id, name, target,
                                                     Owner(stat.S_IFLNK | 0o777, ctx.uid, ctx.gid)))

    async def create(self, name: bytes, mode: int, flags: int, ctx):
        self._reserved(name)
        existing = self.cnode().children.get(name)
        if existing is None:
            owner = Owner(stat.S_IFREG | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)
            f = await self.tree.create(self.node_id, name, owner)
        else:
            if flags & os.O_EXCL:
                raise AlreadyExists(f"{name!r} exists")
            f = self.tree.nodes[existing]
            if isinstance(f, CLink):
                raise NotPermitted(f"{name!r} is a symlink")  # the kernel follows links before CREATE
            if not isinstance(f, CFile):
                raise IsADirectory(f"{name!r} is a directory")
            await self.tree.open_write(f, truncate=bool(flags & os.O_TRUNC))
        return self.node_for(f), CheckpointWriter(self.fs, f, wants_read(flags), ctx.pid, ctx.uid)

    async def unlink(self, name: bytes) -> None:
        self._reserved(name)
        await self.tree.remove(self.node_id, name, want_dir=False)

    async def rmdir(self, name: bytes) -> None:
        self._reserved(name)
        await self.tree.remove(self.node_id, name, want_dir=True)

    async def rename(self, old: bytes, new_parent: Node, new: bytes, flags: int) -> None:
        if not isinstance(new_parent, CheckpointsDir):
            raise CrossDevice("checkpoints move only within checkpoints/")
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_EXCHANGE is not supported under checkpoints/")
        self._reserved(old)
        new_parent._reserved(new)
        await self.tree.rename(self.node_id, old, new_parent.node_id, new,
                               noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE))

    async def setattr(self, attr, fields, handle, ctx) -> None:
        change = attr_change(attr, fields)
        if change.size is not None:
            raise IsADirectory("a directory has no size to set")
        await self.tree.set_attrs(self.cnode(), change)

    def xattrs(self) -> dict[bytes, bytes]:
        n = self.cnode()
        if not isinstance(n, CStep):
            return {}
        files = list(self.tree.files_below(n))
        return {
            b"state": self.tree.state(n).encode(),
            b"pinned": b"1" if n.pinned else b"0",
            b"seq": b"%d" % n.id,
            b"files": b"%d" % len(files),
            b"size": b"%d" % sum(f.size for f in files),
            b"stored_size": b"%d" % sum(self.tree.stored_size(f) for f in files),
            **({b"origin": n.origin.encode()} if n.origin else {}),  # written on that node (read-only here)
        }

    async def setxattr(self, name: bytes, value: bytes, ctx=None) -> None:
        n = self.cnode()
        if name != b"pinned" or not isinstance(n, CStep):
            await super().setxattr(name, value, ctx)
        flag = value.strip().lower()
        if flag not in (b"0", b"1", b"true", b"false", b"yes", b"no"):
            raise InvalidArgument(f"pinned must be 1 or 0, got {value[:20]!r}")
        await self.tree.set_pinned(n, flag in (b"1", b"true", b"yes"))

    async def fsyncdir(self) -> None:
        settle_all_writes(self.fs)  # (everything written before it)
        await self.tree.sync_dir(self.cnode())


class LatestLink(Node):
    """RUN/latest -> the newest complete step (read anew at every readlink)."""

    def __init__(self, fs: "Filesystem", run_id: int) -> None:
        super().__init__(fs)
        self.run_id = run_id

    def readlink(self) -> bytes:
        tree = self.fs.store.checkpoints
        step = tree.latest(tree.node(self.run_id))
        if step is None:
            raise NotFound("no complete step")
        return step.name

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        run = self.fs.store.checkpoints.node(self.run_id)
        target = self.readlink()
        return make_attrs(self.ino, stat.S_IFLNK | 0o777, len(target), run.uid, run.gid, run.mtime_ns, NO_CACHE)


class CheckpointLink(Node):
    """A symlink in a step."""

    def __init__(self, fs: "Filesystem", link: CLink) -> None:
        super().__init__(fs)
        self.link = link

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n = self.link
        return stamp_attrs(self.ino, stat.S_IFLNK | 0o777, len(n.target), n, NO_CACHE,
                           nlink=1 if n.attached else 0, entry_timeout=DIR_LONG)

    def readlink(self) -> bytes:
        return self.link.target

    async def setattr(self, attr, fields, handle, ctx) -> None:
        change = attr_change(attr, fields)
        if change.size is not None:
            raise NotPermitted("a symlink has no size to set")
        await self.fs.store.checkpoints.set_attrs(self.link, change)


class CheckpointFile(Node):
    def __init__(self, fs: "Filesystem", f: CFile) -> None:
        super().__init__(fs)
        self.f = f

    @property
    def tree(self):
        return self.fs.store.checkpoints

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        f = self.f
        settle_writes(self.fs, f, if_written=True)  # (its size; a create's reply asks before any write)
        return stamp_attrs(self.ino, stat.S_IFREG | (f.mode & 0o7777), f.size, f, NO_CACHE,
                           nlink=1 if f.attached and not f.unlinked else 0, entry_timeout=DIR_LONG)

    async def open(self, flags: int, ctx) -> Handle:
        if not self.f.attached:
            # removed or replaced since the kernel looked it up: it looks the name up again
            # (ENOENT if nothing has it now, else the file that does)
            raise Stale("the file was removed or replaced")
        settle_writes(self.fs, self.f)
        if wants_write(flags):
            await self.tree.open_write(self.f, truncate=bool(flags & os.O_TRUNC))
            return CheckpointWriter(self.fs, self.f, wants_read(flags), ctx.pid if ctx is not None else 0,
                                    ctx.uid if ctx is not None else 0)
        return CheckpointReader(self.fs, self.f)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        settle_writes(self.fs, self.f)
        change = attr_change(attr, fields)
        if change.size is not None:
            await self.tree.truncate(self.f, change.size)
            if not isinstance(handle, CheckpointWriter) and not self.f.writers:
                self.tree.flushed(self.f)  # truncate(2) by path: nothing else hands it over
        await self.tree.set_attrs(self.f, replace(change, size=None))

    def xattrs(self, crc: int | None = -1) -> dict[bytes, bytes]:
        f, tree = self.f, self.tree
        settle_writes(self.fs, f)
        attrs = {
            b"state": tree.state(f).encode(),
            b"seq": b"%d" % f.id,
            b"tier": ",".join(tree.tiers(f)).encode(),
            b"size": b"%d" % f.size,
            b"stored_size": b"%d" % tree.stored_size(f),
        }
        if crc == -1:
            crc = tree.checksum(f)
        if crc is not None:  # known once every chunk is stored
            attrs[b"checksum"] = b"crc32:%08x" % crc
        return attrs

    async def read_xattrs(self) -> dict[bytes, bytes]:
        settle_writes(self.fs, self.f)
        # The checksum combines one CRC per chunk (a 1 TB file has 131,072 of 8 MiB): a worker
        # thread computes it from a snapshot, so the mount never stalls on a big file.
        parts = self.tree.checksum_parts(self.f)
        crc = None if parts is None else await trio.to_thread.run_sync(checksum_of, *parts)
        return self.xattrs(crc)


def checkpoints_root(fs: "Filesystem") -> tuple[tuple, Node]:
    """checkpoints/ (its fixed inode key and node); the kernel is told of removals the core
    makes by itself, so a retired step disappears from cached names at once (and its
    parent's attributes with it), and of directories whose attributes it changes otherwise
    (another node's step applied)."""
    root = CheckpointsDir(fs, ROOT_ID)

    def removed(node: CNode) -> None:
        ino = fs.inodes.unname(_key(node))
        parent = fs.inodes.ino_of(("ckdir", node.parent))
        if fs.invalidator is not None and parent is not None:
            fs.invalidator.entry(parent, node.name, ino or 0)

    def dir_changed(d: CDir) -> None:
        ino = fs.inodes.ino_of(_key(d))
        if fs.invalidator is not None and ino is not None:
            fs.invalidator.attributes(ino)

    fs.store.checkpoints.listeners.append(removed)
    fs.store.checkpoints.dir_listeners.append(dir_changed)
    fs.store.checkpoints.reclaimers.append(lambda: settle_all_writes(fs))
    return ("ckdir", ROOT_ID), root


__all__ = ["CheckpointsDir", "CheckpointFile", "LatestLink", "CheckpointWriter", "CheckpointReader",
           "checkpoints_root"]

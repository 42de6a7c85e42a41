"""weights/ in the path tree: thin nodes over `distorefs.weights` (the tree, its drafts and
versions live there; see its docstring).

A file is one inode for its life, `("wfile", id, gen)`; `gen` moves only when the core gives
a writer an inode of its own because other processes read the published version through
the page cache (the writer's O_TRUNC and writes would otherwise change what they see):
its OPEN then fails with ESTALE, the kernel looks the name up again (LOOKUP_REVAL), and
that lookup, from the writer's thread, answers with the writers' inode. File names are
never cached by the kernel (every open looks them up), so a publish reaches every later
open. Readers use the page cache unless a draft is being written through their inode;
writers always do (so a shared writable mmap works).
"""

from __future__ import annotations

import logging
import os
import stat
from typing import TYPE_CHECKING

import pyfuse3

from distorefs.errors import CrossDevice, NotPermitted, Stale, Unsupported
from distorefs.fileattrs import dir_nlink
from distorefs.owner import Owner
from distorefs.values import WarmResult
from distorefs.weights import DIR, LINK, ROOT_ID, ReadHandle, WNode, WriteHandle

from .handles import Handle, wants_read, wants_write
from .inodes import WEIGHTS_DIR, WEIGHTS_FILE, WEIGHTS_LINK, stable_number
from .nodes import DIR_LONG, NO_CACHE, Node, RenderedFile, _json
from .treeattrs import attr_change, stamp_attrs

if TYPE_CHECKING:
    from .operations import Filesystem

log = logging.getLogger(__name__)
CONTROL = (b"config.json", b"stats.json")


class WeightsReader(Handle):
    """Reads the version it opened to its end, whatever is published meanwhile."""

    def __init__(self, core: ReadHandle) -> None:
        self.core = core
        self.keep_cache = core.page_cache
        self.direct_io = not core.page_cache

    async def read(self, off: int, size: int) -> bytes:
        return await self.core.read(off, size)

    async def release(self) -> None:
        self.core.release()


class WeightsWriter(Handle):
    """Writes to the file's draft; close() publishes it (distorefs.weights.WriteHandle)."""

    def __init__(self, core: WriteHandle) -> None:
        self.core = core

    async def read(self, off: int, size: int) -> bytes:
        return await self.core.read(off, size)

    async def write(self, off: int, buf: bytes) -> int:
        return await self.core.write(off, buf)

    async def flush(self) -> None:
        await self.core.flush()

    async def release(self) -> None:
        await self.core.release()


def _xattr_names() -> set[bytes]:
    return {b"version", b"seq", b"tier", b"size", b"stored_size", b"checksum"}


class _TreeNode(Node):
    """What weights/ directories, files and symlinks share."""

    @property
    def tree(self):
        return self.fs.store.weights

    async def setxattr(self, name: bytes, value: bytes, ctx=None) -> None:
        if name in _xattr_names():
            raise NotPermitted(f"attribute {name!r} is read-only")
        raise Unsupported(f"no attribute {name!r} here")


class WeightsDir(_TreeNode):
    def __init__(self, fs: "Filesystem", node_id: int) -> None:
        super().__init__(fs)
        self.node_id = node_id

    def wnode(self) -> WNode:
        return self.tree.node(self.node_id)

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n = self.wnode()
        return stamp_attrs(self.ino, stat.S_IFDIR | (n.mode & 0o7777), 0, n, NO_CACHE,
                           nlink=dir_nlink(n.subdirs) if n.attached else 0, entry_timeout=DIR_LONG)

    def node_for(self, child: WNode, pid: int = 0) -> Node:
        intern = self.fs.inodes.intern
        if child.kind == DIR:
            return intern(("wdir", child.id), lambda: WeightsDir(self.fs, child.id),
                          stable_number(WEIGHTS_DIR, 0, child.id))
        if child.kind == LINK:
            return intern(("wlink", child.id), lambda: WeightsLink(self.fs, child),
                          stable_number(WEIGHTS_LINK, 0, child.id))
        gen = self.tree.lookup_gen(child, self.fs.redirected(child.id, pid))
        return intern(("wfile", child.id, gen), lambda: WeightsFile(self.fs, child, gen),
                      stable_number(WEIGHTS_FILE, gen, child.id))

    def _control(self, name: bytes) -> Node | None:
        if self.node_id != ROOT_ID or name not in CONTROL:
            return None
        store = self.fs.store
        if name == b"config.json":
            return self.fs.inodes.intern(("wctl", name), lambda: RenderedFile(
                self.fs, lambda: store.weights.config.to_json(), write=store.configure_weights))
        return self.fs.inodes.intern(("wctl", name), lambda: RenderedFile(
            self.fs, lambda: _json(store.weights.stats()), size_known=False))

    async def lookup(self, name: bytes, ctx=None) -> Node:
        control = self._control(name)
        if control is not None:
            return control
        return self.node_for(self.tree.child(self.node_id, name), ctx.pid if ctx is not None else 0)

    def children(self, start: int):
        names = ([*CONTROL] if self.node_id == ROOT_ID else []) + sorted(self.wnode().children)
        for i, name in enumerate(names[start:], start + 1):
            yield name, self._control(name) or self.node_for(self.tree.child(self.node_id, name)), i

    def _owner(self, mode: int, ctx, kind: int) -> Owner:
        return Owner(kind | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)

    async def mkdir(self, name: bytes, mode: int, ctx) -> Node:
        self._not_control(name)
        return self.node_for(await self.tree.mkdir(self.node_id, name, self._owner(mode, ctx, stat.S_IFDIR)))

    async def symlink(self, name: bytes, target: bytes, ctx) -> Node:
        self._not_control(name)
        return self.node_for(await self.tree.symlink(self.node_id, name, target,
                                                     Owner(stat.S_IFLNK | 0o777, ctx.uid, ctx.gid)))

    async def create(self, name: bytes, mode: int, flags: int, ctx):
        self._not_control(name)
        node, _ = await self.tree.create(self.node_id, name, self._owner(mode, ctx, stat.S_IFREG),
                                         exclusive=bool(flags & os.O_EXCL))
        file = self.node_for(node, ctx.pid)
        assert isinstance(file, WeightsFile)
        return file, await file.open(flags, ctx, redirect=False)

    async def unlink(self, name: bytes) -> None:
        self._not_control(name)
        await self.tree.remove(self.node_id, name, want_dir=False)

    async def rmdir(self, name: bytes) -> None:
        self._not_control(name)
        await self.tree.remove(self.node_id, name, want_dir=True)

    async def rename(self, old: bytes, new_parent: Node, new: bytes, flags: int) -> None:
        if not isinstance(new_parent, WeightsDir):
            raise CrossDevice("weights move only within weights/")
        self._not_control(old)
        if new_parent.node_id == ROOT_ID:
            new_parent._not_control(new)
        await self.tree.rename(self.node_id, old, new_parent.node_id, new,
                               noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                               exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))

    def _not_control(self, name: bytes) -> None:
        if self.node_id == ROOT_ID and name in CONTROL:
            raise NotPermitted(f"weights/{name.decode()} is a control file")

    async def setattr(self, attr, fields, handle, ctx) -> None:
        change = attr_change(attr, fields)
        if change.size is not None:
            raise NotPermitted("a directory has no size to set")
        await self.tree.setattr(self.wnode(), change)


class WeightsLink(_TreeNode):
    def __init__(self, fs: "Filesystem", node: WNode) -> None:
        super().__init__(fs)
        self.wnode = node

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n = self.wnode
        return stamp_attrs(self.ino, stat.S_IFLNK | 0o777, len(n.target), n, NO_CACHE,
                           nlink=1 if n.attached else 0)

    def readlink(self) -> bytes:
        return self.wnode.target

    async def setattr(self, attr, fields, handle, ctx) -> None:
        change = attr_change(attr, fields)
        if change.size is not None:
            raise NotPermitted("a symlink has no size to set")
        await self.tree.setattr(self.wnode, change)


class WeightsFile(_TreeNode):
    """A file through inode generation `gen` (see the module docstring)."""

    def __init__(self, fs: "Filesystem", node: WNode, gen: int) -> None:
        super().__init__(fs)
        self.wnode = node
        self.gen = gen

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n, tree = self.wnode, self.tree
        drafting = n.draft is not None and n.draft_gen == self.gen
        named = n.attached and (n.gen == self.gen or drafting)
        # the name is looked up at every open (a publish may move it to another inode)
        return stamp_attrs(self.ino, stat.S_IFREG | (n.mode & 0o7777), tree.size_of(n, self.gen), n,
                           DIR_LONG if tree.settled(n, self.gen) else NO_CACHE, nlink=1 if named else 0,
                           entry_timeout=NO_CACHE)

    async def open(self, flags: int, ctx, redirect: bool = True) -> Handle:
        tree, node = self.tree, self.wnode
        if not wants_write(flags):
            return WeightsReader(tree.open_read(node, self.gen))
        pid = ctx.pid if ctx is not None else 0
        try:
            core = await tree.open_write(node, self.gen, truncate=bool(flags & os.O_TRUNC),
                                         readable=wants_read(flags),
                                         redirect=redirect and not self.fs.redirected(node.id, pid))
        except Stale:
            self.fs.redirect_writer(node.id, pid)  # until the writers' inode is opened
        self.fs.take_redirect(node.id, pid)
        return WeightsWriter(core)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        core = handle.core if isinstance(handle, WeightsWriter) else None
        await self.tree.setattr(self.wnode, attr_change(attr, fields), core)

    async def warm(self) -> bytes | None:
        v = self.tree.version_at(self.wnode, self.gen)
        if v is None:
            return WarmResult().text()
        return (await self.tree.warm(self.wnode, v)).text()

    def xattrs(self) -> dict[bytes, bytes]:
        n = self.wnode
        v = self.tree.version_at(n, self.gen)
        if v is None:
            return {b"version": b"0", b"seq": b"0", b"tier": b"none", b"size": b"0", b"stored_size": b"0",
                    b"checksum": b"crc32:00000000"}
        stored = [c for c in v.chunks if c is not None]
        tiers = sorted({c.tier_name for c in stored}) or ["none"]
        return {
            b"version": b"%d" % v.number,
            b"seq": b"%d" % v.number,
            b"tier": ",".join(tiers).encode(),
            b"size": b"%d" % v.size,
            b"stored_size": b"%d" % sum(c.stored_size for c in stored),
            b"checksum": b"crc32:%08x" % v.checksum,
        }


__all__ = ["WeightsDir", "WeightsFile", "WeightsLink"]

"""weights/ in the path tree: directories, symlinks, and files whose published versions
are immutable inodes shared by every reader through the kernel page cache.

The one hazard is an in-place rewrite: it opens, with O_TRUNC, the inode readers share,
and libfuse3's atomic O_TRUNC makes the kernel zero that inode's size and drop its pages
(and ignore our size while the writer's writes are in flight): readers of the old
version would see short reads. So a writer never gets the shared inode. Its OPEN for
writing on the shared inode fails with ESTALE; the kernel then walks the path again
(LOOKUP_REVAL), and that lookup, from the writer's process, answers with a private
inode of the same version. Only the private inode is truncated. File names are never
cached by the kernel (every open looks them up), which is also what lets a publish
reach every later open. A writer stages into a spool; at close the version is
published and a new shared inode serves it.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import TYPE_CHECKING

import pyfuse3
import trio

from distorefs.errors import AlreadyExists, CrossDevice, InvalidArgument, NotFound, NotPermitted, Stale, TooLarge
from distorefs.names import check_name
from distorefs.owner import Owner
from distorefs.weights import DIR, LINK, ROOT_ID, Version, WNode

from .handles import Handle, wants_read, wants_write
from .nodes import DIR_LONG, NO_CACHE, Node, RenderedFile, _json, make_attrs

if TYPE_CHECKING:
    from .operations import Filesystem

log = logging.getLogger(__name__)
CONTROL = (b"config.json", b"stats.json")


class WeightsReader(Handle):
    """Reads one version to its end, whatever is published meanwhile (page cache on)."""

    keep_cache = True

    def __init__(self, fs: "Filesystem", node: WNode, version: Version) -> None:
        self.fs, self.wnode, self.version = fs, node, version
        fs.store.weights.opened(version)

    async def read(self, off: int, size: int) -> bytes:
        return await self.fs.store.weights.read(self.wnode, self.version, off, size)

    async def release(self) -> None:
        self.fs.store.weights.closed(self.wnode, self.version)


class WeightsWriter(Handle):
    """Stages a new version in a spool file; published at close (see StagingWriter for
    why a created-or-truncated-only handle publishes at release rather than flush)."""

    direct_io = True

    def __init__(self, fs: "Filesystem", parent_id: int, name: bytes, owner: Owner, node_id: int | None,
                 readable: bool, pid: int = 0) -> None:
        self.fs = fs
        self.pid = pid
        self.parent_id, self.name, self.owner, self.node_id = parent_id, name, owner, node_id
        self.readable = readable
        self.fd, self.spool = fs.store.weights.new_spool()
        self.size = 0
        self.dirty = True
        self.wrote = False
        self.failed: Exception | None = None

    async def fill_from(self, node: WNode) -> None:
        self.size = await self.fs.store.weights.copy_into_spool(node, self.fd)
        self.dirty = False  # unchanged until written

    async def read(self, off: int, size: int) -> bytes:
        if not self.readable:
            raise NotPermitted("not open for reading")
        return await trio.to_thread.run_sync(os.pread, self.fd, max(0, min(size, self.size - off)), off)

    async def write(self, off: int, buf: bytes) -> int:
        try:
            await trio.to_thread.run_sync(os.pwrite, self.fd, buf, off)
        except OSError as exc:
            self.failed = exc
            raise
        self.size = max(self.size, off + len(buf))
        self.dirty = self.wrote = True
        return len(buf)

    async def truncate(self, size: int) -> None:
        await trio.to_thread.run_sync(os.ftruncate, self.fd, size)
        self.size = size
        self.dirty = self.wrote = True

    async def flush(self) -> None:
        if self.failed is not None:
            raise self.failed
        if _exiting(self.pid):
            # The kernel closes a dying process's files with the same FLUSH as a close():
            # a writer killed mid-write must leave the previous version, not publish half.
            self.discard()
            log.warning("writer pid %d of %r died before closing: nothing published", self.pid, self.name)
            return
        if self.dirty and self.wrote:
            await self._publish()

    async def release(self) -> None:
        try:
            if self.dirty and self.failed is None:
                await self._publish()
        finally:
            self._unregister()
            os.close(self.fd)
            os.unlink(self.spool)

    async def publish_now(self) -> None:
        """Publish what is staged (a rename of the open, unpublished file). The kernel
        holds the directory locked for that rename and moves the name itself: no
        invalidation here (it would wait for the rename, which waits for us)."""
        if self.failed is not None:
            raise self.failed
        await self._publish(invalidate=False)

    def discard(self) -> None:
        """The unpublished file was unlinked: nothing will be published."""
        self.dirty = self.wrote = False
        self.failed = NotFound("the file was removed before it was published")
        self._unregister()

    def _unregister(self) -> None:
        key = (self.parent_id, self.name)
        if self.fs.pending_weights.get(key) is self:
            del self.fs.pending_weights[key]

    async def _publish(self, invalidate: bool = True) -> None:
        self.dirty = self.wrote = False
        tree = self.fs.store.weights
        node = await tree.publish(self.parent_id, self.name, self.owner, self.fd, self.size, self.node_id)
        self._unregister()
        self.node_id = node.id
        if invalidate:
            await self.fs.forget_name(node.parent, node.name)


PF_EXITING = 0x4


def _exiting(pid: int) -> bool:
    """Whether process `pid` is exiting (its files are being closed by the kernel)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return True  # gone already
    fields = stat_line[stat_line.rindex(b")") + 2:].split()
    return bool(int(fields[6]) & PF_EXITING)  # field 9 of stat: the task's flags


class WeightsDir(Node):
    def __init__(self, fs: "Filesystem", node_id: int) -> None:
        super().__init__(fs)
        self.node_id = node_id

    @property
    def tree(self):
        return self.fs.store.weights

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n = self.tree.node(self.node_id)
        return make_attrs(self.ino, stat.S_IFDIR | (n.mode & 0o7777), 0, n.uid, n.gid, n.mtime_ns, NO_CACHE,
                          nlink=2, entry_timeout=DIR_LONG)

    def node_for(self, child: WNode, pid: int = 0) -> Node:
        intern = self.fs.inodes.intern
        if child.kind == DIR:
            return intern(("wdir", child.id), lambda: WeightsDir(self.fs, child.id))
        if child.kind == LINK:
            return intern(("wlink", child.id), lambda: WeightsLink(self.fs, child))
        version = child.current
        if (child.id, pid) in self.fs.writer_redirects:  # kept until the private inode is opened
            # the retry of an open for writing refused on the shared inode: a private one
            return intern(("wpriv", child.id, version.number, pid),
                          lambda: WeightsFile(self.fs, child, version, shared=False))
        return intern(("wver", child.id, version.number), lambda: WeightsFile(self.fs, child, version))

    def _control(self, name: bytes) -> Node | None:
        if self.node_id != ROOT_ID or name not in CONTROL:
            return None
        store = self.fs.store
        if name == b"config.json":
            return self.fs.inodes.intern(("wctl", name), lambda: RenderedFile(
                self.fs, lambda: store.weights.config.to_json(), write=store.configure_weights))
        return self.fs.inodes.intern(("wctl", name), lambda: RenderedFile(
            self.fs, lambda: _json(store.weights.stats())))

    async def lookup(self, name: bytes, ctx=None) -> Node:
        control = self._control(name)
        if control is not None:
            return control
        pending = self._pending(name)
        if pending is not None:  # resolvable (its creator renames it), not openable by others
            return self.fs.inodes.intern(("wpending", pending.spool), lambda: PendingFile(self.fs, pending))
        return self.node_for(self.tree.child(self.node_id, name), ctx.pid if ctx is not None else 0)

    def children(self, start: int):
        names = ([*CONTROL] if self.node_id == ROOT_ID else []) + sorted(self.tree.node(self.node_id).children)
        for i, name in enumerate(names[start:], start + 1):
            yield name, self._control(name) or self.node_for(self.tree.child(self.node_id, name)), i

    def _owner(self, mode: int, ctx, kind: int) -> Owner:
        return Owner(kind | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)

    async def mkdir(self, name: bytes, mode: int, ctx) -> Node:
        self._not_control(name)
        return self.node_for(await self.tree.mkdir(self.node_id, name, self._owner(mode, ctx, stat.S_IFDIR)))

    async def symlink(self, name: bytes, target: bytes, ctx) -> Node:
        self._not_control(name)
        return self.node_for(await self.tree.symlink(self.node_id, name, target, Owner(stat.S_IFLNK | 0o777,
                                                                                       ctx.uid, ctx.gid)))

    async def create(self, name: bytes, mode: int, flags: int, ctx):
        self._not_control(name)
        check_name(name)
        existing = self.tree.node(self.node_id).children.get(name)
        if existing is not None and flags & os.O_EXCL:
            raise AlreadyExists(f"{name!r} exists")
        writer = WeightsWriter(self.fs, self.node_id, name, self._owner(mode, ctx, stat.S_IFREG), existing,
                               wants_read(flags), ctx.pid)
        node = self.fs.inodes.intern(("wpending", writer.spool), lambda: PendingFile(self.fs, writer))
        if existing is None:
            self.fs.pending_weights[(self.node_id, name)] = writer
        return node, writer

    def _pending(self, name: bytes) -> "WeightsWriter | None":
        """A created file not yet published (invisible to lookups, but its creator may
        rename or remove it while it is open, as tools writing temp files do)."""
        if name in self.tree.node(self.node_id).children:
            return None
        return self.fs.pending_weights.get((self.node_id, name))

    async def unlink(self, name: bytes) -> None:
        self._not_control(name)
        pending = self._pending(name)
        if pending is not None:
            pending.discard()
            return
        await self.tree.remove(self.node_id, name, want_dir=False)

    async def rmdir(self, name: bytes) -> None:
        await self.tree.remove(self.node_id, name, want_dir=True)

    async def rename(self, old: bytes, new_parent: Node, new: bytes, flags: int) -> None:
        if not isinstance(new_parent, WeightsDir):
            raise CrossDevice("weights move only within weights/")
        self._not_control(old)
        if new_parent.node_id == ROOT_ID:
            self._not_control(new)
        pending = self._pending(old)
        if pending is not None:
            await pending.publish_now()  # what was written so far becomes the file, then it moves
        await self.tree.rename(self.node_id, old, new_parent.node_id, new,
                               noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                               exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))

    def _not_control(self, name: bytes) -> None:
        if self.node_id == ROOT_ID and name in CONTROL:
            raise NotPermitted(f"weights/{name.decode()} is a control file")

    async def setattr(self, attr, fields, handle, ctx) -> None:
        await _set_attrs(self.tree, self.tree.node(self.node_id), attr, fields)




async def _set_attrs(tree, node: WNode, attr, fields) -> None:
    mode = (node.mode & ~0o7777) | (attr.st_mode & 0o7777) if fields.update_mode else None
    await tree.set_attrs(node, mode=mode, uid=attr.st_uid if fields.update_uid else None,
                         gid=attr.st_gid if fields.update_gid else None,
                         mtime_ns=attr.st_mtime_ns if fields.update_mtime else None)


class WeightsLink(Node):
    def __init__(self, fs: "Filesystem", node: WNode) -> None:
        super().__init__(fs)
        self.wnode = node

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n = self.wnode
        return make_attrs(self.ino, stat.S_IFLNK | 0o777, len(n.target), n.uid, n.gid, n.mtime_ns, NO_CACHE)

    def readlink(self) -> bytes:
        return self.wnode.target


class WeightsFile(Node):
    """One published version of a file: immutable, so cached by the kernel."""

    def __init__(self, fs: "Filesystem", node: WNode, version: Version, shared: bool = True) -> None:
        super().__init__(fs)
        self.wnode = node
        self.version = version
        self.shared = shared

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        n, v = self.wnode, self.version
        current = n.attached and n.current is v
        # attributes of a version never change; its name is looked up at every open
        return make_attrs(self.ino, stat.S_IFREG | (n.mode & 0o7777), v.size, n.uid, n.gid, v.mtime_ns,
                          DIR_LONG, nlink=1 if current else 0, entry_timeout=NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            if not self.wnode.attached:
                raise NotFound("the file was removed")
            if ctx is not None:
                redirect = (self.wnode.id, ctx.pid)
                if self.shared and redirect not in self.fs.writer_redirects:
                    # never truncate the inode readers share: have the kernel look up again
                    self.fs.writer_redirects[redirect] = True
                    raise Stale("redirecting a writer to a private inode")
                # the private inode (or, if the kernel did not look up again, the shared one)
                self.fs.writer_redirects.pop(redirect, None)
            writer = WeightsWriter(self.fs, self.wnode.parent, self.wnode.name,
                                   Owner(self.wnode.mode, self.wnode.uid, self.wnode.gid), self.wnode.id,
                                   wants_read(flags), ctx.pid if ctx is not None else 0)
            if not flags & os.O_TRUNC:
                await writer.fill_from(self.wnode)
            return writer
        if self.version not in self.wnode.versions:
            raise NotFound("this version was collected")
        return WeightsReader(self.fs, self.wnode, self.version)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        if fields.update_size:
            if isinstance(handle, WeightsWriter):
                await handle.truncate(attr.st_size)
            else:
                raise NotPermitted("truncate a published version by writing a new one (open with O_TRUNC)")
        await _set_attrs(self.fs.store.weights, self.wnode, attr, fields)

    def xattrs(self) -> dict[bytes, bytes]:
        v = self.version
        tiers = sorted({c.tier_name for c in v.chunks}) or ["none"]
        return {
            b"version": b"%d" % v.number,
            b"seq": b"%d" % v.number,
            b"tier": ",".join(tiers).encode(),
            b"size": b"%d" % v.size,
            b"stored_size": b"%d" % sum(c.stored_size for c in v.chunks),
            b"checksum": b"crc32:%08x" % v.checksum,
        }


class PendingFile(Node):
    """The inode a create() returns: the writer's until it publishes, then an alias of the
    file's current version (read without the page cache: its version changes)."""

    def __init__(self, fs: "Filesystem", writer: WeightsWriter) -> None:
        super().__init__(fs)
        self.writer = writer

    def _published(self) -> WNode | None:
        nid = self.writer.node_id
        node = self.fs.store.weights.nodes.get(nid) if nid is not None else None
        return node if node is not None and node.current is not None else None

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        node = self._published()
        w = self.writer
        if node is None and w.failed is not None:
            raise NotFound("discarded before it was published")
        if node is None or w.dirty:
            return make_attrs(self.ino, w.owner.mode, w.size, w.owner.uid, w.owner.gid, time.time_ns(), NO_CACHE,
                              entry_timeout=DIR_LONG)
        v = node.current
        return make_attrs(self.ino, stat.S_IFREG | (node.mode & 0o7777), v.size, node.uid, node.gid,
                          v.mtime_ns, NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        node = self._published()
        if node is None:
            raise NotFound("not published yet")
        version_node = WeightsFile(self.fs, node, node.current)
        version_node.ino = self.ino
        handle = await version_node.open(flags, ctx)
        handle.keep_cache = False
        handle.direct_io = True
        return handle

    async def setattr(self, attr, fields, handle, ctx) -> None:
        if fields.update_size and isinstance(handle, WeightsWriter):
            await handle.truncate(attr.st_size)
        elif fields.update_size and self._published() is None:
            await self.writer.truncate(attr.st_size)  # ftruncate of the path before the first close


__all__ = ["WeightsDir", "WeightsFile", "WeightsLink", "PendingFile", "InvalidArgument", "TooLarge"]

"""datasets/NAME/: the FUSE side of datasets (items/, index.npy, order, stats.json, .stage).

Each node makes one call into `distorefs.dataset.Dataset`. Sealed items never change, so
they are served through the kernel page cache (keep_cache, long timeouts); the prefetcher
also pushes values into it (`notify_store`) for items whose inode the kernel already
holds. Items of an unsealed dataset can be rewritten, so their readers use direct_io
(the same reason as buffer entries: an O_TRUNC open zeroes the size every sharer sees).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import pyfuse3
import trio

from distorefs.dataset import DIR, FILE, LINK, ROOT_DIR, SEALED, Dataset, DirRec, Item
from distorefs.errors import (AlreadyExists, CrossDevice, DistorefsError, InvalidArgument, IsADirectory, NotFound,
                              NotPermitted, ReadOnly, TooLarge)
from distorefs.fileattrs import apply_setattr, dir_nlink
from distorefs.names import check_name
from distorefs.owner import Owner
from distorefs.sources import Credentials, check_can_act_for
from distorefs.stagewire import StageStream
from distorefs.values import WarmResult

from . import interpose
from .callers import lineage, process_gone, process_of
from .handles import BytesReader, ClientHandle, ConfigWriter, Handle, wants_read, wants_write
from .inodes import DATASET_DIR, DATASET_FILE, DATASET_LINK, stable_number
from .nodes import DIR_LONG, NO_CACHE, Node, RenderedFile, _json, make_attrs
from .treeattrs import attr_change, stamp_attrs

if TYPE_CHECKING:
    from .operations import Filesystem

log = logging.getLogger(__name__)

MAX_ORDER_BYTES = 1 << 30
LOAD_AT_OPEN_MAX = 1 << 20  # a sealed item no bigger is loaded at its open (as batch files are)


class DatasetDir(Node):
    """datasets/NAME/: config.json, stats.json, items/, index.npy (once sealed), order."""

    def __init__(self, fs: "Filesystem", ds: Dataset) -> None:
        super().__init__(fs)
        self.ns = self.ds = ds
        ds.prefetcher.push = push_into_page_cache(fs, ds)
        intern = fs.inodes.intern
        i = ds.ds_id

        async def configure(text: bytes) -> None:
            await fs.store.configure("datasets", ds.name, text)

        self.entries = {
            b"config.json": lambda: intern(("config", i), lambda: RenderedFile(
                fs, lambda: ds.config.to_json(), owner=lambda: ds.owner, write=configure)),
            b"stats.json": lambda: intern(("stats", i), lambda: RenderedFile(
                fs, lambda: _json(ds.stats()), size_known=False, owner=lambda: ds.owner)),
            b"items": lambda: intern(("dsdir", i, ROOT_DIR), lambda: ItemsDir(fs, ds, ROOT_DIR)),
            b"order": lambda: intern(("dsorder", i), lambda: OrderFile(fs, ds)),
            b"index.npy": lambda: intern(("dsindex", i), lambda: IndexFile(fs, ds)),
            b"client": lambda: intern(("dsclient", i), lambda: DatasetClientFile(fs, ds)),
        }

    def _visible(self) -> list[bytes]:
        return [n for n in self.entries if n not in (b"index.npy", b"client") or self.ds.sealed]

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.ds.owner
        # Sealed, it changes only by chmod/chown here (whose reply updates the kernel's copy):
        # cached, a path walk to an item asks nothing of the daemon for this directory.
        timeout = self.fs.store.config.entry_timeout if self.ds.sealed else NO_CACHE
        return make_attrs(self.ino, stat.S_IFDIR | (o.mode & 0o7777), 0, o.uid, o.gid, self.ds.ctime_ns,
                          timeout, nlink=3, entry_timeout=DIR_LONG)

    async def lookup(self, name: bytes, ctx=None) -> Node:
        if name == b".stage":  # the control file of `distorefs stage`; not listed
            return self.fs.inodes.intern(("dsstage", self.ds.ds_id), lambda: StageFile(self.fs, self.ds))
        if name not in self._visible():
            raise NotFound(f"no {name!r}")
        return self.entries[name]()

    def children(self, start: int):
        for i, name in enumerate(self._visible()[start:], start + 1):
            yield name, self.entries[name](), i

    def xattrs(self) -> dict[bytes, bytes]:
        return {b"state": b"sealed" if self.ds.sealed else b"open",
                b"items": b"%d" % self.ds.counters.items}

    async def setattr(self, attr, fields, handle, ctx) -> None:
        """chmod/chown of datasets/NAME set the dataset's mode and owner (kept in the store);
        its control files follow them. Times are accepted and not kept (touch works)."""
        if fields.update_size:
            raise IsADirectory("datasets/NAME is a directory")
        if fields.update_mode or fields.update_uid or fields.update_gid:
            await self.fs.store.set_owner("datasets", self.ds.name,
                                          mode=attr.st_mode if fields.update_mode else None,
                                          uid=attr.st_uid if fields.update_uid else None,
                                          gid=attr.st_gid if fields.update_gid else None)

    async def setxattr(self, name: bytes, value: bytes, ctx=None) -> None:
        if name != b"sealed":
            await super().setxattr(name, value, ctx)
        if value.strip() not in (b"1", b"true", b"yes"):
            raise InvalidArgument("a dataset is sealed with the value 1; it cannot be unsealed")
        await self.ds.seal()
        await self._keep_sealed_attributes()

    async def _keep_sealed_attributes(self) -> None:
        """The kernel may hold inodes of this dataset's items and directories from before the
        seal, with attributes it was told not to cache (they could change then): the
        permission check of each one's next open asked Python for them again. Sealed, they
        change only by a chmod or chown that Python answers: the front answers those
        GETATTRs now, as many as its table holds. (Not on a shared store: another node's
        chmod would not reach them.)"""
        if self.ds.shared is not None:
            return
        nodes = [self] + [n for n in self.fs.inodes.nodes()
                          if isinstance(n, (ItemNode, ItemsDir)) and n.ds is self.ds]
        for i, node in enumerate(nodes):
            if isinstance(node, ItemNode) and (node.removed or node.writers or node.item_id is None):
                continue
            try:
                attrs = node.attributes()
            except DistorefsError:  # gone meanwhile
                continue
            if not interpose.keep_attributes(attrs):
                return
            if i % 512 == 511:  # the loop serves requests between
                await trio.sleep(0)


class ItemsDir(Node):
    """items/ and every directory below it."""

    def __init__(self, fs: "Filesystem", ds: Dataset, dir_id: int) -> None:
        super().__init__(fs)
        self.ds = ds
        self.dir_id = dir_id
        self._rec: DirRec | None = None

    def record(self) -> DirRec:
        rec = self._rec
        if rec is None or not self.ds.sealed:
            rec = self.ds.dir(self.dir_id)
            self._rec = rec if self.ds.sealed else None  # sealed: never changes
        return rec

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        rec = self.record()
        if self.ds.sealed:
            return make_attrs(self.ino, stat.S_IFDIR | (rec.mode & 0o7777), 0, rec.uid, rec.gid, rec.mtime_ns,
                              self.fs.store.config.entry_timeout, nlink=2, entry_timeout=DIR_LONG)
        subdirs = self.ds.subdirs(self.dir_id)  # None in a very big directory: 1, "not counted", as btrfs
        return stamp_attrs(self.ino, stat.S_IFDIR | (rec.mode & 0o7777), 0, rec, NO_CACHE,
                           nlink=1 if subdirs is None else dir_nlink(subdirs), entry_timeout=DIR_LONG)

    def node_for(self, kind: int, node_id: int, name: bytes, rec=None) -> Node:
        fs, ds = self.fs, self.ds
        if kind == DIR:
            node = fs.inodes.intern(("dsdir", ds.ds_id, node_id), lambda: ItemsDir(fs, ds, node_id),
                                    stable_number(DATASET_DIR, ds.ds_id, node_id))
        elif kind == LINK:
            return fs.inodes.intern(("dslink", ds.ds_id, node_id), lambda: DatasetLink(fs, ds, node_id),
                                    stable_number(DATASET_LINK, ds.ds_id, node_id))
        else:
            # sealing renumbers the items (a new tag): a number then, not before and after
            node = fs.inodes.intern(("dsitem", ds.ds_id, ds.tag, node_id),
                                    lambda: ItemNode(fs, ds, self.dir_id, name, node_id),
                                    stable_number(DATASET_FILE, ds.ds_id, node_id))
            node.parent_id, node.name = self.dir_id, name
        if rec is not None and ds.sealed:
            node._rec = rec  # read in the same transaction as the name; sealed records never change
        return node

    async def lookup(self, name: bytes, ctx=None) -> Node:
        check_name(name)
        pending = self.fs.pending_items.get((self.ds.ds_id, self.dir_id, name))
        if pending is not None:
            return pending
        found = self.ds.lookup(self.dir_id, name)
        if found is None:
            raise NotFound(f"no {name!r}")
        return self.node_for(found[0], found[1], name, found[2])

    def children(self, start: int):
        for name, kind, node_id, ordinal, rec in self.ds.children(self.dir_id, start):
            yield name, self.node_for(kind, node_id, name, rec), ordinal + 1

    def _owner(self, mode: int, ctx, kind: int) -> Owner:
        return Owner(kind | (mode & ~ctx.umask & 0o7777), ctx.uid, ctx.gid)

    async def create(self, name: bytes, mode: int, flags: int, ctx) -> tuple[Node, Handle]:
        self.ds._writable()
        check_name(name)
        key = (self.ds.ds_id, self.dir_id, name)
        found = self.ds.child(self.dir_id, name)
        if found is not None:
            if flags & os.O_EXCL:
                raise AlreadyExists(f"{name!r} exists")
            node = self.node_for(found[0], found[1], name)
            return node, await node.open(flags, ctx)
        node = ItemNode(self.fs, self.ds, self.dir_id, name, None)
        node.new_id = self.ds.take_file_id()  # its inode number is its item's from the start
        node = self.fs.inodes.intern(("dspending",) + key, lambda: node,
                                     stable_number(DATASET_FILE, self.ds.ds_id, node.new_id))
        handle = ItemWriter(node, self._owner(mode, ctx, stat.S_IFREG), await self.ds.draft(None),
                            wants_read(flags), fresh=True)
        node.writers.append(handle)
        self.fs.pending_items[key] = node
        return node, handle

    async def mkdir(self, name: bytes, mode: int, ctx) -> Node:
        rec = await self.ds.mkdir(self.dir_id, name, self._owner(mode, ctx, stat.S_IFDIR))
        return self.node_for(DIR, rec.id, name)

    async def symlink(self, name: bytes, target: bytes, ctx) -> Node:
        rec = await self.ds.symlink(self.dir_id, name, target, Owner(stat.S_IFLNK | 0o777, ctx.uid, ctx.gid))
        return self.node_for(LINK, rec.id, name)

    async def rmdir(self, name: bytes) -> None:
        await self.ds.remove(self.dir_id, name, want_dir=True)

    def _open_node(self, name: bytes) -> "ItemNode | None":
        """The node of `name` if the kernel holds it (an open file among them)."""
        pending = self.fs.pending_items.get((self.ds.ds_id, self.dir_id, name))
        if pending is not None:
            return pending
        found = self.ds.child(self.dir_id, name)
        if found is None or found[0] != FILE:
            return None
        return self.fs.inodes.node_of(("dsitem", self.ds.ds_id, self.ds.tag, found[1]))

    async def unlink(self, name: bytes) -> None:
        node = self._open_node(name)
        if node is not None and node.item_id is None:  # created, not written yet: only its writers hold it
            node.removed = True
            del self.fs.pending_items[(self.ds.ds_id, self.dir_id, name)]
            return
        await self.ds.remove(self.dir_id, name, want_dir=False)
        if node is not None:
            node.removed = True  # its writers' close commits nothing; its readers read their copy

    async def rename(self, old: bytes, new_parent: Node, new: bytes, flags: int) -> None:
        if not isinstance(new_parent, ItemsDir) or new_parent.ds is not self.ds:
            raise CrossDevice("items move between datasets by copy")
        pending = self._open_node(old)
        if pending is not None and pending.item_id is None and pending.writers:
            await pending.writers[-1]._commit()  # a file still being written moves with what it holds
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_EXCHANGE is not supported in datasets")
        if flags & pyfuse3.RENAME_NOREPLACE and self.ds.child(new_parent.dir_id, new) is not None:
            raise AlreadyExists(f"{new!r} exists")
        found = self.ds.child(self.dir_id, old)
        await self.ds.rename(self.dir_id, old, new_parent.dir_id, new)
        if found is not None and found[0] == FILE:
            node = self.fs.inodes.node_of(("dsitem", self.ds.ds_id, self.ds.tag, found[1]))
            if node is not None:
                node.parent_id, node.name = new_parent.dir_id, new

    async def setattr(self, attr, fields, handle, ctx) -> None:
        change = attr_change(attr, fields)
        if change.size is not None:
            raise IsADirectory("a directory has no size to set")
        if not change.empty():
            await self.ds.set_attrs(DIR, self.dir_id, change)

    def xattrs(self) -> dict[bytes, bytes]:
        rec = self.record()
        return {b"path": self.ds.path_of(rec.parent, rec.name).encode()}


class DatasetLink(Node):
    """A symlink under items/ (its record: the target in place of metadata)."""

    def __init__(self, fs: "Filesystem", ds: Dataset, link_id: int) -> None:
        super().__init__(fs)
        self.ds, self.link_id = ds, link_id

    def record(self) -> Item:
        rec = self.ds._read(lambda txn: self.ds._node_txn(txn, LINK, self.link_id, b""))
        if rec is None:
            raise NotFound("the symlink was removed")
        return rec

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        rec = self.record()
        return stamp_attrs(self.ino, stat.S_IFLNK | 0o777, len(rec.meta), rec, NO_CACHE, entry_timeout=DIR_LONG)

    def readlink(self) -> bytes:
        return self.record().meta

    async def setattr(self, attr, fields, handle, ctx) -> None:
        change = attr_change(attr, fields)
        if change.size is not None:
            raise NotPermitted("a symlink has no size to set")
        if not change.empty():
            await self.ds.set_attrs(LINK, self.link_id, change)


class ItemNode(Node):
    """One file under items/. `item_id` is None while a newly created file is unwritten."""

    def __init__(self, fs: "Filesystem", ds: Dataset, parent_id: int, name: bytes, item_id: int | None) -> None:
        super().__init__(fs)
        self.ds = ds
        self.parent_id = parent_id
        self.name = name
        self.item_id = item_id
        self.tag = ds.tag
        self.writers: list[ItemWriter] = []
        self._rec: Item | None = None
        self._rec_generation = -1  # ds.generation when _rec was read (unsealed datasets)
        self.removed = False  # unlinked while open: its writers commit nothing
        self.new_id: int | None = None  # created through the mount: the item id taken at create
        self.last: Item | None = None  # the record last read (attributes of a removed, open file)
        # A sealed item's whole value went into the kernel's page cache (pushed, stored at an
        # open, or read whole): an open needs not load it again. The kernel may have evicted
        # those pages since; then READs come, as without this.
        self.in_page_cache = False
        # A sealed value queued for the page cache and not stored yet: an open that comes
        # first serves it from here, not from the disk (the prefetcher let it go as pushed).
        self.pushing: bytes | None = None

    def item(self) -> Item:
        ds = self.ds
        rec = self._rec
        # a sealed record never changes; an unsealed one is reused until the tree changes (a
        # record of a file of thousands of chunks costs more to unpack than its stat is worth)
        if rec is not None and rec.tag == ds.tag and (ds.sealed or self._rec_generation == ds.generation):
            return rec
        generation = ds.generation
        if self.tag != ds.tag and self.item_id is not None:
            # Sealing renumbered the files: find this one again by its name (and its record,
            # in the same read: every file the kernel held from before the seal asks once).
            found = ds.lookup(self.parent_id, self.name)
            if found is None or found[0] != FILE:
                raise NotFound("item is gone")
            self.item_id, self.tag = found[1], ds.tag
            rec = cast(Item, found[2])
        elif self.item_id is None:
            raise NotFound("not written yet")
        else:
            rec = ds.item(self.item_id)
        self._rec, self._rec_generation = rec, generation
        self.last = rec
        return rec

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        nlink = 0 if self.removed else 1
        if self.writers:
            w = self.writers[-1]
            o = w.owner
            a = make_attrs(self.ino, o.mode, w.size, o.uid, o.gid, w.mtime_ns, NO_CACHE, nlink=nlink,
                           entry_timeout=DIR_LONG)
            a.st_atime_ns, a.st_ctime_ns = w.atime_ns, w.ctime_ns
            return a
        if self.removed and self.last is not None:
            item = self.last
        else:
            item = self.item()
        if self.ds.sealed:
            return make_attrs(self.ino, item.mode, item.size, item.uid, item.gid, item.mtime_ns,
                              self.fs.store.config.entry_timeout, entry_timeout=DIR_LONG)
        return stamp_attrs(self.ino, item.mode, item.size, item, NO_CACHE, nlink=nlink, entry_timeout=DIR_LONG)

    def opened_by_front(self) -> None:
        if self.ds.sealed and self.item_id is not None:
            _, hit = self.ds.prefetcher.take_nowait(self.item_id)  # the hit a pushed value is, counted once
            if not hit:
                # Pushed for a plan a newer order replaced (or pushed again after a miss read
                # it): the kernel's pages serve this open all the same, and it counts once.
                self.ds.prefetcher.served_by_page_cache()
        return None

    def listed(self) -> None:
        # A value loaded before the kernel held the inode (the prefetcher runs ahead of the
        # name warmer's listing) was held in memory: it goes into the page cache now, so
        # that the item's open is the front's, not an OPEN through Python.
        if self.ds.sealed and self.item_id is not None and not self.in_page_cache:
            self.ds.prefetcher.push_held(self.item_id)

    async def adopt(self, flags: int) -> Handle:
        handle = await self.open(flags, None)
        if isinstance(handle, ItemReader) and self.ds.sealed:  # a READ after all: the pages went
            handle.counted = handle.accounted = True  # its open was counted (opened_by_front)
        return handle

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            if self.ds.sealed:
                raise ReadOnly(f"datasets/{self.ds.name} is sealed (read-only)")
            item = None if self.item_id is None else self.item()
            draft = await self.ds.draft(None if flags & os.O_TRUNC else item)
            owner = Owner(item.mode, item.uid, item.gid) if item else Owner(0o100644, ctx.uid, ctx.gid)
            w = ItemWriter(self, owner, draft, wants_read(flags), fresh=bool(flags & os.O_TRUNC))
            if item is not None:
                w.atime_ns, w.ctime_ns = item.atime_ns, item.ctime_ns
                if not flags & os.O_TRUNC:
                    w.mtime_ns = item.mtime_ns
            self.writers.append(w)
            return w
        item = self.item()
        reader = ItemReader(self.ds, item, self.pushing)
        pusher = self.fs.pusher
        if reader.data is None and self.ds.whole_in_memory(item):
            if not self.ds.sealed:
                reader.data = await self.ds.read_item(item)  # its own copy: a rewrite or rm cannot take it away
            elif (item.size <= LOAD_AT_OPEN_MAX and not self.in_page_cache and not self.open_handles
                  and pusher is not None):
                # Not loaded ahead (no order declared, or read out of it): loaded now and put
                # into the page cache before OPEN is answered, as a prefetched value is. The
                # same disk read as at the first READ, less that READ, and less the GETATTR
                # the reader's next fstat would make (a READ drops the kernel's atime).
                reader.data = await reader.load()
        if reader.data is not None and reader.keep_cache and not self.open_handles and pusher is not None:
            if pusher.store_at_open(self.ino, reader.data):  # a value already here: no READ for it
                self.in_page_cache = True
        return reader

    async def commit(self, content, owner: Owner, times=(None, None)) -> None:
        """Commit a writer's draft (or bytes: a truncate by path) as this file's content."""
        if self.removed:
            return  # unlinked while open: nothing to commit
        new_id = self.new_id if self.item_id is None else None
        if isinstance(content, bytes):
            item = await self.ds.put(self.parent_id, self.name, content, owner, times, new_id)
        else:
            item = await self.ds.put_draft(self.parent_id, self.name, content, owner, times, new_id)
        if self.item_id is None:
            self.item_id = item.id
            key = (self.ds.ds_id, self.parent_id, self.name)
            if self.fs.pending_items.get(key) is self:
                del self.fs.pending_items[key]
            self.fs.inodes.rekey(self.key, ("dsitem", self.ds.ds_id, item.tag, item.id))

    def released(self, handle: Handle) -> None:
        if handle in self.writers:
            self.writers.remove(handle)
        if not self.writers and self.item_id is None:
            key = (self.ds.ds_id, self.parent_id, self.name)
            if self.fs.pending_items.get(key) is self:
                del self.fs.pending_items[key]  # created, never committed (a failed write)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        change = attr_change(attr, fields)
        w = handle if isinstance(handle, ItemWriter) else (self.writers[-1] if self.writers else None)
        if change.size is not None:
            if w is not None:
                await w.truncate(change.size)
            else:  # truncate(2) by path: the item rewritten at its new size
                if self.ds.sealed:
                    raise ReadOnly(f"datasets/{self.ds.name} is sealed (read-only)")
                item = self.item()
                if change.size > self.ds.config.max_item_bytes:
                    raise TooLarge(f"{change.size} bytes exceed max_item_bytes {self.ds.config.max_item_bytes}")
                data = await self.ds.read_range(item, 0, min(item.size, change.size)) if item.size else b""
                await self.commit(data + bytes(change.size - len(data)), Owner(item.mode, item.uid, item.gid))
        meta = replace(change, size=None)
        if meta.empty():
            return
        for writer in self.writers:  # what the writers commit at close carries it too
            apply_setattr(writer, meta)
        if self.item_id is not None and not self.removed:
            self.item()  # follows a renumbering
            await self.ds.set_attrs(FILE, self.item_id, meta)

    async def warm(self) -> bytes | None:
        if self.item_id is None:
            return WarmResult().text()
        return (await self.ds.warm(self.item())).text()

    def xattrs(self) -> dict[bytes, bytes]:
        if self.item_id is None:
            return {}
        item = self.item()
        chunk = item.chunks[0] if item.chunks else None
        attrs = {
            b"item": b"%d" % item.id if self.ds.sealed else b"",
            b"path": self.ds.path_of(item.parent, item.name).encode(),
            b"size": b"%d" % item.size,
            b"stored_size": b"%d" % item.stored_size,
            b"checksum": b"crc32:%08x" % item.checksum,
            b"chunks": b"%d" % len(item.chunks),
            b"tier": chunk.tier_name.encode() if chunk else b"lmdb",
            b"compression": chunk.codec_name.encode() if chunk else b"none",
        }
        if not self.ds.sealed:
            del attrs[b"item"]
        if item.meta:
            attrs[b"meta"] = item.meta
        return attrs


class ItemReader(Handle):
    """Reads one item. A sealed item's value is taken from the prefetcher at open when it is
    held already (the kernel may serve every read from its page cache: no READ comes)."""

    node: ItemNode | None

    def __init__(self, ds: Dataset, item: Item, pushing: bytes | None = None) -> None:
        self.ds = ds
        self.item = item
        self.keep_cache = ds.sealed
        self.direct_io = not ds.sealed
        self.data: bytes | None = None
        # Whether this open is in the prefetch counts yet: if no READ comes and it is not,
        # the kernel served the reads from pages an earlier open left in its cache.
        self.accounted = not ds.sealed or item.size == 0
        self.counted = False  # the open was a prefetch hit (the value here, or pushed ahead)
        self._loading: trio.Event | None = None  # a READ is loading the value: others wait for it
        if ds.sealed:
            self.data, self.counted = ds.prefetcher.take_nowait(item.id)
            self.accounted = self.accounted or self.counted
            if self.data is None and pushing is not None:
                self.data = pushing  # (its hit was counted when it was pushed)
        if self.data is not None:
            ds._count_read(len(self.data))

    async def load(self) -> bytes:
        """The whole value, counted once for this open (a hit, late or a miss)."""
        self.accounted = True
        ask, self.counted = not self.counted, True  # (a READ after a failed load: not counted again)
        return await self.ds.read_item(self.item, ask_prefetcher=ask)

    async def read(self, off: int, size: int):
        ds, item = self.ds, self.item
        self.accounted = True
        while self.data is None and ds.whole_in_memory(item):
            if self._loading is not None:  # the kernel sent READs of this open side by side
                await self._loading.wait()  # (as long as that READ's own load: bounded by it)
                continue
            # One load for all of them, so that the open is counted once.
            self._loading = trio.Event()
            try:
                self.data = await self.load()
            finally:
                self._loading.set()
                self._loading = None
        if self.data is not None:
            if ds.sealed and self.node is not None:
                self.node.in_page_cache = True  # the kernel keeps what it read (keep_cache)
            return memoryview(self.data)[off:off + size]
        return await ds.read_range(item, off, size)

    async def release(self) -> None:
        if not self.accounted:
            self.ds.prefetcher.served_by_page_cache()


class ItemWriter(Handle):
    """A file written through the mount: staged in a draft on disk (distorefs/draft.py: copy on
    write over the item's chunks, memory bounded whatever the size), committed at every close
    (a created or truncated file too: it is listed once close() returns)."""

    node: ItemNode

    def __init__(self, node: ItemNode, owner: Owner, draft, readable: bool, fresh: bool) -> None:
        self.node = node
        self.owner = owner
        self.draft = draft
        self.readable = readable
        self.dirty = fresh  # created or truncated: committed even if nothing is written
        now = time.time_ns()
        self.atime_ns = self.mtime_ns = self.ctime_ns = now

    # the attributes chmod/chown/utimes set before the first close (fileattrs.apply_setattr)
    @property
    def mode(self) -> int:
        return self.owner.mode

    @mode.setter
    def mode(self, value: int) -> None:
        self.owner = Owner(value, self.owner.uid, self.owner.gid)

    @property
    def uid(self) -> int:
        return self.owner.uid

    @uid.setter
    def uid(self, value: int) -> None:
        self.owner = Owner(self.owner.mode, value, self.owner.gid)

    @property
    def gid(self) -> int:
        return self.owner.gid

    @gid.setter
    def gid(self, value: int) -> None:
        self.owner = Owner(self.owner.mode, self.owner.uid, value)

    @property
    def size(self) -> int:
        return self.draft.size

    async def read(self, off: int, size: int) -> bytes:
        if not self.readable:
            raise NotPermitted("not open for reading")
        return await self.draft.read(off, size)

    async def write(self, off: int, buf: bytes) -> int:
        n = await self.draft.write(off, buf)  # EFBIG fails this write only (the draft is unchanged)
        self.mtime_ns = self.ctime_ns = time.time_ns()
        self.dirty = True
        return n

    async def truncate(self, size: int) -> None:
        await self.draft.truncate(size)
        self.mtime_ns = self.ctime_ns = time.time_ns()
        self.dirty = True

    async def flush(self) -> None:
        if self.dirty:
            await self._commit()

    async def release(self) -> None:
        try:
            if self.dirty:
                await self._commit()
        finally:
            self.draft.close()

    async def _commit(self) -> None:
        self.dirty = False  # a failed commit was reported to close() and is not retried later
        await self.node.commit(self.draft, self.owner, (self.atime_ns, self.mtime_ns))


class DatasetClientFile(Node):
    """client (once sealed): the channel of MountedDataset reading items in its own process;
    each open (for reading and writing) is a session (distorefs/clientsession.py)."""

    def __init__(self, fs: "Filesystem", ds: Dataset) -> None:
        super().__init__(fs)
        self.ds = ds

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.ds.owner
        return make_attrs(self.ino, stat.S_IFREG | (o.mode & 0o644), 0, o.uid, o.gid, self.ds.ctime_ns, DIR_LONG)

    async def open(self, flags: int, ctx) -> Handle:
        if not (wants_read(flags) and wants_write(flags)):
            raise InvalidArgument("the client file is opened for reading and writing")
        if not self.ds.sealed:
            raise NotFound(f"datasets/{self.ds.name} is not sealed")
        return ClientHandle(self.fs.store.dataset_session(self.ds, lineage(process_of(ctx.pid))))


class OrderFile(Node):
    """order: write the next epoch's item numbers (int64 .npy or lines); read back as .npy."""

    def __init__(self, fs: "Filesystem", ds: Dataset) -> None:
        super().__init__(fs)
        self.ds = ds

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.ds.owner
        return make_attrs(self.ino, stat.S_IFREG | (o.mode & 0o664), len(self.ds.order_npy()), o.uid, o.gid,
                          self.ds.ctime_ns, NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            stream = process_of(ctx.pid)  # each reader process (a DDP rank) declares its own part

            async def declare(data: bytes) -> None:
                for other in [s for s in self.ds.prefetcher.streams if s is not None and s != stream]:
                    if process_gone(cast(int, other)):  # (a dataset's streams are processes)
                        self.ds.drop_order(other)
                await self.ds.declare_order(data, stream)
                if self.fs.names is not None:  # the kernel learns the items' names before their reads
                    self.fs.names.warm(os.path.join("datasets", self.ds.name, "items"))
            return ConfigWriter(declare, b"" if flags & os.O_TRUNC else self.ds.order_npy(), limit=MAX_ORDER_BYTES)
        return BytesReader(self.ds.order_npy(), cacheable=False)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        if fields.update_size:
            if isinstance(handle, ConfigWriter):
                handle.truncate(attr.st_size)
            return


class IndexFile(Node):
    """index.npy: one structured array (item, path, size, checksum, per-item metadata)."""

    def __init__(self, fs: "Filesystem", ds: Dataset) -> None:
        super().__init__(fs)
        self.ds = ds

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.ds.owner
        # It names every item: readable by a class of users only if every directory is.
        mode = o.mode & self.ds.index_mode
        return make_attrs(self.ino, stat.S_IFREG | mode, self.ds.index_size, o.uid, o.gid, self.ds.sealed_ns,
                          self.fs.store.config.entry_timeout)

    async def warm(self) -> bytes | None:
        return (await self.ds.warm_index()).text()

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            raise ReadOnly("index.npy is built when the dataset is sealed")
        return IndexReader(self.ds)


class IndexReader(Handle):
    keep_cache = True

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    async def read(self, off: int, size: int) -> bytes:
        return await self.ds.read_index(off, size)


class StageFile(Node):
    """.stage: `distorefs stage` writes requests naming source files, small ones with their
    bytes (distorefs/stagewire.py); the daemon copies them in and each write returns once
    they are committed and verified. Reading the handle gives one result line per file:
    "ok|skip|error<TAB>path<TAB>size<TAB>message"; on a sealed dataset nothing is written
    and each line says "same" or "differs".

    Who may stage: whoever may open .stage for writing (the dataset's owner, or root: the
    kernel checks its 0600 mode). The daemon opens the sources it reads with that caller's
    uid, gid and groups (distorefs/sources.py), never with its own rights; the bytes a
    stager sends it read itself, as the user it is."""

    def __init__(self, fs: "Filesystem", ds: Dataset) -> None:
        super().__init__(fs)
        self.ds = ds

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        o = self.ds.owner
        return make_attrs(self.ino, stat.S_IFREG | 0o600, 0, o.uid, o.gid, self.ds.ctime_ns, NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        cred = Credentials.of_caller(ctx.pid, ctx.uid, ctx.gid)
        check_can_act_for(cred)
        return StageHandle(self.ds, Owner(0o100000 | (0o666 & ~ctx.umask), ctx.uid, ctx.gid), cred)


class StageHandle(Handle):
    direct_io = True

    def __init__(self, ds: Dataset, owner: Owner, cred: Credentials) -> None:
        self.ds = ds
        self.owner = owner
        self.cred = cred
        self.stream = StageStream()
        self.results = bytearray()

    async def write(self, off: int, buf: bytes) -> int:
        requests = self.stream.feed(buf)
        if requests:
            stage = self.ds.compare_sealed if self.ds.sealed else self.ds.stage
            for r in await stage(requests, self.owner, self.cred):
                self.results += f"{r.status}\t{r.path}\t{r.size}\t{r.message}\n".encode("utf-8", "surrogateescape")
        return len(buf)

    async def read(self, off: int, size: int) -> bytes:
        return bytes(self.results[off:off + size])


def push_into_page_cache(fs: "Filesystem", ds: Dataset):
    """The prefetcher's push hook: queue a value for the kernel page cache when the kernel
    holds the item's inode already (otherwise notify_store has nowhere to put it)."""
    def push(item_id: int, value: bytes) -> bool:
        pusher = fs.pusher
        ino = fs.inodes.ino_of(("dsitem", ds.ds_id, SEALED, item_id))
        if pusher is None or ino is None or not fs.inodes.known(ino) or not value:
            return False
        node = fs.inodes.node_of(("dsitem", ds.ds_id, SEALED, item_id))
        if node is None or node.open_handles:
            return False  # being read now: its READ takes the value from memory instead
        # Once the kernel holds the value, its next open is the front's: a sealed item's
        # open only takes its value from the prefetcher (ItemNode.opened_by_front), and
        # its reads are the kernel's (keep_cache; a READ after all makes the handle here).
        # Unless Python opened it while the push waited: that open took the value's hit.
        opens = node.opens

        def stored() -> None:  # (in the pusher's thread)
            if node.opens == opens:
                interpose.answer_opens(ino, os.O_RDONLY, keep_cache=True, noflush=True, once=True)

        def ended() -> None:  # (in the pusher's thread, stored or not)
            if node.pushing is value:
                node.pushing = None

        node.pushing = value  # (before the push: its end may come before push() returns)
        node.in_page_cache = pusher.push(ino, value, then=stored, done=ended)
        if not node.in_page_cache:
            node.pushing = None
        return node.in_page_cache
    return push

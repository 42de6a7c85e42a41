"""Datasets (datasets/NAME/): a tree of files staged once, sealed, then read many times.

Before it is sealed a dataset is an ordinary writable tree (`distorefs stage`, `cp -r`,
`rsync` into `items/`). Sealing numbers its files in path order (depth first, names in
byte order: item i is row i of `index.npy`), builds `index.npy` and makes the tree
read-only. Its `order` (the item numbers of the next epoch) drives the prefetcher.

Everything lives in LMDB, not in memory, so a directory of millions of files costs a
lookup (one B-tree get) and a readdir (a range scan from the reader's position), never
a scan of the directory. Records in the `dsnodes` db, keys prefixed by the dataset id:

  c                        counters: next file id, next dir id, items, bytes, stored bytes, sealed
  d + dir                  directory: parent, owner, mtime, next ordinal, name
  n + dir + name           child by name: kind, id, ordinal
  o + dir + ordinal        child by position (readdir): kind, id, name
  i + id / s + number      file (staging id / sealed item number): size, checksum, owner,
                           mtimes, parent, chunks, name, per-item metadata (JSON)
  l + id                   symlink (an item record: its target in place of metadata)

A file's content is a list of chunks (`chunks.py`), each checksummed. Changes are
planned against LMDB inside the group's write transaction, so changes of one group
see each other in order; the in-memory counters follow at apply.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import os
import stat
import struct
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Hashable, Iterator, Sequence, cast

import numpy as np
import trio

from . import codec
from .backends.crc import crc32
from .committer import Change, Overlay
from .config import DatasetConfig
from .catalog import DB_NS
from .errors import (AlreadyExists, CorruptValue, DistorefsError, InvalidArgument, IsADirectory, NotADirectory,
                     NotEmpty, NotFound, ReadOnly, TooLarge)
from .codec import crc32_combine
from .draft import Draft
from .fileattrs import AttrChange, apply_setattr
from .names import check_name
from .owner import Owner
from .prefetcher import PrefetchStreams
from .services import Services
from .stagewire import INLINE_MAX
from .values import StoredValue, WarmResult
from .sources import (CachedFirst, Credentials, NotCached, OpenSource, SourceRefused, SourceRoots, acting_as,
                      read_ahead, read_bounded, read_cached)

log = logging.getLogger(__name__)

DB_DSNODES = b"dsnodes"
ROOT_DIR = 1
DIR, FILE, LINK = 0, 1, 2
STAGING, SEALED = b"i", b"s"
LINKS = b"l"  # symlinks: an Item record whose `meta` is the target (never numbered, sealed or not)
PREPARE_MAX = 8 << 20  # files up to this size are read and compressed before the commit (bigger ones stream in it)
READ_AHEAD_BYTES = 64 << 20  # of uncached sources the kernel is asked to read ahead of the one being read
VERIFY_RUN_BYTES = 8 << 20  # staged values read back together to verify them
ROWS_AT_ONCE = 4096  # index rows the seal converts and writes at once

_DS = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_COUNTERS = struct.Struct("<QQQQQB")
_DIR = struct.Struct("<QIIIqQ")
_CHILD = struct.Struct("<BQQ")
_POS = struct.Struct("<BQ")
_ITEM = struct.Struct("<QIIIIqqQHHI")
_TIMES = struct.Struct("<qq")  # atime, ctime (after a record's older fields)


@dataclass
class Counters:
    next_file: int = 0
    next_dir: int = ROOT_DIR + 1
    items: int = 0
    bytes: int = 0
    stored_bytes: int = 0
    sealed: int = 0

    def pack(self) -> builtins.bytes:  # `bytes` in here is the field
        return _COUNTERS.pack(self.next_file, self.next_dir, self.items, self.bytes, self.stored_bytes, self.sealed)

    @classmethod
    def unpack(cls, data) -> "Counters":
        return cls(*_COUNTERS.unpack(bytes(data)))


@dataclass(slots=True)
class DirRec:
    id: int
    parent: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    next_ordinal: int
    name: bytes
    atime_ns: int = 0
    ctime_ns: int = 0

    def pack(self) -> bytes:
        # atime and ctime follow the name after a NUL (a name holds none); older records end at the name
        return (_DIR.pack(self.parent, self.mode, self.uid, self.gid, self.mtime_ns, self.next_ordinal) + self.name
                + b"\0" + _TIMES.pack(self.atime_ns or self.mtime_ns, self.ctime_ns or self.mtime_ns))

    @classmethod
    def unpack(cls, dir_id: int, data) -> "DirRec":
        rest = bytes(data[_DIR.size:])
        name, sep, times = rest.partition(b"\0")
        parent, mode, uid, gid, mtime_ns, next_ordinal = _DIR.unpack_from(data)
        rec = cls(dir_id, parent, mode, uid, gid, mtime_ns, next_ordinal, name)
        rec.atime_ns, rec.ctime_ns = _TIMES.unpack(times) if sep and len(times) == _TIMES.size else (
            rec.mtime_ns, rec.mtime_ns)
        return rec


@dataclass(slots=True)
class Item:
    id: int
    size: int
    checksum: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    src_mtime_ns: int
    parent: int
    chunks: list[StoredValue]
    name: bytes
    meta: bytes = b""
    tag: bytes = STAGING
    atime_ns: int = 0
    ctime_ns: int = 0

    @property
    def stored_size(self) -> int:
        return sum(c.stored_size for c in self.chunks)

    def pack(self) -> bytes:
        head = _ITEM.pack(self.size, self.checksum, self.mode, self.uid, self.gid, self.mtime_ns,
                          self.src_mtime_ns, self.parent, len(self.chunks), len(self.name), len(self.meta))
        return (head + b"".join(c.pack() for c in self.chunks) + self.name + self.meta
                + _TIMES.pack(self.atime_ns or self.mtime_ns, self.ctime_ns or self.mtime_ns))

    @staticmethod
    def indexed(data) -> tuple[int, int, bytes]:
        """(size, checksum, metadata) of a packed item: what its index row needs, read
        without building the item (a seal reads every item)."""
        (size, crc, _, _, _, _, _, _, nchunks, name_len, meta_len) = _ITEM.unpack_from(data)
        off = _ITEM.size
        for _ in range(nchunks):
            off = StoredValue.skip(data, off)
        off += name_len
        return size, crc, bytes(data[off:off + meta_len])

    @classmethod
    def unpack(cls, item_id: int, data, tag: bytes) -> "Item":
        (size, crc, mode, uid, gid, mtime, src_mtime, parent, nchunks, name_len, meta_len) = _ITEM.unpack_from(data)
        off = _ITEM.size
        chunks = []
        for _ in range(nchunks):
            chunk, off = StoredValue.unpack_from(data, off)
            chunks.append(chunk)
        name = bytes(data[off:off + name_len])
        meta = bytes(data[off + name_len:off + name_len + meta_len])
        off += name_len + meta_len
        atime, ctime = _TIMES.unpack_from(data, off) if len(data) - off >= _TIMES.size else (mtime, mtime)
        return cls(item_id, size, crc, mode, uid, gid, mtime, src_mtime, parent, chunks, name, meta, tag, atime, ctime)


@dataclass
class StageResult:
    path: str
    status: str  # ok | skip | error
    message: str = ""
    size: int = 0


# One thread at a time opens and reads what the kernel has cached, for every stage of the
# daemon: several would spend their time handing the GIL to each other (distorefs/sources.py).
CACHED_LANE = trio.CapacityLimiter(1)


@dataclass
class _Source:
    """One file to stage: where it comes from and what the source said about it."""

    path: str
    parts: list[bytes]
    src: str
    size: int
    mtime_ns: int
    meta: bytes = b""
    crc: int = 0
    encoded: list[codec.Encoded] | None = None
    error: str = ""
    root: str | None = None  # the tree (or list directory) the source must stay beneath; None: anywhere
    follow: bool = False  # --follow-symlinks: links are followed wherever they lead
    opened: OpenSource | None = None  # open with the caller's rights; size and mtime from its fstat
    data: bytes | memoryview | None = None  # the bytes themselves, read and sent by the stager (see `stage`)
    sent: bool = False  # its bytes came with the request
    codec: int | None = None  # ... encoded so by the stager (None: as read)
    owner: Owner | None = None  # the item's mode and owner, from the source
    dirs: list[Owner] = field(default_factory=list)  # the directories on its path, from the source tree


class Dataset:
    kind = "datasets"
    config_type = DatasetConfig

    def __init__(self, services: Services, ds_id: int, name: str, config: DatasetConfig, owner: Owner,
                 ctime_ns: int, record: dict | None = None) -> None:
        self.values = services.values
        self.committer = services.committer
        self.env = services.env
        self.spool_dir = services.spool_dir
        self.prefetch_budget = services.prefetch_budget
        self.ds_id = ds_id
        self.name = name
        self.config = config
        self.owner = owner
        self.ctime_ns = ctime_ns
        record = record or {}
        self.sealed_ns: int = record.get("sealed_ns", 0)
        self.index_mode: int = record.get("index_mode", 0o444)  # see Seal: who may read index.npy
        self.index_chunks = [StoredValue.from_json(c) for c in record.get("index", [])]
        self.index_size: int = record.get("index_size", 0)
        self.fields: list = record.get("fields", [])
        # on a shared store, once sealed: {"export": id, "origin": node} (distorefs/datasetslog.py)
        self.shared: dict | None = record.get("shared")
        self._share = services.share_sealed
        self.counters = Counters()
        self.file_ids_taken = 0  # ids handed to files created through the mount, not committed yet, are below it
        self.generation = 0  # bumped by every change of the tree: a record read at this generation is current
        self.order = np.zeros(0, dtype=np.int64)
        self.stats_counters = {"reads": 0, "read_bytes": 0, "staged": 0, "staged_bytes": 0, "staged_sent": 0,
                               "skipped": 0, "stage_errors": 0, "verify_failures": 0, "orders": 0}
        # one plan per declaring stream (a DDP rank): see declare_order
        self.prefetcher: PrefetchStreams[int] = PrefetchStreams(services.prefetch_budget, self._fetch_blocking,
                                                                spawn=services.spawn, elsewhere=self._read_directly)
        # The processes (and their ancestors) of open client sessions (distorefs/
        # clientsession.py): they read items from the store's files themselves, so an order
        # one of them declared is not read ahead here; that would only take the CPU from
        # them (measured: 4 such readers went from 24,457 to 6,429 items/s while the daemon
        # read ahead for nobody). Orders of other processes (mount readers) are read ahead.
        self._direct: list[frozenset[int]] = []
        self._prefix = _DS.pack(ds_id)
        # staging: sources opened and read from the kernel's caches first (distorefs/sources.py)
        self._cached_opens, self._cached_reads = CachedFirst(), CachedFirst()

    @property
    def ns_id(self) -> int:
        return self.ds_id

    @property
    def sealed(self) -> bool:
        return bool(self.counters.sealed)

    @property
    def tag(self) -> bytes:
        return SEALED if self.sealed else STAGING

    def load(self, txn) -> None:
        data = txn.get(self._key(b"c"), db=DB_DSNODES)
        self.counters = Counters.unpack(data) if data is not None else Counters()

    def record(self) -> dict:
        return {"sealed_ns": self.sealed_ns, "index_size": self.index_size, "fields": self.fields,
                "index_mode": self.index_mode,
                "index": [c.to_json() for c in self.index_chunks],
                **({"shared": self.shared} if self.shared is not None else {})}

    def drop_txn(self, txn) -> None:
        """Remove the dataset's records (it is empty: only counters and the root remain)."""
        cursor = txn.cursor(db=DB_DSNODES)
        while cursor.set_range(self._prefix) and bytes(cursor.key()[:len(self._prefix)]) == self._prefix:
            cursor.delete()

    def reconfigure(self, config: DatasetConfig) -> None:
        self.config = config

    # ----- keys -----------------------------------------------------------------------

    def _key(self, tag: bytes, *parts: bytes) -> bytes:
        return self._prefix + tag + b"".join(parts)

    # (the keys of every record, several per staged file: built directly, not through _key)
    def _dkey(self, dir_id: int) -> bytes:
        return self._prefix + b"d" + _U64.pack(dir_id)

    def _nkey(self, dir_id: int, name: bytes) -> bytes:
        return self._prefix + b"n" + _U64.pack(dir_id) + name

    def _okey(self, dir_id: int, ordinal: int) -> bytes:
        return self._prefix + b"o" + _U64.pack(dir_id) + _U64.pack(ordinal)

    def _ikey(self, tag: bytes, item_id: int) -> bytes:
        return self._prefix + tag + _U64.pack(item_id)

    # ----- metadata reads (LMDB, metadata pages only) ------------------------------------

    def _read(self, fn):
        return self.env.read(fn)

    def dir(self, dir_id: int) -> DirRec:
        rec = self._read(lambda txn: self._dir_txn(txn, dir_id))
        if rec is None:
            raise NotFound(f"datasets/{self.name}: directory {dir_id} is gone")
        return rec

    def _dir_txn(self, txn, dir_id: int) -> DirRec | None:
        if dir_id == ROOT_DIR:
            data = txn.get(self._dkey(dir_id), db=DB_DSNODES)
            if data is None:  # the root exists from creation; its record only once changed
                o = self.owner
                return DirRec(ROOT_DIR, 0, 0o40755, o.uid, o.gid, self.ctime_ns, 0, b"", self.ctime_ns, self.ctime_ns)
            return DirRec.unpack(dir_id, data)
        data = txn.get(self._dkey(dir_id), db=DB_DSNODES)
        return None if data is None else DirRec.unpack(dir_id, data)

    def child(self, dir_id: int, name: bytes) -> tuple[int, int] | None:
        """(kind, id) of `name` in directory `dir_id`, or None."""
        return self._read(lambda txn: self._child_txn(txn, dir_id, name))

    def _child_txn(self, txn, dir_id: int, name: bytes) -> tuple[int, int] | None:
        data = txn.get(self._nkey(dir_id, name), db=DB_DSNODES)
        if data is None:
            return None
        kind, child_id, _ = _CHILD.unpack(data)
        return kind, child_id

    def item(self, item_id: int) -> Item:
        tag = self.tag
        item = self._read(lambda txn: self._item_txn(txn, tag, item_id))
        if item is None:
            raise NotFound(f"datasets/{self.name}: item {item_id} is gone")
        return item

    def sealed_items(self, numbers: list[int]) -> list[Item | None]:
        """The records of sealed items by number, None for a number out of range (one read
        transaction; worker thread)."""
        return self._read(lambda txn: [self._item_txn(txn, SEALED, i) for i in numbers])

    def _node_txn(self, txn, kind: int, node_id: int, tag: bytes):
        if kind == DIR:
            return self._dir_txn(txn, node_id)
        return self._item_txn(txn, LINKS if kind == LINK else tag, node_id)

    def _item_txn(self, txn, tag: bytes, item_id: int) -> Item | None:
        data = txn.get(self._ikey(tag, item_id), db=DB_DSNODES)
        return None if data is None else Item.unpack(item_id, data, tag)

    def lookup(self, dir_id: int, name: bytes) -> tuple[int, int, "Item | DirRec"] | None:
        """(kind, id, record) of `name` in `dir_id`, in one read transaction; or None."""
        tag = self.tag

        def fn(txn):
            found = self._child_txn(txn, dir_id, name)
            if found is None:
                return None
            kind, node_id = found
            rec = self._node_txn(txn, kind, node_id, tag)
            return None if rec is None else (kind, node_id, rec)
        return self._read(fn)

    def children(self, dir_id: int, start: int, limit: int = 128) -> list[tuple[bytes, int, int, int, object]]:
        """Up to `limit` children of `dir_id` from ordinal `start` on: (name, kind, id, ordinal,
        record), read in one transaction."""
        tag = self.tag

        def fn(txn):
            out = []
            cursor = txn.cursor(db=DB_DSNODES)
            prefix = self._key(b"o", _U64.pack(dir_id))
            if not cursor.set_range(self._okey(dir_id, start)):
                return out
            for key, value in cursor:
                if not bytes(key[:len(prefix)]) == prefix or len(out) >= limit:
                    break
                kind, child_id = _POS.unpack_from(value)
                out.append((bytes(value[_POS.size:]), kind, child_id, _U64.unpack(bytes(key[-8:]))[0]))
            return [(name, kind, i, o, self._node_txn(txn, kind, i, tag)) for name, kind, i, o in out]
        return self._read(fn)

    def path_of(self, parent: int, name: bytes) -> str:
        parts = [name]
        def fn(txn):
            d = parent
            while d != ROOT_DIR:
                rec = self._dir_txn(txn, d)
                if rec is None:
                    break
                parts.append(rec.name)
                d = rec.parent
        self._read(fn)
        return os.fsdecode(b"/".join(reversed(parts)))

    def resolve(self, path: bytes) -> tuple[int, int]:
        """(kind, id) of a relative path."""
        kind, node_id = DIR, ROOT_DIR
        for part in [p for p in path.split(b"/") if p]:
            if kind != DIR:
                raise NotFound(f"{path!r}: not a directory on the way")
            found = self.child(node_id, part)
            if found is None:
                raise NotFound(f"datasets/{self.name}/items/{os.fsdecode(path)}: no such item")
            kind, node_id = found
        return kind, node_id

    # ----- content --------------------------------------------------------------------

    def _cache_key(self, item: Item, index: int) -> tuple:
        # A rewrite stores its chunks under the same locations (keyed by item and index)
        # and may keep the mtime (utime before close): the chunk's size and CRC-32 tell
        # versions apart, as a read from its tier checks them.
        chunk = item.chunks[index]
        return ("ds", self.ds_id, item.tag, item.id, index, chunk.size, chunk.checksum)

    def _what(self, item: Item, index: int) -> str:
        # Cheap (it is made for every read): the item's name, not its path (a walk up the tree).
        name = item.name.decode("utf-8", "replace")
        return f"datasets/{self.name} item {item.id} ({name}) chunk {index}"

    async def warm(self, item: Item) -> WarmResult:
        """Load an item's chunks into the memory tier (distorefs warmup), under the keys its
        reads look for."""
        return await self.values.warm([(self._cache_key(item, i), c, self._what(item, i))
                                       for i, c in enumerate(item.chunks)])

    def whole_in_memory(self, item: Item) -> bool:
        return item.size <= self.config.chunk_bytes

    async def read_item(self, item: Item, ask_prefetcher: bool = True) -> bytes:
        """The content of a one-chunk item: prefetched if it was, else from its tier.
        `ask_prefetcher` False: this read's open was counted already (its value was pushed
        into the page cache, and the kernel has dropped those pages since)."""
        if self.sealed and ask_prefetcher:
            value = await self.prefetcher.take(item.id)
            if value is not None:
                self._count_read(len(value))
                return value
        if not item.chunks:
            value = b""
        else:
            _, value = await self._chunk(item, 0)
        self._count_read(len(value))
        return value

    async def read_range(self, item: Item, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of an item of many chunks, chunk by chunk via the memory tier."""
        end = min(off + size, item.size)
        if off >= end:
            return b""
        step = item.chunks[0].size  # every chunk but the last is this big
        parts = []
        for i in range(off // step, (end - 1) // step + 1):
            item, data = await self._chunk(item, i)
            parts.append(memoryview(data)[max(off - i * step, 0):min(end - i * step, len(data))])
        out = parts[0].tobytes() if len(parts) == 1 else b"".join(parts)
        self._count_read(len(out))
        return out

    async def _chunk(self, item: Item, index: int) -> tuple[Item, bytes]:
        """Chunk `index` of `item` (and the record it was read with). An unsealed file's
        writer stores its version's chunks where the version before kept them, so a read
        made with the record of that version may find other bytes: that is a rewrite, not
        damage. The chunk is then read as the file has it now (a reader of a local file
        being rewritten gets the new bytes too; past the new end, none), its record and
        bytes in one snapshot, so no further rewrite comes between them. Only bytes that
        do not match the record of their snapshot are damage (EIO, reported)."""
        if index >= len(item.chunks):
            return item, b""
        try:
            return item, await self.values.fetch_one(self._cache_key(item, index), item.chunks[index],
                                                     self._what(item, index), must_exist=self.sealed)
        except (CorruptValue, NotFound):
            if self.sealed:
                raise  # a sealed record never changes: damage, reported by fetch_one
        current, data = await trio.to_thread.run_sync(self._chunk_now, item, index)
        if isinstance(data, DistorefsError) and self.item(item.id).chunks != current.chunks:
            # A value in a segment is never rewritten in place, but its segment may have been
            # collected after the snapshot began (the file rewritten meanwhile): once more.
            current, data = await trio.to_thread.run_sync(self._chunk_now, item, index)
        if isinstance(data, DistorefsError):
            raise self.values.report_corrupt(data)
        return current, data

    def _chunk_now(self, item: Item, index: int) -> tuple[Item, "bytes | DistorefsError"]:
        """(the current record of `item`, chunk `index` as it holds it, or the error of
        reading it), in one read transaction (worker thread)."""
        tag = self.tag

        def fn(txn):
            current = self._item_txn(txn, tag, item.id)
            if current is None:
                raise NotFound(f"datasets/{self.name}: {item.name!r} was removed while it was read")
            if index >= len(current.chunks):
                return current, b""
            try:
                return current, self.values.read_in(txn, current.chunks[index], self._what(current, index))
            except (CorruptValue, NotFound) as exc:
                return current, exc
        return self._read(fn)

    def _count_read(self, n: int) -> None:
        self.stats_counters["reads"] += 1
        self.stats_counters["read_bytes"] += n

    def _fetch_blocking(self, ids: list[int]) -> list[bytes | None]:
        """The prefetcher's loader: whole items (worker thread); big ones are left to the reader."""
        limit = max(self.config.chunk_bytes, self.prefetch_budget.capacity // 8)
        items = [item if item is not None and item.size <= limit else None for item in self.sealed_items(ids)]
        # every chunk in one read: a shared dataset's in one pipeline to the cluster
        results = iter(self.values.read_all([(c, self._what(item, i)) for item in items if item is not None
                                             for i, c in enumerate(item.chunks)]))
        out: list[bytes | None] = []
        for item in items:
            if item is None:
                out.append(None)
                continue
            parts = [next(results) for _ in item.chunks]
            if any(isinstance(p, DistorefsError) for p in parts):
                out.append(None)  # the read reports it
            else:
                out.append(parts[0] if len(parts) == 1 else b"".join(parts))
        return out

    # ----- the declared order ---------------------------------------------------------

    async def declare_order(self, data: bytes, stream: Hashable = None) -> int:
        """Set the order of the next reads (int64 .npy, or one item number or path per line)
        of `stream` (a reader: the ranks of a DDP job each declare their part of an epoch,
        and each is read ahead; a stream's new order replaces only its own)."""
        if not self.sealed:
            raise InvalidArgument(f"datasets/{self.name} is not sealed: seal it before declaring an order")
        order = await trio.to_thread.run_sync(self._parse_order, data)
        self.order = order
        self.stats_counters["orders"] += 1
        self.prefetcher.declare(cast("Sequence[int]", order), stream)  # an int64 array: indexed and sliced
        return len(order)

    def _read_directly(self, stream: Hashable) -> bool:
        """Whether the order of `stream` (the declaring process) is read by client sessions."""
        return any(stream in lineage for lineage in self._direct)

    def session_started(self, lineage: frozenset[int]) -> None:
        """A client session opened by the last of `lineage`: orders they declared are not read
        ahead any more, and what is held for them goes."""
        self._direct.append(lineage)
        self.prefetcher.release_held([s for s in self.prefetcher.streams if s in lineage])

    def session_ended(self, lineage: frozenset[int]) -> None:
        if lineage in self._direct:
            self._direct.remove(lineage)

    def drop_order(self, stream: Hashable) -> None:
        """`stream` reads no more (its process is gone): stop reading ahead for it."""
        self.prefetcher.drop(stream)

    def _parse_order(self, data: bytes) -> np.ndarray:
        n = self.counters.items
        if data.startswith(b"\x93NUMPY"):
            try:
                order = np.load(io.BytesIO(data), allow_pickle=False)
            except Exception as exc:
                raise InvalidArgument(f"order: not a loadable .npy: {exc}") from None
            if order.ndim != 1 or order.dtype.kind not in "iu":
                raise InvalidArgument(f"order: expected a 1-d integer array, got {order.dtype} {order.shape}")
            order = order.astype(np.int64, copy=False)
        else:
            values = []
            for number, line in enumerate(data.splitlines(), 1):
                line = line.strip()
                if not line or line.startswith(b"#"):
                    continue
                if line.isdigit():
                    values.append(int(line))
                    continue
                try:
                    kind, item_id = self.resolve(line)
                except NotFound:
                    raise InvalidArgument(f"order line {number}: no item {line[:200]!r}") from None
                if kind != FILE:
                    raise InvalidArgument(f"order line {number}: {line[:200]!r} is a directory")
                values.append(item_id)
            order = np.array(values, dtype=np.int64)
        if len(order) and (order.min() < 0 or order.max() >= n):
            raise InvalidArgument(f"order: item numbers must be in 0..{n - 1}")
        return order

    def order_npy(self) -> bytes:
        buf = io.BytesIO()
        np.save(buf, self.order)
        return buf.getvalue()

    # ----- the index ------------------------------------------------------------------

    def _index_chunk(self, i: int) -> tuple[Hashable, StoredValue, str]:
        """(cache key, value, what) of index.npy's chunk i."""
        return ("dsindex", self.ds_id, i), self.index_chunks[i], f"datasets/{self.name}/index.npy chunk {i}"

    async def warm_index(self) -> WarmResult:
        """Load index.npy's chunks into the memory tier (distorefs warmup)."""
        return await self.values.warm([self._index_chunk(i) for i in range(len(self.index_chunks))])

    async def read_index(self, off: int, size: int) -> bytes:
        end = min(off + size, self.index_size)
        if off >= end or not self.index_chunks:
            return b""
        step = self.index_chunks[0].size
        parts = []
        for i in range(off // step, (end - 1) // step + 1):
            data = await self.values.fetch_one(*self._index_chunk(i))
            parts.append(memoryview(data)[max(off - i * step, 0):min(end - i * step, len(data))])
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    # ----- writes ---------------------------------------------------------------------

    def _writable(self) -> None:
        if self.sealed:
            raise ReadOnly(f"datasets/{self.name} is sealed (read-only)")

    async def draft(self, item: Item | None) -> Draft:
        """A draft of a file written through the mount, over `item`'s chunks (copy on write,
        on disk: memory stays bounded however big the file; max_item_bytes bounds it)."""
        step = self.config.chunk_bytes
        fits = item is not None and all(c.size <= step for c in item.chunks) and _step_of(item, step) == step

        async def fetch(index: int, chunk: StoredValue) -> bytes:
            assert item is not None  # its chunks are the draft's base; another writer may have replaced them since
            return (await self._chunk(item, index))[1]
        draft = Draft(self.spool_dir, step, self.config.max_item_bytes,  # `fits` holds only with an item
                      list(item.chunks) if fits else [], item.size if fits else 0, fetch)  # type: ignore[union-attr]
        if item is not None and not fits and item.size:  # stored in chunks of another size: copied in once
            try:
                for off in range(0, item.size, step):
                    await draft.write(off, await self.read_range(item, off, step))
            except BaseException:
                draft.close()
                raise
            draft.changes = 0
        return draft

    def take_file_id(self) -> int:
        """The item id a file created through the mount will have once its first close
        commits it, given at its create: its inode number is made from it and stays the
        same for the file's life (mount/inodes.py). Not stored: an id of a file never
        committed (a crash before its close) is simply given again later."""
        self.file_ids_taken = max(self.file_ids_taken, self.counters.next_file) + 1
        return self.file_ids_taken - 1

    def _new_file_id(self, c: Counters, wanted: int | None = None) -> int:
        """The id of a file or link new to the tree (inside a commit): `wanted` if it was
        taken at create, else one above every id taken."""
        item_id = wanted if wanted is not None else max(c.next_file, self.file_ids_taken)
        c.next_file = max(c.next_file, item_id + 1)
        if wanted is None:
            self.file_ids_taken = max(self.file_ids_taken, c.next_file)
        return item_id

    async def put_draft(self, dir_id: int, name: bytes, draft: Draft, owner: Owner,
                        times: tuple[int | None, int | None] = (None, None), new_id: int | None = None) -> Item:
        """Create or replace file `name` with a draft's content: the chunks written are stored,
        the others kept. `new_id`: the id taken at create (`take_file_id`), if it is new."""
        self._writable()
        check_name(name)
        async with draft.lock:
            change = PutItem(self, dir_id, [name], owner, draft=draft, times=times, new_id=new_id)
            await self.committer.submit(change)
            draft.changes = 0
        assert change.item is not None
        return change.item

    async def put(self, dir_id: int, name: bytes, data: bytes, owner: Owner,
                  times: tuple[int | None, int | None] = (None, None), new_id: int | None = None) -> Item:
        """Create or replace file `name` in `dir_id` with `data` (a write through the mount);
        `times`: the atime and mtime set on it before it was closed (None: now)."""
        self._writable()
        check_name(name)
        if len(data) > self.config.max_item_bytes:
            raise TooLarge(f"datasets/{self.name}: {len(data)} bytes exceed max_item_bytes "
                           f"{self.config.max_item_bytes}; stage big files with `distorefs stage`")
        change = PutItem(self, dir_id, [name], owner, data=data, times=times, new_id=new_id)
        await self.committer.submit(change)
        assert change.item is not None
        return change.item

    async def symlink(self, dir_id: int, name: bytes, target: bytes, owner: Owner) -> Item:
        """A symlink in the unsealed tree (its record an Item whose `meta` is the target)."""
        self._writable()
        check_name(name)
        if not target or b"\0" in target or len(target) > 4095:
            raise InvalidArgument("invalid symlink target")
        change = MakeLink(self, dir_id, name, target, owner)
        await self.committer.submit(change)
        return change.rec

    async def mkdir(self, dir_id: int, name: bytes, owner: Owner) -> DirRec:
        self._writable()
        change = MakeDir(self, dir_id, check_name(name), owner)
        await self.committer.submit(change)
        return change.rec

    async def remove(self, dir_id: int, name: bytes, want_dir: bool) -> None:
        self._writable()
        await self.committer.submit(RemoveNode(self, dir_id, name, want_dir))

    async def rename(self, old_dir: int, old: bytes, new_dir: int, new: bytes) -> None:
        self._writable()
        check_name(new)
        await self.committer.submit(RenameNode(self, old_dir, old, new_dir, new))

    async def set_attrs(self, kind: int, node_id: int, change: AttrChange) -> None:
        """chmod, chown, utimes of a file or directory (not its size)."""
        self._writable()
        await self.committer.submit(SetNodeAttrs(self, kind, node_id, replace(change, size=None)))

    def subdirs(self, dir_id: int, limit: int = 10000) -> int | None:
        """How many directories `dir_id` holds (None past `limit` children: not counted)."""
        def fn(txn):
            prefix = self._key(b"n", _U64.pack(dir_id))
            cursor = txn.cursor(db=DB_DSNODES)
            count = seen = 0
            if cursor.set_range(prefix):
                for key, value in cursor:
                    if bytes(key[:len(prefix)]) != prefix:
                        break
                    seen += 1
                    if seen > limit:
                        return None
                    count += value[0] == DIR
            return count
        return self._read(fn)

    async def seal(self) -> None:
        """Number the files in path order, build index.npy, make the tree read-only."""
        if self.sealed:
            return
        await self.committer.submit(Seal(self))
        if self._share is not None:
            await self._share(self)

    # ----- staging from a source tree ---------------------------------------------------

    async def stage(self, requests: list[dict], owner: Owner, cred: Credentials | None = None) -> list[StageResult]:
        """Copy source files into the dataset, skipping those staged already and intact.

        Each request: {"src": source path, "path": relative path, "root": the source tree
        or list directory src must stay beneath (absent: anywhere), "follow": follow
        symlinks, "meta": {...}} ("size" and "mtime_ns" are informative: the source's own
        fstat decides). Sources are opened with `cred`'s rights and must be regular files
        (distorefs/sources.py). Or the stager read the file itself, as the user it is, and
        sent it: "data" holds its bytes (at most INLINE_MAX), "crc" their CRC-32, "mode",
        "uid", "gid" and "mtime_ns" its fstat and "dirs" the (mode, uid, gid) of the
        directories above it in its tree; nothing is opened here then. With "codec" the
        stager encoded them as the dataset stores them ("size": the file's size): they are
        checked, not encoded again. Items keep the source's permission bits; their owner is
        the source's when root stages, else the stager's (`owner`). Every file is verified
        after its commit (its stored chunks read back and checked against the checksum of
        the source bytes).
        """
        self._writable()
        sources, results = _parse_requests(requests)
        keep_owner = cred is not None and cred.is_root
        for s in sources:
            if s.sent:
                assert s.owner is not None  # the source's own, sent with it
                s.owner = _staged_owner(stat.S_IFREG, s.owner, owner, keep_owner)
                s.dirs = [_staged_owner(stat.S_IFDIR, d, owner, keep_owner) for d in s.dirs]
        try:
            await self._open_sources([s for s in sources if not s.sent], owner, cred)
            for s in sources:
                if s.error:
                    results.append(StageResult(s.path, "error", s.error))
                    self.stats_counters["stage_errors"] += 1
            return results + await self._stage_opened([s for s in sources if not s.error], owner)
        finally:
            _close_all(sources)

    async def compare_sealed(self, requests: list[dict], owner: Owner,
                             cred: Credentials | None = None) -> list[StageResult]:
        """A stage request against a sealed dataset: nothing is written; each source is
        "same" (an item at its path with its size and source mtime) or "differs"."""
        sources, results = _parse_requests(requests)
        try:
            await self._open_sources(sources, owner, cred)
            good = [s for s in sources if not s.error]
            results += [StageResult(s.path, "error", s.error) for s in sources if s.error]
            items = await trio.to_thread.run_sync(self._existing, good)
            for s, item in zip(good, items):
                if item is not None and item.size == s.size and item.src_mtime_ns == s.mtime_ns:
                    results.append(StageResult(s.path, "same", size=s.size))
                else:
                    why = "not in the dataset" if item is None else "size or modification time differ"
                    results.append(StageResult(s.path, "differs", why, s.size))
            return results
        finally:
            _close_all(sources)

    async def _open_sources(self, sources: list[_Source], stager: Owner, cred: Credentials | None) -> None:
        """Open the sources: those the kernel resolves from its caches in one thread, the
        rest (waiting for a disk or a server) in parallel threads (distorefs/sources.py)."""
        slow = sources
        if self._cached_opens.worth_trying():
            await trio.to_thread.run_sync(self._open_blocking, sources, stager, cred, True, limiter=CACHED_LANE)
            slow = [s for s in sources if s.opened is None and not s.error]
            self._cached_opens.tried(len(sources) - len(slow), len(sources))
        limiter = trio.CapacityLimiter(8)
        async with trio.open_nursery() as nursery:
            for i in range(0, len(slow), 64):
                nursery.start_soon(_open_in_thread, self, slow[i:i + 64], stager, cred, limiter)

    def _open_blocking(self, sources: list[_Source], stager: Owner, cred: Credentials | None,
                       cached: bool = False) -> None:
        """Open each source with the caller's rights (worker thread); errors go to s.error.
        `cached`: only those the kernel resolves from its caches (the others stay unopened)."""
        keep_owner = cred is not None and cred.is_root
        roots = SourceRoots()
        with acting_as(cred):
            try:
                for s in sources:
                    try:
                        try:
                            s.opened = o = roots.open(s.src, s.root, s.follow, cached)
                        except NotCached:
                            continue
                        s.owner = _staged_owner(stat.S_IFREG, Owner(o.mode, o.uid, o.gid), stager, keep_owner)
                        s.size, s.mtime_ns = o.size, o.mtime_ns
                        s.dirs = [_staged_owner(stat.S_IFDIR, Owner(*d), stager, keep_owner)
                                  for d in roots.tree_dirs(s.src, s.root, s.follow, s.path)]  # a tree: keep its dirs
                    except SourceRefused as exc:
                        s.error = str(exc)
            finally:
                roots.close()

    async def _stage_opened(self, sources: list[_Source], owner: Owner) -> list[StageResult]:
        results: list[StageResult] = []
        # Already staged and unchanged (same size and source mtime) and still intact: skip.
        staged = await trio.to_thread.run_sync(self._existing, sources)
        same = [(s, item) for s, item in zip(sources, staged)
                if item is not None and item.size == s.size and item.src_mtime_ns == s.mtime_ns]
        intact = await trio.to_thread.run_sync(self._verify_all, [(item, item.checksum) for _, item in same]) \
            if same else []
        skip = {id(s) for (s, item), ok in zip(same, intact) if ok}
        todo = []
        for source in sources:
            if id(source) in skip:
                results.append(StageResult(source.path, "skip", size=source.size))
                self.stats_counters["skipped"] += 1
            else:
                todo.append(source)
        # Encode (or check) what the stager sent. Read and compress the other small files:
        # what the page cache holds in one thread, the rest read ahead all at once and
        # taken in another (distorefs/sources.py); big ones stream inside the commit.
        sent = [s for s in todo if s.sent]
        if sent:
            await trio.to_thread.run_sync(self._encode_sent, sent)
        small = [s for s in todo if not s.sent and s.size <= PREPARE_MAX]  # fstat's size, not the request's
        slow = small
        if small and self._cached_reads.worth_trying():  # (none when the stager sent them all: no thread hop)
            slow = await trio.to_thread.run_sync(self._read_cached_blocking, small, limiter=CACHED_LANE)
            self._cached_reads.tried(len(small) - len(slow), len(small))
        if slow:
            await trio.to_thread.run_sync(self._read_sources_blocking, slow)
        changes = []
        batch = _BatchRecords()
        for s in todo:
            if s.error:
                results.append(StageResult(s.path, "error", s.error))
                continue
            changes.append(PutItem(self, ROOT_DIR, s.parts, owner, source=s, batch=batch))
        errors = await self.committer.submit_all(changes)
        verified = await trio.to_thread.run_sync(  # each change has its source (made above)
            self._verify_all, [(c.item, cast(_Source, c.source).crc) for c, e in zip(changes, errors) if e is None])
        ok_iter = iter(verified)
        for change, error in zip(changes, errors):
            assert change.source is not None
            s = change.source
            if error is not None:
                results.append(StageResult(s.path, "error", str(error)))
                self.stats_counters["stage_errors"] += 1
                continue
            if not next(ok_iter):
                self.stats_counters["verify_failures"] += 1
                results.append(StageResult(s.path, "error", "verification after writing failed"))
                continue
            self.stats_counters["staged"] += 1
            self.stats_counters["staged_bytes"] += s.size
            self.stats_counters["staged_sent"] += int(s.sent)
            results.append(StageResult(s.path, "ok", size=s.size))
        return results

    def _existing(self, sources: list[_Source]) -> list[Item | None]:
        tag = self.tag

        def fn(txn):
            out = []
            for s in sources:
                d, found = ROOT_DIR, None
                for i, part in enumerate(s.parts):
                    found = self._child_txn(txn, d, part)
                    if found is None or (i < len(s.parts) - 1 and found[0] != DIR):
                        found = None
                        break
                    d = found[1]
                out.append(self._item_txn(txn, tag, found[1]) if found and found[0] == FILE else None)
            return out
        return self._read(fn)

    def _read_cached_blocking(self, sources: list[_Source]) -> list[_Source]:
        """Read and encode the sources the page cache holds; the others, returned, are read
        by `_read_sources_blocking`."""
        slow = []
        for s in sources:
            assert s.opened is not None
            try:
                raw = read_cached(s.opened)
            except (NotCached, OSError):
                slow.append(s)
                continue
            self._encode_source(s, raw)
        return slow

    def _read_sources_blocking(self, sources: list[_Source]) -> None:
        """Read and encode sources the page cache did not hold, in order, the kernel asked
        to read up to READ_AHEAD_BYTES of them ahead: the disk gets many reads at once (a
        cold tree of 10 KB files: 40,000 files/s this way, 8,000/s from 8 threads reading
        one file each at a time)."""
        ahead = 0  # sources asked for so far
        ahead_end = 0  # bytes asked for, counted from the first source
        done = 0
        for i, s in enumerate(sources):
            while ahead < len(sources) and (ahead == i or ahead_end - done < READ_AHEAD_BYTES):
                opened = sources[ahead].opened
                assert opened is not None
                read_ahead(opened)
                ahead_end += opened.size
                ahead += 1
            done += s.size
            assert s.opened is not None
            try:
                raw = b"".join(read_bounded(s.opened, s.src))
            except SourceRefused as exc:
                s.error = str(exc)
                continue
            except OSError as exc:
                s.error = f"cannot read {s.src}: {exc.strerror or exc}"
                continue
            self._encode_source(s, raw)

    def _encode_sent(self, sources: list[_Source]) -> None:
        """Encode the sources the stager sent (worker thread), each checked against the
        CRC it was sent with: what the stager read is what is stored. One it encoded
        already, as the dataset stores it, is only checked (decoded, its CRC computed here:
        a zstd frame's own checksum is the stager's word) and stored as sent."""
        step = self.config.chunk_bytes
        for s in sources:
            assert s.data is not None
            sent, s.data = s.data, b""
            sent_crc = s.crc
            if s.codec is None:
                self._encode_source(s, sent)
                intact = s.crc == sent_crc
            else:
                try:
                    raw = codec.decode(sent, s.codec, s.size, sent_crc, s.src)
                    intact = s.codec == codec.RAW or codec.checksum(raw) == sent_crc  # (decode checked a raw one)
                except CorruptValue:
                    intact = False
                if intact and s.size > step:  # more than one chunk: stored as the daemon splits a file
                    self._encode_source(s, raw)
                elif intact:
                    s.encoded = [codec.Encoded(bytes(sent), s.codec, s.size, sent_crc)] if s.size else []
            if not intact:
                s.error = f"{s.src}: the bytes received do not match the checksum they were sent with"

    def _encode_source(self, s: _Source, raw: bytes | memoryview) -> None:
        s.size = len(raw)
        s.crc = codec.checksum(raw)
        step = self.config.chunk_bytes
        s.encoded = [codec.encode(memoryview(raw)[i:i + step], self.config.compression,
                                  self.config.compression_level) for i in range(0, max(len(raw), 1), step)]
        if not raw:
            s.encoded = []

    def _verify_all(self, pairs: list) -> list[bool]:
        """Whether each staged item reads back whole with the CRC its source had: the
        values of up to VERIFY_RUN_BYTES at a time, fetched together (one read transaction
        for those in LMDB)."""
        out: list[bool] = []
        run: list = []
        run_bytes = 0
        for pair in pairs:
            size = sum(c.stored_size for c in pair[0].chunks) if pair[0] is not None else 0
            if run and run_bytes + size > VERIFY_RUN_BYTES:
                out.extend(self._verify_run(run))
                run, run_bytes = [], 0
            run.append(pair)
            run_bytes += size
        out.extend(self._verify_run(run))
        return out

    def _verify_run(self, pairs: list) -> list[bool]:
        wanted = [(chunk, f"datasets/{self.name} item {item.id}")
                  for item, _ in pairs if item is not None for chunk in item.chunks]
        results = iter(self.values.read_all(wanted)) if wanted else iter(())
        out = []
        for item, crc in pairs:
            if item is None:
                out.append(False)
                continue
            total, failed = 0, None
            for chunk in item.chunks:
                data = next(results)
                if isinstance(data, DistorefsError):
                    failed = failed or data
                else:
                    total = crc32(data, total)
            if failed is not None:
                log.warning("datasets/%s: verifying item %d: %s", self.name, item.id, failed)
                out.append(False)
            else:
                out.append(total == crc == item.checksum)
        return out

    # ----- reporting ------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.counters
        return {"name": self.name, "sealed": self.sealed, "items": c.items, "bytes": c.bytes,
                "stored_bytes": c.stored_bytes, "directories": c.next_dir - ROOT_DIR,
                "index_bytes": self.index_size, "order_length": len(self.order),
                **self.stats_counters, "prefetch": self.prefetcher.stats()}


def _parse_request(r) -> _Source:
    if not isinstance(r, dict):
        raise InvalidArgument("a stage request must be a JSON object")
    try:
        path = str(r["path"])
        src = str(r["src"])
        size = int(r.get("size", 0))
        mtime_ns = int(r.get("mtime_ns", 0))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad stage request {str(r)[:200]}: {exc}") from None
    parts = [check_name(p) for p in os.fsencode(path).split(b"/") if p]
    if not parts:
        raise InvalidArgument(f"empty path in stage request for {src}")
    meta = r.get("meta")
    root = r.get("root")
    if root is not None and not (isinstance(root, str) and root.startswith("/")):
        raise InvalidArgument(f"stage request for {src}: root must be an absolute path, got {root!r}")
    if not src.startswith("/"):
        raise InvalidArgument(f"stage request: src must be an absolute path, got {src!r}")
    s = _Source(path, parts, src, size, mtime_ns, json.dumps(meta).encode() if meta else b"",
                root=root, follow=bool(r.get("follow", False)))
    if "data" in r:
        _parse_sent(s, r)
    return s


def _parse_sent(s: _Source, r: dict) -> None:
    """The fields of a source the stager read and sent (see Dataset.stage)."""
    data = r["data"]
    if not isinstance(data, (bytes, memoryview)) or len(data) > INLINE_MAX:
        raise InvalidArgument(f"stage request for {s.src}: the bytes sent must be at most {INLINE_MAX}")
    try:
        mode, uid, gid, crc = int(r["mode"]), int(r["uid"]), int(r["gid"]), int(r["crc"])
        dirs = [Owner(int(m), int(u), int(g)) for m, u, g in r["dirs"]] if r.get("dirs") else []
        s.codec = None if r.get("codec") is None else int(r["codec"])
        size = len(data) if s.codec in (None, codec.RAW) else int(r["size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad stage request for {s.src}: {exc}") from None
    if not stat.S_ISREG(mode) or any(not stat.S_ISDIR(d.mode) for d in dirs) or len(dirs) > len(s.parts) - 1:
        raise InvalidArgument(f"stage request for {s.src}: mode or directories that are not a file's")
    if s.codec is not None and (s.codec not in codec.CODEC_NAMES or not 0 <= size <= INLINE_MAX):
        raise InvalidArgument(f"stage request for {s.src}: codec {s.codec} for {size} bytes")
    s.data, s.size, s.crc, s.sent = data, size, crc & 0xFFFFFFFF, True
    s.owner = Owner(mode, uid, gid)
    s.dirs = dirs


def _staged_owner(kind: int, source: Owner, stager: Owner, keep_owner: bool) -> Owner:
    """A staged file's or directory's mode and owner (`kind`: stat.S_IFREG or S_IFDIR): the
    source's permission bits; the source's owner when root stages (`keep_owner`), else the
    stager's."""
    uid, gid = (source.uid, source.gid) if keep_owner else (stager.uid, stager.gid)
    return Owner(kind | (source.mode & 0o777), uid, gid)


def _parse_requests(requests: list) -> tuple[list[_Source], list[StageResult]]:
    sources: list[_Source] = []
    errors: list[StageResult] = []
    for r in requests:
        try:
            sources.append(_parse_request(r))
        except InvalidArgument as exc:
            errors.append(StageResult(str(r.get("path", "?")) if isinstance(r, dict) else "?", "error", str(exc)))
    return sources, errors


def _close_all(sources: list[_Source]) -> None:
    for s in sources:
        if s.opened is not None:
            s.opened.close()


async def _open_in_thread(ds: Dataset, sources: list[_Source], stager: Owner, cred: Credentials | None,
                       limiter: trio.CapacityLimiter) -> None:
    await trio.to_thread.run_sync(ds._open_blocking, sources, stager, cred, limiter=limiter)


# ----- changes ------------------------------------------------------------------------------


class _DsChange(Change):
    """A change to one dataset's tree. It reads what it needs inside the transaction, so
    changes of one group see each other in order (no conflict key needed)."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds
        self.db = DB_DSNODES
        self.after: Counters | None = None

    def plan(self, overlay: Overlay) -> None:
        self.ds._writable()

    def counters(self, txn) -> Counters:
        data = txn.get(self.ds._key(b"c"), db=self.db)
        c = Counters.unpack(data) if data is not None else Counters()
        if c.sealed and not isinstance(self, Seal):
            raise ReadOnly(f"datasets/{self.ds.name} is sealed (read-only)")
        return c

    def save(self, txn, c: Counters) -> None:
        txn.put(self.ds._key(b"c"), c.pack(), db=self.db)
        self.after = c

    def dir_txn(self, txn, dir_id: int) -> DirRec:
        rec = self.ds._dir_txn(txn, dir_id)
        if rec is None:
            raise NotFound(f"datasets/{self.ds.name}: directory {dir_id} is gone")
        return rec

    def add_child(self, txn, parent: DirRec, name: bytes, kind: int, child_id: int) -> None:
        ds = self.ds
        ordinal = parent.next_ordinal
        parent.next_ordinal += 1
        parent.mtime_ns = parent.ctime_ns = time.time_ns()
        txn.put(ds._nkey(parent.id, name), _CHILD.pack(kind, child_id, ordinal), db=self.db)
        txn.put(ds._okey(parent.id, ordinal), _POS.pack(kind, child_id) + name, db=self.db)
        txn.put(ds._dkey(parent.id), parent.pack(), db=self.db)

    def drop_child(self, txn, parent_id: int, name: bytes) -> None:
        ds = self.ds
        data = txn.get(ds._nkey(parent_id, name), db=self.db)
        if data is not None:
            _, _, ordinal = _CHILD.unpack(data)
            txn.delete(ds._nkey(parent_id, name), db=self.db)
            txn.delete(ds._okey(parent_id, ordinal), db=self.db)
            parent = ds._dir_txn(txn, parent_id)
            if parent is not None:
                parent.mtime_ns = parent.ctime_ns = time.time_ns()
                txn.put(ds._dkey(parent_id), parent.pack(), db=self.db)

    def child_or_fail(self, txn, dir_id: int, name: bytes) -> tuple[int, int]:
        found = self.ds._child_txn(txn, dir_id, name)
        if found is None:
            raise NotFound(f"datasets/{self.ds.name}: no {name!r}")
        return found

    def is_empty(self, txn, dir_id: int) -> bool:
        prefix = self.ds._key(b"n", _U64.pack(dir_id))
        cursor = txn.cursor(db=self.db)
        return not (cursor.set_range(prefix) and bytes(cursor.key()[:len(prefix)]) == prefix)

    def apply(self) -> None:
        self.ds.generation += 1  # records read before this change may be stale now
        if self.after is not None:
            self.ds.counters = self.after


class _BatchRecords:
    """The dataset's counters and the directory records a staged batch's changes read,
    kept between them within one transaction. A batch's changes are queued together, so
    in a group they run one after another, and each writes what it changes through to the
    transaction: the next one takes them from here instead of reading and unpacking them
    again. Another transaction (the next group, or a rerun after the map grew) starts
    afresh."""

    def __init__(self) -> None:
        self._txn: object = None
        self.counters: Counters | None = None
        self.dirs: dict[int, DirRec] = {}
        self.children: dict[tuple[int, bytes], tuple[int, int]] = {}  # directories only

    def within(self, txn) -> "_BatchRecords":
        if self._txn is not txn:
            self._txn, self.counters, self.dirs, self.children = txn, None, {}, {}
        return self


class PutItem(_DsChange):
    """Create or replace one file (a write through the mount, or one staged source file)."""

    def __init__(self, ds: Dataset, dir_id: int, parts: list[bytes], owner: Owner, *, data: bytes | None = None,
                 source: _Source | None = None, times: tuple[int | None, int | None] = (None, None),
                 draft: Draft | None = None, new_id: int | None = None, batch: _BatchRecords | None = None) -> None:
        super().__init__(ds)
        self.dir_id, self.parts, self.owner, self.times = dir_id, parts, owner, times
        self.batch = batch
        self.new_id = new_id
        self.data, self.source, self.draft = data, source, draft
        self.layout = draft.plan() if draft is not None else None
        self.encoded: list[codec.Encoded] | None = source.encoded if source else None
        self.item: Item | None = None

    def prepare_bytes(self) -> int:
        # a staged source came encoded
        return len(self.data) if self.encoded is None and self.data is not None else 0

    def prepare(self) -> None:
        if self.encoded is None and self.data is not None:
            step, cfg = self.ds.config.chunk_bytes, self.ds.config
            view = memoryview(self.data)
            self.encoded = [codec.encode(view[i:i + step], cfg.compression, cfg.compression_level)
                            for i in range(0, len(view), step)]

    def txn(self, txn) -> None:
        ds = self.ds
        kept = self.batch.within(txn) if self.batch is not None else _BatchRecords()
        if kept.counters is None:
            kept.counters = self.counters(txn)
        c = kept.counters
        self.prepare()
        parent = self._dir(txn, kept, self.dir_id)
        dirs = self.source.dirs if self.source else []
        owner = self.source.owner if self.source and self.source.owner else self.owner
        for i, part in enumerate(self.parts[:-1]):  # missing directories on the way are made
            found = kept.children.get((parent.id, part)) or ds._child_txn(txn, parent.id, part)
            if found is None:
                d = dirs[i] if i < len(dirs) else Owner(0o40755, owner.uid, owner.gid)
                rec = DirRec(c.next_dir, parent.id, d.mode, d.uid, d.gid, time.time_ns(), 0, part)
                c.next_dir += 1
                self.add_child(txn, parent, part, DIR, rec.id)
                txn.put(ds._dkey(rec.id), rec.pack(), db=self.db)
                kept.dirs[rec.id], kept.children[(parent.id, part)] = rec, (DIR, rec.id)
                parent = rec
            elif found[0] != DIR:
                raise AlreadyExists(f"{os.fsdecode(part)} is a file, not a directory")
            else:
                kept.children[(parent.id, part)] = found
                parent = self._dir(txn, kept, found[1])
        name = self.parts[-1]
        found = ds._child_txn(txn, parent.id, name)
        old = None
        if found is not None:
            if found[0] == DIR:
                raise AlreadyExists(f"{os.fsdecode(name)} is a directory")
            if found[0] == LINK:
                raise AlreadyExists(f"{os.fsdecode(name)} is a symlink")
            old = ds._item_txn(txn, STAGING, found[1])
        layout = self._current_layout(old)
        kept_values = {(c.tier, c.loc) for c in layout or [] if isinstance(c, StoredValue)}
        if old is not None:
            item_id = old.id
            ds.values.delete_all(txn, [c for c in old.chunks if (c.tier, c.loc) not in kept_values])
            c.items -= 1
            c.bytes -= old.size
            c.stored_bytes -= old.stored_size
        else:
            item_id = ds._new_file_id(c, self.new_id)
            self.add_child(txn, parent, name, FILE, item_id)
        base = b"D" + ds._prefix + _U64.pack(item_id)
        if self.draft is not None:
            assert layout is not None  # the draft's plan
            chunks, size, crc = self._from_draft(txn, base, layout)
        elif self.encoded is not None:
            chunks = [ds.values.put(txn, base + _DS.pack(i), enc) for i, enc in enumerate(self.encoded)]
            size = sum(e.size for e in self.encoded)
            crc = self.source.crc if self.source else codec.checksum(self.data or b"")
        else:
            chunks, size, crc = self._stream(txn, base)
        now = time.time_ns()
        src_mtime = self.source.mtime_ns if self.source else 0
        mode = (owner.mode & 0o7777) | 0o100000
        atime, mtime = self.times
        self.item = Item(item_id, size, crc, mode, owner.uid, owner.gid, now if mtime is None else mtime, src_mtime,
                         parent.id, chunks, name, self.source.meta if self.source else b"", STAGING,
                         now if atime is None else atime, now)
        txn.put(ds._ikey(STAGING, item_id), self.item.pack(), db=self.db)
        c.items += 1
        c.bytes += size
        c.stored_bytes += self.item.stored_size
        self.save(txn, c)

    def _dir(self, txn, kept: _BatchRecords, dir_id: int) -> DirRec:
        rec = kept.dirs.get(dir_id)
        if rec is None:
            rec = kept.dirs[dir_id] = self.dir_txn(txn, dir_id)
        return rec

    def _current_layout(self, old: Item | None) -> list[StoredValue | int | None] | None:
        """The draft's plan with each chunk it keeps as the file has it now (`old`, read in
        this transaction). Another writer may have committed since the draft was made: a
        chunk it rewrote is stored where the one the draft knew was (the draft's record of it
        would name other bytes), and a tier move may have moved it. A kept chunk is the
        current one then, as on a local filesystem, where what a writer did not write is
        what the file holds; one the file no longer has (it was cut short) is a hole."""
        if self.layout is None:
            return None
        now = old.chunks if old is not None else []
        out: list[StoredValue | int | None] = []
        for i, part in enumerate(self.layout):
            if isinstance(part, StoredValue) and not (i < len(now) and now[i] == part):
                current = now[i] if i < len(now) else None
                part = current if current is not None and current.size == part.size else None
            out.append(part)
        return out

    def _from_draft(self, txn, base: bytes, layout: list) -> tuple[list[StoredValue], int, int]:
        """The draft's chunks (`layout`: its plan against the file as it is now): those written
        stored (one at a time from its spool), the others kept; the CRC of the whole from each
        chunk's own."""
        draft, cfg = self.draft, self.ds.config
        assert draft is not None
        chunks: list[StoredValue] = []
        crc = 0
        for i, part in enumerate(layout):
            if isinstance(part, StoredValue):
                chunk = part
            else:  # written (an int), or a hole: stored (compressed, a hole costs next to nothing)
                raw = draft.chunk(i, holes=False) if part is not None else bytes(
                    max(0, min(draft.chunk_bytes, draft.size - i * draft.chunk_bytes)))
                chunk = self.ds.values.put_raw(txn, base + _DS.pack(i), raw, cfg.compression, cfg.compression_level)
            crc = crc32_combine(crc, chunk.checksum, chunk.size)
            chunks.append(chunk)
        return chunks, draft.size, crc

    def _stream(self, txn, base: bytes) -> tuple[list[StoredValue], int, int]:
        """A big source file, read and stored one chunk at a time (memory stays bounded)."""
        s = self.source
        assert s is not None
        cfg = self.ds.config
        chunks: list[StoredValue] = []
        size, crc = 0, 0
        assert s.opened is not None  # opened with the caller's rights; read up to its size at open
        try:
            for raw in read_bounded(s.opened, s.src, cfg.chunk_bytes):
                crc = crc32(raw, crc)
                chunks.append(self.ds.values.put_raw(txn, base + _DS.pack(len(chunks)), raw,
                                                     cfg.compression, cfg.compression_level))
                size += len(raw)
        except OSError as exc:
            raise InvalidArgument(f"cannot read {s.src}: {exc.strerror or exc}") from None
        s.crc = crc & 0xFFFFFFFF
        s.size = size
        return chunks, size, s.crc


class MakeDir(_DsChange):
    def __init__(self, ds: Dataset, dir_id: int, name: bytes, owner: Owner) -> None:
        super().__init__(ds)
        self.dir_id, self.name, self.owner = dir_id, name, owner

    def txn(self, txn) -> None:
        c = self.counters(txn)
        parent = self.dir_txn(txn, self.dir_id)
        if self.ds._child_txn(txn, parent.id, self.name) is not None:
            raise AlreadyExists(f"{os.fsdecode(self.name)} exists")
        o = self.owner
        self.rec = DirRec(c.next_dir, parent.id, 0o40000 | (o.mode & 0o7777), o.uid, o.gid, time.time_ns(), 0,
                          self.name)
        c.next_dir += 1
        self.add_child(txn, parent, self.name, DIR, self.rec.id)
        txn.put(self.ds._dkey(self.rec.id), self.rec.pack(), db=self.db)
        self.save(txn, c)


class MakeLink(_DsChange):
    def __init__(self, ds: Dataset, dir_id: int, name: bytes, target: bytes, owner: Owner) -> None:
        super().__init__(ds)
        self.dir_id, self.name, self.target, self.owner = dir_id, name, target, owner

    def txn(self, txn) -> None:
        c = self.counters(txn)
        parent = self.dir_txn(txn, self.dir_id)
        if self.ds._child_txn(txn, parent.id, self.name) is not None:
            raise AlreadyExists(f"{os.fsdecode(self.name)} exists")
        now = time.time_ns()
        o = self.owner
        self.rec = Item(self.ds._new_file_id(c), len(self.target), 0, 0o120777, o.uid, o.gid, now, 0, parent.id, [],
                        self.name, self.target, LINKS, now, now)
        self.add_child(txn, parent, self.name, LINK, self.rec.id)
        txn.put(self.ds._ikey(LINKS, self.rec.id), self.rec.pack(), db=self.db)
        self.save(txn, c)


class RemoveNode(_DsChange):
    def __init__(self, ds: Dataset, dir_id: int, name: bytes, want_dir: bool) -> None:
        super().__init__(ds)
        self.dir_id, self.name, self.want_dir = dir_id, name, want_dir

    def txn(self, txn) -> None:
        c = self.counters(txn)
        kind, node_id = self.child_or_fail(txn, self.dir_id, self.name)
        if self.want_dir and kind != DIR:
            raise NotADirectory(f"{os.fsdecode(self.name)} is not a directory")
        if not self.want_dir and kind == DIR:
            raise IsADirectory(f"{os.fsdecode(self.name)} is a directory")
        remove_node_txn(self, txn, c, kind, node_id)
        self.drop_child(txn, self.dir_id, self.name)
        self.save(txn, c)


def remove_node_txn(change: _DsChange, txn, c: Counters, kind: int, node_id: int) -> None:
    ds = change.ds
    if kind == DIR:
        if not change.is_empty(txn, node_id):
            raise NotEmpty("directory not empty")
        txn.delete(ds._dkey(node_id), db=change.db)
        return
    if kind == LINK:
        txn.delete(ds._ikey(LINKS, node_id), db=change.db)
        return
    item = ds._item_txn(txn, STAGING, node_id)
    if item is not None:
        ds.values.delete_all(txn, item.chunks)
        txn.delete(ds._ikey(STAGING, node_id), db=change.db)
        c.items -= 1
        c.bytes -= item.size
        c.stored_bytes -= item.stored_size


class RenameNode(_DsChange):
    def __init__(self, ds: Dataset, old_dir: int, old: bytes, new_dir: int, new: bytes) -> None:
        super().__init__(ds)
        self.old_dir, self.old, self.new_dir, self.new = old_dir, old, new_dir, new

    def txn(self, txn) -> None:
        ds = self.ds
        c = self.counters(txn)
        kind, node_id = self.child_or_fail(txn, self.old_dir, self.old)
        if kind == DIR:  # never into its own subtree
            d = self.new_dir
            while d != ROOT_DIR:
                if d == node_id:
                    raise InvalidArgument("cannot move a directory into itself")
                d = self.dir_txn(txn, d).parent
        target = ds._child_txn(txn, self.new_dir, self.new)
        if target is not None:
            if target == (kind, node_id):
                return
            if (target[0] == DIR) != (kind == DIR):
                raise (IsADirectory if target[0] == DIR else NotADirectory)(
                    f"cannot replace {os.fsdecode(self.new)} with a {'directory' if kind == DIR else 'file'}")
            if target[0] == DIR and not self.is_empty(txn, target[1]):
                raise NotEmpty(f"{os.fsdecode(self.new)} is not empty")
            remove_node_txn(self, txn, c, target[0], target[1])
            self.drop_child(txn, self.new_dir, self.new)
        self.drop_child(txn, self.old_dir, self.old)
        self.add_child(txn, self.dir_txn(txn, self.new_dir), self.new, kind, node_id)
        if kind == DIR:
            rec = self.dir_txn(txn, node_id)
            rec.parent, rec.name = self.new_dir, self.new
            txn.put(ds._dkey(node_id), rec.pack(), db=self.db)
        else:
            tag = LINKS if kind == LINK else STAGING
            item = ds._item_txn(txn, tag, node_id)
            if item is not None:
                item.parent, item.name = self.new_dir, self.new
                item.ctime_ns = time.time_ns()
                txn.put(ds._ikey(tag, node_id), item.pack(), db=self.db)
        self.save(txn, c)


class SetNodeAttrs(_DsChange):
    def __init__(self, ds: Dataset, kind: int, node_id: int, change: AttrChange) -> None:
        super().__init__(ds)
        self.kind, self.node_id, self.change = kind, node_id, change

    def txn(self, txn) -> None:
        ds = self.ds
        self.counters(txn)
        tag = LINKS if self.kind == LINK else STAGING
        rec = self.dir_txn(txn, self.node_id) if self.kind == DIR else ds._item_txn(txn, tag, self.node_id)
        if rec is None:
            raise NotFound(f"datasets/{ds.name}: gone")
        apply_setattr(rec, self.change)
        key = ds._dkey(self.node_id) if self.kind == DIR else ds._ikey(tag, self.node_id)
        txn.put(key, rec.pack(), db=self.db)


class Seal(_DsChange):
    """Number files in path order, write index.npy, mark the dataset read-only: one
    transaction, so a crash leaves the dataset either unsealed or sealed whole."""

    def plan(self, overlay: Overlay) -> None:
        pass

    def txn(self, txn) -> None:
        ds = self.ds
        c = self.counters(txn)
        if c.sealed:
            return
        # Pass 1: sizes of the index (longest path, metadata fields), and who may read it:
        # it names every item, so group or others may read it only if every directory
        # lets them list it (read and search).
        longest = 1
        metas: dict[str, list] = {}
        root = ds._dir_txn(txn, ROOT_DIR)
        assert root is not None  # the root's record, or one made up if it has none
        self.index_mode = _listable_by(root.mode, 0o444)
        for event in self._walk(txn):
            if event[0] == DIR:
                rec = ds._dir_txn(txn, event[3])
                if rec is not None:
                    self.index_mode = _listable_by(rec.mode, self.index_mode)
            elif event[0] == FILE:
                _, _, _, item_id, path = event
                longest = max(longest, len(path))
                raw = txn.get(ds._ikey(STAGING, item_id), db=self.db)
                meta = Item.indexed(raw)[2] if raw is not None else b""
                if meta:
                    for key, value in json.loads(meta).items():
                        metas.setdefault(key, []).append(value)
        fields = _meta_fields(metas)
        dtype = np.dtype([("item", "<i8"), ("path", f"S{longest}"), ("size", "<i8"), ("checksum", "<u4")]
                         + [(name, dt) for name, dt, _, _ in fields])
        # Pass 2: renumber, rebuild readdir order (sorted), write index rows to a spool file.
        cursor = txn.cursor(db=self.db)
        prefix = ds._key(b"o")
        while cursor.set_range(prefix) and bytes(cursor.key()[:len(prefix)]) == prefix:
            cursor.delete()
        fd, spool = tempfile.mkstemp(dir=ds.spool_dir, prefix="index-")
        try:
            with os.fdopen(fd, "wb") as out:
                np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                           "fortran_order": False, "shape": (c.items,)})
                rows: list[tuple] = []  # made into the array ROWS_AT_ONCE at a time (one conversion, not a field each)
                n = 0
                ordinals: dict[int, int] = {}
                for kind, parent, name, node_id, path in self._walk(txn):
                    ordinal = ordinals.get(parent, 0)
                    ordinals[parent] = ordinal + 1
                    if kind == FILE:
                        staged = ds._ikey(STAGING, node_id)
                        raw = txn.get(staged, db=self.db)
                        if raw is None:
                            continue
                        # the record does not hold its own id or tag: it moves as it is
                        raw = bytes(raw)
                        size, checksum, packed_meta = Item.indexed(raw)
                        txn.delete(staged, db=self.db)
                        txn.put(ds._ikey(SEALED, n), raw, db=self.db)
                        node_id = n
                        row: tuple = (n, path, size, checksum)
                        if fields:
                            meta = json.loads(packed_meta) if packed_meta else {}
                            row += tuple(_index_value(meta.get(key, missing), dt) for _, dt, missing, key in fields)
                        rows.append(row)
                        n += 1
                        if len(rows) == ROWS_AT_ONCE:
                            out.write(np.array(rows, dtype=dtype).tobytes())
                            rows = []
                    txn.put(ds._nkey(parent, name), _CHILD.pack(kind, node_id, ordinal), db=self.db)
                    txn.put(ds._okey(parent, ordinal), _POS.pack(kind, node_id) + name, db=self.db)
                out.write(np.array(rows, dtype=dtype).tobytes())
            for d, count in ordinals.items():
                rec = self.dir_txn(txn, d)
                rec.next_ordinal = count
                txn.put(ds._dkey(d), rec.pack(), db=self.db)
            if n != c.items:
                raise DistorefsError(f"datasets/{ds.name}: {n} files found, {c.items} counted")
            self._store_index(txn, spool, fields)
        finally:
            os.unlink(spool)
        c.sealed = 1
        self.save(txn, c)

    def _store_index(self, txn, spool: str, fields) -> None:
        ds = self.ds
        step = ds.config.chunk_bytes
        chunks: list[StoredValue] = []
        with open(spool, "rb") as f:
            while True:
                raw = f.read(step)
                if not raw:
                    break
                vkey = b"X" + ds._prefix + _U64.pack(len(chunks))
                chunks.append(ds.values.put_raw(txn, vkey, raw, "zstd", 3))
        self.index_chunks = chunks
        self.index_size = os.path.getsize(spool)
        self.fields = [[name, dt] for name, dt, _, _ in fields]
        self.sealed_ns = time.time_ns()
        key = f"datasets/{ds.name}".encode()
        record = json.loads(bytes(txn.get(key, db=DB_NS)))
        record.update({"sealed_ns": self.sealed_ns, "index_size": self.index_size, "fields": self.fields,
                       "index_mode": self.index_mode,
                       "index": [c.to_json() for c in chunks]})
        txn.put(key, json.dumps(record).encode(), db=DB_NS)

    def _walk(self, txn) -> Iterator[tuple[int, int, bytes, int, bytes]]:
        """(kind, parent, name, id, path) of every node, depth first, names in byte order."""
        stack: list[Iterator] = [self._listing(txn, ROOT_DIR, b"")]
        while stack:
            event = next(stack[-1], None)
            if event is None:
                stack.pop()
                continue
            yield event
            if event[0] == DIR:
                stack.append(self._listing(txn, event[3], event[4] + b"/"))

    def _listing(self, txn, dir_id: int, prefix_path: bytes) -> Iterator[tuple[int, int, bytes, int, bytes]]:
        prefix = self.ds._key(b"n", _U64.pack(dir_id))
        entries = []
        cursor = txn.cursor(db=self.db)
        if cursor.set_range(prefix):
            for key, value in cursor:
                if bytes(key[:len(prefix)]) != prefix:
                    break
                kind, node_id, _ = _CHILD.unpack(value)
                name = bytes(key[len(prefix):])
                entries.append((kind, dir_id, name, node_id, prefix_path + name))
        return iter(entries)

    def apply(self) -> None:
        ds = self.ds
        super().apply()
        if hasattr(self, "index_chunks"):
            ds.index_chunks, ds.index_size = self.index_chunks, self.index_size
            ds.fields, ds.sealed_ns, ds.index_mode = self.fields, self.sealed_ns, self.index_mode


def _step_of(item: Item, default: int) -> int:
    """The chunk size of an item (every chunk but the last is this big)."""
    return item.chunks[0].size if len(item.chunks) > 1 else default


def _listable_by(dir_mode: int, mode: int) -> int:
    """`mode` (read bits) less the group and other bits of the classes that may not list
    a directory of `dir_mode` (they need both read and search)."""
    for shift in (3, 0):  # group, others
        if (dir_mode >> shift) & 0o5 != 0o5:
            mode &= ~(0o4 << shift)
    return mode


def _index_value(value, dt: str):
    """A metadata value as its index field holds it (text fields hold bytes)."""
    return str(value).encode() if dt.startswith("S") and value != b"" else value


def _meta_fields(metas: dict[str, list]) -> list[tuple[str, str, object, str]]:
    """numpy field (name, dtype, value when missing, metadata key) for each per-item metadata key."""
    fields: list[tuple[str, str, object, str]] = []
    for name, values in sorted(metas.items()):
        if name in ("item", "path", "size", "checksum"):
            name_out = f"meta_{name}"
        else:
            name_out = name
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            fields.append((name_out, "<i8", 0, name))
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            fields.append((name_out, "<f8", float("nan"), name))
        else:
            width = max(1, max(len(str(v).encode()) for v in values))
            fields.append((name_out, f"S{width}", b"", name))
    return fields


__all__ = ["Dataset", "Item", "DirRec", "StageResult", "DIR", "FILE", "LINK", "ROOT_DIR", "DB_DSNODES"]

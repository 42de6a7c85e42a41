"""The value layer: every stored value of the store, whichever namespace it belongs to.

It owns the tiers (LMDB values, NVMe segment directories), placement (which tier a new
value goes to; the policy is distorefs/placement.py), the codec (zstd and CRC-32 checks)
and the memory tier (decoded values, LRU within a byte budget). A stored value has one
record, `StoredValue`, whether it is a ring entry's, a chunk of a weights version, of a
dataset item, of a dataset index or of a checkpoint file.

Namespaces are built with the value layer and never reach a tier themselves:
- they put and delete values inside a commit's transaction (`put`, `delete`: the tiers'
  accounting commits or aborts with the records that point at the value);
- they read values through `fetch` (memory tier first; what is missing is read, decoded
  and verified in worker threads, many requests to one thread hand-off: see `_Reads`;
  one or two small values whose pages are in memory already, on the loop), or `read`
  when already in a worker thread.

A read that fails is either a race (the value was replaced or removed after its record
was taken: NotFound, or CorruptValue of a location since reused) or damage: the caller,
who knows what is current, decides, and reports damage with `report_corrupt` (logged,
counted, EIO).
"""

from __future__ import annotations

import builtins
import logging
import os
import resource
import struct
import time
from dataclasses import dataclass
from typing import Any, Hashable, Sequence, TypeAlias

import trio

from . import codec
from .backends.base import Txn, ValueBackend
from .backends.errors import BackendError
from .backends.lmdbenv import LmdbEnv
from .backends.lmdbvalues import LmdbValues
from .backends.segments import SegmentDir, SegmentValues
from .cache import ValueCache
from .config import StoreConfig
from .errors import CorruptValue, DistorefsError, InvalidArgument, NotFound, from_backend
from .lane import Lane
from .placement import TIER_CLUSTER, TIER_LMDB, TIER_NAMES, TIER_NVME, choose_tier

log = logging.getLogger(__name__)

_VALUE = struct.Struct("<QQIBBH")


@dataclass(frozen=True, slots=True)
class StoredValue:
    """Where a value is and how to read it back: its decoded size and CRC-32, the codec,
    the stored size, the tier and the tier's location."""

    size: int
    stored_size: int
    checksum: int
    codec: int
    tier: int
    loc: bytes

    def pack(self) -> bytes:
        return _VALUE.pack(self.size, self.stored_size, self.checksum, self.codec, self.tier,
                           len(self.loc)) + self.loc

    @classmethod
    def unpack_from(cls, data, off: int = 0) -> tuple["StoredValue", int]:
        """(the value packed at `off`, the offset after it)."""
        size, stored, crc, cdc, tier, loc_len = _VALUE.unpack_from(data, off)
        off += _VALUE.size
        return cls(size, stored, crc, cdc, tier, bytes(data[off:off + loc_len])), off + loc_len

    @staticmethod
    def skip(data, off: int = 0) -> int:
        """The offset after the value packed at `off` (read past, nothing built)."""
        return off + _VALUE.size + _VALUE.unpack_from(data, off)[5]

    @property
    def tier_name(self) -> str:
        return TIER_NAMES[self.tier]

    @property
    def codec_name(self) -> str:
        return codec.CODEC_NAMES.get(self.codec, "?")

    def to_json(self) -> dict:
        return {"size": self.size, "stored_size": self.stored_size, "checksum": self.checksum, "codec": self.codec,
                "tier": self.tier, "loc": self.loc.hex()}

    @classmethod
    def from_json(cls, d: dict) -> "StoredValue":
        return cls(d["size"], d["stored_size"], d["checksum"], d["codec"], d["tier"], bytes.fromhex(d["loc"]))


@dataclass(frozen=True, slots=True)
class Spooled:
    """A value a client beside the mount stored itself, in its spool (a segment of its own,
    distorefs/backends/segments.py): where the record is, and what the client says of it."""

    seg: int
    offset: int  # of the record's header
    vkey_len: int
    size: int  # decoded
    stored_size: int
    checksum: int  # CRC-32 of the decoded value
    codec: int


Fetched: TypeAlias = "bytes | DistorefsError"


@dataclass
class WarmResult:
    """What a warm request did for one file's values (bytes are decoded sizes)."""

    values: int = 0
    bytes: int = 0
    already: int = 0  # in the memory tier before the request
    loaded: int = 0  # read and put there by it
    refused: int = 0  # not taken: too big for the tier, or the tier's budget is used up

    def text(self) -> builtins.bytes:  # (`bytes` here is the field)
        """Short (one getxattr reply, under 128 bytes: Python's first buffer)."""
        return (b"values=%d bytes=%d already=%d loaded=%d refused=%d"
                % (self.values, self.bytes, self.already, self.loaded, self.refused))


WARM_GROUP_BYTES = 64 << 20  # values read per hand-off while warming: bounds what is held at once
# A fetch that misses at most this many values, each at most INLINE_READ_BYTES decoded and
# all in memory already (a tier that can tell: `resident_reads`), reads them on the loop: a
# copy and a decode of a few KB cost less of the loop's time than the thread hand-off (a
# dataset item's open: the hand-off was about 40 % of the daemon's CPU for it). The tier's
# lookup may itself touch the value's first page before it can tell (LMDB checks an
# overflow page's header), a disk read on the loop if that page was not in memory (a major
# fault of the loop's thread, counted by the kernel): so a value found not in memory, or a
# lookup that faulted, stops reads on the loop for INLINE_BACKOFF_S, twice as long after each
# such read up to INLINE_BACKOFF_MAX_S, half as long after each read here again (a cold epoch
# costs the loop a few such reads).
INLINE_READ_VALUES = 0 if os.environ.get("DISTOREFS_INLINE_READS") == "0" else 2  # (0: none on the loop)
INLINE_READ_BYTES = 16 << 10
INLINE_BACKOFF_S = 0.5
INLINE_BACKOFF_MAX_S = 8.0


def _major_faults() -> int:
    """Page faults of this thread that waited for the disk, so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt


def _named(exc: BackendError | CorruptValue, what: str) -> BaseException:
    """A tier's or a decoder's failure of a read, as the error that names the value read."""
    if isinstance(exc, CorruptValue):
        return CorruptValue(str(exc) if str(exc).startswith(what) else f"{what}: {exc}")
    mapped = from_backend(exc)
    return type(mapped)(f"{what}: {exc}")


class ValueLayer:
    def __init__(self, env: LmdbEnv, config: StoreConfig, dirs: Sequence[SegmentDir], *,
                 create_dirs: bool = True) -> None:
        """The tiers of the store whose metadata engine is `env`: LMDB values in it, and
        segment files in `dirs`."""
        self.config = config
        self.lmdb = LmdbValues(env)
        self.nvme = SegmentValues(env, list(dirs), config.segment_bytes, create=create_dirs)
        self.tiers: dict[int, ValueBackend] = {TIER_LMDB: self.lmdb, TIER_NVME: self.nvme}
        self.cache = ValueCache(0)  # sized by the store's memory plan
        self.counters = {"corrupt_reads": 0, "disk_reads": 0, "disk_read_bytes": 0, "segment_bytes_freed": 0,
                         "read_batches": 0, "inline_reads": 0, "inline_backoffs": 0}
        self._gen = 0
        self._reads = _Reads(self)
        self._inline_after = 0.0  # (monotonic) no read on the loop before this: one found the disk
        self._inline_backoff = INLINE_BACKOFF_S

    def attach_cluster(self, backend: ValueBackend) -> None:
        """A shared store: values of its shared namespaces live in the cluster's tier."""
        self.tiers[TIER_CLUSTER] = backend

    def put_shared(self, enc: codec.Encoded) -> StoredValue:
        """Store one encoded value in the cluster (worker thread; durable when it returns).
        No transaction: the log record that refers to it is the commit."""
        return self.put_shared_many([enc])[0]

    def put_shared_many(self, encs: Sequence[codec.Encoded]) -> list[StoredValue]:
        """`put_shared` of several values at once (a round trip per master holding some)."""
        try:
            locs = self.tiers[TIER_CLUSTER].put_many([e.stored for e in encs])  # type: ignore[attr-defined]
        except BackendError as exc:
            raise from_backend(exc) from None
        return [StoredValue(e.size, len(e.stored), e.checksum, e.codec, TIER_CLUSTER, loc)
                for e, loc in zip(encs, locs)]

    def copy_to_cluster(self, values: Sequence[StoredValue], group_bytes: int = 32 << 20) -> list[StoredValue]:
        """Copies in the cluster of this node's `values` (stored bytes as they are: no
        decoding), for a tree another node reads once it is shared (worker thread; durable
        when it returns). A value in the cluster already is its own copy. At most
        `group_bytes` are held at once."""
        out: list[StoredValue] = list(values)
        group: list[int] = []
        held = 0

        def flush() -> None:
            nonlocal held
            encs = [codec.Encoded(self.read_stored(out[i]), out[i].codec, out[i].size, out[i].checksum)
                    for i in group]
            for i, copy in zip(group, self.put_shared_many(encs)):
                out[i] = copy
            group.clear()
            held = 0

        for i, value in enumerate(values):
            if value.tier == TIER_CLUSTER:
                continue
            group.append(i)
            held += value.stored_size
            if held >= group_bytes:
                flush()
        if group:
            flush()
        return out

    # ----- writes: inside a commit's transaction -------------------------------------

    def lands_hot(self, size: int, cold: bool = False, txn: Txn | None = None) -> bool:
        """Whether a new value of `size` stored bytes goes to the LMDB (hot) tier (`put`'s
        choice): as of `txn`, or, without one, as of the last commit (an estimate)."""
        live = self.lmdb.live_bytes_in(txn) if txn is not None else self.lmdb.recent_live
        return choose_tier(self.config, live, size, cold) == TIER_LMDB

    def put(self, txn: Txn, vkey: bytes, enc: codec.Encoded, *, stream: int = 0, cold: bool = False,
            direct: bool = False) -> StoredValue:
        """Store one encoded value in the tier placement picks. `stream` groups values that
        age together (a ring's); `cold`: it belongs behind its ring's demotion front;
        `direct`: it is read back rarely (a checkpoint's chunk), so it skips the page cache."""
        stored = enc.stored
        tier = choose_tier(self.config, self.lmdb.live_bytes_in(txn), len(stored), cold)
        loc = self.tiers[tier].put(txn, vkey, stored, stream=stream, direct=direct)
        return StoredValue(enc.size, len(stored), enc.checksum, enc.codec, tier, loc)

    def adopt(self, txn: Txn, spooled: Spooled) -> StoredValue:
        """A value a client stored in its spool, made one of the store's (InvalidArgument
        when the spool holds no such record, or the client's description cannot be right)."""
        if spooled.codec not in codec.CODEC_NAMES or not 0 <= spooled.checksum <= 0xFFFFFFFF \
                or (spooled.codec == codec.RAW and spooled.stored_size != spooled.size):
            raise InvalidArgument(f"a spooled value of codec {spooled.codec}, {spooled.stored_size} bytes stored "
                                  f"for {spooled.size}")
        try:
            loc = self.nvme.adopt(txn, spooled.seg, spooled.offset, spooled.stored_size, spooled.vkey_len)
        except BackendError as exc:
            raise from_backend(exc) from None
        return StoredValue(spooled.size, spooled.stored_size, spooled.checksum, spooled.codec, TIER_NVME, loc)

    def open_spool(self, stream: int, owner: tuple[int, int] | None = None) -> tuple[int, str]:
        """A spool for a client's values of `stream` (see `Spooled`): (segment, path)."""
        try:
            seg, path = self.nvme.open_spool(stream, owner)
        except BackendError as exc:
            raise from_backend(exc) from None
        return seg, str(path)

    def close_spool(self, seg: int) -> None:
        self.nvme.close_spool(seg)

    def put_raw(self, txn: Txn, vkey: bytes, raw, compression: str, level: int = 1, *,
                shared: bool = False) -> StoredValue:
        """`shared`: in the cluster (a shared store's value every node reads), not this node's tiers."""
        enc = codec.encode(raw, compression, level)
        return self.put_shared(enc) if shared else self.put(txn, vkey, enc)

    def relocate(self, txn: Txn, vkey: bytes, value: StoredValue, stored: bytes, stream: int,
                 codec_id: int | None = None) -> StoredValue:
        """Move a value's stored bytes (read beforehand) to the NVMe tier, in `stream`; the
        old location is freed in the same transaction (demotion, compaction). `codec_id`:
        the bytes were encoded anew on the way (a hot value compressed as it is demoted)."""
        loc = self.nvme.put(txn, vkey, stored, stream=stream)
        self.tiers[value.tier].delete(txn, value.loc)
        return StoredValue(value.size, len(stored), value.checksum, value.codec if codec_id is None else codec_id,
                           TIER_NVME, loc)

    def delete(self, txn: Txn, value: StoredValue, *, grace: float = 0.0) -> None:
        """Free a value's location (each location exactly once). `grace`: a value in the
        cluster goes only after that many seconds, for readers on other nodes that may still
        be reading it (a node-local value has none but this node's, which the caller knows)."""
        if grace and value.tier == TIER_CLUSTER:
            self.tiers[value.tier].delete_later(value.loc, grace)  # type: ignore[attr-defined]
            return
        self.tiers[value.tier].delete(txn, value.loc)

    def delete_all(self, txn: Txn, values: Sequence[StoredValue]) -> None:
        for value in values:
            self.tiers[value.tier].delete(txn, value.loc)

    # ----- reads ------------------------------------------------------------------------

    def read(self, value: StoredValue, what: str, stored: bytes | None = None) -> bytes:
        """The decoded, verified content of `value` (worker thread). NotFound when nothing
        is at its location, CorruptValue when its bytes do not verify; both name `what`.
        `stored`: its stored bytes, fetched already (with others: see `_Reads`)."""
        try:
            if stored is None:
                stored, tier_crc = self.tiers[value.tier].get_checked(value.loc)
            else:
                tier_crc = None
            if len(stored) != value.stored_size:
                raise CorruptValue(f"stored size {len(stored)}, expected {value.stored_size}")
            data = codec.decode(stored, value.codec, value.size, value.checksum, what, stored_crc=tier_crc)
        except (BackendError, CorruptValue) as exc:
            raise _named(exc, what) from None
        self._count_read(value)
        return data

    def _count_read(self, value: StoredValue) -> None:
        self.counters["disk_reads"] += 1
        self.counters["disk_read_bytes"] += value.stored_size

    def read_into(self, value: StoredValue, what: str, out: Any) -> memoryview | None:
        """`read` of a value stored raw into the writable buffer `out` (worker thread): a
        view of its content there, verified. None when its tier cannot read into a caller's
        buffer or it is not stored raw (the caller uses `read`)."""
        backend = self.tiers[value.tier]
        if value.codec != codec.RAW or value.stored_size != value.size or len(out) < value.size:
            return None
        try:
            got = backend.get_into(value.loc, out)
            if got is None:
                return None
            view, tier_crc = got
            codec.check_content(view, value.size, value.checksum, what, tier_crc)
        except (BackendError, CorruptValue) as exc:
            raise _named(exc, what) from None
        self._count_read(value)
        return view

    def read_in(self, txn: Txn, value: StoredValue, what: str) -> bytes:
        """`read` of a value whose record was read in `txn`, a read transaction (worker
        thread): its bytes as of that snapshot, so a location rewritten since (a value
        stored again under the same key) is read as the record knew it."""
        try:
            stored = self.tiers[value.tier].get_in(txn, value.loc)
        except BackendError as exc:
            raise _named(exc, what) from None
        return self.read(value, what, stored)

    def read_all(self, wanted: Sequence[tuple[StoredValue, str]]) -> list:
        """`read` of each (value, what), in a worker thread already: values in the cluster
        in one pipeline. Each result is the bytes or the DistorefsError of that read."""
        return self._reads._read_blocking([_Req(value, what) for value, what in wanted])

    def read_or_fail(self, value: StoredValue, what: str) -> bytes:
        """`read` for a value that must be there (its record is current): any failure is
        damage, logged and counted, and raised as CorruptValue (EIO)."""
        try:
            return self.read(value, what)
        except (CorruptValue, NotFound) as exc:
            raise self.report_corrupt(exc) from None

    def read_stored(self, value: StoredValue) -> bytes:
        """The stored (encoded) bytes of `value`, unverified beyond the tier's own check
        (worker thread; for moving a value between tiers)."""
        try:
            return self.tiers[value.tier].get(value.loc)
        except BackendError as exc:
            raise from_backend(exc) from None

    def report_corrupt(self, exc: Exception) -> CorruptValue:
        """Count and log a value that failed to verify; the read fails with EIO."""
        self.counters["corrupt_reads"] += 1
        log.error("corrupt value: %s", exc)
        return CorruptValue(str(exc))

    async def fetch(self, items: Sequence[tuple[Hashable, StoredValue, str]], *,
                    cache: bool = True) -> list[Fetched]:
        """The decoded content of each (cache key, value, what): from the memory tier, else
        read in a worker thread (all misses of this call, and of calls waiting meanwhile,
        in one hand-off), or here when they are few, small and in memory (INLINE_READ_*).
        Each result is the bytes or the DistorefsError of that read; values read are kept
        in the memory tier (`cache`)."""
        out: list = [None] * len(items)
        missing = []
        get = self.cache.get
        for i, (key, value, what) in enumerate(items):
            data = get(key) if key is not None else None
            if data is None:
                missing.append(i)
            else:
                out[i] = data
        if missing:
            if len(missing) <= INLINE_READ_VALUES:
                inline = [(i, self._read_inline(items[i][1], items[i][2])) for i in missing]
                missing = [i for i, result in inline if result is None]
                read = [(i, result) for i, result in inline if result is not None]
            else:
                read = []
            if missing:
                read += zip(missing, await self._reads.read([(items[i][1], items[i][2]) for i in missing]))
            for i, result in read:
                out[i] = result
                if cache and isinstance(result, bytes) and items[i][0] is not None:
                    self.cache.put(items[i][0], result)
        return out

    def _read_inline(self, value: StoredValue, what: str) -> "bytes | DistorefsError | None":
        """A small value whose bytes are all in memory here, read on the loop (the bytes,
        or the DistorefsError of the read); None: it is for a worker thread."""
        backend = self.tiers.get(value.tier)
        if value.size > INLINE_READ_BYTES or backend is None or not backend.resident_reads:
            return None
        if time.monotonic() < self._inline_after:
            return None
        try:
            faults = _major_faults()
            stored = backend.get_resident(value.loc)
            if stored is None or _major_faults() != faults:
                self._inline_after = time.monotonic() + self._inline_backoff
                self._inline_backoff = min(2 * self._inline_backoff, INLINE_BACKOFF_MAX_S)
                self.counters["inline_backoffs"] += 1
                if stored is None:
                    return None
            else:
                self._inline_backoff = max(INLINE_BACKOFF_S, self._inline_backoff / 2)
            data: bytes | DistorefsError = self.read(value, what, stored)
        except BackendError:  # (absent, say: no wait for the disk, no back-off)
            return None  # (failed again, and said, by the worker thread's read)
        except DistorefsError as exc:
            data = exc
        self.counters["inline_reads"] += 1
        return data

    async def fetch_one(self, key: Hashable, value: StoredValue, what: str, *, must_exist: bool = True) -> bytes:
        """One value (see `fetch`); a failure raises. `must_exist`: the caller knows the
        record is current, so a failure is damage (reported, EIO)."""
        result = (await self.fetch([(key, value, what)]))[0]
        if isinstance(result, DistorefsError):
            if must_exist and isinstance(result, (CorruptValue, NotFound)):
                raise self.report_corrupt(result)
            raise result
        return result

    async def warm(self, items: Sequence[tuple[Hashable, StoredValue, str]]) -> WarmResult:
        """Load the values of one file (cache key, value, what) into the memory tier, sending
        nothing back: `distorefs warmup`. Within the tier's budget: a value the tier never
        takes (over a quarter of it) is refused, and so is any value past what the tier holds
        in all, so a file bigger than the tier does not evict its own first values. Values
        already there count as `already` (without counting a cache hit). A value whose read
        fails is left out: it may have moved or gone meanwhile (compaction, a rewrite), and a
        damaged one is reported by the read of the file that follows."""
        cache = self.cache
        out = WarmResult(values=len(items), bytes=sum(v.size for _, v, _ in items))
        group: list[tuple[Hashable, StoredValue, str]] = []
        taken = group_bytes = 0
        for key, value, what in items:
            if cache.peek(key) is not None:
                out.already += value.size
                taken += value.size  # the file's own: what comes next must not evict it
                continue
            if not cache.admits(value.size) or taken + value.size > cache.capacity_bytes:
                out.refused += value.size
                continue
            taken += value.size
            group.append((key, value, what))
            group_bytes += value.size
            if group_bytes >= WARM_GROUP_BYTES:
                out.loaded += await self._warm_group(group)
                group, group_bytes = [], 0
        if group:
            out.loaded += await self._warm_group(group)
        cache.warmed_bytes += out.loaded
        cache.warm_refused_bytes += out.refused
        return out

    async def _warm_group(self, group: list[tuple[Hashable, StoredValue, str]]) -> int:
        results = await self._reads.read([(value, what) for _, value, what in group])
        loaded = 0
        for (key, value, _), result in zip(group, results):
            if isinstance(result, bytes):
                self.cache.put(key, result)
                loaded += value.size
        return loaded

    def next_gen(self) -> int:
        """A number never handed out before in this process: cache keys of a new version."""
        self._gen += 1
        return self._gen

    # ----- maintenance ------------------------------------------------------------------

    def sync(self) -> None:
        """Make every value put so far durable: segment files first, then the LMDB
        environment (which also holds the metadata), so a durable record never points at
        data that is not."""
        self.nvme.sync()
        self.lmdb.sync()

    def collect(self) -> int:
        """Unlink segment files whose every value is gone (own write transaction); bytes freed."""
        try:
            freed = self.nvme.collect()
        except BackendError as exc:
            raise from_backend(exc) from None
        self.counters["segment_bytes_freed"] += freed
        return freed

    def tier_stats(self) -> dict:
        out: dict[str, dict[str, Any]] = {}
        for tier, backend in self.tiers.items():
            u = backend.usage()
            out[TIER_NAMES[tier]] = {"used_bytes": u.used_bytes, "live_bytes": u.live_bytes,
                                     "capacity_bytes": u.capacity_bytes}
        out["lmdb"]["budget_bytes"] = self.config.lmdb_bytes
        out["nvme"]["directories"] = self.nvme.dir_usage()
        return out

    def close(self) -> None:
        for backend in self.tiers.values():
            backend.close()


class _Req:
    __slots__ = ("value", "what", "result", "done")

    def __init__(self, value: StoredValue, what: str) -> None:
        self.value = value
        self.what = what
        self.result: bytes | DistorefsError | None = None
        self.done = False


class _Reads:
    """Value reads asked for on the event loop, done in worker threads in batches.

    A thread hand-off costs more than reading a small value from the page cache, so the
    reads of every caller waiting at one moment go to one worker thread call, in a lane of
    `workers` threads of its own (distorefs/lane.py: half the loop's CPU of a
    trio.to_thread hand-off). No background task: the first caller that finds a free slot
    (at most `workers` batches at once) takes everything pending and reads it; the others
    wait for their results or a free slot. Decompression and CRC release the GIL, so two
    batches use two cores.
    """

    MAX_BATCH_BYTES = 64 << 20

    def __init__(self, layer: ValueLayer, workers: int = 2) -> None:
        self.layer = layer
        self.workers = workers
        self.lane = Lane("distorefs-read", threads=workers)
        self.active = 0
        self.pending: list[_Req] = []
        self.changed = trio.Event()

    async def read(self, wanted: list[tuple[StoredValue, str]]) -> list:
        reqs = [_Req(v, what) for v, what in wanted]
        self.pending.extend(reqs)
        while not all(r.done for r in reqs):
            if self.active < self.workers and self.pending:
                await self._run(self._take())
            else:
                await self.changed.wait()
        return [r.result for r in reqs]

    def _take(self) -> list[_Req]:
        """The oldest pending requests, up to MAX_BATCH_BYTES stored (at least one)."""
        total = n = 0
        for req in self.pending:
            if n and total + req.value.stored_size > self.MAX_BATCH_BYTES:
                break
            total += req.value.stored_size
            n += 1
        batch = self.pending[:n]
        del self.pending[:n]
        return batch

    async def _run(self, batch: list[_Req]) -> None:
        self.active += 1
        results = None
        try:
            results = await self.lane.run(lambda: self._read_blocking(batch))
        finally:
            self.active -= 1
            if results is None:  # the lane's call raised, no result came back: the others read them
                self.pending[:0] = batch
            else:
                for req, result in zip(batch, results):
                    req.result, req.done = result, True
                self.layer.counters["read_batches"] += 1
            self.changed.set()
            self.changed = trio.Event()

    def _read_blocking(self, batch: list[_Req]) -> list:
        read = self.layer.read
        prefetched = self._fetched(batch)
        out: list = []
        for i, req in enumerate(batch):
            try:
                out.append(read(req.value, req.what, prefetched.get(i)))
            except DistorefsError as exc:
                out.append(exc)
            except Exception as exc:  # a bug must fail this read, never the daemon
                log.exception("reading %s", req.what)
                out.append(DistorefsError(f"{req.what}: read failed: {exc}"))
        return out

    def _fetched(self, batch: list[_Req]) -> dict[int, bytes]:
        """The stored bytes of the batch's values in tiers that fetch many at once for less
        (the cluster: a round trip per master, not per value; LMDB: one read transaction);
        what they miss is read alone (and fails alone)."""
        by_tier: dict[int, list[int]] = {}
        for i, req in enumerate(batch):
            by_tier.setdefault(req.value.tier, []).append(i)
        out: dict[int, bytes] = {}
        for tier, wanted in by_tier.items():
            backend = self.layer.tiers[tier]
            if len(wanted) < 2 or not backend.batched:
                continue
            try:
                found = backend.get_many([batch[i].value.loc for i in wanted])
            except BackendError:
                continue
            out.update((i, data) for i, data in zip(wanted, found) if data is not None)
        return out

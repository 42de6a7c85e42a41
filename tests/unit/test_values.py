"""The value layer (distorefs/values.py): the backend conformance suite run through it on
each tier, then what only it does: placement, the codec and checksums, damage and races
told apart, reads handed to worker threads in batches, relocation between tiers."""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path

import pytest
import trio

from distorefs import codec
from distorefs.backends.base import ValueBackend
from distorefs.backends.errors import Missing
from distorefs.backends.lmdbenv import LmdbEnv
from distorefs.backends.segments import HEADER, LOCATION, SegmentDir
from distorefs.config import StoreConfig
from distorefs.errors import CorruptValue, NotFound
from distorefs.placement import TIER_LMDB, TIER_NVME
from distorefs.values import INLINE_BACKOFF_S, INLINE_READ_BYTES, StoredValue, ValueLayer

try:
    from .backend_conformance import BackendConformance
    from .test_backends import TestLmdbValues, TestSegmentValues
except ImportError:  # tests/unit is not a package: pytest put it on sys.path
    from backend_conformance import BackendConformance
    from test_backends import TestLmdbValues, TestSegmentValues

MiB = 1 << 20


def _config(tier: int | None = None, **overrides) -> StoreConfig:
    """A store config; `tier` forces every value into one tier."""
    if tier == TIER_LMDB:
        overrides.setdefault("segment_threshold", 0)
        overrides.setdefault("lmdb_bytes", 1 << 40)
    elif tier == TIER_NVME:
        overrides.setdefault("lmdb_bytes", 0)
    overrides.setdefault("segment_bytes", MiB)
    return StoreConfig.from_dict(overrides)


def _layer(tmp_path: Path, config: StoreConfig, map_size: int | None = None) -> ValueLayer:
    env = LmdbEnv(tmp_path / "meta", **({"map_size": map_size} if map_size else {}))
    return ValueLayer(env, config, [SegmentDir(tmp_path / "nvme")])


class _LayerAsTier(ValueBackend):
    """The value layer seen through the tier interface (codec "none", so stored bytes are
    the value's bytes): a location is a packed StoredValue."""

    def __init__(self, layer: ValueLayer, tier: int) -> None:
        self.layer = layer
        self.env = layer.lmdb.env
        self.inner = layer.tiers[tier]
        self.segment_bytes = layer.nvme.segment_bytes
        self.directory = layer.nvme.directory

    def put(self, txn, vkey, data, stream=0):
        raw = bytes(memoryview(data).cast("B"))
        enc = codec.Encoded(raw, codec.RAW, len(raw), codec.checksum(raw))
        return self.layer.put(txn, vkey, enc, stream=stream).pack()

    def get(self, loc):
        try:
            return self.layer.read(StoredValue.unpack_from(loc)[0], "value")
        except NotFound as exc:
            raise Missing(str(exc)) from None

    def delete(self, txn, loc):
        self.layer.delete(txn, StoredValue.unpack_from(loc)[0])

    def sync(self):
        self.layer.sync()

    def usage(self):
        return self.inner.usage()

    def locations(self):
        return self.inner.locations()

    def collect(self):
        return self.layer.collect()

    def close(self):
        self.layer.close()


class _LayerConformance(BackendConformance):
    tier = TIER_LMDB
    inner: type = TestLmdbValues

    def make_backend(self, tmp_path, map_size=None):
        return _LayerAsTier(_layer(tmp_path, _config(self.tier), map_size), self.tier)

    def raw_read(self, backend, loc):
        value = StoredValue.unpack_from(loc)[0]
        assert value.tier == self.tier
        return self.inner.raw_read(self.inner(), backend.inner, value.loc)

    def make_unreachable(self, backend, loc):
        if self.tier == TIER_NVME:
            self.put(backend, b"filler", b"f" * backend.segment_bytes)
            assert backend.collect() > 0

    def test_locations_lists_what_was_put(self, backend):
        sizes = {StoredValue.unpack_from(self.put(backend, b"l%d" % i, os.urandom(i * 10)))[0]: i * 10
                 for i in range(50)}
        listed = dict(backend.locations())
        for value, size in sizes.items():
            assert listed[value.loc] == size


class TestLayerOnLmdb(_LayerConformance):
    tier = TIER_LMDB
    inner = TestLmdbValues

    def missing_location(self):
        return StoredValue(10, 10, 0, codec.RAW, TIER_LMDB, b"no-such-vkey").pack()


class TestLayerOnSegments(_LayerConformance):
    tier = TIER_NVME
    inner = TestSegmentValues

    def missing_location(self):
        return StoredValue(10, 10, 0, codec.RAW, TIER_NVME, LOCATION.pack(99999, HEADER.size, 10)).pack()


# ----- what only the value layer does ------------------------------------------------------

@pytest.fixture
def layer(tmp_path):
    made = _layer(tmp_path, _config(segment_threshold=64 << 10, lmdb_bytes=4 * MiB))
    yield made
    made.close()
    made.lmdb.env.close()


def _put(layer: ValueLayer, vkey: bytes, raw: bytes, compression: str = "zstd", cold: bool = False) -> StoredValue:
    return layer.lmdb.env.write(lambda txn: layer.put(txn, vkey, codec.encode(raw, compression), cold=cold))


def _compressible(n: int, seed: int = 0) -> bytes:
    import numpy as np
    return np.random.default_rng(seed).integers(0, 8, size=n, dtype=np.uint8).tobytes()


def test_placement_by_size_coldness_and_budget(tmp_path):
    layer = _layer(tmp_path, _config(segment_threshold=64 << 10, lmdb_bytes=300 << 10))
    try:
        small, big = os.urandom(10 << 10), os.urandom(100 << 10)
        assert _put(layer, b"s", small, "none").tier == TIER_LMDB
        assert _put(layer, b"b", big, "none").tier == TIER_NVME  # at least segment_threshold
        assert _put(layer, b"c", small, "none", cold=True).tier == TIER_NVME  # behind a demotion front
        # the hot tier's budget: once full, small values go to NVMe too
        tiers = [_put(layer, b"f%d" % i, os.urandom(50 << 10), "none").tier for i in range(8)]
        assert tiers[0] == TIER_LMDB and tiers[-1] == TIER_NVME
        assert layer.lmdb.live_bytes() <= 300 << 10
    finally:
        layer.close()
        layer.lmdb.env.close()


def test_codec_round_trip_and_record(layer):
    raw = _compressible(200 << 10)
    v = _put(layer, b"z", raw)
    assert v.codec == codec.ZSTD and v.stored_size < v.size == len(raw)
    assert v.checksum == zlib.crc32(raw)
    assert layer.read(v, "z") == raw
    assert StoredValue.unpack_from(v.pack())[0] == v
    assert StoredValue.from_json(v.to_json()) == v
    packed = b"prefix" + v.pack() + b"tail"
    assert StoredValue.unpack_from(packed, 6) == (v, len(packed) - 4)


def test_damage_is_corrupt_and_names_the_value(layer, tmp_path):
    v = _put(layer, b"d", os.urandom(200 << 10), "none")
    assert v.tier == TIER_NVME
    seg, off, _size = LOCATION.unpack(v.loc)
    path = tmp_path / "nvme" / f"seg-{seg:08d}.dat"
    with open(path, "r+b") as f:
        f.seek(off + 1000)
        byte = f.read(1)
        f.seek(off + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptValue, match="the entry d"):
        layer.read(v, "the entry d")
    before = layer.counters["corrupt_reads"]
    with pytest.raises(CorruptValue):
        layer.read_or_fail(v, "the entry d")
    assert layer.counters["corrupt_reads"] == before + 1


def test_damage_in_the_hot_tier_is_caught_by_the_checksum(layer):
    raw = os.urandom(4096)
    v = _put(layer, b"h", raw, "none")
    assert v.tier == TIER_LMDB
    layer.lmdb.env.write(lambda txn: txn.put(b"h", raw[:-1] + bytes([raw[-1] ^ 1]), db=b"values"))
    with pytest.raises(CorruptValue, match="checksum"):
        layer.read(v, "h")


def test_missing_is_not_found(layer):
    v = _put(layer, b"m", os.urandom(1000), "none")
    layer.lmdb.env.write(lambda txn: layer.delete(txn, v))
    with pytest.raises(NotFound):
        layer.read(v, "m")


def test_fetch_hands_concurrent_reads_to_few_thread_calls(layer):
    layer.cache.resize(64 * MiB)
    values = {}
    for i in range(200):
        raw = _compressible(20 << 10, i)  # (over INLINE_READ_BYTES: one alone is not read on the loop)
        values[i] = (raw, _put(layer, b"v%d" % i, raw))
    results: dict[int, bytes] = {}

    async def one(i: int) -> None:
        raw, v = values[i]
        results[i] = (await layer.fetch([(("k", i), v, f"v{i}")]))[0]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in values:
                nursery.start_soon(one, i)

    before = layer.counters["read_batches"]
    trio.run(main)
    batches = layer.counters["read_batches"] - before
    assert all(results[i] == values[i][0] for i in values)
    assert batches < len(values) // 4, f"{batches} thread hand-offs for {len(values)} reads"
    # now in the memory tier: no hand-off at all
    trio.run(main)
    assert layer.counters["read_batches"] - before == batches


def test_a_small_value_in_memory_is_read_on_the_loop_and_one_on_disk_in_a_worker_thread(tmp_path):
    config = _config(segment_threshold=64 << 10, lmdb_bytes=64 * MiB)
    layer = _layer(tmp_path, config)
    # In one transaction, between half a megabyte of others each side: in pages of their
    # own, none the kernel reads after the file's first at open or that a lookup touches.
    # Three pages each, incompressible: a lookup touches the first (LMDB checks its header).
    raw, other, one_page = os.urandom(12 << 10), os.urandom(12 << 10), os.urandom(3 << 10)
    big_raw = _compressible(INLINE_READ_BYTES + 1, 1)

    def fill(txn) -> list[StoredValue]:
        put = [layer.put(txn, b"fill%d" % i, codec.encode(os.urandom(16 << 10), "none")) for i in range(32)]
        put += [layer.put(txn, key, codec.encode(data, "none"))
                for key, data in ((b"s", raw), (b"o", other), (b"b", big_raw), (b"t", one_page))]
        return put + [layer.put(txn, b"fill-%d" % i, codec.encode(os.urandom(16 << 10), "none")) for i in range(32)]
    v, w, big, t = layer.lmdb.env.write(fill)[32:36]
    assert v.tier == w.tier == big.tier == t.tier == TIER_LMDB
    layer.lmdb.sync()
    layer.close()
    layer.lmdb.env.close()  # (a page this process maps stays in the page cache)
    fd = os.open(tmp_path / "meta" / "data.mdb", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (this test's own file)
    finally:
        os.close(fd)
    # The store reads around a page that faults: this test's file would be read whole at
    # the first lookup. Here a lookup brings in the B-tree's pages and the value's first.
    layer = ValueLayer(LmdbEnv(tmp_path / "meta", readahead=False), config, [SegmentDir(tmp_path / "nvme")])

    async def fetch(*values):
        return await layer.fetch([(None, value, "v") for value in values], cache=False)

    counts = lambda: (layer.counters["inline_reads"], layer.counters["read_batches"])  # noqa: E731
    assert trio.run(fetch, v) == [raw] and counts() == (0, 1)  # not in memory: a worker thread read it
    assert trio.run(fetch, v) == [raw] and counts() == (0, 2)  # in memory now, but the loop backs off a while
    time.sleep(INLINE_BACKOFF_S)
    assert trio.run(fetch, v) == [raw] and counts() == (1, 2)  # read here
    assert trio.run(fetch, big) == [big_raw] and counts() == (1, 3)  # too large to read here
    assert trio.run(fetch, v, v, v) == [raw] * 3 and counts() == (1, 4)  # too many to read here
    # damage found here is the read's result, as a worker thread's would be
    layer.lmdb.env.write(lambda txn: txn.put(b"s", raw[:-1] + bytes([raw[-1] ^ 1]), db=b"values"))
    out = trio.run(fetch, v)
    assert isinstance(out[0], CorruptValue) and counts() == (2, 4)
    # a value of one page: the lookup itself reads it from the disk (a major fault), so it is
    # read here, but the loop backs off again
    assert trio.run(fetch, t) == [one_page] and counts() == (3, 4)
    assert isinstance(trio.run(fetch, v)[0], CorruptValue)  # (in memory, but the loop backs off)
    assert counts() == (3, 5) and layer.counters["inline_backoffs"] == 2
    assert trio.run(fetch, w) == [other] and counts() == (3, 6)
    layer.close()
    layer.lmdb.env.close()


def test_fetch_reports_each_failure_alone(layer):
    good = _put(layer, b"g", os.urandom(100), "none")
    gone = StoredValue(10, 10, 0, codec.RAW, TIER_LMDB, b"nothing-here")

    async def main():
        return await layer.fetch([(None, good, "g"), (None, gone, "gone")])

    out = trio.run(main)
    assert isinstance(out[0], bytes) and isinstance(out[1], NotFound)
    # an absent value made no read on the loop back off (nothing waited for the disk)
    assert layer.counters["inline_backoffs"] == 0 and layer.counters["inline_reads"] == 1


def test_relocate_moves_the_stored_bytes(layer):
    raw = _compressible(20 << 10)
    v = _put(layer, b"r", raw)
    assert v.tier == TIER_LMDB
    live = layer.lmdb.live_bytes()
    stored = layer.read_stored(v)
    moved = layer.lmdb.env.write(lambda txn: layer.relocate(txn, b"r", v, stored, stream=7))
    assert moved.tier == TIER_NVME and (moved.size, moved.checksum, moved.codec) == (v.size, v.checksum, v.codec)
    assert layer.read(moved, "r") == raw
    assert layer.lmdb.live_bytes() == live - v.stored_size
    assert struct.unpack("<IQQ", moved.loc)[2] == v.stored_size


def test_warm_loads_within_the_memory_budget(layer):
    """warm (distorefs warmup) puts a file's values in the memory tier without returning them:
    values already there count as such, a value over a quarter of the tier and any past what
    the tier holds are refused, and a value that cannot be read is left out."""
    layer.cache.resize(1 * MiB)
    vals = [_put(layer, b"w%d" % i, os.urandom(200 << 10), "none") for i in range(6)]
    big = _put(layer, b"big", os.urandom(300 << 10), "none")  # over 1 MiB / 4
    gone = StoredValue(10, 10, 0, codec.RAW, TIER_LMDB, b"nothing-here")
    items = [(("w", i), v, f"w{i}") for i, v in enumerate(vals)] + [(("big",), big, "big"), (("gone",), gone, "gone")]

    async def warm():
        return await layer.warm(items)

    r = trio.run(warm)
    assert (r.values, r.bytes) == (8, 6 * (200 << 10) + (300 << 10) + 10)
    assert r.already == 0 and r.loaded == 5 * (200 << 10)  # five fit in 1 MiB, the sixth would evict the first
    assert r.refused == (200 << 10) + (300 << 10)  # the sixth and the one too big; "gone" is left out
    assert layer.cache.used_bytes == 5 * (200 << 10) and layer.cache.hits == 0
    assert layer.cache.peek(("w", 0)) is not None and layer.cache.peek(("big",)) is None
    r = trio.run(warm)
    assert r.already == 5 * (200 << 10) and r.loaded == 0
    assert layer.cache.stats()["warmed_bytes"] == 5 * (200 << 10)

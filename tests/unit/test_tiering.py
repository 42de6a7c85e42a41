"""Tiers without FUSE: demotion of the oldest ring values out of a small LMDB budget,
compaction of sparse ring segments (space overhead back under its bound, every value
intact, sampling going on), a full NVMe tier (evict the oldest, or ENOSPC and nothing
lost), segments striped over directories with capacities, and the memory plan."""

import random

import pytest
import trio

from distorefs import codec
from distorefs.backends.segments import LOCATION, SegmentDir, SegmentValues
from distorefs.placement import TIER_LMDB, TIER_NVME
from distorefs.config import StoreConfig
from distorefs.backends.errors import Full
from distorefs.errors import InvalidConfig, NoSpace
from distorefs.memory import MemoryPlan
from distorefs.placement import DEMOTE_AT
from distorefs.owner import Owner
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
DIR = Owner(0o40755, 1000, 1000)
KiB, MiB = 1 << 10, 1 << 20


def payload(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)  # incompressible: stored size == size


async def wait_for(pred, timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.05)


async def read_all(ring, sizes: dict[int, int]) -> None:
    for i, size in sizes.items():
        meta = ring.get(b"e%d" % i)
        assert await ring.read(meta) == payload(i, size), i


def test_demotion_keeps_lmdb_under_budget_oldest_first(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"compression": "none", "capacity": 100000}')
        sizes = {i: 20 * KiB for i in range(200)}  # 4 MB into a 1 MB hot tier
        for i, size in sizes.items():
            await buf.insert(b"e%d" % i, payload(i, size), OWNER)
        ring = buf.ring
        await wait_for(lambda: store.values.lmdb.live_bytes() <= DEMOTE_AT * store.config.lmdb_bytes)
        tiers = [m.tier for m in ring.oldest()]
        assert tiers.count(TIER_LMDB) <= MiB // (20 * KiB)
        # the oldest went first: every entry before the demotion front is cold, none after it
        # was demoted (some went to NVMe directly, while the hot tier was full)
        front = ring.demote_front
        assert front > 40 and all(m.tier == TIER_NVME for m in ring.oldest() if m.seq < front)
        assert store.mover.counters["demoted_entries"] >= 40
        await buf.insert(b"e200", payload(200, 20 * KiB), OWNER)  # demotion made room: new ones land hot
        sizes[200] = 20 * KiB
        assert ring.get(b"e200").tier == TIER_LMDB
        # a rewrite of a demoted entry stays cold; of a hot one, hot
        await buf.insert(b"e0", payload(0, 20 * KiB), OWNER)
        await buf.insert(b"e200", payload(200, 20 * KiB), OWNER)
        assert ring.get(b"e0").tier == TIER_NVME and ring.get(b"e200").tier == TIER_LMDB
        store.values.cache.resize(0)  # read from the tiers, not the memory tier
        await read_all(ring, sizes)
        stats = store.stats()
        assert stats["tiers"]["lmdb"]["live_bytes"] <= store.config.lmdb_bytes
        assert stats["buffers"]["rb"]["tiers"]["nvme"]["entries"] == sum(m.tier == TIER_NVME for m in ring.oldest())

    run(tmp_path / "s", body, config={"lmdb_bytes": MiB, "sync_interval": 0.05, "segment_bytes": MiB})

    async def reopen(store):  # moves survive a restart
        ring = store.buffer("rb").ring
        store.values.cache.resize(0)
        assert sum(m.tier == TIER_NVME for m in ring.oldest()) >= 149
        await read_all(ring, {i: 20 * KiB for i in range(201)})

    run(tmp_path / "s", reopen)


def compressible(i: int, size: int) -> bytes:
    rng = random.Random(i)
    return bytes(rng.randrange(4) for _ in range(size))  # 2 bits of entropy a byte: zstd packs it


def test_hot_values_are_stored_as_written_and_compressed_when_demoted(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        ring = buf.ring
        for i in range(10):
            await buf.insert(b"e%d" % i, compressible(i, 40 * KiB), OWNER)
        hot = ring.get(b"e0")
        assert (hot.tier, hot.value.codec, hot.stored_size) == (TIER_LMDB, codec.RAW, 40 * KiB)
        for i in range(10, 60):  # 2.4 MB as written into a 1 MB hot tier: the oldest are demoted
            await buf.insert(b"e%d" % i, compressible(i, 40 * KiB), OWNER)
        await wait_for(lambda: store.mover.counters["compressed_on_move"] >= 20)
        cold = ring.get(b"e0")
        assert (cold.tier, cold.value.codec) == (TIER_NVME, codec.ZSTD)
        assert cold.stored_size < 20 * KiB and cold.value.checksum == hot.value.checksum
        store.values.cache.resize(0)  # (what inserts left in memory: the reads below are the tiers')
        for i in range(60):  # every value whole, wherever and however it is stored now
            assert await ring.read(ring.get(b"e%d" % i)) == compressible(i, 40 * KiB), i
        assert all(m.value.codec == codec.ZSTD for m in ring.oldest() if m.tier == TIER_NVME)

    run(tmp_path / "s", body, config={"lmdb_bytes": MiB, "sync_interval": 0.05, "segment_bytes": MiB})


def test_values_are_compressed_at_insert_with_compress_hot_or_outside_the_hot_tier(tmp_path):
    async def body(store):
        hot = await store.create_buffer("hot", DIR)
        await store.configure_buffer("hot", b'{"compress_hot": true}')
        await hot.insert(b"a", compressible(1, 40 * KiB), OWNER)
        meta = hot.ring.get(b"a")
        assert (meta.tier, meta.value.codec) == (TIER_LMDB, codec.ZSTD) and meta.stored_size < 20 * KiB
        big = await store.create_buffer("big", DIR)  # past segment_threshold: straight to NVMe
        await big.insert(b"b", compressible(2, 2 * MiB), OWNER)
        meta = big.ring.get(b"b")
        assert (meta.tier, meta.value.codec) == (TIER_NVME, codec.ZSTD)
        raw = await store.create_buffer("raw", DIR)
        await store.configure_buffer("raw", b'{"compression": "none"}')
        await raw.insert(b"c", compressible(3, 40 * KiB), OWNER)
        assert raw.ring.get(b"c").value.codec == codec.RAW
        for buf, key, i, size in ((hot, b"a", 1, 40 * KiB), (big, b"b", 2, 2 * MiB), (raw, b"c", 3, 40 * KiB)):
            assert await buf.ring.read(buf.ring.get(key)) == compressible(i, size)

    run(tmp_path / "s", body)


def test_an_idle_store_takes_no_tier_rounds_until_the_next_commit(tmp_path):
    """A round looks at the hot tier's live bytes and at the segments, each a hop to a worker
    thread: with nothing committed since the last round there is nothing new to see."""
    async def body(store):
        looks = []
        segments = store.values.nvme.segments

        def counted():  # the compaction's look, which every round takes
            looks.append(1)
            return segments()

        store.values.nvme.segments = counted
        buf = await store.create_buffer("rb", DIR)
        for i in range(20):
            await buf.insert(b"e%d" % i, payload(i, 20 * KiB), OWNER)
        with trio.fail_after(10):  # the rounds that see those commits, until one sees nothing new
            seen = -1
            while len(looks) != seen:
                seen = len(looks)
                await trio.sleep(0.25)
        await trio.sleep(0.5)  # ten sync intervals, nothing committed
        assert len(looks) == seen
        rounds = store.mover.counters["rounds"]
        await buf.insert(b"e20", payload(20, 20 * KiB), OWNER)
        await wait_for(lambda: len(looks) > seen)
        assert store.mover.counters["rounds"] > rounds
        assert (await buf.ring.read(buf.ring.get(b"e20"))) == payload(20, 20 * KiB)

    run(tmp_path / "s", body, config={"sync_interval": 0.05})


def test_compaction_reclaims_sparse_segments_while_sampling(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"compression": "none", "capacity": 100000, "sampler": "uniform"}')
        rng = random.Random(1)
        sizes = {}
        for i in range(400):  # 400 x 40 KB = 16 MB in 1 MB segments
            sizes[i] = 40 * KiB
            await buf.insert(b"e%d" % i, payload(i, sizes[i]), OWNER)
        for i in rng.sample(sorted(sizes), 260):  # 65% gone, spread over every segment
            await buf.ring.delete(b"e%d" % i)
            del sizes[i]
        nvme = store.values.nvme
        before = nvme.usage()  # compaction may have started already
        assert before.live_bytes == sum(sizes.values())
        sampled = 0

        async def sample_meanwhile():
            nonlocal sampled
            while True:
                batch = await buf.sample(8)
                values = await buf.ring.read_many(batch.metas)
                for m, v in zip(batch.metas, values):
                    assert v == payload(int(m.key[1:]), 40 * KiB)
                sampled += 1
                buf.release(batch)
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample_meanwhile)
            store.values.cache.resize(0)
            await wait_for(lambda: store.mover.counters["compacted_segments"] >= 5)
            await wait_for(lambda: nvme.usage().used_bytes <= store.config.max_space_overhead * nvme.usage().live_bytes)
            nursery.cancel_scope.cancel()
        after = nvme.usage()
        assert after.live_bytes == before.live_bytes and sampled > 0
        assert store.stats()["tiering"]["compacted_entries"] > 0
        await read_all(buf.ring, sizes)
        assert buf.stats()["entries"] == len(sizes)

    run(tmp_path / "s", body, config={"lmdb_bytes": 0, "sync_interval": 0.05, "segment_bytes": MiB})


def test_full_nvme_tier_evicts_the_oldest_or_says_enospc(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()  # an NVMe directory must exist before a store is given it

    async def body(store):
        # a bank that does not allow eviction holds a few entries first
        bank = await store.create("banks", "b", DIR)
        await store.configure("banks", "b", b'{"compression": "none", "evict_when_full": false}')
        for i in range(3):
            await bank.insert(b"b%d" % i, payload(1000 + i, 200 * KiB), OWNER)
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"compression": "none", "capacity": 100000}')
        for i in range(60):  # 60 x 200 KB = 12 MB into a 4 MB tier: the buffer evicts its oldest
            await buf.insert(b"e%d" % i, payload(i, 200 * KiB), OWNER)
        ring = buf.ring
        assert ring.counters.get("evictions_for_space", 0) > 0
        assert store.values.nvme.usage().used_bytes <= 4 * MiB
        assert next(ring.newest()).key == b"e59" and len(ring) >= 5  # the newest are there, whole
        keys = [m.key for m in ring.oldest()]
        for key in keys:
            assert await ring.read(ring.get(key)) == payload(int(key[1:]), 200 * KiB)
        # the bank may not evict: ENOSPC, and nothing it or the buffer held is lost
        await store.configure_buffer("rb", b'{"evict_when_full": false}')
        with pytest.raises(NoSpace):
            for i in range(3, 100):
                await bank.insert(b"b%d" % i, payload(1000 + i, 200 * KiB), OWNER)
        with pytest.raises(NoSpace):
            for i in range(60, 100):
                await buf.insert(b"e%d" % i, payload(i, 200 * KiB), OWNER)
        for i in range(3):
            assert await bank.ring.read(bank.ring.get(b"b%d" % i)) == payload(1000 + i, 200 * KiB)
        assert [m.key for m in ring.oldest()][:len(keys)] == keys
        for key in keys:
            assert await ring.read(ring.get(key)) == payload(int(key[1:]), 200 * KiB)

    run(tmp_path / "s", body, nvme_dirs=[{"path": str(nvme), "capacity_bytes": 4 * MiB}],
        config={"lmdb_bytes": 0, "sync_interval": 0.05, "segment_bytes": MiB})


def test_segments_stripe_over_directories_with_capacities(tmp_path, lmdb_env):
    a, b = tmp_path / "a", tmp_path / "b"
    tier = SegmentValues(lmdb_env, [SegmentDir(a, 8 * MiB), SegmentDir(b, 4 * MiB)], segment_bytes=MiB)
    try:
        locs = [lmdb_env.write(lambda txn, i=i: tier.put(txn, b"v%d" % i, payload(i, 300 * KiB), stream=i % 2))
                for i in range(36)]
        in_a, in_b = len(list(a.glob("seg-*.dat"))), len(list(b.glob("seg-*.dat")))
        assert in_a > 0 and in_b > 0 and in_a >= in_b  # more room, more segments
        usage = tier.dir_usage()
        assert usage[0]["used_bytes"] <= 8 * MiB and usage[1]["used_bytes"] <= 4 * MiB
        segs = {LOCATION.unpack(l)[0] for l in locs}
        streams = {s.seg: s.stream for s in tier.segments()}
        assert {streams[s] for s in segs} == {0, 1}  # each stream has its own segments
        with pytest.raises(Full):
            for i in range(36, 100):
                lmdb_env.write(lambda txn, i=i: tier.put(txn, b"v%d" % i, payload(i, 300 * KiB)))
        for i, loc in enumerate(locs):
            assert tier.get(loc) == payload(i, 300 * KiB)
        assert [(v, l) for v, l in tier.records(LOCATION.unpack(locs[0])[0])][0] == (b"v0", locs[0])
        tier.sync()
    finally:
        tier.close()
    # a directory holding values left out of the list: its segments are named as missing
    tier = SegmentValues(lmdb_env, [SegmentDir(a, 8 * MiB)], segment_bytes=MiB)
    try:
        assert tier.missing and all(tier.path_of(seg) is None for seg in tier.missing)
    finally:
        tier.close()


def test_memory_plan_shares_one_budget():
    config = StoreConfig.from_dict({"memory_bytes": 1 << 30})
    plan = MemoryPlan.of(config)
    assert plan.cache + plan.prefetch + plan.writeback + plan.transfer <= 1 << 30
    assert plan.cache > plan.prefetch > 0 and plan.writeback > 0
    plan = MemoryPlan.of(StoreConfig.from_dict({"memory_bytes": 1 << 30, "cache_bytes": 0}), writeback_bytes=256 * MiB)
    assert plan.cache == 0 and plan.writeback == 256 * MiB
    assert plan.prefetch + plan.transfer <= (1 << 30) - 256 * MiB
    with pytest.raises(InvalidConfig, match="memory_bytes"):
        StoreConfig.from_dict({"memory_bytes": 64 * MiB, "cache_bytes": 128 * MiB})
    with pytest.raises(InvalidConfig, match="memory_bytes"):
        MemoryPlan.of(StoreConfig.from_dict({"memory_bytes": 64 * MiB}), writeback_bytes=128 * MiB)


@pytest.fixture
def lmdb_env(tmp_path):
    from distorefs.backends.lmdbenv import LmdbEnv
    env = LmdbEnv(tmp_path / "meta")
    env.db(b"segments")
    yield env
    env.close()


def test_a_dropped_rings_last_segment_is_collected(tmp_path):
    async def body(store):
        buf = await store.create_buffer("gone", DIR)
        await store.configure_buffer("gone", b'{"compression": "none"}')
        await buf.insert(b"big", payload(1, 600 * KiB), OWNER)  # over segment_threshold: NVMe
        segs = list((tmp_path / "s" / "segments").glob("seg-*.dat"))
        assert len(segs) == 1
        await buf.ring.delete(b"big")
        await store.drop_buffer("gone")
        await store.collect()
        assert not segs[0].exists()

    run(tmp_path / "s", body, config={"lmdb_bytes": 0})


def test_a_directory_added_later_is_used_and_a_missing_one_refused(tmp_path):
    store_dir, extra = tmp_path / "s", tmp_path / "nvme1"
    extra.mkdir()

    async def fill(store, start: int):
        buf = store.buffer("b") if "b" in store.buffers else await store.create_buffer("b", DIR)
        await store.configure_buffer("b", b'{"compression": "none"}')
        for i in range(start, start + 6):
            await buf.insert(b"e%d" % i, payload(i, 600 * KiB), OWNER)  # over segment_threshold: NVMe

    run(store_dir, lambda store: fill(store, 0), config={"segment_bytes": MiB})
    assert list((store_dir / "segments").glob("seg-*.dat"))

    async def more(store):
        paths = [d.path for d in store.config.nvme_dirs]
        assert paths == [str(store_dir / "segments"), str(extra)]  # the default one stays listed
        await fill(store, 6)
        assert list(extra.glob("seg-*.dat"))  # the new directory, with the most room, takes segments
        for i in range(12):
            assert await store.buffer("b").ring.read(store.buffer("b").ring.get(b"e%d" % i)) == payload(i, 600 * KiB)

    # the default directory capped near what it holds: the new one has the most room
    run(store_dir, more, nvme_dirs=[{"path": str(store_dir / "segments"), "capacity_bytes": 6 * MiB},
                                    {"path": str(extra), "capacity_bytes": 1 << 30}])
    for seg in extra.glob("seg-*.dat"):  # a drive that is not there: the mount is refused
        seg.unlink()
    extra.rmdir()
    with pytest.raises(InvalidConfig, match="does not exist"):
        run(store_dir, lambda store: trio.sleep(0))

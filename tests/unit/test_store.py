"""The store, ring and replay buffer as a library: no FUSE, a real LMDB store on disk."""

import io
from collections import deque
import math
import zipfile

import numpy as np
import pytest
import trio

from distorefs.errors import (AlreadyExists, InvalidArgument, InvalidConfig, NotEmpty, NotFound, StoreLocked,
                             TooLarge, WouldBlock)
from distorefs.owner import Owner
from distorefs.store import Store
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
LARGE = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
DIR = Owner(0o40755, 1000, 1000)


def npz_bytes(**arrays) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def npy(value, shape=(4, 3)) -> bytes:
    out = io.BytesIO()
    np.save(out, np.full(shape, value, dtype=np.float32))
    return out.getvalue()


async def fill(buf, n, start=0, size=None):
    for i in range(start, start + n):
        data = npy(i) if size is None else bytes([i % 256]) * size
        await buf.insert(b"k%d" % i, data, OWNER)


def test_insert_read_rewrite_delete(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await fill(buf, 5)
        ring = buf.ring
        assert [m.key for m in ring.oldest()] == [b"k0", b"k1", b"k2", b"k3", b"k4"]
        seq = ring.get(b"k2").seq
        await buf.insert(b"k2", npy(99), OWNER)
        assert ring.get(b"k2").seq == seq  # rewrite keeps the FIFO position
        assert await ring.read(ring.get(b"k2")) == npy(99)
        with pytest.raises(InvalidArgument, match="neither an .npy"):  # the buffer is of .npy arrays
            await buf.insert(b"k2", b"new", OWNER)
        await ring.delete(b"k0")
        with pytest.raises(NotFound):
            ring.get(b"k0")
        with pytest.raises(NotFound):
            await ring.delete(b"k0")
        await ring.rename(b"k3", b"renamed")
        assert ring.get(b"renamed").seq == seq + 1
        assert [m.key for m in ring.oldest()] == [b"k1", b"k2", b"renamed", b"k4"]
        assert ring.at(0).key == b"k1" and ring.at(3).key == b"k4"
        with pytest.raises(AlreadyExists):
            await store.create_buffer("rb", DIR)
        with pytest.raises(NotEmpty):
            await store.drop_buffer("rb")
    run(tmp_path / "s", body)


def test_eviction_by_capacity_and_bytes(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"capacity": 3}')
        await fill(buf, 6)
        assert [m.key for m in buf.ring.oldest()] == [b"k3", b"k4", b"k5"]
        assert buf.ring.counters["evictions"] == 3
        # raw mode: entries of any layout (here plain bytes)
        await store.configure_buffer("rb", b'{"capacity": 100, "max_bytes": 2500, "raw": true}')
        await fill(buf, 5, start=10, size=1000)
        assert buf.ring.bytes <= 2500
        assert [m.key for m in buf.ring.oldest()] == [b"k13", b"k14"]
        with pytest.raises(TooLarge):
            await buf.insert(b"big", b"x" * 3000, OWNER)
        await store.configure_buffer("rb", b'{"capacity": 1}')
        assert [m.key for m in buf.ring.oldest()] == [b"k14"]
    run(tmp_path / "s", body)


def test_concurrent_inserts_group_commit(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"capacity": 150}')
        async with trio.open_nursery() as nursery:
            for w in range(8):
                async def writer(w=w):
                    for i in range(40):
                        await buf.insert(b"w%d-%d" % (w, i), npy(w * 1000 + i), OWNER)
                nursery.start_soon(writer)
        assert len(buf.ring) == 150
        seqs = [m.seq for m in buf.ring.oldest()]
        assert seqs == sorted(seqs) and len(set(seqs)) == 150
        assert store.committer.groups < 320  # concurrent inserts shared transactions
        for meta in buf.ring.oldest():
            w, i = map(int, meta.key[1:].split(b"-"))
            assert np.load(io.BytesIO(await buf.ring.read(meta)))[0, 0] == w * 1000 + i
    run(tmp_path / "s", body)


def test_everything_persists(tmp_path):
    async def write(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"sampler": "prioritized", "alpha": 0.7}')
        await store.configure_buffer("rb", b'{"raw": true}')  # npy arrays and plain bytes
        await fill(buf, 10)
        await buf.insert(b"large", LARGE, OWNER)  # 1 MiB incompressible: the nvme tier
        await buf.set_priorities([(b"k3", 9.0), (b"k4", 0.5)])
        await buf.sample(4)
        return {m.key: m.seq for m in buf.ring.oldest()}, buf.sampler.times.copy()

    seqs, times = run(tmp_path / "s", write, config={"cache_bytes": 0})

    async def read(store):
        buf = store.buffer("rb")
        assert buf.config.sampler == "prioritized" and buf.config.alpha == 0.7
        assert {m.key: m.seq for m in buf.ring.oldest()} == seqs
        assert buf.sampler.priority[buf.ring.get(b"k3").slot] == 9.0
        assert buf.sampler.priority[buf.ring.get(b"k4").slot] == 0.5
        assert buf.sampler.times.sum() == times.sum() == 4
        large = buf.ring.get(b"large")
        assert large.tier == 1
        assert await buf.ring.read(large) == LARGE
        assert np.load(io.BytesIO(await buf.ring.read(buf.ring.get(b"k7"))))[0, 0] == 7
        await buf.insert(b"after", b"x", OWNER)
        assert buf.ring.get(b"after").seq == max(seqs.values()) + 1

    run(tmp_path / "s", read, config={"cache_bytes": 0})


def test_times_sampled_counts_are_written_for_every_entry_drawn_and_none_deleted(tmp_path):
    from distorefs.catalog import entry_key, entry_keys, pack_u32, pack_u32s
    seqs = np.array([0, 1, 255, 256, 2**40 + 7], dtype=np.int64)
    assert entry_keys(9, seqs) == [entry_key(9, int(s)) for s in seqs]
    assert pack_u32s(np.array([0, 5, 2**32 - 1])) == [pack_u32(0), pack_u32(5), pack_u32(2**32 - 1)]

    async def write(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"presample_batches": 0}')
        await fill(buf, 300)
        for _ in range(20):
            buf.release(await buf.sample(64))
        await buf.ring.delete(b"k3")  # drawn, most likely, and gone before the counts are written
        await buf.ring.delete(b"k4")
        return {m.key: int(buf.sampler.times[m.slot]) for m in buf.ring.oldest()}

    times = run(tmp_path / "s", write)
    assert sum(times.values()) > 1000 and b"k3" not in times

    async def read(store):
        buf = store.buffer("rb")
        return {m.key: int(buf.sampler.times[m.slot]) for m in buf.ring.oldest()}

    assert run(tmp_path / "s", read) == times


def test_second_open_is_refused(tmp_path):
    store = Store(tmp_path / "s")
    try:
        with pytest.raises(StoreLocked, match="already in use"):
            Store(tmp_path / "s")
    finally:
        store.close()
    Store(tmp_path / "s").close()  # released on close


def test_sampling_modes(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await fill(buf, 6)
        await store.configure_buffer("rb", b'{"sampler": "fifo"}')
        assert [m.key for m in (await buf.sample(3)).metas] == [b"k0", b"k1", b"k2"]
        await store.configure_buffer("rb", b'{"sampler": "lifo"}')
        assert [m.key for m in (await buf.sample(2)).metas] == [b"k5", b"k4"]
        await store.configure_buffer("rb", b'{"sampler": "uniform", "seed": 3}')
        batch = await buf.sample(600)
        assert np.allclose(batch.probabilities, 1 / 6) and np.all(batch.weights == 1)
        counts = np.bincount([int(m.key[1:]) for m in batch.metas], minlength=6)
        assert counts.min() > 60  # stratified uniform over 6 entries: ~100 each
        with pytest.raises(InvalidArgument):
            await buf.sample(0)
    run(tmp_path / "s", body)


def test_prioritized_probabilities_and_weights(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"sampler": "prioritized", "alpha": 0.5, "beta": 0.4, "seed": 7}')
        await fill(buf, 4)
        await buf.set_priorities([(b"k0", 1.0), (b"k1", 4.0), (b"k2", 9.0), (b"k3", 16.0)])
        expected = np.array([1, 2, 3, 4]) / 10.0  # p ** 0.5 normalised
        draws = np.zeros(4)
        for _ in range(100):
            batch = await buf.sample(64)
            for meta, p, w in zip(batch.metas, batch.probabilities, batch.weights):
                i = int(meta.key[1:])
                draws[i] += 1
                assert math.isclose(p, expected[i], rel_tol=1e-9)
                assert math.isclose(w, (expected[i] / expected[0]) ** -0.4, rel_tol=1e-9)
        freq = draws / draws.sum()
        assert np.allclose(freq, expected, atol=0.02)
        # zero priority: never drawn
        await buf.set_priorities([(b"k3", 0.0)])
        batch = await buf.sample(500)
        assert b"k3" not in {m.key for m in batch.metas}
    run(tmp_path / "s", body)


def test_max_times_sampled_and_release(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"max_times_sampled": 2, "presample_batches": 0}')
        await fill(buf, 3)
        batch = await buf.sample(6)  # 3 entries x 2 draws each: everything spent
        keys = [m.key for m in batch.metas]
        assert sorted(keys) == sorted([b"k0", b"k1", b"k2"] * 2)
        assert len(batch.spent) == 3
        assert len(buf.ring) == 3  # still readable while the batch is held
        with pytest.raises(WouldBlock):
            await buf.sample(1, nonblocking=True)
        buf.release(batch)
        await store.committer.drain()
        assert len(buf.ring) == 0
        assert buf.counters["exhausted"] == 3
    run(tmp_path / "s", body)


def test_min_size_to_sample_waits(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"min_size_to_sample": 3}')
        await fill(buf, 2)
        with pytest.raises(WouldBlock):
            await buf.sample(2, nonblocking=True)
        got = []

        async def sampler():
            got.append(await buf.sample(2))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            await trio.sleep(0.05)
            assert not got
            await fill(buf, 1, start=5)
        assert len(got[0].metas) == 2
    run(tmp_path / "s", body)


def test_priority_updates_validate_and_skip_unknown(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await fill(buf, 3)
        with pytest.raises(InvalidArgument):
            await buf.set_priorities([(b"k0", 2.0), (b"k1", float("nan"))])
        assert buf.sampler.priority[buf.ring.get(b"k0").slot] == 1.0  # nothing of the bad call applied
        with pytest.raises(InvalidArgument):
            await buf.set_priorities([(b"k0", -1.0)])
        assert await buf.set_priorities([(b"k0", 2.0), (b"gone", 3.0)]) == 1
        assert buf.counters["priority_unknown_keys"] == 1
        with pytest.raises(NotFound):
            await buf.set_priorities([(b"gone", 3.0)], strict=True)
        # new entries get the max priority seen so far (PER)
        await fill(buf, 1, start=9)
        assert buf.sampler.priority[buf.ring.get(b"k9").slot] == 2.0
    run(tmp_path / "s", body)


def test_batch_npz_stacks_fields(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"sampler": "fifo"}')
        for i in range(3):
            out = io.BytesIO()
            np.savez(out, obs=np.full((2, 2), i, np.uint8), reward=np.float32(i), keys=np.int64(i))
            await buf.insert(b"e%d" % i, out.getvalue(), OWNER)
        _, data = await buf.sample_npz(3)
        z = np.load(io.BytesIO(bytes(data)))
        assert z["obs"].shape == (3, 2, 2) and list(z["obs"][:, 0, 0]) == [0, 1, 2]
        assert list(z["reward"]) == [0, 1, 2]
        assert list(z["entry_keys"]) == [0, 1, 2]  # a field named like a reserved array
        assert list(z["keys"]) == ["e0", "e1", "e2"]
        assert z["weights"].dtype == np.float64
        with pytest.raises(InvalidArgument, match="entry layout"):  # another layout: refused
            await buf.insert(b"raw", b"hello", OWNER)
        await store.configure_buffer("rb", b'{"sampler": "lifo", "raw": true}')
        await buf.insert(b"raw", b"hello", OWNER)
        _, data = await buf.sample_npz(2)
        z = np.load(io.BytesIO(bytes(data)))
        off = z["offsets"]
        assert bytes(z["data"][off[0]:off[1]]) == b"hello"
        assert zipfile.is_zipfile(io.BytesIO(bytes(data)))
    run(tmp_path / "s", body)


async def building_ahead(store):
    """A buffer "rb" of entries e0..e2 (one float32 array `obs` each, full of i) whose
    batch/32.npz files are built ahead: one was opened."""
    buf = await store.create_buffer("rb", DIR)
    for i in range(3):
        await buf.insert(b"e%d" % i, npz_bytes(obs=np.full(2, i, np.float32)), OWNER)
    await buf.sample_npz(32)
    await trio.sleep(0.05)
    return buf


def test_a_batch_set_aside_is_counted_when_taken_and_void_when_an_entry_of_it_goes(tmp_path):
    """Buffer.reserve_ahead: the next batch built ahead, set aside for an open to come (the
    mount's learner inode). Nothing is counted until it is taken; removing an entry it holds
    makes it void (its taker is told); with a rate limiter nothing is set aside."""
    async def body(store):
        buf = await building_ahead(store)
        voided: list[int] = []
        reservation = buf.reserve_ahead(32, lambda: voided.append(1))
        assert reservation is not None and reservation.file.size > 0
        counted = buf.counters["batches"], int(buf.sampler.times.sum())
        buf.refill(32, now=True)  # its queue refills (the taker's to ask, once its own work is done)
        await trio.sleep(0.05)
        assert (buf.counters["batches"], int(buf.sampler.times.sum())) == counted
        batch = buf.take_ahead(reservation)
        assert buf.counters["batches"] == counted[0] + 1
        assert int(buf.sampler.times.sum()) == counted[1] + 32
        z = np.load(io.BytesIO(bytes(reservation.file.read(0, reservation.file.size, bytearray(1 << 20)))))
        assert [int(v) for v in z["obs"][:, 0]] == [int(m.key[1:]) for m in batch.metas]

        second = buf.reserve_ahead(32, lambda: voided.append(2))
        assert second is not None and not second.void
        assert {m.key for m in second.ahead.batch.metas} == {b"e0", b"e1", b"e2"}  # 32 draws of 3
        await buf.ring.delete(b"e1")
        assert second.void and voided == [2]
        assert b"e1" not in {m.key for m in (await buf.sample_npz(32))[0].metas}

        await store.configure_buffer("rb", b'{"samples_per_insert": 4, "error_buffer": 1000, "min_size_to_sample": 1}')
        await buf.sample_npz(32)
        await trio.sleep(0.05)
        assert buf.reserve_ahead(32, lambda: None) is None  # a draw may have to wait: through sample_npz
    run(tmp_path / "s", body)


def test_a_batch_set_aside_is_drawn_again_by_its_taker_without_a_task(tmp_path):
    """A learner takes one batch set aside per step (Buffer.reserve_ahead): the batch after
    it is drawn and built by `refill`, in the taker's call, not by a task spawned for each
    (a spawn and its first step cost some 20 us of a batch's 300 in the daemon)."""
    async def body(store):
        buf = await building_ahead(store)
        spawned: list[object] = []
        real_spawn = buf.spawn
        buf.spawn = lambda fn, *args: (spawned.append(fn), real_spawn(fn, *args))  # type: ignore[method-assign]
        queued = len(buf._presampled[32])
        for _ in range(5):
            reservation = buf.reserve_ahead(32, lambda: None)
            assert reservation is not None
            assert len(buf._presampled[32]) == queued - 1
            buf.refill(32, now=True)
            assert len(buf._presampled[32]) == queued  # drawn and built in the call
            assert buf._presampled[32][-1][1] is not None
            buf.take_ahead(reservation)
        assert spawned == []
    run(tmp_path / "s", body)


def test_a_refill_that_fails_is_logged_and_the_next_one_draws(tmp_path, caplog):
    """A failure while drawing ahead in the caller's call (a bug) is logged, not raised into
    the release that asked; the next refill draws as before."""
    async def body(store):
        buf = await building_ahead(store)
        reservation = buf.reserve_ahead(32, lambda: None)
        assert reservation is not None
        queued = len(buf._presampled[32])
        real_draw = buf.sampler.draw

        def broken(*args):
            raise RuntimeError("a bug")
        buf.sampler.draw = broken  # type: ignore[method-assign]
        buf.refill(32, now=True)
        assert "drawing batches of 32 ahead failed" in caplog.text
        assert len(buf._presampled[32]) == queued
        buf.sampler.draw = real_draw  # type: ignore[method-assign]
        buf.refill(32, now=True)
        assert len(buf._presampled[32]) == queued + 1
    run(tmp_path / "s", body)


def test_a_large_batch_reserved_ahead_is_counted_when_taken_and_void_when_an_entry_of_it_goes(tmp_path):
    """Buffer.reserve_large: the next batch of a size too large to be built while queued,
    drawn ahead and its file described (the mount writes it into a memfd for the next
    open). Nothing is counted until it is taken; removing an entry it holds makes it void;
    fifo and a rate limiter reserve nothing."""
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"sampler": "uniform"}')
        for i in range(3):
            await buf.insert(b"e%d" % i, npy(i, (300, 300)), OWNER)
        await buf.sample_npz(32)  # 32 x 360 KB: a batch/32.npz was opened, none built while queued
        await trio.sleep(0.05)
        assert buf.reserve_ahead(32, lambda: None) is None  # too large for the small way
        counted = buf.counters["batches"], int(buf.sampler.times.sum())
        reservation = await buf.reserve_large(32)
        assert reservation is not None and not reservation.void
        assert (buf.counters["batches"], int(buf.sampler.times.sum())) == counted
        z = np.load(io.BytesIO(bytes(reservation.file.read(0, reservation.file.size))))
        assert [int(v) for v in z["data"][:, 0, 0]] == [int(m.key[1:]) for m in reservation.ahead.batch.metas]
        batch = buf.take_ahead(reservation)
        assert buf.counters["batches"] == counted[0] + 1
        assert int(buf.sampler.times.sum()) == counted[1] + 32
        assert len(batch.metas) == 32

        second = await buf.reserve_large(32)
        assert second is not None
        await buf.ring.delete(b"e1")
        assert second.void
        buf.drop_reserved(second)

        await store.configure_buffer("rb", b'{"sampler": "fifo"}')
        assert await buf.reserve_large(32) is None
        await store.configure_buffer("rb", b'{"sampler": "uniform", "samples_per_insert": 4, "error_buffer": 1000, '
                                           b'"min_size_to_sample": 1}')
        assert await buf.reserve_large(32) is None  # a draw may have to wait: through sample_npz
    run(tmp_path / "s", body)


def test_dead_segments_are_collected(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"capacity": 2, "compression": "none"}')
        for i in range(4):  # each 1 MiB value fills a 1 MiB segment: one segment per value
            await buf.insert(b"big%d" % i, LARGE, OWNER)
        await trio.sleep(0.5)  # a few sync intervals
        segments = sorted((tmp_path / "s" / "segments").glob("seg-*.dat"))
        assert store.values.counters["segment_bytes_freed"] >= 2 * len(LARGE)
        assert len(segments) <= 3  # the two evicted values' segments are gone
        for key in (b"big2", b"big3"):
            assert await buf.ring.read(buf.ring.get(key)) == LARGE
    run(tmp_path / "s", body, config={"segment_bytes": 1 << 20, "sync_interval": 0.1, "cache_bytes": 0})


def test_batch_bytes_are_bounded(tmp_path):
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await buf.insert(b"a", LARGE, OWNER)
        await buf.insert(b"b", b"small", OWNER)
        await store.configure_buffer("rb", b'{"sampler": "fifo"}')
        with pytest.raises(TooLarge):
            await buf.sample_npz(2)  # 1 MiB + 5 bytes > 1 MiB
        await store.configure_buffer("rb", b'{"sampler": "lifo"}')
        _, data = await buf.sample_npz(1)  # just "b": fits
        assert np.load(io.BytesIO(bytes(data)))["keys"][0] == "b"
    run(tmp_path / "s", body, config={"max_batch_bytes": 1 << 20})


def test_bank_ring_positions_and_persistence(tmp_path):
    async def write(store):
        bank = await store.create("banks", "mem", DIR)
        await store.configure("banks", "mem", b'{"capacity": 3}')
        for i in range(5):
            await bank.insert(b"m%d" % i, b"x" * (i + 1) * 100, OWNER)
        assert [bank.at(i).key for i in range(3)] == [b"m2", b"m3", b"m4"]
        with pytest.raises(NotFound):
            bank.at(3)
        with pytest.raises(InvalidConfig):
            await store.configure("banks", "mem", b'{"sampler": "uniform"}')
        with pytest.raises(AlreadyExists):
            await store.create("banks", "mem", DIR)
        await store.create_buffer("mem", DIR)  # a buffer and a bank may share a name

    run(tmp_path / "s", write)

    async def read(store):
        bank = store.namespace("banks", "mem")
        assert bank.config.capacity == 3
        assert [bank.at(i).key for i in range(3)] == [b"m2", b"m3", b"m4"]
        assert await bank.ring.read(bank.at(0)) == b"x" * 300
        assert store.stats()["banks"]["mem"]["entries"] == 3
        assert "mem" in store.buffers

    run(tmp_path / "s", read)


def test_the_weight_of_a_drawn_entry_whose_priority_is_0_now_is_0(tmp_path):
    """A batch drawn ahead is handed out with the weights of the distribution it was drawn
    from; an entry of it set to priority 0 since gets weight 0 (not inf, not nan) and
    probability 0, the others theirs."""
    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"sampler": "prioritized", "alpha": 1.0, "beta": 0.5}')
        await fill(buf, 3)
        await buf.set_priorities([(b"k0", 1.0), (b"k1", 4.0), (b"k2", 0.0)])
        slots = np.array([buf.ring.by_key[k].slot for k in (b"k0", b"k1", b"k2")], dtype=np.int64)
        probs, weights = buf.sampler.probabilities(slots, np.zeros(0, dtype=np.int64))
        assert probs.tolist() == [0.2, 0.8, 0.0]
        assert weights.tolist() == [1.0, 0.25 ** 0.5, 0.0]
    run(tmp_path / "s", body)


def test_the_rings_name_table_holds_each_slots_name_and_draws_read_their_keys_from_it(tmp_path):
    """Ring.slot_name follows the ring through inserts (past 1,024 slots, names growing
    past the table's first width), renames (to a long name, a non-ASCII one and back) and
    deletes; a draw's keys, manifest and keys.npy are those of its entries, from the table
    when it holds them all, from the entries otherwise, with the same dtype either way."""
    def consistent(ring) -> None:
        live = [m for m in ring.slot_meta if m is not None]
        named = [bool(ring.slot_named[m.slot]) for m in live]
        assert named == [len(m.key) <= 64 and m.key.isascii() for m in live]
        assert [ring.slot_name[m.slot] for m in live if ring.slot_named[m.slot]] == \
            [m.key for m in live if ring.slot_named[m.slot]]

    def draws_match(buf) -> None:
        from_table = 0
        for _ in range(20):
            batch = buf._draw(32, presample=False)
            from_table += batch.names is not None
            assert batch.keys() == [m.key for m in batch.metas]
            expected = np.array([m.key.decode("utf-8", "surrogateescape") for m in batch.metas])
            got = batch.key_strings()
            assert got.dtype == expected.dtype and got.tolist() == expected.tolist()
            lines = batch.manifest().splitlines()
            assert [line.split(b" ")[1] for line in lines] == [b"%d" % m.seq for m in batch.metas]
        assert from_table

    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        ring = buf.ring
        for i in range(1100):  # the slot tables grow past 1,024
            await buf.insert(b"k%d" % i, npy(i), OWNER)
        consistent(ring)
        await buf.insert(b"a-name-longer-than-sixteen-bytes", npy(1), OWNER)  # the table widens
        assert ring.slot_name.dtype.itemsize > 16
        consistent(ring)
        await ring.rename(b"k5", b"x" * 70)  # too long for the table: from its entry
        await ring.rename(b"k6", "caf\u00e9".encode())  # not ASCII: likewise
        consistent(ring)
        draws_match(buf)
        await ring.delete(b"x" * 70)
        await ring.rename("caf\u00e9".encode(), b"k6")  # back in the table
        await ring.delete(b"k7")
        consistent(ring)
        assert ring.names_of(np.array([ring.get(b"k6").slot, ring.get(b"k8").slot])).tolist() == [b"k6", b"k8"]
        draws_match(buf)
    run(tmp_path / "s", body)


def test_a_rings_name_watcher_hears_every_key_come_and_go_and_is_held_weakly(tmp_path):
    """Ring.watch_names: the watcher's count of each name equals the ring's keys through
    inserts, rewrites, evictions, renames and deletes (the mount's front answers LOOKUPs
    from that count); a watcher nobody else holds is dropped."""
    class Names:
        def __init__(self) -> None:
            self.count: dict[bytes, int] = {}

        def changed(self, key: bytes, present: bool) -> None:
            self.count[key] = self.count.get(key, 0) + (1 if present else -1)
            assert self.count[key] in (0, 1)

        def held(self) -> set[bytes]:
            return {k for k, n in self.count.items() if n}

    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"capacity": 5}')
        ring = buf.ring
        names = Names()
        ring.watch_names(names.changed)
        await fill(buf, 8)  # three evicted
        assert names.held() == set(ring.by_key) == {b"k3", b"k4", b"k5", b"k6", b"k7"}
        await buf.insert(b"k5", npy(50), OWNER)  # a rewrite: the name stays, once
        await ring.rename(b"k6", b"moved")
        await ring.delete(b"k7")
        assert names.held() == set(ring.by_key) == {b"k3", b"k4", b"k5", b"moved"}
        del names
        await fill(buf, 1, start=20)
        assert ring._name_watchers == []
    run(tmp_path / "s", body)


def test_the_ring_knows_which_values_the_memory_tier_holds_and_presampling_reads_ahead_the_others(tmp_path):
    """Ring.slot_cached follows the memory tier through inserts, evictions from the tier,
    reads, rewrites, renames and deletes; a presampled draw hands the prefetcher exactly
    its entries the tier does not hold."""
    def consistent(buf) -> None:
        ring, cache = buf.ring, buf.ring.values.cache
        live = [m for m in ring.slot_meta if m is not None]
        assert [bool(ring.slot_cached[m.slot]) for m in live] == [(ring.ns_id, m.seq, m.gen) in cache for m in live]
        free = [slot for slot, m in enumerate(ring.slot_meta) if m is None]
        assert not ring.slot_cached[free].any()

    async def body(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"presample_batches": 1}')
        await fill(buf, 24, size=8 << 10)  # the tier (64 KiB) holds the last few only
        ring = buf.ring
        consistent(buf)
        assert 0 < int(ring.slot_cached.sum()) < 24
        oldest = ring.get(b"k0")
        assert not ring.slot_cached[oldest.slot]
        assert await ring.read(oldest) == bytes([0]) * (8 << 10)  # read: held now, another one left
        assert ring.slot_cached[oldest.slot]
        consistent(buf)
        await buf.insert(b"k0", bytes([99]) * (8 << 10), OWNER)  # a rewrite: its new version is held
        consistent(buf)
        await ring.rename(b"k0", b"renamed")
        consistent(buf)
        await ring.delete(b"k23")
        consistent(buf)

        asked: list[dict] = []
        ring.prefetcher.extend = asked.append  # type: ignore[method-assign]  # what a draw ahead reads
        queue = buf._presampled.setdefault(64, deque())
        queue.clear()
        await buf._presample(64)
        (slots, _), _ = queue[-1]
        drawn = [ring.slot_meta[s] for s in slots.tolist()]
        wanted = {(m.seq, m.gen) for m in drawn if (ring.ns_id, m.seq, m.gen) not in ring.values.cache}
        assert wanted and set().union(*asked) == wanted
    run(tmp_path / "s", body, config={"cache_bytes": 64 << 10})


def test_a_batch_built_ahead_is_not_handed_out_once_an_entry_of_it_is_rewritten(tmp_path):
    """A batch/N.npz built ahead holds the versions it was built from: a rewrite of one of
    its entries (same key, same slot, new version) makes it stale, as a delete does."""
    async def body(store):
        buf = await building_ahead(store)
        _, ahead = buf._presampled[32][0]
        assert ahead is not None and ahead.current(buf)
        await buf.insert(b"e1", npz_bytes(obs=np.full(2, 7, np.float32)), OWNER)
        assert not ahead.current(buf)
        batch, content = await buf.sample_npz(32)
        z = np.load(io.BytesIO(bytes(content.read(0, content.size, bytearray(1 << 20)))))
        assert 7.0 in z["obs"][:, 0] and 1.0 not in z["obs"][:, 0]
    run(tmp_path / "s", body)


def test_a_draws_sequence_numbers_come_from_the_ring_and_name_its_entries(tmp_path):
    """sample/N lines and batch/N.npz's seqs.npy give each drawn entry's own sequence number,
    taken from the ring's slot table when it is drawn."""
    async def body(store):
        buf = await building_ahead(store)
        await buf.insert(b"e0", npz_bytes(obs=np.full(2, 9, np.float32)), OWNER)  # a rewrite keeps its seq
        for _ in range(3):
            batch = await buf.sample(16)
            assert len(batch.seqs) == 16 and batch.seqs.tolist() == [m.seq for m in batch.metas]
            assert [int(line.split()[1]) for line in batch.manifest().splitlines()] == batch.seqs.tolist()
            batch, content = await buf.sample_npz(32)
            z = np.load(io.BytesIO(bytes(content.read(0, content.size, bytearray(1 << 20)))))
            assert z["seqs"].tolist() == [m.seq for m in batch.metas]
            assert [buf.ring.by_seq[s].key.decode() for s in z["seqs"].tolist()] == z["keys"].tolist()
    run(tmp_path / "s", body)

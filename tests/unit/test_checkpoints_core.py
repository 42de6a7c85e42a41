"""Checkpoints as a library (no FUSE): snapshot and persist phases, the write-back budget,
step completion and `latest`, keep_last and pinning, reopening, crash leftovers."""

import zlib

import numpy as np
import pytest
import trio

from distorefs.checkpoints import DURABLE, INCOMPLETE, PERSISTING, ROOT_ID, WRITING, FileReader
from distorefs.codec import _crc32_combine_python, crc32_combine
from backends.segments import LOCATION
from distorefs.errors import CorruptValue, InvalidConfig, NotEmpty, ReadOnly, Stale
from distorefs.owner import Owner
from store_runner import run

DIR = Owner(0o40755, 0, 0)
FILE = Owner(0o100644, 0, 0)
SMALL = b'{"chunk_bytes": 65536, "writeback_bytes": 524288, "seal_after": 0, "keep_last": 2}'


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


async def save(ck, step_id: int, name: bytes, data: bytes, piece: int = 50_000):
    """What a writer does: create, write in pieces, close."""
    f = await ck.create(step_id, name, FILE)
    for off in range(0, len(data), piece):
        await ck.write(f, off, data[off:off + piece])
    ck.flushed(f)
    ck.released(f, write=True)
    return f


async def new_step(store, config: bytes = SMALL, step: bytes = b"s"):
    """checkpoints configured with `config`, run/ and run/STEP: (tree, run, step)."""
    ck = store.checkpoints
    await ck.configure(config)
    r = await ck.mkdir(ROOT_ID, b"run", DIR)
    return ck, r, await ck.mkdir(r.id, step, DIR)


async def read_all(ck, f) -> bytes:
    reader = FileReader(ck, f)
    ck.open_read(f)
    try:
        return await reader.read(0, f.size + 10)
    finally:
        ck.released(f, write=False)


def test_crc32_combine():
    a, b = payload(1000, 1), payload(123457, 2)
    for combine in (crc32_combine, _crc32_combine_python):  # zlib's (ctypes) and the fallback
        assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert combine(zlib.crc32(a), 0, 0) == zlib.crc32(a)


def test_config_is_validated(tmp_path):
    async def body(store):
        with pytest.raises(InvalidConfig):
            await store.checkpoints.configure(b'{"writeback_bytes": 1024}')
        with pytest.raises(InvalidConfig):
            await store.checkpoints.configure(b'{"keep_last": 0}')
        await store.checkpoints.configure(SMALL)
        return store.checkpoints.config.chunk_bytes

    assert run(tmp_path / "s", body) == 65536


def test_write_read_persist_complete_and_reload(tmp_path):
    data = payload(700_001, 3)

    async def write(store):
        ck, r, s = await new_step(store, step=b"step-1")
        f = await ck.create(s.id, b"model.bin", FILE)
        for off in range(0, len(data), 30_000):  # pieces that straddle chunk borders
            await ck.write(f, off, data[off:off + 30_000])
        await ck.write(f, 10, b"HEADER")  # a seek back, as zip writers do
        expect = data[:10] + b"HEADER" + data[16:]
        assert ck.state(f) == WRITING and ck.state(s) == WRITING
        assert await FileReader(ck, f).read(65530, 20) == expect[65530:65550]  # from memory
        ck.flushed(f)
        ck.released(f, write=True)
        assert ck.latest(r) is None
        await ck.sync_dir(s)  # fsync of the step directory: closes it, waits for durability
        assert ck.state(f) == DURABLE and ck.state(s) == DURABLE
        assert ck.latest(r) is s
        assert not f.mem and ck.budget.used == 0
        assert len(f.stored) == 11
        assert ck.checksum(f) == zlib.crc32(expect)
        assert await read_all(ck, f) == expect
        return expect

    expect = run(tmp_path / "s", write)

    async def reload(store):
        ck = store.checkpoints
        r = ck.resolve("run")
        s = ck.resolve("run/step-1")
        f = ck.resolve("run/step-1/model.bin")
        assert ck.latest(r) is s and ck.state(s) == DURABLE
        assert f.size == len(expect) and ck.checksum(f) == zlib.crc32(expect)
        assert await read_all(ck, f) == expect
        reader = FileReader(ck, f)  # ranges across chunks, sparse reads past the end
        for off, n in ((0, 1), (65535, 2), (131000, 200_000), (len(expect) - 3, 100)):
            assert await reader.read(off, n) == expect[off:off + n]

    run(tmp_path / "s", reload)


def test_backpressure_keeps_memory_in_the_budget(tmp_path):
    data = payload(3 << 20, 4)

    async def body(store):
        ck, r, s = await new_step(store)
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, ck.budget.used)
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            files = []
            for i in range(3):  # three writers at once, each with 3 MiB
                async def one(i=i):
                    files.append(await save(ck, s.id, b"f%d" % i, data, piece=40_000))
                nursery.start_soon(one)
            await trio.sleep(0.01)
            while len(files) < 3:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        await ck.sync_dir(s)
        assert ck.budget.waits > 0, "the writers never had to wait"
        assert peak <= ck.budget.capacity
        assert ck.budget.peak <= ck.budget.capacity
        for f in files:
            assert await read_all(ck, f) == data
        assert ck.state(s) == DURABLE

    run(tmp_path / "s", body)


def test_partly_filled_chunks_are_evicted_when_the_budget_is_full(tmp_path):
    async def body(store):
        ck = store.checkpoints
        await ck.configure(SMALL)  # 8 chunks of 64 KiB
        r = await ck.mkdir(ROOT_ID, b"run", DIR)
        s = await ck.mkdir(r.id, b"s", DIR)
        files = [await ck.create(s.id, b"f%d" % i, FILE) for i in range(12)]
        pieces = [payload(60_000, i) for i in range(12)]
        with trio.fail_after(10):  # 12 half-full chunks > the budget: must not deadlock
            for f, p in zip(files, pieces):
                await ck.write(f, 0, p[:45_000])
            for f, p in zip(files, pieces):
                await ck.write(f, 45_000, p[45_000:])
        assert ck.counters["evictions"] > 0 and ck.counters["chunk_reloads"] > 0
        for f, p in zip(files, pieces):
            ck.flushed(f)
            ck.released(f, True)
            assert await read_all(ck, f) == p

    run(tmp_path / "s", body)


def test_keep_last_pinning_and_latest(tmp_path):
    async def body(store):
        ck = store.checkpoints
        await ck.configure(SMALL)
        r = await ck.mkdir(ROOT_ID, b"run", DIR)
        steps = []
        for i in range(5):
            s = await ck.mkdir(r.id, b"step-%d" % i, DIR)  # closes the previous step
            steps.append(s)
            await save(ck, s.id, b"w", payload(100_000, i))
            if i == 0:
                await ck.set_pinned(s, True)
            await trio.sleep(0)
        assert ck.state(steps[-1]) == WRITING
        await ck.sync_dir(steps[-1])
        await store.committer.drain()
        assert ck.latest(r) is steps[-1]
        names = sorted(ck.dir(r.id).children)
        assert names == [b"step-0", b"step-3", b"step-4"], names  # keep_last 2, + the pinned one
        await ck.set_pinned(steps[0], False)
        await store.committer.drain()
        assert sorted(ck.dir(r.id).children) == [b"step-3", b"step-4"]
        assert ck.counters["steps_removed"] == 3

    run(tmp_path / "s", body)


def test_writing_a_complete_step_again_reopens_it(tmp_path):
    async def body(store):
        ck, r, s1 = await new_step(store, step=b"a")
        await save(ck, s1.id, b"w", b"one")
        s2 = await ck.mkdir(r.id, b"b", DIR)
        f = await save(ck, s2.id, b"w", b"two")
        await ck.sync_dir(s2)
        assert ck.latest(r) is s2
        await ck.open_write(f, truncate=True)  # a rewrite: b is no longer complete
        assert not s2.complete and ck.latest(r) is s1
        await ck.write(f, 0, b"three")
        ck.flushed(f)
        ck.released(f, True)
        await ck.sync_dir(s2)
        assert ck.latest(r) is s2 and await read_all(ck, f) == b"three"

    run(tmp_path / "s", body)


def test_truncate_and_holes(tmp_path):
    async def body(store):
        ck, r, s = await new_step(store)
        f = await ck.create(s.id, b"sparse", FILE)
        data = payload(200_000, 9)
        await ck.write(f, 0, data)
        await ck.fsync(f)  # everything stored
        assert not f.mem and ck.state(f) == WRITING  # still open
        await ck.truncate(f, 70_000)
        await ck.write(f, 300_000, b"end")
        ck.flushed(f)
        ck.released(f, True)
        expect = data[:70_000] + bytes(230_000) + b"end"
        assert await read_all(ck, f) == expect
        await ck.sync_dir(s)
        assert ck.checksum(f) == zlib.crc32(expect) and not f.garbage
        assert await read_all(ck, f) == expect

    run(tmp_path / "s", body)


def test_a_step_left_incomplete_is_interrupted_after_reopen(tmp_path):
    async def crash(store):
        ck, r, good = await new_step(store, step=b"good")
        await save(ck, good.id, b"w", b"good")
        cut = await ck.mkdir(r.id, b"cut", DIR)
        f = await ck.create(cut.id, b"w", FILE)  # never closed: as if the daemon died now
        await ck.write(f, 0, payload(300_000, 1))
        await ck.fsync(f)
        assert ck.state(good) == DURABLE and ck.state(cut) == WRITING

    run(tmp_path / "s", crash)

    async def after(store):
        ck = store.checkpoints
        r = ck.resolve("run")
        cut = ck.resolve("run/cut")
        assert ck.latest(r).name == b"good"
        assert ck.state(cut) == INCOMPLETE and cut.interrupted
        with pytest.raises(ReadOnly):
            await ck.create(cut.id, b"more", FILE)
        assert len(await read_all(ck, ck.resolve("run/cut/w"))) == 300_000  # what it got stays readable
        s = await ck.mkdir(r.id, b"next", DIR)
        await save(ck, s.id, b"w", b"next")
        await ck.sync_dir(s)
        await store.committer.drain()
        # an fsync acknowledged its file: retention keeps the interrupted step (rm it by hand)
        assert sorted(ck.dir(r.id).children) == [b"cut", b"good", b"next"]
        assert await read_all(ck, ck.resolve("run/cut/w")) == payload(300_000, 1)

    run(tmp_path / "s", after)


def test_seal_after_closes_a_quiet_step(tmp_path):
    async def body(store):
        ck, r, s = await new_step(store, b'{"chunk_bytes": 65536, "writeback_bytes": 524288, "seal_after": 0.1}')
        await save(ck, s.id, b"w", payload(100_000, 5))
        assert ck.state(s) == WRITING
        with trio.fail_after(5):
            while ck.latest(r) is not s:
                assert ck.state(s) in (WRITING, PERSISTING, DURABLE)
                await trio.sleep(0.01)

    run(tmp_path / "s", body)


def test_rename_and_remove(tmp_path):
    async def body(store):
        ck, r, tmp = await new_step(store, step=b"tmp")
        live = store.values.lmdb.live_bytes()
        sub = await ck.mkdir(tmp.id, b"sub", DIR)
        await save(ck, sub.id, b"a.tmp", b"A" * 1000)
        await ck.rename(sub.id, b"a.tmp", sub.id, b"a", noreplace=False)
        await ck.rename(r.id, b"tmp", r.id, b"step-7", noreplace=False)  # the write-then-rename idiom
        await ck.sync_dir(tmp)
        assert ck.latest(r).name == b"step-7"
        assert await read_all(ck, ck.resolve("run/step-7/sub/a")) == b"A" * 1000
        assert store.values.lmdb.live_bytes() == live + 1000
        with pytest.raises(NotEmpty):
            await ck.remove(tmp.id, b"sub", want_dir=True)
        await ck.remove(sub.id, b"a", want_dir=False)  # the step is being changed: no longer complete
        assert ck.latest(r) is None
        await ck.remove(tmp.id, b"sub", want_dir=True)
        await store.committer.drain()
        # kept for a crash (the step would go back to its complete content) until it completes
        # again or the store restarts cleanly
        assert store.values.lmdb.live_bytes() == live + 1000

    run(tmp_path / "s", body)

    async def after(store):
        ck = store.checkpoints
        assert sorted(ck.dir(ck.resolve("run").id).children) == [b"step-7"]
        assert not ck.resolve("run/step-7").children
        await store.committer.drain()
        assert store.values.lmdb.live_bytes() == 0  # the restore point went at the clean start

    run(tmp_path / "s", after)


def test_big_chunks_use_recycled_buffers(tmp_path):
    data = payload(21 << 20, 6)

    async def body(store):
        ck, r, s = await new_step(store, b'{"chunk_bytes": 4194304, "writeback_bytes": 16777216, "seal_after": 0}')
        f = await save(ck, s.id, b"big", data, piece=1 << 20)
        await ck.sync_dir(s)
        assert ck.pool.free_bytes > 0 and ck.budget.peak <= 16 << 20
        s2 = await ck.mkdir(r.id, b"s2", DIR)
        g = await ck.create(s2.id, b"mid", FILE)
        await ck.write(g, 0, data[:700_000])  # big writes appended: kept as they came, no copy
        await ck.write(g, 700_000, data[700_000:1_500_000])
        assert g.mem[0].pieces is not None and g.mem[0].length == 1_500_000 and ck.budget.used == 1_500_000
        await ck.write(g, 100, b"patch")  # anything else: one buffer (a first chunk grows 1, 2, 4 MiB)
        assert g.mem[0].pieces is None and len(g.mem[0].data) == 2 << 20
        ck.flushed(g)
        ck.released(g, True)
        await ck.sync_dir(s2)
        assert await read_all(ck, f) == data
        assert await read_all(ck, g) == data[:100] + b"patch" + data[105:1_500_000]
        assert ck.budget.used == 0 and ck.budget.used + ck.pool.free_bytes <= ck.budget.capacity

    run(tmp_path / "s", body)


def test_chunks_read_back_land_in_free_buffers_of_the_pool_and_go_back(tmp_path):
    """After a checkpoint the pool holds its chunks' buffers: a reader loads stored chunks
    into them (not into new bytes), verified, and gives them back as it moves on and at
    its close; a damaged chunk read that way is EIO, its buffer back too."""
    data = payload(13 << 20, 9)

    async def body(store):
        ck, r, s = await new_step(store, b'{"chunk_bytes": 4194304, "writeback_bytes": 33554432, "seal_after": 0}')
        f = await save(ck, s.id, b"big", data, piece=1 << 20)
        await ck.sync_dir(s)
        free = ck.pool.free_bytes
        assert free >= 8 << 20
        reader = FileReader(ck, f)
        ck.open_read(f)
        try:
            first = await reader.read(0, 1 << 20)
            assert bytes(first) == data[:1 << 20]
            pooled = [held[2] for held in reader.cache.values() if held[2] is not None]
            assert pooled and ck.pool.free_bytes <= free - (4 << 20)
            got = bytearray(first)
            while len(got) < len(data):
                got += await reader.read(len(got), 1 << 20)
            assert bytes(got) == data
        finally:
            reader.close()
            ck.released(f, write=False)
        assert ck.pool.free_bytes == free
        chunk = f.stored[1]
        backend = store.values.tiers[chunk.tier]
        seg, off, _ = LOCATION.unpack(chunk.loc)
        with open(backend._path(seg), "r+b") as raw:
            raw.seek(off + 1000)
            byte = raw.read(1)
            raw.seek(off + 1000)
            raw.write(bytes([byte[0] ^ 0xFF]))
        reader = FileReader(ck, f)
        ck.open_read(f)
        try:
            with pytest.raises(CorruptValue):
                await reader.read(4 << 20, 1 << 20)
        finally:
            reader.close()
            ck.released(f, write=False)
        await store.committer.drain()
        for _ in range(100):  # (the chunks it was loading ahead land after its close)
            if ck.pool.free_bytes == free:
                break
            await trio.sleep(0.01)
        assert ck.pool.free_bytes == free

    run(tmp_path / "s", body)


def test_the_persister_takes_several_chunks_at_once_and_commits_a_file_after_its_chunks(tmp_path):
    files = {b"f%d" % i: payload(5 * 65536 + 1000 * i, 20 + i) for i in range(6)}

    async def body(store):
        ck, r, s = await new_step(store, b'{"chunk_bytes": 65536, "writeback_bytes": 8388608, "seal_after": 0}')
        at_once = {"now": 0, "most": 0}
        commits = []
        persist_one, commit_file = ck._persist_one, ck._commit_file

        async def counted(f, index):
            at_once["now"] += 1
            at_once["most"] = max(at_once["most"], at_once["now"])
            try:
                await persist_one(f, index)
            finally:
                at_once["now"] -= 1

        async def commit(f, ticket):
            commits.append((f.name, dict(f.mem), sorted(f.stored)))  # what its commit sees
            await commit_file(f, ticket)

        ck._persist_one, ck._commit_file = counted, commit
        made = [await save(ck, s.id, name, data) for name, data in files.items()]
        await ck.sync_dir(s)
        assert at_once["most"] > 1  # one chunk joined and encoded while another is written
        assert {name for name, _, _ in commits} == set(files)
        for name, in_memory, stored in commits:
            assert not in_memory and stored == list(range(-(-len(files[name]) // 65536))), name
        assert ck.latest(r) is s and ck.budget.used == 0
        for f in made:
            assert await read_all(ck, f) == files[f.name]

    run(tmp_path / "s", body)


def test_a_reader_that_opens_a_file_while_a_rename_over_it_commits_reads_it_whole(tmp_path):
    """tmp + rename over a checkpoint file while a reader opens it: the rename is planned,
    its transaction runs in a worker thread, and the open comes in between (the name still
    names the old file). The reader holds the old file, so its data must outlive that
    transaction: it goes at the reader's last close, as for any file replaced while open."""
    from distorefs.checkpoints import Rename
    from distorefs.committer import Overlay

    async def body(store):
        ck, r, step = await new_step(store)
        ck.RETIRE_GRACE_S = 0  # a file replaced goes at once once unopened
        old = await save(ck, step.id, b"a.npy", b"old" * 1000)
        await save(ck, step.id, b"a.tmp", b"new" * 1000)
        await ck.sync_dir(step)
        old.mem.clear()  # persisted: read back from the store, as after eviction
        live = store.values.lmdb.live_bytes()
        rename = Rename(ck, ck.child(step.id, b"a.tmp"), step.id, b"a.npy", False)
        rename.plan(Overlay())
        await trio.to_thread.run_sync(store.committer._write_txn, rename.txn)
        reader = FileReader(ck, old)
        ck.open_read(old)  # the reader's open, before the rename is applied
        rename.apply()
        assert bytes(await reader.read(0, 3000)) == b"old" * 1000
        ck.released(old, write=False)  # its last close: it goes, with its data
        await store.committer.drain()
        with pytest.raises(Stale):  # an open through a lookup made before the rename
            ck.open_read(old)
        assert store.values.lmdb.live_bytes() == live - 3000
        assert await read_all(ck, ck.resolve("run/s/a.npy")) == b"new" * 1000

    run(tmp_path / "s", body)


def test_a_reader_opening_a_file_of_a_step_being_removed_whole_gets_enoent_not_eio(tmp_path):
    """A step removed whole (retention, in the background, or at the word of the node that
    wrote it): its files' data go in the removal's transaction (a worker thread), while
    their names still open them until it is applied. A reader opening one in that window must be told the step is gone (ENOENT),
    not given a file whose chunks are being freed (EIO, counted as corruption). A removal
    whose transaction fails gives the step back."""
    from distorefs.checkpoints import RemoveTree
    from distorefs.committer import Overlay
    from distorefs.errors import NotFound

    async def body(store):
        ck, r, step = await new_step(store)
        f = await save(ck, step.id, b"a.npy", b"old" * 1000)
        await ck.sync_dir(step)
        f.mem.clear()  # persisted: read back from the store
        removal = RemoveTree(ck, step, background=False, whole=True)
        removal.plan(Overlay())
        removal.failed()  # a failed transaction: the step is read as before
        assert await read_all(ck, f) == b"old" * 1000
        removal.plan(Overlay())
        await trio.to_thread.run_sync(store.committer._write_txn, removal.txn)
        with pytest.raises(NotFound):  # the reader's open, before the removal is applied
            ck.open_read(f)
        removal.apply()
        assert store.values.counters["corrupt_reads"] == 0

    run(tmp_path / "s", body)


def test_a_step_removed_at_another_nodes_word_while_open_here_keeps_its_data(tmp_path):
    """The node that wrote a step removed it (its `cremove`): here the step goes whole, with
    its data, unless something here has it open. A reader may open one of its files after
    the follower saw none open and before the removal is planned: the plan refuses
    (Busy) and the follower marks the step incomplete instead, so retention takes it once
    it is closed; the reader reads it whole, nothing is counted corrupt."""
    from distorefs.checkpoints import RemoveTree
    from distorefs.checkpointslog import CheckpointsLog
    from distorefs.clusterlog import Record
    from distorefs.committer import Overlay
    from distorefs.errors import Busy

    async def body(store):
        ck, r, step = await new_step(store)
        f = await save(ck, step.id, b"a.npy", b"old" * 1000)
        await ck.sync_dir(step)
        f.mem.clear()  # persisted: read back from the store
        step.origin, step.nonce = "node-b", "n1"  # written there, applied here
        reader = FileReader(ck, f)
        ck.open_read(f)  # opened after the follower's look, before the plan
        with pytest.raises(Busy):
            RemoveTree(ck, step, background=False, whole=True).plan(Overlay())
        assert not step.going
        follower = CheckpointsLog(ck, None, store.committer, store.values, "node-a", lambda *a: None)
        await follower.apply(Record(b"1-0", "cremove", "checkpoints", "run/s",
                                    {b"origin": b"node-b", b"nonce": b"n1"}))
        assert ck.child(r.id, b"s") is step and not step.complete
        assert await reader.read(0, f.size) == b"old" * 1000
        ck.released(f, write=False)
        assert store.values.counters["corrupt_reads"] == 0

    run(tmp_path / "s", body)


def test_a_file_replaced_since_its_lookup_opens_within_the_grace_then_goes(tmp_path):
    """A reader's lookup found a file, then writers replaced the name (rename over it)
    before the reader's open: within a second the replaced file still opens and reads
    whole (under writers that replace a name faster than a lookup and its open, even the
    kernel's one retry of a Stale open would find the next file replaced too). Its data go
    once the grace has passed with nobody holding it; an open after that is Stale."""
    async def body(store):
        ck, r, step = await new_step(store)
        old = await save(ck, step.id, b"a.npy", b"old" * 1000)
        for i in range(2):
            await save(ck, step.id, b"a.tmp", b"new%d" % i * 1000)
            await ck.rename(step.id, b"a.tmp", step.id, b"a.npy", False)
        await store.committer.drain()
        assert old.unlinked and old.attached
        assert await read_all(ck, old) == b"old" * 1000
        await trio.sleep(ck.RETIRE_GRACE_S + 0.2)
        await store.committer.drain()
        assert not old.attached
        with pytest.raises(Stale):
            ck.open_read(old)
        assert await read_all(ck, ck.resolve("run/s/a.npy")) == b"new1" * 1000

    run(tmp_path / "s", body)


def test_a_chunk_being_persisted_is_not_queued_again_by_the_close(tmp_path):
    # Two persists of one chunk at once: held as one buffer, the chunk's buffer goes back to
    # the pool when the first is done, and new writes into it reach the second one's record
    # (a checksum mismatch on read). Counted here: one persist per chunk.
    data = payload(2 << 20, 40)

    async def body(store):
        ck, r, s = await new_step(store, b'{"chunk_bytes": 1048576, "writeback_bytes": 16777216, "seal_after": 0}')
        f = await ck.create(s.id, b"model", FILE)
        await ck.write(f, 0, data[:1 << 20])  # a full chunk: queued, persisted at once
        for _ in range(1000):
            if f.mem[0].busy is not None:
                break
            await trio.sleep(0)
        assert f.mem[0].busy is not None
        ck.flushed(f)  # the close while the chunk is being persisted
        ck.released(f, write=True)
        g = await ck.create(s.id, b"optim", FILE)
        await ck.write(g, 0, data[1 << 20:])  # into a buffer the first chunk may give back
        ck.flushed(g)
        ck.released(g, write=True)
        await ck.sync_dir(s)
        assert ck.counters["chunks_persisted"] == 2
        assert await read_all(ck, f) == data[:1 << 20]
        assert await read_all(ck, g) == data[1 << 20:]

    run(tmp_path / "s", body)

"""A buffer's rows (distorefs/rows.py): the fields of narrow entries kept by slot, filled
when an entry commits or from a verified read, never stale after an eviction or a
rewrite, their bytes reserved from the memory tier's budget; a client's draw of such a
buffer answers with them."""

from __future__ import annotations

import io

import numpy as np
import trio

from distorefs import clientwire as wire
from distorefs.cache import ValueCache
from distorefs.client.buffer import stack_rows
from distorefs.layout import Layout, parse
from distorefs.owner import Owner
from distorefs.rows import ROW_MAX_BYTES, SlotRows
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
DIR = Owner(0o40755, 1000, 1000)


def transition(i: int, width: int = 8) -> bytes:
    out = io.BytesIO()
    np.savez(out, obs=np.full(width, i, dtype=np.float32), action=np.int64(i), reward=np.float32(i / 2))
    return out.getvalue()


def expected_row(i: int, width: int = 8) -> bytes:
    return np.full(width, i, dtype=np.float32).tobytes() + np.int64(i).tobytes() + np.float32(i / 2).tobytes()


def test_slot_rows_fill_take_clear_and_their_budget():
    layout, offsets = parse(transition(3))
    cache = ValueCache(10_000)
    rows = SlotRows(layout, cache)
    assert rows.width == 44 and SlotRows.fits(layout)
    assert rows.grow(100) and cache.reserved_bytes == 4400
    rows.fill(7, transition(3), np.array(offsets))
    rows.fill(9, transition(5), np.array(offsets))
    assert rows.take(np.array([7, 9, 7])).tobytes() == expected_row(3) + expected_row(5) + expected_row(3)
    assert rows.take(np.array([7, 8])) is None  # slot 8 holds no row
    rows.clear(9)
    assert rows.take(np.array([9])) is None and rows.unfilled(np.array([7, 9])).tolist() == [9]
    assert not rows.grow(200)  # 8,800 more bytes: over half of the budget
    assert len(rows.filled) == 100 and cache.reserved_bytes == 4400
    rows.close()
    assert cache.reserved_bytes == 0
    wide = Layout("npy", (layout.fields[0].__class__("data", "|u1", (ROW_MAX_BYTES + 1,)),))
    assert not SlotRows.fits(wide) and not SlotRows.fits(None)



def test_taking_rows_gathers_them_in_c_as_numpy_does_and_refuses_an_unfilled_or_foreign_slot():
    """SlotRows.take gathers int64 slots in one C call (distorefs/_batchfill.c), other slots in
    numpy: the same rows either way, and None where a slot holds no row or is past the table."""
    layout, offsets = parse(transition(0))
    rows = SlotRows(layout, ValueCache(1 << 20))
    assert rows.grow(64)
    for slot in range(0, 64, 2):
        rows.fill(slot, transition(slot), np.array(offsets))
    slots = np.random.default_rng(1).integers(0, 32, 500) * 2
    want = b"".join(expected_row(int(s)) for s in slots)
    assert rows.take(slots.astype(np.int64)).tobytes() == want
    assert rows.take(slots.astype(np.int32)).tobytes() == want  # numpy's gather
    strided = slots.astype(np.int64)[::2]  # not contiguous: numpy's gather
    assert rows.take(strided).tobytes() == b"".join(expected_row(int(s)) for s in strided)
    assert rows.take(np.array([0, 2, 3], dtype=np.int64)) is None  # slot 3 holds no row
    assert rows.take(np.array([0, len(rows.filled)], dtype=np.int64)) is None  # past the table
    assert rows.take(np.array([0, -1], dtype=np.int64)) is None
    assert rows.take(np.zeros(0, dtype=np.int64)) is None

def test_the_memory_tier_holds_what_the_tables_leave():
    cache = ValueCache(1000)
    for key in "abc":
        cache.put(key, key.encode() * 200)
    assert cache.reserve(500)  # the LRU now holds 500 bytes at most: "a", the oldest, goes
    assert cache.peek("a") is None and cache.peek("b") is not None and cache.used_bytes == 400
    assert not cache.reserve(1)  # tables take half of the budget at most
    cache.release(500)
    cache.put("d", b"d" * 200)  # the whole budget again
    assert cache.peek("b") is not None and cache.peek("d") is not None and cache.used_bytes == 600


async def filled(store, count: int, config: bytes = b'{"presample_batches": 0}'):
    """Buffer `b` of `store` with `config` and `count` transitions k000, k001 ..."""
    buf = await store.create_buffer("b", DIR)
    await store.configure("buffers", "b", config)
    for i in range(count):
        await buf.insert(b"k%03d" % i, transition(i), OWNER)
    return buf


async def draw(session, n: int):
    op, payload = wire.split_frame(wire.draw_request(n))
    return wire.unpack_tables(await session.request(op, payload))


def test_rows_follow_commits_evictions_and_rewrites(tmp_path):
    async def body(store):
        buf = await filled(store, 15, b'{"capacity": 10, "presample_batches": 0}')  # the first five evicted
        await buf.insert(b"k012", transition(99), OWNER)  # a rewrite: its row is the new value's
        session = store.client_session(buf, OWNER)
        for _ in range(5):
            meta, t = await draw(session, 32)
            assert meta["rows"] and "locs" not in t
            batch = stack_rows(Layout.from_json(meta["layout"]), t["rows"], wire.keys_of(t), t["seqs"])
            for key, obs, action in zip(batch["keys"].tolist(), batch["obs"], batch["action"].tolist()):
                i = 99 if key == "k012" else int(key[1:])
                assert i >= 5 and action == i and (obs == i).all(), key
        assert buf.stats()["rows"]["filled"] == 10
    run(tmp_path / "s", body)


def test_rows_of_a_reopened_store_are_read_back_before_draws_answer_with_them(tmp_path):
    async def fill(store):
        await filled(store, 300)

    async def reopened(store):
        buf = store.buffers["b"]
        assert buf.stats()["rows"] is None  # nothing read at load: the table is made at the first draw
        session = store.client_session(buf, OWNER)
        meta, t = await draw(session, 16)
        assert not meta.get("rows") and "locs" in t  # values' places: the client reads them
        with trio.fail_after(10):
            while buf.stats()["rows"]["filled"] < 300:  # every row read behind, after that draw
                await trio.sleep(0.01)
        meta, t = await draw(session, 16)
        assert meta["rows"]
        batch = stack_rows(Layout.from_json(meta["layout"]), t["rows"], wire.keys_of(t), t["seqs"])
        assert all((obs == int(k[1:])).all() for k, obs in zip(batch["keys"].tolist(), batch["obs"]))

    run(tmp_path / "s", fill)
    run(tmp_path / "s", reopened)


def test_a_buffer_whose_rows_do_not_fit_keeps_none(tmp_path):
    async def body(store):
        buf = await filled(store, 40)
        assert buf.rows.table is None and buf.stats()["rows"] is None
        meta, t = await draw(store.client_session(buf, OWNER), 8)
        assert not meta.get("rows") and len(wire.keys_of(t)) == 8
    run(tmp_path / "s", body, config={"cache_bytes": 0})


def test_a_removed_buffer_gives_its_table_back(tmp_path):
    async def body(store):
        buf = await store.create_buffer("b", DIR)
        await buf.insert(b"k", transition(1), OWNER)
        cache = store.values.cache
        assert buf.rows.table is not None and cache.reserved_bytes == buf.rows.table.reserved > 0
        await buf.ring.delete(b"k")
        await store.drop_buffer("b")
        assert cache.reserved_bytes == 0
    run(tmp_path / "s", body)


def test_a_draw_of_several_batches_answers_them_together(tmp_path):
    """DRAW with `batches`: as many draws, one after another, in one answer (`sizes`), all
    held until the session's next draw; a count out of range is refused."""
    async def body(store):
        import pytest
        buf = await filled(store, 30, b'{"presample_batches": 0, "max_times_sampled": 1}')
        session = store.client_session(buf, OWNER)
        op, payload = wire.split_frame(wire.draw_request(8, batches=3))
        meta, t = wire.unpack_tables(await session.request(op, payload))
        assert meta["rows"] and t["sizes"].tolist() == [8, 8, 8] and len(session.held) == 3
        keys = wire.keys_of(t)
        assert len(set(keys)) == 24  # max_times_sampled 1: the three draws took different entries
        assert buf.stats()["batches"] == 3
        op, payload = wire.split_frame(wire.draw_request(6, batches=2))  # 6 left: one batch
        meta, t = wire.unpack_tables(await session.request(op, payload))
        assert t["sizes"].tolist() == [6] and not set(wire.keys_of(t)) & set(keys)
        import struct
        for bad in (0, wire.MAX_DRAW_BATCHES + 1):
            with pytest.raises(wire.WireError):
                wire.parse_draw(memoryview(struct.pack("<IBH", 4, 0, bad)))
    run(tmp_path / "s", body)

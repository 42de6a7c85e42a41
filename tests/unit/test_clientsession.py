"""The daemon's side of the client (distorefs/clientsession.py) without FUSE: frames in,
tables out; inserts committed in order behind their requests; spent entries kept until
the client's next request."""

from __future__ import annotations

import errno

import numpy as np
import trio

from distorefs import clientwire as wire
from distorefs.owner import Owner
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
DIR = Owner(0o40755, 1000, 1000)


async def call(session, request: bytes):
    op, payload = wire.split_frame(request)
    reply = await session.request(op, payload)
    if reply is None:
        return None
    meta, arrays = wire.unpack_tables(reply)
    return meta, wire.entry_columns(arrays)


def test_inserts_commit_in_order_and_flush_reports_failures(tmp_path):
    async def body(store):
        buf = await store.create_buffer("b", DIR)
        session = store.client_session(buf, OWNER)
        for i in range(50):
            assert await call(session, wire.insert_request(b"k%02d" % i, bytes([i]) * 300)) is None
        await call(session, wire.insert_request(b"bad/name", b"x"))
        meta, _ = await call(session, wire.frame(wire.FLUSH))
        assert meta["committed"] == 50
        assert [(e[0], e[1]) for e in meta["errors"]] == [("bad/name", errno.EINVAL)]
        assert [m.key for m in buf.ring.oldest()] == [b"k%02d" % i for i in range(50)]
        assert await buf.ring.read(buf.ring.get(b"k07")) == bytes([7]) * 300
        meta, _ = await call(session, wire.frame(wire.FLUSH))
        assert meta == {"committed": 0, "errors": []}
    run(tmp_path / "s", body)


def test_draw_tables_name_the_drawn_entries_and_locate_follows_them(tmp_path):
    async def body(store):
        buf = await store.create_buffer("b", DIR)
        for i in range(20):
            await buf.insert(b"k%d" % i, bytes([i]) * 1000, OWNER)
        session = store.client_session(buf, OWNER)
        meta, t = await call(session, wire.draw_request(8))
        keys = wire.keys_of(t)
        assert len(keys) == 8 and meta["layout"] is None  # plain bytes: raw mode
        for key, seq, size, crc in zip(keys, t["seqs"].tolist(), t["sizes"].tolist(), t["checksums"].tolist()):
            m = buf.ring.get(key)
            assert (m.seq, m.size, m.checksum) == (seq, size, crc)
        assert np.allclose(t["probabilities"], 1 / 20)
        gone, kept = keys[0], next(k for k in keys if k != keys[0])
        await buf.ring.delete(gone)
        meta, now = await call(session, wire.locate_request([buf.ring.get(kept).seq, t["seqs"][0]]))
        assert now["present"].tolist() == [True, False]
        assert wire.keys_of(now) == [kept]
    run(tmp_path / "s", body)


def test_spent_entries_go_at_the_next_request(tmp_path):
    async def body(store):
        buf = await store.create_buffer("b", DIR)
        await store.configure("buffers", "b", b'{"max_times_sampled": 1, "presample_batches": 0}')
        for i in range(10):
            await buf.insert(b"k%d" % i, bytes([i]) * 100, OWNER)
        session = store.client_session(buf, OWNER)
        _, t = await call(session, wire.draw_request(4))
        await trio.sleep(0.05)
        assert len(buf.ring) == 10  # the client is still reading them
        _, t2 = await call(session, wire.draw_request(4))
        await store.committer.drain()
        assert len(buf.ring) == 6
        assert not set(wire.keys_of(t)) & set(wire.keys_of(t2))
        session.close()
        await store.committer.drain()
        assert len(buf.ring) == 2
    run(tmp_path / "s", body)


def test_priorities_are_committed_by_flush(tmp_path):
    async def body(store):
        buf = await store.create_buffer("b", DIR)
        await store.configure("buffers", "b", b'{"sampler": "prioritized", "presample_batches": 0}')
        for i in range(4):
            await buf.insert(b"k%d" % i, bytes([i]) * 100, OWNER)
        session = store.client_session(buf, OWNER)
        await call(session, wire.priorities_request([b"k0", b"k1", b"k2", b"k3"], [0, 0, 5.0, 0]))
        meta, _ = await call(session, wire.frame(wire.FLUSH))
        assert meta == {"committed": 0, "errors": []}
        _, t = await call(session, wire.draw_request(16))
        assert set(wire.keys_of(t)) == {b"k2"}
    run(tmp_path / "s", body)


def test_priorities_by_sequence_number(tmp_path):
    """PRIORITIES_SEQS names entries by the seqs a draw gave: those still there get their
    priority, a seq no longer there is skipped and counted, a bad value fails the request."""
    async def body(store):
        import pytest

        from distorefs.errors import InvalidArgument
        buf = await store.create_buffer("b", DIR)
        await store.configure("buffers", "b", b'{"sampler": "prioritized", "presample_batches": 0}')
        for i in range(4):
            await buf.insert(b"k%d" % i, bytes([i]) * 100, OWNER)
        seqs = np.array([buf.ring.get(b"k%d" % i).seq for i in range(4)])
        await buf.ring.delete(b"k3")
        session = store.client_session(buf, OWNER)
        await call(session, wire.priorities_seqs_request(seqs, [0, 0, 5.0, 7.0]))
        meta, _ = await call(session, wire.frame(wire.FLUSH))
        assert meta == {"committed": 0, "errors": []}
        _, t = await call(session, wire.draw_request(16))
        assert set(wire.keys_of(t)) == {b"k2"}
        assert buf.stats()["priority_unknown_keys"] == 1
        with pytest.raises(InvalidArgument, match="priority of"):
            await call(session, wire.priorities_seqs_request(seqs[:2], [1.0, float("nan")]))
        with pytest.raises(wire.WireError):
            await call(session, wire.frame(wire.PRIORITIES_SEQS, b"\x00" * 12))
    run(tmp_path / "s", body)


def test_located_blocks_stay_within_their_bytes():
    """The location tables kept for a dataset's readers stay within their capacity: the
    least recently used block goes first; a block asked for again is a hit."""
    from types import SimpleNamespace

    import numpy as np

    from distorefs.clientsession import LocatedBlocks
    from distorefs.placement import TIER_LMDB
    from distorefs.values import StoredValue

    class Items:  # sealed items of one 10-byte chunk each
        def sealed_items(self, numbers):
            return [SimpleNamespace(size=10, checksum=1, chunks=[StoredValue(10, 10, 1, 0, TIER_LMDB, b"k%d" % n)])
                    for n in numbers]

    located = LocatedBlocks(capacity=200_000)
    ds = Items()
    first, _ = located.tables(ds, np.arange(0, 1000))
    for b in range(1, 10):
        located.tables(ds, np.arange(b * 1000, (b + 1) * 1000))
        assert located.used <= located.capacity
    assert located.counters == {"hits": 0, "built": 10}
    again, _ = located.tables(ds, np.arange(9000, 10000))  # the newest: kept
    assert located.counters["hits"] == 1
    located.tables(ds, np.arange(0, 1000))  # the oldest went: built again, the same tables
    assert located.counters["built"] == 11
    assert np.array_equal(located.tables(ds, np.arange(0, 1000))[0]["item_sizes"], first["item_sizes"])
    located.tables(ds, np.array([5, 3, 9]))  # not a run of numbers: made for this request alone
    assert located.counters == {"hits": 2, "built": 11} and located.used <= located.capacity

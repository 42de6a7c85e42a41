"""Spools (distorefs/backends/segments.py, distorefs/clientsession.py, distorefs/client/spool.py)
without FUSE: a client's values written to a segment of its own and adopted by the daemon
when their inserts commit; what does not describe a record there refused; damage after
the commit caught by the checksum; spooled values compacted, durable, and a spool never
adopted from collected."""

from __future__ import annotations

import errno
import io
import os

import numpy as np
import pytest
import trio

from distorefs import clientwire as wire
from distorefs.client.spool import Spool
from distorefs.errors import CorruptValue, InvalidArgument
from distorefs.owner import Owner
from distorefs.placement import TIER_NVME
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
DIR = Owner(0o40755, 1000, 1000)
KiB, MiB = 1 << 10, 1 << 20


async def wait_for(pred, timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.05)


async def call(session, request: bytes):
    op, payload = wire.split_frame(request)
    reply = await session.request(op, payload)
    return None if reply is None else wire.unpack_tables(reply)[0]


def npz(i: int) -> bytes:
    out = io.BytesIO()
    rng = np.random.default_rng(i)
    np.savez(out, obs=rng.standard_normal(16).astype(np.float32), action=np.int64(i))
    return out.getvalue()


async def spooled_buffer(store, name: str, first: bytes):
    """A buffer whose layout `first` fixed, and a session with a spool of it."""
    buf = await store.create_buffer(name, DIR)
    await buf.insert(b"first", first, OWNER)
    session = store.client_session(buf, OWNER)
    meta = await call(session, wire.frame(wire.SPOOL))
    assert meta["path"] is not None, meta
    return buf, session, Spool(meta), meta


def test_spooled_values_are_adopted_where_the_client_wrote_them(tmp_path):
    async def body(store):
        buf, session, spool, meta = await spooled_buffer(store, "b", npz(0))
        assert os.stat(meta["path"]).st_uid == OWNER.uid  # the daemon (root here) gives it to the client
        written = {b"k%02d" % i: npz(i) for i in range(1, 40)}
        for key, raw in written.items():
            assert await call(session, spool.store(key, raw)) is None
        reply = await call(session, wire.frame(wire.FLUSH))
        assert reply == {"committed": 39, "errors": []}
        assert buf.ring.counters["spooled_inserts"] == 39
        store.values.cache.resize(0)  # read from the spool, not from memory
        for key, raw in written.items():
            m = buf.ring.get(key)
            assert m.tier == TIER_NVME and await buf.ring.read(m) == raw
        batch, npz_file = await buf.sample_npz(16)  # stacked from the places the client gave
        with np.load(io.BytesIO(bytes(npz_file))) as z:
            for key, obs, action in zip(z["keys"].tolist(), z["obs"], z["action"]):
                with np.load(io.BytesIO(written.get(key.encode(), npz(0)))) as want:
                    assert np.array_equal(obs, want["obs"]) and action == want["action"]
        buf.release(batch)
        spool.close()
    run(tmp_path / "s", body, config={"lmdb_bytes": 64 * MiB})


def test_a_stored_request_that_names_no_record_is_refused(tmp_path):
    async def body(store):
        buf, session, spool, meta = await spooled_buffer(store, "b", npz(0))
        good = spool.store(b"good", npz(1))
        _op, payload = wire.split_frame(good)
        st = wire.parse_stored(payload)
        # another segment than the session's spools: the write itself fails (EINVAL)
        with pytest.raises(InvalidArgument):
            await call(session, wire.stored_request(b"x1", st.segment + 100, st.offset, st.size, st.stored_size,
                                                    st.checksum, st.codec, st.offsets, st.crcs))
        # no record at that offset; a record of another size; arrays outside the value
        bad = [wire.stored_request(b"x2", st.segment, st.offset + 7, st.size, st.stored_size, st.checksum,
                                   st.codec, st.offsets, st.crcs),
               wire.stored_request(b"x3", st.segment, st.offset, st.size + 1, st.stored_size + 1, st.checksum,
                                   st.codec, st.offsets, st.crcs),
               wire.stored_request(b"x4", st.segment, st.offset, st.size, st.stored_size, st.checksum, st.codec,
                                   [st.size, 0], st.crcs),
               wire.stored_request(b"x5", st.segment, 1 << 40, st.size, st.stored_size, st.checksum, st.codec,
                                   st.offsets, st.crcs)]
        for request in bad:
            assert await call(session, request) is None
        assert await call(session, good) is None
        reply = await call(session, wire.frame(wire.FLUSH))
        assert reply["committed"] == 1
        assert sorted((e[0], e[1]) for e in reply["errors"]) == [(k, errno.EINVAL) for k in ("x2", "x3", "x4", "x5")]
        assert sorted(buf.ring.by_key) == [b"first", b"good"]
        assert await buf.ring.read(buf.ring.get(b"good")) == npz(1)
        spool.close()
    run(tmp_path / "s", body)


def test_a_spooled_value_damaged_after_its_commit_fails_its_checksum(tmp_path):
    async def body(store):
        buf, session, spool, meta = await spooled_buffer(store, "b", npz(0))
        raw = npz(5)
        await call(session, spool.store(b"v", raw))
        assert (await call(session, wire.frame(wire.FLUSH)))["committed"] == 1
        with open(meta["path"], "r+b") as f:  # the client's own file: it can write it
            data = f.read()
            at = data.find(raw[200:240])
            f.seek(at)
            f.write(bytes([data[at] ^ 0xFF]))
        store.values.cache.resize(0)
        with pytest.raises(CorruptValue):
            await buf.ring.read(buf.ring.get(b"v"))
        spool.close()
    run(tmp_path / "s", body)


def test_spooled_values_are_compacted_and_survive_a_reopen(tmp_path):
    sizes: dict[bytes, bytes] = {}

    async def fill(store):
        buf = await store.create_buffer("rb", DIR)
        await store.configure_buffer("rb", b'{"compression": "none", "capacity": 100000, "raw": true}')
        session = store.client_session(buf, OWNER)
        meta = await call(session, wire.frame(wire.SPOOL))
        spool = Spool(meta)
        for i in range(120):  # 120 x 40 KB spread over spools of 1 MB
            if spool.full:
                spool.close()
                spool = Spool(await call(session, wire.frame(wire.SPOOL)))
            value = bytes([i % 251]) * (40 * KiB)
            await call(session, spool.store(b"e%d" % i, value))
            sizes[b"e%d" % i] = value
        assert (await call(session, wire.frame(wire.FLUSH)))["committed"] == 120
        spools = list(session.spools)
        assert len(spools) >= 4
        spool.close()
        session.close()  # its spools age as any segment now
        assert not set(spools) & store.values.nvme.current_segments()
        for i in range(0, 120, 3):
            for j in (i, i + 1):
                await buf.ring.delete(b"e%d" % j)
                del sizes[b"e%d" % j]
        store.values.cache.resize(0)
        nvme = store.values.nvme
        await wait_for(lambda: store.mover.counters["compacted_segments"] >= 2)
        await wait_for(lambda: nvme.usage().used_bytes <= store.config.max_space_overhead * nvme.usage().live_bytes)
        for key, value in sizes.items():
            assert await buf.ring.read(buf.ring.get(key)) == value

    async def reopened(store):
        buf = store.buffers["rb"]
        assert sorted(buf.ring.by_key) == sorted(sizes)
        for key, value in sizes.items():
            assert await buf.ring.read(buf.ring.get(key)) == value
        session = store.client_session(buf, OWNER)
        meta = await call(session, wire.frame(wire.SPOOL))  # a spool never adopted from
        session.close()
        return meta["segment"]

    config = {"lmdb_bytes": 0, "sync_interval": 0.05, "segment_bytes": MiB}
    run(tmp_path / "s", fill, config=config)
    unused = run(tmp_path / "s", reopened, config=config)

    async def collected(store):
        await trio.to_thread.run_sync(store.values.nvme.collect)
        assert store.values.nvme.path_of(unused) is None

    run(tmp_path / "s", collected, config=config)


def test_no_spool_for_a_buffer_without_a_layout_yet_or_a_read_only_session(tmp_path):
    async def body(store):
        buf = await store.create_buffer("b", DIR)
        session = store.client_session(buf, OWNER)
        meta = await call(session, wire.frame(wire.SPOOL))
        assert meta["path"] is None and meta["later"] is True
        await buf.insert(b"first", npz(0), OWNER)
        assert (await call(session, wire.frame(wire.SPOOL)))["path"] is not None
        session.read_only = True
        meta = await call(session, wire.frame(wire.SPOOL))
        assert meta["path"] is None and meta["later"] is False
        session.close()
    run(tmp_path / "s", body)


def test_an_array_entry_is_the_npy_np_save_writes():
    """encode_entry makes an array's .npy itself (its header once per dtype and shape):
    byte for byte what np.save writes, for every kind of array (the ones it leaves to
    np.save included: Fortran order, strided, structured)."""
    import io

    import numpy as np

    from distorefs.client.buffer import encode_entry

    def saved(a):
        out = io.BytesIO()
        np.save(out, a, allow_pickle=False)
        return out.getvalue()

    for a in [np.arange(113 * 1024, dtype=np.uint8), np.zeros((3, 4), np.float32), np.array(5, np.int64),
              np.zeros((0,), np.float64), np.ones((2, 3), dtype=">i4"), np.array([True, False]),
              np.asfortranarray(np.ones((3, 4))), np.arange(12)[::2], np.array(["ab", "c"]),
              np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]), np.zeros((2, 2), np.complex64)]:
        assert encode_entry(a) == saved(a), (a.dtype, a.shape)

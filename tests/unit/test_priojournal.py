"""A buffer's priority updates as the catalog keeps them (distorefs/priojournal.py): one
journal record per `priorities` write, folded into a snapshot from memory once the journal
holds as many updates as the buffer has entries; what a reopened store loads is the last
priority each entry was given, whatever was folded, removed or dropped in between."""

import lmdb
import numpy as np
import pytest

import distorefs.buffer as buffer_module
from distorefs import priojournal
from distorefs.catalog import DB_META, DB_PRIO, FORMAT_VERSION, pack_u32
from distorefs.errors import ReadOnly
from distorefs.owner import Owner
from distorefs.priojournal import DB_PRIOLOG, DB_PRIOSNAP
from distorefs.store import Store
from distorefs.verify import EXIT_CLEAN, EXIT_PROBLEMS, EXIT_REPAIRED, verify_store
from store_runner import run

DIR = Owner(0o40755, 0, 0)
FILE = Owner(0o100644, 0, 0)


def rows(path, db: bytes) -> dict[bytes, bytes]:
    env = lmdb.open(str(path / "meta"), max_dbs=32, subdir=True, readonly=True, lock=False)
    try:
        handle = env.open_db(db, create=False)
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=handle)}
    finally:
        env.close()


def priorities(path, name="replay") -> dict[bytes, float]:
    async def body(store):
        buf = store.buffer(name)
        return {m.key: float(buf.sampler.priority[m.slot]) for m in buf.ring.oldest()}
    return run(path, body)


def fill(path, n: int) -> None:
    async def body(store):
        buf = await store.create_buffer("replay", DIR)
        for i in range(n):
            await buf.insert(b"k%03d" % i, bytes([i % 256]) * 100, FILE)
    run(path, body)


def test_a_priorities_write_is_one_journal_record_not_a_row_per_entry(tmp_path):
    fill(tmp_path / "s", 100)
    prio_rows = len(rows(tmp_path / "s", DB_PRIO))  # one per entry, written at its insert

    async def body(store):
        buf = store.buffer("replay")
        await buf.set_priorities([(b"k%03d" % i, 1.0 + i) for i in range(64)])
        await buf.set_priorities([(b"k%03d" % i, 100.0 + i) for i in range(0, 64, 2)])
    run(tmp_path / "s", body)
    assert len(rows(tmp_path / "s", DB_PRIO)) == prio_rows  # none rewritten
    journal = rows(tmp_path / "s", DB_PRIOLOG)
    assert [len(priojournal.unpack(v)) for v in journal.values()] == [64, 32]
    got = priorities(tmp_path / "s")
    assert got[b"k001"] == 2.0 and got[b"k002"] == 102.0 and got[b"k063"] == 64.0  # the last write holds
    assert got[b"k064"] == got[b"k099"]  # never set: the insert's priority


def test_the_journal_is_folded_into_a_snapshot_and_loads_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(buffer_module, "SNAPSHOT_UPDATES", 200)
    fill(tmp_path / "s", 100)
    expected: dict[bytes, float] = {}

    async def body(store):
        buf = store.buffer("replay")
        rng = np.random.default_rng(5)
        for step in range(40):  # 40 x 20 updates: several snapshots, then records after the last
            keys = rng.choice(100, 20, replace=False)
            pairs = [(b"k%03d" % k, float(step * 100 + k)) for k in keys]
            await buf.set_priorities(pairs)
            expected.update(pairs)
            if step == 25:
                await buf.ring.delete(b"k007")  # removed between snapshots: not brought back
        expected.pop(b"k007", None)  # (later writes naming it skip it: no such entry)
        await store.committer.drain()
        return buf.counters["priority_snapshots"]
    snapshots = run(tmp_path / "s", body)
    assert snapshots >= 3
    journal = rows(tmp_path / "s", DB_PRIOLOG)
    assert 0 < len(journal) <= 200 // 20 + 1  # the records before the last snapshot went
    assert rows(tmp_path / "s", DB_PRIOSNAP)
    got = priorities(tmp_path / "s")
    assert b"k007" not in got and len(got) == 99
    for key, value in expected.items():
        assert got[key] == value, key
    assert verify_store(tmp_path / "s").exit_code == EXIT_CLEAN


def test_numbers_go_on_after_a_reopen(tmp_path):
    fill(tmp_path / "s", 10)

    async def set_one(store, value=1.0):
        await store.buffer("replay").set_priorities([(b"k001", value)])
    run(tmp_path / "s", set_one)
    run(tmp_path / "s", lambda store: set_one(store, 7.5))  # a second run's record comes after the first's
    assert len(rows(tmp_path / "s", DB_PRIOLOG)) == 2
    assert priorities(tmp_path / "s")[b"k001"] == 7.5


def test_a_dropped_buffer_leaves_no_journal(tmp_path, monkeypatch):
    monkeypatch.setattr(buffer_module, "SNAPSHOT_UPDATES", 4)

    async def body(store):
        buf = await store.create_buffer("gone", DIR)
        await buf.insert(b"a", b"x", FILE)
        for i in range(6):
            await buf.set_priorities([(b"a", float(i))])
        await store.committer.drain()
        await buf.ring.delete(b"a")
        await store.drop("buffers", "gone")
    run(tmp_path / "s", body)
    assert rows(tmp_path / "s", DB_PRIOLOG) == {} and rows(tmp_path / "s", DB_PRIOSNAP) == {}


def test_verify_repairs_journal_rows_of_no_buffer_and_bad_priorities(tmp_path):
    fill(tmp_path / "s", 4)
    run(tmp_path / "s", lambda store: store.buffer("replay").set_priorities([(b"k001", 3.0)]))
    env = lmdb.open(str(tmp_path / "s" / "meta"), max_dbs=32, subdir=True)
    log, snap = env.open_db(DB_PRIOLOG), env.open_db(DB_PRIOSNAP)
    with env.begin(write=True) as txn:
        txn.put(b"\x00\x00\x00\x63" + bytes(8), priojournal.pack(np.array([1]), np.array([1.0])), db=log)
        txn.put(b"\x00\x00\x00\x01" + (1 << 40).to_bytes(8, "big"),
                priojournal.pack(np.array([2]), np.array([float("nan")])), db=log)
        txn.put(b"\x00\x00\x00\x01" + bytes(4), b"not pairs", db=snap)
    env.close()
    report = verify_store(tmp_path / "s")
    assert report.exit_code == EXIT_PROBLEMS
    assert len([f for f in report.problems if f.check == "priority-journal"]) == 3, report.problems
    assert verify_store(tmp_path / "s", repair=True).exit_code == EXIT_REPAIRED
    assert verify_store(tmp_path / "s").exit_code == EXIT_CLEAN
    assert priorities(tmp_path / "s")[b"k001"] == 3.0  # the good record stays


def test_a_format_2_store_is_upgraded_and_refused_read_only_before(tmp_path):
    fill(tmp_path / "s", 3)
    env = lmdb.open(str(tmp_path / "s" / "meta"), max_dbs=32, subdir=True)
    meta, gone = env.open_db(DB_META), [env.open_db(name) for name in (DB_PRIOLOG, DB_PRIOSNAP)]
    with env.begin(write=True) as txn:
        txn.put(b"format", pack_u32(2), db=meta)
        for db in gone:  # a format-2 store never had them
            txn.drop(db, delete=True)
    env.close()
    with pytest.raises(ReadOnly, match="format 2"):
        Store(tmp_path / "s", read_only=True)
    run(tmp_path / "s", lambda store: store.buffer("replay").set_priorities([(b"k002", 9.0)]))
    assert rows(tmp_path / "s", DB_META)[b"format"] == pack_u32(FORMAT_VERSION) == pack_u32(3)
    Store(tmp_path / "s", read_only=True).close()
    assert priorities(tmp_path / "s")[b"k002"] == 9.0

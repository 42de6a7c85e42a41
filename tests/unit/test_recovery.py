"""Recovery at open, as a library: a store left open by a crash is checked and repaired
before it opens (and says so in its stats), one that cannot be repaired is not opened,
and a cleanly closed store opens without any of it."""

import json
import multiprocessing
import os
import struct

import lmdb
import numpy as np
import pytest

from distorefs.catalog import DB_NS, DB_PRIO, entry_key, pack_f64
from distorefs.errors import RecoveryFailed
from distorefs.owner import Owner
from distorefs.store import Store
from distorefs.verify import EXIT_PROBLEMS, EXIT_REPAIRED, verify_store
from store_runner import run

DIR = Owner(0o40755, 0, 0)
FILE = Owner(0o100644, 0, 0)
BIG = np.random.default_rng(3).integers(0, 256, 700 << 10, dtype=np.uint8).tobytes()  # a segment value
CONFIG = {"segment_bytes": 1 << 20}


def build(path) -> None:
    async def body(store):
        buf = await store.create_buffer("replay", DIR)
        for i in range(10):
            await buf.insert(b"k%d" % i, bytes([i]) * (2000 + i), FILE)
        await buf.insert(b"big", BIG, FILE)
        await buf.set_priorities([(b"k1", 4.0)])
    run(path, body, config=CONFIG)


def lock_text(path) -> str:
    return (path / "lock").read_text()


def crash_marker(path, text="pid 999999") -> None:
    """What a daemon killed with the store open leaves in the lock file."""
    (path / "lock").write_text(text + "\n")


def damage_repairably(path) -> None:
    """A priority row of no entry and a segment accounting row that is off by one record."""
    env = lmdb.open(str(path / "meta"), max_dbs=32, subdir=True)
    prio, segments = env.open_db(DB_PRIO), env.open_db(b"segments")
    with env.begin(write=True) as txn:
        txn.put(entry_key(1, 4242), pack_f64(1.0), db=prio)
        key, value = next(iter(txn.cursor(db=segments)))
        live, total, n, stream = struct.unpack("<QQQI", value)
        txn.put(key, struct.pack("<QQQI", live + 10, total, n + 1, stream), db=segments)
    env.close()


def contents(path) -> dict:
    async def body(store):
        buf = store.buffer("replay")
        return {m.key: await buf.ring.read(m) for m in buf.ring.oldest()}
    return run(path, body)


def test_clean_close_leaves_the_lock_empty_and_reopens_without_recovery(tmp_path):
    build(tmp_path / "s")
    assert lock_text(tmp_path / "s") == ""
    store = Store(tmp_path / "s")
    try:
        assert lock_text(tmp_path / "s") == f"pid {os.getpid()}\n"  # held: marked
        assert store.recovery.ran is False
        assert store.stats()["recovery"]["ran"] is False
    finally:
        store.close()
    assert lock_text(tmp_path / "s") == ""


def _open_and_die(path) -> None:
    async def body(store):
        buf = await store.create_buffer("replay", DIR)
        await buf.insert(b"k0", b"zero", FILE)
        await buf.insert(b"big", BIG, FILE)
        await store.sync()
        await buf.insert(b"late", BIG[::-1], FILE)  # committed, maybe not synced
        os._exit(0)  # no close: as kill -9
    run(path, body, config=CONFIG)


def test_a_process_that_died_with_the_store_open_is_recovered(tmp_path):
    proc = multiprocessing.get_context("fork").Process(target=_open_and_die, args=(tmp_path / "s",))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert lock_text(tmp_path / "s") == f"pid {proc.pid}\n"
    store = Store(tmp_path / "s")
    try:
        rec = store.stats()["recovery"]
        assert rec["ran"] is True and rec["previous_holder"] == f"pid {proc.pid}"
        assert "values" not in rec["passes"] and {"ring-indexes", "segments"} <= set(rec["passes"])
        assert rec["problems"] == rec["unrepaired"] == rec["blocking"] == 0, rec["findings"]
        assert rec["seconds"] >= 0
    finally:
        store.close()
    assert contents(tmp_path / "s") == {b"k0": b"zero", b"big": BIG, b"late": BIG[::-1]}


def test_recovery_repairs_what_a_crash_left_and_reports_it(tmp_path, caplog):
    build(tmp_path / "s")
    before = contents(tmp_path / "s")
    damage_repairably(tmp_path / "s")
    crash_marker(tmp_path / "s")
    with caplog.at_level("WARNING", logger="distorefs.recovery"):
        store = Store(tmp_path / "s")
    try:
        rec = store.stats()["recovery"]
        assert rec["ran"] and rec["previous_holder"] == "pid 999999"
        assert rec["problems"] == rec["repaired"] == 2 and rec["unrepaired"] == 0, rec["findings"]
        assert any(line.startswith("ring-indexes: error") and "repaired" in line for line in rec["findings"])
        assert any(line.startswith("segments: error") and "repaired" in line for line in rec["findings"])
    finally:
        store.close()
    assert any("not closed cleanly (pid 999999)" in r.getMessage() for r in caplog.records)
    assert lock_text(tmp_path / "s") == ""
    assert verify_store(tmp_path / "s").exit_code == 0  # nothing left to find
    assert contents(tmp_path / "s") == before
    store = Store(tmp_path / "s")  # closed cleanly since: no recovery
    try:
        assert store.recovery.ran is False
    finally:
        store.close()


def test_an_unrepairable_store_is_not_opened_until_it_is_fixed(tmp_path):
    build(tmp_path / "s")
    env = lmdb.open(str(tmp_path / "s" / "meta"), max_dbs=32, subdir=True)
    ns = env.open_db(DB_NS)
    with env.begin(write=True) as txn:
        txn.put(b"buffers/broken", b"{not json", db=ns)  # nothing can repair this
    env.close()
    crash_marker(tmp_path / "s")
    for _ in range(2):  # refused, and the next attempt recovers (and refuses) again
        with pytest.raises(RecoveryFailed) as info:
            Store(tmp_path / "s")
        message = str(info.value)
        assert "namespace buffers/broken" in message and "not closed cleanly (pid 999999)" in message
        assert f"distorefs verify --repair {tmp_path / 's'}" in message
        assert lock_text(tmp_path / "s") == "pid 999999\n"
    # verify names it; neither a check nor a repair that cannot fix it marks the store clean
    assert verify_store(tmp_path / "s").exit_code == EXIT_PROBLEMS
    assert lock_text(tmp_path / "s") == "pid 999999\n"
    report = verify_store(tmp_path / "s", repair=True)
    assert report.exit_code == EXIT_PROBLEMS and report.blocking
    assert lock_text(tmp_path / "s") == "pid 999999\n"
    with pytest.raises(RecoveryFailed):
        Store(tmp_path / "s")
    # once the record is gone (by hand here), the store opens, recovered
    env = lmdb.open(str(tmp_path / "s" / "meta"), max_dbs=32, subdir=True)
    ns = env.open_db(DB_NS)
    with env.begin(write=True) as txn:
        txn.delete(b"buffers/broken", db=ns)
    env.close()
    store = Store(tmp_path / "s")
    try:
        assert store.recovery.ran and store.recovery.blocking == 0
        assert sorted(store.buffers) == ["replay"]
    finally:
        store.close()


def test_verify_repair_recovers_a_crashed_store_a_plain_verify_does_not(tmp_path):
    build(tmp_path / "s")
    damage_repairably(tmp_path / "s")
    crash_marker(tmp_path / "s")
    assert verify_store(tmp_path / "s").exit_code == EXIT_PROBLEMS
    assert lock_text(tmp_path / "s") == "pid 999999\n"  # a check changes nothing
    assert verify_store(tmp_path / "s", repair=True).exit_code == EXIT_REPAIRED
    assert lock_text(tmp_path / "s") == ""  # recovered by verify: the mount need not
    store = Store(tmp_path / "s")
    try:
        assert store.recovery.ran is False
    finally:
        store.close()


def test_lost_values_do_not_keep_a_store_from_opening(tmp_path):
    """A segment file gone (lost disk cache): reads of its values fail with EIO and `rm`
    through the mount drops them, so recovery reports it and the store still opens."""
    build(tmp_path / "s")
    for seg in (tmp_path / "s" / "segments").glob("seg-*.dat"):
        seg.unlink()
    crash_marker(tmp_path / "s")
    store = Store(tmp_path / "s")
    try:
        rec = store.recovery.as_dict()
        assert rec["ran"] and rec["unrepaired"] == 1 and rec["blocking"] == 0
        assert "segment" in rec["findings"][0] and "missing" in rec["findings"][0]
        assert json.loads(json.dumps(store.stats()))["recovery"] == rec
    finally:
        store.close()

    async def drop(store):
        buf = store.buffer("replay")
        await buf.ring.delete(b"big")
        assert len(buf.ring) == 10
    run(tmp_path / "s", drop)

"""Snapshots and trimming of the shared store's log on a real Redis Cluster, without FUSE
(distorefs/logsnapshot.py): what is trimmed and when, installs that race, and what a
snapshot keeps of the file trees' records."""

from __future__ import annotations

import time

import pytest

from distorefs.clusterlog import Insert, Record, SharedLog, id_tuple
from distorefs.logsnapshot import LogSnapshots, tree_records
from distorefs.owner import Owner

OWNER = Owner(0o100644, 0, 0)
_stores = iter(range(1000))


@pytest.fixture
def shared(redis_engine) -> SharedLog:
    return SharedLog(redis_engine, f"snap{next(_stores)}")


def _fill(log: SharedLog, n: int) -> list[bytes]:
    log.create("buffers", "b", {"capacity": 1000, "max_bytes": 0}, OWNER, 1)
    return log.insert("buffers", "b", [Insert(b"k%d" % i, 1, b"v", b"", OWNER, 1, None) for i in range(n)])


def _first(snaps: LogSnapshots) -> tuple[int, int]:
    first = snaps.engine.on_master(snaps.log_key, lambda p: p.xrange(snaps.log_key, "-", "+", count=1),
                                   durable=False)[0]
    return id_tuple(first[0][0])


def test_nothing_is_trimmed_before_a_snapshot(shared):
    ids = _fill(shared, 10)
    snaps = LogSnapshots(shared)
    info, pos = snaps.register("n1", None)
    assert (info.n, info.at, pos) == (0, b"", b"0-0")
    rep = snaps.report("n1", ids[-1], 60)
    assert (rep.trimmed, rep.n, rep.length) == (b"0-0", 0, 11)


def test_the_log_is_trimmed_up_to_the_snapshot_and_the_slowest_live_node(shared):
    ids = _fill(shared, 10)
    snaps = LogSnapshots(shared)
    snaps.register("fast", ids[-1])
    snaps.register("slow", ids[3])
    assert snaps.write(1, [{b"op": b"create", b"ns": b"buffers/b"}]) == 1
    assert snaps.install(1, ids[7], "fast", 1, 60)
    # the slow node still needs what follows ids[3]
    assert snaps.info().trimmed == ids[3]
    assert _first(snaps) == id_tuple(ids[4])
    # it catches up: trimmed to the snapshot, not past it
    rep = snaps.report("slow", ids[-1], 60)
    assert rep.trimmed == ids[7] and rep.length == 2 and rep.n == 1 and rep.records == 1
    assert _first(snaps) == id_tuple(ids[8])


def test_a_silent_node_holds_the_log_back_only_for_the_node_timeout(shared):
    ids = _fill(shared, 6)
    snaps = LogSnapshots(shared)
    snaps.register("gone", ids[1])
    snaps.write(1, [])
    snaps.install(1, ids[4], "live", 0, 60)
    assert snaps.info().trimmed == ids[1]
    time.sleep(0.3)
    assert snaps.report("live", ids[-1], 0.2).trimmed == ids[4]
    # it comes back: its position is behind the trim, and it is not registered
    info, _ = snaps.register("gone", ids[1])
    assert id_tuple(ids[1]) < id_tuple(info.trimmed)
    assert snaps.report("live", ids[-1], 60).trimmed == ids[4]


def test_an_install_that_raced_another_is_refused_and_its_stream_dropped(shared):
    ids = _fill(shared, 3)
    snaps = LogSnapshots(shared)
    snaps.write(1, [{b"op": b"x"}])
    assert snaps.install(1, ids[0], "a", 1, 60)
    snaps.write(1, [{b"op": b"y"}])  # another node, from the same snapshot before
    assert not snaps.install(1, ids[1], "b", 1, 60)
    assert snaps.info().at == ids[0]
    for n in (2, 3):
        snaps.write(n, [{b"op": b"z"}])
        assert snaps.install(n, ids[n - 1], "a", 1, 60)
    # the one before is kept for nodes still loading it; the one before that is gone
    assert snaps.exists(snaps.stream_key(2)) and not snaps.exists(snaps.stream_key(1))
    assert [r.op for r in snaps.read(snaps.info().stream)] == ["z"]


def test_a_lease_is_held_by_one_node_at_a_time(shared):
    snaps = LogSnapshots(shared)
    assert snaps.lease("a") and not snaps.lease("b")
    snaps.release("b")  # not b's: stays
    assert not snaps.lease("b")
    snaps.release("a")
    assert snaps.lease("b")


def test_reading_a_range_in_chunks(shared):
    ids = _fill(shared, 25)
    snaps = LogSnapshots(shared)
    got = [r.id for r in snaps.read(snaps.log_key, ids[2], ids[20], count=4)]
    assert got == ids[3:21]


def _rec(op: str, ns: str, **fields: bytes) -> Record:
    return Record.of(b"1-0", {b"op": op.encode(), b"ns": ns.encode(), **{k.encode(): v for k, v in fields.items()}})


def test_a_snapshot_keeps_the_trees_records_less_the_removed_steps():
    recs = [
        _rec("insert", "buffers/b", key=b"k"),
        _rec("wpublish", "weights/m", version=b'{"number": 1}'),
        _rec("wpublish", "weights/m", version=b'{"number": 2}'),
        _rec("cstep", "checkpoints/r/s1", origin=b"n1", nonce=b"x1"),
        _rec("dpart", "datasets/d", export=b"e"),
        _rec("cstep", "checkpoints/r/s2", origin=b"n1", nonce=b"x2"),
        _rec("cremove", "checkpoints/r/s1", origin=b"n1", nonce=b"x1"),
        _rec("cstep", "checkpoints/r/s1", origin=b"n2", nonce=b"x1"),  # another node's export
        _rec("dseal", "datasets/d", export=b"e"),
    ]
    kept = [(f[b"op"], f[b"ns"]) for f in tree_records(recs)]
    assert kept == [(b"wpublish", b"weights/m"), (b"dpart", b"datasets/d"), (b"cstep", b"checkpoints/r/s2"),
                    (b"cstep", b"checkpoints/r/s1"), (b"dseal", b"datasets/d")]

"""The shared store's log on a real Redis Cluster, without FUSE: the scripts that decide
global FIFO eviction (distorefs/clusterlog.py), record by record."""

from __future__ import annotations


import pytest

from distorefs.clusterlog import Insert, SharedLog, id_tuple
from distorefs.errors import AlreadyExists, NotEmpty, NotFound
from distorefs.owner import Owner

OWNER = Owner(0o100644, 0, 0)


@pytest.fixture(scope="module")
def shared(redis_engine):
    return SharedLog(redis_engine, "unit")


def _insert(log: SharedLog, name: str, *keys: bytes, size: int = 10) -> list[bytes]:
    return log.insert("buffers", name, [Insert(k, size, b"v" + k, b"", OWNER, 1, None) for k in keys])


def _records(log: SharedLog, after: bytes = b"0-0"):
    out = []
    while True:
        got = log.read(after, 100, 0) if after != b"$" else []
        if not got:
            return out
        out += got
        after = got[-1].id


def test_fifo_capacity_rewrite_and_delete(shared):
    config = {"capacity": 3, "max_bytes": 0}
    start = shared.head()
    shared.create("buffers", "fifo", config, OWNER, 1)
    with pytest.raises(AlreadyExists):
        shared.create("buffers", "fifo", config, OWNER, 1)
    _insert(shared, "fifo", b"a", b"b", b"c")
    _insert(shared, "fifo", b"b")  # a rewrite: keeps its seq and its place in the FIFO
    shared.delete("buffers", "fifo", b"c")  # leaves a leftover in the FIFO, skipped later
    with pytest.raises(NotFound):
        shared.delete("buffers", "fifo", b"c")
    ids = _insert(shared, "fifo", b"d", b"e", b"f")
    assert [id_tuple(i) for i in ids] == sorted(id_tuple(i) for i in ids)
    recs = [r for r in _records(shared, start) if r.name == "fifo"]
    inserts = [r for r in recs if r.op == "insert"]
    seqs = {bytes(r.fields[b"key"]): int(r.fields[b"seq"]) for r in inserts}
    assert seqs == {b"a": 1, b"b": 2, b"c": 3, b"d": 4, b"e": 5, b"f": 6}
    evicted = [e for r in inserts for e in r.evicted()]
    # a, b, c, d, e, f with c deleted and capacity 3: after f the live ones are d, e, f
    assert evicted == [(1, b"a"), (2, b"b")], evicted
    with pytest.raises(NotEmpty):
        shared.drop("buffers", "fifo")
    # a lower capacity evicts the oldest at once, in the configure record
    rid = shared.configure("buffers", "fifo", {"capacity": 1, "max_bytes": 0})
    rec = [r for r in _records(shared, start) if r.id == rid][0]
    assert rec.evicted() == [(4, b"d"), (5, b"e")]


def test_max_bytes_evicts_down_to_it(shared):
    shared.create("buffers", "bytes", {"capacity": 100, "max_bytes": 25}, OWNER, 1)
    start = shared.head()
    _insert(shared, "bytes", b"x", b"y", size=10)
    _insert(shared, "bytes", b"z", size=10)  # 30 > 25: x goes
    recs = [r for r in _records(shared, start) if r.op == "insert"]
    assert [e for r in recs for e in r.evicted()] == [(1, b"x")]


def test_priorities_and_layout_records(shared):
    shared.create("buffers", "prio", {"capacity": 10, "max_bytes": 0}, OWNER, 1)
    start = shared.head()
    shared.priorities("buffers", "prio", [(b"k1", 2.5), (b"k \xff", 0.0)])
    shared.set_layout("buffers", "prio", None)
    recs = _records(shared, start)
    assert recs[0].op == "priorities" and recs[0].priorities() == [(b"k1", 2.5), (b"k \xff", 0.0)]
    assert recs[1].op == "layout"
    with pytest.raises(NotFound):
        shared.priorities("buffers", "nothere", [(b"k", 1.0)])


def test_draws_counted_against_the_global_limit(shared):
    """max_times_sampled across nodes: a batch is counted whole or not at all, and an entry
    drawn to the limit (by any node) or gone is refused by name."""
    shared.create("buffers", "limit", {"capacity": 2, "max_bytes": 0}, OWNER, 1)
    _insert(shared, "limit", b"a", b"b")
    a, b = (1, b"a"), (2, b"b")
    assert shared.claim_draws("buffers", "limit", 3, [a, b, a]) == (True, [1, 1, 2])
    # node 2 draws a twice more: its count would be 4 > 3; nothing of this batch counts, and
    # the answer says a stands at 2 (one draw left: the node may still hand it out once)
    assert shared.claim_draws("buffers", "limit", 3, [b, a, a]) == (False, [1, 2])
    assert shared.claim_draws("buffers", "limit", 3, [b, a]) == (True, [2, 3])
    assert shared.claim_draws("buffers", "limit", 3, [a]) == (False, [1, 3])
    # a key put again under another seq is not the entry drawn (gone: the limit)
    shared.delete("buffers", "limit", b"b", 2)
    _insert(shared, "limit", b"b")
    assert shared.claim_draws("buffers", "limit", 3, [b]) == (False, [2, 3])
    assert shared.claim_draws("buffers", "limit", 3, [(3, b"b")]) == (True, [1])
    # an eviction forgets the count: c evicts a (capacity 2), a's count goes with it
    _insert(shared, "limit", b"c")
    assert shared.claim_draws("buffers", "limit", 3, [a]) == (False, [1, 3])
    times = f"{shared.tag}:times:buffers/limit".encode()
    assert sorted(shared.engine.on_master(times, lambda p: p.hkeys(times))[0]) == [b"3"]


def test_a_delete_names_the_seq_it_means(shared):
    """A spent entry's delete carries its seq: an entry inserted under the key since stays."""
    shared.create("buffers", "spent", {"capacity": 10, "max_bytes": 0}, OWNER, 1)
    _insert(shared, "spent", b"k")
    shared.delete("buffers", "spent", b"k", 1)
    _insert(shared, "spent", b"k")  # seq 2
    with pytest.raises(NotFound):
        shared.delete("buffers", "spent", b"k", 1)
    start = shared.head()
    shared.delete("buffers", "spent", b"k", 2)
    assert [(r.op, int(r.fields[b"seq"])) for r in _records(shared, start)] == [("delete", 2)]


def test_cluster_values_deleted_in_the_background(shared):
    """A value's delete is queued (a record decided it: no round trip inside the node's
    write transaction) and done by the tier's own thread; close() finishes the queue."""
    from distorefs.backends.errors import Missing
    from distorefs.backends.redisengine import ClusterValues
    tier = ClusterValues(shared.engine, "{unit}:del")
    locs = tier.put_many([b"a" * 100, b"b" * 100, b"c" * 100])
    for loc in locs[:2]:
        tier.delete(None, loc)
    tier.close()
    for loc in locs[:2]:
        with pytest.raises(Missing):
            tier.get(loc)
    assert tier.get(locs[2]) == b"c" * 100
    tier.delete(None, locs[2])  # after close: at once
    with pytest.raises(Missing):
        tier.get(locs[2])


def test_a_write_its_replicas_were_slow_to_take_is_not_made_twice(redis_engine, monkeypatch):
    """A write that ran on its master but whose WAIT came back short (the replica slow under
    load) used to be retried whole: a script ran again, and a batch's draws were counted
    twice (an entry handed out 2 times reached max_times_sampled 3). Now only the WAIT is
    repeated, and past the deadline the write fails as not replicated, made once."""
    from distorefs.backends import redisengine
    from distorefs.backends.errors import Unavailable
    from distorefs.backends.redisengine import ClusterEngine
    engine = ClusterEngine(redis_engine.url, wait_replicas=1, deadline=1.0)
    try:
        monkeypatch.setattr(redisengine, "WAIT_MS", 50)  # (this cluster has no replicas: WAIT gives 0)
        monkeypatch.setattr(engine, "live_replicas", lambda master: 1)  # as if one were there, lagging
        key = b"{unit}:made-once"
        engine.rc.delete(key)
        with pytest.raises(Unavailable) as info:
            engine.eval("return redis.call('INCR', KEYS[1])", [key], [])
        assert int(engine.rc.get(key)) == 1
        assert "it was made" in str(info.value)
    finally:
        engine.close()


def test_a_script_whose_reply_was_lost_is_not_run_again(redis_engine, monkeypatch):
    """A script's reply lost on the way back (a dropped connection, a socket timeout) made
    the engine send the script again, and it ran twice (an INCR counted 2). A durable script
    now carries a key of its own and runs once: the retry gets the first run's result."""
    import redis
    from distorefs.backends.redisengine import ClusterEngine
    engine = ClusterEngine(redis_engine.url, wait_replicas=0, deadline=5.0)
    real = redis.client.Pipeline.execute
    lost = []

    def execute(self, *a, **kw):
        out = real(self, *a, **kw)
        if not lost:  # the first reply goes missing after the script ran
            lost.append(out)
            raise redis.exceptions.ConnectionError("connection reset by peer (injected)")
        return out

    try:
        key = b"{unit}:run-once"
        engine.rc.delete(key)
        monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
        assert engine.eval("return {redis.call('INCR', KEYS[1]), 'ok'}", [key], []) == [1, b"ok"]
        monkeypatch.undo()
        assert lost and int(engine.rc.get(key)) == 1 and engine.counters["retries"] == 1
        # a script that refuses keeps no result: sent again, it runs again
        with pytest.raises(Exception):
            engine.eval("return redis.error_reply('EINVAL no')", [key], [])
        assert engine.eval("return redis.call('INCR', KEYS[1])", [key], [], durable=False) == 2
    finally:
        engine.close()

"""The shared store's log is snapshotted and trimmed (distorefs/logsnapshot.py), through real
mounts on a real Redis Cluster (the `cluster` and `nodes` fixtures are conftest's): a node
that joins after the log was trimmed starts from the snapshot and sees every namespace as
the others do, then follows the log from there; a node away longer than the node timeout,
whose place in the log was trimmed away, is refused at mount with the reason."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from redis.cluster import RedisCluster

from distorefs_it import CLI, Mount, fsync_dir, have_fuse, wait_for, xattr

pytestmark = pytest.mark.skipif(not have_fuse(), reason="needs /dev/fuse and fusermount3")

SNAP = ("--cluster-snapshot-every", "40")


def npy(value: int) -> bytes:
    out = io.BytesIO()
    np.save(out, np.full(4, value, dtype=np.int64))
    return out.getvalue()


def cluster_stats(node: Mount) -> dict:
    return json.loads((node.mnt / ".distorefs" / "stats.json").read_bytes())["cluster"]


def redis_of(cluster) -> RedisCluster:
    host, port = cluster.url.removeprefix("redis://").split(":")
    return RedisCluster(host=host, port=int(port))


def log_length(rc: RedisCluster, node: Mount) -> int:
    return rc.xlen("{distorefs:%s}:log" % node.cluster_store)  # type: ignore[attr-defined]


def entries(node: Mount, name: str) -> list[str]:
    return sorted(os.listdir(node.mnt / "buffers" / name / "entries"))


def priorities(node: Mount, name: str) -> str:
    return (node.mnt / "buffers" / name / "priorities").read_text()


def save_step(node: Mount, run: str, step: str, seed: int) -> bytes:
    d = node.mnt / "checkpoints" / run / step
    d.mkdir(parents=True)
    data = np.random.default_rng(seed).bytes(300_000)
    (d / "model.bin").write_bytes(data)
    fsync_dir(d)
    assert xattr(d, "state") == "durable"
    return data


def test_a_node_joining_after_the_log_was_trimmed_starts_from_the_snapshot(nodes, cluster, tmp_path):
    a = nodes(flags=SNAP)
    rc = redis_of(cluster)
    buf = a.mnt / "buffers" / "one"
    buf.mkdir()
    (buf / "config.json").write_text('{"capacity": 10, "sampler": "prioritized"}')
    (a.mnt / "banks" / "mem").mkdir()
    (a.mnt / "checkpoints" / "config.json").write_text(json.dumps({"keep_last": 1}))
    # weights/: a file published three times, a publish by rename over it, a directory
    for v in range(3):
        (a.mnt / "weights" / "model.bin").write_bytes(b"model %d" % v)
    (a.mnt / "weights" / "sub").mkdir()
    (a.mnt / "weights" / "sub" / ".tmp").write_bytes(b"policy 1")
    os.rename(a.mnt / "weights" / "sub" / ".tmp", a.mnt / "weights" / "sub" / "policy.bin")
    # checkpoints/: s1 removed by retention once s2 is complete (its cstep and cremove both go)
    save_step(a, "run", "s1", seed=1)
    s2 = save_step(a, "run", "s2", seed=2)
    assert wait_for(lambda: json.loads((a.mnt / "checkpoints/stats.json").read_bytes())["steps_exported"] >= 2,
                    20.0)
    # datasets/: staged and sealed, so exported into the log
    src = tmp_path / "src"
    src.mkdir()
    items = {f"i{i}.bin": os.urandom(1000 + i) for i in range(5)}
    for rel, data in items.items():
        (src / rel).write_bytes(data)
    out = subprocess.run(CLI + ["stage", "-q", str(src), str(a.mnt / "datasets" / "ds")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for i in range(100):
        (buf / "entries" / f"e{i:03d}").write_bytes(npy(i))
        (a.mnt / "banks/mem/entries" / f"m{i % 7}").write_bytes(b"memory %d" % i)
    (buf / "priorities").write_text("e095 7.5\ne097 0.25\n")
    appended = 300  # records at least: 100 inserts and 100 rewrites, each a record
    assert wait_for(lambda: cluster_stats(a)["snapshots_made"] >= 1, 30.0), cluster_stats(a)
    assert wait_for(lambda: log_length(rc, a) < 100, 30.0), log_length(rc, a)
    assert log_length(rc, a) < appended

    late = nodes(flags=SNAP)  # ready once it loaded the snapshot and applied the log after it
    assert cluster_stats(late)["snapshot_records_loaded"] > 0
    assert entries(late, "one") == entries(a, "one") == [f"e{i:03d}" for i in range(90, 100)]
    assert priorities(late, "one") == priorities(a, "one")
    assert "e095 7.5" in priorities(late, "one")
    for i in range(90, 100):
        assert np.load(late.mnt / "buffers/one/entries" / f"e{i:03d}").tolist() == [i] * 4
    assert sorted(os.listdir(late.mnt / "banks/mem/entries")) == [f"m{i}" for i in range(7)]
    assert (late.mnt / "banks/mem/entries/m1").read_bytes() == b"memory 99"
    assert (late.mnt / "weights/model.bin").read_bytes() == b"model 2"
    assert xattr(late.mnt / "weights/model.bin", "version") == xattr(a.mnt / "weights/model.bin", "version")
    assert (late.mnt / "weights/sub/policy.bin").read_bytes() == b"policy 1"
    assert sorted(os.listdir(late.mnt / "weights/sub")) == ["policy.bin"]
    assert sorted(os.listdir(late.mnt / "checkpoints/run")) == ["latest", "s2"]
    assert (late.mnt / "checkpoints/run/s2/model.bin").read_bytes() == s2
    assert wait_for(lambda: xattr(late.mnt / "datasets/ds", "state") == "sealed")
    for rel, data in items.items():
        assert (late.mnt / "datasets/ds/items" / rel).read_bytes() == data

    # and it follows the log from the snapshot on, both ways
    (buf / "entries" / "after").write_bytes(npy(1000))
    assert wait_for(lambda: "after" in entries(late, "one"))
    (late.mnt / "buffers/one/entries/late").write_bytes(npy(2000))
    assert wait_for(lambda: "late" in entries(a, "one"))
    assert entries(late, "one") == entries(a, "one")
    rc.close()


def test_a_node_away_while_the_log_was_trimmed_past_it_is_refused(nodes, cluster):
    flags = (*SNAP, "--cluster-node-timeout", "1")
    a, b = nodes(flags=flags), nodes(flags=flags)
    buf = a.mnt / "buffers" / "gone"
    buf.mkdir()
    (buf / "config.json").write_text('{"capacity": 5}')
    assert wait_for(lambda: (b.mnt / "buffers" / "gone").is_dir())
    b.umount()
    time.sleep(1.5)  # longer than the node timeout: b no longer holds the log back
    rc = redis_of(cluster)
    for i in range(120):
        (buf / "entries" / f"e{i:03d}").write_bytes(npy(i))
    assert wait_for(lambda: cluster_stats(a)["snapshots_made"] >= 1, 30.0)
    assert wait_for(lambda: log_length(rc, a) < 60, 30.0), log_length(rc, a)
    with pytest.raises(AssertionError, match="trimmed"):
        b.mount(flags=b.cluster_flags)  # type: ignore[attr-defined]
    # with an empty STORE directory it joins again, from the snapshot
    fresh = nodes(flags=flags)
    assert entries(fresh, "gone") == [f"e{i:03d}" for i in range(115, 120)]
    rc.close()

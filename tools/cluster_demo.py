"""`distorefs demo-cluster` (the second half of `make run`): two nodes, one shared store.

It starts a Redis Cluster of 3 masters with a replica each on loopback ports in a work
directory of its own, mounts two daemons (each with its own store directory) on it, and
shows through plain file APIs what the shared store gives: actors insert on node 0 and a
learner on node 1 samples them and writes priorities; a weights file published on node 0
is read whole on node 1; a dataset staged on node 0 is read on node 1. Everything it
started is stopped and removed at the end, on Ctrl-C too.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from .bench_buffers import DistorefsMount, remove_workdir
from .rediscluster import LoopbackCluster


def _wait_for(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def _transition(rng: np.random.Generator, step: int) -> bytes:
    out = io.BytesIO()
    np.savez(out, obs=rng.random(32, dtype=np.float32), action=np.int64(step % 4), reward=np.float32(step % 3),
             done=np.bool_(step % 50 == 49))
    return out.getvalue()


def _actors(buf: Path, n: int, per_actor: int) -> None:
    def actor(i: int) -> None:
        rng = np.random.default_rng(i)
        for step in range(per_actor):
            with open(buf / "entries" / f"actor{i}-{step:05d}.npz", "wb") as f:
                f.write(_transition(rng, step))

    threads = [threading.Thread(target=actor, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _replay(nodes: list[DistorefsMount], actors: int = 4, per_actor: int = 250) -> None:
    buf0, buf1 = (node.mnt / "buffers" / "replay" for node in nodes)
    buf0.mkdir()
    (buf0 / "config.json").write_text(json.dumps({"capacity": 800, "sampler": "prioritized"}))
    _wait_for(buf1.is_dir, what="buffers/replay on node 1")
    t0 = time.perf_counter()
    _actors(buf0, actors, per_actor)
    inserted = actors * per_actor
    dt = time.perf_counter() - t0
    _wait_for(lambda: len(os.listdir(buf1 / "entries")) == 800, what="node 1 to apply node 0's inserts")
    seen = time.perf_counter() - t0
    steps = 0
    t1 = time.perf_counter()
    while steps < 50:
        with np.load(buf1 / "batch" / "32.npz") as batch:
            keys = [str(k) for k in batch["keys"]]
            td = np.abs(batch["reward"] - batch["obs"].mean(axis=1)) + 0.01
        (buf1 / "priorities").write_text("".join(f"{k} {p:.4f}\n" for k, p in zip(keys, td)))
        steps += 1
    learn = time.perf_counter() - t1

    def total(buf: Path) -> float:
        return round(json.loads((buf / "stats.json").read_text())["priority_total"], 3)

    _wait_for(lambda: total(buf0) == total(buf1), what="node 1's priorities on node 0")
    print(f"replay buffer: 4 actors on node 0 inserted {inserted} transitions in {dt:.2f} s "
          f"({inserted / dt:,.0f}/s); capacity 800 evicted the oldest in one global FIFO order")
    print(f"  node 1 listed all 800 entries {seen:.2f} s after the first insert, then a learner there ran "
          f"{steps} steps of batch/32.npz + 32 priorities ({steps / learn:,.0f} steps/s)")
    print(f"  the priorities written on node 1 hold on node 0 too: priority total {total(buf0)} on both")


def _weights(nodes: list[DistorefsMount]) -> None:
    w0, w1 = (node.mnt / "weights" / "policy.npy" for node in nodes)
    latencies = []
    for version in range(1, 4):
        params = np.full(1 << 18, version, dtype=np.float32)  # 1 MiB
        with open(w0, "wb") as f:
            np.save(f, params)
        t0 = time.perf_counter()
        _wait_for(lambda v=version: w1.exists() and os.getxattr(w1, "user.distorefs.version") == str(v).encode(),
                  what=f"weights version {version} on node 1")
        latencies.append((time.perf_counter() - t0) * 1e3)
        read = np.load(w1)
        assert read.shape == params.shape and float(read.min()) == float(read.max()) == version, "torn read"
    print(f"weights: 3 versions of weights/policy.npy (1 MiB) published on node 0, each read whole on node 1 "
          f"{max(latencies):.1f} ms (at most) after close() returned on node 0")


def _dataset(nodes: list[DistorefsMount], work: Path) -> None:
    src = work / "frames"
    rng = np.random.default_rng(7)
    sums = {}
    for i in range(300):
        data = rng.integers(0, 255, 8192, dtype=np.uint8).tobytes()
        rel = f"episode{i // 100}/frame{i:04d}.bin"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        sums[rel] = zlib.crc32(data)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "stage", "-q", str(src),
                    str(nodes[0].mnt / "datasets" / "frames")], check=True, capture_output=True, timeout=300)
    staged = time.perf_counter() - t0
    ds1 = nodes[1].mnt / "datasets" / "frames"
    _wait_for(lambda: ds1.is_dir(), what="datasets/frames on node 1")
    index = np.load(ds1 / "index.npy")
    with open(ds1 / "order", "wb") as f:  # node 1's own epoch order: read ahead from the cluster
        np.save(f, np.random.default_rng(1).permutation(len(index)))
    bad = sum(zlib.crc32((ds1 / "items" / p.decode()).read_bytes()) != sums[p.decode()] for p in index["path"])
    prefetch = json.loads((ds1 / "stats.json").read_text())["prefetch"]
    print(f"dataset: 300 items staged and sealed on node 0 in {staged:.2f} s, read on node 1: {len(index)} items, "
          f"{bad} differing, prefetch hits {prefetch.get('hits', 0) + prefetch.get('late', 0)}")
    if bad:
        raise RuntimeError(f"{bad} dataset items differ on node 1")


def run_cluster_demo(workdir: Path | None = None) -> None:
    work = Path(tempfile.mkdtemp(prefix="distorefs-cluster-demo-", dir=workdir))
    errors: list[str] = []
    cluster = LoopbackCluster(work / "redis", masters=3, replicas=1)
    nodes = [DistorefsMount(work / f"node{i}" / "store", work / f"node{i}" / "mnt") for i in range(2)]
    try:
        print(f"Redis Cluster: 3 masters + 3 replicas on loopback, in {work / 'redis'}", flush=True)
        cluster.start()
        for i, node in enumerate(nodes):
            node.mount(flags=("--cluster", cluster.url, "--cluster-store", "demo"))
            print(f"node {i}: distorefs mount {node.store} {node.mnt} --cluster {cluster.url} --cluster-store demo",
                  flush=True)
        _replay(nodes)
        _weights(nodes)
        _dataset(nodes, work)
    finally:
        for node in nodes:
            node.umount()
        cluster.stop()
        remove_workdir(work, errors)
        for e in errors:
            print(f"warning: {e}", file=sys.stderr)

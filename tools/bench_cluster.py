"""`distorefs bench cluster`: several nodes on one shared store on a Redis Cluster.

Nodes are daemons with their own mounts and store directories on this machine, against
one Redis Cluster on loopback (3 masters, each with a replica: the durable setting, every
write waits for its replica). For 1, 2 and 3 nodes:
- aggregate insert rate: 4 actor threads writing 110 KB `.npy` entries as files, spread
  over the nodes;
- a learner on node 0 reading `batch/64.npz` alone, and while the actors insert through
  the other nodes;
- bytes and round trips through Redis per insert, and CPU per insert of the daemons and
  of the Redis servers (the log's master apart from the others): the figures of the model
  that predicts N nodes on real hardware (README, Several nodes);
- what the log costs in Redis memory over many inserts, with snapshots (the log trimmed
  behind them) and with the log kept whole (`_log_memory`);
- the learner again with the machine split the way separate machines would split it
  (`_Split`): node 0's daemon and the learner on CPU 0, everything else (the other
  daemons, the Redis servers, the actors) on the other CPUs, alone and while the other
  nodes insert, so that what the learner loses is what its own node spends on the others'
  inserts (applying their records, fetching their values), not CPU taken by processes a
  real cluster runs elsewhere.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .bench_buffers import DistorefsMount, print_report, remove_workdir, run_cli, start_run
from .rediscluster import LoopbackCluster

ENTRY = 110_000  # bytes of uint8 per entry (Atari-like frames stacked: the 110 KB)
ACTORS = 4
BATCH = 64
CAPACITY = 2_000  # global: the cluster holds at most this many values (220 MB)


def _params(quick: bool) -> dict:
    return {"seconds": 3.0 if quick else 8.0, "nodes": (1, 2, 3), "log_inserts": 6_000 if quick else 20_000}


def _npy(rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    np.save(out, rng.integers(0, 256, ENTRY, dtype=np.uint8))
    return out.getvalue()


def _cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _set_cpus(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` on `cpus` (threads it starts later inherit it)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


class _Split:
    """The machine split as separate machines would split it: node 0's daemon and this
    thread (the learner) on CPU 0, every other process of the run on the other CPUs;
    undone on exit. `_Actors(..., cpus=split.rest)` keeps the actor threads off CPU 0."""

    def __init__(self, learner_pid: int | None, others: list[int | None]) -> None:
        self.all = os.sched_getaffinity(0)
        self.mine = {min(self.all)}
        self.rest = (self.all - self.mine) or self.all
        self.learner_pid = learner_pid
        self.others = [p for p in others if p is not None]

    def __enter__(self) -> "_Split":
        os.sched_setaffinity(0, self.mine)  # this thread only (Linux: 0 is the caller)
        if self.learner_pid is not None:
            _set_cpus(self.learner_pid, self.mine)
        for pid in self.others:
            _set_cpus(pid, self.rest)
        return self

    def __exit__(self, *exc) -> None:
        os.sched_setaffinity(0, self.all)
        for pid in [self.learner_pid, *self.others]:
            if pid is not None:
                _set_cpus(pid, self.all)


class _Burner:
    """A process spinning on `cpus` (a plain Python loop) for the life of the block."""

    def __init__(self, cpus: set[int]) -> None:
        self.cpus = cpus

    def __enter__(self) -> "_Burner":
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        _set_cpus(self.proc.pid, self.cpus)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


class _Busy:
    """A node's daemon over a phase: the share of a CPU it used, records applied per
    second, CPU ms per record applied, bytes fetched from the cluster per second."""

    def __init__(self, node: DistorefsMount) -> None:
        self.node = node
        self.result: dict = {}

    def __enter__(self) -> "_Busy":
        s = _stats(self.node)
        self.t0, self.cpu0 = time.perf_counter(), _cpu_s(self.node.pid)
        self.rec0, self.in0 = s.get("records_applied", 0), s.get("bytes_in", 0)
        return self

    def __exit__(self, *exc) -> None:
        s = _stats(self.node)
        dt = time.perf_counter() - self.t0
        cpu = _cpu_s(self.node.pid) - self.cpu0
        records = s.get("records_applied", 0) - self.rec0
        self.result = {"cpu": round(cpu / dt, 3), "records_per_s": round(records / dt, 1),
                       "cpu_ms_per_record": round(cpu * 1e3 / records, 3) if records else None,
                       "fetched_mb_per_s": round((s.get("bytes_in", 0) - self.in0) / dt / 1e6, 2)}


class _Actors:
    """ACTORS threads inserting entries as files into the buffers given, round robin
    (on `cpus`, when given)."""

    def __init__(self, bufs: list[Path], prefix: str, cpus: set[int] | None = None) -> None:
        self.bufs, self.prefix, self.cpus = bufs, prefix, cpus
        self.count = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(ACTORS)]

    def _run(self, i: int) -> None:
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)  # this thread only
        rng = np.random.default_rng(i)
        data = [_npy(rng) for _ in range(8)]
        buf = self.bufs[i % len(self.bufs)]
        n = 0
        while not self._stop.is_set():
            try:
                with open(buf / "entries" / f"{self.prefix}{i}-{n}", "wb") as f:
                    f.write(data[n % len(data)])
            except OSError as exc:
                self.errors.append(str(exc))
                time.sleep(0.1)
                continue
            n += 1
            with self._lock:
                self.count += 1

    def __enter__(self) -> "_Actors":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def _stats(node: DistorefsMount) -> dict:
    return json.loads((node.mnt / ".distorefs" / "stats.json").read_bytes()).get("cluster", {})


def _sum(nodes: list[DistorefsMount], key: str) -> int:
    return sum(_stats(n).get(key, 0) for n in nodes)


def _learner(buf: Path, seconds: float) -> float:
    """batch/64.npz read and loaded for `seconds`: entries/s."""
    with np.load(buf / "batch" / f"{BATCH}.npz") as z:  # warm: the first draw, the layout
        _ = {k: z[k] for k in z.files}
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        with np.load(buf / "batch" / f"{BATCH}.npz") as z:
            batch = {k: z[k] for k in z.files}
        count += len(batch["keys"])
    return round(count / (time.perf_counter() - t0), 1)


WEIGHTS = 16 << 20  # bytes of the weights file republished


def _weights_latency(nodes: list[DistorefsMount], p: dict) -> dict:
    """Node 0 republishes weights/bench/model.bin; a waiter on each other node blocks in
    .distorefs/wait for the next version. Milliseconds from close() returning on node 0
    to the wait returning elsewhere (median and max over the rounds), and the publish itself."""
    d = nodes[0].mnt / "weights" / "bench"
    d.mkdir(exist_ok=True)
    path = d / "model.bin"
    data = np.random.default_rng(0).integers(0, 256, WEIGHTS, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    version = 1
    lags: list[float] = []
    publish_ms: list[float] = []
    for _ in range(5 if p["seconds"] < 5 else 12):
        seen: dict[int, float] = {}

        def waiter(i: int, node: DistorefsMount, after: int) -> None:
            with open(node.mnt / ".distorefs" / "wait", "r+b", buffering=0) as f:
                f.write(f"bench/model.bin {after}\n".encode())
                f.read()
            seen[i] = time.perf_counter()

        deadline = time.monotonic() + 30
        while not all((n.mnt / "weights/bench/model.bin").exists() for n in nodes[1:]):
            if time.monotonic() > deadline:
                raise TimeoutError("weights never reached the other nodes")
            time.sleep(0.01)
        threads = [threading.Thread(target=waiter, args=(i, n, version), daemon=True) for i, n in enumerate(nodes[1:])]
        for t in threads:
            t.start()
        time.sleep(0.2)  # the waiters are blocked in the mount
        t0 = time.perf_counter()
        path.write_bytes(data)
        closed = time.perf_counter()
        version += 1
        for t in threads:
            t.join(30)
        publish_ms.append((closed - t0) * 1e3)
        lags += [(seen[i] - closed) * 1e3 for i in seen]
    return {"median": round(float(np.median(lags)), 2), "max": round(max(lags), 2),
            "publish_ms": round(float(np.median(publish_ms)), 1), "bytes": WEIGHTS}


def _nodes_run(cluster: LoopbackCluster, root: Path, n: int, p: dict) -> dict:
    store = f"bench{n}"
    nodes = [DistorefsMount(root / f"n{n}-{i}" / "store", root / f"n{n}-{i}" / "mnt") for i in range(n)]
    log_master = cluster.master_of("{distorefs:%s}:log" % store)
    redis_pids = {node.port: node.proc.pid for node in cluster.live()}
    try:
        for node in nodes:
            node.mount(flags=("--cluster", cluster.url, "--cluster-store", store))
        buf0 = nodes[0].mnt / "buffers" / "rb"
        buf0.mkdir()
        (buf0 / "config.json").write_text(json.dumps({"capacity": CAPACITY}))
        bufs = [node.mnt / "buffers" / "rb" for node in nodes]
        deadline = time.monotonic() + 30
        while not all(b.is_dir() for b in bufs) and time.monotonic() < deadline:
            time.sleep(0.05)
        with _Actors(bufs, "warm") as warm:  # fills the buffer past a batch, starts every path
            while warm.count < 4 * BATCH:
                time.sleep(0.05)
        res: dict[str, Any] = {"nodes": n}
        # ----- aggregate insert rate, actors spread over the nodes
        before = {k: _sum(nodes, k) for k in ("bytes_out", "bytes_in", "round_trips")}
        daemons0 = sum(_cpu_s(node.pid) for node in nodes)
        redis0 = {port: _cpu_s(pid) for port, pid in redis_pids.items()}
        t0 = time.perf_counter()
        with _Actors(bufs, "a") as actors:
            time.sleep(p["seconds"])
            done = actors.count
        dt = time.perf_counter() - t0
        res["inserts_per_s"] = round(done / dt, 1)
        res["actor_errors"] = len(actors.errors)
        after = {k: _sum(nodes, k) for k in before}
        res["per_insert"] = {
            "bytes_to_redis": round((after["bytes_out"] - before["bytes_out"]) / max(1, done)),
            "bytes_from_redis": round((after["bytes_in"] - before["bytes_in"]) / max(1, done)),
            "round_trips": round((after["round_trips"] - before["round_trips"]) / max(1, done), 2),
            "daemon_cpu_ms": round((sum(_cpu_s(node.pid) for node in nodes) - daemons0) * 1e3 / max(1, done), 3),
            "redis_log_master_cpu_ms": round((_cpu_s(redis_pids[log_master]) - redis0[log_master]) * 1e3
                                             / max(1, done), 3),
            "redis_other_cpu_ms": round(sum(_cpu_s(pid) - redis0[port] for port, pid in redis_pids.items()
                                            if port != log_master) * 1e3 / max(1, done), 3),
        }
        print(f"  {n} node(s): {res['inserts_per_s']} inserts/s; per insert {res['per_insert']}", flush=True)
        # ----- the learner on node 0: alone, then while the other nodes' actors insert
        res["learner_alone"] = _learner(buf0, p["seconds"])
        if n > 1:
            with _Actors(bufs[1:], "b") as others:
                res["learner_while_others_insert"] = _learner(buf0, p["seconds"])
                res["others_inserts"] = others.count
        print(f"  {n} node(s): learner alone {res['learner_alone']} entries/s, while others insert "
              f"{res.get('learner_while_others_insert', '-')}", flush=True)
        if len(os.sched_getaffinity(0)) >= 2 and n in (1, 3):
            # The learner's node on a CPU of its own, the rest of the run on the others.
            with _Split(nodes[0].pid, [x.pid for x in nodes[1:]] + list(redis_pids.values())) as split:
                _learner(buf0, 1.0)  # the entries the other nodes inserted so far, fetched from the cluster
                with _Busy(nodes[0]) as busy:
                    res["split_learner_alone"] = _learner(buf0, p["seconds"])
                res["split_learner_alone_daemon"] = busy.result
                if n > 1:
                    # The control for this VM: its vCPUs slow each other (two busy processes
                    # each run 17-30 % slower than one alone), so the learner is measured
                    # again with the other CPU busy with a plain loop and nothing else: what
                    # it loses to that is the machine's, not work its node does for others.
                    with _Burner(split.rest):
                        res["split_learner_with_burner"] = _learner(buf0, p["seconds"])
                    # Node 0 only follows: its CPU per record applied is the apply cost of
                    # the model, measured on a CPU nothing else uses.
                    with _Actors(bufs[1:], "f", cpus=split.rest), _Busy(nodes[0]) as busy:
                        time.sleep(p["seconds"] / 2)
                    res["split_follow_only"] = busy.result
                    with _Actors(bufs[1:], "s", cpus=split.rest) as others, _Busy(nodes[0]) as busy:
                        t0 = time.perf_counter()
                        res["split_learner_while_others_insert"] = _learner(buf0, p["seconds"])
                        inserted = others.count
                    res["split_others_inserts_per_s"] = round(inserted / (time.perf_counter() - t0), 1)
                    res["split_learner_busy_daemon"] = busy.result
                    # against the learner of this very run with the others idle (the 1-node
                    # row's varies more between runs than this does within one)
                    res["split_ratio_same_run"] = round(res["split_learner_while_others_insert"]
                                                        / res["split_learner_alone"], 2)
                    res["split_ratio_vs_burner"] = round(res["split_learner_while_others_insert"]
                                                         / res["split_learner_with_burner"], 2)
            print(f"  {n} node(s), learner's node on a CPU of its own: alone {res['split_learner_alone']} "
                  f"entries/s (its daemon {res['split_learner_alone_daemon']}), while the others insert "
                  f"{res.get('split_learner_while_others_insert', '-')} ({res.get('split_others_inserts_per_s', '-')} "
                  f"inserts/s on the other nodes; its daemon {res.get('split_learner_busy_daemon', '-')}; "
                  f"{res.get('split_ratio_same_run', '-')}x of its rate with the others idle, "
                  f"{res.get('split_ratio_vs_burner', '-')}x of its rate with the other CPU busy with a plain loop: "
                  f"{res.get('split_learner_with_burner', '-')}); "
                  f"following only: {res.get('split_follow_only', '-')}", flush=True)
        if n > 1:
            res["weights_visible_ms"] = _weights_latency(nodes, p)
            print(f"  {n} node(s): weights visible on the other nodes after close() returned: "
                  f"{res['weights_visible_ms']}", flush=True)
        if n == 2:
            res["dataset"] = _shared_dataset(nodes, root / f"n{n}-ds", p)
            print(f"  {n} node(s): shared dataset {res['dataset']}", flush=True)
        apply_s = [_stats(node) for node in nodes]
        res["applied_records"] = [s.get("records_applied") for s in apply_s]
        return res
    finally:
        for node in nodes:
            node.umount()


SNAPSHOT_EVERY = 2_000  # --cluster-snapshot-every of the log phase
LOG_CAPACITY = 500  # entries of the log phase's buffer


def _log_memory(cluster: LoopbackCluster, root: Path, p: dict) -> dict:
    """What the log costs in Redis memory over many inserts: one node inserting small
    entries into a buffer of LOG_CAPACITY, with snapshots every SNAPSHOT_EVERY records (the
    log trimmed behind them) and, as the baseline of the same run, with none (the log kept
    whole, as before snapshots). The log, its snapshots and the buffer's global state
    (`{...}:idx`, `:fifo`) are measured with MEMORY USAGE."""
    from redis.cluster import RedisCluster
    host, port = cluster.url.removeprefix("redis://").split(":")
    rc = RedisCluster(host=host, port=int(port))
    total = p["log_inserts"]
    out: dict[str, Any] = {"inserts": total, "snapshot_every": SNAPSHOT_EVERY, "capacity": LOG_CAPACITY}
    try:
        for label, every in (("snapshots", SNAPSHOT_EVERY), ("whole_log", 10 ** 12)):
            store = f"benchlog-{label}"
            tag = "{distorefs:%s}" % store
            node = DistorefsMount(root / f"log-{label}" / "store", root / f"log-{label}" / "mnt")
            node.mount(flags=("--cluster", cluster.url, "--cluster-store", store,
                              "--cluster-snapshot-every", str(every)))
            try:
                buf = node.mnt / "buffers" / "log"
                buf.mkdir()
                (buf / "config.json").write_text(json.dumps({"capacity": LOG_CAPACITY}))
                data = io.BytesIO()
                np.save(data, np.arange(64, dtype=np.int32))
                entry = data.getvalue()

                def memory() -> int:
                    keys = [f"{tag}:log", f"{tag}:idx:buffers/log", f"{tag}:fifo:buffers/log"]
                    n = int(rc.hget(f"{tag}:snap", "n") or 0)
                    keys += [f"{tag}:snap:{i}" for i in (n - 1, n) if i > 0]
                    return sum(rc.memory_usage(k, samples=0) or 0 for k in keys)

                peak, samples = 0, []
                done = [0]

                def actor(i: int) -> None:
                    for j in range(i, total, ACTORS):
                        with open(buf / "entries" / f"e{j}", "wb") as f:
                            f.write(entry)
                        done[0] += 1

                threads = [threading.Thread(target=actor, args=(i,), daemon=True) for i in range(ACTORS)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                while any(t.is_alive() for t in threads):
                    time.sleep(0.5)
                    m = memory()
                    peak = max(peak, m)
                    samples.append((done[0], m))
                dt = time.perf_counter() - t0
                time.sleep(6.0 if every < 10 ** 12 else 0.0)  # a report: the last snapshot made, the log trimmed
                final = memory()
                out[label] = {"inserts_per_s": round(total / dt, 1), "final_bytes": final, "peak_bytes": max(peak, final),
                              "log_records": rc.xlen(f"{tag}:log"), "snapshots": _stats(node).get("snapshots_made", 0),
                              "bytes_per_insert_at_end": round(final / total, 1),
                              "samples": samples[:: max(1, len(samples) // 20)]}
            finally:
                node.umount()
    finally:
        rc.close()
    return out


DS_ITEMS, DS_BYTES = 5000, 10 << 10  # the shared dataset: items and bytes per item


def _epoch(ds: Path, paths: list[str]) -> float:
    """One epoch of `paths` in a shuffled order declared first (the node reads ahead): items/s."""
    order = np.random.default_rng(len(paths)).permutation(len(paths))
    with open(ds / "order", "wb") as f:
        np.save(f, order)
    t0 = time.perf_counter()
    for i in order:
        with open(ds / "items" / paths[i], "rb") as f:
            f.read()
    return round(len(paths) / (time.perf_counter() - t0), 1)


def _shared_dataset(nodes: list[DistorefsMount], root: Path, p: dict) -> dict:
    """A dataset staged and sealed on node 0 (sealing shares it), then one epoch on node 1,
    whose items come from the cluster, and one on node 0, whose items are its own."""
    n = DS_ITEMS if p["seconds"] >= 5 else DS_ITEMS // 5
    src = root / "ds-src"
    rng = np.random.default_rng(1)
    for i in range(n):
        (src / f"d{i // 1000}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i // 1000}" / f"{i:06d}.bin").write_bytes(rng.integers(0, 256, DS_BYTES, dtype=np.uint8).tobytes())
    before = _sum(nodes[:1], "bytes_out")
    t0 = time.perf_counter()
    r = run_cli("stage", "-q", str(src), str(nodes[0].mnt / "datasets" / "shared"), timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"distorefs stage: {r.stderr.strip()}")
    staged = time.perf_counter() - t0
    shared = nodes[1].mnt / "datasets" / "shared"
    deadline = time.monotonic() + 60
    while not shared.is_dir():
        if time.monotonic() > deadline:
            raise TimeoutError("the dataset never reached node 1")
        time.sleep(0.01)
    visible = time.perf_counter() - t0
    paths = [x.decode() for x in np.load(shared / "index.npy")["path"]]
    return {"items": n, "item_bytes": DS_BYTES, "stage_and_share_s": round(staged, 2),
            "visible_on_node1_s": round(visible, 2),
            "bytes_to_redis_per_item": round((_sum(nodes[:1], "bytes_out") - before) / n),
            "epoch_node1_items_per_s": _epoch(shared, paths),
            "epoch_node0_items_per_s": _epoch(nodes[0].mnt / "datasets" / "shared", paths)}


def _model(rows: list[dict]) -> list[str]:
    """What the per-insert figures predict, and where the limit is on real hardware."""
    one = next((r for r in rows if r["nodes"] == 1), None)
    if not one:
        return []
    pi = one["per_insert"]
    total_ms = pi["daemon_cpu_ms"] + pi["redis_log_master_cpu_ms"] + pi["redis_other_cpu_ms"]
    lines = [f"model: one insert costs {pi['daemon_cpu_ms']} ms of daemon CPU, {pi['redis_log_master_cpu_ms']} ms on "
             f"the log's master and {pi['redis_other_cpu_ms']} ms on the other Redis servers (values, replicas), "
             f"and moves {pi['bytes_to_redis']:,} B to Redis in {pi['round_trips']} round trips."]
    if total_ms > 0:
        lines.append(f"model on this machine (2 cores shared by everything, plus the actors' own CPU): at most "
                     f"{2000 / total_ms:,.0f} inserts/s whatever the node count; measured "
                     + ", ".join(f"{r['nodes']} node(s) {r['inserts_per_s']:,}" for r in rows) + ".")
        log_limit = 1000 / pi["redis_log_master_cpu_ms"] if pi["redis_log_master_cpu_ms"] else float("inf")
        # A node's daemon spends D1 (one node's daemon CPU per insert: the insert and its own
        # record applied) on each of its own inserts and `apply` on each record of another
        # node: with R inserts/s over N nodes, each at R/N, R/N x D1 + (N-1) R/N x apply <= one
        # core, so R <= N / (D1 + (N-1) x apply). `apply` is measured on a node that only
        # follows, on a CPU of its own (the split phase); without it, fitted over the rows.
        three = next((r for r in rows if r.get("split_follow_only", {}).get("cpu_ms_per_record")), None)
        if three is not None:
            follow = three["split_follow_only"]
            apply_ms = follow["cpu_ms_per_record"]
            lines.append(f"model: a node that only follows spends {apply_ms:.3f} ms of daemon CPU per record applied "
                         f"({follow['records_per_s']:,.0f} records/s from the other nodes, {follow['cpu']:.2f} of its "
                         f"CPU; measured with that node on a CPU of its own): less the faster records come, since "
                         f"it applies them in batches.")
        else:
            xs = np.array([r["nodes"] for r in rows], dtype=float)
            ys = np.array([r["per_insert"]["daemon_cpu_ms"] for r in rows], dtype=float)
            apply_ms = max(float(np.polyfit(xs, ys, 1)[0]), 0.0) if len(rows) > 1 else 0.0
            lines.append(f"model: {apply_ms:.2f} ms per record applied, fitted to the rows' daemon CPU per insert "
                         "(contention on 2 cores inflates the later points).")
        d1 = pi["daemon_cpu_ms"]
        predicted = {n: min(n * 1000 / (d1 + (n - 1) * apply_ms), log_limit) for n in (1, 2, 3, 8)}
        lines.append("model on real hardware (one core per daemon, a machine per node, Redis on machines of its own): "
                     f"N nodes insert at most min(N / ({d1:.2f} ms + (N-1) x {apply_ms:.3f} ms), the log's master at "
                     f"{log_limit:,.0f} records/s): " + ", ".join(f"{n} nodes {v:,.0f}/s" for n, v in predicted.items())
                     + f" ({predicted[3] / predicted[1]:.2f}x one node with 3); the network carries "
                     f"{pi['bytes_to_redis'] * 2 / 1e6:.2f} MB per insert with its replica copy.")
    return lines


def _log_line(m: dict) -> str:
    snap, whole = m.get("snapshots", {}), m.get("whole_log", {})
    return (f"after {m['inserts']:,} inserts into a buffer of {m['capacity']}: the log, its snapshots and the "
            f"buffer's state hold {snap.get('final_bytes', 0) / 1e6:.2f} MB in Redis with a snapshot every "
            f"{m['snapshot_every']:,} records (peak {snap.get('peak_bytes', 0) / 1e6:.2f} MB, "
            f"{snap.get('snapshots', 0)} snapshots, {snap.get('log_records', 0):,} records left in the log, "
            f"{snap.get('inserts_per_s', 0):,} inserts/s), against {whole.get('final_bytes', 0) / 1e6:.2f} MB "
            f"with the log kept whole ({whole.get('bytes_per_insert_at_end', 0):,} B per insert, "
            f"{whole.get('inserts_per_s', 0):,} inserts/s)")


def format_table(rows: list[dict]) -> str:
    lines = [f"{'nodes':>5s} {'inserts/s':>10s} {'vs 1 node':>9s} {'learner alone':>14s} {'learner, others insert':>23s} "
             f"{'ratio':>6s} {'B to Redis/insert':>18s} {'round trips':>11s} {'weights ms':>13s}"]
    base = next((r["inserts_per_s"] for r in rows if r["nodes"] == 1), None)
    single = next((r["learner_alone"] for r in rows if r["nodes"] == 1), None)
    for r in rows:
        busy = r.get("learner_while_others_insert")
        lines.append(f"{r['nodes']:>5d} {r['inserts_per_s']:>10,.1f} "
                     f"{(r['inserts_per_s'] / base if base else 0):>8.2f}x {r['learner_alone']:>14,.1f} "
                     f"{'-' if busy is None else f'{busy:,.1f}':>23s} "
                     f"{'-' if busy is None or not single else f'{busy / single:.2f}x':>6s} "
                     f"{r['per_insert']['bytes_to_redis']:>18,d} {r['per_insert']['round_trips']:>11.2f} "
                     f"{(r.get('weights_visible_ms') or {}).get('median', '-')!s:>13s}")
    return "\n".join(lines)


def run(out: Path, quick: bool = False, workdir: Path | None = None) -> dict:
    r = start_run(out, workdir)
    out, root, notes, machine = r.out, r.root, r.notes, r.machine
    p = _params(quick)
    print(f"distorefs bench cluster{' --quick' if quick else ''}: workdir {root}, {machine['cpus']} CPUs", flush=True)
    rows: list[dict] = []
    errors: list[str] = []
    log_memory: dict = {}
    cluster = LoopbackCluster(root / "redis", masters=3, replicas=1)
    try:
        cluster.start()
        for n in p["nodes"]:
            try:
                rows.append(_nodes_run(cluster, root, n, p))
            except Exception as exc:
                errors.append(f"{n} node(s): {type(exc).__name__}: {exc}")
        try:
            log_memory = _log_memory(cluster, root, p)
            print(f"  log memory: {_log_line(log_memory)}", flush=True)
        except Exception as exc:
            errors.append(f"log memory: {type(exc).__name__}: {exc}")
    except Exception as exc:
        errors.append(f"cluster: {type(exc).__name__}: {exc}")
    finally:
        cluster.stop()
        remove_workdir(root, errors)
    notes.append("nodes, the 6 Redis servers and the actors share this machine's cores: the aggregate rate cannot "
                 "grow with nodes here; the model below says what does on real hardware")
    notes.append("weights: a 16 MB file republished on node 0; 'visible' is from its close() returning there to "
                 ".distorefs/wait returning on another node (it can return first: the other node applies the "
                 "record as soon as it is in the cluster, which close() waits for too)")
    table = format_table(rows)
    base = next((x for x in rows if x["nodes"] == 1), None)
    three = next((x for x in rows if x["nodes"] == 3), None)
    goals = []
    if base and three:
        goals.append({"goal": "aggregate inserts with 3 nodes >= 2x one node",
                      "value": round(three["inserts_per_s"] / base["inserts_per_s"], 2),
                      "met": three["inserts_per_s"] >= 2 * base["inserts_per_s"]})
        busy = three.get("learner_while_others_insert")
        if busy:
            goals.append({"goal": "learner on one node, 2 others inserting, >= 0.8x its single-node rate",
                          "value": round(busy / base["learner_alone"], 2), "met": busy >= 0.8 * base["learner_alone"]})
        busy, alone = three.get("split_learner_while_others_insert"), base.get("split_learner_alone")
        if busy and alone:
            goals.append({"goal": "the same, the learner's node on a CPU of its own (as on a machine of its own), "
                                  ">= 0.8x its single-node rate on that CPU",
                          "value": round(busy / alone, 2), "met": busy >= 0.8 * alone})
        burner = three.get("split_learner_with_burner")
        if busy and burner:
            goals.append({"goal": "the same against the learner with the other CPU busy with a plain loop (this VM's "
                                  "vCPUs slow each other; on separate machines they do not), >= 0.8x",
                          "value": round(busy / burner, 2), "met": busy >= 0.8 * burner})
    model = _model(rows)
    if log_memory:
        model.append("log memory: " + _log_line(log_memory))
    doc = {"benchmark": "cluster", "log_memory": log_memory, "quick": quick, "params": {**p, "entry_bytes": ENTRY, "actors": ACTORS,
                                                              "batch": BATCH, "capacity": CAPACITY},
           "machine": machine, "results": rows, "model": model, "goals": goals, "notes": notes, "errors": errors,
           "table": table}
    (out / "cluster.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print_report(table, goals, notes, errors, tuple(model))
    print(f"wrote {out / 'cluster.json'}")
    return doc

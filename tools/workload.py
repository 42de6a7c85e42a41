"""A short RL-style workload against a mounted store (what `make run` / `distorefs demo` shows).

Actors (separate processes) insert Atari-like observation stacks as `.npy` entries into
`buffers/demo`; a learner (this process) draws `batch/32.npz` files, computes a fake TD
error and writes new priorities for the batch in one write to `priorities`. Everything
goes through plain file APIs (open/os/numpy): no distorefs imports.
"""

from __future__ import annotations

import errno
import io
import json
import multiprocessing as mp
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

BUFFER = "demo"
FRAME_SHAPE = (16, 84, 84)  # uint8: 112,896 bytes of pixels, ~110 KiB as .npy
LEARNER_BATCH = 32
MIN_ENTRIES = 200
KEY_RE = re.compile(r"^actor(\d+)-step(\d+)\.npy$")


# ----- observation data (shared with bench_buffers) -----------------------------------

class FrameSource:
    """Atari-like uint8 frame stacks: a banded background, bricks, a paddle and a ball
    that move with the step, plus 2 bits of sensor noise, so that zstd level 1 packs
    them about 2x (real game frames compress more; pure noise would not at all).

    Bases and noise come from small pre-computed pools, so making one stack costs a
    copy and an add (well under a millisecond), not the insert being measured.
    """

    def __init__(self, seed: int, shape: tuple[int, ...] = FRAME_SHAPE, noise_levels: int = 4,
                 pool: int = 8) -> None:
        self.shape = shape
        rng = np.random.default_rng(seed)
        depth, h, w = shape[0], shape[-2], shape[-1]
        yy, _ = np.mgrid[0:h, 0:w]
        background = (40 + (yy * 7 // h) * 12).astype(np.uint8)
        self.bases = []
        for t in range(pool):
            stack = np.empty((depth, h, w), dtype=np.uint8)
            for d in range(depth):
                s = t * depth + d + seed
                img = background.copy()
                img[h // 8:h // 8 + h // 10, :] = 120
                for b in range(6):
                    y0 = h // 4 + b * (h // 20)
                    x0 = (s * 3 + b * 13) % max(1, w - 14)
                    img[y0:y0 + max(1, h // 28), x0:x0 + 12] = 180 + b * 10
                x, y = (s * 5) % max(1, w - 8), (s * 3) % max(1, h - 8)
                img[y:y + 6, x:x + 6] = 255
                img[h - 6:h - 3, (s * 2) % max(1, w - 16):(s * 2) % max(1, w - 16) + 16] = 220
                stack[d] = img
            self.bases.append(stack.reshape(shape))
        self.noise = [rng.integers(0, noise_levels, size=shape, dtype=np.uint8) for _ in range(pool)]
        self.rng = rng

    def array(self, step: int) -> np.ndarray:
        base = self.bases[step % len(self.bases)]
        noise = self.noise[int(self.rng.integers(len(self.noise)))]
        out = base + noise
        out.flat[:8] = np.frombuffer(np.int64(step).tobytes(), dtype=np.uint8)  # every entry unique
        return out

    def npy(self, step: int) -> bytes:
        buf = io.BytesIO()
        np.save(buf, self.array(step), allow_pickle=False)
        return buf.getvalue()


# ----- actors --------------------------------------------------------------------------

def _actor(index: int, entries_dir: str, seconds: float, first_step: int, barrier, results) -> None:
    """Insert observations as entries/actorA-stepS.npy for `seconds` (a separate process)."""
    out: dict[str, Any] = {"actor": index, "inserts": 0, "bytes": 0, "errors": 0, "error": None, "latency_ms": []}
    try:
        source = FrameSource(seed=1000 + index)
        barrier.wait(timeout=60)
        start = time.perf_counter()
        deadline = start + seconds
        step = first_step
        lat = []
        while time.perf_counter() < deadline:
            data = source.npy(step)
            path = os.path.join(entries_dir, f"actor{index}-step{step}.npy")
            t0 = time.perf_counter()
            try:
                with open(path, "wb") as f:  # create, write, close: visible whole at close
                    f.write(data)
            except OSError as exc:
                out["errors"] += 1
                out["error"] = f"{path}: {exc}"
                if out["errors"] > 20:
                    break
                continue
            lat.append(time.perf_counter() - t0)
            out["inserts"] += 1
            out["bytes"] += len(data)
            step += 1
        out["elapsed_s"] = time.perf_counter() - start
        if lat:
            a = np.array(lat) * 1e3
            out["latency_ms"] = [round(float(np.percentile(a, 50)), 3), round(float(np.percentile(a, 99)), 3)]
    except Exception as exc:  # report, never hang the learner
        out["error"] = f"{type(exc).__name__}: {exc}"
        out.setdefault("elapsed_s", 0.0)
    results.put(out)


# ----- learner -------------------------------------------------------------------------

def _open_batch(path: Path, deadline: float) -> tuple[int, float]:
    """Open batch/N.npz with O_NONBLOCK until min_size_to_sample entries exist; (fd, waited s)."""
    t0 = time.perf_counter()
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_NONBLOCK), time.perf_counter() - t0
        except BlockingIOError:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{path}: still fewer than {MIN_ENTRIES} entries after waiting") from None
            time.sleep(0.02)


def _read_fd(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _learner_step(buf: Path, value_estimate: float, rng: np.random.Generator) -> tuple[int, int, int, float, float]:
    """One training step; returns (entries, npz bytes, priorities sent, mean |td|, new estimate)."""
    fd, _ = _open_batch(buf / "batch" / f"{LEARNER_BATCH}.npz", time.perf_counter() + 30)
    try:
        raw = _read_fd(fd)
    finally:
        os.close(fd)
    with np.load(io.BytesIO(raw)) as z:
        data, keys, weights = z["data"], z["keys"], z["weights"]
        _ = z["probabilities"], z["seqs"]
    # A fake Q-value: the mean pixel of each transition; TD error against a moving target.
    q = data.reshape(len(data), -1).mean(axis=1, dtype=np.float64) / 255.0
    target = value_estimate + 0.05 * rng.standard_normal(len(q))
    td = (q - target) * weights
    value_estimate = 0.9 * value_estimate + 0.1 * float(q.mean())
    priorities = np.abs(td) + 1e-3
    payload = "".join(f"{k} {p:.6g}\n" for k, p in zip(keys.tolist(), priorities.tolist())).encode()
    pfd = os.open(buf / "priorities", os.O_WRONLY)
    try:
        os.write(pfd, payload)  # one write: all the batch's priorities at once
    finally:
        os.close(pfd)
    return len(keys), len(raw), len(keys), float(np.abs(td).mean()), value_estimate


# ----- the workload --------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read())


def _prepare_buffer(buf: Path, capacity: int) -> tuple[int, int]:
    """Create (or reuse) buffers/demo; returns (entries already there, first free step)."""
    try:
        os.mkdir(buf)
    except FileExistsError:
        pass
    config = {"sampler": "prioritized", "capacity": capacity, "compression": "zstd", "compression_level": 1,
              "alpha": 0.6, "beta": 0.4, "min_size_to_sample": MIN_ENTRIES, "presample_batches": 2}
    with open(buf / "config.json", "w") as f:
        f.write(json.dumps(config))
    names = os.listdir(buf / "entries")
    steps = [int(m.group(2)) for m in map(KEY_RE.match, names) if m]
    return len(names), (max(steps) + 1 if steps else 0)


def _mb(n: float) -> float:
    return n / 1e6


def run_workload(mnt: Path, actors: int = 4, seconds: float = 5.0, capacity: int = 5000,
                 quiet: bool = False) -> dict:
    """Run actors inserting and a learner sampling/updating priorities on `mnt`; print and return numbers."""
    say = (lambda *a: None) if quiet else print
    mnt = Path(mnt)
    buf = mnt / "buffers" / BUFFER
    if not (mnt / "buffers").is_dir():
        raise FileNotFoundError(f"{mnt} does not look like a distorefs mount (no buffers/)")
    existing, first_step = _prepare_buffer(buf, capacity)
    before = _read_json(buf / "stats.json")
    say(f"buffers/{BUFFER}: prioritized, capacity {capacity}, zstd; "
        f"{existing} entries already there" + (f" (new steps start at {first_step})" if existing else ""))
    say(f"starting {actors} actor processes for {seconds:g}s, each inserting {FRAME_SHAPE} uint8 .npy "
        f"observations (~{_mb(int(np.prod(FRAME_SHAPE)) + 128):.2f} MB) as entries/actorA-stepS.npy")

    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    barrier = ctx.Barrier(actors + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_actor, args=(i, str(buf / "entries"), seconds, first_step, barrier, results),
                         daemon=True) for i in range(actors)]
    for p in procs:
        p.start()
    learner: dict[str, Any] = {"batches": 0, "entries": 0, "bytes": 0, "priority_lines": 0, "td_abs_mean": None,
                               "waited_s": None, "errors": 0, "error": None}
    actor_results: list[dict] = []
    rng = np.random.default_rng(7)
    try:
        barrier.wait(timeout=120)
        start = time.perf_counter()
        deadline = start + seconds
        # Wait for min_size_to_sample entries: O_NONBLOCK opens fail with EAGAIN until then.
        fd, waited = _open_batch(buf / "batch" / f"{LEARNER_BATCH}.npz", deadline + 30)
        os.close(fd)
        learner["waited_s"] = round(waited, 3)
        learn_start = time.perf_counter()
        value, tds = 0.5, []
        while time.perf_counter() < deadline:
            try:
                n, nbytes, lines, td, value = _learner_step(buf, value, rng)
            except OSError as exc:
                learner["errors"] += 1
                learner["error"] = str(exc)
                if exc.errno not in (errno.EAGAIN, errno.ENOENT) or learner["errors"] > 20:
                    break
                continue
            learner["batches"] += 1
            learner["entries"] += n
            learner["bytes"] += nbytes
            learner["priority_lines"] += lines
            tds.append(td)
        learn_s = time.perf_counter() - learn_start
        learner["elapsed_s"] = round(learn_s, 3)
        learner["td_abs_mean"] = round(float(np.mean(tds)), 4) if tds else None
        for _ in procs:
            actor_results.append(results.get(timeout=seconds + 60))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    actor_results.sort(key=lambda r: r["actor"])

    stats = _read_json(buf / "stats.json")
    store = _read_json(mnt / ".distorefs" / "stats.json")
    inserts = sum(r["inserts"] for r in actor_results)
    ins_bytes = sum(r["bytes"] for r in actor_results)
    span = max((r.get("elapsed_s", 0.0) for r in actor_results), default=0.0) or seconds
    learn_s = learner["elapsed_s"] or 1e-9
    delta = {k: stats.get(k, 0) - before.get(k, 0)
             for k in ("inserts", "rewrites", "evictions", "batches", "sampled_entries", "priority_updates",
                       "priority_unknown_keys", "presampled_used")}
    result = {
        "mount": str(mnt),
        "actors": actors,
        "seconds": seconds,
        "entry_bytes": int(np.prod(FRAME_SHAPE)) + 128,
        "per_actor": [{"actor": r["actor"], "inserts": r["inserts"],
                       "inserts_per_s": round(r["inserts"] / r["elapsed_s"], 1) if r.get("elapsed_s") else 0.0,
                       "latency_ms_p50_p99": r["latency_ms"], "errors": r["errors"], "error": r["error"]}
                      for r in actor_results],
        "inserts": inserts,
        "inserts_per_s": round(inserts / span, 1),
        "insert_mb_per_s": round(_mb(ins_bytes) / span, 1),
        "learner": {**learner,
                    "batches_per_s": round(learner["batches"] / learn_s, 1),
                    "entries_per_s": round(learner["entries"] / learn_s, 1),
                    "mb_per_s": round(_mb(learner["bytes"]) / learn_s, 1)},
        "priority_updates_sent": learner["priority_lines"],
        "buffer_delta": delta,
        "final_entries": stats.get("entries"),
        "compression_ratio": stats.get("compression_ratio"),
        "buffer_stats": stats,
        "store_tiers": store.get("tiers"),
        "store_cache": store.get("memory", {}).get("cache"),
    }
    if not quiet:
        _print_report(result)
    return result


def _print_report(r: dict) -> None:
    print()
    print("actors (insert = create + write + close of one .npy entry):")
    for a in r["per_actor"]:
        lat = a["latency_ms_p50_p99"]
        lat_s = f"  latency p50 {lat[0]:.2f} ms, p99 {lat[1]:.2f} ms" if lat else ""
        err = f"  errors {a['errors']} (last: {a['error']})" if a["errors"] or a["error"] else ""
        print(f"  actor{a['actor']}: {a['inserts']:6d} inserts  {a['inserts_per_s']:8.1f}/s{lat_s}{err}")
    print(f"  total: {r['inserts']} inserts, {r['inserts_per_s']:.0f} inserts/s, {r['insert_mb_per_s']:.1f} MB/s")
    ln = r["learner"]
    print(f"learner (batch/{LEARNER_BATCH}.npz -> np.load -> fake TD error -> one write to priorities):")
    print(f"  waited {ln['waited_s']}s for {MIN_ENTRIES} entries, then {ln['batches']} batches in "
          f"{ln['elapsed_s']}s: {ln['batches_per_s']:.1f} batches/s, {ln['entries_per_s']:.0f} entries/s, "
          f"{ln['mb_per_s']:.1f} MB/s; mean |TD| {ln['td_abs_mean']}")
    if ln["errors"]:
        print(f"  learner errors: {ln['errors']} (last: {ln['error']})")
    d = r["buffer_delta"]
    print(f"  priority updates: {r['priority_updates_sent']} sent, {d['priority_updates']} applied, "
          f"{d['priority_unknown_keys']} for entries already evicted")
    s = r["buffer_stats"]
    print(f"buffers/{BUFFER}: {r['final_entries']} entries (capacity {s.get('capacity')}), "
          f"this run: +{d['inserts']} inserts, {d['rewrites']} rewrites, {d['evictions']} evictions, "
          f"{d['batches']} batches drawn ({d['presampled_used']} pre-sampled)")
    ratio = r["compression_ratio"]
    print(f"  {_mb(s.get('bytes', 0)):.1f} MB of entries stored in {_mb(s.get('stored_bytes', 0)):.1f} MB"
          f" (compression ratio {ratio if ratio is not None else '-'}); by tier: " +
          ", ".join(f"{t} {v['entries']} entries / {_mb(v['stored_bytes']):.1f} MB"
                    for t, v in (s.get("tiers") or {}).items()))
    print(f"  max_priority {s.get('max_priority')}, priority_total {s.get('priority_total')}, "
          f"drawable {s.get('drawable')}")
    tiers = r["store_tiers"] or {}
    print("store tiers (.distorefs/stats.json): " + ", ".join(
        f"{t}: used {_mb(v.get('used_bytes', 0)):.1f} MB, live {_mb(v.get('live_bytes', 0)):.1f} MB"
        for t, v in tiers.items()))
    c = r["store_cache"] or {}
    if c:
        print(f"memory tier: {_mb(c.get('used_bytes', 0)):.1f} of {_mb(c.get('capacity_bytes', 0)):.0f} MB, "
              f"{c.get('values')} values, hit rate {c.get('hit_rate')}")


if __name__ == "__main__":
    import sys
    # MOUNTPOINT [ACTORS]: the two calls spelled out, as a star of ints could (for a type checker) reach `quiet`
    if len(sys.argv) > 2:
        run_workload(Path(sys.argv[1]), int(sys.argv[2]))
    else:
        run_workload(Path(sys.argv[1]))


DATASET = "demo-frames"


def run_dataset_epoch(mnt: Path, items: int = 2000, item_bytes: int = 16 << 10, quiet: bool = False,
                      name: str = DATASET) -> dict:
    """Stage a small generated tree into datasets/, then read one shuffled epoch along a
    declared order (what a data loader using EpochSampler does); print and return numbers."""
    import json
    import tempfile

    from distorefs.loader import EpochSampler, MountedDataset

    from .stage import is_sealed, stage

    say = (lambda *a: None) if quiet else print
    ds_dir = Path(mnt) / "datasets" / name
    result: dict = {"items": items}
    if not is_sealed(str(ds_dir)):
        with tempfile.TemporaryDirectory(prefix="distorefs-demo-src-") as src:
            rng = np.random.default_rng(0)
            for i in range(items):
                sub = Path(src) / f"shard{i % 16:02d}"
                sub.mkdir(exist_ok=True)
                (sub / f"frame{i:06d}.bin").write_bytes(rng.integers(0, 16, item_bytes, dtype=np.uint8).tobytes())
            t0 = time.perf_counter()
            report = stage(src, str(ds_dir), progress=False)
            dt = time.perf_counter() - t0
        result["stage"] = {"seconds": round(dt, 2), "files_per_s": round(items / dt, 1), "copied": report.ok,
                           "skipped": report.skipped, "errors": len(report.errors)}
        say(f"\ndatasets/{name}: staged {items} files of {item_bytes >> 10} KB in {dt:.2f}s "
            f"({items / dt:.0f} files/s, every file verified), sealed")
    data = MountedDataset(ds_dir, direct=False)  # through the mount: the prefetch it reports
    sampler = EpochSampler(data, seed=int(time.time()))
    before = json.loads((ds_dir / "stats.json").read_bytes())["prefetch"]
    t0 = time.perf_counter()
    nbytes = sum(len(data[i]) for i in sampler)
    dt = time.perf_counter() - t0
    s = json.loads((ds_dir / "stats.json").read_bytes())
    after = s["prefetch"]
    hits = after["hits"] + after["late"] - before["hits"] - before["late"]
    misses = after["misses"] - before["misses"]
    result["epoch"] = {"seconds": round(dt, 2), "items_per_s": round(len(data) / dt, 1),
                       "mb_per_s": round(_mb(nbytes) / dt, 1), "prefetch_hits": hits, "prefetch_misses": misses,
                       "compression_ratio": round(s["bytes"] / max(1, s["stored_bytes"]), 2)}
    say(f"one shuffled epoch (order declared by EpochSampler): {len(data)} items in {dt:.2f}s "
        f"({len(data) / dt:.0f} items/s, {_mb(nbytes) / dt:.1f} MB/s), prefetch hits {hits}, misses {misses}; "
        f"stored {_mb(s['stored_bytes']):.1f} MB for {_mb(s['bytes']):.1f} MB")
    return result

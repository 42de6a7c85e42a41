"""The cost of every operation: FUSE requests per operation and daemon CPU per request.

`distorefs bench ops [--quick] [--out DIR] [--workdir DIR]` runs each operation a user does
on a distorefs mount, one process, one after another, and the same operation on

- the floor: a minimal in-memory pyfuse3 filesystem (tools/floorfs.py) holding files of
  the same sizes: what pyfuse3 and the kernel cost per request, with nothing behind them;
- bindfs (a C FUSE passthrough) over a directory on the store's disk (ext4 here).

For each operation it reports the rate, the FUSE requests per operation by type (distorefs
and the floor count what they answer), and the serving process's CPU time per operation
and per request. The target (issue "The file path at the binding's floor"): distorefs'
CPU per request within 2x of the floor's on every path.

Operations (the floor and bindfs do the plain-file equivalent of each):
  insert_110k       np.save of a 110 KB uint8 frame into buffers/B/entries/ (create, write, close)
  insert_npz        np.savez of a small transition (obs, action, reward, done) into entries/
  read_entry        open + read of a random 110 KB entry
  sample_64         open + read of sample/64 (floor: a file of the same size, not cached)
  batch_64_npz      np.load of batch/64.npz of small .npz entries (floor: an npz of the same size)
  batch_64_npy      np.load of batch/64.npz of 110 KB .npy entries (7 MB)
  priorities_64     a write of 64 "KEY PRIORITY" lines to priorities
  weights_200m      open + read of a 200 MB weights version (warm after the first)
  dataset_10k       open + read of a random 10 KB item of a sealed dataset
  checkpoint_64m    mkdir of a step, a 64 MB file written into it, close

Writes OUT/ops.json and OUT/ops.png; prints a table.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .bench_buffers import (LIVE_MOUNTS, BindfsMount, DistorefsMount, print_report, remove_workdir, save_figure,
                            start_run)
from .floorfs import FloorMount

SYSTEMS = ("floor", "distorefs", "bindfs")
FRAME = (16, 84, 84)  # uint8: 112,896 bytes + 128 of header
TARGET_RATIO = 2.0


def _params(quick: bool) -> dict:
    scale = 0.1 if quick else 1.0
    counts = {"insert_110k": 600, "insert_npz": 1500, "read_entry": 1500, "sample_64": 600, "batch_64_npz": 400,
              "batch_64_npy": 150, "priorities_64": 1000, "weights_200m": 4, "dataset_10k": 2000,
              "checkpoint_64m": 6}
    return {"entries": 2000 if not quick else 300, "items": 4000 if not quick else 500,
            "weights_mb": 200 if not quick else 32, "ckpt_mb": 64 if not quick else 16,
            "counts": {k: max(2, int(v * scale)) for k, v in counts.items()}}


def cpu_ns(pid: int | None) -> int | None:
    """CPU time of every live thread of `pid`, in ns (schedstat: /proc/PID/stat counts 10 ms
    ticks, too coarse for tens of microseconds per operation). Threads that ended during a
    measurement take their time with them; the daemons' worker threads live on."""
    if not pid:
        return None
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        return None
    return total


# ----- payloads ------------------------------------------------------------------------------

def _frame(i: int) -> np.ndarray:
    rng = np.random.default_rng(i % 64)
    a = rng.integers(0, 32, size=FRAME, dtype=np.uint8)  # compressible like game frames, not trivially
    a.flat[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return a


def _transition(i: int) -> dict[str, np.ndarray | np.generic]:
    rng = np.random.default_rng(i)
    return {"obs": rng.standard_normal(8).astype(np.float32), "action": np.int64(i % 4),
            "reward": np.float32(rng.standard_normal()), "done": np.bool_(i % 100 == 0)}


def _npz_bytes(arrays: dict) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


# ----- the systems -------------------------------------------------------------------------------

class Floor(FloorMount):
    def __init__(self, root: Path) -> None:
        super().__init__(root / "floor")

    def mount(self) -> None:
        LIVE_MOUNTS.add(self)  # taken down on SIGINT/SIGTERM with the others
        super().mount()


class Distorefs:
    name = "distorefs"

    def __init__(self, root: Path) -> None:
        self.m = DistorefsMount(root / "store", root / "mnt")
        self.mnt = self.m.mnt

    @property
    def pid(self) -> int | None:
        return self.m.pid

    def mount(self) -> None:
        self.m.mount()

    def umount(self) -> None:
        self.m.umount()

    def requests(self) -> Counter:
        with open(self.mnt / ".distorefs" / "stats.json", "rb") as f:
            return Counter(json.loads(f.read())["mount"]["requests"])


class Bindfs:
    name = "bindfs"

    def __init__(self, root: Path) -> None:
        self.src = root / "plain"
        self.src.mkdir(parents=True, exist_ok=True)
        self.b = BindfsMount(self.src, root / "bindmnt")
        self.mnt = self.b.mnt

    @property
    def pid(self) -> int | None:
        return self.b.pid

    def mount(self) -> None:
        self.b.mount()

    def umount(self) -> None:
        self.b.umount()

    def requests(self) -> Counter | None:
        return None


# ----- where each operation's files are, per system ---------------------------------------

class Layout:
    """The paths an operation uses on one system (distorefs' tree, or plain directories)."""

    def __init__(self, system: str, mnt: Path) -> None:
        self.system = system
        self.mnt = mnt
        d = system == "distorefs"
        self.frames = mnt / ("buffers/frames/entries" if d else "frames")
        self.trans = mnt / ("buffers/trans/entries" if d else "trans")
        self.sample = mnt / "buffers/frames/sample/64" if d else mnt / "sample64.direct"
        self.batch_npz = mnt / "buffers/trans/batch/64.npz" if d else mnt / "batchnpz.direct"
        self.batch_npy = mnt / "buffers/frames/batch/64.npz" if d else mnt / "batchnpy.direct"
        self.priorities = mnt / "buffers/frames/priorities" if d else mnt / "priorities.direct"
        self.weights = mnt / ("weights/ops/model.bin" if d else "weights/model.bin")
        self.items = mnt / ("datasets/ops/items" if d else "dataset")
        self.ckpt = mnt / ("checkpoints/ops" if d else "ckpt")


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _setup_distorefs(lay: Layout, p: dict, log) -> dict:
    mnt = lay.mnt
    for name, config in (("frames", {"capacity": 1_000_000, "sampler": "prioritized"}),
                         ("trans", {"capacity": 1_000_000, "sampler": "prioritized"})):
        (mnt / "buffers" / name).mkdir()
        _write(mnt / "buffers" / name / "config.json", json.dumps(config).encode())
    sizes = {}
    log(f"  distorefs: {p['entries']} frames, {p['entries']} transitions, a {p['weights_mb']} MB weights file, "
        f"{p['items']} dataset items")
    for i in range(p["entries"]):
        np.save(lay.frames / f"f{i:07d}.npy", _frame(i))
        _write(lay.trans / f"t{i:07d}.npz", _npz_bytes(_transition(i)))
    _setup_common(lay, p)
    os.mkdir(mnt / "datasets" / "ops")
    _fill_items(lay.items, p["items"])
    os.setxattr(mnt / "datasets" / "ops", "user.distorefs.sealed", b"1")
    (mnt / "checkpoints" / "ops").mkdir()
    for path in (lay.sample, lay.batch_npz, lay.batch_npy):
        with open(path, "rb") as f:
            sizes[path.name + ("" if path is lay.sample else f"-{path.parent.parent.name}")] = len(f.read())
    return sizes


def _fill_items(items: Path, n: int) -> None:
    rng = np.random.default_rng(5)
    blob = rng.integers(0, 64, size=10_240 + 64, dtype=np.uint8).tobytes()
    for i in range(n):
        d = items / f"d{i // 500:03d}"
        if i % 500 == 0:
            d.mkdir(exist_ok=True)
        _write(d / f"i{i:07d}.bin", blob[i % 64:i % 64 + 10_240])


def _setup_common(lay: Layout, p: dict) -> None:
    lay.weights.parent.mkdir(parents=True, exist_ok=True)
    chunk = np.random.default_rng(3).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()
    with open(lay.weights, "wb") as f:
        for _ in range(p["weights_mb"]):
            f.write(chunk)


def _setup_plain(lay: Layout, p: dict, sizes: dict) -> None:
    for d in (lay.frames, lay.trans, lay.items):
        d.mkdir(parents=True, exist_ok=True)
    for i in range(p["entries"]):
        np.save(lay.frames / f"f{i:07d}.npy", _frame(i))
        _write(lay.trans / f"t{i:07d}.npz", _npz_bytes(_transition(i)))
    _setup_common(lay, p)
    _fill_items(lay.items, p["items"])
    lay.ckpt.mkdir()
    rng = np.random.default_rng(9)
    # files of the sizes distorefs' generated files had (one that parses as .npz for np.load)
    _write(lay.sample, b"x" * sizes["64"])
    for path, key in ((lay.batch_npz, "64.npz-trans"), (lay.batch_npy, "64.npz-frames")):
        target = sizes[key]
        pad = max(1, target - 600)
        _write(path, _npz_bytes({"data": rng.integers(0, 256, size=pad, dtype=np.uint8)}))
    _write(lay.priorities, b"")


# ----- the operations ------------------------------------------------------------------------

def _read_whole(path: Path) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def _ops(lay: Layout, p: dict, run_id: int) -> dict[str, Callable[[int], None]]:
    rng = np.random.default_rng(run_id)
    frames = [_frame(10_000_000 + i) for i in range(8)]
    trans = [_npz_bytes(_transition(i)) for i in range(64)]
    entry_names = [f"f{i:07d}.npy" for i in range(p["entries"])]
    item_paths = [lay.items / f"d{i // 500:03d}" / f"i{i:07d}.bin" for i in range(p["items"])]
    prio_lines = None
    ckpt_blob = np.random.default_rng(4).integers(0, 256, size=p["ckpt_mb"] << 20, dtype=np.uint8).tobytes()

    def insert_110k(i: int) -> None:
        a = frames[i % 8]
        a.flat[8:16] = np.frombuffer((run_id * 1_000_000 + i).to_bytes(8, "little"), dtype=np.uint8)
        np.save(lay.frames / f"n{run_id}-{i:07d}.npy", a)

    def insert_npz(i: int) -> None:
        _write(lay.trans / f"n{run_id}-{i:07d}.npz", trans[i % 64])

    def read_entry(i: int) -> None:
        _read_whole(lay.frames / entry_names[int(rng.integers(len(entry_names)))])

    def sample_64(i: int) -> None:
        _read_whole(lay.sample)

    def batch(path: Path) -> Callable[[int], None]:
        def load(i: int) -> None:
            with np.load(path) as z:
                for k in z.files:
                    z[k]
        return load

    def priorities_64(i: int) -> None:
        nonlocal prio_lines
        if prio_lines is None:
            keys = rng.choice(len(entry_names), size=64)
            prio_lines = [entry_names[k] for k in keys]
        text = "".join(f"{k} {0.1 + (i * 7 + j) % 97 / 10:.4f}\n" for j, k in enumerate(prio_lines))
        with open(lay.priorities, "w") as f:
            f.write(text)

    def weights_200m(i: int) -> None:
        buf = bytearray(1 << 20)
        with open(lay.weights, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    def dataset_10k(i: int) -> None:
        _read_whole(item_paths[int(rng.integers(len(item_paths)))])

    def checkpoint_64m(i: int) -> None:
        step = lay.ckpt / f"r{run_id}-step{i:05d}"
        step.mkdir()
        with open(step / "model.bin", "wb") as f:
            f.write(ckpt_blob)

    return {"insert_110k": insert_110k, "insert_npz": insert_npz, "read_entry": read_entry, "sample_64": sample_64,
            "batch_64_npz": batch(lay.batch_npz), "batch_64_npy": batch(lay.batch_npy),
            "priorities_64": priorities_64, "weights_200m": weights_200m, "dataset_10k": dataset_10k,
            "checkpoint_64m": checkpoint_64m}


OPS = ("insert_110k", "insert_npz", "read_entry", "sample_64", "batch_64_npz", "batch_64_npy", "priorities_64",
       "weights_200m", "dataset_10k", "checkpoint_64m")


def _measure(system, op: Callable[[int], None], count: int, snapshot_cost: Counter) -> dict:
    op(0)  # warm-up: the first of a kind starts pre-sampling, opens files
    before = system.requests()
    cpu0 = cpu_ns(system.pid)
    t0 = time.perf_counter()
    for i in range(1, count + 1):
        op(i)
    wall = time.perf_counter() - t0
    cpu1 = cpu_ns(system.pid)
    after = system.requests()
    out: dict[str, Any] = {"ops": count, "seconds": round(wall, 4), "ops_per_s": round(count / wall, 1),
                           "cpu_us_per_op": round((cpu1 - cpu0) / count / 1e3, 1) if cpu0 is not None and cpu1 else None}
    if before is not None and after is not None:
        delta = after - before - snapshot_cost
        per_op = {k: round(v / count, 2) for k, v in sorted(delta.items()) if v > 0}
        total = sum(delta.values()) / count
        out["requests_per_op"] = per_op
        out["requests"] = round(total, 2)
        if out["cpu_us_per_op"] is not None and total > 0:
            out["cpu_us_per_request"] = round(out["cpu_us_per_op"] / total, 1)
    return out


def _snapshot_cost(system) -> Counter:
    """Requests that one `requests()` call itself adds (subtracted from every measurement)."""
    a = system.requests()
    if a is None:
        return Counter()
    b = system.requests()
    return b - a


def format_table(res: dict) -> str:
    lines = [f"{'operation':16s} {'ops/s floor':>11s} {'distorefs':>10s} {'bindfs':>9s} | "
             f"{'req/op fl':>9s} {'dfs':>6s} | {'cpu us/op fl':>12s} {'dfs':>8s} {'bindfs':>8s} | "
             f"{'us/req fl':>9s} {'dfs':>7s} {'ratio':>6s}"]
    for op in OPS:
        r = res.get(op, {})
        f, d, b = r.get("floor", {}), r.get("distorefs", {}), r.get("bindfs", {})

        def g(x: dict, k: str, fmt: str) -> str:
            v = x.get(k)
            return "-" if v is None else format(v, fmt)
        ratio = r.get("cpu_per_request_ratio")
        lines.append(f"{op:16s} {g(f, 'ops_per_s', ',.0f'):>11s} {g(d, 'ops_per_s', ',.0f'):>10s} "
                     f"{g(b, 'ops_per_s', ',.0f'):>9s} | {g(f, 'requests', '.1f'):>9s} {g(d, 'requests', '.1f'):>6s} | "
                     f"{g(f, 'cpu_us_per_op', ',.0f'):>12s} {g(d, 'cpu_us_per_op', ',.0f'):>8s} "
                     f"{g(b, 'cpu_us_per_op', ',.0f'):>8s} | {g(f, 'cpu_us_per_request', '.0f'):>9s} "
                     f"{g(d, 'cpu_us_per_request', '.0f'):>7s} {'-' if ratio is None else f'{ratio:.2f}x':>6s}")
    lines.append("")
    lines.append("requests per operation by type (floor | distorefs):")
    for op in OPS:
        r = res.get(op, {})
        fl = r.get("floor", {}).get("requests_per_op", {})
        ds = r.get("distorefs", {}).get("requests_per_op", {})
        fmt = lambda x: " ".join(f"{k}={v:g}" for k, v in x.items()) or "-"  # noqa: E731
        lines.append(f"  {op:16s} {fmt(fl)} | {fmt(ds)}")
    return "\n".join(lines)


def _plot(res: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = [op for op in OPS if res.get(op, {}).get("cpu_per_request_ratio") is not None]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    x = np.arange(len(ops))
    for k, system in enumerate(("floor", "distorefs")):
        ax1.bar(x + (k - 0.5) * 0.4, [res[op][system].get("cpu_us_per_request", 0) for op in ops], 0.4, label=system)
    ax1.set_xticks(x, ops, rotation=40, ha="right")
    ax1.set_ylabel("daemon CPU per FUSE request (us)")
    ax1.legend()
    ax2.bar(x, [res[op]["cpu_per_request_ratio"] for op in ops], 0.6, color="tab:orange")
    ax2.axhline(TARGET_RATIO, color="red", linestyle="--", label=f"target {TARGET_RATIO}x")
    ax2.set_xticks(x, ops, rotation=40, ha="right")
    ax2.set_ylabel("distorefs / floor CPU per request")
    ax2.legend()
    save_figure(fig, path, title)


def run(out: Path, quick: bool = False, workdir: Path | None = None) -> dict:
    r = start_run(out, workdir)
    out, root, notes, machine = r.out, r.root, r.notes, r.machine
    p = _params(quick)
    print(f"distorefs bench ops{' --quick' if quick else ''}: workdir {root}, {machine['cpus']} CPUs", flush=True)
    systems: dict[str, Floor | Distorefs | Bindfs] = {"floor": Floor(root), "distorefs": Distorefs(root),
                                                      "bindfs": Bindfs(root)}
    res: dict[str, Any] = {}
    errors: list[str] = []
    try:
        for s in systems.values():
            s.mount()
        lays = {name: Layout(name, s.mnt) for name, s in systems.items()}
        sizes = _setup_distorefs(lays["distorefs"], p, lambda m: print(m, flush=True))
        for name in ("floor", "bindfs"):
            _setup_plain(lays[name], p, sizes)
        res["sizes"] = sizes
        res["entry_bytes"] = {"frame": int(np.prod(FRAME)) + 128, "transition": len(_npz_bytes(_transition(0)))}
        costs = {name: _snapshot_cost(s) for name, s in systems.items()}
        for op in OPS:
            res[op] = {}
            for run_id, (name, s) in enumerate(systems.items(), 1):
                try:
                    res[op][name] = _measure(s, _ops(lays[name], p, run_id)[op], p["counts"][op], costs[name])
                except Exception as exc:
                    errors.append(f"{op} on {name}: {type(exc).__name__}: {exc}")
                    res[op][name] = {}
            f, d = res[op].get("floor", {}), res[op].get("distorefs", {})
            if f.get("cpu_us_per_request") and d.get("cpu_us_per_request"):
                res[op]["cpu_per_request_ratio"] = round(d["cpu_us_per_request"] / f["cpu_us_per_request"], 2)
            print(f"  {op:16s} " + "  ".join(f"{n} {res[op][n].get('ops_per_s', 0):,.0f}/s "
                                              f"{res[op][n].get('requests', '-')} req "
                                              f"{res[op][n].get('cpu_us_per_op', '-')} us" for n in systems), flush=True)
        try:
            with open(systems["distorefs"].mnt / ".distorefs" / "stats.json", "rb") as f:
                res["distorefs_stats"] = {k: v for k, v in json.loads(f.read()).items()
                                          if k in ("mount", "memory", "commits", "prefetch")}
        except OSError as exc:
            errors.append(f"stats: {exc}")
    finally:
        for s in systems.values():
            try:
                s.umount()
            except Exception as exc:
                errors.append(f"umount {s.name}: {exc}")
        remove_workdir(root, errors)
    goals = [{"goal": f"{op}: distorefs CPU per request within {TARGET_RATIO:g}x of the floor",
              "value": f"{res[op].get('cpu_per_request_ratio', '-')}x",
              "met": (res[op]["cpu_per_request_ratio"] <= TARGET_RATIO) if "cpu_per_request_ratio" in res[op] else None}
             for op in OPS if op in res]
    table = format_table(res)
    result = {"benchmark": "ops", "quick": quick, "params": p, "machine": machine, "results": res, "goals": goals,
              "notes": notes, "errors": errors, "table": table}
    (out / "ops.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    try:
        _plot(res, out / "ops.png", f"distorefs vs the pyfuse3 floor ({machine['cpus']} CPUs{', quick' if quick else ''})")
    except Exception as exc:
        errors.append(f"plot: {exc}")
    print_report(table, goals, notes, errors)
    print(f"wrote {out / 'ops.json'} and {out / 'ops.png'}")
    return result

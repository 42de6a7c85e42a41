"""Sequence sampling (R2D2's batches): N=32 sequences of L=80 steps of 10 KB, one run.

`distorefs bench sequences [--quick] [--out DIR] [--workdir DIR]` fills a buffer of
`sequence_length` 80 with episodes of 500 steps (20,000 steps; --quick 4,000), each step an
.npz of about 10 KB (an incompressible uint8 observation, an action, a reward), then, each
phase for a fixed time, in this process:

a) `batch/32.npz` of a uniform buffer, np.load and every array taken (N, L, ...);
b) the learner loop of a prioritized buffer: a) plus a `priorities` write of every real
   step of the batch (2,560 lines), as a learner writing back per-step TD errors does;
c) `distorefs.client` sample(32) (values read from the store's files in this process);
d) the in-process baseline, measured in the same run: the same steps in numpy arrays,
   uniform starts sliced to (32, 80, ...) with their mask (the padding zeroed), and its
   prioritized form (starts from a sum tree over per-sequence priorities, 32 of them
   updated per batch).

Sequences per second, the bytes they carry, the daemon's CPU and how busy the machine was.
Writes OUT/sequences.json and OUT/sequences.png; prints a table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .bench_buffers import DistorefsMount, _CpuMeter, print_report, remove_workdir, save_figure, start_run
from .bench_rl import _one_thread

N, LENGTH = 32, 80
EPISODE = 500  # steps per episode
OBS = 9_700  # uint8: with its .npz framing a step is about 10 KB


def _params(quick: bool) -> dict:
    return {"steps": 4_000 if quick else 20_000, "seconds": 3.0 if quick else 10.0}


def _step(rng: np.random.Generator, i: int) -> dict[str, np.ndarray | np.generic]:
    return {"obs": rng.integers(0, 256, OBS, dtype=np.uint8), "action": np.int64(i % 18),
            "reward": np.float32(i % 7)}


def _key(i: int) -> str:
    return f"ep{i // EPISODE:05d}.{i % EPISODE:06d}"


def _timed(seconds: float, once: Callable[[], int], pid: int | None = None) -> dict:
    """Call once() (it returns the sequences it took) for `seconds`: sequences/s and CPU."""
    once()  # warm: the first open, the first draw ahead
    meter = _CpuMeter(pid)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        count += once()
    dt = time.perf_counter() - t0
    return {"sequences_per_s": round(count / dt, 1), "batches": count // N, **meter.done()}


def _check(batch: dict[str, np.ndarray]) -> int:
    mask = batch["mask"]
    assert batch["obs"].shape == (N, LENGTH, OBS) and mask.shape == (N, LENGTH), {k: v.shape for k, v in batch.items()}
    return N


# ----- through the mount ----------------------------------------------------------------------

def _distorefs(root: Path, p: dict) -> dict:
    from distorefs.client import open_buffer
    mount = DistorefsMount(root / "store", root / "mnt")
    mount.mount()
    try:
        buf = mount.mnt / "buffers" / "r2d2"
        buf.mkdir()
        (buf / "config.json").write_text(json.dumps({"capacity": p["steps"], "sequence_length": LENGTH, "seed": 1}))
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        with open_buffer(buf, direct=True) as client:
            for i in range(p["steps"]):
                client.insert(_key(i), _step(rng, i))
            assert client.flush() == p["steps"]
        res: dict[str, Any] = {"fill_steps_per_s": round(p["steps"] / (time.perf_counter() - t0), 1)}
        res["step_bytes"] = (buf / "entries" / _key(0)).stat().st_size

        def files() -> int:
            with np.load(buf / "batch" / f"{N}.npz") as z:
                return _check({k: z[k] for k in z.files})

        res["files_uniform"] = _timed(p["seconds"], files, mount.pid)
        print(f"  batch/{N}.npz uniform: {res['files_uniform']}", flush=True)
        with open_buffer(buf, direct=True) as client:
            res["client_uniform"] = _timed(p["seconds"], lambda: _check(client.sample(N)), mount.pid)
        print(f"  client sample({N}) uniform: {res['client_uniform']}", flush=True)

        (buf / "config.json").write_text(json.dumps({"sampler": "prioritized"}))
        prio = np.random.default_rng(1)

        def learner() -> int:
            with np.load(buf / "batch" / f"{N}.npz") as z:
                batch = {k: z[k] for k in z.files}
            keys = batch["keys"][batch["mask"]]
            td = prio.random(len(keys)) + 0.01
            with open(buf / "priorities", "w") as f:
                f.write("".join(f"{k} {v:.6f}\n" for k, v in zip(keys.tolist(), td.tolist())))
            return _check(batch)

        res["files_prioritized_learner"] = _timed(p["seconds"], learner, mount.pid)
        print(f"  batch/{N}.npz prioritized + priorities: {res['files_prioritized_learner']}", flush=True)
        stats = json.loads((buf / "stats.json").read_bytes())
        res["sequences"] = stats.get("sequences")
        return res
    finally:
        mount.umount()


# ----- in process -----------------------------------------------------------------------------

class _InProcess:
    """The same steps in numpy arrays, sliced to (N, L, ...) sequences as a learner's own
    buffer would: uniform starts, or starts from a sum tree over per-sequence priorities."""

    def __init__(self, steps: int) -> None:
        rng = np.random.default_rng(0)
        rows = [_step(rng, i) for i in range(steps)]
        self.fields = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        index = np.arange(steps)
        self.episode_end = (index // EPISODE + 1) * EPISODE  # one past each step's episode's last step
        np.minimum(self.episode_end, steps, out=self.episode_end)
        self.rng = np.random.default_rng(2)
        from distorefs.sumtree import SumTree
        self.tree = SumTree(steps)
        self.tree.update(index, np.ones(steps))

    def batch(self, starts: np.ndarray) -> dict[str, np.ndarray]:
        at = starts[:, None] + np.arange(LENGTH)
        mask = at < self.episode_end[starts][:, None]
        at = np.where(mask, at, starts[:, None])
        out = {}
        for name, a in self.fields.items():
            b = a[at]  # the gather copies, as a batch must
            b[~mask] = 0
            out[name] = b
        out["mask"] = mask
        return out

    def uniform(self) -> int:
        return _check(self.batch(self.rng.integers(0, len(self.episode_end), N)))

    def prioritized(self) -> int:
        starts = self.tree.sample(N, self.rng)
        batch = self.batch(starts)
        self.tree.update(starts, self.rng.random(N) + 0.01)
        return _check(batch)


# ----- report ---------------------------------------------------------------------------------

def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def _rows(res: dict) -> list[tuple[str, Any, Any]]:
    d, i = res.get("distorefs") or {}, res.get("in_process") or {}

    def rate(part: dict, name: str):
        return (part.get(name) or {}).get("sequences_per_s")
    return [(f"batch/{N}.npz + np.load, uniform (sequences/s)", rate(d, "files_uniform"), rate(i, "uniform")),
            (f"the same, prioritized + {N}x{LENGTH} priorities written (sequences/s)",
             rate(d, "files_prioritized_learner"), rate(i, "prioritized")),
            (f"distorefs.client sample({N}), uniform (sequences/s)", rate(d, "client_uniform"), rate(i, "uniform"))]


def format_table(res: dict) -> str:
    step = (res.get("distorefs") or {}).get("step_bytes") or 10_000
    lines = [f"{'measure (N=32, L=80, %d B steps)' % step:64s} {'distorefs':>10s} {'in-process':>11s} "
             f"{'ratio':>7s} {'GB/s':>6s}"]
    for text, d, i in _rows(res):
        gbs = "-" if d is None else f"{d * LENGTH * step / 1e9:.2f}"
        lines.append(f"{text:64s} {'-' if d is None else f'{d:,.1f}':>10s} {'-' if i is None else f'{i:,.1f}':>11s} "
                     f"{'-' if _ratio(d, i) is None else f'{_ratio(d, i):.2f}x':>7s} {gbs:>6s}")
    return "\n".join(lines)


def _plot(res: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    rows = _rows(res)
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [d or 0 for _, d, _ in rows], 0.4, label="distorefs")
    ax.bar(x + 0.2, [i or 0 for _, _, i in rows], 0.4, label="in-process (numpy)")
    ax.set_xticks(x, ["batch npz\nuniform", "batch npz prioritized\n+ priorities", "client\nuniform"])
    ax.set_ylabel("sequences/s")
    ax.legend()
    save_figure(fig, path, title)


def run(out: Path, quick: bool = False, workdir: Path | None = None) -> dict:
    r = start_run(out, workdir)
    out, root, notes, machine = r.out, r.root, r.notes, r.machine
    p = _params(quick)
    _one_thread()
    print(f"distorefs bench sequences{' --quick' if quick else ''}: workdir {root}, {machine['cpus']} CPUs", flush=True)
    res: dict[str, Any] = {}
    errors: list[str] = []
    try:
        try:
            res["distorefs"] = _distorefs(root, p)
        except Exception as exc:
            errors.append(f"distorefs: {type(exc).__name__}: {exc}")
        try:
            inproc = _InProcess(p["steps"])
            res["in_process"] = {"uniform": _timed(p["seconds"], inproc.uniform),
                                 "prioritized": _timed(p["seconds"], inproc.prioritized)}
            print(f"  in-process: {res['in_process']}", flush=True)
        except Exception as exc:
            errors.append(f"in-process: {type(exc).__name__}: {exc}")
    finally:
        remove_workdir(root, errors)
    notes.append("the page cache is not dropped: steps are read from the daemon's memory tier and LMDB's pages, as a "
                 "learner sampling a warm buffer reads them")
    table = format_table(res)
    doc = {"benchmark": "sequences", "quick": quick, "params": {**p, "n": N, "length": LENGTH, "episode": EPISODE},
           "machine": machine, "results": res, "goals": [], "notes": notes, "errors": errors, "table": table}
    (out / "sequences.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    try:
        _plot(res, out / "sequences.png", f"distorefs sequence sampling ({machine['cpus']} CPUs"
                                          f"{', quick' if quick else ''})")
    except Exception as exc:
        errors.append(f"plot: {exc}")
    print_report(table, [], notes, errors)
    print(f"wrote {out / 'sequences.json'} and {out / 'sequences.png'}")
    return doc

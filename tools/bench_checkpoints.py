"""Checkpoint benchmark: what a trainer waits for, and a training loop that checkpoints.

`distorefs bench checkpoints [--quick] [--out DIR] [--workdir DIR]` runs:

1. **One checkpoint** of 2 GiB (one 1.5 GiB file and 128 files of 4 MiB; --quick: 192 MiB
   and 32 x 2 MiB), written by a fresh process in 64 MiB write() calls of incompressible
   bytes, twice per system (the second write of a daemon whose buffers are warm is what
   a training job sees from its second checkpoint on):
   - distorefs: MNT/checkpoints/bench/STEP, with `writeback_bytes` sized to the checkpoint
     (1.25x, as a job would set it; `--default-budget`: the default share); *visible* =
     until every close() returned;
     *durable* = until an fsync of the step directory returned (then the step is complete
     and RUN/latest names it);
   - ext4 (the work directory's file system): write and close every file, then fsync
     every file and the directory; visible = durable = all of that (a checkpoint not
     fsynced is not safe), the write-only time is reported too;
   - tmpfs: write and close (visible; never durable).
   Then the checkpoint is read back whole by a fresh process (resume), page cache warm.
2. **A training loop**: one process doing CPU-bound steps of ~200 ms (the same fixed
   amount of pure-Python work per step in every run, calibrated once), saving a
   checkpoint (np.save of a 256 MiB state, --quick 64 MiB, plus a small meta.json into a
   new STEP directory) every 10 steps: without checkpoints, to distorefs (np.save only),
   and to ext4 (np.save + fsync of the files and the directory). Steps/s of each; for
   distorefs also the time until the last checkpoint was durable after the loop.

Reported: times, GB/s, the daemon's RSS (sampled every 0.2 s) and CPU, and the goals
of issue 5: distorefs visible time <= 0.5x ext4 write+fsync; training loop with distorefs
checkpoints >= 95% of the no-checkpoint rate. Writes `OUT/checkpoints.json` and
`OUT/checkpoints.png`, prints a table, returns the JSON dict.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

if __package__:
    from .bench_buffers import (DistorefsMount, _CpuMeter, _other_load, print_report, remove_workdir, save_figure,
                                start_run)
    from .bench_weights import _RssSampler, _Tmpfs
else:  # `python tools/bench_checkpoints.py`
    from distorefs.tools.bench_buffers import (DistorefsMount, _CpuMeter, _other_load, print_report, remove_workdir,
                                               save_figure, start_run)
    from distorefs.tools.bench_weights import _RssSampler, _Tmpfs

SYSTEMS = ("distorefs", "tmpfs", "ext4")
MiB = 1 << 20
BLOCK = 64 * MiB  # one write() call
VISIBLE_GOAL = 0.5  # distorefs visible time <= 0.5x ext4 write+fsync
LOOP_GOAL = 0.95  # training loop >= 95% of the rate without checkpoints


def _params(quick: bool) -> dict:
    if quick:
        return {"big_mib": 192, "small_files": 32, "small_mib": 2, "repeats": 2,
                "loop_steps": 30, "every": 10, "step_ms": 200, "loop_mib": 64}
    return {"big_mib": 1536, "small_files": 128, "small_mib": 4, "repeats": 2,
            "loop_steps": 100, "every": 10, "step_ms": 200, "loop_mib": 256}


def _total_bytes(p: dict) -> int:
    return (p["big_mib"] + p["small_files"] * p["small_mib"]) * MiB


# ----- worker processes (spawned: fresh memory each) ---------------------------------------

def _block() -> memoryview:
    return np.random.default_rng(1).integers(0, 256, BLOCK, dtype=np.uint8).data  # (memoryview(array))


def _write_file(path: Path, size: int, block: memoryview, salt: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < size:
            n = min(BLOCK, size - off)
            start = (salt * 40961) % (BLOCK - n + 1)  # every file and block its own bytes
            view = block[start:start + n]
            while view:
                view = view[os.write(fd, view):]
            off += n
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoint_main(step_dir: str, p: dict, mode: str, results) -> None:
    """Write one checkpoint; mode: distorefs (close, then fsync the directory), ext4 (close,
    then fsync every file and the directory), tmpfs (close)."""
    try:
        block = _block()
        d = Path(step_dir)
        files = [(d / "model.bin", p["big_mib"] * MiB)] + \
                [(d / f"shard-{i:04d}.bin", p["small_mib"] * MiB) for i in range(p["small_files"])]
        t0 = time.perf_counter()
        d.mkdir(parents=True)
        for salt, (path, size) in enumerate(files):
            _write_file(path, size, block, salt)
        closed = time.perf_counter() - t0
        durable = None
        if mode == "ext4":
            for path, _ in files:
                _fsync_path(path)
            _fsync_path(d)
            durable = time.perf_counter() - t0
        elif mode == "distorefs":
            _fsync_path(d)
            durable = time.perf_counter() - t0
        out: dict[str, Any] = {"closed_s": round(closed, 3),
                               "durable_s": None if durable is None else round(durable, 3)}
        if mode == "distorefs":
            out["state"] = os.getxattr(d, "user.distorefs.state").decode()
            out["latest"] = os.readlink(d.parent / "latest")
        results.put(out)
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


def _read_main(step_dir: str, results) -> None:
    try:
        t0 = time.perf_counter()
        total = 0
        buf = bytearray(16 * MiB)
        for path in sorted(Path(step_dir).iterdir()):
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        results.put({"read_s": round(time.perf_counter() - t0, 3), "bytes": total})
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def _work(n: int, x: int = 1) -> int:
    """A fixed amount of CPU work (one core, holds the GIL): the simulated training step."""
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    return x


def _calibrate(step_ms: float) -> int:
    n = 200_000
    best = min(_timed(_work, n) for _ in range(3))
    return max(1, int(n * step_ms / 1000 / best))


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _trainer_main(mode: str, run_dir: str, p: dict, n_work: int, results) -> None:
    """Train for loop_steps steps, checkpointing every `every` (mode none|distorefs|ext4)."""
    try:
        state = np.random.default_rng(2).integers(0, 256, p["loop_mib"] * MiB, dtype=np.uint8)
        run = Path(run_dir)
        if mode != "none":
            run.mkdir(parents=True, exist_ok=True)
        saves, step_times, last = [], [], None
        x = 1
        t0 = time.perf_counter()
        for step in range(1, p["loop_steps"] + 1):
            ts = time.perf_counter()
            x = _work(n_work, x)
            step_times.append(time.perf_counter() - ts)
            if mode != "none" and step % p["every"] == 0:
                tc = time.perf_counter()
                last = run / f"step-{step:06d}"
                last.mkdir()
                np.save(last / "model.npy", state)
                (last / "meta.json").write_text(json.dumps({"step": step}))
                if mode == "ext4":
                    _fsync_path(last / "model.npy")
                    _fsync_path(last / "meta.json")
                    _fsync_path(last)
                saves.append(time.perf_counter() - tc)
        elapsed = time.perf_counter() - t0
        out: dict[str, Any] = {"steps": p["loop_steps"], "elapsed_s": round(elapsed, 3),
                               "steps_per_s": round(p["loop_steps"] / elapsed, 4),
                               "step_ms_mean": round(1000 * float(np.mean(step_times)), 1),
                               "checkpoints": len(saves)}
        if saves:
            out["checkpoint_ms"] = {"mean": round(1000 * float(np.mean(saves)), 1),
                                    "max": round(1000 * max(saves), 1)}
        if mode == "distorefs" and last is not None:
            td = time.perf_counter()
            _fsync_path(last)
            out["last_durable_after_loop_s"] = round(time.perf_counter() - td, 3)
            out["latest"] = os.readlink(run / "latest")
        results.put(out)
    except BaseException as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


def _in_process(target, *args, timeout: float = 900) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, results))
    proc.start()
    try:
        out = results.get(timeout=timeout)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return out


# ----- one system ---------------------------------------------------------------------------

def _one_shot(name: str, mode: str, base: Path, p: dict, pid: int | None, log) -> dict:
    total = _total_bytes(p)
    runs = []
    for r in range(p["repeats"]):
        step = base / f"step-{r}"
        rss = _RssSampler(pid)
        rss.start()
        cpu = _CpuMeter(pid)
        out = _in_process(_checkpoint_main, str(step), p, mode)
        out.update(cpu.done())
        if pid:
            out["daemon_rss"] = {k: v for k, v in (rss.stop() or {}).items() if k != "series"}
        else:
            rss.stop()
        if "error" in out:
            raise RuntimeError(f"{name} checkpoint {r}: {out['error']}\n{out.get('trace', '')}")
        out["visible_s"] = out["durable_s"] if mode == "ext4" else out["closed_s"]
        out["visible_gb_per_s"] = round(total / out["visible_s"] / 1e9, 3)
        read = _in_process(_read_main, str(step))
        if "error" in read:
            raise RuntimeError(f"{name} read back: {read['error']}")
        if read["bytes"] != total:
            raise RuntimeError(f"{name} read back {read['bytes']} bytes of {total}")
        out["read_gb_per_s"] = round(total / read["read_s"] / 1e9, 3)
        runs.append(out)
        durable = "-" if out["durable_s"] is None else f"{out['durable_s']:.2f}s"
        log(f"  {name} #{r + 1}: closes returned {out['closed_s']:.2f}s, durable {durable}, "
            f"read back {out['read_gb_per_s']:.2f} GB/s")
        if mode != "distorefs":
            shutil.rmtree(step, ignore_errors=True)  # distorefs: keep_last retires old steps itself
    return {"runs": runs}


def _loop(mode: str, run_dir: Path, p: dict, n_work: int, pid: int | None, log) -> dict:
    rss = _RssSampler(pid)
    rss.start()
    cpu = _CpuMeter(pid)
    out = _in_process(_trainer_main, mode, str(run_dir), p, n_work)
    out.update(cpu.done())
    summary = rss.stop()
    if pid and summary:
        out["daemon_rss"] = {k: v for k, v in summary.items() if k != "series"}
    if "error" in out:
        raise RuntimeError(f"loop {mode}: {out['error']}\n{out.get('trace', '')}")
    log(f"  loop {mode}: {out['steps_per_s']:.3f} steps/s"
        + (f", checkpoint {out['checkpoint_ms']['mean']:.0f} ms mean" if "checkpoint_ms" in out else ""))
    return out


# ----- report ------------------------------------------------------------------------------

def _grid(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [" | ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
             for r in [head, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _cells(results: dict, columns: list[str], rows: list[tuple]) -> list[list[str]]:
    out = []
    for label, fn in rows:
        line = [label]
        for c in columns:
            r = results.get(c) or {}
            try:
                line.append(fn(r) if r else "-")
            except (KeyError, TypeError, ZeroDivisionError, IndexError):
                line.append("-")
        out.append(line)
    return out


def _table(res: dict, labels: dict[str, str]) -> str:
    def runs(key: str, fmt: str = "{:.2f}"):
        return lambda r: " / ".join("-" if x.get(key) is None else fmt.format(x[key]) for x in r["runs"])

    one = _cells(res.get("one_shot", {}), list(SYSTEMS), [
        ("close() returned, run 1 / 2 (s)", runs("closed_s")),
        ("durable, run 1 / 2 (s)", runs("durable_s")),
        ("trainer-visible, run 1 / 2 (s)", runs("visible_s")),
        ("trainer-visible GB/s, run 1 / 2", runs("visible_gb_per_s")),
        ("read back (resume) GB/s, run 1 / 2", runs("read_gb_per_s")),
        ("daemon RSS max, run 1 / 2 (MB)", lambda r: " / ".join(f"{x['daemon_rss']['max_mb']:.0f}" for x in r["runs"])),
        ("daemon CPU, run 1 / 2 (cores)", runs("server_cpu_cores")),
    ])
    loops = res.get("loop", {})
    base = (loops.get("none") or {}).get("steps_per_s")
    loop = _cells(loops, ["none", "distorefs", "ext4"], [
        ("steps/s", lambda r: f"{r['steps_per_s']:.3f}"),
        ("vs no checkpoints", lambda r: f"{r['steps_per_s'] / base:.1%}"),
        ("checkpoint in the loop, mean / max (ms)",
         lambda r: f"{r['checkpoint_ms']['mean']:.0f} / {r['checkpoint_ms']['max']:.0f}"),
        ("last checkpoint durable after the loop (s)", lambda r: f"{r['last_durable_after_loop_s']:.2f}"),
        ("daemon RSS max (MB)", lambda r: f"{r['daemon_rss']['max_mb']:.0f}"),
    ])
    p = res["params"]
    return "\n\n".join([
        f"one checkpoint of {_total_bytes(p) / 2**30:.2f} GiB\n"
        + _grid([""] + [labels[s] for s in SYSTEMS], one),
        f"training loop: {p['loop_steps']} steps of {p['step_ms']} ms, {p['loop_mib']} MiB checkpoint every "
        f"{p['every']}\n" + _grid(["", "no checkpoints", "distorefs", labels["ext4"]], loop),
    ])


def _goals(res: dict) -> list[dict]:
    goals = []
    one = res.get("one_shot", {})
    d, e = (one.get(s) or {} for s in ("distorefs", "ext4"))
    if d.get("runs") and e.get("runs"):
        dv = [r["visible_s"] for r in d["runs"]]
        ev = [r["visible_s"] for r in e["runs"]]
        ratio = min(dv) / min(ev)
        goals.append({"goal": f"trainer-visible checkpoint time <= {VISIBLE_GOAL}x ext4 write+fsync",
                      "met": ratio <= VISIBLE_GOAL,
                      "value": f"{' / '.join(f'{x:.2f}' for x in dv)} s vs {' / '.join(f'{x:.2f}' for x in ev)} s "
                               f"(best {ratio:.2f}x; first run {dv[0] / ev[0]:.2f}x)"})
    else:
        goals.append({"goal": f"trainer-visible checkpoint time <= {VISIBLE_GOAL}x ext4 write+fsync", "met": None,
                      "value": "not measured"})
    loops = res.get("loop", {})
    if loops.get("none", {}).get("steps_per_s") and loops.get("distorefs", {}).get("steps_per_s"):
        ratio = loops["distorefs"]["steps_per_s"] / loops["none"]["steps_per_s"]
        ext = loops.get("ext4", {}).get("steps_per_s")
        goals.append({"goal": f"training loop >= {LOOP_GOAL:.0%} of the no-checkpoint rate", "met": ratio >= LOOP_GOAL,
                      "value": f"{ratio:.1%} ({loops['distorefs']['steps_per_s']:.3f} vs "
                               f"{loops['none']['steps_per_s']:.3f} steps/s"
                               + (f"; ext4 {ext / loops['none']['steps_per_s']:.1%})" if ext else ")")})
    else:
        goals.append({"goal": f"training loop >= {LOOP_GOAL:.0%} of the no-checkpoint rate", "met": None,
                      "value": "not measured"})
    return goals


def _plot(res: dict, labels: dict[str, str], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    one = res.get("one_shot", {})
    names, visible, durable = [], [], []
    for s in SYSTEMS:
        for i, r in enumerate((one.get(s) or {}).get("runs", [])):
            names.append(f"{labels[s]} #{i + 1}")
            visible.append(r["visible_s"])
            durable.append(r["durable_s"] or 0)
    x = np.arange(len(names))
    ax1.bar(x - 0.2, visible, 0.4, label="trainer-visible (s)")
    ax1.bar(x + 0.2, durable, 0.4, label="durable (s)")
    ax1.set_xticks(x, names, rotation=20, fontsize=8)
    ax1.set_title(f"one {_total_bytes(res['params']) / 2**30:.2f} GiB checkpoint")
    ax1.legend(fontsize=8)
    loops = res.get("loop", {})
    modes = [m for m in ("none", "distorefs", "ext4") if loops.get(m, {}).get("steps_per_s")]
    ax2.bar(modes, [loops[m]["steps_per_s"] for m in modes], color=["gray", "tab:blue", "tab:orange"][:len(modes)])
    ax2.set_title(f"training loop: {res['params']['step_ms']} ms steps, checkpoint every {res['params']['every']}")
    ax2.set_ylabel("steps/s")
    save_figure(fig, path, title, fontsize=10)


# ----- entry point -------------------------------------------------------------------------

def run(out: Path, quick: bool = False, workdir: Path | None = None, fit_budget: bool = True) -> dict:
    """Run the checkpoint benchmark; write OUT/checkpoints.json and .png; return the results."""
    r = start_run(out, workdir)
    out, root, notes, machine, started = r.out, r.root, r.notes, r.machine, r.started
    errors: list[str] = []
    p = _params(quick)
    total = _total_bytes(p)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    labels = {"distorefs": "distorefs", "tmpfs": "tmpfs", "ext4": machine["fs"]["fstype"]}
    if machine["fs"]["fstype"] != "ext4":
        notes.append(f"the 'ext4' column is {machine['fs']['fstype']} (the work directory's file system)")
    log(f"distorefs bench checkpoints{' --quick' if quick else ''}: {total / 2**30:.2f} GiB checkpoint "
        f"({p['big_mib']} MiB + {p['small_files']} x {p['small_mib']} MiB) x{p['repeats']}, loop of "
        f"{p['loop_steps']} x {p['step_ms']} ms steps with a {p['loop_mib']} MiB checkpoint every {p['every']}; "
        f"workdir {root} ({machine['fs']['fstype']}), {machine['cpus']} CPUs")
    result: dict[str, Any] = {"benchmark": "checkpoints", "quick": quick, "params": p, "machine": machine,
                              "goals_text": [f"trainer-visible checkpoint time <= {VISIBLE_GOAL}x ext4 write+fsync",
                                             f"training loop >= {LOOP_GOAL:.0%} of the no-checkpoint rate"],
                              "one_shot": {}, "loop": {}}
    dfs = DistorefsMount(root / "store", root / "mnt")
    tmpfs = _Tmpfs(root, 2 * total)
    n_work = _calibrate(p["step_ms"])
    result["loop_work_units"] = n_work

    def section(what: str, fn) -> None:
        """Run one part; a failure is reported and the others still run."""
        try:
            fn()
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
            log(f"  {what} failed: {exc}")
            traceback.print_exc()

    def on_distorefs() -> None:
        dfs.mount()
        ck = dfs.mnt / "checkpoints"
        if fit_budget:  # a job sizes the write-back budget to its checkpoint (README, checkpoints/)
            memory = json.loads((dfs.mnt / ".distorefs" / "config.json").read_bytes())["memory_bytes"]
            want = min(int(total * 1.25), int(memory * 0.6))
            (ck / "config.json").write_text(json.dumps({"writeback_bytes": want}))
            log(f"  writeback_bytes set to {want / 2**30:.2f} GiB (the checkpoint and a quarter; "
                f"memory_bytes {memory / 2**30:.2f} GiB)")
        result["distorefs_config"] = json.loads((ck / "config.json").read_bytes())
        result["one_shot"]["distorefs"] = _one_shot("distorefs", "distorefs", ck / "bench", p, dfs.pid, log)
        result["loop"]["distorefs"] = _loop("distorefs", ck / "loop", p, n_work, dfs.pid, log)
        result["distorefs_stats"] = json.loads((ck / "stats.json").read_bytes())
        t0 = time.monotonic()
        dfs.umount()  # waits for everything held to be persisted
        result["distorefs_umount_s"] = round(time.monotonic() - t0, 2)

    def on_tmpfs() -> None:
        d = tmpfs.make()
        machine["tmpfs"] = {"dir": str(d), "mounted_for_run": tmpfs.mounted is not None}
        result["one_shot"]["tmpfs"] = _one_shot("tmpfs", "tmpfs", d / "bench", p, None, log)

    def on_disk() -> None:
        result["one_shot"]["ext4"] = _one_shot(labels["ext4"], "ext4", root / "ext4" / "bench", p, None, log)
        result["loop"]["ext4"] = _loop("ext4", root / "ext4" / "loop", p, n_work, None, log)

    def on_nothing() -> None:
        result["loop"]["none"] = _loop("none", root / "none", p, n_work, None, log)

    try:
        for what, fn, done in (("distorefs", on_distorefs, dfs.umount), ("tmpfs", on_tmpfs, tmpfs.remove),
                               (labels["ext4"], on_disk, lambda: shutil.rmtree(root / "ext4", ignore_errors=True)),
                               ("no checkpoints", on_nothing, lambda: None)):
            log(f"[{what}]")
            section(what, fn)
            section(f"cleaning up after {what}", done)
    finally:
        section("unmount", dfs.umount)
        tmpfs.remove()
        remove_workdir(root, errors)
    machine["other_load_cores_end"] = _other_load(0.5)
    goals = _goals(result)
    result.update(labels=labels, goals=goals, notes=notes, errors=errors, elapsed_s=round(time.time() - started, 1))
    table = _table(result, labels)
    result["table"] = table
    json_path, png_path = out / "checkpoints.json", out / "checkpoints.png"
    try:
        _plot(result, labels, png_path, f"distorefs checkpoints/ vs tmpfs and {labels['ext4']} "
                                        f"({machine['cpus']} CPUs{', quick' if quick else ''})")
    except Exception as exc:
        errors.append(f"plot: {type(exc).__name__}: {exc}")
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_report(table, goals, notes, errors)
    print(f"wrote {json_path} and {png_path} in {result['elapsed_s']:.0f}s")
    return result


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="distorefs checkpoints/ benchmark (see the module docstring)")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--default-budget", action="store_true",
                    help="keep the default writeback_bytes (30%% of memory_bytes) instead of fitting the checkpoint")
    a = ap.parse_args()
    run(Path(a.out), quick=a.quick, workdir=Path(a.workdir) if a.workdir else None, fit_budget=not a.default_budget)

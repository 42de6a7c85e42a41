"""Warm-up benchmark: `distorefs warmup` against plain reading of the same tree.

`distorefs bench warmup [--quick] [--out DIR] [--workdir DIR] [--drop-caches]` stages a
dataset of 2,000 files of 100 KB (`items/small`) and 3 of 100 MB (`items/large`)
(--quick: 500 and 2 of 20 MB), then, for each set and each method, remounts the store (the
mount's page cache and the daemon's memory tier start empty) and times one pass over the
set through the mount:

- `distorefs warmup -q DIR` (memory tier, then page cache; 4 threads);
- `cat`: `find DIR -type f -print0 | xargs -0 cat > /dev/null`;
- `cat -P4`: the same with 4 cat processes at once;
- `mmap touch`: what `vmtouch -t` does: map each file and touch one byte per page.

Each method runs `rounds` times in a rotating order; the median is reported (wall time of
the command, the interpreter's start included; `warmup, own time` is the time warmup
itself reports). The store's
own files are in the host's page cache for every method alike (they are not dropped unless
--drop-caches). After each warmup, one `cat` of the set is timed as well: how fast the job
that follows reads.

Writes `OUT/warmup.json` and `OUT/warmup.png`, prints a table, returns the JSON dict.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .bench_buffers import DistorefsMount, _drop_caches, print_report, save_figure, start_run

METHODS = ("warmup", "cat", "cat -P4", "mmap touch")
_TOUCH = ("import mmap, os, sys\n"
          "for root, _, names in os.walk(sys.argv[1]):\n"
          "    for n in names:\n"
          "        with open(os.path.join(root, n), 'rb') as f:\n"
          "            size = os.fstat(f.fileno()).st_size\n"
          "            if size:\n"
          "                with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:\n"
          "                    sum(m[i] for i in range(0, size, mmap.PAGESIZE))\n")


def _params(quick: bool) -> dict:
    if quick:
        return {"small": 500, "small_bytes": 100_000, "large": 2, "large_bytes": 20_000_000, "rounds": 1}
    return {"small": 2000, "small_bytes": 100_000, "large": 3, "large_bytes": 100_000_000, "rounds": 3}


def _commands(method: str, tree: Path) -> list[str] | str:
    if method == "warmup":
        return [sys.executable, "-m", "distorefs.tools.cli", "warmup", "-q", "--json", str(tree)]
    if method == "cat":
        return f"find '{tree}' -type f -print0 | xargs -0 cat > /dev/null"
    if method == "cat -P4":
        return f"find '{tree}' -type f -print0 | xargs -0 -P4 -n 64 cat > /dev/null"
    return [sys.executable, "-c", _TOUCH, str(tree)]


def _timed(cmd) -> tuple[float, str]:
    """(wall seconds, what it printed)."""
    t0 = time.monotonic()
    res = subprocess.run(cmd, shell=isinstance(cmd, str), check=True, stdout=subprocess.PIPE, text=True,
                         timeout=3600)
    return time.monotonic() - t0, res.stdout


def _make_tree(src: Path, p: dict) -> None:
    rng = os.urandom
    (src / "small").mkdir(parents=True)
    (src / "large").mkdir()
    for i in range(p["small"]):
        (src / "small" / f"s{i:05d}.bin").write_bytes(rng(p["small_bytes"]))
    for i in range(p["large"]):
        with open(src / "large" / f"l{i}.bin", "wb") as f:
            for _ in range(0, p["large_bytes"], 1 << 20):
                f.write(rng(min(1 << 20, p["large_bytes"])))
            f.truncate(p["large_bytes"])


def run(out: Path, quick: bool = False, workdir: Path | None = None) -> dict:
    """Run the warm-up benchmark; write OUT/warmup.json and OUT/warmup.png; return the results."""
    r = start_run(out, workdir)
    out, root, notes = r.out, r.root, r.notes
    p = _params(quick)
    print(f"distorefs bench warmup{' --quick' if quick else ''}: {p['small']} x {p['small_bytes'] // 1000} KB and "
          f"{p['large']} x {p['large_bytes'] // 1_000_000} MB, {p['rounds']} round(s); workdir {root}", flush=True)
    src = root / "src"
    _make_tree(src, p)
    dfs = DistorefsMount(root / "store", root / "mnt")
    results: dict = {"benchmark": "warmup", "quick": quick, "params": p, "machine": r.machine, "sets": {}}
    errors: list[str] = []
    try:
        dfs.mount()
        res = subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "stage", "-q", str(src),
                              str(dfs.mnt / "datasets" / "bench")], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"stage failed: {res.stderr or res.stdout}")
        for name, count, size in (("small", p["small"], p["small_bytes"]), ("large", p["large"], p["large_bytes"])):
            tree = dfs.mnt / "datasets" / "bench" / "items" / name
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            after: list[float] = []
            own: list[float] = []  # warmup's own time (without the interpreter's start)
            reports: list[dict] = []
            for rnd in range(p["rounds"]):
                order = METHODS[rnd % len(METHODS):] + METHODS[:rnd % len(METHODS)]
                for method in order:
                    dfs.umount()
                    _drop_caches(notes)
                    dfs.mount()
                    seconds, printed = _timed(_commands(method, tree))
                    times[method].append(seconds)
                    if method == "warmup":
                        reports.append(json.loads(printed))
                        own.append(reports[-1]["seconds"])
                        after.append(_timed(_commands("cat", tree))[0])
            total = count * size
            rows = {}
            for method, ts in times.items():
                t = statistics.median(ts)
                rows[method] = {"seconds": round(t, 3), "mb_per_s": round(total / 1e6 / t, 1),
                                "files_per_s": round(count / t, 1), "runs": [round(x, 3) for x in ts]}
            t = statistics.median(after)
            rows["cat after warmup"] = {"seconds": round(t, 3), "mb_per_s": round(total / 1e6 / t, 1),
                                        "files_per_s": round(count / t, 1)}
            t = statistics.median(own)
            rows["warmup, own time"] = {"seconds": round(t, 3), "mb_per_s": round(total / 1e6 / t, 1),
                                        "files_per_s": round(count / t, 1)}
            results["sets"][name] = {"files": count, "bytes": total, "methods": rows, "warmup_reports": reports}
            print(f"  {name}: " + ", ".join(f"{m} {v['mb_per_s']:.0f} MB/s {v['files_per_s']:.0f} files/s"
                                             for m, v in rows.items()), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, and the mount still goes
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        dfs.umount()
    results["notes"], results["errors"] = notes, errors
    (out / "warmup.json").write_text(json.dumps(results, indent=2) + "\n")
    table = _table(results)
    _plot(results, out / "warmup.png")
    print_report(table, [], notes, errors)
    return results


def _table(results: dict) -> str:
    columns = (*METHODS, "warmup, own time", "cat after warmup")
    lines = ["| set | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, s in results["sets"].items():
        cells = [f"{s['methods'][m]['mb_per_s']:,.0f} MB/s, {s['methods'][m]['files_per_s']:,.0f} files/s"
                 for m in columns]
        lines.append(f"| {s['files']} x {s['bytes'] // s['files'] // 1000:,} KB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sets = list(results["sets"].items())
    if not sets:
        return
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.5))
    axes = axes if len(sets) > 1 else [axes]
    for ax, (name, s) in zip(axes, sets):
        labels = [*METHODS, "cat after warmup"]
        ax.bar(labels, [s["methods"][m]["mb_per_s"] for m in labels],
               color=["tab:blue", "tab:gray", "tab:gray", "tab:gray", "tab:green"])
        ax.set_title(f"{s['files']} files of {s['bytes'] // s['files'] // 1000:,} KB")
        ax.set_ylabel("MB/s")
        ax.tick_params(axis="x", rotation=30)
    save_figure(fig, path, "distorefs warmup vs plain reads through the mount (cold mount)")

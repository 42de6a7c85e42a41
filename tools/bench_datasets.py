"""`distorefs bench datasets`: staging and one shuffled epoch, cold, vs ext4 files and bindfs.

In one run, on one file system: a tree of small items (10 KB, one flat directory) and
one of large items (1 MB, in sub-directories) are generated as plain files. Each tree is
copied with `cp -r` and staged with `distorefs stage` (page cache dropped before each),
then read once in a shuffled order by 1 and 4 reader processes through: the plain files
(ext4), bindfs over them (a C FUSE passthrough), and distorefs with that order declared
(`order` written just before the epoch starts, as EpochSampler does). The page cache is
dropped before every pass, so each is a cold epoch. Also: listing and stat-ing the flat
directory cold (`ls -l`), and the prefetch hit rate of every distorefs pass.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from .bench_buffers import BindfsMount, DistorefsMount, _drop_caches, remove_workdir, save_figure, start_run

GOAL_EPOCH = 1.0  # distorefs cold items/s vs bindfs, 10 KB items, 4 readers (issue 12)
GOAL_EPOCH_READERS = "4"
GOAL_HITS = 0.95
GOAL_STAGE = 0.8  # staging rate vs cp -r


def _params(quick: bool) -> dict:
    if quick:
        return {"small_n": 5000, "small_size": 10 << 10, "big_n": 200, "big_size": 1 << 20, "readers": [1, 4],
                "bigdir_n": [2_000, 20_000]}
    return {"small_n": 100_000, "small_size": 10 << 10, "big_n": 10_000, "big_size": 1 << 20, "readers": [1, 4],
            "bigdir_n": [10_000, 1_000_000]}


def _generate(root: Path, n: int, size: int, per_dir: int, seed: int) -> list[str]:
    """n files of `size` random bytes; per_dir = 0 puts them all in one directory."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        rel = f"d{i // per_dir:04d}/item{i:07d}.bin" if per_dir else f"item{i:07d}.bin"
        path = root / rel
        if per_dir and i % per_dir == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(rng.bytes(size))
        paths.append(rel)
    return paths


def _reader(paths: list[bytes], barrier, results) -> None:
    buf = bytearray(4 << 20)
    mv = memoryview(buf)
    barrier.wait()
    t0 = time.perf_counter()
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [mv])
                total += n
                if n < len(buf):
                    break
        finally:
            os.close(fd)
    results.put((time.perf_counter() - t0, len(paths), total))


def _epoch(paths: list[bytes], readers: int) -> dict:
    """Read `paths` (in order) with `readers` processes, each taking every readers-th path."""
    return timed_readers(_reader, [(paths[k::readers],) for k in range(readers)])


def timed_readers(target, argsets: list[tuple]) -> dict:
    """One forked process per argument tuple, `target(*args, barrier, results)`, started
    together; each puts (seconds, items, bytes). Items and bytes per second of the whole."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(argsets) + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for args in argsets]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    got = [results.get(timeout=3600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    items = sum(g[1] for g in got)
    nbytes = sum(g[2] for g in got)
    return {"seconds": round(wall, 3), "items": items, "bytes": nbytes, "items_per_s": round(items / wall, 1),
            "mb_per_s": round(nbytes / wall / 1e6, 1)}


def _ls_l(directory: Path) -> dict:
    t0 = time.perf_counter()
    n = 0
    with os.scandir(directory) as it:
        for entry in it:
            entry.stat()
            n += 1
    dt = time.perf_counter() - t0
    return {"entries": n, "seconds": round(dt, 3), "entries_per_s": round(n / dt, 1)}


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, timeout=7200)
    return time.perf_counter() - t0


def _prefetch(ds: Path) -> dict:
    return json.loads((ds / "stats.json").read_bytes())["prefetch"]


class Bench:
    def __init__(self, root: Path, quick: bool, notes: list[str]) -> None:
        self.root = root
        self.p = _params(quick)
        self.notes = notes
        self.res: dict[str, Any] = {}
        self.errors: list[str] = []
        self.dfs = DistorefsMount(root / "store", root / "mnt")
        self.bfs = BindfsMount(root / "src", root / "bindfs")

    def run(self) -> None:
        p = self.p
        src = self.root / "src"
        src.mkdir()
        self.dfs.mount()
        trees = {"small": (p["small_n"], p["small_size"], 0), "big": (p["big_n"], p["big_size"], 1000)}
        for name, (n, size, per_dir) in trees.items():
            print(f"[{name}: {n} items of {size // 1024} KB]", flush=True)
            try:
                self.tree(name, src / name, n, size, per_dir)
            except Exception as exc:
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()
        print("[big directories]", flush=True)
        try:
            self.bigdirs()
        except Exception as exc:
            self.errors.append(f"bigdir: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    def tree(self, name: str, src: Path, n: int, size: int, per_dir: int) -> None:
        res = self.res[name] = {"items": n, "item_bytes": size}
        t0 = time.perf_counter()
        _generate(src, n, size, per_dir, seed=len(name))
        res["generate_s"] = round(time.perf_counter() - t0, 1)
        total_mb = n * size / 1e6
        # staging: cp -r vs distorefs stage, both from a cold source
        copy = self.root / f"cp-{name}"
        _drop_caches(self.notes)
        cp_s = _timed(["cp", "-r", str(src), str(copy)]) + _sync_time()
        shutil.rmtree(copy)
        ds = self.dfs.mnt / "datasets" / name
        _drop_caches(self.notes)
        stage_s = _timed([sys.executable, "-m", "distorefs.tools.cli", "stage", "-q", str(src), str(ds)]) + _sync_time()
        res["staging"] = {"cp_r_s": round(cp_s, 2), "cp_r_mb_per_s": round(total_mb / cp_s, 1),
                          "cp_r_items_per_s": round(n / cp_s, 1),
                          "stage_s": round(stage_s, 2), "stage_mb_per_s": round(total_mb / stage_s, 1),
                          "stage_items_per_s": round(n / stage_s, 1), "ratio_vs_cp": round(cp_s / stage_s, 3)}
        print(f"  staging: cp -r {cp_s:.1f}s, distorefs stage {stage_s:.1f}s ({cp_s / stage_s:.2f}x cp speed)", flush=True)
        index = np.load(ds / "index.npy")
        order = np.random.default_rng(7).permutation(n).astype(np.int64)
        rel_of = [bytes(p) for p in index["path"]]
        res["epochs"] = {}
        if per_dir == 0:
            _drop_caches(self.notes)
            res["ls_l_ext4"] = _ls_l(src)
            _drop_caches(self.notes)
            res["ls_l_distorefs"] = _ls_l(ds / "items")
        for readers in self.p["readers"]:
            ep = res["epochs"][str(readers)] = {}
            ext4_paths = [os.fsencode(src) + b"/" + rel_of[i] for i in order]
            _drop_caches(self.notes)
            ep["ext4"] = _epoch(ext4_paths, readers)
            self.bfs.src = src
            self.bfs.mount()
            try:
                bind_paths = [os.fsencode(self.bfs.mnt) + b"/" + rel_of[i] for i in order]
                _drop_caches(self.notes)
                ep["bindfs"] = _epoch(bind_paths, readers)
            finally:
                self.bfs.umount()
            dist_paths = [os.fsencode(ds / "items") + b"/" + rel_of[i] for i in order]
            # A fresh mount per pass: no dentries, inodes or prefetched values left from the last.
            self.dfs.umount()
            _drop_caches(self.notes)
            self.dfs.mount()
            before = _prefetch(ds)
            t0 = time.perf_counter()
            with open(ds / "order", "wb") as f:  # what EpochSampler does at the start of an epoch
                np.save(f, order)
            declare_s = time.perf_counter() - t0
            r = _epoch(dist_paths, readers)
            after = _prefetch(ds)
            hits = after["hits"] + after["late"] - before["hits"] - before["late"]
            misses = after["misses"] - before["misses"]
            r["seconds"] = round(r["seconds"] + declare_s, 3)
            r["items_per_s"] = round(r["items"] / r["seconds"], 1)
            r["mb_per_s"] = round(r["bytes"] / r["seconds"] / 1e6, 1)
            r.update({"declare_s": round(declare_s, 3), "prefetch_hits": hits, "prefetch_late": after["late"] - before["late"],
                      "prefetch_misses": misses, "hit_rate": round(hits / max(1, hits + misses), 4)})
            ep["distorefs"] = r
            print(f"  epoch, {readers} reader(s): ext4 {ep['ext4']['items_per_s']:.0f}/s, "
                  f"bindfs {ep['bindfs']['items_per_s']:.0f}/s, distorefs {r['items_per_s']:.0f}/s "
                  f"({r['items_per_s'] / ep['bindfs']['items_per_s']:.2f}x bindfs, hits {r['hit_rate']:.1%})", flush=True)
        shutil.rmtree(src)

    def bigdirs(self) -> None:
        """Directories of n entries (tiny files, staged through `.stage` from one source):
        cold listing and cold lookups, to show their cost per entry does not grow with n."""
        one = self.root / "one-byte"
        one.write_bytes(b"x")
        st = one.stat()
        out = self.res["bigdir"] = {}
        for n in self.p["bigdir_n"]:
            ds = self.dfs.mnt / "datasets" / f"flat{n}"
            os.mkdir(ds)
            t0 = time.perf_counter()
            fd = os.open(ds / ".stage", os.O_RDWR)
            try:
                for start in range(0, n, 4096):
                    os.write(fd, b"".join(json.dumps({"src": str(one), "path": f"e{i:08d}", "size": 1,
                                                      "mtime_ns": st.st_mtime_ns}).encode() + b"\n"
                                          for i in range(start, min(n, start + 4096))))
            finally:
                os.close(fd)
            os.setxattr(ds, "user.distorefs.sealed", b"1")
            stage_s = time.perf_counter() - t0
            self.dfs.umount()
            _drop_caches(self.notes)
            self.dfs.mount()
            listing = _ls_l(ds / "items")
            rng = np.random.default_rng(0)
            names = [os.fsencode(ds / "items" / f"e{i:08d}") for i in rng.integers(0, n, 2000)]
            t0 = time.perf_counter()
            for name in names:
                os.stat(name)
            lookup_us = (time.perf_counter() - t0) / len(names) * 1e6
            out[str(n)] = {"entries": n, "stage_s": round(stage_s, 1), "stage_items_per_s": round(n / stage_s, 1),
                           "ls_l": listing, "lookup_us": round(lookup_us, 1)}
            print(f"  one directory of {n:,} entries: staged {n / stage_s:,.0f}/s, cold ls -l "
                  f"{listing['entries_per_s']:,.0f} entries/s, cold lookup {lookup_us:.0f} us", flush=True)

    def teardown(self) -> None:
        self.bfs.umount()
        self.dfs.umount()


def _sync_time() -> float:
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def _rows(res: dict) -> list[dict]:
    rows = []
    for name in ("small", "big"):
        r = res.get(name)
        if not r:
            continue
        label = f"{r['items']:,} x {r['item_bytes'] // 1024} KB"
        st = r.get("staging")
        if st:
            rows.append({"what": f"staging {label}", "distorefs": f"{st['stage_items_per_s']:,.0f}/s {st['stage_mb_per_s']:.0f} MB/s",
                         "ext4": f"cp -r {st['cp_r_items_per_s']:,.0f}/s {st['cp_r_mb_per_s']:.0f} MB/s", "bindfs": "",
                         "ratio": st["ratio_vs_cp"], "goal": f">= {GOAL_STAGE} x cp -r",
                         "met": st["ratio_vs_cp"] >= GOAL_STAGE})
        for readers, ep in r.get("epochs", {}).items():
            d, e, b = ep["distorefs"], ep["ext4"], ep["bindfs"]
            ratio = round(d["items_per_s"] / e["items_per_s"], 3)
            vs_bindfs = round(d["items_per_s"] / b["items_per_s"], 3)
            judged = name == "small" and readers == GOAL_EPOCH_READERS
            rows.append({"what": f"cold epoch {label}, {readers} reader(s)",
                         "distorefs": f"{d['items_per_s']:,.0f}/s {d['mb_per_s']:.0f} MB/s hits {d['hit_rate']:.1%}",
                         "ext4": f"{e['items_per_s']:,.0f}/s {e['mb_per_s']:.0f} MB/s",
                         "bindfs": f"{b['items_per_s']:,.0f}/s {b['mb_per_s']:.0f} MB/s", "ratio": ratio,
                         "vs_bindfs": vs_bindfs,
                         "goal": f">= {GOAL_EPOCH}x bindfs, hits >= {GOAL_HITS:.0%}" if judged else "",
                         "met": (vs_bindfs >= GOAL_EPOCH and d["hit_rate"] >= GOAL_HITS) if judged else None})
        if "ls_l_distorefs" in r:
            d, e = r["ls_l_distorefs"], r["ls_l_ext4"]
            rows.append({"what": f"ls -l of one directory of {d['entries']:,} items, cold",
                         "distorefs": f"{d['seconds']:.2f}s ({d['entries_per_s']:,.0f}/s)",
                         "ext4": f"{e['seconds']:.2f}s ({e['entries_per_s']:,.0f}/s)", "bindfs": "",
                         "ratio": round(e["seconds"] / d["seconds"], 3), "goal": "", "met": None})
    for n, d in res.get("bigdir", {}).items():
        rows.append({"what": f"one directory of {d['entries']:,} entries: cold ls -l; cold lookup",
                     "distorefs": f"{d['ls_l']['entries_per_s']:,.0f} entries/s; {d['lookup_us']:.0f} us",
                     "ext4": "", "bindfs": "", "ratio": None, "goal": "", "met": None})
    return rows


def format_table(rows: list[dict]) -> str:
    head = ["what", "distorefs", "ext4", "bindfs", "vs ext4", "vs bindfs", "goal"]
    body = [[r["what"], r["distorefs"], r["ext4"], r["bindfs"], f"{r['ratio']:.2f}x" if r["ratio"] else "",
             f"{r['vs_bindfs']:.2f}x" if r.get("vs_bindfs") else "",
             (r["goal"] + (" met" if r["met"] else " MISSED")) if r["met"] is not None else ""] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def _plot(res: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels: list[str] = []
    series: dict[str, list[float]] = {"ext4": [], "bindfs": [], "distorefs": []}
    for name in ("small", "big"):
        for readers, ep in res.get(name, {}).get("epochs", {}).items():
            labels.append(f"{name}\n{readers} reader(s)")
            for k in series:
                series[k].append(ep[k]["items_per_s"])
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = np.arange(len(labels))
    for i, (k, v) in enumerate(series.items()):
        ax.bar(x + (i - 1) * 0.27, v, 0.27, label=k)
    ax.set_xticks(x, labels)
    ax.set_ylabel("items/s, one cold shuffled epoch")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend()
    save_figure(fig, path, dpi=120)


def run(out: Path, quick: bool = False, workdir: Path | None = None) -> dict:
    r = start_run(out, workdir)
    out, root, notes, machine, started = r.out, r.root, r.notes, r.machine, r.started
    print(f"distorefs bench datasets{' --quick' if quick else ''}: workdir {root} "
          f"({machine['fs']['fstype']} on {machine['fs']['source']}), {machine['cpus']} CPUs", flush=True)
    bench = Bench(root, quick, notes)
    result: dict[str, Any] = {"benchmark": "datasets", "quick": quick, "params": bench.p, "machine": machine}
    try:
        bench.run()
    except Exception as exc:
        bench.errors.append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    finally:
        bench.teardown()
        remove_workdir(root, bench.errors)
    result.update(bench.res)
    rows = _rows(bench.res)
    result["rows"] = rows
    result["notes"] = notes
    result["errors"] = bench.errors
    result["elapsed_s"] = round(time.time() - started, 1)
    table = format_table(rows)
    result["table"] = table
    (out / "datasets.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    try:
        _plot(bench.res, out / "datasets.png", f"one cold shuffled epoch: distorefs (order declared) vs ext4 vs bindfs"
                                               f" ({machine['cpus']} CPUs{', quick' if quick else ''})")
    except Exception as exc:
        result["errors"].append(f"plot: {exc}")
    print()
    print(table)
    for n in notes:
        print(f"note: {n}")
    for e in bench.errors:
        print(f"error: {e}")
    print(f"wrote {out / 'datasets.json'} and {out / 'datasets.png'} in {result['elapsed_s']:.0f}s")
    return result

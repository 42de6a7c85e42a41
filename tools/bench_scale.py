"""`distorefs bench scale`: a replay buffer many times larger than the daemon's memory.

In one run, on one file system:

1. fill a buffer with 20 GiB of ~110 KB `.npy` entries (4 writer processes) through a
   mount with `memory_bytes` = 1 GiB and a 512 MiB hot tier;
2. delete a random 40 % of the entries (holes: on-disk / live jumps past the bound), then
   sample and read batches (`batch/64.npz` + `np.load`) for 60 s with 1 and with 4
   reader processes, page cache dropped first, while compaction reclaims the holes and
   the buffer churns: a writer keeps inserting (the oldest are evicted at capacity) and a
   deleter removes random entries;
3. the same data in cpprb's `ReplayBuffer` with `mmap_prefix` (its storage a memory-mapped
   file on the same disk): fill, drop the page cache, `sample(64)` for 60 s;
4. the mount time of the filled store, and of a store of 1M small entries.

Every second: inserts and sampled entries per second, the daemon's resident memory
(RssAnon: its own; VmRSS: plus mapped files), bytes on disk and live. Writes
`OUT/scale.json` and `OUT/scale.png` (rates, memory and space over time) and prints a
table with the goals: sample rate >= cpprb's, RSS <= memory_bytes + 200 MB, on-disk /
live <= 1.5.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from .bench_buffers import DistorefsMount, _drop_caches, remove_workdir, save_figure, start_run

SHAPE = (16, 84, 84)  # uint8: 112,896 bytes + a 128-byte .npy header
ENTRY_BYTES = int(np.prod(SHAPE)) + 128
BATCH = 64
GiB, MiB = 1 << 30, 1 << 20
RSS_SLACK = 200 * 10**6
GOAL_OVERHEAD = 1.5


def _params(quick: bool) -> dict:
    if quick:
        return {"total_bytes": GiB, "memory_bytes": 256 * MiB, "lmdb_bytes": 128 * MiB, "segment_bytes": 32 * MiB,
                "seconds": 10, "readers": [1, 4], "writers": 4, "mount_entries": 100_000, "churn_per_s": 50,
                "settle_max_s": 60}
    return {"total_bytes": 20 * GiB, "memory_bytes": GiB, "lmdb_bytes": 512 * MiB, "segment_bytes": 256 * MiB,
            "seconds": 60, "readers": [1, 4], "writers": 4, "mount_entries": 1_000_000, "churn_per_s": 50,
            "settle_max_s": 300}


def _frame(i: int) -> np.ndarray:
    """Entry i: an observation of random pixels (incompressible), the same in every system."""
    return np.random.default_rng(i).integers(0, 256, SHAPE, dtype=np.uint8)


def _npy(i: int) -> bytes:
    out = io.BytesIO()
    np.save(out, _frame(i))
    return out.getvalue()


def _key(i: int) -> str:
    return f"e{i:08d}"


# ----- processes ---------------------------------------------------------------------------

def _writer(buf: str, start: int, stop: int, step: int) -> None:
    for i in range(start, stop, step):
        with open(os.path.join(buf, "entries", _key(i)), "wb") as f:
            f.write(_npy(i))


def _reader(buf: str, seconds: float, barrier, results) -> None:
    barrier.wait()
    deadline = time.perf_counter() + seconds
    entries = nbytes = 0
    while time.perf_counter() < deadline:
        with np.load(os.path.join(buf, "batch", f"{BATCH}.npz")) as z:
            obs = z["obs"] if "obs" in z.files else z["data"]
            entries += len(z["keys"])
            nbytes += obs.nbytes
    results.put((entries, nbytes))


def _deleter(buf: str, keys: list[int]) -> None:
    for i in keys:
        try:
            os.unlink(os.path.join(buf, "entries", _key(i)))
        except FileNotFoundError:
            pass


def _punch_holes(buf: Path, n: int, fraction: float, procs: int = 4) -> dict:
    """Delete a random `fraction` of the n entries (4 processes); returns the keys kept."""
    rng = random.Random(42)
    gone = rng.sample(range(n), int(n * fraction))
    ctx = mp.get_context("fork")
    t0 = time.perf_counter()
    workers = [ctx.Process(target=_deleter, args=(str(buf), gone[k::procs])) for k in range(procs)]
    for p in workers:
        p.start()
    for p in workers:
        p.join()
    elapsed = time.perf_counter() - t0
    gone_set = set(gone)
    return {"deleted": len(gone), "seconds": round(elapsed, 1), "deletes_per_s": round(len(gone) / elapsed),
            "kept": [i for i in range(n) if i not in gone_set]}


def _churn(buf: str, first_new: int, live: list[int], per_s: float, stop) -> None:
    """Keep inserting new entries (the oldest are evicted at capacity) and delete random
    ones (holes for compaction), each at about `per_s`."""
    rng = random.Random(first_new)
    i = first_new
    period = 1.0 / per_s
    while not stop.is_set():
        t0 = time.perf_counter()
        with open(os.path.join(buf, "entries", _key(i)), "wb") as f:
            f.write(_npy(i))
        i += 1
        victim = live[rng.randrange(len(live) // 4, len(live))]  # not the oldest: eviction takes those
        try:
            os.unlink(os.path.join(buf, "entries", _key(victim)))
        except FileNotFoundError:
            pass
        time.sleep(max(0.0, period - (time.perf_counter() - t0)))


def _cpprb_run(prefix: str, n: int, seconds: float, results) -> None:
    """cpprb with a memory-mapped storage: fill with the same entries, drop caches, sample."""
    try:
        from cpprb import ReplayBuffer
    except ImportError as exc:
        results.put({"error": f"cpprb not installed: {exc}"})
        return
    try:
        rb = ReplayBuffer(n, {"obs": {"shape": SHAPE, "dtype": np.uint8}}, mmap_prefix=prefix)
        t0 = time.perf_counter()
        for i in range(n):
            rb.add(obs=_frame(i)[None])
        fill_s = time.perf_counter() - t0
        _drop_caches([])
        deadline = time.perf_counter() + seconds
        entries = 0
        t0 = time.perf_counter()
        while time.perf_counter() < deadline:
            batch = rb.sample(BATCH)
            entries += len(batch["obs"])
        elapsed = time.perf_counter() - t0
        results.put({"fill_s": round(fill_s, 1), "fill_entries_per_s": round(n / fill_s),
                     "entries_per_s": round(entries / elapsed), "mb_per_s": round(entries * ENTRY_BYTES / elapsed / 1e6)})
    except Exception as exc:  # noqa: BLE001 - reported in the results
        results.put({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})


# ----- the monitor -------------------------------------------------------------------------

def _memory(pid: int | None) -> dict[str, int]:
    # (pid None, no daemon found: there is no /proc/None, so nothing)
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class Monitor(threading.Thread):
    """Once a second: the store's counters, the daemon's memory and the disk bytes."""

    def __init__(self, mnt: Path, pid: int | None, buf: str) -> None:
        super().__init__(daemon=True)
        self.mnt, self.pid, self.buf = mnt, pid, buf
        self.samples: list[dict] = []
        self.phase = "fill"
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def run(self) -> None:
        prev = None
        while not self._halt.wait(1.0):
            try:
                s = json.loads((self.mnt / ".distorefs" / "stats.json").read_bytes())
            except (OSError, ValueError):
                continue
            b = s["buffers"].get(self.buf, {})
            row = {"t": round(time.monotonic() - self.t0, 1), "phase": self.phase,
                   "inserts": b.get("inserts", 0), "sampled": b.get("sampled_entries", 0),
                   "entries": b.get("entries", 0), "on_disk": s["space"]["on_disk_bytes"],
                   "live": s["space"]["live_bytes"], "lmdb_live": s["tiers"]["lmdb"]["live_bytes"],
                   "held": s["memory"]["held_bytes"], **_memory(self.pid),
                   "compacted_segments": s["tiering"]["compacted_segments"],
                   "demoted_entries": s["tiering"]["demoted_entries"]}
            if prev is not None:
                dt = row["t"] - prev["t"]
                row["insert_rate"] = round((row["inserts"] - prev["inserts"]) / dt, 1)
                row["sample_rate"] = round((row["sampled"] - prev["sampled"]) / dt, 1)
            self.samples.append(row)
            prev = row

    def stop(self) -> list[dict]:
        self._halt.set()
        self.join()
        return self.samples


# ----- phases ------------------------------------------------------------------------------

def _fill(buf: Path, n: int, writers: int) -> dict:
    ctx = mp.get_context("fork")
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_writer, args=(str(buf), w, n, writers)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a writer failed (exit {p.exitcode})")
    elapsed = time.perf_counter() - t0
    return {"entries": n, "seconds": round(elapsed, 1), "entries_per_s": round(n / elapsed),
            "mb_per_s": round(n * ENTRY_BYTES / elapsed / 1e6)}


def _sample_phase(buf: Path, readers: int, seconds: float, live: list[int], churn_per_s: float, first_new: int,
                  notes: list[str]) -> dict:
    ctx = mp.get_context("fork")
    _drop_caches(notes)
    stop = ctx.Event()
    churn = ctx.Process(target=_churn, args=(str(buf), first_new, live, churn_per_s, stop))
    churn.start()
    barrier = ctx.Barrier(readers)
    results = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(buf), seconds, barrier, results)) for _ in range(readers)]
    for p in procs:
        p.start()
    got = [results.get(timeout=seconds + 300) for _ in procs]
    for p in procs:
        p.join()
    stop.set()
    churn.join(timeout=30)
    entries = sum(e for e, _ in got)
    return {"readers": readers, "entries_per_s": round(entries / seconds), "mb_per_s":
            round(sum(b for _, b in got) / seconds / 1e6)}


def _time_mount(store: Path, mnt: Path, options: list[str]) -> float:
    m = DistorefsMount(store, mnt)
    t0 = time.perf_counter()
    m.mount(*options)
    elapsed = time.perf_counter() - t0
    m.umount()
    return round(elapsed, 2)


def _make_many_entries(store: Path, n: int) -> float:
    """A store with one buffer of `n` 100-byte entries, built through the library (fast)."""
    code = f"""
import trio
from distorefs.store import Store
from distorefs.owner import Owner
async def main():
    store = Store({str(store)!r}, config={{"sync_interval": 5}})
    async with store.running():
        buf = await store.create_buffer("many", Owner(0o40755, 0, 0))
        await store.configure_buffer("many", b'{{"capacity": {n}, "compression": "none"}}')
        owner = Owner(0o100644, 0, 0)
        async def worker(w):
            for i in range(w, {n}, 64):
                await buf.insert(b"k%09d" % i, b"x" * 100, owner)
        async with trio.open_nursery() as nursery:
            for w in range(64):
                nursery.start_soon(worker, w)
    store.close()
trio.run(main)
"""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=3600)
    return time.perf_counter() - t0


# ----- report ------------------------------------------------------------------------------

def _rows(res: dict) -> list[list[str]]:
    p = res["params"]
    rows = []
    f = res["fill"]
    rows.append(["fill (insert, 4 writers)", f"{f['entries_per_s']:,}/s {f['mb_per_s']} MB/s",
                 f"cpprb {res['cpprb'].get('fill_entries_per_s', '-'):,}/s" if "fill_entries_per_s" in res["cpprb"]
                 else "-", "", ""])
    peer = res["cpprb"].get("entries_per_s")
    for s in res["sample"]:
        ratio = s["entries_per_s"] / peer if peer else None
        rows.append([f"sample+read batch/{BATCH}.npz, {s['readers']} reader(s)", f"{s['entries_per_s']:,}/s "
                     f"{s['mb_per_s']} MB/s", f"cpprb sample({BATCH}) {peer:,}/s" if peer else "-",
                     f"{ratio:.2f}x" if ratio else "-", ">= cpprb " + ("met" if ratio and ratio >= 1 else "MISSED")])
    m = res["memory"]
    limit = p["memory_bytes"] + RSS_SLACK
    rows.append(["daemon RSS max: RssAnon / VmRSS", f"{m['rss_anon_max'] / 1e6:,.0f} / {m['vm_rss_max'] / 1e6:,.0f} MB",
                 f"memory_bytes {p['memory_bytes'] / 1e6:,.0f} MB", "",
                 f"<= {limit / 1e6:,.0f} MB: RssAnon " + ("met" if m["rss_anon_max"] <= limit else "MISSED")
                 + ", VmRSS " + ("met" if m["vm_rss_max"] <= limit else "MISSED")])
    sp = res["space"]
    c = sp["compaction"]
    rows.append(["space: on-disk / live after deleting 40% (max; end)", f"{sp['overhead_max']:.3f}; "
                 f"{sp['overhead_end']:.3f}", f"compacted {c['compacted_segments']} segments, moved "
                 f"{c['compacted_bytes'] / 1e9:.1f} GB", "", f"<= {GOAL_OVERHEAD} once compacted: "
                 + ("met" if sp["overhead_end"] <= GOAL_OVERHEAD else "MISSED")])
    mt = res["mount"]
    rows.append([f"mount time: filled store ({mt['filled_entries']:,} entries)", f"{mt['filled_s']} s", "", "", ""])
    rows.append([f"mount time: {mt['many_entries']:,} small entries", f"{mt['many_s']} s", "", "", ""])
    return rows


def _table(rows: list[list[str]]) -> str:
    head = ["what", "distorefs", "peer / baseline", "ratio", "goal"]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _chart(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = [s for s in res["timeline"] if "insert_rate" in s]
    t = [s["t"] for s in tl]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    axes[0].plot(t, [s["insert_rate"] for s in tl], label="inserts/s")
    axes[0].plot(t, [s["sample_rate"] for s in tl], label="sampled entries/s")
    peer = res["cpprb"].get("entries_per_s")
    if peer:
        axes[0].axhline(peer, color="gray", ls="--", label=f"cpprb sample rate ({peer:,}/s)")
    axes[0].set_ylabel("entries/s (log)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    limit = (res["params"]["memory_bytes"] + RSS_SLACK) / 1e6
    axes[1].plot(t, [s.get("RssAnon", 0) / 1e6 for s in tl], label="RssAnon")
    axes[1].plot(t, [s.get("VmRSS", 0) / 1e6 for s in tl], label="VmRSS (incl. mapped LMDB pages)")
    axes[1].plot(t, [s["held"] / 1e6 for s in tl], label="held against memory_bytes")
    axes[1].axhline(limit, color="red", ls="--", label="memory_bytes + 200 MB")
    axes[1].set_ylabel("MB")
    axes[1].legend(fontsize=8)
    axes[2].plot(t, [s["on_disk"] / max(1, s["live"]) for s in tl], label="on-disk / live")
    axes[2].axhline(GOAL_OVERHEAD, color="red", ls="--", label="bound")
    axes[2].set_ylabel("space overhead")
    axes[2].set_xlabel("seconds")
    axes[2].legend(fontsize=8)
    for s0, s1 in zip(tl, tl[1:]):
        if s0["phase"] != s1["phase"]:
            for ax in axes:
                ax.axvline(s1["t"], color="black", lw=0.5)
            axes[0].text(s1["t"], axes[0].get_ylim()[1] * 0.5, s1["phase"], fontsize=7)
    save_figure(fig, path, f"bench scale: {res['fill']['entries']:,} entries of {ENTRY_BYTES:,} B, "
                f"memory_bytes {res['params']['memory_bytes'] >> 20} MiB", fontsize=10)


# ----- entry point -------------------------------------------------------------------------

def run(out: Path, quick: bool = False, workdir: Path | None = None) -> dict:
    """Run the scale benchmark; write OUT/scale.json and OUT/scale.png; return the results."""
    r = start_run(out, workdir)
    out, root, notes, started = r.out, r.root, r.notes, r.started
    p = _params(quick)
    n = p["total_bytes"] // ENTRY_BYTES
    res: dict = {"params": p, "notes": notes, "machine": r.machine}
    options = [f"memory_bytes={p['memory_bytes']}", f"lmdb_bytes={p['lmdb_bytes']}",
               f"segment_bytes={p['segment_bytes']}"]
    print(f"distorefs bench scale{' --quick' if quick else ''}: {n:,} entries of {ENTRY_BYTES:,} B "
          f"({n * ENTRY_BYTES / 2**30:.1f} GiB), memory_bytes {p['memory_bytes'] >> 20} MiB, "
          f"lmdb_bytes {p['lmdb_bytes'] >> 20} MiB; workdir {root}", flush=True)
    store, mnt = root / "store", root / "mnt"
    m = DistorefsMount(store, mnt)
    monitor = None
    try:
        m.mount(*options)
        buf = mnt / "buffers" / "scale"
        buf.mkdir()
        (buf / "config.json").write_text(json.dumps({"capacity": n, "compression": "none", "sampler": "uniform",
                                                     "presample_batches": 4}))
        monitor = Monitor(mnt, m.pid, "scale")
        monitor.start()
        res["fill"] = _fill(buf, n, p["writers"])
        print(f"  fill: {res['fill']}", flush=True)
        monitor.phase = "delete 40%"
        holes = _punch_holes(buf, n, 0.4)
        live = holes.pop("kept")
        res["holes"] = holes
        print(f"  holes: {holes}", flush=True)
        res["sample"] = []
        first_new = n
        for readers in p["readers"]:
            monitor.phase = f"sample x{readers}"
            sample = _sample_phase(buf, readers, p["seconds"], live, p["churn_per_s"], first_new, notes)
            first_new += int(p["churn_per_s"] * (p["seconds"] + 30))
            res["sample"].append(sample)
            print(f"  sample+read, {readers} reader(s): {sample}", flush=True)
        monitor.phase = "settle"
        deadline = time.monotonic() + p["settle_max_s"]  # compaction finishing what it started
        while time.monotonic() < deadline:
            time.sleep(5)
            sp = json.loads((mnt / ".distorefs" / "stats.json").read_bytes())["space"]
            if sp["overhead"] <= GOAL_OVERHEAD * 0.95:
                break
        res["timeline"] = monitor.stop()
        monitor = None
        s = json.loads((mnt / ".distorefs" / "stats.json").read_bytes())
        res["final_stats"] = {k: s[k] for k in ("tiers", "space", "tiering", "memory")}
        filled = s["buffers"]["scale"]["entries"]
        m.umount()
        tl = res["timeline"]
        res["memory"] = {"rss_anon_max": max(x.get("RssAnon", 0) for x in tl),
                         "vm_rss_max": max(x.get("VmRSS", 0) for x in tl),
                         "held_max": max(x["held"] for x in tl)}
        over = [x["on_disk"] / x["live"] for x in tl if x["live"] > 64 * MiB]
        settled = [x["on_disk"] / x["live"] for x in tl if x["phase"] == "settle" and x["live"]]
        res["space"] = {"overhead_end": s["space"]["overhead"], "overhead_max": max(over) if over else None,
                        "overhead_settled": settled[-1] if settled else s["space"]["overhead"],
                        "on_disk_bytes": s["space"]["on_disk_bytes"], "live_bytes": s["space"]["live_bytes"],
                        "compaction": s["tiering"]}
        res["mount"] = {"filled_entries": filled, "filled_s": _time_mount(store, mnt, [])}
        print(f"  mount of the filled store: {res['mount']['filled_s']} s", flush=True)

        # the peer, on the same disk, after distorefs' store is gone (room for both is not assumed)
        shutil.rmtree(store, ignore_errors=True)
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        proc = ctx.Process(target=_cpprb_run, args=(str(root / "cpprb"), n, p["seconds"], q))
        proc.start()
        res["cpprb"] = q.get(timeout=7200)
        proc.join()
        for f in root.glob("cpprb*"):
            f.unlink()
        print(f"  cpprb (mmap_prefix): {res['cpprb']}", flush=True)

        many = root / "many"
        build_s = _make_many_entries(many, p["mount_entries"])
        res["mount"]["many_entries"] = p["mount_entries"]
        res["mount"]["many_build_s"] = round(build_s, 1)
        res["mount"]["many_s"] = _time_mount(many, mnt, [])
        print(f"  mount of a store of {p['mount_entries']:,} entries: {res['mount']['many_s']} s", flush=True)
    finally:
        if monitor is not None:
            res["timeline"] = monitor.stop()
        m.umount()
        errors: list[str] = []
        remove_workdir(root, errors)  # a failed umount leaves the store, never deletes through it
        if errors:
            res["errors"] = errors
    res["elapsed_s"] = round(time.time() - started, 1)
    rows = _rows(res)
    res["table"] = rows
    (out / "scale.json").write_text(json.dumps(res, indent=1, default=str))
    _chart(res, out / "scale.png")
    print()
    print(_table(rows))
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {out / 'scale.json'} and {out / 'scale.png'} in {res['elapsed_s']:.0f}s")
    return res

"""Parameter-server benchmark: one writer publishing weights while many readers load them.

`distorefs bench weights [--quick] [--out DIR] [--workdir DIR]` runs, for each of three
systems in turn, one writer process that publishes a new version of a 200 MiB file every
2 s while 16 reader processes read that file whole, again and again, for 30 s
(--quick: 50 MiB, 4 readers, 8 s):

- distorefs: the writer rewrites `MNT/weights/bench/model.bin` in place
  (open(..., "wb"), write, close): publication at close() is distorefs' job;
- tmpfs: a directory on /dev/shm (or a tmpfs mounted for the run); the writer writes a
  temp file, closes it and os.replace()s it over the name;
- ext4: the same temp + rename, in a directory on the disk holding the work directory.

Every copy carries its version: a 4 KiB header (magic, version, lengths) and a body of
little-endian uint64 words, word i = (version << 40) + i. A reader checks the header and
every word of every read (1 MiB at a time, vectorised) and the length, so a read that
mixes versions, is shifted, truncated or too long counts as torn. The writer's close (or
rename) times give a second check: an open that starts after version v became visible
and still returns an older version is a stale open. Both must be 0.

Reported per system: aggregate reader GB/s (all bytes of all finished reads over the
readers' wall time, verification included), reads, torn reads, stale opens, publish
latency p50/max (distorefs: open+write+close; baselines: write to temp + rename, split),
the daemon's RSS (sampled every 0.2 s from STORE/lock's pid) and CPU, and goal lines:
readers >= 50% of tmpfs' throughput, publish <= 1.5x ext4's write+rename (p50).

If the mount has no `weights/` directory (the namespace not built yet), or a target
directory is given, the distorefs column runs the same in-place writer against a plain
directory instead and says so: torn reads there show the checker at work, not distorefs.

Writes `OUT/weights.json` and `OUT/weights.png`, prints a table, returns the JSON dict.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

if __package__:
    from .bench_buffers import (DistorefsMount, _CpuMeter, _drop_caches, _fs_of, _other_load, _proc_cpu,
                                print_report, remove_workdir, save_figure, start_run)
else:  # `python tools/bench_weights.py`
    from distorefs.tools.bench_buffers import (DistorefsMount, _CpuMeter, _drop_caches, _fs_of, _other_load,
                                               _proc_cpu, print_report, remove_workdir, save_figure, start_run)

SYSTEMS = ("distorefs", "tmpfs", "ext4")
HEADER = 4096
MAGIC = b"DFSWBNCH"
_HDR = struct.Struct("<8sQQQ")          # magic, version, body bytes, file bytes
VERSION_SHIFT = 40                       # word i of version v = (v << 40) + i; 2**40 words = 8 TiB
CHUNK = 1 << 20                          # read + verify unit: stays in cache, ~17 GB/s to check
XATTR = "user.distorefs.version"
READER_GOAL = 0.5                        # distorefs readers >= 50% of tmpfs aggregate GB/s
PUBLISH_GOAL = 1.5                       # distorefs publish p50 <= 1.5x ext4 write+rename p50
RSS_PERIOD = 0.2


def _params(quick: bool) -> dict:
    if quick:
        return {"size_mib": 50, "readers": 4, "seconds": 8.0, "period": 2.0}
    return {"size_mib": 200, "readers": 16, "seconds": 30.0, "period": 2.0}


# ----- the payload -------------------------------------------------------------------------

def _header(version: int, size: int) -> bytes:
    return _HDR.pack(MAGIC, version, size - HEADER, size).ljust(HEADER, b"\0")


def _fill(buf: np.ndarray, version: int, base: np.ndarray) -> None:
    """Write version `version`'s bytes into `buf` (uint8, the whole file)."""
    size = len(buf)
    buf[:HEADER] = np.frombuffer(_header(version, size), dtype=np.uint8)
    body = buf[HEADER:].view(np.uint64)
    cw = len(base)
    for w0 in range(0, len(body), cw):
        k = min(cw, len(body) - w0)
        np.add(base[:k], np.uint64((version << VERSION_SHIFT) + w0), out=body[w0:w0 + k])


# ----- worker processes --------------------------------------------------------------------

def _read_full(f, mv: memoryview) -> int:
    """Fill `mv` from `f` unless EOF comes first; bytes read."""
    pos, n = 0, len(mv)
    while pos < n:
        got = f.readinto(mv[pos:])
        if not got:
            break
        pos += got
    return pos


def _read_one(path: str, size: int, hdr: memoryview, mv: memoryview, arr: np.ndarray, base: np.ndarray,
              scratch: np.ndarray) -> tuple[int, int, str, int]:
    """Read `path` whole and verify it: (version or -1, bytes read, torn reason or '', st_ino)."""
    version, reason = -1, ""
    with open(path, "rb", buffering=0) as f:
        ino = os.fstat(f.fileno()).st_ino
        nbytes = _read_full(f, hdr)
        if nbytes < HEADER:
            return version, nbytes, "length", ino
        magic, version, body_len, total = _HDR.unpack_from(hdr)
        if magic != MAGIC:
            version, reason = -1, "header"
        elif bytes(hdr) != _header(version, total) or total != size:
            reason = "header"
        word = 0
        while True:
            n = _read_full(f, mv)
            if not n:
                break
            nbytes += n
            if reason:
                continue  # already torn: read on, to count the length
            if n % 8 or nbytes > size:
                reason = "length"
                continue
            k = n // 8
            np.subtract(arr[:k], base[:k], out=scratch[:k])
            if not (scratch[:k] == np.uint64((version << VERSION_SHIFT) + word)).all():
                reason = "body"
            word += k
    if not reason and nbytes != size:
        reason = "length"
    return version, nbytes, reason, ino


def _reader_main(path: str, size: int, seconds: float, barrier, results) -> None:
    out: dict[str, Any] = {"role": "reader", "reads": [], "open_errors": 0, "read_errors": 0, "error": None}
    try:
        buf = bytearray(CHUNK)
        mv = memoryview(buf)
        hdr = memoryview(bytearray(HEADER))
        arr = np.frombuffer(buf, dtype=np.uint64)
        base = np.arange(CHUNK // 8, dtype=np.uint64)
        scratch = np.empty_like(base)
        barrier.wait(timeout=120)
        start = time.monotonic()
        cpu0 = time.process_time()
        deadline = start + seconds
        reads = out["reads"]
        while time.monotonic() < deadline:
            t_open = time.monotonic()
            try:
                version, nbytes, reason, ino = _read_one(path, size, hdr, mv, arr, base, scratch)
            except FileNotFoundError:
                out["open_errors"] += 1
                time.sleep(0.001)
                continue
            except OSError as exc:  # EIO, ESTALE, ...: a failed read, counted as torn
                out["read_errors"] += 1
                out.setdefault("errnos", []).append(exc.errno)
                version, nbytes, reason, ino = -1, 0, f"errno {exc.errno}", -1
            reads.append((t_open, time.monotonic(), version, nbytes, reason, ino))
        out["start"] = start
        out["elapsed"] = (reads[-1][1] if reads else time.monotonic()) - start
        out["cpu"] = time.process_time() - cpu0
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        try:
            barrier.abort()
        except Exception:
            pass
    results.put(out)


def _write_all(f, mv: memoryview) -> None:
    pos = 0
    while pos < len(mv):
        pos += f.write(mv[pos:])


def _publish(mode: str, path: Path, data: memoryview, version: int) -> dict:
    """One publication, timed. mode "inplace": open(path, "wb"), write, close; "rename":
    write a temp file beside it, close, os.replace it over `path`."""
    rec: dict[str, Any] = {"version": version}
    target = path if mode == "inplace" else path.with_name(f".{path.name}.tmp{version}")
    t0 = time.monotonic()
    f = open(target, "wb", buffering=0)
    t1 = time.monotonic()
    try:
        _write_all(f, data)
    finally:
        t2 = time.monotonic()
        f.close()
    t3 = time.monotonic()
    rec.update(t_start=t0, open_s=t1 - t0, write_s=t2 - t1, close_s=t3 - t2, write_total_s=t3 - t0)
    if mode == "rename":
        os.replace(target, path)
    t4 = time.monotonic()
    rec.update(rename_s=(t4 - t3) if mode == "rename" else None, total_s=t4 - t0, t_visible=t4)
    try:
        rec["xattr_version"] = os.getxattr(path, XATTR).decode(errors="replace")
    except OSError:
        rec["xattr_version"] = None
    return rec


def _writer_main(mode: str, path: str, size: int, seconds: float, period: float, first: int, barrier,
                 results) -> None:
    out: dict[str, Any] = {"role": "writer", "publishes": [], "error": None}
    try:
        buf = np.empty(size, dtype=np.uint8)
        base = np.arange(CHUNK // 8, dtype=np.uint64)
        version = first
        _fill(buf, version, base)
        barrier.wait(timeout=120)
        start = time.monotonic()
        cpu0 = time.process_time()
        k = 1
        while True:
            due = start + k * period
            if due >= start + seconds:
                break
            late = due - time.monotonic()
            if late > 0:
                time.sleep(late)
            rec = _publish(mode, Path(path), buf.data, version)  # (.data: memoryview(buf), typed as one)
            rec["late_s"] = max(0.0, -late)
            out["publishes"].append(rec)
            version += 1
            k += 1
            _fill(buf, version, base)  # the next version, off the clock
        out["cpu"] = time.process_time() - cpu0
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=4)
        try:
            barrier.abort()
        except Exception:
            pass
    results.put(out)


# ----- memory ------------------------------------------------------------------------------

def _rss(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    kb = lambda k: int(fields[k].split()[0]) if k in fields else None  # noqa: E731
    return {"rss_kb": kb("VmRSS"), "anon_kb": kb("RssAnon"), "file_kb": kb("RssFile"), "shmem_kb": kb("RssShmem")}


class _RssSampler(threading.Thread):
    """VmRSS of one process every RSS_PERIOD seconds until stopped."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, dict]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while self.pid and not self.stop_event.is_set():
            s = _rss(self.pid)
            if s is not None:
                self.samples.append((round(time.monotonic() - t0, 2), s))
            self.stop_event.wait(RSS_PERIOD)

    def stop(self) -> dict | None:
        self.stop_event.set()
        self.join(timeout=5)
        if not self.samples:
            return None
        rss = np.array([s["rss_kb"] for _, s in self.samples], dtype=float) / 1024
        anon = np.array([s["anon_kb"] or 0 for _, s in self.samples], dtype=float) / 1024
        return {"pid": self.pid, "samples": len(rss), "start_mb": round(rss[0], 1), "max_mb": round(rss.max(), 1),
                "mean_mb": round(rss.mean(), 1), "end_mb": round(rss[-1], 1), "anon_max_mb": round(anon.max(), 1),
                "series": [(t, round(s["rss_kb"] / 1024, 1)) for t, s in self.samples]}


# ----- one system --------------------------------------------------------------------------

def _ms(values: list[float]) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    a = np.array(vals) * 1000
    return {"p50_ms": round(float(np.median(a)), 1), "max_ms": round(float(a.max()), 1),
            "mean_ms": round(float(a.mean()), 1), "n": len(vals)}


def _stale(reads: list[tuple], pubs: list[dict]) -> tuple[int, list]:
    """Opens that started after version v was visible yet returned an older version."""
    vis = sorted((p["t_visible"], p["version"]) for p in pubs)
    times = [t for t, _ in vis]
    stale = 0
    examples: list[dict[str, Any]] = []
    for t_open, _t_end, version, _n, _reason, _ino in reads:
        if version < 0:
            continue
        i = int(np.searchsorted(times, t_open, side="right")) - 1
        if i >= 0 and version < vis[i][1]:
            stale += 1
            if len(examples) < 5:
                examples.append({"read_version": version, "visible_version": vis[i][1],
                                 "opened_after_s": round(t_open - times[i], 4)})
    return stale, examples


def _run_system(name: str, mode: str, target: Path, p: dict, server_pid: int | None, log) -> dict:
    size = p["size_mib"] << 20
    path = target / "model.bin"
    target.mkdir(parents=True, exist_ok=True)
    base = np.arange(CHUNK // 8, dtype=np.uint64)
    buf = np.empty(size, dtype=np.uint8)
    _fill(buf, 1, base)
    initial = _publish(mode, path, buf.data, 1)
    del buf
    res: dict[str, Any] = {"mode": mode, "path": str(path), "initial_publish_s": round(initial["total_s"], 3),
                           "initial_xattr_version": initial["xattr_version"]}
    ctx = mp.get_context("fork")
    n = p["readers"]
    barrier = ctx.Barrier(n + 2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_reader_main, args=(str(path), size, p["seconds"], barrier, results), daemon=True)
             for _ in range(n)]
    procs.append(ctx.Process(target=_writer_main, args=(mode, str(path), size, p["seconds"], p["period"], 2,
                                                        barrier, results), daemon=True))
    for proc in procs:
        proc.start()
    outs: list[dict] = []
    sampler = _RssSampler(server_pid)
    meter = None
    try:
        barrier.wait(timeout=180)
        t0 = time.monotonic()
        sampler.start()
        meter = _CpuMeter(server_pid)
        for _ in procs:
            outs.append(results.get(timeout=p["seconds"] + 600))
        wall_total = time.monotonic() - t0
    finally:
        cpu = meter.done() if meter else {}
        res["daemon_rss"] = sampler.stop() if sampler.is_alive() else None
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()  # our own worker, by its handle
                proc.join(timeout=5)
    readers = [o for o in outs if o["role"] == "reader"]
    writer: dict[str, Any] = next((o for o in outs if o["role"] == "writer"),
                                  {"publishes": [], "error": "no writer result"})
    errors = [f"{o['role']}: {o['error']}" for o in outs if o.get("error")]
    reads = [r for o in readers for r in o["reads"]]
    pubs = writer["publishes"]
    wall = max((o.get("elapsed", 0.0) for o in readers), default=0.0)
    nbytes = sum(r[3] for r in reads)
    torn = [r for r in reads if r[4]]
    reasons: dict[str, int] = {}
    for r in torn:
        reasons[r[4]] = reasons.get(r[4], 0) + 1
    stale, stale_examples = _stale(reads, [initial] + pubs)
    ncpu = os.cpu_count() or 1
    reader_cpu = sum(o.get("cpu", 0.0) for o in readers)
    res.update({
        "readers": n, "seconds": round(wall, 2), "reads": len(reads), "bytes": nbytes,
        "gb_per_s": round(nbytes / wall / 1e9, 3) if wall > 0 else 0.0,
        "reads_per_s": round(len(reads) / wall, 2) if wall > 0 else 0.0,
        "torn_reads": len(torn), "torn_reasons": reasons,
        "torn_examples": [_torn_example(r, pubs, readers) for r in torn[:8]],
        "torn_during_publish": sum(1 for r in torn if _overlapping(r, pubs)),
        "stale_opens": stale, "stale_examples": stale_examples,
        "open_errors": sum(o.get("open_errors", 0) for o in readers),
        "read_errors": sum(o.get("read_errors", 0) for o in readers),
        "read_latency": _ms([r[1] - r[0] for r in reads]),
        "versions_published": [initial["version"]] + [q["version"] for q in pubs],
        "versions_read": len({r[2] for r in reads if r[2] >= 0}),
        # one inode per version lets every reader share its pages; more means separate caches
        "inodes_per_version": _inodes_per_version(reads),
        "publishes": len(pubs),
        "publish": _ms([q["total_s"] for q in pubs]),
        "publish_open": _ms([q["open_s"] for q in pubs]),
        "publish_write": _ms([q["write_s"] for q in pubs]),
        "publish_close": _ms([q["close_s"] for q in pubs]),
        "publish_write_close": _ms([q["write_total_s"] for q in pubs]),
        "publish_rename": _ms([q["rename_s"] for q in pubs]),
        "publish_late": sum(1 for q in pubs if q.get("late_s", 0) > 0.05),
        "publish_series": [(round(q["t_start"] - (readers[0]["start"] if readers and "start" in readers[0]
                                                   else q["t_start"]), 2), round(q["total_s"] * 1000, 1))
                           for q in pubs],
        "xattr_versions": [initial["xattr_version"]] + [q["xattr_version"] for q in pubs],
        "reader_cpu_cores": round(reader_cpu / wall, 2) if wall > 0 else None,
        "writer_cpu_cores": round(writer.get("cpu", 0.0) / wall, 2) if wall > 0 else None,
        "wall_s": round(wall_total, 2) if outs else None,
        **cpu,
    })
    if "machine_busy" in cpu and wall > 0:
        res["other_cpu_cores"] = round(max(0.0, cpu["machine_busy"] * ncpu - (reader_cpu + writer.get("cpu", 0.0))
                                           / wall - cpu.get("server_cpu_cores", 0.0)), 2)
    xv = [x for x in res["xattr_versions"] if x is not None]
    res["xattr_monotonic"] = (all(_num(a) < _num(b) for a, b in zip(xv, xv[1:])) if xv else None)
    res["read_series"] = [(round(r[0] - readers[0]["start"], 3), round(r[1] - r[0], 3), r[2], bool(r[4]))
                          for r in reads[:4000]] if readers and "start" in readers[0] else []
    if errors:
        res["errors"] = errors
    if writer.get("traceback"):
        res["writer_traceback"] = writer["traceback"]
    rss = res["daemon_rss"]
    log(f"  {name:9s}: {res['gb_per_s']:6.2f} GB/s, {len(reads)} reads ({res['versions_read']} versions), "
        f"torn {len(torn)}{' ' + str(reasons) if reasons else ''}, stale opens {stale}; "
        f"publish p50 {_g(res['publish'], 'p50_ms')} ms max {_g(res['publish'], 'max_ms')} ms "
        f"({len(pubs)} publishes); cpu: daemon {cpu.get('server_cpu_cores', '-')}, readers "
        f"{res['reader_cpu_cores']}, other {res.get('other_cpu_cores', '-')}"
        + (f"; daemon RSS max {rss['max_mb']} MB mean {rss['mean_mb']} MB" if rss else ""))
    for e in errors:
        log(f"    error: {e}")
    return res


def _overlapping(r: tuple, pubs: list[dict]) -> list[int]:
    """Versions whose publication (writer's open .. visible) overlapped read `r`."""
    return [q["version"] for q in pubs if q["t_start"] <= r[1] and q["t_visible"] >= r[0]]


def _torn_example(r: tuple, pubs: list[dict], readers: list[dict]) -> dict:
    t0 = min((o["start"] for o in readers if "start" in o), default=r[0])
    return {"version": r[2], "bytes": r[3], "reason": r[4], "ino": r[5], "opened_at_s": round(r[0] - t0, 3),
            "read_s": round(r[1] - r[0], 3), "publishes_overlapping": _overlapping(r, pubs)}


def _inodes_per_version(reads: list[tuple]) -> dict | None:
    per: dict[int, set] = {}
    for r in reads:
        if r[2] >= 0:
            per.setdefault(r[2], set()).add(r[5])
    if not per:
        return None
    counts = [len(v) for v in per.values()]
    return {"mean": round(sum(counts) / len(counts), 2), "max": max(counts)}


def _num(x: str) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _g(d: dict | None, k: str) -> Any:
    return None if not d else d.get(k)


# ----- report ------------------------------------------------------------------------------

def _rows(res: dict) -> list[tuple[str, dict[str, str]]]:
    """(label, {system: cell}) rows of the table."""
    sysres = {s: res.get(s) or {} for s in SYSTEMS}

    def row(label: str, fn) -> tuple[str, dict[str, str]]:
        cells = {}
        for s in SYSTEMS:
            r = sysres[s]
            try:
                v = fn(r) if r and "error" not in r else None
            except (KeyError, TypeError):
                v = None
            cells[s] = "-" if v is None else str(v)
        return label, cells

    def lat(key: str, sub: str = "p50_ms"):
        return lambda r: None if not r.get(key) else f"{r[key][sub]:.0f}"

    return [
        row("aggregate reader GB/s", lambda r: f"{r['gb_per_s']:.2f}"),
        row("reads completed", lambda r: f"{r['reads']:,}"),
        row("torn reads", lambda r: f"{r['torn_reads']}" + (f" {r['torn_reasons']}" if r["torn_reasons"] else "")),
        row("stale opens (old version after close)", lambda r: r["stale_opens"]),
        row("versions published / seen by readers", lambda r: f"{len(r['versions_published'])} / {r['versions_read']}"),
        row("inodes per version, mean / max (1 = shared pages)",
            lambda r: f"{r['inodes_per_version']['mean']:.1f} / {r['inodes_per_version']['max']}"),
        row("read of whole file p50 / max (ms)", lambda r: f"{r['read_latency']['p50_ms']:.0f} / "
                                                          f"{r['read_latency']['max_ms']:.0f}"),
        row("publishes (late > 50 ms: writer fell behind)", lambda r: f"{r['publishes']} ({r['publish_late']})"),
        row("publish p50 (ms)", lat("publish")),
        row("publish max (ms)", lat("publish", "max_ms")),
        row("  open+write+close p50 (ms)", lat("publish_write_close")),
        row("  of which close p50 / max (ms)", lambda r: f"{r['publish_close']['p50_ms']:.0f} / "
                                                       f"{r['publish_close']['max_ms']:.0f}"),
        row("  rename p50 / max (ms)", lambda r: None if not r.get("publish_rename") else
            f"{r['publish_rename']['p50_ms']:.1f} / {r['publish_rename']['max_ms']:.1f}"),
        row("first publish (create) (ms)", lambda r: f"{r['initial_publish_s'] * 1000:.0f}"),
        row("daemon RSS max / mean (MB)", lambda r: None if not r.get("daemon_rss") else
            f"{r['daemon_rss']['max_mb']:.0f} / {r['daemon_rss']['mean_mb']:.0f}"),
        row("daemon CPU (cores)", lambda r: r.get("server_cpu_cores")),
        row("readers / writer CPU (cores)", lambda r: f"{r['reader_cpu_cores']} / {r['writer_cpu_cores']}"),
        row("other load (cores)", lambda r: r.get("other_cpu_cores")),
    ]


def format_table(res: dict, labels: dict[str, str]) -> str:
    rows = _rows(res)
    head = ["", *(labels[s] for s in SYSTEMS)]
    body = [[label, *(cells[s] for s in SYSTEMS)] for label, cells in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    fmt = lambda cols: " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cols, widths)))
    return "\n".join([fmt(head), "+".join("-" * (w + 2) for w in widths), *(fmt(b) for b in body)])


def _goals(res: dict) -> list[dict]:
    d, t, e = (res.get(s) or {} for s in SYSTEMS)
    goals = []
    if d.get("gb_per_s") is not None and t.get("gb_per_s"):
        ratio = d["gb_per_s"] / t["gb_per_s"]
        goals.append({"goal": f"readers >= {READER_GOAL:.0%} of tmpfs aggregate throughput", "met": ratio >= READER_GOAL,
                      "value": f"{d['gb_per_s']:.2f} vs {t['gb_per_s']:.2f} GB/s = {ratio:.0%}"})
    else:
        goals.append({"goal": f"readers >= {READER_GOAL:.0%} of tmpfs aggregate throughput", "met": None,
                      "value": "not measured"})
    dp, ep = _g(d.get("publish"), "p50_ms"), _g(e.get("publish"), "p50_ms")
    if dp is not None and ep:
        goals.append({"goal": f"publish <= {PUBLISH_GOAL}x ext4 write+rename (p50)", "met": dp <= PUBLISH_GOAL * ep,
                      "value": f"{dp:.0f} vs {ep:.0f} ms = {dp / ep:.2f}x (max {_g(d['publish'], 'max_ms'):.0f} vs "
                               f"{_g(e['publish'], 'max_ms'):.0f} ms)"})
    else:
        goals.append({"goal": f"publish <= {PUBLISH_GOAL}x ext4 write+rename (p50)", "met": None,
                      "value": "not measured"})
    if "torn_reads" in d:
        goals.append({"goal": "torn reads = 0", "met": d["torn_reads"] == 0,
                      "value": f"{d['torn_reads']} of {d['reads']}"})
        goals.append({"goal": "stale opens = 0", "met": d["stale_opens"] == 0,
                      "value": f"{d['stale_opens']} of {d['reads']}"})
    return goals


def _plot(res: dict, labels: dict[str, str], goals: list[dict], path: Path, title: str, summary: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"distorefs": "#1f77b4", "tmpfs": "#2ca02c", "ext4": "#7f7f7f"}
    got = [s for s in SYSTEMS if res.get(s) and "error" not in res[s]]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    ax = axes[0, 0]
    vals = [res[s]["gb_per_s"] for s in got]
    bars = ax.bar([labels[s] for s in got], vals, color=[colors[s] for s in got])
    for b, v, s in zip(bars, vals, got):
        ax.annotate(f"{v:.2f}\n{res[s]['reads']} reads, {res[s]['torn_reads']} torn",
                    (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    if "tmpfs" in got:
        ax.axhline(READER_GOAL * res["tmpfs"]["gb_per_s"], color="red", linestyle="--", linewidth=1,
                   label=f"goal: {READER_GOAL:.0%} of tmpfs")
        ax.legend(fontsize=7)
    ax.margins(y=0.15)
    ax.set_title(f"aggregate reader throughput, {res['params']['readers']} readers (GB/s)", fontsize=9)
    ax.tick_params(labelsize=8)

    ax = axes[0, 1]
    x = np.arange(len(got))
    for j, (key, sub, lab) in enumerate((("publish", "p50_ms", "p50"), ("publish", "max_ms", "max"))):
        v = [_g(res[s].get(key), sub) or 0 for s in got]
        bs = ax.bar(x + (j - 0.5) * 0.38, v, 0.38, label=lab, color=[colors[s] for s in got], alpha=1.0 - 0.45 * j)
        for b, val in zip(bs, v):
            ax.annotate(f"{val:.0f}", (b.get_x() + b.get_width() / 2, val), ha="center", va="bottom", fontsize=7)
    if "ext4" in got and res["ext4"].get("publish"):
        ax.axhline(PUBLISH_GOAL * res["ext4"]["publish"]["p50_ms"], color="red", linestyle="--", linewidth=1,
                   label=f"goal: {PUBLISH_GOAL}x ext4 p50")
    ax.margins(y=0.1)
    ax.set_xticks(x, [labels[s] for s in got], fontsize=8)
    ax.set_title(f"publish latency of {res['params']['size_mib']} MiB (ms): "
                 "distorefs open+write+close, others write temp+rename", fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=8)

    ax = axes[0, 2]
    for s in got:
        series = res[s].get("publish_series") or []
        if series:
            ax.plot([a for a, _ in series], [b for _, b in series], marker="o", markersize=3, label=labels[s],
                    color=colors[s])
    ax.set_xlabel("s into the run", fontsize=8)
    ax.set_title("publish latency over the run (ms)", fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=8)

    ax = axes[1, 0]
    for s in got:
        series = res[s].get("read_series") or []
        ok = [(a, b) for a, b, _v, torn in series if not torn]
        bad = [(a, b) for a, b, _v, torn in series if torn]
        if ok:
            ax.scatter([a for a, _ in ok], [b * 1000 for _, b in ok], s=4, color=colors[s], label=labels[s])
        if bad:
            ax.scatter([a for a, _ in bad], [b * 1000 for _, b in bad], s=14, marker="x", color="red",
                       label=f"{labels[s]}: torn")
    ax.set_xlabel("s into the run (read start)", fontsize=8)
    ax.set_title("time to read the whole file, each read (ms)", fontsize=9)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=8)

    ax = axes[1, 1]
    rss = _g(res.get("distorefs"), "daemon_rss")
    if rss and rss.get("series"):
        ax.plot([a for a, _ in rss["series"]], [b for _, b in rss["series"]], color=colors["distorefs"])
        ax.set_xlabel("s into the run", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no daemon RSS samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("distorefs daemon RSS (MB)", fontsize=9)
    ax.tick_params(labelsize=8)

    ax = axes[1, 2]
    ax.axis("off")
    lines = list(summary) + [""] + [f"{'met ' if g['met'] else ('MISS' if g['met'] is False else ' -  ')} "
                                    f"{g['goal']}: {g['value']}" for g in goals]
    ax.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", fontsize=7.5, family="monospace", wrap=True,
            transform=ax.transAxes)
    save_figure(fig, path, title, fontsize=11)


# ----- places ------------------------------------------------------------------------------

class _Tmpfs:
    """A directory on tmpfs: under /dev/shm when it is tmpfs with room, else a tmpfs mounted for the run."""

    def __init__(self, root: Path, need_bytes: int) -> None:
        self.root, self.need = root, need_bytes
        self.dir: Path | None = None
        self.mounted: Path | None = None

    def make(self) -> Path:
        shm = Path("/dev/shm")
        try:
            fs = _fs_of(shm)
            if fs["fstype"] == "tmpfs" and fs["free_gb"] * 1e9 > 1.5 * self.need:
                self.dir = Path(tempfile.mkdtemp(prefix="distorefs-bench-weights-", dir=shm))
                return self.dir
        except OSError:
            pass
        mnt = self.root / "tmpfs"
        mnt.mkdir()
        size_mb = int(1.5 * self.need / 2**20) + 64
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise RuntimeError(f"mount -t tmpfs failed: {r.stderr.strip()}")
        self.mounted = self.dir = mnt
        return mnt

    def remove(self) -> None:
        if self.mounted is not None:
            subprocess.run(["umount", str(self.mounted)], capture_output=True)
            self.mounted = None
        elif self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None


# ----- entry point -------------------------------------------------------------------------

def run(out: Path, quick: bool = False, workdir: Path | None = None, distorefs_target: Path | None = None) -> dict:
    """Run the weights benchmark; write OUT/weights.json and OUT/weights.png; return the results.

    `distorefs_target`: a directory to use for the distorefs column instead of
    MNT/weights/bench on a fresh mount (for testing the harness; nothing is mounted then).
    Without it, a mount whose weights/ directory is missing falls back to a plain
    directory in the work directory, and the column is labelled as such."""
    r = start_run(out, workdir)
    out, root, notes, machine, started = r.out, r.root, r.notes, r.machine, r.started
    errors: list[str] = []
    p = _params(quick)
    size = p["size_mib"] << 20
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"distorefs bench weights{' --quick' if quick else ''}: {p['size_mib']} MiB published every "
        f"{p['period']:g} s, {p['readers']} readers, {p['seconds']:g} s per system; workdir {root} "
        f"({machine['fs']['fstype']} on {machine['fs']['source']}), {machine['cpus']} CPUs, "
        f"other load {machine['other_load_cores_start']} cores")
    result: dict[str, Any] = {"benchmark": "weights", "quick": quick, "params": p, "machine": machine,
                              "payload": {"header_bytes": HEADER, "body": "uint64 word i = (version << 40) + i",
                                          "read_chunk": CHUNK},
                              "goals_text": [f"readers >= {READER_GOAL:.0%} of tmpfs aggregate GB/s",
                                             f"publish p50 <= {PUBLISH_GOAL}x ext4 write+rename p50",
                                             "torn reads = 0", "stale opens = 0"]}
    labels = {"distorefs": "distorefs", "tmpfs": "tmpfs", "ext4": machine["fs"]["fstype"]}
    if machine["fs"]["fstype"] != "ext4":
        notes.append(f"the 'ext4' column is {machine['fs']['fstype']} (the work directory's file system)")
    dfs = DistorefsMount(root / "store", root / "mnt")
    tmpfs = _Tmpfs(root, (p["readers"] + 4) * size)
    fallback = False
    try:
        # distorefs
        log("[distorefs]")
        try:
            pid = None
            if distorefs_target is not None:
                target = Path(distorefs_target) / "bench"
                fallback = True
                notes.append(f"distorefs column: plain directory {distorefs_target} (as asked), in-place writes")
            else:
                dfs.mount()
                pid = dfs.pid
                if os.path.isdir(dfs.mnt / "weights"):
                    target = dfs.mnt / "weights" / "bench"
                else:
                    target = root / "fallback" / "weights" / "bench"
                    fallback = True
                    notes.append("the mount has no weights/ directory yet: the distorefs column ran against a plain "
                                 f"directory ({target.parent}, {machine['fs']['fstype']}) with the same in-place "
                                 "writer; its torn reads show the checker working, not distorefs")
            if fallback:
                labels["distorefs"] = "distorefs*"
            _drop_caches(notes)
            before = _store_stats(dfs.mnt) if pid else None
            result["distorefs"] = _run_system("distorefs", "inplace", target, p, pid, log)
            if pid:
                after = _store_stats(dfs.mnt)
                result["distorefs"]["store_stats"] = {"before": before, "after": after}
                result["distorefs"]["daemon_rss_after_mb"] = round((_rss(pid) or {}).get("rss_kb", 0) / 1024, 1)
                result["distorefs"]["daemon_cpu_total_s"] = _proc_cpu(pid)
            result["distorefs"]["fallback"] = fallback
        except Exception as exc:
            errors.append(f"distorefs: {type(exc).__name__}: {exc}")
            result["distorefs"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  distorefs failed: {exc}")
            traceback.print_exc()
        finally:
            try:
                t0 = time.monotonic()
                dfs.umount()
                result["distorefs_umount_s"] = round(time.monotonic() - t0, 2)
            except Exception as exc:
                errors.append(f"unmount {dfs.mnt}: {exc}")
        # tmpfs
        log("[tmpfs]")
        try:
            d = tmpfs.make()
            machine["tmpfs"] = {"dir": str(d), "mounted_for_run": tmpfs.mounted is not None}
            _drop_caches(notes)
            result["tmpfs"] = _run_system("tmpfs", "rename", d / "bench", p, None, log)
        except Exception as exc:
            errors.append(f"tmpfs: {type(exc).__name__}: {exc}")
            result["tmpfs"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  tmpfs failed: {exc}")
            traceback.print_exc()
        finally:
            tmpfs.remove()
        # ext4
        log(f"[{labels['ext4']}]")
        try:
            _drop_caches(notes)
            result["ext4"] = _run_system(labels["ext4"], "rename", root / "ext4" / "bench", p, None, log)
            shutil.rmtree(root / "ext4", ignore_errors=True)
        except Exception as exc:
            errors.append(f"ext4: {type(exc).__name__}: {exc}")
            result["ext4"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"  ext4 failed: {exc}")
            traceback.print_exc()
    finally:
        try:
            dfs.umount()
        except Exception as exc:
            errors.append(f"unmount {dfs.mnt}: {exc}")
        tmpfs.remove()
        remove_workdir(root, errors)
    machine["other_load_cores_end"] = _other_load(0.5)
    machine["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    goals = _goals(result)
    if fallback:
        for g in goals:
            g["value"] += " [fallback: plain directory, not distorefs]"
    result["labels"] = labels
    result["goals"] = goals
    result["notes"] = notes
    result["errors"] = errors
    result["elapsed_s"] = round(time.time() - started, 1)
    table = format_table(result, labels)
    result["table"] = table
    json_path = out / "weights.json"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    png_path = out / "weights.png"
    try:
        summary = [f"{'quick run' if quick else 'full run'}, {machine['cpus']} CPUs, {machine['mem_gb']} GB RAM",
                   f"{p['size_mib']} MiB file published every {p['period']:g} s",
                   f"{p['readers']} readers verifying every read, {p['seconds']:g} s per system",
                   f"disk: {machine['fs']['fstype']} on {machine['fs']['source']}",
                   f"other load at start/end: {machine['other_load_cores_start']}/"
                   f"{machine['other_load_cores_end']} cores"]
        if fallback:
            summary.append("distorefs* = FALLBACK plain dir, in-place writes")
        _plot(result, labels, goals, png_path,
              f"distorefs weights/: 1 writer + {p['readers']} readers vs tmpfs and {labels['ext4']} "
              f"({machine['cpus']} CPUs{', quick' if quick else ''})", summary)
    except Exception as exc:
        errors.append(f"plot: {type(exc).__name__}: {exc}")
        json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_report(table, goals, notes, errors, (
        f"payload: {p['size_mib']} MiB = {HEADER} B header + uint64 words (version << 40) + i, every word of every "
        f"read checked; distorefs writes in place (open 'wb', write, close), tmpfs/{labels['ext4']} write a temp "
        f"file and os.replace it; publish = the writer's open..close (+ rename).",))
    print(f"wrote {json_path} and {png_path} in {result['elapsed_s']:.0f}s")
    return result


def _store_stats(mnt: Path) -> dict | None:
    """The weights and memory-cache parts of MNT/.distorefs/stats.json."""
    try:
        with open(mnt / ".distorefs" / "stats.json", "rb") as f:
            st = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return {k: st.get(k) for k in ("weights", "memory", "tiers", "commits")}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="distorefs weights/ benchmark (see the module docstring)")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--distorefs-target", default=None,
                    help="a plain directory for the distorefs column instead of a mount (harness testing)")
    a = ap.parse_args()
    run(Path(a.out), quick=a.quick, workdir=Path(a.workdir) if a.workdir else None,
        distorefs_target=Path(a.distorefs_target) if a.distorefs_target else None)

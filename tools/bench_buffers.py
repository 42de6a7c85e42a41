"""Replay-buffer benchmark: distorefs vs plain files vs bindfs, side by side on one disk.

`distorefs bench buffers [--quick] [--out DIR] [--workdir DIR]` runs, in one go:

a) insert of ~110 KB .npy observation entries (create, write, close), 1 and P writer
   processes, compression on for distorefs (the achieved ratio is reported);
b) sample + read through per-entry files: open `sample/N`, read every listed entry;
   baselines read N random files (keys drawn with numpy);
c) sample + read through batch files: open `batch/256.npz`, np.load it, touch every
   array; baselines np.load 256 random .npy files and np.stack them;
d) 3 MB entries read whole in random order: a cold pass (distorefs remounted, page
   cache dropped), a warm pass, and a warm pass with P readers, in GB/s;
e) the sum-tree against cpprb (`bench_sumtree.run`).

Plain files live in a directory on the same file system as the store; bindfs (a C FUSE
passthrough) mounts that directory, so the bindfs column is "FUSE cost without
distorefs". Every phase records the CPU the daemon used and how busy the whole machine
was, because other work on a 2-core machine moves these numbers a lot.

Writes `OUT/buffers.json` and `OUT/buffers.png`, prints a table, returns the JSON dict.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .floorfs import FloorMount
from .mounts import daemon_pid, mountpoints_under
from .workload import FrameSource

SMALL_SHAPE = (16, 84, 84)    # uint8, 112,896 bytes + 128 header: ~110 KiB .npy
BIG_SHAPE = (448, 84, 84)     # uint8, 3,161,088 bytes + 128: ~3 MB .npy
SAMPLE_N = 64
BATCH_N = 256
SYSTEMS = ("distorefs", "plain", "bindfs", "floor")
LEVELS = (-10, -5, -1, 1, 3)  # zstd levels compared by the levels phase (negative: zstd's fast levels)
OTHER_LOAD_MAX = 0.3  # cores of other work tolerated during a timed phase before it is retried

# The targets of issue 12 ("The file path at the binding's floor"): (row key, value, unit, what).
# A "x bindfs" target is a ratio to bindfs in the same run.
TARGETS = {
    "insert": ("insert_P", 1.0, "x bindfs", "insert 110 KB, P writers >= 1.0x bindfs"),
    "sample": ("sample_P", 1.0, "x bindfs", "per-entry sample + read 110 KB, P readers >= 1.0x bindfs"),
    "batch": ("batch_1", 10000.0, "entries/s", "batch/256.npz of 110 KB entries, 1 reader >= 10,000 entries/s"),
    "big": ("big_warm_Pproc", 1.5, "GB/s", "3 MB entries, warm, P readers >= 1.5 GB/s"),
    "sumtree": ("", 2.0, "x cpprb", "sum-tree within 2x of cpprb"),
}


# ----- sizes -----------------------------------------------------------------------------

def _params(quick: bool) -> dict:
    if quick:
        return {"procs": 4, "insert_s": 1.0, "insert_cap": 1500, "read_s": 1.0, "retries": 2,
                "big_entries": 48, "sumtree": {"entries": 200_000, "batch": 256, "seconds": 0.4}}
    return {"procs": 4, "insert_s": 4.0, "insert_cap": 6000, "read_s": 3.0, "retries": 8,
            "big_entries": 256, "sumtree": {"entries": 1_000_000, "batch": 256, "seconds": 3.0}}


# ----- machine state -----------------------------------------------------------------------

def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    return sum(parts) - idle, sum(parts)


def _proc_cpu(pid: int | None) -> float | None:
    """CPU seconds (user + system, all threads) of `pid`."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class _CpuMeter:
    """Machine busy fraction and a server process's CPU use over one timed phase."""

    def __init__(self, server_pid: int | None) -> None:
        self.pid = server_pid
        self.t0 = time.monotonic()
        self.m0 = _cpu_times()
        self.p0 = _proc_cpu(server_pid)

    def done(self) -> dict:
        dt = time.monotonic() - self.t0
        m1 = _cpu_times()
        p1 = _proc_cpu(self.pid)
        busy = (m1[0] - self.m0[0]) / max(1e-9, m1[1] - self.m0[1])
        out = {"machine_busy": round(busy, 3)}
        if self.p0 is not None and p1 is not None and dt > 0:
            out["server_cpu_cores"] = round((p1 - self.p0) / dt, 3)
        return out


def _other_load(seconds: float = 1.0) -> float:
    """Cores busy while this process sleeps: work by others on the machine."""
    b0, t0 = _cpu_times()
    time.sleep(seconds)
    b1, t1 = _cpu_times()
    return round((b1 - b0) / max(1e-9, t1 - t0) * (os.cpu_count() or 1), 2)


def _fs_of(path: Path) -> dict:
    """File system type and source holding `path` (longest mount prefix)."""
    path = path.resolve()
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            src, mnt, fstype = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, src, fstype)
    st = os.statvfs(path)
    return {"mountpoint": best[0], "source": best[1], "fstype": best[2], "dev": os.stat(path).st_dev,
            "free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1)}


# Dropping the page cache is the whole host's (every other user's cache goes too): only
# when asked (`distorefs bench ... --drop-caches`). Otherwise "cold" reads are warm-ish.
DROP_CACHES = False

# Mounts a benchmark made and has not unmounted yet: taken down on SIGINT/SIGTERM too.
LIVE_MOUNTS: set = set()
MOUNT_SETTLE_S = 10.0  # how long the take-down of a mount cut short waits for its daemon


def unmount_all() -> None:
    """Unmount every mount a benchmark of this process made and still holds."""
    for m in list(LIVE_MOUNTS):
        try:
            m.umount()
        except Exception as exc:  # noqa: BLE001 - the next one must still go
            print(f"warning: could not unmount {m.mnt}: {exc}", file=sys.stderr)
        LIVE_MOUNTS.discard(m)


def _drop_caches(notes: list[str]) -> bool:
    if not DROP_CACHES:
        msg = "page cache not dropped (pass --drop-caches; it drops the whole host's): cold numbers are warm-ish"
        if msg not in notes:
            notes.append(msg)
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as exc:
        msg = f"could not drop page caches ({exc}); cold numbers are warm-ish"
        if msg not in notes:
            notes.append(msg)
        return False


# ----- mounts ------------------------------------------------------------------------------

def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distorefs.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _is_mounted(mnt: Path) -> bool:
    target = str(mnt.resolve())
    with open("/proc/mounts") as f:
        return any(line.split()[1].replace("\\040", " ") == target for line in f)


class DistorefsMount:
    def __init__(self, store: Path, mnt: Path) -> None:
        self.store, self.mnt = store, mnt
        self.pid: int | None = None
        self.starting = False  # `distorefs mount` ran and did not finish (a signal cut it short)

    def mount(self, *options: str, flags: tuple[str, ...] = ()) -> None:
        """Mount; `options` are store settings (KEY=VALUE, as for -o), `flags` more of
        `distorefs mount`'s options (--cluster URL)."""
        self.mnt.mkdir(parents=True, exist_ok=True)
        LIVE_MOUNTS.add(self)
        self.starting = True
        r = run_cli("mount", *flags, *[a for o in options for a in ("-o", o)], str(self.store), str(self.mnt))
        self.starting = False
        if r.returncode != 0:
            raise RuntimeError(f"distorefs mount failed: {r.stderr.strip() or r.stdout.strip()}")
        self.pid = daemon_pid(self.store)

    def _settle(self) -> None:
        """A mount cut short: the command was killed, but the daemon it started goes on.
        Wait until that daemon is mounted or gone (none within a second: none was started),
        so that its mount is taken down now rather than appearing afterwards."""
        start = time.monotonic()
        while not _is_mounted(self.mnt):
            waited = time.monotonic() - start
            if (daemon_pid(self.store) is None and waited > 1.0) or waited > MOUNT_SETTLE_S:
                break
            time.sleep(0.05)
        self.pid = daemon_pid(self.store)
        self.starting = False  # (only now: a signal during the wait leaves it to unmount_all)

    def umount(self) -> None:
        # Out of LIVE_MOUNTS only once down: a second signal that cuts this short leaves it
        # there for unmount_all to finish.
        if self.starting:
            self._settle()
        pid = self.pid
        if not _is_mounted(self.mnt):
            if pid is not None:  # our own daemon, by its pid, that never got its mount up
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        else:
            r = run_cli("umount", str(self.mnt))
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
                if pid and Path(f"/proc/{pid}").exists():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)  # our own daemon, by its pid
        self.pid = None
        LIVE_MOUNTS.discard(self)


class BindfsMount:
    def __init__(self, src: Path, mnt: Path) -> None:
        self.src, self.mnt = src, mnt
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def mount(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        LIVE_MOUNTS.add(self)
        self.proc = subprocess.Popen(["bindfs", "-f", str(self.src), str(self.mnt)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert self.proc.stderr is not None  # (stderr=PIPE)
        deadline = time.monotonic() + 20
        while not _is_mounted(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
                self.umount()
                raise RuntimeError(f"bindfs did not mount: {err.strip() or 'timeout'}")
            time.sleep(0.05)

    def umount(self) -> None:
        if self.proc is not None:  # (out of LIVE_MOUNTS only once down, as DistorefsMount)
            if _is_mounted(self.mnt):
                for cmd in (["fusermount3", "-u", str(self.mnt)], ["fusermount", "-u", str(self.mnt)],
                            ["fusermount3", "-u", "-z", str(self.mnt)]):
                    if subprocess.run(cmd, capture_output=True).returncode == 0:
                        break
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.terminate()  # our own bindfs, by its Popen handle
                self.proc.wait(timeout=10)
            self.proc = None
        LIVE_MOUNTS.discard(self)


# ----- worker processes --------------------------------------------------------------------

def _read_whole(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def _prep_insert(t: dict) -> None:
    """Observation bytes made before the clock starts: the insert is what is timed."""
    src = FrameSource(seed=t["seed"], shape=t["shape"])
    t["pool"] = [bytearray(src.npy(i)) for i in range(8)]


def _w_insert(t: dict, deadline: float) -> tuple[int, int]:
    pool = t["pool"]
    ops = nbytes = 0
    d, prefix, cap = t["dir"], t["prefix"], t["cap"]
    while ops < cap and time.perf_counter() < deadline:
        data = pool[ops % len(pool)]
        data[-8:] = ops.to_bytes(8, "little")  # every entry unique
        with open(f"{d}/{prefix}{ops}.npy", "wb") as f:
            f.write(data)
        ops += 1
        nbytes += len(data)
    return ops, nbytes


def _w_sample_entries(t: dict, deadline: float) -> tuple[int, int]:
    buf, n = t["buffer"], t["n"]
    ops = nbytes = 0
    while time.perf_counter() < deadline:
        with open(f"{buf}/sample/{n}", "rb") as f:
            lines = f.read().splitlines()
        for line in lines:
            nbytes += _read_whole(f"{buf}/entries/{line.split(b' ', 1)[0].decode()}")
        ops += len(lines)
    return ops, nbytes


def _w_random_files(t: dict, deadline: float) -> tuple[int, int]:
    d, names, n = t["dir"], t["names"], t["n"]
    rng = np.random.default_rng(t["seed"])
    ops = nbytes = 0
    while time.perf_counter() < deadline:
        for i in rng.integers(0, len(names), size=n).tolist():
            nbytes += _read_whole(f"{d}/{names[i]}")
        ops += n
    return ops, nbytes


def _w_batch_npz(t: dict, deadline: float) -> tuple[int, int]:
    # np.load(path), as a user writes it; if the probe found that failing (a batch file
    # reporting st_size 0 defeats zipfile's seek to the end), read it whole and np.load
    # from memory instead.
    path, by_path = t["path"], t["by_path"]
    ops = nbytes = 0
    while time.perf_counter() < deadline:
        if by_path:
            source: Any = path
        else:
            with open(path, "rb") as f:
                source = io.BytesIO(f.read())
        with np.load(source) as z:
            arrays = {k: z[k] for k in z.files}
        data = arrays["data"]
        ops += len(arrays["keys"])
        nbytes += data.nbytes
    return ops, nbytes


def _w_npy_stack(t: dict, deadline: float) -> tuple[int, int]:
    d, names, n = t["dir"], t["names"], t["n"]
    rng = np.random.default_rng(t["seed"])
    ops = nbytes = 0
    while time.perf_counter() < deadline:
        idx = rng.integers(0, len(names), size=n).tolist()
        data = np.stack([np.load(f"{d}/{names[i]}") for i in idx])
        ops += n
        nbytes += data.nbytes
    return ops, nbytes


def _w_read_list(t: dict, deadline: float) -> tuple[int, int]:
    d = t["dir"]
    ops = nbytes = 0
    for name in t["names"]:
        nbytes += _read_whole(f"{d}/{name}")
        ops += 1
    return ops, nbytes


WORKERS: dict[str, Callable[[dict, float], tuple[int, int]]] = {
    "insert": _w_insert, "sample_entries": _w_sample_entries, "random_files": _w_random_files,
    "batch_npz": _w_batch_npz, "npy_stack": _w_npy_stack, "read_list": _w_read_list,
}


def _worker_main(task: dict, seconds: float, barrier, results) -> None:
    out: dict[str, Any] = {"ops": 0, "bytes": 0, "elapsed": 0.0, "error": None}
    try:
        fn = WORKERS[task["kind"]]
        try:
            if task["kind"] == "insert":
                _prep_insert(task)
        except BaseException:
            barrier.abort()  # the parent and the other workers stop waiting
            raise
        barrier.wait(timeout=120)
        start = time.perf_counter()
        cpu0 = time.process_time()
        ops, nbytes = fn(task, start + seconds)
        out.update(ops=ops, bytes=nbytes, elapsed=time.perf_counter() - start, cpu=time.process_time() - cpu0)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    results.put(out)


def _cpu_text(r: dict) -> str:
    server = r.get("server_cpu_cores")
    return (f"cpu cores: server {'-' if server is None else f'{server:.2f}'}, "
            f"clients {r.get('client_cpu_cores', 0):.2f}, other {r.get('other_cpu_cores', 0):.2f}")


def _parallel(tasks: list[dict], seconds: float, server_pid: int | None = None) -> dict:
    """Run one worker process per task, started together; aggregate throughput."""
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    barrier = ctx.Barrier(len(tasks) + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(t, seconds, barrier, results), daemon=True) for t in tasks]
    for p in procs:
        p.start()
    outs: list[dict] = []
    try:
        barrier.wait(timeout=120)
        meter = _CpuMeter(server_pid)
        for _ in procs:
            outs.append(results.get(timeout=seconds + 600))
        cpu = meter.done()
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()  # our own worker
                p.join(timeout=5)
    errors = [o["error"] for o in outs if o["error"]]
    ops = sum(o["ops"] for o in outs)
    nbytes = sum(o["bytes"] for o in outs)
    wall = max((o["elapsed"] for o in outs), default=0.0)
    res = {"procs": len(tasks), "ops": ops, "bytes": nbytes, "seconds": round(wall, 3),
           "ops_per_s": round(ops / wall, 1) if wall > 0 else 0.0,
           "mb_per_s": round(nbytes / wall / 1e6, 1) if wall > 0 else 0.0,
           "gb_per_s": round(nbytes / wall / 1e9, 3) if wall > 0 else 0.0, **cpu}
    if wall > 0:
        # Cores used by the clients, and by everything else (not clients, not the server):
        # the second is other work on the machine competing with this measurement.
        res["client_cpu_cores"] = round(sum(o.get("cpu", 0.0) for o in outs) / wall, 3)
        ncpu = os.cpu_count() or 1
        res["other_cpu_cores"] = round(max(0.0, cpu["machine_busy"] * ncpu - res["client_cpu_cores"]
                                           - cpu.get("server_cpu_cores", 0.0)), 2)
    if errors:
        res["errors"] = errors[:3]
    return res


def _probe_np_load(path: Path) -> dict:
    """Does np.load(path) work on a batch file, as a user would call it?"""
    out: dict[str, Any] = {"path": path.name, "st_size": os.stat(path).st_size}
    try:
        with np.load(path) as z:
            out["files"] = list(z.files)
        out["ok"] = True
    except Exception as exc:
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# ----- phases ------------------------------------------------------------------------------

class Bench:
    def __init__(self, root: Path, quick: bool) -> None:
        self.root = root
        self.p = _params(quick)
        self.quick = quick
        self.notes: list[str] = []
        self.errors: list[str] = []
        self.store = root / "store"
        self.plain = root / "plain"
        self.dfs = DistorefsMount(self.store, root / "mnt")
        self.bfs = BindfsMount(self.plain, root / "bindmnt")
        self.floor = FloorMount(root / "floormnt")  # the binding's floor: pyfuse3 doing nothing
        self.res: dict[str, Any] = {}
        self.retries_left = self.p["retries"]

    # where each system's files live
    def small_dir(self, system: str) -> Path:
        if system == "distorefs":
            return self.dfs.mnt / "buffers" / "bench" / "entries"
        if system == "plain":
            return self.plain / "small_plain"
        if system == "floor":
            return self.floor.mnt / "small"
        return self.bfs.mnt / "small_bindfs"

    def server_pid(self, system: str) -> int | None:
        return {"distorefs": self.dfs.pid, "bindfs": self.bfs.pid, "floor": self.floor.pid}.get(system)

    def measure(self, make_tasks: Callable[[int], list[dict]], seconds: float, system: str) -> dict:
        """_parallel, repeated (within a retry budget) while other work on the machine took
        more than OTHER_LOAD_MAX cores; keeps the attempt least disturbed, records them all."""
        attempts: list[dict] = []
        while True:
            r = _parallel(make_tasks(len(attempts)), seconds, self.server_pid(system))
            attempts.append(r)
            if r.get("other_cpu_cores", 0.0) <= OTHER_LOAD_MAX or self.retries_left <= 0:
                break
            self.retries_left -= 1
        least = min(attempts, key=lambda a: a.get("other_cpu_cores", 0.0))
        best = dict(least)  # a copy: it is one of the attempts it lists
        if len(attempts) > 1:
            best["attempts"] = [{k: a.get(k) for k in ("ops_per_s", "mb_per_s", "gb_per_s", "other_cpu_cores")}
                                for a in attempts]
        return best

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def setup(self) -> None:
        self.plain.mkdir(parents=True)
        for sub in ("small_plain", "small_bindfs", "big"):
            (self.plain / sub).mkdir()
        self.dfs.mount()
        self.bfs.mount()
        LIVE_MOUNTS.add(self.floor)  # taken down on SIGINT/SIGTERM with the others
        self.floor.mount()
        for sub in ("small", "big"):
            (self.floor.mnt / sub).mkdir()
        self._make_buffer("bench", {"capacity": 1_000_000, "sampler": "uniform", "compression": "zstd",
                                    "compression_level": 1, "presample_batches": 2, "min_size_to_sample": 1})

    def _make_buffer(self, name: str, config: dict) -> None:
        path = self.dfs.mnt / "buffers" / name
        os.mkdir(path)
        with open(path / "config.json", "w") as f:
            f.write(json.dumps(config))

    def buffer_stats(self, name: str) -> dict:
        with open(self.dfs.mnt / "buffers" / name / "stats.json", "rb") as f:
            return json.loads(f.read())

    def _cache(self) -> dict:
        return self.store_stats().get("memory", {}).get("cache") or {"hits": 0, "misses": 0}

    def store_stats(self) -> dict:
        with open(self.dfs.mnt / ".distorefs" / "stats.json", "rb") as f:
            return json.loads(f.read())

    # a) insert
    def insert(self) -> None:
        p = self.p
        out: dict[str, Any] = {}
        for system in SYSTEMS:
            out[system] = {}
            for procs in (1, p["procs"]):
                _drop_caches(self.notes)
                d = self.small_dir(system)

                def tasks(attempt: int, d=d, procs=procs) -> list[dict]:
                    if attempt:
                        _drop_caches(self.notes)  # the last attempt's dirty pages out of the way
                    return [{"kind": "insert", "dir": str(d), "prefix": f"w{procs}a{attempt}x{i}-",
                             "seed": 100 * procs + i, "shape": SMALL_SHAPE, "cap": p["insert_cap"] // procs}
                            for i in range(procs)]
                r = self.measure(tasks, p["insert_s"], system)
                t0 = time.perf_counter()
                os.sync()
                r["sync_after_s"] = round(time.perf_counter() - t0, 3)
                out[system][str(procs)] = r
                self.log(f"  insert  {system:9s} {procs} proc: {r['ops_per_s']:9.0f} entries/s "
                         f"{r['mb_per_s']:7.1f} MB/s  ({_cpu_text(r)})")
        st = self.buffer_stats("bench")
        out["compression_ratio"] = st.get("compression_ratio")
        out["distorefs_buffer"] = {k: st.get(k) for k in ("entries", "bytes", "stored_bytes", "compression_ratio",
                                                          "tiers", "inserts")}
        self.res["insert"] = out

    def _names(self, system: str) -> list[str]:
        return sorted(os.listdir(self.small_dir(system)))

    # b) per-entry sample + read, c) batch files
    def reads(self) -> None:
        p = self.p
        buf = self.dfs.mnt / "buffers" / "bench"
        names = {s: self._names(s) for s in ("plain", "bindfs", "floor")}
        sample: dict[str, Any] = {}
        batch: dict[str, Any] = {}
        # warm-up draws: the pre-sampler starts on the first open of each size
        for path in (buf / "sample" / str(SAMPLE_N), buf / "batch" / f"{BATCH_N}.npz"):
            with open(path, "rb") as f:
                f.read()
        self.res["probe_np_load_path"] = _probe_np_load(buf / "batch" / "4.npz")
        by_path = bool(self.res["probe_np_load_path"].get("ok"))
        batch["distorefs_mode"] = "np.load(path)" if by_path else "np.load(io.BytesIO(open(path).read()))"
        for system in SYSTEMS:
            sample[system], batch[system] = {}, {}
            for procs in (1, p["procs"]):
                def tasks(attempt: int, system=system, procs=procs) -> list[dict]:
                    if system == "distorefs":
                        return [{"kind": "sample_entries", "buffer": str(buf), "n": SAMPLE_N} for _ in range(procs)]
                    return [{"kind": "random_files", "dir": str(self.small_dir(system)), "names": names[system],
                             "n": SAMPLE_N, "seed": 7 + i + 100 * attempt} for i in range(procs)]
                r = self.measure(tasks, p["read_s"], system)
                sample[system][str(procs)] = r
                self.log(f"  sample/{SAMPLE_N}+read {system:9s} {procs} proc: {r['ops_per_s']:9.0f} entries/s "
                         f"{r['mb_per_s']:7.1f} MB/s  ({_cpu_text(r)})")
            for procs in (1, p["procs"]):
                def tasks(attempt: int, system=system, procs=procs) -> list[dict]:
                    if system == "distorefs":
                        return [{"kind": "batch_npz", "path": str(buf / "batch" / f"{BATCH_N}.npz"),
                                 "by_path": by_path} for _ in range(procs)]
                    return [{"kind": "npy_stack", "dir": str(self.small_dir(system)), "names": names[system],
                             "n": BATCH_N, "seed": 11 + i + 100 * attempt} for i in range(procs)]
                r = self.measure(tasks, p["read_s"], system)
                batch[system][str(procs)] = r
                self.log(f"  batch/{BATCH_N}.npz {system:9s} {procs} proc: {r['ops_per_s']:9.0f} entries/s "
                         f"{r['mb_per_s']:7.1f} MB/s  ({_cpu_text(r)})")
        st = self.buffer_stats("bench")
        sample["distorefs_buffer"] = {k: st.get(k) for k in ("entries", "batches", "sampled_entries",
                                                             "presampled_used", "reads")}
        sample["dataset_entries"] = {"distorefs": st.get("entries"), "plain": len(names["plain"]),
                                     "bindfs": len(names["bindfs"]), "floor": len(names["floor"])}
        sample["distorefs_cache"] = self.store_stats().get("memory", {}).get("cache")
        self.res["sample"] = sample
        self.res["batch"] = batch

    # d) 3 MB entries
    def big(self) -> None:
        p = self.p
        n = p["big_entries"]
        procs = p["procs"]
        self._make_buffer("big", {"capacity": 1_000_000, "sampler": "uniform", "compression": "zstd",
                                  "compression_level": 1, "presample_batches": 0})
        dirs = {"distorefs": self.dfs.mnt / "buffers" / "big" / "entries", "plain": self.plain / "big",
                "bindfs": self.bfs.mnt / "big", "floor": self.floor.mnt / "big"}
        out: dict[str, Any] = {"entries": n, "entry_bytes": int(np.prod(BIG_SHAPE)) + 128}
        fill = {}
        for system in ("distorefs", "plain", "floor"):  # bindfs reads the plain directory's files
            tasks = [{"kind": "insert", "dir": str(dirs[system]), "prefix": f"big{i}-", "seed": 500 + i,
                      "shape": BIG_SHAPE, "cap": n // procs + (1 if i < n % procs else 0)} for i in range(procs)]
            fill[system] = _parallel(tasks, 600.0, self.server_pid(system))
            self.log(f"  3MB fill {system:9s}: {fill[system]['ops']} entries, {fill[system]['mb_per_s']:.0f} MB/s")
        out["fill"] = fill
        st = self.buffer_stats("big")
        out["distorefs_buffer"] = {k: st.get(k) for k in ("entries", "bytes", "stored_bytes", "compression_ratio",
                                                          "tiers")}
        rng = np.random.default_rng(3)
        for system in SYSTEMS:
            names = sorted(os.listdir(dirs[system]))
            out[system] = {}
            if system == "distorefs":  # cold: a fresh daemon (empty memory tier)
                self.dfs.umount()
                self.dfs.mount()
            cold = _drop_caches(self.notes)
            for label, nprocs in (("cold", 1), ("warm", 1), (f"warm_{procs}proc", procs)):
                def make_tasks(attempt: int, nprocs=nprocs, system=system, names=names) -> list[dict]:
                    order = [names[i] for i in rng.permutation(len(names))]
                    return [{"kind": "read_list", "dir": str(dirs[system]), "names": order[i::nprocs]}
                            for i in range(nprocs)]
                c0 = self._cache() if system == "distorefs" else None
                if label == "cold":  # a retry would not be cold any more
                    r = _parallel(make_tasks(0), 600.0, self.server_pid(system))
                    r["page_cache_dropped"] = cold
                else:
                    r = self.measure(make_tasks, 600.0, system)
                if c0 is not None:
                    c1 = self._cache()
                    hits, misses = c1["hits"] - c0["hits"], c1["misses"] - c0["misses"]
                    r["memory_tier_hit_rate"] = round(hits / (hits + misses), 3) if hits + misses else None
                out[system][label] = r
                hit = r.get("memory_tier_hit_rate")
                self.log(f"  3MB read {label:11s} {system:9s}: {r['gb_per_s']:6.2f} GB/s "
                         f"({r['ops_per_s']:.0f} entries/s, {_cpu_text(r)}"
                         + (f", memory tier hit rate {hit:.0%}" if hit is not None else "") + ")")
        out["distorefs_cache"] = self.store_stats().get("memory", {}).get("cache")
        self.res["big"] = out

    # e) zstd levels: what each level costs the daemon per insert and what it saves on disk
    # (compressed at insert, compress_hot: by default a hot value is compressed when demoted)
    def levels(self) -> None:
        p = self.p
        out: dict[str, Any] = {}
        for level in LEVELS:
            name = f"level{level}".replace("-", "m")
            self._make_buffer(name, {"capacity": 1_000_000, "sampler": "uniform", "compression": "zstd",
                                     "compression_level": level, "compress_hot": True})
            d = self.dfs.mnt / "buffers" / name / "entries"

            def tasks(attempt: int, d=d) -> list[dict]:
                return [{"kind": "insert", "dir": str(d), "prefix": f"a{attempt}x{i}-", "seed": 7 + i,
                         "shape": SMALL_SHAPE, "cap": p["insert_cap"] // p["procs"]}
                        for i in range(p["procs"])]
            r = self.measure(tasks, p["insert_s"], "distorefs")
            st = self.buffer_stats(name)
            server = r.get("server_cpu_cores")
            r["compression_ratio"] = st.get("compression_ratio")
            r["server_cpu_us_per_entry"] = (round(server / r["ops_per_s"] * 1e6, 1)
                                            if server is not None and r["ops_per_s"] else None)
            out[str(level)] = r
            self.log(f"  level {level:3d}: {r['ops_per_s']:7.0f} entries/s, ratio x{r['compression_ratio']}, "
                     f"daemon {r['server_cpu_us_per_entry']} us CPU/entry ({_cpu_text(r)})")
            shutil.rmtree(self.dfs.mnt / "buffers" / name, ignore_errors=True)
        self.res["levels"] = out

    # f) sum-tree
    def sumtree(self) -> None:
        try:
            from . import bench_sumtree
            self.res["sumtree"] = bench_sumtree.run(**self.p["sumtree"])
        except Exception as exc:  # missing module or a failing run: record, keep going
            self.res["sumtree"] = {"error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc(limit=3)}
        s = self.res["sumtree"]
        if "error" in s:
            self.log(f"  sum-tree: failed: {s['error']}")
        else:
            self.log(f"  sum-tree: sample {s.get('distorefs_sample_us')} us vs cpprb {s.get('cpprb_sample_us')} us; "
                     f"update {s.get('distorefs_update_us')} us vs cpprb {s.get('cpprb_update_us')} us")

    def teardown(self) -> None:
        for m in (self.bfs, self.dfs, self.floor):
            try:
                m.umount()
            except Exception as exc:
                self.errors.append(f"unmount {m.mnt}: {exc}")


# ----- report ------------------------------------------------------------------------------

def _get(d: dict, *path) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _rows(res: dict, procs: int) -> list[dict]:
    """Table rows: operation, value per system, ratio vs plain, target, met?"""
    rows = []
    ratio = _get(res, "insert", "compression_ratio")

    def add(op: str, kind: str, key: str, vals: dict, unit: str, fmt: str) -> None:
        row_key, target, target_unit, _ = TARGETS[kind]
        judged = key == row_key.replace("P", str(procs))
        d, b = vals.get("distorefs"), vals.get("bindfs")
        value = (d / b if d is not None and b else None) if target_unit == "x bindfs" else d
        rows.append({
            "operation": op, "kind": kind, "key": key, "unit": unit, "fmt": fmt,
            "distorefs": d, "plain": vals.get("plain"), "bindfs": b, "floor": vals.get("floor"),
            "ratio_vs_plain": (round(d / vals["plain"], 3) if d is not None and vals.get("plain") else None),
            "ratio_vs_bindfs": round(d / b, 3) if d is not None and b else None,
            "target": target if judged else None, "target_unit": target_unit,
            "met": None if value is None or not judged else value >= target,
        })

    for pr in ("1", str(procs)):
        v = {s: _get(res, "insert", s, pr, "ops_per_s") for s in SYSTEMS}
        mb = {s: _get(res, "insert", s, pr, "mb_per_s") for s in SYSTEMS}
        add(f"insert 110 KB .npy, {pr} writer{'s' if pr != '1' else ''} (stored x{ratio})", "insert",
            f"insert_{pr}", v, "entries/s", "{:,.0f}")
        rows[-1]["mb_per_s"] = mb
    for pr in ("1", str(procs)):
        v = {s: _get(res, "sample", s, pr, "ops_per_s") for s in SYSTEMS}
        add(f"sample/{SAMPLE_N} + read entries, {pr} reader{'s' if pr != '1' else ''}", "sample",
            f"sample_{pr}", v, "entries/s", "{:,.0f}")
        rows[-1]["mb_per_s"] = {s: _get(res, "sample", s, pr, "mb_per_s") for s in SYSTEMS}
    for pr in ("1", str(procs)):
        v = {s: _get(res, "batch", s, pr, "ops_per_s") for s in SYSTEMS}
        mode = "" if _get(res, "batch", "distorefs_mode") in (None, "np.load(path)") else " (via BytesIO)"
        add(f"batch/{BATCH_N}.npz + np.load{mode}, {pr} reader{'s' if pr != '1' else ''}", "batch",
            f"batch_{pr}", v, "entries/s", "{:,.0f}")
        rows[-1]["mb_per_s"] = {s: _get(res, "batch", s, pr, "mb_per_s") for s in SYSTEMS}
    for label, text in (("cold", "cold, 1 reader"), ("warm", "warm, 1 reader"),
                        (f"warm_{procs}proc", f"warm, {procs} readers")):
        v = {s: _get(res, "big", s, label, "gb_per_s") for s in SYSTEMS}
        hit = _get(res, "big", "distorefs", label, "memory_tier_hit_rate")
        hit_text = f", distorefs memory-tier hits {hit:.0%}" if hit is not None else ""
        add(f"3 MB entries read whole, {text}{hit_text}", "big", f"big_{label}", v, "GB/s", "{:.2f}")
    st = res.get("sumtree") or {}
    if "error" not in st:
        for op in ("sample", "update"):
            d, c = st.get(f"distorefs_{op}_us"), st.get(f"cpprb_{op}_us")
            rows.append({"operation": f"sum-tree {op} {st.get('batch')} of {st.get('entries'):,} (us; plain col = cpprb)",
                         "kind": "sumtree", "key": f"sumtree_{op}", "unit": "us/op", "fmt": "{:.1f}",
                         "distorefs": d, "plain": c, "bindfs": None, "floor": None,
                         "ratio_vs_plain": round(d / c, 3) if d and c else None, "ratio_vs_bindfs": None,
                         "target": 2.0, "target_unit": "x cpprb", "met": (d / c <= 2.0) if d and c else None})
    else:
        rows.append({"operation": "sum-tree vs cpprb", "kind": "sumtree", "key": "sumtree", "unit": "",
                     "fmt": "{}", "distorefs": None, "plain": None, "bindfs": None, "floor": None,
                     "ratio_vs_plain": None, "ratio_vs_bindfs": None, "target": 2.0, "target_unit": "x cpprb",
                     "met": None, "error": st["error"]})
    return rows


def _cell(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _target_text(row: dict) -> str:
    if row["target"] is None:
        return "-"
    if row["kind"] == "sumtree":
        return "<= 2.0x cpprb"
    if row["target_unit"] == "x bindfs":
        return f">= {row['target']:g}x bindfs"
    if row["kind"] == "big":
        return f">= {row['target']:g} GB/s"
    return f">= {row['target']:,.0f}/s"


def format_table(rows: list[dict]) -> str:
    head = ["operation", "distorefs", "plain", "bindfs", "floor", "vs bindfs", "target", "met?"]
    body = []
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        if r.get("error"):
            met = "error"
        body.append([r["operation"], _cell(r["distorefs"], r["fmt"]), _cell(r["plain"], r["fmt"]),
                     _cell(r["bindfs"], r["fmt"]), _cell(r.get("floor"), r["fmt"]),
                     "-" if r.get("ratio_vs_bindfs") is None else f"{r['ratio_vs_bindfs']:.2f}x",
                     _target_text(r), met])
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    line = "+".join("-" * (w + 2) for w in widths)
    out = [" | ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))), line]
    for row in body:
        out.append(" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(out)


def _plot(rows: list[dict], path: Path, title: str, summary: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("insert", "insert 110 KB .npy (entries/s)"), ("sample", f"sample/{SAMPLE_N} + read entries (entries/s)"),
              ("batch", f"batch/{BATCH_N}.npz + np.load (entries/s)"), ("big", "3 MB entries read whole (GB/s)"),
              ("sumtree", "sum-tree, batch of 256 (us per op, lower is better)")]
    colors = {"distorefs": "#1f77b4", "plain": "#7f7f7f", "bindfs": "#ff7f0e", "floor": "#2ca02c"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    flat = axes.ravel()
    for ax, (kind, label) in zip(flat, groups):
        rs = [r for r in rows if r["kind"] == kind]
        systems = ["distorefs", "plain"] + ([] if kind == "sumtree" else ["bindfs", "floor"])
        x = np.arange(len(rs))
        w = 0.8 / len(systems)
        for j, s in enumerate(systems):
            vals = [r[s] or 0.0 for r in rs]
            name = "cpprb" if (kind == "sumtree" and s == "plain") else s
            bars = ax.bar(x + (j - (len(systems) - 1) / 2) * w, vals, w, label=name, color=colors[s])
            for b, v in zip(bars, vals):
                if v:
                    ax.annotate(f"{v:,.2f}" if kind == "big" else f"{v:,.0f}", (b.get_x() + b.get_width() / 2, v),
                                ha="center", va="bottom", fontsize=6)
        if rs and kind in ("batch", "big"):
            ax.axhline(TARGETS[kind][1], color="red", linestyle="--", linewidth=1, label="target")
        ticks = {"insert": lambda k: f"{k.split('_')[1]} writer(s)", "sample": lambda k: f"{k.split('_')[1]} reader(s)",
                 "batch": lambda k: f"{k.split('_')[1]} reader(s)",
                 "big": lambda k: k.split("_", 1)[1].replace("_", ", ").replace("proc", " readers"),
                 "sumtree": lambda k: k.split("_", 1)[1] if "_" in k else k}[kind]
        ax.set_xticks(x, [ticks(r["key"]) for r in rs], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
        ax.tick_params(axis="y", labelsize=8)
    flat[-1].axis("off")
    flat[-1].text(0.0, 1.0, "\n".join(summary), va="top", ha="left", fontsize=7.5, family="monospace", wrap=True,
                  transform=flat[-1].transAxes)
    save_figure(fig, path, title, fontsize=11)


# ----- entry point -------------------------------------------------------------------------

def machine_info(root: Path, notes: list[str]) -> dict:
    """What the numbers were measured on, and a note if the machine was busy at the start."""
    machine: dict[str, Any] = {
        "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
        "numpy": np.__version__, "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "workdir": str(root), "fs": _fs_of(root)}
    try:
        with open("/sys/block/" + Path(machine["fs"]["source"]).name + "/queue/read_ahead_kb") as f:
            machine["read_ahead_kb"] = int(f.read())
    except (OSError, ValueError):
        pass
    machine["loadavg_start"] = open("/proc/loadavg").read().split()[:3]
    machine["other_load_cores_start"] = _other_load(1.0)
    if machine["other_load_cores_start"] > 0.3:
        notes.append(f"the machine was not idle: {machine['other_load_cores_start']} cores busy with other work "
                     f"at the start (of {machine['cpus']}); every number below competes with it")
    return machine


def _pick_workdir(workdir: Path | None, notes: list[str]) -> Path:
    base = Path(workdir) if workdir else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    fs = _fs_of(base)
    if fs["fstype"] in ("tmpfs", "ramfs"):
        if workdir is not None:
            notes.append(f"workdir {base} is on {fs['fstype']}: results measure memory, not a disk")
        else:
            raise RuntimeError(f"{base} is on {fs['fstype']}; pass --workdir on a disk-backed file system")
    return Path(tempfile.mkdtemp(prefix="distorefs-bench-", dir=base))


@dataclass
class BenchRun:
    """What every benchmark starts from: its output directory, a scratch directory on a
    disk, the notes its report ends with, the machine it ran on, and when it started."""

    out: Path
    root: Path
    notes: list[str]
    machine: dict
    started: float


def save_figure(fig, path: Path, title: str | None = None, fontsize: float | None = None, dpi: int = 110) -> None:
    """The end of every benchmark's plot: its title, the layout, the PNG, the figure freed."""
    import matplotlib.pyplot as plt
    if title is not None:
        fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def remove_workdir(root: Path, errors: list[str]) -> None:
    """Remove a benchmark's work directory, unless something is still mounted below it: a
    removal would go through the mount (a store's or a baseline's files), so it is left
    in place and `errors` says so."""
    still = mountpoints_under(root)
    if still:
        errors.append(f"left {root} in place: still mounted: {', '.join(map(str, still))}")
    else:
        shutil.rmtree(root, ignore_errors=True)


def start_run(out: Path, workdir: Path | None) -> BenchRun:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    notes: list[str] = []
    root = _pick_workdir(workdir, notes)
    return BenchRun(out, root, notes, machine_info(root, notes), started)


def print_report(table: str, goals: list[dict], notes: list[str], errors: list[str],
                 explanations: tuple[str, ...] = ()) -> None:
    """The end of a benchmark's output: its table, each goal met or missed, then what
    explains the numbers, notes and errors."""
    print()
    print(table)
    print()
    for g in goals:
        status = "met " if g["met"] else ("MISS" if g["met"] is False else " -  ")
        print(f"goal {status} {g['goal']}: {g['value']}")
    for line in explanations:
        print(line)
    for n in notes:
        print(f"note: {n}")
    for e in errors:
        print(f"error: {e}")


def run(out: Path, quick: bool = False, workdir: Path | None = None) -> dict:
    """Run the whole benchmark; write OUT/buffers.json and OUT/buffers.png; return the results."""
    r = start_run(out, workdir)
    out, root, notes, machine, started = r.out, r.root, r.notes, r.machine, r.started
    bench = Bench(root, quick)
    bench.notes = notes
    p = bench.p
    print(f"distorefs bench buffers{' --quick' if quick else ''}: workdir {root} "
          f"({machine['fs']['fstype']} on {machine['fs']['source']}), {machine['cpus']} CPUs, "
          f"other load {machine['other_load_cores_start']} cores", flush=True)
    result: dict[str, Any] = {"benchmark": "buffers", "quick": quick, "params": p, "machine": machine,
                              "entry_shapes": {"small": SMALL_SHAPE, "big": BIG_SHAPE},
                              "targets": {k: v[3] for k, v in TARGETS.items()}}
    try:
        bench.setup()
        for name, phase in (("insert", bench.insert), ("reads", bench.reads), ("big", bench.big),
                            ("levels", bench.levels)):
            print(f"[{name}]", flush=True)
            try:
                phase()
            except Exception as exc:
                bench.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"  {name} failed: {exc}", flush=True)
                traceback.print_exc()
        try:
            result["distorefs_store_stats"] = {k: v for k, v in bench.store_stats().items() if k != "buffers"}
        except OSError as exc:
            bench.errors.append(f"store stats: {exc}")
    except Exception as exc:
        bench.errors.append(f"setup: {type(exc).__name__}: {exc}")
        print(f"  setup failed: {exc}", flush=True)
    finally:
        bench.teardown()
        remove_workdir(root, bench.errors)
    print("[sum-tree]", flush=True)
    bench.sumtree()
    machine["other_load_cores_end"] = _other_load(1.0)
    machine["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    result.update(bench.res)
    probe = bench.res.get("probe_np_load_path")
    if probe and not probe.get("ok"):
        notes.append(f"np.load('batch/N.npz') by path fails ({probe.get('error')}; st_size {probe.get('st_size')}): "
                     f"the distorefs batch rows read the file whole and np.load an io.BytesIO of it")
    rows = _rows(bench.res, p["procs"])
    result["rows"] = [{k: v for k, v in r.items() if k != "fmt"} for r in rows]
    result["notes"] = notes
    result["errors"] = bench.errors
    result["elapsed_s"] = round(time.time() - started, 1)
    table = format_table(rows)
    result["table"] = table
    json_path = out / "buffers.json"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    png_path = out / "buffers.png"
    try:
        summary = [f"{'quick run' if quick else 'full run'}, {machine['cpus']} CPUs, "
                   f"{machine['fs']['fstype']} on {machine['fs']['source']}",
                   f"entries {SMALL_SHAPE} uint8 .npy, stored x{_get(bench.res, 'insert', 'compression_ratio')}",
                   f"big entries {BIG_SHAPE} uint8 (3.2 MB)",
                   f"other load at start/end: {machine['other_load_cores_start']}"
                   f"/{machine.get('other_load_cores_end')} cores", ""]
        for row in rows:
            if row["met"] is not None:
                summary.append(f"{'met ' if row['met'] else 'MISS'} {row['operation'][:52]}")
        _plot(rows, png_path, f"distorefs replay buffers vs plain files and bindfs "
                              f"({machine['cpus']} CPUs, {machine['fs']['fstype']}{', quick' if quick else ''})",
              summary)
    except Exception as exc:
        result["errors"].append(f"plot: {exc}")
        json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print()
    print(table)
    print()
    ratio = _get(bench.res, "insert", "compression_ratio")
    print(f"entries: {SMALL_SHAPE} uint8 .npy ({int(np.prod(SMALL_SHAPE)) + 128:,} B), zstd ratio in distorefs: "
          f"{ratio} (hot values are stored as written, compressed when demoted); 3 MB entries: {BIG_SHAPE} uint8. plain = files in a directory on the same file system; "
          f"bindfs = C FUSE passthrough of that directory. Warm = data in memory (page cache / memory tier).")
    levels = bench.res.get("levels") or {}
    if levels:
        print(f"zstd levels (compressed at insert: compress_hot), insert 110 KB .npy with {p['procs']} writers: "
              + "; ".join(
            f"{lv}: {r['ops_per_s']:,.0f}/s x{r.get('compression_ratio')} {r.get('server_cpu_us_per_entry')} us"
            for lv, r in levels.items()))
    for n in notes:
        print(f"note: {n}")
    for e in bench.errors:
        print(f"error: {e}")
    print(f"wrote {json_path} and {png_path} in {result['elapsed_s']:.0f}s")
    return result


if __name__ == "__main__":
    run(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results"), quick="--quick" in sys.argv)

"""`distorefs warmup PATH...`: load files or trees of a mount into the daemon's memory tier
and the kernel's page cache before a job reads them (as JuiceFS's warmup does).

For each file, in a few threads at once:
1. The file is opened and, unless it is wholly in the page cache already (mincore on a
   mapping of it: no page is read), read through the mount in 1 MiB reads. That fills the
   page cache, and the daemon's reads put the values into its memory tier as any read does.
2. `getxattr user.distorefs.warm` then asks the daemon to make sure the file's stored values
   are in the memory tier, sending nothing back: values the read put there are found there
   (no second read from disk), the others (a file whose pages the kernel had, so no read
   reached the daemon; values evicted meanwhile) are read, decoded and verified in the
   daemon's worker threads. The reply says how many bytes were held, loaded, or refused.
   The tier's budget (`cache_bytes`) bounds it: the daemon never takes a value over a
   quarter of it, nor more for one file than the tier holds; and this command stops asking
   once the files it warmed would fill the tier (the rest is warmed in the page cache; the
   summary says the tier was full). Files the memory tier does not serve (checkpoint files:
   their reads stream past it) answer ENODATA: page cache only.

Reads of files beyond the budget still pass through the memory tier (least recently used
values leave), so of a tree bigger than the tier, the tier ends holding what was read last.
Nothing is dropped from any cache, and memory stays bounded by the store's configuration.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import stat as stat_mod
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..backends.resident import page_flags
from .inspection import walk_tree, is_dataset_dir, is_namespace_dir, mount_root

WARM_XATTR = "user.distorefs.warm"
READ_BYTES = 1 << 20
# Files at least this big are read one at a time: one sequential reader of a big file keeps
# the daemon busy already (the kernel's read-ahead sends its requests ahead of it), and
# several interleaved ran slower here (2 cores: 790 MB/s one at a time, 595 with 4 threads).
BIG_FILE = 8 << 20
# Files a namespace or tree renders (statistics, configuration): not data to warm.
_RENDERED = {"config.json", "stats.json", "priorities"}


@dataclass
class WarmupReport:
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    page_cache_already: int = 0  # bytes in the page cache when the file was opened
    read_bytes: int = 0  # bytes read through the mount to fill it
    memory_held: int = 0  # bytes in the memory tier once warmed (by the reads or the warm requests)
    memory_loaded: int = 0  # of which the warm requests loaded (the reads did not bring them)
    memory_refused: int = 0  # bytes the daemon would not take (a value too big for the tier, or the tier full)
    memory_over_budget: int = 0  # bytes not asked for: the tier's budget was used up by this warmup
    memory_not_served: int = 0  # bytes of files the memory tier does not serve (checkpoints)
    memory_budget: int = 0  # the tier's capacity (cache_bytes)
    errors: list[str] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "mb_per_s": round(self.mb_per_s, 1), "files_per_s": round(self.files_per_s, 1)}


def collect(paths: list[Path]) -> list[tuple[Path, int]]:
    """(file, size) of every regular file named or below a directory named, as `export`
    walks them (no generated or control files), without a namespace's rendered files."""
    out: list[tuple[Path, int]] = []
    for top in paths:
        st = os.stat(top)
        if stat_mod.S_ISREG(st.st_mode):
            out.append((top, st.st_size))
            continue
        for rel, st in walk_tree(top):
            if not stat_mod.S_ISREG(st.st_mode):
                continue
            path = top / rel
            if path.name in _RENDERED and _renders(path.parent):
                continue
            out.append((path, st.st_size))
    return out


def _renders(directory: Path) -> bool:
    """Whether `directory` is one whose config.json/stats.json are the store's, not data."""
    root = mount_root(directory)
    return (is_namespace_dir(directory) or is_dataset_dir(directory)
            or (root is not None and directory in (root / "weights", root / "checkpoints")))


def _parse(reply: bytes) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (part.split(b"=", 1) for part in reply.split())}


# ----- page cache residency ---------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(fd: int, size: int) -> int | None:
    """Bytes of the open file `fd` in the page cache (mincore of a read-only mapping: no
    page is read), or None when it cannot be mapped (a file opened with direct I/O)."""
    if size == 0:
        return 0
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        return None
    try:
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        flags = page_flags(addr, size)
        if flags is None:
            return None
        resident = sum(b & 1 for b in flags)
        if resident == pages:
            return size
        return resident * page - (page - size % page if flags[pages - 1] & 1 and size % page else 0)
    finally:
        _libc.munmap(addr, size)


# ----- the warmup -------------------------------------------------------------------------------

class _Budget:
    """What this warmup has asked the memory tier to hold, against its capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.asked = 0
        self.lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self.lock:
            if self.asked + size > self.capacity:
                return False
            self.asked += size
            return True


def _capacity(paths: list[Path]) -> int:
    root = mount_root(paths[0]) if paths else None
    if root is None:
        return 0
    try:
        stats = json.loads((root / ".distorefs" / "stats.json").read_bytes())
        return int(stats["memory"]["cache"]["capacity_bytes"])
    except (OSError, ValueError, KeyError):
        return 0


def _read_all(f, buf: bytearray) -> int:
    view = memoryview(buf)
    n = 0
    while got := f.readinto(view):
        n += got
    return n


def _warm(path: Path, size: int, budget: _Budget) -> dict[str, int]:
    """The memory tier's part for one file (report fields)."""
    if not budget.take(size):
        return {"memory_over_budget": size}
    try:
        got = _parse(os.getxattr(path, WARM_XATTR))
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.ENOTSUP):
            raise
        return {"memory_not_served": size}
    return {"memory_held": got["already"] + got["loaded"], "memory_loaded": got["loaded"],
            "memory_refused": got["refused"]}


def warmup(paths: list[Path], *, jobs: int = 4, memory: bool = True, progress: bool = True) -> WarmupReport:
    """Warm `paths` (files or directories under one mount); see the module docstring."""
    from tqdm import tqdm

    t0 = time.monotonic()
    files = collect(paths)
    report = WarmupReport(files=len(files), bytes=sum(s for _, s in files), memory_budget=_capacity(paths))
    budget = _Budget(report.memory_budget)
    lock = threading.Lock()
    bar = tqdm(total=report.bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               desc="warmup", dynamic_ncols=True)
    local = threading.local()
    big = threading.Semaphore(1)

    def one(item: tuple[Path, int]) -> None:
        path, size = item
        counts: dict[str, int] = {}
        try:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(READ_BYTES)
            with open(path, "rb", buffering=0) as f:
                resident = resident_bytes(f.fileno(), size)
                counts["page_cache_already"] = resident or 0
                if resident != size:
                    if size >= BIG_FILE:
                        with big:
                            counts["read_bytes"] = _read_all(f, buf)
                    else:
                        counts["read_bytes"] = _read_all(f, buf)
            if memory:
                counts.update(_warm(path, size, budget))
        except OSError as exc:
            with lock:
                report.errors.append(f"{path}: {exc.strerror or exc}")
        with lock:
            for k, v in counts.items():
                setattr(report, k, getattr(report, k) + v)
            bar.update(size)

    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            list(pool.map(one, files))
    finally:
        bar.close()
    report.seconds = time.monotonic() - t0
    return report


def summary(r: WarmupReport) -> list[str]:
    from .inspection import human
    lines = [f"warmed {r.files} files, {human(r.bytes)} in {r.seconds:.2f} s ({r.mb_per_s:.1f} MB/s, "
             f"{r.files_per_s:.0f} files/s)",
             f"  page cache: {human(r.page_cache_already)} already there, {human(r.read_bytes)} read into it"]
    memory = (f"  memory tier: {human(r.memory_held)} held ({human(r.memory_loaded)} loaded by warm requests, "
              f"the rest by the reads; budget {human(r.memory_budget)})")
    if r.memory_not_served:
        memory += f"; {human(r.memory_not_served)} in files it does not serve (page cache only)"
    lines.append(memory)
    if r.memory_over_budget or r.memory_refused:
        lines.append(f"  memory tier full: {human(r.memory_over_budget + r.memory_refused)} did not fit its "
                     f"budget (cache_bytes {human(r.memory_budget)}; values over a quarter of it are never "
                     f"kept) and are in the page cache only")
    return lines


__all__ = ["warmup", "WarmupReport", "collect", "resident_bytes", "summary"]

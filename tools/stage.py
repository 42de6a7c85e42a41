"""`distorefs stage SRC MNT/datasets/NAME` and `distorefs seal`: copy a tree into a dataset.

The source is listed here (a directory tree walked in parallel, or a text file of paths,
or a CSV/TSV file with a `path` column whose other columns become per-item metadata in
index.npy). The copying itself is done by the daemon, which reads the source files with
its own threads: this process writes batches of JSON lines (source, relative path, size,
mtime) to the dataset's `.stage` control file and reads back one result per file once
the batch is committed and verified. Several batches are in flight at once (`jobs`).
A rerun skips what is staged already and intact, so an interrupted stage resumes.
"""

from __future__ import annotations

import csv
import json
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

SEAL_XATTR = "user.distorefs.sealed"
STATE_XATTR = "user.distorefs.state"


@dataclass
class Source:
    src: str
    path: str
    size: int
    mtime_ns: int
    meta: dict | None = None

    def line(self) -> bytes:
        r = {"src": self.src, "path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}
        if self.meta:
            r["meta"] = self.meta
        return (json.dumps(r) + "\n").encode()


@dataclass
class StageReport:
    ok: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    bytes: int = 0
    files: int = 0
    sealed: bool = False


def walk(root: str, workers: int = 8) -> Iterator[Source]:
    """Every regular file under `root`, listing directories in parallel (metadata servers
    of Lustre/Ceph answer many requests at once far better than one after another)."""
    root = os.path.abspath(root)
    out: queue.Queue = queue.Queue()
    pending = [1]
    lock = threading.Lock()

    def scan(directory: str) -> None:
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            with lock:
                                pending[0] += 1
                            pool.submit(scan, entry.path)
                        elif entry.is_file():
                            st = entry.stat()
                            out.put(Source(entry.path, os.path.relpath(entry.path, root), st.st_size, st.st_mtime_ns))
                    except OSError as exc:
                        out.put(exc)
        except OSError as exc:
            out.put(exc)
        finally:
            with lock:
                pending[0] -= 1
                if pending[0] == 0:
                    out.put(None)

    with ThreadPoolExecutor(workers) as pool:
        pool.submit(scan, root)
        while True:
            item = out.get()
            if item is None:
                break
            if isinstance(item, OSError):
                raise item
            yield item


def read_list(list_file: str) -> list[Source]:
    """Sources named by a text file (one path per line) or a CSV/TSV with a `path` column."""
    base = os.path.dirname(os.path.abspath(list_file))
    with open(list_file, newline="") as f:
        text = f.read()
    first = text.split("\n", 1)[0]
    rows: list[tuple[str, dict | None]] = []
    delimiter = "\t" if "\t" in first else ","
    if "path" in [c.strip() for c in first.split(delimiter)]:
        for row in csv.DictReader(text.splitlines(), delimiter=delimiter):
            path = row.pop("path")
            rows.append((path, {k: _number(v) for k, v in row.items() if k}))
    else:
        rows = [(line.strip(), None) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    paths = [os.path.normpath(os.path.join(base, p)) for p, _ in rows]
    common = os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else base
    sources = []
    for path, (_, meta) in zip(paths, rows):
        st = os.stat(path)
        sources.append(Source(path, os.path.relpath(path, common), st.st_size, st.st_mtime_ns, meta))
    return sources


def _number(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def batches(sources, max_files: int = 256, max_bytes: int = 64 << 20) -> Iterator[list[Source]]:
    batch: list[Source] = []
    size = 0
    for s in sources:
        batch.append(s)
        size += s.size
        if len(batch) >= max_files or size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def stage(src: str, dest: str, *, jobs: int = 8, seal: bool = True, progress: bool = True) -> StageReport:
    """Stage `src` into the dataset directory `dest` (MNT/datasets/NAME), then seal it."""
    dest_path = Path(dest)
    if not dest_path.exists():
        os.mkdir(dest_path)
    if is_sealed(dest):
        raise RuntimeError(f"{dest} is sealed already")
    sources = read_list(src) if os.path.isfile(src) else list(walk(src))
    report = StageReport(files=len(sources), bytes=sum(s.size for s in sources))
    control = str(dest_path / ".stage")
    lock = threading.Lock()
    bar = tqdm(total=report.bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               desc=f"staging {dest_path.name}", dynamic_ncols=True)

    def send(batch: list[Source]) -> None:
        fd = os.open(control, os.O_RDWR)
        try:
            os.write(fd, b"".join(s.line() for s in batch))
            results = b""
            while True:
                chunk = os.pread(fd, 1 << 20, len(results))
                if not chunk:
                    break
                results += chunk
        finally:
            os.close(fd)
        with lock:
            for line in results.decode("utf-8", "surrogateescape").splitlines():
                status, path, size, message = (line.split("\t", 3) + ["", "", ""])[:4]
                if status == "ok":
                    report.ok += 1
                elif status == "skip":
                    report.skipped += 1
                else:
                    report.errors.append(f"{path}: {message}")
            bar.update(sum(s.size for s in batch))
            bar.set_postfix(files=f"{report.ok + report.skipped + len(report.errors)}/{report.files}",
                            skipped=report.skipped, errors=len(report.errors), refresh=False)

    try:
        with ThreadPoolExecutor(jobs) as pool:
            for future in [pool.submit(send, b) for b in batches(sources)]:
                future.result()
    finally:
        bar.close()
    if seal and not report.errors:
        seal_dataset(dest)
        report.sealed = True
    return report


def seal_dataset(dest: str) -> None:
    os.setxattr(dest, SEAL_XATTR, b"1")


def is_sealed(dest: str) -> bool:
    try:
        return os.getxattr(dest, STATE_XATTR) == b"sealed"
    except OSError:
        return False

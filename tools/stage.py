"""`distorefs stage SRC MNT/datasets/NAME` and `distorefs seal`: copy a tree into a dataset.

The source is listed here (a directory tree walked in parallel, or a text file of paths,
or a CSV/TSV file with a `path` column whose other columns become per-item metadata in
index.npy). The copying itself is done by the daemon: this process writes batches of
requests (source, relative path, size, mtime) to the dataset's `.stage` control file and
reads back one result per file once the batch is committed and verified. Several batches
are in flight at once (`jobs`). Small files (up to INLINE_MAX) this process reads itself
and sends with their request: the daemon takes one batch at a time, and the jobs waiting
their turn do the opening and the reading from disk meanwhile. Bigger files the daemon
reads, with its own threads (distorefs/stagewire.py).
A rerun skips what is staged already and intact, so an interrupted stage resumes; a rerun
against a sealed dataset compares instead ("already staged, identical", or what differs).

What is read, and as whom (distorefs/sources.py, the same rules for what the daemon
reads and for what this process reads and sends): sources are opened with the rights of
the user running this command; a symlink is followed only if it stays inside the source
tree (`follow_symlinks` follows every link); only regular files are staged. A list file
may name only files below its own directory unless `allow_outside` is given.
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
from typing import Iterable, Iterator

from tqdm import tqdm

from distorefs import codec
from distorefs.sources import OpenSource, SourceRefused, SourceRoots, read_ahead, read_bounded
from distorefs.stagewire import INLINE_MAX, encode

SEAL_XATTR = "user.distorefs.sealed"
STATE_XATTR = "user.distorefs.state"


class StageError(RuntimeError):
    """The stage cannot start (a wrong destination, a list naming files it may not)."""


@dataclass
class Source:
    src: str
    path: str
    size: int
    mtime_ns: int
    meta: dict | None = None
    root: str | None = None  # the tree or list directory the daemon keeps the source beneath
    follow: bool = False

    def request(self) -> dict:
        r = {"src": self.src, "path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}
        if self.meta:
            r["meta"] = self.meta
        if self.root is not None:
            r["root"] = self.root
        if self.follow:
            r["follow"] = True
        return r

    def line(self) -> bytes:
        """The request naming this file: the daemon opens and reads it."""
        return encode(self.request())


@dataclass
class StageReport:
    ok: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    bytes: int = 0
    files: int = 0
    sealed: bool = False
    identical: bool = False  # a sealed dataset the source matches: nothing to do
    differs: list[str] = field(default_factory=list)  # a sealed dataset: sources it does not match


LISTED_AT_ONCE = 256


def walk(root: str, workers: int = 8, refused: list[str] | None = None) -> Iterator[Source]:
    """Every regular file under `root` (and every symlink that does not name a directory:
    the daemon follows it only if it stays inside the tree), listing directories in
    parallel (metadata servers of Lustre/Ceph answer many requests at once far better than
    one after another). FIFOs, devices and sockets go to `refused`; links to directories
    are not descended."""
    root = os.path.realpath(root)
    out: queue.Queue = queue.Queue()
    pending = [1]
    lock = threading.Lock()

    def scan(directory: str) -> None:
        # Files go to the consumer LISTED_AT_ONCE at a time: a queue operation per file
        # hands the GIL back and forth with the jobs reading files, and the listing falls behind.
        found: list[Source] = []
        rel_dir = "" if directory == root else os.path.relpath(directory, root)  # once a directory, not a file
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            with lock:
                                pending[0] += 1
                            pool.submit(scan, entry.path)
                        elif entry.is_file(follow_symlinks=False) or (entry.is_symlink() and not entry.is_dir()):
                            st = entry.stat(follow_symlinks=False)
                            found.append(Source(entry.path, f"{rel_dir}/{entry.name}" if rel_dir else entry.name,
                                                st.st_size, st.st_mtime_ns, root=root))
                            if len(found) == LISTED_AT_ONCE:
                                out.put(found)
                                found = []
                        elif not entry.is_symlink() and refused is not None:
                            with lock:
                                refused.append(f"{entry.path}: not a regular file: refused")
                    except OSError as exc:
                        out.put(exc)
        except OSError as exc:
            out.put(exc)
        finally:
            if found:
                out.put(found)
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
            yield from item


def read_list(list_file: str, allow_outside: bool = False) -> list[Source]:
    """Sources named by a text file (one path per line) or a CSV/TSV with a `path` column.
    Paths are relative to the list's directory and must stay below it (StageError naming
    those that do not) unless `allow_outside`."""
    base = os.path.realpath(os.path.dirname(os.path.abspath(list_file)))
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
    if not allow_outside:
        outside = [p for (p, _), path in zip(rows, paths) if os.path.commonpath([base, path]) != base]
        if outside:
            raise StageError(f"{list_file} names {len(outside)} file(s) outside its directory {base} (e.g. "
                             f"{', '.join(outside[:3])}); pass --allow-outside to stage them")
    common = os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else base
    sources = []
    for path, (_, meta) in zip(paths, rows):
        st = os.stat(path, follow_symlinks=False)
        sources.append(Source(path, os.path.relpath(path, common), st.st_size, st.st_mtime_ns, meta,
                              root=None if allow_outside else base))
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


@dataclass(frozen=True)
class Encoding:
    """How the dataset stores a file (its config.json): the stager encodes what it sends the
    same way, so the daemon only checks it (a decode and a CRC cost less than the encode)."""

    compression: str
    level: int
    chunk_bytes: int

    @classmethod
    def of(cls, dest: Path) -> "Encoding | None":
        """The dataset's, or None (unreadable: the daemon encodes what is sent)."""
        try:
            config = json.loads((dest / "config.json").read_bytes())
            return cls(str(config["compression"]), int(config["compression_level"]), int(config["chunk_bytes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def batch_bytes(batch: list[Source], send_small: bool = True, encoding: Encoding | None = None) -> bytes:
    """What a batch writes to `.stage`: each file's request, with the bytes of each file up
    to INLINE_MAX read here (`send_small`), encoded as `encoding` says when given. The disk
    is asked for those files all at once before the first is read. A file not read here
    (bigger, refused, changed while read) goes by its path alone: the daemon reads it, or
    says why it does not."""
    if not send_small:
        return b"".join(s.line() for s in batch)
    roots = SourceRoots()
    opened: list[OpenSource | None] = []
    try:
        for s in batch:
            opened.append(_open_small(s, roots) if s.size <= INLINE_MAX else None)
        for o in opened:
            if o is not None:
                read_ahead(o)
        return b"".join(s.line() if o is None else _with_bytes(s, o, roots, encoding) for s, o in zip(batch, opened))
    finally:
        for o in opened:
            if o is not None:
                o.close()
        roots.close()


def _open_small(s: Source, roots: SourceRoots) -> OpenSource | None:
    """`s` opened as the daemon would open it (None if refused, or not small after all)."""
    try:
        o = roots.open(s.src, s.root, s.follow)
    except (SourceRefused, OSError):
        return None
    if o.size > INLINE_MAX:
        o.close()
        return None
    return o


def _with_bytes(s: Source, o: OpenSource, roots: SourceRoots, encoding: Encoding | None) -> bytes:
    try:
        data = b"".join(read_bounded(o, s.src))
        dirs = roots.tree_dirs(s.src, s.root, s.follow, s.path)  # a tree: its directories' modes go too
    except (SourceRefused, OSError):
        return s.line()
    request = {**s.request(), "size": o.size, "mtime_ns": o.mtime_ns, "mode": o.mode, "uid": o.uid, "gid": o.gid,
               "crc": codec.checksum(data), "dirs": dirs}
    if encoding is None or len(data) > encoding.chunk_bytes:  # (one chunk only: the daemon splits bigger ones)
        return encode(request, data)
    enc = codec.encode(data, encoding.compression, encoding.level, crc=request["crc"])
    return encode({**request, "codec": enc.codec}, bytes(enc.stored))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def check_destination(dest: str) -> Path:
    """`dest` must be MNT/datasets/NAME of a distorefs mount (StageError saying what it is
    instead): anything else would get a stray `.stage` file."""
    path = Path(os.path.abspath(dest))
    datasets, mount = path.parent, path.parent.parent
    if datasets.name != "datasets" or not (mount / ".distorefs" / "version").is_file():
        raise StageError(f"{dest} is not a dataset of a distorefs mount: the destination must be "
                         f"MNT/datasets/NAME (MNT a distorefs mount point)")
    if path.exists() and not path.is_dir():
        raise StageError(f"{dest} exists and is not a dataset directory")
    return path


def stage(src: str, dest: str, *, jobs: int = 8, seal: bool = True, progress: bool = True,
          follow_symlinks: bool = False, allow_outside: bool = False) -> StageReport:
    """Stage `src` into the dataset directory `dest` (MNT/datasets/NAME), then seal it. A
    sealed `dest` is compared with `src` instead (report.identical, report.differs)."""
    dest_path = check_destination(dest)
    refused: list[str] = []
    # a tree is staged while it is listed: its first batches are copied meanwhile
    listed = read_list(src, allow_outside) if os.path.isfile(src) else walk(src, refused=refused)
    return stage_sources(_following(listed, follow_symlinks), dest_path, jobs=jobs, seal=seal,
                         progress=progress, refused=refused)


def _following(sources: Iterable[Source], follow: bool) -> Iterator[Source]:
    for s in sources:
        s.follow = follow
        yield s


def stage_sources(sources: Iterable[Source], dest_path: Path, *, jobs: int = 8, seal: bool = True,
                  progress: bool = True, refused: list[str] | None = None) -> StageReport:
    """Stage `sources` (a list, or a listing still under way) into the dataset directory
    `dest_path` (checked by `check_destination`), then seal it; see `stage`. `refused`: what
    the listing refused, read once it is over."""
    dest = str(dest_path)
    if not dest_path.exists():
        os.mkdir(dest_path)
    sealed = is_sealed(dest)
    encoding = Encoding.of(dest_path)
    report = StageReport()  # files and bytes counted as the sources come
    control = str(dest_path / ".stage")
    lock = threading.Lock()
    bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               desc=f"staging {dest_path.name}", dynamic_ncols=True)

    def counted() -> Iterator[Source]:
        for s in sources:
            with lock:
                report.files += 1
                report.bytes += s.size
                bar.total += s.size
            yield s

    def send(batch: list[Source]) -> None:
        data = batch_bytes(batch, send_small=not sealed, encoding=encoding)  # (a sealed dataset only compares)
        fd = os.open(control, os.O_RDWR)
        try:
            _write_all(fd, data)
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
                elif status in ("skip", "same"):
                    report.skipped += 1
                elif status == "differs":
                    report.differs.append(f"{path}: {message}")
                else:
                    report.errors.append(f"{path}: {message}")
            bar.update(sum(s.size for s in batch))
            bar.set_postfix(files=f"{report.ok + report.skipped + len(report.errors)}/{report.files}",
                            skipped=report.skipped, errors=len(report.errors), refresh=False)

    try:
        with ThreadPoolExecutor(jobs) as pool:
            for future in [pool.submit(send, b) for b in batches(counted())]:
                future.result()
    finally:
        bar.close()
    report.errors[:0] = refused or []
    if sealed:
        items = int(os.getxattr(dest, "user.distorefs.items") or 0)
        report.sealed = True
        report.identical = not report.errors and not report.differs and items == report.files
        if items != report.files and not report.differs:
            report.differs.append(f"the dataset holds {items} items, the source {report.files} files")
        return report
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

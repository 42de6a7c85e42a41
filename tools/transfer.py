"""`distorefs import SRC DEST`: load what `distorefs export` wrote back into a mount.

Everything goes through the mount with plain file calls, so it obeys the mount's rules and
permissions like any job: entries are created in the manifest's (FIFO) order, so they get
the same relative order; a buffer's priorities go in through its `priorities` file and
times sampled through the `user.distorefs.times_sampled` attribute (the buffer's owner
only); weights files are written under a temporary name and renamed into place (published
whole), then their symlinks made; a dataset is staged from SRC by the daemon
(`tools/stage.py`) and sealed if the exported one was; checkpoint steps are made in the
order they were created, each fsynced so it completes and `latest` follows.

Every file is checked against the manifest's checksums (the `checksum` attribute the
store gave it and the CRC-32 the export wrote) before it is published: a file that does
not match, or that a current manifest does not name, is refused with an error line and
the command exits 1. What is refused is never half there: an entry is inserted only once
its bytes verified, a weights or checkpoint file is renamed into place only once its copy
verified (else its temporary file is removed), a checkpoint step with a refused file is
removed whole, and a dataset with a refused file is left unsealed, the file removed, so a
rerun (once SRC is fixed) resumes it.

What is not restored, and why: sequence numbers and weights version numbers (a store gives
them: the order and the content are restored), a weights file's older versions (an
export holds the current one), owners (files belong to whoever imports, as with `cp`),
a dataset's declared `order` (per reading process) and the generated files (stats.json,
sample/, batch/).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from distorefs.names import escape_key

from .inspection import KIND_PLACES, MANIFEST, is_dataset_dir, is_namespace_dir, kind_of_parts, mount_root, tree_kind

_SKIP = {"stats.json"}  # rendered by the store, never written back
_RESERVED = {"latest"}  # a run's latest: the daemon's to set
TMP_SUFFIX = ".distorefs-import"
PRIORITY_LINES_PER_WRITE = 4096


class ImportError_(RuntimeError):
    """The import cannot start (no manifest, a destination that is not empty, kinds that
    do not match)."""


@dataclass
class ImportReport:
    files: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def find_manifest(src: Path) -> tuple[Path, Path]:
    """(the export's top, `src` relative to it): SRC is an export or a directory in one."""
    for top in (src, *src.parents):
        if (top / MANIFEST).is_file():
            return top, src.relative_to(top)
    raise ImportError_(f"neither {src} nor a directory above it holds {MANIFEST}: not something "
                       f"`distorefs export` wrote")


class Manifest:
    """The export's records by path, and the checksums each file must match."""

    def __init__(self, top: Path) -> None:
        path = top / MANIFEST
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ImportError_(f"{path} is not JSON: {exc}") from None
        self.format = int(data.get("format", 1))
        self.kind = data.get("kind")
        self.root = data.get("root", {})
        self.files: dict[str, dict] = {f["path"]: f for f in data.get("files", [])}
        self.order = [f["path"] for f in data.get("files", [])]
        self.dirs: dict[str, dict] = {d["path"]: d for d in data.get("dirs", [])}
        # Format 1 merged attributes into each record, and a dataset item's own `path`
        # attribute (its path below items/) replaced the record's: find those by it.
        self._items: dict[str, dict | None] = {}
        if self.format < 2:
            for f in data.get("files", []):
                if "item" in f:
                    self._items[f["path"]] = None if f["path"] in self._items else f

    def record(self, rel: str, item_path: str | None = None) -> dict | None:
        found = self.files.get(rel)
        if found is None and item_path is not None:
            found = self._items.get(item_path)
        return found

    def expected(self, record: dict | None) -> list[int]:
        """The CRC-32s a file must have: the store's checksum and the export's own."""
        out = []
        for key in ("checksum", "crc32"):
            value = (record or {}).get(key)
            if isinstance(value, str) and value.startswith("crc32:"):
                out.append(int(value[6:], 16))
        return out

    def check(self, rel: str, record: dict | None, crc: int) -> str | None:
        """None if the bytes whose CRC-32 is `crc` are what the manifest says, else why not."""
        if record is None:
            if self.format >= 2:
                return f"{rel}: not in the manifest (refused: nothing to check it against)"
            return None  # an older export did not list every file with a checksum
        for want in self.expected(record):
            if want != crc:
                return f"{rel}: checksum mismatch (the file has crc32:{crc:08x}, the manifest says " \
                       f"crc32:{want:08x}): refused"
        return None


def _read_verified(path: Path, rel: str, manifest: Manifest, record: dict | None) -> bytes:
    data = path.read_bytes()
    problem = manifest.check(rel, record, zlib.crc32(data))
    if problem:
        raise _Refused(problem)
    return data


class _Refused(Exception):
    """One file is not imported (the message says why); the import goes on."""


def _copy_verified(src: Path, dest: Path, rel: str, manifest: Manifest, record: dict | None, bar) -> int:
    """Copy src to `dest` under a temporary name, check its CRC-32, then rename it into
    place (published whole); a mismatch removes the temporary file and raises _Refused."""
    tmp = dest.with_name(f".{uuid.uuid4().hex}{TMP_SUFFIX}")  # short: any name stays within 255 bytes
    crc = size = 0
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
                fout.write(chunk)
                bar.update(len(chunk))
        problem = manifest.check(rel, record, crc)
        if problem:
            raise _Refused(problem)
        _restore_attrs(src, tmp)
        os.rename(tmp, dest)
    except BaseException:
        with _ignore_missing():
            os.unlink(tmp)
        raise
    return size


class _ignore_missing:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        return kind is not None and issubclass(kind, OSError) and exc.errno == errno.ENOENT


def _restore_attrs(src: Path, dest: Path, dir_record: dict | None = None) -> None:
    """Owner (when run as root), mode and mtime as exported: a file's as the export set them
    on its copy (an export run as root keeps owners, as cp -a does), a directory's from the
    manifest (the export's own directory has the exporter's)."""
    if dir_record is not None:
        mode, mtime_ns = dir_record["mode"], dir_record["mtime_ns"]
        owner = (dir_record["uid"], dir_record["gid"]) if "uid" in dir_record else None
    else:
        st = os.lstat(src)
        mode, mtime_ns, owner = st.st_mode & 0o7777, st.st_mtime_ns, (st.st_uid, st.st_gid)
    now = os.lstat(dest)
    if owner is not None and os.geteuid() == 0 and (now.st_uid, now.st_gid) != owner:
        os.lchown(dest, *owner)  # before chmod: a chown clears setuid/setgid bits
    if now.st_mode & 0o7777 != mode:
        os.chmod(dest, mode)
    if now.st_mtime_ns != mtime_ns:
        os.utime(dest, ns=(mtime_ns, mtime_ns))


# ----- what goes where -----------------------------------------------------------------------

_PARTS = ("buffers", "banks", "weights", "datasets", "checkpoints")


def import_tree(src: Path, dest: Path, *, progress: bool = True, jobs: int = 4) -> ImportReport:
    """Import the export at `src` into `dest`, a path under a distorefs mount of the same
    kind as what was exported (a buffer into buffers/NAME, a weights tree into weights/...,
    a dataset into datasets/NAME, a run into checkpoints/RUN, a whole mount into a mount)."""
    src, dest = Path(os.path.abspath(src)), Path(os.path.abspath(dest))
    top, rel = find_manifest(src)
    manifest = Manifest(top)
    if mount_root(dest) is None:
        raise ImportError_(f"{dest} is not under a distorefs mount")
    want = tree_kind(dest)
    if manifest.kind in KIND_PLACES:  # a directory of the export: its kind below the export's
        have = kind_of_parts(KIND_PLACES[manifest.kind] + rel.parts)
    else:
        have = _infer_kind(src)
    if want == "weights" and have != "weights" and manifest.kind is None and not _looks_special(src):
        have = "weights"  # an older export of a weights directory: plain files
    if want != have:
        raise ImportError_(f"{src} is an export of a {have} and {dest} is a {want}: import it where the same kind "
                           f"of thing goes (e.g. a buffer into MNT/buffers/NAME)")
    report = ImportReport()
    below = "" if rel == Path() else f"{rel}/"
    total = sum(int(f.get("size") or 0) for p, f in manifest.files.items() if p.startswith(below))
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress, desc="import",
              dynamic_ncols=True) as bar:
        _Importer(manifest, report, bar, jobs).run(want, src, dest, rel)
    return report


def _infer_kind(src: Path) -> str:
    """What an older export (no `kind` in its manifest) holds, from its layout."""
    if is_namespace_dir(src):
        return "bank" if json.loads((src / "config.json").read_text()).get("sampler") is None else "buffer"
    if is_dataset_dir(src):
        return "dataset"
    if all((src / p).is_dir() for p in ("buffers", "weights", "checkpoints")):
        return "mount"
    return "weights"


def _looks_special(src: Path) -> bool:
    return is_namespace_dir(src) or is_dataset_dir(src)


class _Importer:
    def __init__(self, manifest: Manifest, report: ImportReport, bar, jobs: int) -> None:
        self.m = manifest
        self.report = report
        self.bar = bar
        self.jobs = jobs

    def run(self, kind: str, src: Path, dest: Path, rel: Path) -> None:
        if kind == "mount":
            for part in _PARTS:
                if (src / part).is_dir():
                    self.run(part, src / part, dest / part, rel / part)
        elif kind in ("buffers", "banks", "datasets"):
            for child in sorted(p for p in src.iterdir() if p.is_dir()):
                self.run(kind[:-1], child, dest / child.name, rel / child.name)
        elif kind in ("buffer", "bank"):
            self.ring(src, dest, rel, kind == "buffer")
        elif kind == "weights":
            self.weights(src, dest, rel)
        elif kind == "dataset":
            self.dataset(src, dest, rel)
        elif kind == "checkpoints":
            if (src / "config.json").is_file():
                self.config(src / "config.json", dest / "config.json", rel / "config.json", optional=True)
            for child in sorted(p for p in src.iterdir() if p.is_dir()):
                self.run("run", child, dest / child.name, rel / child.name)
        elif kind == "run":
            self.checkpoint_run(src, dest, rel)
        else:
            raise ImportError_(f"cannot import into a {kind}")

    def error(self, line: str) -> None:
        self.report.errors.append(line)

    def config(self, src: Path, dest: Path, rel: Path, optional: bool = False) -> None:
        """A config.json written back whole (a store refuses an invalid one with EINVAL)."""
        try:
            data = _read_verified(src, str(rel), self.m, self.m.record(str(rel)))
            with open(dest, "wb") as f:
                f.write(data)
        except _Refused as exc:
            self.error(str(exc))
        except OSError as exc:
            text = f"{rel}: not restored ({exc.strerror})"
            if optional:
                self.report.notes.append(text + "; the destination keeps its own")
            else:
                self.error(text)

    # ----- buffers and banks ---------------------------------------------------------------

    def ring(self, src: Path, dest: Path, rel: Path, is_buffer: bool) -> None:
        if dest.exists():
            if os.listdir(dest / "entries"):
                raise ImportError_(f"{dest} already holds entries: import into a new {'buffer' if is_buffer else 'bank'}")
        else:
            os.mkdir(dest)
        self.config(src / "config.json", dest / "config.json", rel / "config.json")
        if self.report.errors:
            return  # a buffer whose configuration was refused would take entries by another one
        keys = [p for p in self.m.order if p.startswith(f"{rel}/entries/" if str(rel) != "." else "entries/")]
        present = {p.name for p in (src / "entries").iterdir()}
        listed = {Path(p).name for p in keys}
        keys += [str(rel / "entries" / n) for n in sorted(present - listed)]  # refused below (v2)
        priorities, sampled = [], []
        for rel_path in keys:
            name = Path(rel_path).name
            s = src / "entries" / name
            if name not in present:
                self.error(f"{rel_path}: in the manifest but not in {src / 'entries'}: not imported")
                continue
            record = self.m.record(rel_path)
            try:
                data = _read_verified(s, rel_path, self.m, record)
                d = dest / "entries" / name
                with open(d, "wb") as f:
                    f.write(data)
                _restore_attrs(s, d)
            except _Refused as exc:
                self.error(str(exc))
                continue
            except OSError as exc:
                self.error(f"{rel_path}: {exc.strerror or exc}")
                continue
            self.bar.update(len(data))
            self.report.files += 1
            self.report.bytes += len(data)
            if is_buffer and record is not None:
                if record.get("priority") is not None:
                    priorities.append((name, record["priority"]))
                if int(record.get("times_sampled") or 0):
                    sampled.append((name, int(record["times_sampled"])))
        if priorities:
            self.priorities(dest, rel, priorities)
        for name, times in sampled:
            try:
                os.setxattr(dest / "entries" / name, "user.distorefs.times_sampled", b"%d" % times)
            except OSError as exc:
                self.error(f"{rel}/entries/{name}: times_sampled {times} not restored ({exc.strerror})")

    def priorities(self, dest: Path, rel: Path, pairs: list[tuple[str, str]]) -> None:
        """Through `priorities`, many lines a write (each write is applied whole or not at all)."""
        try:
            with open(dest / "priorities", "wb", buffering=0) as f:
                for i in range(0, len(pairs), PRIORITY_LINES_PER_WRITE):
                    f.write(b"".join(b"%s %s\n" % (escape_key(k.encode("utf-8", "surrogateescape")),
                                                  str(v).encode()) for k, v in pairs[i:i + PRIORITY_LINES_PER_WRITE]))
        except OSError as exc:
            self.error(f"{rel}/priorities: not restored ({exc.strerror})")

    # ----- general file trees (weights/, checkpoint steps) ---------------------------------

    def weights(self, src: Path, dest: Path, rel: Path) -> None:
        root = mount_root(dest)
        assert root is not None  # (import_tree refused a dest that is not under a mount)
        is_root = root / "weights" == dest
        if dest.exists():
            if set(os.listdir(dest)) - ({"config.json", "stats.json"} if is_root else set()):
                raise ImportError_(f"{dest} is not empty: import into a new directory under weights/")
        else:
            os.mkdir(dest)
        if is_root and (src / "config.json").is_file():
            self.config(src / "config.json", dest / "config.json", rel / "config.json", optional=True)
        self.tree(src, dest, rel, skip_top={"config.json", "stats.json"} if is_root else set())

    def tree(self, src: Path, dest: Path, rel: Path, skip_top: set[str] | frozenset[str] = frozenset()) -> bool:
        """Copy a plain tree into a general file tree: directories, then files (in parallel,
        each verified and renamed into place), then symlinks, then directory modes and times
        (deepest first: creating children changed them). True if nothing was refused."""
        dirs: list[Path] = []
        files: list[Path] = []
        links: list[Path] = []
        for here, subdirs, names in os.walk(src):
            h = Path(here)
            for n in names + subdirs:
                if h == src and n in skip_top:
                    continue
                p = h / n
                (links if p.is_symlink() else dirs if p.is_dir() else files).append(p)
            subdirs[:] = [d for d in subdirs if not (h / d).is_symlink() and not (h == src and d in skip_top)]
        dirs.sort(key=lambda p: len(p.parts))
        for d in dirs:
            os.makedirs(dest / d.relative_to(src), exist_ok=True)
        ok = True

        def one(p: Path) -> None:
            nonlocal ok
            r = str(rel / p.relative_to(src))
            try:
                size = _copy_verified(p, dest / p.relative_to(src), r, self.m, self.m.record(r), self.bar)
                self.report.files += 1
                self.report.bytes += size
            except _Refused as exc:
                self.error(str(exc))
                ok = False
            except OSError as exc:
                self.error(f"{r}: {exc.strerror or exc}")
                ok = False

        with ThreadPoolExecutor(self.jobs) as pool:
            list(pool.map(one, files))
        for p in links:
            try:
                os.symlink(os.readlink(p), dest / p.relative_to(src))
            except OSError as exc:
                self.error(f"{rel / p.relative_to(src)}: symlink not made ({exc.strerror})")
                ok = False
        self.dir_attrs([src] + dirs, src, dest, rel)
        return ok

    def dir_attrs(self, dirs: list[Path], src: Path, dest: Path, rel: Path) -> None:
        """Directories' modes and mtimes from the manifest, deepest first (creating their
        children changed them); an older manifest has none: they stay as made."""
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            record = self.m.dirs.get(str(rel / d.relative_to(src)))
            if record is None or "mode" not in record:
                continue
            try:
                _restore_attrs(d, dest / d.relative_to(src), record)
            except OSError as exc:
                if d != src:  # the destination's own top (weights/, a run) may keep its own
                    self.error(f"{rel / d.relative_to(src)}: mode and time not restored ({exc.strerror})")

    # ----- datasets ------------------------------------------------------------------------

    def dataset(self, src: Path, dest: Path, rel: Path) -> None:
        from .stage import Source, check_destination, is_sealed, seal_dataset, stage_sources
        check_destination(str(dest))
        if is_sealed(str(dest)):
            raise ImportError_(f"{dest} is a sealed dataset: import into a new one")
        fresh = not dest.exists()
        if fresh:
            os.mkdir(dest)
            self.config(src / "config.json", dest / "config.json", rel / "config.json")
        items = src / "items"
        meta = _index_meta(src / "index.npy")
        sources, links, dirs = [], [], []
        for here, subdirs, names in os.walk(items):
            h = Path(here)
            links += [h / d for d in subdirs if (h / d).is_symlink()]
            dirs += [h / d for d in subdirs if not (h / d).is_symlink()]
            for n in names:
                p = h / n
                if p.is_symlink():
                    links.append(p)
                    continue
                st = p.stat()
                item_path = str(p.relative_to(items))
                sources.append(Source(str(p), item_path, st.st_size, st.st_mtime_ns, meta.get(item_path),
                                      root=str(items)))
        for d in dirs:
            os.makedirs(dest / "items" / d.relative_to(items), exist_ok=True)
        for p in links:
            target = dest / "items" / p.relative_to(items)
            if not os.path.lexists(target):
                os.symlink(os.readlink(p), target)
        staged = stage_sources(sources, dest, jobs=self.jobs, seal=False, progress=False)
        self.bar.update(staged.bytes)
        refused = set()
        for line in staged.errors:
            self.error(f"{rel}/items/{line}")
            refused.add(line.split(": ", 1)[0])
        # The daemon computed each item's CRC-32 from the bytes it read from SRC: they must
        # be what the export wrote, else the item goes (the dataset stays unsealed).
        for s in sources:
            r = str(rel / "items" / s.path)
            if s.path in refused:
                continue
            try:
                got = os.getxattr(dest / "items" / s.path, "user.distorefs.checksum").decode()
                problem = self.m.check(r, self.m.record(r, s.path), int(got.removeprefix("crc32:"), 16))
            except OSError as exc:
                problem = f"{r}: not staged ({exc.strerror})"
            if problem:
                self.error(problem)
                with _ignore_missing():
                    os.unlink(dest / "items" / s.path)
                continue
            _restore_attrs(Path(s.src), dest / "items" / s.path)  # a staged item has the time it was staged
            self.report.files += 1
            self.report.bytes += s.size
        self.dir_attrs([items] + dirs, items, dest / "items", rel / "items")
        was_sealed = (self.m.root.get("state") == "sealed" if str(rel) == "." else
                      self.m.dirs.get(str(rel), {}).get("state") == "sealed") or (src / "index.npy").is_file()
        if not was_sealed:
            return
        if any(e.startswith(f"{rel}/") or str(rel) == "." for e in self.report.errors):
            self.report.notes.append(f"{dest}: left unsealed (files were refused); fix {src} and import again: "
                                     f"what is staged already is kept")
            return
        seal_dataset(str(dest))

    # ----- checkpoints ---------------------------------------------------------------------

    def checkpoint_run(self, src: Path, dest: Path, rel: Path) -> None:
        if dest.exists():
            if [n for n in os.listdir(dest) if n not in _RESERVED]:
                raise ImportError_(f"{dest} already holds steps: import into a new run")
        else:
            os.mkdir(dest)

        def created(step: Path) -> tuple:
            seq = self.m.dirs.get(str(rel / step.name), {}).get("seq")
            return (0, int(seq), step.name) if seq is not None else (1, 0, step.name)

        steps = sorted((p for p in src.iterdir() if p.is_dir() and not p.is_symlink()), key=created)
        for step in steps:
            info = self.m.dirs.get(str(rel / step.name), {})
            if info.get("state") == "incomplete":
                self.report.notes.append(f"{rel / step.name}: not imported (it was cut short in the exported store)")
                continue
            d = dest / step.name
            os.mkdir(d)
            if not self.tree(step, d, rel / step.name):
                self.error(f"{rel / step.name}: step not imported (a file was refused); removed")
                shutil.rmtree(d, ignore_errors=True)
                continue
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)  # closes the step and returns once it is durable: latest follows
            finally:
                os.close(fd)
            if info.get("pinned") == "1":
                os.setxattr(d, "user.distorefs.pinned", b"1")
        self.dir_attrs([src], src, dest, rel)
        was, now = _link(src / "latest"), _link(dest / "latest")
        if was != now:
            self.report.notes.append(f"{rel}/latest names {now} here, {was} in the export")


def _link(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _index_meta(index: Path) -> dict[str, dict]:
    """Per-item metadata columns of an exported index.npy, by item path (staged back with
    the items, so the new index has the same columns)."""
    if not index.is_file():
        return {}
    import numpy as np
    table = np.load(index, allow_pickle=False)
    extra = [n for n in table.dtype.names or () if n not in ("item", "path", "size", "checksum")]
    if not extra:
        return {}
    out = {}
    for row in table:
        meta = {}
        for name in extra:
            value = row[name].item()
            meta[name] = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
        out[row["path"].decode("utf-8", "surrogateescape")] = meta
    return out


__all__ = ["import_tree", "ImportReport", "ImportError_", "Manifest"]

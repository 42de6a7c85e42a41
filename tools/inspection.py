"""Looking inside a store: `distorefs verify`, `ls`, `inspect`, `export`, `gc` and `stats`.

Everything but `verify` (and `gc` of a store that is not mounted) works through the mount
with ordinary calls: `stat`, `getxattr` of `user.distorefs.*`, reads. So these commands
see exactly what a job sees, need no access to the store directory, and are subject to
the same permissions. `verify` opens the store directory itself and refuses one in use.
"""

from __future__ import annotations

import errno
import json
import os
import stat as stat_mod
import sys
import time
import zipfile
import zlib
from pathlib import Path

import click

from .mounts import find_mount, mounts

XATTR = "user.distorefs."


# ----- small helpers -------------------------------------------------------------------------

def human(n: float | int | None, unit: str = "B") -> str:
    if n is None:
        return "-"
    n = float(n)
    for prefix in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):
        if abs(n) < 1024 or prefix == "Pi":
            return f"{n:.0f} {unit}" if not prefix else f"{n:.1f} {prefix}{unit}"
        n /= 1024
    return f"{n} {unit}"


def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[str(c) for c in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = right if right is not None else {i for i in range(1, len(headers))}
    lines = []
    for n, row in enumerate(cells):
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def xattrs(path: Path) -> dict[str, str]:
    """The `user.distorefs.*` attributes of `path` (empty if it has none)."""
    out: dict[str, str] = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for name in names:
        if name.startswith(XATTR):
            try:
                out[name[len(XATTR):]] = os.getxattr(path, name, follow_symlinks=False).decode(errors="replace")
            except OSError:
                pass
    return out


def _num(value: str | None, kind=int):
    try:
        return kind(value) if value is not None else None
    except ValueError:
        return None


def is_namespace_dir(path: Path) -> bool:
    return (path / "entries").is_dir() and (path / "config.json").is_file()


# ----- ls ------------------------------------------------------------------------------------

def ls_rows(path: Path, limit: int | None = None) -> list[dict]:
    """One dict per file or directory listed (stat + xattrs), in the directory's own order."""
    target = path / "entries" if is_namespace_dir(path) else path
    if target.is_dir() and not target.is_symlink():
        names = []
        with os.scandir(target) as it:
            for e in it:
                names.append(e.name)
                if limit is not None and len(names) >= limit:
                    break
        paths = [target / n for n in names]
    else:
        paths = [target]
    rows = []
    for p in paths:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue  # evicted between the listing and the stat
        a = xattrs(p) if stat_mod.S_ISREG(st.st_mode) else {}
        size, stored = st.st_size, _num(a.get("stored_size"))
        kind = "dir" if stat_mod.S_ISDIR(st.st_mode) else "link" if stat_mod.S_ISLNK(st.st_mode) else "file"
        rows.append({
            "name": p.name + ("/" if kind == "dir" else ""),
            "kind": kind,
            "size": size,
            "stored_size": stored,
            "ratio": round(size / stored, 2) if stored else None,
            "tier": a.get("tier"),
            "compression": a.get("compression"),
            "priority": _num(a.get("priority"), float),
            "times_sampled": _num(a.get("times_sampled")),
            "seq": _num(a.get("seq")),
            "version": _num(a.get("version")),
            "checksum": a.get("checksum"),
            "mtime": st.st_mtime,
            "target": os.readlink(p) if kind == "link" else None,
        })
    return rows


def ls_text(rows: list[dict]) -> str:
    out = []
    for r in rows:
        name = r["name"] + (f" -> {r['target']}" if r["target"] else "")
        version = r["version"] if r["version"] is not None else r["seq"]
        out.append([name, human(r["size"]) if r["kind"] == "file" else "-", human(r["stored_size"]),
                    f"{r['ratio']:.2f}" if r["ratio"] else None, r["tier"],
                    f"{r['priority']:.4g}" if r["priority"] is not None else None, r["times_sampled"], version])
    return table(["NAME", "SIZE", "STORED", "RATIO", "TIER", "PRIORITY", "SAMPLED", "SEQ/VER"], out)


@click.command("ls")
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--limit", "-n", type=int, default=None, help="At most N entries (in FIFO order for buffers).")
def ls_cmd(path, as_json, limit) -> None:
    """List PATH's entries (a buffer, bank, entries/, weights directory or one file) with tier,
    stored size, compression ratio, priority, times sampled and sequence or version."""
    rows = ls_rows(Path(path), limit)
    if as_json:
        for r in rows:
            click.echo(json.dumps(r))
    else:
        click.echo(ls_text(rows))


# ----- inspect -------------------------------------------------------------------------------

NPY_MAGIC = b"\x93NUMPY"


def _npy_header(f) -> dict:
    import numpy as np
    version = np.lib.format.read_magic(f)
    reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if reader is None:
        # 3.0; (private, and not in numpy's stubs)
        shape, fortran, dtype = np.lib.format._read_array_header(f, version)  # type: ignore[attr-defined]
    else:
        shape, fortran, dtype = reader(f)
    return {"dtype": str(dtype), "shape": list(shape), "fortran_order": bool(fortran)}


def describe_content(path: Path) -> dict:
    """What a file holds: .npy arrays and .npz members by dtype and shape, safetensors and
    torch.save tensors by name, dtype and shape (read without running the file: see
    tensorfiles), else raw bytes. A tensor file that cannot be read safely gives
    {"format": ..., "error": why}."""
    from .tensorfiles import CannotRead, looks_like_safetensors, read_safetensors, read_torch, torch_pickle_name

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(9)
        f.seek(0)
        if head.startswith(NPY_MAGIC):
            return {"format": "npy", "array": _npy_header(f)}
        if looks_like_safetensors(head, size):
            try:
                return read_safetensors(f, size)
            except CannotRead as exc:
                return {"format": "safetensors", "error": str(exc)}
        if head.startswith(b"PK\x03\x04"):
            try:
                with zipfile.ZipFile(f) as z:  # reads the directory and member headers only
                    member = torch_pickle_name(z)
                    if member is not None:
                        try:
                            return read_torch(z, member)
                        except CannotRead as exc:
                            return {"format": "torch", "error": f"cannot read: {exc}"}
                    arrays, other = {}, []
                    for info in z.infolist():
                        if info.filename.endswith(".npy"):
                            with z.open(info) as member_file:
                                if member_file.read(6) == NPY_MAGIC:
                                    with z.open(info) as again:
                                        arrays[info.filename[:-4]] = _npy_header(again)
                                    continue
                        other.append(info.filename)
                return {"format": "npz" if arrays else "zip", "arrays": arrays, "other_members": other}
            except zipfile.BadZipFile:
                pass
        preview = f.read(64)
    text = preview.decode("utf-8", errors="replace")
    printable = all(c.isprintable() or c in "\n\t\r" for c in text)
    return {"format": "bytes", "preview": text if printable else preview.hex()}


def inspect_info(path: Path) -> dict:
    st = os.lstat(path)
    info = {"path": str(path), "mode": stat_mod.filemode(st.st_mode), "size": st.st_size,
            "uid": st.st_uid, "gid": st.st_gid, "mtime": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                       time.localtime(st.st_mtime)),
            "inode": st.st_ino, "xattrs": xattrs(path)}
    if stat_mod.S_ISREG(st.st_mode):
        try:
            info["content"] = describe_content(path)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno, exc.errno) if exc.errno is not None else None
            info["content"] = {"error": f"{code}: {exc.strerror}"}
    elif stat_mod.S_ISDIR(st.st_mode):
        for name in ("config.json", "stats.json"):
            try:
                info[name[:-5]] = json.loads((path / name).read_bytes())
            except (OSError, ValueError):
                pass
    elif stat_mod.S_ISLNK(st.st_mode):
        info["target"] = os.readlink(path)
    return info


def inspect_text(info: dict) -> str:
    lines = [f"{info['path']}", f"  {info['mode']}  {info['uid']}:{info['gid']}  {human(info['size'])} "
             f"({info['size']} bytes)  mtime {info['mtime']}  inode {info['inode']}"]
    if info.get("target"):
        lines.append(f"  -> {info['target']}")
    a = info["xattrs"]
    if a:
        size, stored = info["size"], _num(a.get("stored_size"))
        if stored:
            a = {**a, "ratio": f"{size / stored:.2f}" if stored else "-"}
        width = max(len(k) for k in a)
        lines.append("  attributes:")
        lines += [f"    {k.ljust(width)}  {v}" for k, v in a.items()]
    content = info.get("content")
    if content:
        if "error" in content and "format" in content:
            lines.append(f"  content: {content['format']} file, {content['error']}")
        elif "error" in content:
            lines.append(f"  content: unreadable ({content['error']})")
        elif content["format"] in ("safetensors", "torch"):
            from .tensorfiles import tensor_rows
            what = "safetensors file" if content["format"] == "safetensors" else "torch.save archive"
            lines.append(f"  content: {what} with {len(content['tensors'])} tensors")
            rows = tensor_rows(content["tensors"])
            if rows:
                lines += ["    " + line for line in table(["TENSOR", "DTYPE", "SHAPE"], rows, right=set()).splitlines()]
            extra = list((content.get("metadata") or content.get("values") or {}).items())
            lines += [f"    {k}: {v}" for k, v in extra[:20]]
            if len(extra) > 20:
                lines.append(f"    ... {len(extra) - 20} more values (--json lists them)")
        elif content["format"] == "npy":
            arr = content["array"]
            lines.append(f"  content: .npy array, dtype {arr['dtype']}, shape {tuple(arr['shape'])}")
        elif content["format"] in ("npz", "zip"):
            lines.append(f"  content: .{content['format']} with {len(content['arrays'])} arrays")
            rows = [[k, v["dtype"], str(tuple(v["shape"]))] for k, v in content["arrays"].items()]
            if rows:
                lines += ["    " + line for line in table(["ARRAY", "DTYPE", "SHAPE"], rows, right=set()).splitlines()]
            if content["other_members"]:
                lines.append(f"    other members: {', '.join(content['other_members'])}")
        else:
            lines.append(f"  content: {content['preview']!r}")
    for section in ("config", "stats"):
        if section in info:
            lines.append(f"  {section}:")
            lines += [f"    {k}: {v}" for k, v in info[section].items() if not isinstance(v, dict)]
    return "\n".join(lines)


@click.command("inspect")
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(path, as_json) -> None:
    """Show one entry (or file, or namespace) in detail: attributes, and for .npy/.npz the
    array names, dtypes and shapes; for safetensors and torch.save files the tensors'
    (torch pickles are read without running them: anything but tensors is not read)."""
    info = inspect_info(Path(path))
    click.echo(json.dumps(info, indent=2) if as_json else inspect_text(info))
    if "error" in info.get("content", {}):
        raise SystemExit(1)


# ----- export --------------------------------------------------------------------------------

# Directories whose names are computed per open (sample/N, batch/N.npz, at/I): never copied.
_GENERATED = {"sample", "batch", "at"}
_CHANNELS = {"client"}  # a namespace's request/reply files (the client beside the mount): no content
_CONTROL = ".distorefs"  # control files (wait, gc, ...): not data
# A dataset's per-process files: `order` is the reading process's declared order, `client`
# a session file; neither is the dataset's content.
_DATASET_SKIP = {"client", "order"}
MANIFEST = ".distorefs-export.json"
MANIFEST_FORMAT = 2  # 1: files only, attributes merged into each record (a dataset item's
                     # own `path` attribute overwrote the record's path)


def is_dataset_dir(path: Path) -> bool:
    return (path / "items").is_dir() and (path / "config.json").is_file()


def mount_root(path: Path) -> Path | None:
    """The distorefs mount point `path` is in (or is), else None."""
    p = Path(os.path.abspath(path))
    for candidate in (p, *p.parents):
        if (candidate / ".distorefs" / "version").is_file():
            return candidate
    return None


def tree_kind(path: Path) -> str:
    """What `path` is in its mount's tree: mount, buffers, buffer, banks, bank, weights (the
    tree or a directory in it), datasets, dataset, checkpoints, run, step, or other."""
    root = mount_root(path)
    if root is None:
        return "other"
    return kind_of_parts(Path(os.path.abspath(path)).relative_to(root).parts)


# A path of each kind, relative to the mount (kind_of_parts(KIND_PLACES[k]) == k)
KIND_PLACES = {"mount": (), "buffers": ("buffers",), "buffer": ("buffers", "B"), "banks": ("banks",),
               "bank": ("banks", "B"), "weights": ("weights",), "datasets": ("datasets",),
               "dataset": ("datasets", "D"), "checkpoints": ("checkpoints",), "run": ("checkpoints", "R"),
               "step": ("checkpoints", "R", "S")}


def kind_of_parts(parts: tuple[str, ...]) -> str:
    """tree_kind of the path `parts` (relative to the mount)."""
    if not parts:
        return "mount"
    top, depth = parts[0], len(parts)
    if top == "weights":
        return "weights"
    singular = {"buffers": "buffer", "banks": "bank", "datasets": "dataset"}
    if top in singular and depth <= 2:
        return top if depth == 1 else singular[top]
    if top == "checkpoints" and depth <= 3:
        return ("checkpoints", "run", "step")[depth - 1]
    return "other"


def walk_tree(root: Path):
    """(relative path, lstat) of everything below root, files of a directory in its order."""
    stack = [Path()]
    while stack:
        rel = stack.pop()
        here = root / rel
        names = []
        with os.scandir(here) as it:
            names = [e.name for e in it]
        namespace = is_namespace_dir(here)
        skip = _CHANNELS if namespace else _DATASET_SKIP if is_dataset_dir(here) else set()
        subdirs = []
        for name in names:
            if name in skip:
                continue
            st = os.lstat(here / name)
            if stat_mod.S_ISDIR(st.st_mode):
                if (namespace and name in _GENERATED) or name == _CONTROL:
                    continue
                subdirs.append(rel / name)
            yield rel / name, st
        stack.extend(reversed(subdirs))


def export(src: Path, dest: Path, progress: bool = True) -> dict:
    """Copy src (a namespace, a weights or dataset tree, ...) to dest as plain files.

    Each file's CRC-32 is checked against its `checksum` attribute while it is copied.
    DEST/.distorefs-export.json records, in listing order (FIFO for entries), each file's
    attributes (seq, priority, times sampled, version, checksum), the CRC-32, mode and
    mtime of what was written, and each directory's mode, mtime and attributes (a
    checkpoint step's seq, state, pinned): what `distorefs import` restores."""
    from tqdm import tqdm

    if dest.exists() and any(dest.iterdir()):
        raise click.ClickException(f"{dest} exists and is not empty")
    items = list(walk_tree(src))
    total = sum(st.st_size for _, st in items if stat_mod.S_ISREG(st.st_mode))
    dest.mkdir(parents=True, exist_ok=True)
    manifest, dirs, errors, copied, nbytes = [], [], [], 0, 0
    keep_owners = os.geteuid() == 0
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc="export", dynamic_ncols=True) as bar:
        for rel, st in items:
            s, d = src / rel, dest / rel
            try:
                if stat_mod.S_ISDIR(st.st_mode):
                    d.mkdir(exist_ok=True)
                    dirs.append({**xattrs(s), "path": str(rel), "mode": st.st_mode & 0o7777,
                                 "mtime_ns": st.st_mtime_ns, "uid": st.st_uid, "gid": st.st_gid})
                elif stat_mod.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(s), d)
                elif stat_mod.S_ISREG(st.st_mode):
                    a = xattrs(s)
                    crc = size = 0
                    with open(s, "rb") as fin, open(d, "wb") as fout:
                        while True:
                            chunk = fin.read(1 << 20)
                            if not chunk:
                                break
                            crc = zlib.crc32(chunk, crc)
                            size += len(chunk)
                            fout.write(chunk)
                            bar.update(len(chunk))
                    if keep_owners:  # as cp -a: the copy is the owner's (import restores it)
                        os.chown(d, st.st_uid, st.st_gid)
                    os.chmod(d, st.st_mode & 0o777)
                    os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
                    want = a.get("checksum", "")
                    if want.startswith("crc32:") and int(want[6:], 16) != crc:
                        errors.append(f"{rel}: checksum {crc:08x} does not match {want}")
                    # the record's own fields last: an attribute named path or size (a dataset
                    # item's) must not replace them
                    manifest.append({**a, "path": str(rel), "size": size, "crc32": f"crc32:{crc:08x}",
                                     "mode": st.st_mode & 0o7777, "mtime_ns": st.st_mtime_ns,
                                     "uid": st.st_uid, "gid": st.st_gid})
                    copied += 1
                    nbytes += size
            except OSError as exc:
                if exc.errno == errno.ENOENT and not stat_mod.S_ISDIR(st.st_mode):
                    continue  # evicted or removed while the export ran
                errors.append(f"{rel}: {exc.strerror or exc}")
    (dest / MANIFEST).write_text(json.dumps(
        {"format": MANIFEST_FORMAT, "source": str(src), "kind": tree_kind(src), "exported_at": time.time(),
         "root": xattrs(src), "files": manifest, "dirs": dirs}, indent=1) + "\n")
    return {"files": copied, "bytes": nbytes, "errors": errors}


@click.command("export")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def export_cmd(path, dest, quiet) -> None:
    """Copy a namespace (MNT/buffers/NAME, MNT/weights/MODEL, ...) out to DEST as plain files,
    checking each file's checksum; attributes go to DEST/.distorefs-export.json."""
    result = export(Path(path), Path(dest), progress=not quiet)
    click.echo(f"exported {result['files']} files, {human(result['bytes'])} to {dest}")
    for line in result["errors"][:20]:
        click.echo(f"  error: {line}", err=True)
    if result["errors"]:
        raise SystemExit(1)


# ----- gc ------------------------------------------------------------------------------------

@click.command("gc")
@click.argument("target", type=click.Path(exists=True, file_okay=False))
def gc_cmd(target) -> None:
    """Free segment files whose values are all gone, now. TARGET is a mount point (the daemon
    collects at once: a write to MNT/.distorefs/gc) or a store that is not mounted."""
    info = find_mount(target)
    if info is not None:
        ctl = info.mountpoint / ".distorefs" / "gc"
        try:
            with open(ctl, "wb") as f:
                f.write(b"collect\n")  # the collection runs at close()
            result = json.loads(ctl.read_bytes())
        except OSError as exc:
            raise click.ClickException(f"{ctl}: {exc.strerror}")
        where = f"daemon of {info.mountpoint}"
    else:
        if not (Path(target) / "meta" / "data.mdb").is_file():
            raise click.ClickException(f"{target} is neither a distorefs mount nor a store")
        result = offline_gc(Path(target))
        where = f"store {Path(target).resolve()} (offline)"
    click.echo(f"{where}: freed {human(result['segment_bytes_freed'])} of segment files; "
               f"segments now use {human(result['nvme_used_bytes'])}")


def offline_gc(path: Path) -> dict:
    from distorefs.errors import RecoveryFailed, StoreLocked
    from distorefs.store import Store
    try:
        store = Store(path)
    except (StoreLocked, RecoveryFailed) as exc:
        raise click.ClickException(str(exc))
    try:
        store.sync_blocking()
        freed = store.values.collect()
        used = store.values.nvme.usage().used_bytes
    finally:
        store.close()
    return {"segment_bytes_freed": freed, "nvme_used_bytes": used}


# ----- verify --------------------------------------------------------------------------------

@click.command("verify")
@click.argument("store", type=click.Path(exists=True, file_okay=False))
@click.option("--repair", is_flag=True, help="Fix what can be fixed safely and say what was done.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def verify_cmd(store, repair, as_json, quiet) -> None:
    """Check a store that is not mounted: every value's checksum, every index against the
    data, segment files accounted for, leaked space. Exit 0 clean, 1 problems found and
    all repaired, 4 problems left, 8 the check could not run."""
    from distorefs.errors import DamagedStore, NotFound, StoreLocked
    from distorefs.verify import EXIT_FAILED, verify_store

    marks = {"error": "ERROR", "leak": "LEAK", "space": "space", "note": "note"}

    def on_pass(name, summary, found):
        if as_json:
            return
        click.echo(f"  {name:<13} {summary}")
        for f in found:
            click.echo(f"      {marks[f.kind]}: {f.message}" + (f"  [repaired: {f.repair}]" if f.repair else ""))

    if not as_json:
        click.echo(f"verify {Path(store).resolve()}" + (" (repair)" if repair else ""))
    try:
        report = verify_store(store, repair=repair, progress=not quiet and not as_json and sys.stderr.isatty(),
                              on_pass=on_pass)
    except (StoreLocked, NotFound, DamagedStore) as exc:
        click.echo(f"distorefs verify: cannot check: {exc}", err=True)
        raise SystemExit(EXIT_FAILED)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        problems, left = len(report.problems), len(report.unrepaired)
        space = sum(f.bytes for f in report.findings if f.kind == "space" and not f.repair)
        click.echo(("clean" if not problems else f"{problems} problems, {problems - left} repaired, {left} left")
                   + (f"; {human(space)} reclaimable by gc" if space else ""))
    raise SystemExit(report.exit_code)


# ----- stats ---------------------------------------------------------------------------------

def _targets(path: str | None) -> list[tuple[Path, Path | None]]:
    """(mount root, namespace dir or None) to show."""
    if path is None:
        found = mounts()
        if not found:
            raise click.ClickException("no distorefs mounts (give a PATH)")
        return [(m.mountpoint, None) for m in found]
    p = Path(path).resolve()
    root = p
    while not (root / ".distorefs" / "stats.json").exists():
        if root.parent == root:
            raise click.ClickException(f"{path} is not inside a distorefs mount")
        root = root.parent
    return [(root, None if p == root or not (p / "stats.json").is_file() else p)]


_RATE_KEYS = ("inserts", "reads", "read_bytes", "batches", "sampled_entries", "deletes", "evictions")


def _rates(now: dict, before: dict | None, dt: float) -> dict:
    if not before or dt <= 0:
        return {}
    return {k: (now.get(k, 0) - before.get(k, 0)) / dt for k in _RATE_KEYS
            if isinstance(now.get(k), (int, float)) and isinstance(before.get(k), (int, float))}


def _ns_rows(stats: dict, prev: dict | None, dt: float) -> list[list]:
    rows = []
    for kind in ("buffers", "banks"):
        for name, s in stats.get(kind, {}).items():
            before = (prev or {}).get(kind, {}).get(name)
            r = _rates(s, before, dt)
            rows.append([f"{kind}/{name}", s.get("entries"), human(s.get("bytes")), human(s.get("stored_bytes")),
                         s.get("compression_ratio"), s.get("inserts"), s.get("reads"), s.get("batches", "-"),
                         f"{r['inserts']:.0f}/s" if "inserts" in r else "-",
                         f"{human(r['read_bytes'])}/s" if "read_bytes" in r else "-"])
    for name, s in stats.get("datasets", {}).items():
        pf = s.get("prefetch", {})
        rows.append([f"datasets/{name}", s.get("items"), human(s.get("bytes")), human(s.get("stored_bytes")),
                     round(s["bytes"] / s["stored_bytes"], 3) if s.get("stored_bytes") else None,
                     s.get("staged"), s.get("reads"), "-", "-",
                     f"hit {pf.get('hit_rate')}" if pf.get("hit_rate") is not None else "-"])
    return rows


def stats_text(stats: dict, prev: dict | None = None, dt: float = 0.0, namespace: dict | None = None) -> str:
    if namespace is not None:
        width = max((len(k) for k in namespace), default=0)
        return "\n".join(f"{k.ljust(width)}  {json.dumps(v) if isinstance(v, (dict, list)) else v}"
                         for k, v in namespace.items())
    out = [f"store {stats.get('store')}  distorefs {stats.get('version')}  up {stats.get('uptime_s', 0):.0f}s"
           f"  commits {stats.get('commits', {}).get('groups')} groups / {stats.get('commits', {}).get('changes')}"
           f" changes, {stats.get('commits', {}).get('failures')} failed"
           f"  corrupt reads {stats.get('corrupt_reads', 0)}", ""]
    tiers = []
    for name, t in stats.get("tiers", {}).items():
        cap = t.get("capacity_bytes") or 0
        tiers.append([name, human(t.get("used_bytes")), human(t.get("live_bytes")), human(cap),
                      f"{100 * t.get('used_bytes', 0) / cap:.1f}%" if cap else "-"])
    cache = stats.get("memory", {}).get("cache", {})
    tiers.append(["memory", human(cache.get("used_bytes")), human(cache.get("used_bytes")),
                  human(cache.get("capacity_bytes")),
                  f"{100 * cache['used_bytes'] / cache['capacity_bytes']:.1f}%" if cache.get("capacity_bytes") else "-"])
    out += [table(["TIER", "USED", "LIVE", "CAPACITY", "USE"], tiers), ""]
    pf = stats.get("prefetch", {})
    out.append(f"cache hit rate {cache.get('hit_rate')} ({cache.get('hits')} hits, {cache.get('misses')} misses)   "
               f"prefetch hit rate {pf.get('hit_rate')} ({pf.get('hits')} hits, {pf.get('late')} late, "
               f"{pf.get('misses')} misses, {human(pf.get('held_bytes'))} held)")
    m = stats.get("mount")
    if m:
        out.append(f"open handles {m.get('open_handles')}  inodes {m.get('inodes')}  "
                   f"kernel invalidations {m.get('invalidations')}")
    rows = _ns_rows(stats, prev, dt)
    if rows:
        out += ["", table(["NAMESPACE", "ENTRIES", "BYTES", "STORED", "RATIO", "INSERTS", "READS", "BATCHES",
                           "INSERT RATE", "READ RATE"], rows, right=set(range(1, 10)))]
    w = stats.get("weights")
    if w:
        out += ["", f"weights: {w.get('files')} files, {w.get('versions')} versions, {human(w.get('bytes'))}, "
                    f"{w.get('open_readers')} open readers, {w.get('publishes')} publishes, "
                    f"{w.get('versions_collected')} versions collected"]
    c = stats.get("checkpoints")
    if c:
        wb = c.get("writeback", {})
        out.append(f"checkpoints: {c.get('runs')} runs, {c.get('steps')} steps {c.get('steps_by_state')}, "
                   f"{human(c.get('bytes'))}; write-back {human(wb.get('held_bytes'))} of "
                   f"{human(wb.get('budget_bytes'))} held")
    return "\n".join(out)


@click.command("stats")
@click.argument("path", required=False, type=click.Path(exists=True))
@click.option("--watch", "-w", is_flag=True, help="Refresh every --interval seconds, with rates.")
@click.option("--interval", default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--json", "as_json", is_flag=True, help="The raw stats.json.")
@click.option("--prometheus", is_flag=True, help="Prometheus text exposition (as MNT/.distorefs/metrics).")
def stats_cmd(path, watch, interval, as_json, prometheus) -> None:
    """Stats of a mount (or of one namespace in it) as readable tables. Without PATH, every
    distorefs mount."""
    from distorefs.metrics import prometheus_text

    targets = _targets(path)
    prev: dict = {}
    last = time.monotonic()
    while True:
        now = time.monotonic()
        chunks = []
        for root, ns in targets:
            try:
                whole = json.loads((root / ".distorefs" / "stats.json").read_bytes())
                part = json.loads((ns / "stats.json").read_bytes()) if ns is not None else None
            except (OSError, ValueError) as exc:
                raise click.ClickException(f"{root}: {exc}")
            if prometheus:
                chunks.append(prometheus_text(whole))
            elif as_json:
                chunks.append(json.dumps(part if part is not None else whole, indent=2))
            else:
                head = f"== {ns if ns is not None else root}" if len(targets) > 1 or ns is not None else ""
                body = stats_text(whole, prev.get(root), now - last, part)
                chunks.append(f"{head}\n{body}" if head else body)
            prev[root] = whole
        last = now
        if watch:
            click.clear()
        click.echo("\n\n".join(chunks).rstrip("\n"))
        if not watch:
            return
        time.sleep(interval)


COMMANDS = [verify_cmd, ls_cmd, inspect_cmd, export_cmd, gc_cmd, stats_cmd]

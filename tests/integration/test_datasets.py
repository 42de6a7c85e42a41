"""datasets/ through a real mount: `distorefs stage` of a generated tree (every byte compared),
resume after a killed stage, sealing and read-only behaviour, index.npy, the declared
order and its prefetch hits, reads against the order, cp -r / rsync then seal, a list
file with metadata, and the MountedDataset/EpochSampler helper."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from distorefs.loader import EpochSampler, MountedDataset
from distorefs_it import CLI, assert_errno, drop_page_cache, xattr


def make_tree(root: Path, n: int, seed: int = 0, big: int = 0) -> dict[str, bytes]:
    """n files in nested directories, sizes 0..64 KB (compressible and not), `big` of 5 MB."""
    rng = np.random.default_rng(seed)
    files = {}
    for i in range(n):
        depth = i % 4
        rel = "/".join([f"dir{(i >> (2 * d)) % 4}" for d in range(depth)] + [f"file{i:05d}.dat"])
        size = int(rng.integers(0, 64 << 10)) if i >= big else (5 << 20) + i
        data = (rng.integers(0, 256, size, dtype=np.uint8) if i % 2 else
                rng.integers(0, 3, size, dtype=np.uint8)).tobytes()
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[rel] = data
    return files


def stage(src, dest, *extra, check=True):
    return subprocess.run(CLI + ["stage", "-q", str(src), str(dest), *extra], capture_output=True, text=True,
                          check=check, timeout=600)


def stats(ds: Path) -> dict:
    return json.loads((ds / "stats.json").read_bytes())


@pytest.fixture(scope="module")
def staged(fs, tmp_path_factory):
    """One tree of 3,000 files staged and sealed; shared by the read-side tests."""
    src = tmp_path_factory.mktemp("src")
    files = make_tree(src, 3000, big=3)
    ds = fs.mnt / "datasets" / "staged"
    out = stage(src, ds)
    assert "3000 files" in out.stdout and "3000 copied" in out.stdout and "sealed" in out.stdout, out.stdout
    return src, files, ds


def test_stage_copies_every_byte(staged):
    src, files, ds = staged
    for rel, data in files.items():
        assert (ds / "items" / rel).read_bytes() == data, rel
    found = {str(p.relative_to(ds / "items")) for p in (ds / "items").rglob("*") if p.is_file()}
    assert found == set(files)
    assert subprocess.run(["diff", "-r", str(src), str(ds / "items")]).returncode == 0
    s = stats(ds)
    assert s["sealed"] and s["items"] == 3000 and s["bytes"] == sum(map(len, files.values()))
    assert s["verify_failures"] == 0 and s["stage_errors"] == 0
    assert s["staged_sent"] == 3000 - 3  # the stager read and sent every small file; the daemon read the 5 MB ones


def test_index_npy(staged):
    _, files, ds = staged
    index = np.load(ds / "index.npy")
    assert len(index) == len(files)
    assert list(index["item"]) == list(range(len(files)))
    paths = [p.decode() for p in index["path"]]
    assert set(paths) == set(files)
    for row in index[::97]:
        data = files[row["path"].decode()]
        assert row["size"] == len(data) and row["checksum"] == zlib.crc32(data)
        item = ds / "items" / row["path"].decode()
        assert xattr(item, "item") == str(row["item"])
    assert os.path.getsize(ds / "index.npy") == len((ds / "index.npy").read_bytes())


def test_sealed_is_read_only(staged):
    _, files, ds = staged
    rel = next(iter(files))
    item = ds / "items" / rel
    assert_errno(errno.EROFS, open, item, "r+b")
    assert_errno(errno.EROFS, open, ds / "items" / "new.bin", "wb")
    assert_errno(errno.EROFS, os.unlink, item)
    assert_errno(errno.EROFS, os.mkdir, ds / "items" / "newdir")
    assert_errno(errno.EROFS, os.rename, item, ds / "items" / "moved")
    assert_errno(errno.EROFS, os.truncate, item, 0)
    assert_errno(errno.EROFS, open, ds / "index.npy", "wb")
    assert_errno(errno.EINVAL, os.setxattr, ds, "user.distorefs.sealed", b"0")
    assert item.read_bytes() == files[rel]
    assert xattr(ds, "state") == "sealed"


def test_declared_order_is_prefetched(staged):
    _, files, ds = staged
    index = np.load(ds / "index.npy")
    order = np.random.default_rng(5).permutation(len(index))[:1500]
    # pages earlier tests left in the kernel's cache would serve a reader that overtook
    # the prefetcher: this counts the prefetcher's own hits
    drop_page_cache([ds / "items" / index["path"][i].decode() for i in order])
    before = stats(ds)["prefetch"]
    with open(ds / "order", "wb") as f:
        np.save(f, order)
    assert np.array_equal(np.load(ds / "order"), order)
    for i in order:
        path = index["path"][i].decode()
        assert (ds / "items" / path).read_bytes() == files[path]
    after = stats(ds)["prefetch"]
    hits = after["hits"] + after["late"] - before["hits"] - before["late"]
    misses = after["misses"] - before["misses"]
    assert hits >= 0.95 * len(order), (hits, misses, after)
    assert after["bytes_ahead"] < 64 << 20 and after["plans"] == before["plans"] + 1


def test_the_daemons_worker_threads_are_not_renamed_for_each_call(fs, staged):
    """trio names a worker thread after each call's task and back (pthread_setname_np
    through ctypes, letting go of the GIL twice a call): the daemon turns that off, so after
    a cold listing, lookups and a declared order's loads, no thread of it carries a name
    trio gave it."""
    _, files, ds = staged
    index = np.load(ds / "index.npy")
    order = np.random.default_rng(11).permutation(len(index))[:300]
    drop_page_cache([ds / "items" / index["path"][i].decode() for i in order])
    with open(ds / "order", "wb") as f:
        np.save(f, order)
    for i in order:
        path = index["path"][i].decode()
        assert (ds / "items" / path).read_bytes() == files[path]
    names = []
    for task in os.listdir(f"/proc/{fs.pid}/task"):
        try:
            names.append(Path(f"/proc/{fs.pid}/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    assert "distorefs-front" in names  # (the front names its own thread)
    assert not [n for n in names if n.startswith("Trio thread") or " from " in n], names


def test_reads_against_the_order_are_correct(staged):
    _, files, ds = staged
    index = np.load(ds / "index.npy")
    (ds / "order").write_text("\n".join(str(i) for i in range(100)) + "\n")  # lines work too
    assert list(np.load(ds / "order")) == list(range(100))
    backwards = range(2999, 2799, -1)  # the other end, backwards
    # so the reads reach the daemon rather than the kernel's cache
    drop_page_cache([ds / "items" / index["path"][i].decode() for i in backwards])
    before = stats(ds)["prefetch"]["misses"]
    for i in backwards:
        path = index["path"][i].decode()
        assert (ds / "items" / path).read_bytes() == files[path]
    assert stats(ds)["prefetch"]["misses"] > before
    assert_errno(errno.EINVAL, (ds / "order").write_text, "3000\n")
    assert_errno(errno.EINVAL, (ds / "order").write_text, "no/such/item\n")
    assert len(np.load(ds / "order")) == 100


def test_readdir_streams_and_lookups(staged):
    _, files, ds = staged
    top = sorted(os.listdir(ds / "items"))
    assert top == sorted({rel.split("/")[0] for rel in files})
    with os.scandir(ds / "items") as it:
        assert sorted(e.name for e in it) == top
    found = subprocess.run(["find", str(ds / "items"), "-type", "f"], capture_output=True, text=True, check=True)
    assert len(found.stdout.splitlines()) == len(files)


def test_lookups_and_listings_of_one_directory_run_side_by_side(fs, staged):
    """The kernel may send LOOKUPs and READDIRs of one directory at once (the library adds
    FUSE_PARALLEL_DIROPS to libfuse 3.14's INIT reply; without it a cold epoch's readers
    waited for the name warmer's listings). Four threads stat every item by name while two
    list the directories over and over: every stat finds its item's size, every listing
    every name."""
    import threading
    mount = json.loads((fs.mnt / ".distorefs" / "stats.json").read_bytes())["mount"]
    assert mount["parallel_dirops"] is True
    _, files, ds = staged
    rels = sorted(files)
    tops = sorted({rel.split("/")[0] for rel in files})
    errors: list[str] = []
    stop = threading.Event()

    def stat_all(k: int) -> None:
        try:
            for rel in rels[k::4]:
                size = os.stat(ds / "items" / rel).st_size
                if size != len(files[rel]):
                    errors.append(f"{rel}: {size} bytes, not {len(files[rel])}")
        except OSError as exc:
            errors.append(f"stat: {exc}")

    def list_all() -> None:
        try:
            while not stop.is_set():
                if sorted(os.listdir(ds / "items")) != tops:
                    errors.append("a listing of items/ lost a name")
                for top in tops[:2]:  # (directories: they sort before the files)
                    if not os.listdir(ds / "items" / top):
                        errors.append(f"items/{top} listed empty")
        except OSError as exc:
            errors.append(f"listing: {exc}")

    listers = [threading.Thread(target=list_all) for _ in range(2)]
    statters = [threading.Thread(target=stat_all, args=(k,)) for k in range(4)]
    for t in listers + statters:
        t.start()
    for t in statters:
        t.join(timeout=120)
    stop.set()
    for t in listers:
        t.join(timeout=60)
    assert not errors, errors[:5]


def test_interrupted_stage_resumes(fs, tmp_path):
    src = tmp_path / "src"
    files = make_tree(src, 2500, seed=2)
    ds = fs.mnt / "datasets" / "resumed"
    proc = subprocess.Popen(CLI + ["stage", "-q", "-j", "1", str(src), str(ds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (ds / "stats.json").exists() and stats(ds)["staged"] >= 300:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = stats(ds)
    assert not partial["sealed"] and 0 < partial["items"] < len(files), partial
    out = stage(src, ds)
    assert f"{partial['items']} already staged" in out.stdout or "already staged" in out.stdout, out.stdout
    copied = int(out.stdout.split(" copied")[0].rsplit(" ", 1)[1])
    assert copied <= len(files) - partial["items"] + 16  # a batch in flight may be redone
    assert "sealed" in out.stdout
    for rel, data in list(files.items())[::7]:
        assert (ds / "items" / rel).read_bytes() == data
    assert stats(ds)["items"] == len(files)


def test_cp_and_rsync_then_seal(fs, tmp_path):
    src = tmp_path / "src"
    files = make_tree(src, 300, seed=3)
    for tool, name in (("cp", "bycp"), ("rsync", "byrsync")):
        if not shutil.which(tool):
            pytest.fail(f"{tool} missing (make installs it)")
        ds = fs.mnt / "datasets" / name
        os.mkdir(ds)
        cmd = ["cp", "-r", f"{src}/.", str(ds / "items")] if tool == "cp" else \
            ["rsync", "-a", f"{src}/", str(ds / "items") + "/"]
        subprocess.run(cmd, check=True, timeout=120)
        assert xattr(ds, "state") == "open"
        assert not (ds / "index.npy").exists()
        subprocess.run(CLI + ["seal", str(ds)], check=True, capture_output=True)
        assert subprocess.run(["diff", "-r", str(src), str(ds / "items")]).returncode == 0
        index = np.load(ds / "index.npy")
        assert sorted(p.decode() for p in index["path"]) == sorted(files)
    # before a seal items can be rewritten, renamed and removed like ordinary files
    ds = fs.mnt / "datasets" / "scratch"
    os.makedirs(ds / "items" / "a" / "b")
    (ds / "items" / "a" / "b" / "x").write_bytes(b"one")
    (ds / "items" / "a" / "b" / "x").write_bytes(b"two!")
    os.rename(ds / "items" / "a" / "b" / "x", ds / "items" / "a" / "y")
    assert (ds / "items" / "a" / "y").read_bytes() == b"two!"
    assert_errno(errno.ENOTEMPTY, os.rmdir, ds / "items" / "a")
    assert_errno(errno.EINVAL, (ds / "order").write_text, "0\n")  # not sealed yet
    os.unlink(ds / "items" / "a" / "y")
    shutil.rmtree(ds / "items" / "a")
    assert stats(ds)["items"] == 0
    os.rmdir(ds)
    assert not ds.exists()


def test_list_file_with_metadata_and_loader(fs, tmp_path):
    src = tmp_path / "src"
    files = make_tree(src, 200, seed=4)
    listing = tmp_path / "list.csv"
    with open(listing, "w") as f:
        f.write("path,label,weight,split\n")
        for i, rel in enumerate(files):
            f.write(f"src/{rel},{i % 10},{i / 4},{'train' if i % 3 else 'val'}\n")
    ds = fs.mnt / "datasets" / "listed"
    stage(listing, ds)
    index = np.load(ds / "index.npy")
    assert index.dtype["label"] == np.int64 and index.dtype["weight"] == np.float64
    assert index.dtype["split"].kind == "S"
    by_path = {p.decode(): (label, split) for p, label, split in zip(index["path"], index["label"], index["split"])}
    for i, rel in enumerate(files):
        assert by_path[rel] == (i % 10, b"train" if i % 3 else b"val")
    # the helper: each epoch declares its shuffled order, and reads along it are prefetched
    data = MountedDataset(ds, direct=False)  # through the mount: the daemon's prefetch serves the opens
    sampler = EpochSampler(data, seed=1)
    before = stats(ds)["prefetch"]
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        assert sorted(order) == list(range(len(files)))
        assert np.array_equal(np.load(ds / "order"), order)
        for i in order:
            assert data[i] == files[data.index["path"][i].decode()]
    after = stats(ds)["prefetch"]
    assert after["plans"] == before["plans"] + 2
    reads = 2 * len(files)
    opens = {k: after[k] - before[k] for k in ("hits", "late", "page_cache", "misses")}
    assert sum(opens.values()) == reads, json.dumps(after)  # every open is accounted for once
    assert opens["hits"] + opens["late"] + opens["page_cache"] >= 0.95 * reads, json.dumps(after)


def test_a_tree_is_staged_while_it_is_listed(fs, tmp_path):
    from distorefs.tools.stage import check_destination, stage_sources, walk

    src = tmp_path / "src"
    files = make_tree(src, 600, seed=5)
    ds = fs.mnt / "datasets" / "streamed"
    dest = check_destination(str(ds))
    first = 256  # one batch

    def listing():
        """The tree's listing, which goes on only once its first batch was staged."""
        for i, source in enumerate(walk(str(src))):
            if i == first:
                deadline = time.monotonic() + 30
                while not ((ds / "stats.json").exists() and stats(ds)["staged"] >= first):
                    assert time.monotonic() < deadline, "nothing was staged while the tree was listed"
                    time.sleep(0.02)
            yield source

    report = stage_sources(listing(), dest, progress=False)
    assert (report.files, report.ok, report.errors, report.sealed) == (len(files), len(files), [], True)
    assert report.bytes == sum(len(d) for d in files.values())
    for rel, data in list(files.items())[::11]:
        assert (ds / "items" / rel).read_bytes() == data

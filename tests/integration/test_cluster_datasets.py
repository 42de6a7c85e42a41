"""datasets/ of a shared store, through real mounts of daemons joining one Redis Cluster
(the `cluster` and `nodes` fixtures are conftest's): staged once on one node, readable
whole on every node once sealed, each node prefetching along its own declared order."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from distorefs_it import CLI, assert_errno, drop_page_cache, have_fuse, wait_for, xattr

pytestmark = pytest.mark.skipif(not have_fuse(), reason="needs /dev/fuse and fusermount3")


def make_tree(root: Path, n: int, seed: int = 0) -> dict[str, bytes]:
    """n files (0..20 KB, a few of 9 MB: several chunks) in nested directories."""
    rng = np.random.default_rng(seed)
    files = {}
    for i in range(n):
        rel = "/".join([f"d{(i >> (2 * d)) % 3}" for d in range(i % 3)] + [f"f{i:05d}.bin"])
        size = (9 << 20) + i if i % 400 == 7 else int(rng.integers(0, 20 << 10))
        data = rng.integers(0, 256 if i % 2 else 4, size, dtype=np.uint8).tobytes()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


def stage(src: Path, dest: Path) -> None:
    out = subprocess.run(CLI + ["stage", "-q", str(src), str(dest)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "sealed" in out.stdout, (out.stdout, out.stderr)


def stats(ds: Path) -> dict:
    return json.loads((ds / "stats.json").read_bytes())



def exported(node) -> int:
    return json.loads((node.mnt / ".distorefs" / "stats.json").read_bytes())["cluster"]["datasets"]["exported"]


def sealed_on(node, name: str) -> bool:
    ds = node.mnt / "datasets" / name
    return ds.is_dir() and xattr(ds, "state") == "sealed"


def assert_same_dataset(ds: Path, files: dict[str, bytes], index: bytes) -> None:
    assert (ds / "index.npy").read_bytes() == index
    found = {str(p.relative_to(ds / "items")) for p in (ds / "items").rglob("*") if p.is_file()}
    assert found == set(files)
    for rel, data in files.items():
        assert (ds / "items" / rel).read_bytes() == data, rel


def test_a_dataset_staged_on_one_node_is_read_whole_on_the_others(nodes, tmp_path):
    a, b = nodes(), nodes()
    src = tmp_path / "src"
    files = make_tree(src, 1200)  # ~5,000 records: the export goes in several parts of the log
    stage(src, a.mnt / "datasets" / "ds")
    # sealed on a means shared: b has it at once, whole
    assert wait_for(lambda: sealed_on(b, "ds"), 10.0)
    index = (a.mnt / "datasets" / "ds" / "index.npy").read_bytes()
    bds = b.mnt / "datasets" / "ds"
    assert_same_dataset(bds, files, index)
    s = stats(bds)
    assert s["sealed"] and s["items"] == len(files) and s["bytes"] == sum(map(len, files.values()))
    # read-only there too
    rel = next(iter(files))
    assert_errno(errno.EROFS, open, bds / "items" / rel, "r+b")
    assert_errno(errno.EROFS, open, bds / "items" / "new.bin", "wb")
    # b's own order is read ahead into b's memory (not the pages the reads above left in
    # the kernel's cache: those would serve a reader that overtook the prefetcher)
    drop_page_cache(bds / "items" / rel for rel in files)
    order = np.random.default_rng(3).permutation(len(files))[:600]
    with open(bds / "order", "wb") as f:
        np.save(f, order)
    paths = np.load(bds / "index.npy")["path"]
    before = stats(bds)["prefetch"]
    for i in order:
        rel = paths[i].decode()
        assert (bds / "items" / rel).read_bytes() == files[rel]
    after = stats(bds)["prefetch"]
    hits = after["hits"] + after["late"] - before["hits"] - before["late"]
    assert hits >= 0.9 * len(order), (hits, after)
    # a node joining later sees it too, whole
    c = nodes()
    assert sealed_on(c, "ds")
    assert_same_dataset(c.mnt / "datasets" / "ds", files, index)


def test_a_dataset_sealed_before_the_store_joined_is_shared_at_its_start(nodes, tmp_path):
    a = nodes()
    b = nodes()
    a.cleanup()  # a leaves the cluster, stages and seals a dataset alone, then joins again
    src = tmp_path / "src"
    files = make_tree(src, 50, seed=1)
    a.mount()
    stage(src, a.mnt / "datasets" / "solo")
    assert not (b.mnt / "datasets" / "solo").exists()
    index = (a.mnt / "datasets" / "solo" / "index.npy").read_bytes()
    a.cleanup()
    a.mount(flags=a.cluster_flags)  # type: ignore[attr-defined]
    assert wait_for(lambda: sealed_on(b, "solo"), 30.0)
    assert_same_dataset(b.mnt / "datasets" / "solo", files, index)
    # shared once: a second start exports nothing again
    assert wait_for(lambda: exported(a) == 1, 10.0)
    a.cleanup()
    a.mount(flags=a.cluster_flags)  # type: ignore[attr-defined]
    time.sleep(0.5)
    assert exported(a) == 0


def test_a_node_keeps_its_own_dataset_of_the_same_name(nodes, tmp_path):
    a, b = nodes(), nodes()
    (b.mnt / "datasets" / "same").mkdir()
    (b.mnt / "datasets" / "same" / "items" / "mine.txt").write_bytes(b"b's own")
    src = tmp_path / "src"
    files = make_tree(src, 20, seed=2)
    stage(src, a.mnt / "datasets" / "same")
    # the record reached b (a later dataset arrives), and b's own tree is untouched
    src2 = tmp_path / "src2"
    make_tree(src2, 5, seed=3)
    stage(src2, a.mnt / "datasets" / "later")
    assert wait_for(lambda: sealed_on(b, "later"), 10.0)
    assert xattr(b.mnt / "datasets" / "same", "state") == "open"
    assert os.listdir(b.mnt / "datasets" / "same" / "items") == ["mine.txt"]
    assert len(files) == 20


def test_the_python_client_reads_a_shared_dataset_and_buffer(nodes, tmp_path):
    """Values in the cluster are not in this node's files: the client reads them through
    the mount, with the same results."""
    from distorefs.client import open_buffer
    from distorefs.loader import MountedDataset
    a, b = nodes(), nodes()
    src = tmp_path / "src"
    files = make_tree(src, 30, seed=4)
    stage(src, a.mnt / "datasets" / "cds")
    assert wait_for(lambda: sealed_on(b, "cds"), 10.0)
    paths = [p.decode() for p in np.load(b.mnt / "datasets" / "cds" / "index.npy")["path"]]
    with MountedDataset(b.mnt / "datasets" / "cds") as data:
        assert [data[i] for i in range(len(paths))] == [files[p] for p in paths]
        assert data._reader is not None and data._reader.counters["through_mount"] == len(paths)
    (a.mnt / "buffers" / "rb").mkdir()
    for i in range(8):
        with open(a.mnt / "buffers" / "rb" / "entries" / f"k{i}", "wb") as f:
            np.save(f, np.full(3, i, dtype=np.int64))
    bb = b.mnt / "buffers" / "rb" / "entries"
    assert wait_for(lambda: bb.is_dir() and len(os.listdir(bb)) == 8, 10.0)  # the buffer reaches b first
    with open_buffer(b.mnt / "buffers" / "rb") as buf:
        batch = buf.sample(16)
        assert len(batch["keys"]) == 16
        values = [v for k, v in batch.items() if k not in ("keys", "seqs", "probabilities", "weights")]
        assert len(values) == 1, list(batch)
        for key, row in zip(batch["keys"], values[0]):
            assert row.tolist() == [int(str(key)[1:])] * 3
        assert buf.counters["read_through_mount"] > 0  # type: ignore[union-attr]

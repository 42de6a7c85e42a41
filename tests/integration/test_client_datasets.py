"""Datasets beside the mount: MountedDataset reads item bytes from the store's files in its
own process (the same bytes as the files), and the ranks of a DDP job each declare their
part of an epoch and all get prefetch."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import numpy as np
import pytest

from distorefs.loader import MountedDataset
from distorefs_it import CLI, PYTHON


@pytest.fixture(scope="module")
def dataset(fs, tmp_path_factory):
    """400 files (one of 5 MB: two chunks), staged and sealed."""
    src = tmp_path_factory.mktemp("dsrc")
    rng = np.random.default_rng(3)
    files = {}
    for i in range(400):
        size = (5 << 20) + 17 if i == 7 else int(rng.integers(0, 20_000))
        data = (rng.integers(0, 256, size, dtype=np.uint8) if i % 2 else rng.integers(0, 4, size, dtype=np.uint8)).tobytes()
        rel = f"d{i % 5}/f{i:04d}.bin"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        files[rel] = data
    ds = fs.mnt / "datasets" / "beside"
    subprocess.run(CLI + ["stage", "-q", str(src), str(ds)], check=True, capture_output=True, timeout=600)
    return ds, files


def test_items_read_in_this_process_are_the_files(dataset):
    ds, files = dataset
    data = MountedDataset(ds, direct=True)
    before = json.loads((ds / "stats.json").read_bytes())["reads"]
    for i in range(len(data)):
        assert data[i] == files[data.index["path"][i].decode()], i
    reader = data._direct_reader()
    assert reader.counters == {"direct": len(files), "through_mount": 0}
    assert json.loads((ds / "stats.json").read_bytes())["reads"] == before  # the daemon read none of them
    assert "client" in os.listdir(ds)
    data.close()


def test_ddp_ranks_each_declare_their_part_and_all_get_prefetch(dataset):
    ds, files = dataset
    script = textwrap.dedent("""
        import sys
        from distorefs.loader import EpochSampler, MountedDataset
        rank, go = int(sys.argv[2]), sys.argv[3]
        data = MountedDataset(sys.argv[1], direct=False)
        sampler = EpochSampler(data, seed=9, rank=rank, world_size=2)
        order = sampler.order()
        data.declare(order)
        print("declared", flush=True)
        sys.stdin.readline()  # both ranks have declared before either reads
        for i in order.tolist():
            data[i]
        print("read", len(order), flush=True)
    """)
    before = json.loads((ds / "stats.json").read_bytes())["prefetch"]
    ranks = [subprocess.Popen([PYTHON, "-c", script, str(ds), str(r), "go"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for p in ranks:
            assert p.stdout.readline().strip() == "declared"
        for p in ranks:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in ranks:
            assert p.stdout.readline().split() == ["read", str(len(files) // 2)]
            assert p.wait(timeout=60) == 0
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    after = json.loads((ds / "stats.json").read_bytes())["prefetch"]
    opens = {k: after[k] - before[k] for k in ("hits", "late", "page_cache", "misses")}
    assert sum(opens.values()) == len(files), after
    assert opens["hits"] + opens["late"] + opens["page_cache"] >= 0.95 * len(files), (opens, after)


def test_a_caller_that_cannot_read_the_store_reads_through_the_mount(shared_mount, temp_user, tmp_path):
    from distorefs_it import in_child_as
    _name, uid, gid = temp_user
    m = shared_mount()
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"f{i}").write_bytes(bytes([i]) * (100 + i))
    os.chmod(tmp_path, 0o755)
    os.chmod(src, 0o755)
    ds = m.mnt / "datasets" / "shared"
    subprocess.run(CLI + ["stage", "-q", str(src), str(ds)], check=True, capture_output=True, timeout=120)

    def child(root: str) -> dict:
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = MountedDataset(root)
            items = [data[i] for i in range(len(data))]
        return {"warned": [str(w.message) for w in caught], "items": [x.hex() for x in items],
                "paths": [p.decode() for p in data.index["path"]]}

    out = in_child_as(uid, gid, child, str(ds))
    assert len(out["warned"]) == 1 and "through the mount" in out["warned"][0]
    assert [bytes.fromhex(x) for x in out["items"]] == [(src / p).read_bytes() for p in out["paths"]]


def test_nothing_is_read_ahead_while_a_process_reads_the_store_itself(dataset):
    """A declared order is read ahead for readers through the mount; while a process reads
    items from the store's files itself (a client session open), the daemon reads nothing
    ahead: it would only take the CPU from that reader."""
    ds, files = dataset
    stats = lambda: json.loads((ds / "stats.json").read_bytes())["prefetch"]  # noqa: E731
    order = np.random.default_rng(5).permutation(len(files))
    with MountedDataset(ds, direct=True) as data:
        assert data[0] == files[data.index["path"][0].decode()]  # the session is open
        data.declare(order)  # (orders of processes gone are dropped here, with their counts)
        before = stats()
        for i in order.tolist():
            assert data[i] == files[data.index["path"][i].decode()]
        after = stats()
        assert after["loaded"] == before["loaded"] == 0, (before, after)
        assert after["elsewhere"] == len(files)
    # Another process reading through the mount (not one of the client's own, nor an
    # ancestor of one) gets its order read ahead meanwhile.
    script = textwrap.dedent("""
        import sys, numpy as np
        from distorefs.loader import MountedDataset
        data = MountedDataset(sys.argv[1], direct=False)
        order = np.random.default_rng(6).permutation(len(data))
        data.declare(order)
        for i in order.tolist():
            data[i]
    """)
    with MountedDataset(ds, direct=True) as data:
        assert data[1] == files[data.index["path"][1].decode()]  # a client session open meanwhile
        before = stats()
        subprocess.run([PYTHON, "-c", script, str(ds)], check=True, timeout=120)
        after = stats()
    opens = {k: after[k] - before[k] for k in ("hits", "late", "page_cache")}
    assert sum(opens.values()) >= 0.9 * len(files), (opens, before, after)


def _vmflags(pid: int | str, path: str) -> list[str] | None:
    """The kernel's flags (smaps VmFlags) of process `pid`'s mapping of file `path`."""
    flags, mapping = None, None
    for line in open(f"/proc/{pid}/smaps").read().splitlines():
        if not line[:1].isupper() or ":" not in line.split()[0]:
            mapping = line.split()[-1] if len(line.split()) >= 6 else None
        elif line.startswith("VmFlags:") and mapping == path:
            flags = line.split()[1:]
    return flags


def test_the_store_file_is_read_around_each_fault(dataset, fs):
    """The client and the daemon map the store's LMDB file without MADV_RANDOM, so a cold
    item faults in with the kernel's read-around (one read) rather than page by page: the
    kernel's flags for the mapping (VmFlags `rr`: random reads advised) say which."""
    ds, files = dataset
    with MountedDataset(ds, direct=True) as data:
        assert data[3] == files[data.index["path"][3].decode()]
        mdb = os.path.realpath(data._direct_reader().reader.path / "data.mdb")
        for pid in ("self", fs.pid):
            flags = _vmflags(pid, mdb)
            assert flags is not None, f"{mdb} is not mapped by {pid}"
            assert "rr" not in flags, (pid, flags)


def test_the_tables_of_a_block_are_built_once_for_all_readers(dataset):
    """Every reader process of an epoch asks for the locations of every block of items: the
    daemon builds a block's tables once and hands them to the next reader as they are."""
    ds, files = dataset
    from distorefs import clientwire as wire
    from distorefs.client.items import DatasetItems

    def located(items: DatasetItems) -> dict:
        return items.channel.call(wire.frame(wire.STATS))[0]["located_blocks"]

    paths = [p.decode() for p in np.load(ds / "index.npy")["path"]]
    first, second = DatasetItems(ds), DatasetItems(ds)
    try:
        before = located(first)
        for i in range(len(files)):
            assert first.read(i) == files[paths[i]]
        middle = located(first)
        for i in reversed(range(len(files))):
            assert second.read(i) == files[paths[i]]
        after = located(second)
    finally:
        first.close()
        second.close()
    asked = lambda c: c["built"] + c["hits"]  # noqa: E731
    assert asked(middle) > asked(before)  # built here, or by an earlier test's reader
    assert after["built"] == middle["built"] and after["hits"] > middle["hits"], (before, middle, after)

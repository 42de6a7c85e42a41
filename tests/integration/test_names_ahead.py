"""Names ahead of a declared order (mount/namewarmer.py): declaring a dataset's `order`
makes the daemon list its items through the mount, so reads in that order cost no LOOKUP;
and a listing in progress never keeps the mount from going away."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from distorefs_it import CLI, is_mounted, mount_stats, pid_alive


def stage_tree(m, tmp_path: Path, name: str, count: int, size: int = 100) -> Path:
    src = tmp_path / f"src-{name}"
    for d in range(10):
        (src / f"d{d}").mkdir(parents=True)
    for i in range(count):
        (src / f"d{i % 10}" / f"f{i:06d}").write_bytes(i.to_bytes(4, "little") * (size // 4))
    ds = m.mnt / "datasets" / name
    subprocess.run(CLI + ["stage", "-q", str(src), str(ds)], check=True, capture_output=True, timeout=300)
    return ds


def declare(ds: Path, order: np.ndarray) -> None:
    with open(ds / "order", "wb") as f:
        np.save(f, order)


def test_reads_in_a_declared_order_find_their_names_listed_ahead(fresh_mount, tmp_path):
    m = fresh_mount()
    ds = stage_tree(m, tmp_path, "ahead", 300)
    m.remount()  # the kernel knows no item's name
    index = np.load(ds / "index.npy")
    order = np.random.default_rng(1).permutation(len(index)).astype(np.int64)
    declare(ds, order)
    deadline = time.monotonic() + 30
    while mount_stats(m)["names_listed"] < len(index) + 10:  # the items and their 10 directories
        assert time.monotonic() < deadline, mount_stats(m)
        time.sleep(0.05)
    before = mount_stats(m)["requests"].get("lookup", 0)
    for i in order:
        name = index["path"][i].decode()
        assert (ds / "items" / name).read_bytes()[:4] == int(name[-6:]).to_bytes(4, "little")
    after = mount_stats(m)["requests"].get("lookup", 0)
    assert after - before <= 2, f"{after - before} LOOKUPs for {len(order)} reads"  # stats.json's own


def test_an_unmount_during_a_listing_waits_for_it_and_leaves_nothing_behind(fresh_mount, tmp_path):
    m = fresh_mount()
    ds = stage_tree(m, tmp_path, "busy", 20_000, size=8)
    for attempt in range(3):
        m.remount()
        declare(ds, np.arange(20_000, dtype=np.int64))  # a listing of 20,000 names starts
        pid = m.pid
        m.umount()  # `distorefs umount` succeeds: asserts the mount and the daemon are gone
        assert not pid_alive(pid)
        m.mount()
        assert json.loads((ds / "stats.json").read_bytes())["items"] == 20_000


def test_a_daemon_stopped_by_a_signal_during_a_listing_unmounts(fresh_mount, tmp_path):
    m = fresh_mount()
    ds = stage_tree(m, tmp_path, "signalled", 20_000, size=8)
    m.remount()
    declare(ds, np.arange(20_000, dtype=np.int64))
    pid = m.pid
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)
    assert not is_mounted(m.mnt), m.log_tail()
    m.pid = None
    m.mount()
    assert json.loads((ds / "stats.json").read_bytes())["items"] == 20_000

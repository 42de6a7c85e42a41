"""Benchmarks are good neighbours (issue 15): the host's page cache is dropped only when
asked (--drop-caches), and an interrupted benchmark (SIGTERM, SIGINT) unmounts what it
mounted."""

from __future__ import annotations

import io
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distorefs.tools import bench_buffers
from distorefs.tools.mounts import mountpoints_under
from distorefs_it import CLI


def _mounts_under(root: Path) -> list[str]:
    return [str(p) for p in mountpoints_under(root)]


def test_page_cache_is_dropped_only_when_asked(monkeypatch):
    opened: list[str] = []

    def fake_open(path, *args, **kwargs):
        opened.append(str(path))
        return io.StringIO()  # never the real /proc/sys/vm/drop_caches

    monkeypatch.setattr(bench_buffers, "open", fake_open, raising=False)
    monkeypatch.setattr(bench_buffers.os, "sync", lambda: None)
    monkeypatch.setattr(bench_buffers, "DROP_CACHES", False, raising=False)
    notes: list[str] = []
    assert bench_buffers._drop_caches(notes) is False
    assert "/proc/sys/vm/drop_caches" not in opened
    assert any("--drop-caches" in n for n in notes), notes
    monkeypatch.setattr(bench_buffers, "DROP_CACHES", True)
    assert bench_buffers._drop_caches([]) is True
    assert opened == ["/proc/sys/vm/drop_caches"]


def test_an_interrupted_benchmark_unmounts_what_it_mounted(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.Popen(CLI + ["bench", "datasets", "--quick", "--workdir", str(work), "--out",
                                   str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not _mounts_under(work) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert _mounts_under(work), f"the benchmark never mounted: {proc.poll()}"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, f"{proc.returncode}\n{out[-2000:]}"
        assert not _mounts_under(work), f"left mounted: {_mounts_under(work)}\n{out[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for mnt in _mounts_under(work):  # only what this test's benchmark left (under its own dir)
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)


def test_a_workdir_with_a_live_mount_is_never_removed(fresh_mount):
    m = fresh_mount()
    (m.mnt / "buffers" / "kept").mkdir()
    errors: list[str] = []
    bench_buffers.remove_workdir(m.root, errors)
    assert (m.mnt / "buffers" / "kept").is_dir() and (m.root / "store").is_dir()  # nothing deleted through it
    assert errors == [f"left {m.root} in place: still mounted: {m.mnt}"]
    m.umount()
    bench_buffers.remove_workdir(m.root, errors)
    assert not m.root.exists() and len(errors) == 1


@pytest.mark.parametrize("after", [0.4, 0.7, 1.0])
def test_ctrl_c_twice_while_mounting_leaves_no_mount(tmp_path, after):
    """Two SIGINTs (an impatient Ctrl-C) while `distorefs mount` runs: the command is
    killed, the daemon it started goes on; the benchmark waits for that daemon and takes
    its mount down instead of leaving it to appear afterwards."""
    work = tmp_path / "work"
    proc = subprocess.Popen(CLI + ["bench", "datasets", "--quick", "--workdir", str(work), "--out",
                                   str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list(work.glob("*/mnt")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)  # the mount point is made just before the mount command runs
        assert list(work.glob("*/mnt")), f"the benchmark never began to mount: {proc.poll()}"
        time.sleep(after)  # the command has started its daemon, whose mount is not up yet
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGINT, f"{proc.returncode}\n{out[-2000:]}"
        time.sleep(2)  # what a daemon still starting would take to appear
        assert not _mounts_under(work), f"left mounted: {_mounts_under(work)}\n{out[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for mnt in _mounts_under(work):
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)

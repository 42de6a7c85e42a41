"""Operating the mount (issue 15): the daemon starts the same from any directory and
works from `/`; `distorefs status` answers despite a hung mount; `distorefs umount` of a
busy mount says who holds it and suggests --lazy; an idle daemon's event loop sleeps."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from distorefs_it import CLI, Mount, is_mounted

DISTOREFS = str(Path(sys.executable).parent / "distorefs")  # the installed command


def test_mount_from_a_directory_holding_a_distorefs_folder(tmp_path):
    work = tmp_path / "checkout"
    (work / "distorefs").mkdir(parents=True)  # like the repository root
    (work / "distorefs" / "__init__.py").write_text("raise ImportError('the checkout, not the package')\n")
    (work / "mnt").mkdir()
    res = subprocess.run([DISTOREFS, "mount", "store", "mnt"], cwd=work, capture_output=True, text=True, timeout=90)
    m = Mount(work)  # the same store and mount point, for cleanup
    pid = re.search(r"daemon pid (\d+)", res.stdout)
    if pid:
        m.pids.add(int(pid.group(1)))
    try:
        assert res.returncode == 0, res
        m.pid = int(pid.group(1))
        assert os.readlink(f"/proc/{m.pid}/cwd") == "/"
        assert (work / "mnt" / ".distorefs" / "version").read_text().startswith("distorefs")
        assert (work / "store" / "daemon.log").exists()
        m.umount()
    finally:
        m.cleanup()


def test_status_answers_while_a_mount_hangs(fresh_mount):
    m = fresh_mount()
    os.kill(m.pid, signal.SIGSTOP)  # a hung daemon: every request to it waits
    try:
        status = subprocess.Popen(CLI + ["status"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            out, err = status.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(m.pid, signal.SIGCONT)  # let the stuck status go before failing
            status.communicate(timeout=60)
            raise AssertionError("distorefs status hung on a mount that does not answer") from None
        assert status.returncode == 0, err
        line = [x for x in out.splitlines() if str(m.mnt) in x]
        assert line and "not responding" in line[0], out
    finally:
        os.kill(m.pid, signal.SIGCONT)
    res = subprocess.run(CLI + ["status"], capture_output=True, text=True, timeout=60)
    assert [x for x in res.stdout.splitlines() if str(m.mnt) in x and "health=ok" in x], res.stdout


def test_umount_of_a_busy_mount_says_who_holds_it(fresh_mount):
    m = fresh_mount()
    sleeper = subprocess.Popen(["sleep", "300"], cwd=m.mnt / "buffers")
    try:
        res = subprocess.run(CLI + ["umount", str(m.mnt)], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and is_mounted(m.mnt)
        assert f"pid {sleeper.pid} (sleep)" in res.stderr and "--lazy" in res.stderr, res.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
    m.umount()


def _voluntary_switches(tid: int) -> int:
    status = Path(f"/proc/{tid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")).split()[1])


def test_an_idle_mount_wakes_its_event_loop_rarely(fresh_mount):
    """An idle daemon's event loop (its main thread) sleeps: the checkpoint sealer ticks only
    while a step is unsealed or the buffer pool's buffers are due, and the look for the
    front's notes waits longer while it finds none. Before, they woke it 20 and 10 times a
    second on a mount nobody used (this test counted 69 in 3 s), each turn costing CPU."""
    m = fresh_mount()
    step = m.mnt / "checkpoints" / "run" / "step-1"
    step.mkdir(parents=True)
    (step / "w.bin").write_bytes(b"x" * 4096)  # a step written and sealed: the sealer idles again
    fd = os.open(step, os.O_RDONLY)
    try:
        os.fsync(fd)  # (closes the step: it completes)
    finally:
        os.close(fd)
    time.sleep(2.0)  # the notes' wait grows to its longest
    before = _voluntary_switches(m.pid)
    time.sleep(3.0)
    woke = _voluntary_switches(m.pid) - before
    assert woke < 3.0 * 15, f"the idle daemon's event loop woke {woke} times in 3 s"

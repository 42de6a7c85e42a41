"""Every wait in the mount can be ended by the caller's signal (issue 15): a reader blocked
in `sample/N` (min_size_to_sample) or `.distorefs/wait` dies at kill -9 within seconds,
a Python reader's Ctrl-C (SIGINT) is delivered, and a reader nobody signals keeps waiting
and gets its answer. A min_size_to_sample that can never be met is refused."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import time

from distorefs_it import assert_errno, get_config, set_config, write_entry

PYTHON = sys.executable


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _waiting(proc: subprocess.Popen, seconds: float = 1.5) -> None:
    """Let the reader reach its wait in the daemon; it must still be there."""
    time.sleep(seconds)
    assert proc.poll() is None, proc.communicate()


def _ends_within(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_kill9_ends_a_reader_waiting_for_min_size_to_sample(fs):
    buf = fs.buffer("killable", {"min_size_to_sample": 3})
    readers = [subprocess.Popen(["cat", str(buf / "sample" / "2")], stdout=subprocess.PIPE, stderr=subprocess.PIPE),
               subprocess.Popen([PYTHON, "-c", f"import numpy as np; np.load('{buf}/batch/2.npz')"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    try:
        for proc in readers:
            _waiting(proc)
            assert _state(proc.pid) in ("D", "S"), _state(proc.pid)
            proc.kill()
        ended = [_ends_within(proc, 5) for proc in readers]
        assert ended == [True, True], [_state(p.pid) for p in readers]
        assert fs.alive()
    finally:
        for i in range(3):  # old daemons: the wait ends only when the condition comes true
            write_entry(buf, f"e{i}", b"x")
        for proc in readers:
            proc.kill()
            proc.wait(timeout=30)


def _default_sigint() -> None:
    # A shell's background job (`make test &`, CI runners) starts with SIGINT ignored, which
    # children inherit and Python then leaves alone (no KeyboardInterrupt): the reader Ctrl-C
    # is sent to must take it as a terminal's foreground process does.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_kill9_and_sigint_end_a_reader_of_distorefs_wait(fs):
    (fs.mnt / "weights" / "m").mkdir(exist_ok=True)
    (fs.mnt / "weights" / "m" / "w.bin").write_bytes(b"v1")
    script = (f"with open('{fs.mnt}/.distorefs/wait', 'r+b', buffering=0) as w:\n"
              f"    w.write(b'm/w.bin 1\\n')\n"
              f"    print(int(w.read()))\n")
    killed = subprocess.Popen([PYTHON, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    interrupted = subprocess.Popen([PYTHON, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=_default_sigint)
    patient = subprocess.Popen([PYTHON, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for proc in (killed, interrupted, patient):
            _waiting(proc)
        killed.kill()
        interrupted.send_signal(signal.SIGINT)
        assert _ends_within(killed, 5), _state(killed.pid)
        assert _ends_within(interrupted, 5), _state(interrupted.pid)
        assert "KeyboardInterrupt" in interrupted.stderr.read()
        # the one nobody signals is still waiting after several of the daemon's wake-ups
        time.sleep(1.5)
        assert patient.poll() is None
        (fs.mnt / "weights" / "m" / "w.bin").write_bytes(b"v2")
        out, err = patient.communicate(timeout=30)
        assert patient.returncode == 0 and out.strip() == "2", err
    finally:
        (fs.mnt / "weights" / "m" / "w.bin").write_bytes(b"v3")  # old daemons: let every waiter go
        for proc in (killed, interrupted, patient):
            proc.kill()
            proc.wait(timeout=30)
    assert fs.alive()


def test_a_reader_nobody_signals_waits_and_gets_its_batch(buf):
    set_config(buf, {"min_size_to_sample": 2})
    proc = subprocess.Popen(["cat", str(buf / "sample" / "2")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _waiting(proc, 2.0)  # four of the daemon's wake-ups
        write_entry(buf, "a", b"1")
        write_entry(buf, "b", b"2")
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and len(out.splitlines()) == 2, err
    finally:
        proc.kill()


def test_min_size_to_sample_above_capacity_is_refused(buf):
    assert_errno(errno.EINVAL, set_config, buf, {"capacity": 10, "min_size_to_sample": 11})
    set_config(buf, {"capacity": 10, "min_size_to_sample": 10})
    assert_errno(errno.EINVAL, set_config, buf, {"capacity": 9})  # would strand min_size_to_sample
    assert get_config(buf)["min_size_to_sample"] == 10 and get_config(buf)["capacity"] == 10

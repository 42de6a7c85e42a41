"""The sample-to-insert rate limiter (issue 17) through a real mount: `samples_per_insert` and
`error_buffer` in config.json hold actors (creates of new entries) and learners (opens of
sample/N and batch/N.npz) to the ratio; O_NONBLOCK gives EAGAIN on both sides; a waiting
caller goes when the other side moves, when the configuration changes, or when it is killed
or interrupted; stats.json counts it all; the client beside the mount is held the same way;
counting starts over at a remount."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from distorefs.client import open_buffer
from distorefs_it import assert_errno, entry_names, get_config, get_stats, set_config, write_entry
from test_waits import _default_sigint, _ends_within, _waiting

PYTHON = sys.executable
README = Path(__file__).resolve().parents[2] / "README.md"
LIMITED = {"min_size_to_sample": 2, "samples_per_insert": 1, "error_buffer": 2}  # error kept in [0, 4]


def _create(buf, key: str, nonblocking: bool = False, data: bytes = b"x") -> None:
    """A new entry as an actor makes one: create, write, close."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_NONBLOCK if nonblocking else 0)
    fd = os.open(buf / "entries" / key, flags, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _draw(buf, n: int, nonblocking: bool = False) -> list[str]:
    """The keys of one `sample/N` draw."""
    fd = os.open(buf / "sample" / str(n), os.O_RDONLY | (os.O_NONBLOCK if nonblocking else 0))
    with os.fdopen(fd, "rb") as f:
        return [line.split()[0].decode() for line in f.read().splitlines()]


def _limiter(buf) -> dict:
    return get_stats(buf)["rate_limiter"]


def _writer(buf, key: str, **popen) -> subprocess.Popen:
    """An actor process that creates entries/KEY (held back, it waits in its write)."""
    return subprocess.Popen([PYTHON, "-c", f"with open({str(buf / 'entries' / key)!r}, 'wb') as f:\n    f.write(b'w')"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_actors_and_learners_are_held_to_the_ratio_and_nonblocking_calls_get_eagain(buf):
    assert get_stats(buf)["rate_limiter"] is None  # off by default
    set_config(buf, LIMITED)
    for i in range(4):  # 2 below min_size_to_sample, then 2 more: the error at the top (4)
        _create(buf, f"e{i}", nonblocking=True)
    assert_errno(errno.EAGAIN, _create, buf, "e4", nonblocking=True)
    assert "e4" not in entry_names(buf)  # refused at the create: nothing of it exists
    _create(buf, "e0", nonblocking=True, data=b"rewritten")  # a rewrite is no insert: never held back
    with os.fdopen(os.open(buf / "batch" / "3.npz", os.O_RDONLY | os.O_NONBLOCK), "rb") as f, np.load(f) as z:
        assert len(z["keys"]) == 3  # the error: 1
    assert_errno(errno.EAGAIN, _draw, buf, 2, nonblocking=True)  # would take it below 0
    assert len(_draw(buf, 1, nonblocking=True)) == 1  # 0: the bottom
    _create(buf, "e4", nonblocking=True)  # room again
    s = _limiter(buf)
    assert (s["inserts"], s["samples"], s["ratio"], s["error"]) == (5, 4, 0.8, 1.0)
    assert (s["samples_per_insert"], s["error_buffer"], s["min_error"], s["max_error"]) == (1.0, 2.0, 0.0, 4.0)
    assert s["insert"]["eagain"] == 1 and s["sample"]["eagain"] == 1
    assert s["insert"]["waits"] == s["sample"]["waits"] == 0 and s["admitted_inserts"] == 0
    with open(buf / "entries" / "e0", "rb") as f:
        assert f.read() == b"rewritten"


def test_a_waiting_actor_goes_when_the_learner_samples_and_a_waiting_learner_when_an_actor_inserts(buf):
    set_config(buf, {"min_size_to_sample": 1, "samples_per_insert": 1, "error_buffer": 1})  # [0, 2]
    write_entry(buf, "e0", b"0")
    write_entry(buf, "e1", b"1")  # the top
    actor = _writer(buf, "e2")
    learner = None
    try:
        _waiting(actor)
        assert "e2" not in entry_names(buf) and _limiter(buf)["insert"]["waiting"] == 1
        assert len(_draw(buf, 2)) == 2  # the error: 0, room for the actor's insert
        out, err = actor.communicate(timeout=30)
        assert actor.returncode == 0, err
        assert "e2" in entry_names(buf)
        assert len(_draw(buf, 1)) == 1  # 0 again: the learner is ahead
        learner = subprocess.Popen(["cat", str(buf / "sample" / "1")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        _waiting(learner)
        write_entry(buf, "e3", b"3")
        out, err = learner.communicate(timeout=30)
        assert learner.returncode == 0 and len(out.splitlines()) == 1, err
    finally:
        for proc in (actor, learner):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=30)
    s = _limiter(buf)
    assert s["insert"]["waits"] == 1 and s["sample"]["waits"] == 1
    assert s["insert"]["wait_seconds"] > 0 and s["sample"]["wait_seconds"] > 0
    assert s["insert"]["waiting"] == s["sample"]["waiting"] == 0
    assert (s["inserts"], s["samples"]) == (4, 4)


def test_kill9_and_sigint_end_an_actor_held_back_and_leave_nothing(buf):
    set_config(buf, {"min_size_to_sample": 1, "samples_per_insert": 1, "error_buffer": 1})
    write_entry(buf, "e0", b"0")
    write_entry(buf, "e1", b"1")
    killed = subprocess.Popen(["sh", "-c", f"echo x > '{buf / 'entries' / 'shell'}'"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    interrupted = _writer(buf, "python", preexec_fn=_default_sigint)
    try:
        for proc in (killed, interrupted):
            _waiting(proc)
        assert _limiter(buf)["insert"]["waiting"] == 2
        killed.kill()
        interrupted.send_signal(signal.SIGINT)
        assert _ends_within(killed, 5) and _ends_within(interrupted, 5)
        assert "KeyboardInterrupt" in interrupted.stderr.read()
    finally:
        for proc in (killed, interrupted):
            proc.kill()
            proc.wait(timeout=30)
    s = _limiter(buf)
    assert s["insert"]["waiting"] == 0 and s["admitted_inserts"] == 0 and s["inserts"] == 2
    assert sorted(entry_names(buf)) == ["e0", "e1"]
    _draw(buf, 1)
    _create(buf, "after", nonblocking=True)  # the two that gave up took no room


def test_a_new_configuration_applies_to_the_callers_waiting(buf):
    set_config(buf, {"min_size_to_sample": 1, "samples_per_insert": 2, "error_buffer": 2})  # [0, 4]
    write_entry(buf, "e0", b"0")
    write_entry(buf, "e1", b"1")  # 4: the top
    actor = _writer(buf, "e2")
    try:
        _waiting(actor)
        set_config(buf, {"error_buffer": 10})  # counting starts over (error 2), the range is [-8, 12]
        out, err = actor.communicate(timeout=30)
        assert actor.returncode == 0, err
    finally:
        actor.kill()
        actor.wait(timeout=30)
    s = _limiter(buf)
    assert (s["inserts"], s["samples"], s["max_error"]) == (2, 0, 12.0)
    set_config(buf, {"error_buffer": 2})  # [0, 4] again, from 1 insert: error 2
    _draw(buf, 2, nonblocking=True)  # 0
    learner = subprocess.Popen(["cat", str(buf / "sample" / "1")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        _waiting(learner)
        set_config(buf, {"samples_per_insert": 0})  # no limiter: nobody waits for it
        out, err = learner.communicate(timeout=30)
        assert learner.returncode == 0 and len(out.splitlines()) == 1, err
    finally:
        learner.kill()
        learner.wait(timeout=30)
    assert _limiter(buf) is None
    for i in range(10):
        _create(buf, f"free{i}", nonblocking=True)


def test_an_error_buffer_too_small_is_refused_and_the_old_configuration_kept(fs, buf):
    set_config(buf, LIMITED)
    assert_errno(errno.EINVAL, set_config, buf, {"samples_per_insert": 4})  # error_buffer 2 < 4
    assert_errno(errno.EINVAL, set_config, buf, {"error_buffer": 0.5})  # < max(1, 1)
    config = get_config(buf)
    assert (config["samples_per_insert"], config["error_buffer"]) == (1.0, 2.0)
    assert "error_buffer must be >= max(1, samples_per_insert) = 4" in fs.log()


def test_counting_starts_over_at_a_remount(fresh_mount):
    m = fresh_mount()
    buf = m.buffer("b", {"min_size_to_sample": 3, "samples_per_insert": 2, "error_buffer": 2})  # [4, 8]
    for i in range(4):
        _create(buf, f"e{i}", nonblocking=True)  # 3 free, then 8: the top
    assert_errno(errno.EAGAIN, _create, buf, "e4", nonblocking=True)
    m.remount()
    s = _limiter(buf)
    # the 4 entries held count as min(4, 3) inserts and no samples: the middle of the range
    assert (s["inserts"], s["samples"], s["error"]) == (3, 0, 6.0)
    assert s["insert"]["eagain"] == 0  # a new daemon: new totals
    _create(buf, "e4", nonblocking=True)
    assert_errno(errno.EAGAIN, _create, buf, "e5", nonblocking=True)


def test_the_client_is_held_to_the_ratio_too(buf):
    set_config(buf, {"min_size_to_sample": 1, "samples_per_insert": 1, "error_buffer": 1})  # [0, 2]
    actor = open_buffer(str(buf), direct=True)
    learner = open_buffer(str(buf), direct=True)
    try:
        actor.insert_many({"c0": b"0", "c1": b"1"})
        assert actor.flush() == 2  # the top
        with pytest.raises(BlockingIOError):
            learner.sample(3, nonblocking=True)  # 2 - 3 < 0
        flushed: list = []
        thread = threading.Thread(target=lambda: (actor.insert("c2", b"2"), flushed.append(actor.flush())))
        thread.start()
        thread.join(1.5)
        assert thread.is_alive() and "c2" not in entry_names(buf)  # the actor's write waits in the daemon
        assert len(learner.sample(2)["keys"]) == 2  # 0: room for one insert
        thread.join(30)
        assert flushed == [1] and "c2" in entry_names(buf)
        s = learner.stats()["rate_limiter"]
        assert (s["inserts"], s["samples"], s["insert"]["waits"], s["sample"]["eagain"]) == (3, 2, 1, 1)
    finally:
        actor.close()
        learner.close()
    assert json.loads((buf / "stats.json").read_bytes())["rate_limiter"]["admitted_inserts"] == 0


def test_the_readme_example_runs_as_written(fs, capsys):
    text = README.read_text()
    section = text[text.index("### Rate limiter ("):]
    section = section[:section.index("\n### ", 3)]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {}
    exec(compile(code.replace("/mnt/rl", str(fs.mnt)), "README.md", "exec"), scope)  # noqa: S102 - the README's code
    assert (scope["inserted"], scope["batches"]) == (72, 4)
    assert capsys.readouterr().out.split() == ["72", "4", "0.8889", "1", "1"]  # what its comment says

"""A model-based random test: hypothesis drives POSIX calls (create, write at offsets, append,
truncate, rename, unlink, read) on buffer entries and weights files of a real mount, and
after every step compares the mount with a model of what POSIX says it must hold,
including the FIFO order `entries/` lists (a rewrite or a rename keeps the position).

DISTOREFS_MODEL_EXAMPLES (default 25) sets the number of runs of up to 30 steps each.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

EXAMPLES = int(os.environ.get("DISTOREFS_MODEL_EXAMPLES", "25"))
KEYS = st.sampled_from(["a", "b", "c", "d", "e.npy", "f with space"])
WFILES = st.sampled_from(["w.bin", "x.bin", "sub/w.bin", "sub/y.bin"])
# Data is never empty: an entry created and never written appears at release, a moment
# after close() (README, Behaviour), which a model checking right after close cannot know.
DATA = st.one_of(st.binary(min_size=1, max_size=3000),
                 st.integers(1, 3).map(lambda k: bytes([k]) * (600 << 10 + k)))  # big: segment files
OFFSETS = st.integers(0, 5000)

_counter = itertools.count()
_steps = itertools.count()


def _errno(fn, *args) -> int:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    return 0


class Posix(RuleBasedStateMachine):
    mnt: Path = Path("/nonexistent")

    def __init__(self) -> None:
        super().__init__()
        n = next(_counter)
        self.buf = self.mnt / "buffers" / f"model{n}"
        self.buf.mkdir()
        self.entries = self.buf / "entries"
        self.wdir = self.mnt / "weights" / f"model{n}"
        (self.wdir / "sub").mkdir(parents=True)
        self.order: list[str] = []  # entry keys, oldest first
        self.data: dict[str, bytes] = {}
        self.files: dict[str, bytes] = {}

    # ----- buffer entries ---------------------------------------------------------------

    def _put(self, key: str, value: bytes) -> None:
        if key not in self.data:
            self.order.append(key)
        self.data[key] = value

    @rule(key=KEYS, data=DATA)
    def write_whole(self, key, data):
        next(_steps)
        with open(self.entries / key, "wb") as f:
            f.write(data)
        self._put(key, data)

    @rule(key=KEYS, data=DATA, offset=OFFSETS)
    def write_at(self, key, data, offset):
        next(_steps)
        if key not in self.data:
            assert _errno(open, self.entries / key, "r+b") == errno.ENOENT
            return
        with open(self.entries / key, "r+b") as f:
            f.seek(offset)
            f.write(data)
        old = self.data[key]
        old = old + bytes(max(0, offset - len(old)))
        self._put(key, old[:offset] + data + old[offset + len(data):])

    @rule(key=KEYS, data=DATA)
    def append(self, key, data):
        next(_steps)
        with open(self.entries / key, "ab") as f:
            f.write(data)
        self._put(key, self.data.get(key, b"") + data)

    @rule(key=KEYS, size=st.integers(0, 4000))
    def truncate(self, key, size):
        next(_steps)
        if key not in self.data:
            assert _errno(os.truncate, self.entries / key, size) == errno.ENOENT
            return
        os.truncate(self.entries / key, size)
        old = self.data[key]
        self._put(key, old[:size] + bytes(max(0, size - len(old))))

    @rule(src=KEYS, dst=KEYS)
    def rename(self, src, dst):
        next(_steps)
        if src not in self.data:
            assert _errno(os.rename, self.entries / src, self.entries / dst) == errno.ENOENT
            return
        os.rename(self.entries / src, self.entries / dst)
        if src == dst:
            return
        if dst in self.data:
            self.order.remove(dst)
        self.order[self.order.index(src)] = dst  # the renamed entry keeps its FIFO position
        self.data[dst] = self.data.pop(src)

    @rule(key=KEYS)
    def unlink(self, key):
        next(_steps)
        if key not in self.data:
            assert _errno(os.unlink, self.entries / key) == errno.ENOENT
            return
        os.unlink(self.entries / key)
        self.order.remove(key)
        del self.data[key]

    @rule(key=KEYS)
    def read(self, key):
        next(_steps)
        if key not in self.data:
            assert _errno(open, self.entries / key, "rb") == errno.ENOENT
            return
        with open(self.entries / key, "rb") as f:
            assert f.read() == self.data[key]
        assert os.stat(self.entries / key).st_size == len(self.data[key])

    @precondition(lambda self: self.order)
    @rule(pick=st.integers(0, 100))
    def read_by_xattrs(self, pick):
        next(_steps)
        key = self.order[pick % len(self.order)]
        seqs = [int(os.getxattr(self.entries / k, "user.distorefs.seq")) for k in self.order]
        assert seqs == sorted(seqs), "FIFO order and sequence numbers disagree"
        assert int(os.getxattr(self.entries / key, "user.distorefs.size")) == len(self.data[key])

    # ----- weights files --------------------------------------------------------------

    @rule(path=WFILES, data=DATA)
    def publish(self, path, data):
        next(_steps)
        with open(self.wdir / path, "wb") as f:
            f.write(data)
        self.files[path] = data

    @rule(path=WFILES, data=DATA, offset=OFFSETS)
    def wwrite_at(self, path, data, offset):
        next(_steps)
        if path not in self.files:
            assert _errno(open, self.wdir / path, "r+b") == errno.ENOENT
            return
        with open(self.wdir / path, "r+b") as f:
            f.seek(offset)
            f.write(data)
        old = self.files[path] + bytes(max(0, offset - len(self.files[path])))
        self.files[path] = old[:offset] + data + old[offset + len(data):]

    @rule(src=WFILES, dst=WFILES)
    def wrename(self, src, dst):
        next(_steps)
        if src not in self.files:
            assert _errno(os.rename, self.wdir / src, self.wdir / dst) == errno.ENOENT
            return
        os.rename(self.wdir / src, self.wdir / dst)
        if src != dst:
            self.files[dst] = self.files.pop(src)

    @rule(path=WFILES)
    def wunlink(self, path):
        next(_steps)
        if path not in self.files:
            assert _errno(os.unlink, self.wdir / path) == errno.ENOENT
            return
        os.unlink(self.wdir / path)
        del self.files[path]

    @rule(path=WFILES)
    def wread(self, path):
        next(_steps)
        if path not in self.files:
            assert _errno(open, self.wdir / path, "rb") == errno.ENOENT
            return
        assert (self.wdir / path).read_bytes() == self.files[path]

    # ----- the whole namespace --------------------------------------------------------

    @invariant()
    def listings_match(self):
        assert os.listdir(self.entries) == self.order
        stats = json.loads((self.buf / "stats.json").read_bytes())
        assert stats["entries"] == len(self.order) and stats["bytes"] == sum(map(len, self.data.values()))
        listed = {f for f in os.listdir(self.wdir) if f != "sub"} | {f"sub/{f}" for f in os.listdir(self.wdir / "sub")}
        assert listed == set(self.files)

    def teardown(self):
        for key in list(self.data):
            os.unlink(self.entries / key)
        os.rmdir(self.buf)
        for path in sorted(self.files, key=len, reverse=True):
            os.unlink(self.wdir / path)
        os.rmdir(self.wdir / "sub")
        os.rmdir(self.wdir)


@pytest.mark.timeout(120 + 2 * EXAMPLES)
def test_posix_model(fs):
    Posix.mnt = fs.mnt
    start = next(_steps)
    run_state_machine_as_test(Posix, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=30, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]))
    steps = next(_steps) - start - 1
    print(f"\nmodel-based test: {steps} POSIX operations in {EXAMPLES} runs, each checked against the model")
    assert steps > 0

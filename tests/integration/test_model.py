"""A model-based random test: hypothesis drives POSIX calls (create, write at offsets, append,
truncate, rename, unlink, read) on buffer entries and weights files of a real mount, and
after every step compares the mount with a model of what POSIX says it must hold,
including the FIFO order `entries/` lists (a rewrite or a rename keeps the position).

DISTOREFS_MODEL_EXAMPLES (default 25) sets the number of runs of up to 30 steps each.
"""

from __future__ import annotations

import errno
import itertools
import stat
import subprocess
import sys
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


# ----- the general file trees against a plain directory ----------------------------------

TREE_NAMES = st.sampled_from(["a", "b", "c", "d/x", "d/y"])
TREE_DATA = st.one_of(st.binary(min_size=0, max_size=3000), st.integers(1, 3).map(lambda k: bytes([k]) * (70_000 * k)))
EXIT_WRITER = "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644); " \
              "os.write(fd, bytes.fromhex(sys.argv[2])); os._exit(0)"


def _outcome(fn, *args):
    """(result, errno) of fn(*args): the same call on the tree and on the plain directory."""
    try:
        return fn(*args), 0
    except OSError as exc:
        return None, exc.errno


class TreeModel(RuleBasedStateMachine):
    """Every operation issue 14 found broken, done on a tree of the mount and on a plain
    directory side by side; after every step both must hold the same names, bytes, sizes
    and modes (and the times utimes set)."""

    tree_kind = "weights"
    mnt: Path = Path("/nonexistent")
    ref_root: Path = Path("/nonexistent")

    def __init__(self) -> None:
        super().__init__()
        n = next(_counter)
        if self.tree_kind == "weights":
            self.tree = self.mnt / "weights" / f"tm{n}"
            self.tree.mkdir()
        elif self.tree_kind == "checkpoint":
            self.tree = self.mnt / "checkpoints" / f"tm{n}" / "step"
            self.tree.mkdir(parents=True)
        else:
            (self.mnt / "datasets" / f"tm{n}").mkdir()
            self.tree = self.mnt / "datasets" / f"tm{n}" / "items"
        self.ref = self.ref_root / f"tm{n}"
        self.ref.mkdir()
        for root in (self.tree, self.ref):
            (root / "d").mkdir()
        self.times: dict[str, int] = {}  # mtimes set by utimes, until the next write

    def both(self, fn, name, *args):
        got = [_outcome(fn, root / name, *args) for root in (self.tree, self.ref)]
        assert got[0][1] == got[1][1], f"{fn.__name__}({name}): errno {got[0][1]} on the tree, {got[1][1]} on disk"
        assert got[0][0] == got[1][0], f"{fn.__name__}({name}): {got[0][0]!r} on the tree, {got[1][0]!r} on disk"
        return got[0]

    def _changed(self, name):
        self.times.pop(name, None)

    @rule(name=TREE_NAMES, data=TREE_DATA)
    def write_whole(self, name, data):
        next(_steps)
        self.both(lambda p: p.write_bytes(data), name)
        self._changed(name)

    @rule(name=TREE_NAMES)
    def empty_file(self, name):
        next(_steps)
        self.both(lambda p: open(p, "wb").close(), name)
        self._changed(name)
        self.both(lambda p: os.path.basename(p) in os.listdir(os.path.dirname(p)), name)

    @rule(name=TREE_NAMES, data=TREE_DATA, offset=OFFSETS)
    def write_at(self, name, data, offset):
        next(_steps)

        def write(p):
            with open(p, "r+b") as f:
                f.seek(offset)
                f.write(data)
                f.flush()
                return os.fstat(f.fileno()).st_size
        self.both(write, name)
        self._changed(name)

    @rule(name=TREE_NAMES, data=TREE_DATA)
    def append_and_fstat(self, name, data):
        next(_steps)

        def append(p):
            with open(p, "ab") as f:
                f.write(data)
                f.flush()
                return os.fstat(f.fileno()).st_size, f.seek(0, os.SEEK_END)
        self.both(append, name)
        self._changed(name)

    @rule(name=TREE_NAMES, size=st.integers(0, 200_000))
    def truncate_by_path(self, name, size):
        next(_steps)
        self.both(os.truncate, name, size)
        self._changed(name)

    @rule(name=TREE_NAMES, t=st.integers(10**9, 2 * 10**18))
    def utimes(self, name, t):
        next(_steps)
        _, err = self.both(lambda p: os.utime(p, ns=(t, t)), name)
        if not err:
            self.times[name] = t

    @rule(name=TREE_NAMES, data=TREE_DATA, mode=st.sampled_from([0o600, 0o640, 0o755, 0o4755]),
          t=st.integers(10**9, 2 * 10**18))
    def attributes_before_close(self, name, data, mode, t):
        next(_steps)

        def write(p):
            fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                os.fchmod(fd, mode)
                os.fchown(fd, 1000, 1000)
                os.utime(fd, ns=(t, t))
            finally:
                os.close(fd)
        _, err = self.both(write, name)
        if not err:
            self.times[name] = t

    @rule(name=TREE_NAMES, data=TREE_DATA)
    def child_exits_without_close(self, name, data):
        next(_steps)
        self.both(lambda p: subprocess.run([sys.executable, "-c", EXIT_WRITER, str(p), data.hex()],
                                           check=True).returncode, name)
        self._changed(name)

    @rule(name=TREE_NAMES, data=TREE_DATA)
    def unlink_open_file(self, name, data):
        next(_steps)

        def unlink_open(p):
            # (reads before the concurrent write: a weights reader keeps the version it opened,
            # a dataset reader its copy; POSIX shows it the writer's bytes)
            with open(p, "rb") as r, open(p, "r+b") as w:
                os.unlink(p)
                head = r.read(100)
                w.write(data)
                w.flush()
                w.seek(0)
                return head, os.fstat(r.fileno()).st_nlink, os.fstat(w.fileno()).st_size
        self.both(unlink_open, name)
        self._changed(name)

    @rule(src=TREE_NAMES, dst=TREE_NAMES, data=TREE_DATA)
    def rename_open_file(self, src, dst, data):
        next(_steps)
        pairs = [(root / src, root / dst) for root in (self.tree, self.ref)]
        got = []
        for a, b in pairs:
            def run(a=a, b=b):
                with open(a, "r+b") as f:
                    f.write(data)
                    f.flush()
                    os.rename(a, b)  # over an open target too, when dst is open elsewhere
                    f.write(b"after")
                return None
            got.append(_outcome(run))
        assert got[0][1] == got[1][1], got
        for n in (src, dst):
            self._changed(n)

    @rule(src=TREE_NAMES, dst=TREE_NAMES)
    def rename_over_open_target(self, src, dst):
        next(_steps)
        outcomes = []
        for root in (self.tree, self.ref):
            def run(root=root):
                with open(root / dst, "rb") as held:
                    os.rename(root / src, root / dst)
                    return held.read()
            outcomes.append(_outcome(run))
        assert outcomes[0] == outcomes[1], outcomes
        for n in (src, dst):
            self._changed(n)

    @rule(name=TREE_NAMES, off=st.integers(0, 4000), data=st.binary(min_size=1, max_size=100))
    def shared_mmap_write(self, name, off, data):
        next(_steps)
        import mmap

        def mwrite(p):
            with open(p, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if off + len(data) > size:
                    return "short"
                m = mmap.mmap(f.fileno(), size)
                m[off:off + len(data)] = data
                m.flush()
                m.close()
                return "done"
        self.both(mwrite, name)
        self._changed(name)

    @rule(name=TREE_NAMES)
    def unlink(self, name):
        next(_steps)
        self.both(os.unlink, name)
        self._changed(name)

    @invariant()
    def trees_match(self):
        for sub in ("", "d"):
            names = sorted(os.listdir(self.tree / sub)) if sub else sorted(n for n in os.listdir(self.tree) if n != "d")
            ref = sorted(os.listdir(self.ref / sub)) if sub else sorted(n for n in os.listdir(self.ref) if n != "d")
            assert names == ref, (sub, names, ref)
            for n in names:
                rel = f"{sub}/{n}" if sub else n
                a, b = os.stat(self.tree / rel), os.stat(self.ref / rel)
                assert (self.tree / rel).read_bytes() == (self.ref / rel).read_bytes(), rel
                assert (a.st_size, stat.S_IMODE(a.st_mode), a.st_uid) == (b.st_size, stat.S_IMODE(b.st_mode), b.st_uid), rel
                if rel in self.times:
                    assert a.st_mtime_ns == self.times[rel] == b.st_mtime_ns, rel


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["weights", "checkpoint", "dataset"])
def test_file_tree_model(fs, tmp_path, kind):
    TreeModel.tree_kind, TreeModel.mnt, TreeModel.ref_root = kind, fs.mnt, tmp_path
    start = next(_steps)
    run_state_machine_as_test(TreeModel, settings=settings(
        max_examples=max(4, EXAMPLES // 3), stateful_step_count=25, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]))
    steps = next(_steps) - start - 1
    print(f"\nfile-tree model on {kind}: {steps} operations, each checked against a plain directory")
    assert steps > 0

"""Reliability through real mounts: a table of bad inputs (each with its errno, nothing lost,
daemon alive), a full disk (ENOSPC on a small tmpfs), a kill -9 crash harness (inserts,
samples, priority updates, weight publishes, checkpoint steps) checked against a log of
acknowledged operations (and `distorefs verify` and the recovery at mount after every
crash), concurrency stress with consistent stats, and permissions for another user.

DISTOREFS_CRASH_CYCLES (default 10) sets the crash cycles; e.g. 200 for a long run.
"""

from __future__ import annotations

import errno
import json
import mmap
import multiprocessing
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from distorefs_it import (CLI, Mount, assert_errno, entry_names, fsync_dir, get_config, get_stats, have_fuse,
                          is_mounted, make_payload, pid_alive, read_entry, set_config, verify_payload, write_entry,
                          xattr, small_tmpfs)

E = errno
# Names over 255 bytes: the core says EINVAL (DESIGN.md), the kernel ENAMETOOLONG where it checks first.
TOO_LONG = (errno.ENAMETOOLONG, errno.EINVAL)


def verify_cli(store: Path) -> dict:
    res = subprocess.run(list(CLI) + ["verify", "--json", str(store)], capture_output=True, text=True, timeout=120)
    try:
        report = json.loads(res.stdout)
    except ValueError:
        raise AssertionError(f"verify failed to run ({res.returncode}): {res.stdout}{res.stderr}")
    report["returncode"] = res.returncode
    return report


def assert_verify_clean(store: Path) -> dict:
    report = verify_cli(store)
    problems = [f for f in report["findings"] if f["kind"] in ("error", "leak")]
    assert report["returncode"] == 0 and not problems, json.dumps(problems[:5], indent=1)
    return report


# ----- a table of bad inputs ---------------------------------------------------------------

def _write(path, data=b"x", mode="wb"):
    with open(path, mode) as f:
        f.write(data)


def _config(path, text: bytes):
    """Write a whole config file; an invalid one fails at close()."""
    with open(path, "wb", buffering=0) as f:
        f.write(text)


def _priorities(buf, text: bytes):
    fd = os.open(buf / "priorities", os.O_WRONLY)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)


def _open_nonblock(path):
    os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _wait_request(mnt, text: bytes, read: bool):
    with open(mnt / ".distorefs" / "wait", "r+b", buffering=0) as f:
        if text:
            f.write(text)
        if read:
            f.read()


DEEP = b"[" * 100_000 + b"]" * 100_000


def bad_inputs(mnt: Path, buf: Path, bank: Path, empty: Path, model: Path, other: Path):
    """(label, call, expected errnos): every one must fail with one of them and change nothing."""
    long = "L" * 256
    return [
        # names
        ("bank entry name of 256 bytes", lambda: _write(bank / "entries" / long), TOO_LONG),
        ("weights file name of 256 bytes", lambda: _write(model / long), TOO_LONG),
        ("weights mkdir of 256 bytes", lambda: os.mkdir(model / long), TOO_LONG),
        ("bank name of 256 bytes", lambda: os.mkdir(mnt / "banks" / long), TOO_LONG),
        ("symlink target of 4096 bytes", lambda: os.symlink("t" * 4096, model / "lnk"), E.ENAMETOOLONG),
        ("rename an entry to 256 bytes", lambda: os.rename(bank / "entries" / "b0", bank / "entries" / long),
         TOO_LONG),
        # read-only paths and things that cannot be made there
        ("write .distorefs/version", lambda: _write(mnt / ".distorefs" / "version"), (E.EACCES, E.EROFS)),
        ("write .distorefs/config.json", lambda: _write(mnt / ".distorefs" / "config.json", b"{}"),
         (E.EACCES, E.EROFS)),
        ("write .distorefs/metrics", lambda: _write(mnt / ".distorefs" / "metrics"), (E.EACCES, E.EROFS)),
        ("write banks/NAME/stats.json", lambda: _write(bank / "stats.json"), (E.EACCES, E.EROFS)),
        ("truncate buffer stats.json", lambda: os.truncate(buf / "stats.json", 0), (E.EACCES, E.EROFS, E.EPERM)),
        ("write weights/stats.json", lambda: _write(mnt / "weights" / "stats.json"), (E.EACCES, E.EROFS)),
        ("write batch/2.npz", lambda: _write(buf / "batch" / "2.npz"), (E.EACCES, E.EROFS, E.EPERM)),
        ("create a file in banks/NAME/at/", lambda: _write(bank / "at" / "new"), (E.EACCES, E.EROFS, E.EPERM)),
        ("create a file in buffers/", lambda: _write(mnt / "buffers" / "f"), (E.EACCES, E.EROFS, E.EPERM)),
        ("symlink in entries/", lambda: os.symlink("b0", bank / "entries" / "lnk"), (E.EACCES, E.EPERM)),
        ("hard link of an entry", lambda: os.link(buf / "entries" / "keep0", buf / "entries" / "hard"),
         (E.EPERM, E.ENOSYS, E.EACCES)),
        ("mkfifo in entries/", lambda: os.mkfifo(buf / "entries" / "fifo"), (E.EPERM, E.ENOSYS, E.EACCES)),
        ("rename a buffer", lambda: os.rename(empty, mnt / "buffers" / "renamed"), (E.EACCES, E.EPERM, E.EXDEV)),
        ("setxattr on a directory", lambda: os.setxattr(buf, "user.distorefs.priority", b"1"),
         (E.EACCES, E.ENOTSUP)),
        ("priority xattr of a bank entry", lambda: os.setxattr(bank / "entries" / "b0", "user.distorefs.priority",
                                                               b"1"), (E.EACCES, E.ENOTSUP)),
        ("removexattr of seq", lambda: os.removexattr(buf / "entries" / "keep0", "user.distorefs.seq"),
         (E.EACCES, E.ENODATA)),
        # sizes
        ("bank entry over max_entry_bytes", lambda: _write(bank / "entries" / "huge", b"h" * 5000), E.EFBIG),
        ("weights config keep_versions 0", lambda: _config(mnt / "weights" / "config.json",
                                                            b'{"keep_versions": 0}'), E.EINVAL),
        # configuration
        ("buffer config: a JSON array", lambda: _config(buf / "config.json", b"[1, 2]"), E.EINVAL),
        ("buffer config: a string capacity", lambda: _config(buf / "config.json", b'{"capacity": "10"}'), E.EINVAL),
        ("buffer config: alpha -1", lambda: _config(buf / "config.json", b'{"alpha": -1}'), E.EINVAL),
        ("buffer config: beta 2", lambda: _config(buf / "config.json", b'{"beta": 2}'), E.EINVAL),
        ("buffer config: NaN", lambda: _config(buf / "config.json", b'{"alpha": NaN}'), E.EINVAL),
        ("buffer config: presample 65", lambda: _config(buf / "config.json", b'{"presample_batches": 65}'),
         E.EINVAL),
        ("buffer config: unknown sampler", lambda: _config(buf / "config.json", b'{"sampler": "random"}'), E.EINVAL),
        ("buffer config: not UTF-8", lambda: _config(buf / "config.json", b'{"\xff": 1}'), E.EINVAL),
        ("bank config: a buffer-only key", lambda: _config(bank / "config.json", b'{"sampler": "fifo"}'),
         E.EINVAL),
        ("bank config: compression level 99", lambda: _config(bank / "config.json",
                                                               b'{"compression_level": 99}'), E.EINVAL),
        # hostile input (issue 15)
        ("buffer config: JSON nested 100,000 deep", lambda: _config(buf / "config.json", DEEP), E.EINVAL),
        ("weights config: JSON nested 100,000 deep", lambda: _config(mnt / "weights" / "config.json", DEEP),
         E.EINVAL),
        ("checkpoints config: JSON nested 100,000 deep", lambda: _config(mnt / "checkpoints" / "config.json", DEEP),
         E.EINVAL),
        ("buffer config: min_size_to_sample above capacity",
         lambda: _config(buf / "config.json", b'{"capacity": 5, "min_size_to_sample": 6}'), E.EINVAL),
        ("buffer name not UTF-8", lambda: os.mkdir(os.path.join(os.fsencode(mnt / "buffers"), b"bad\xff\xfe")),
         E.EINVAL),
        ("bank name not UTF-8", lambda: os.mkdir(os.path.join(os.fsencode(mnt / "banks"), b"\xc3\x28")), E.EINVAL),
        ("dataset name not UTF-8", lambda: os.mkdir(os.path.join(os.fsencode(mnt / "datasets"), b"\xff")),
         E.EINVAL),
        ("priority 1e308 (its sum overflows)", lambda: _priorities(buf, b"keep0 1e308\n"), E.EINVAL),
        ("priority xattr 1e300", lambda: os.setxattr(buf / "entries" / "keep1", "user.distorefs.priority",
                                                     b"1e300"), E.EINVAL),
        ("buffer config: initial_priority 1e300", lambda: _config(buf / "config.json",
                                                                   b'{"initial_priority": 1e300}'), E.EINVAL),
        # priorities
        ("priority 1e400 (inf)", lambda: _priorities(buf, b"keep0 1e400\n"), E.EINVAL),
        ("priority -0.0001", lambda: _priorities(buf, b"keep1 -0.0001\n"), E.EINVAL),
        ("priority in hex", lambda: _priorities(buf, b"keep0 0x10\n"), E.EINVAL),
        ("good lines then a NaN line", lambda: _priorities(buf, b"keep0 9\nkeep1 9\nkeep2 NaN\n"), E.EINVAL),
        ("priority xattr '1e400'", lambda: os.setxattr(buf / "entries" / "keep0", "user.distorefs.priority",
                                                       b"1e400"), E.EINVAL),
        # sampling and positions
        ("sample/0", lambda: _read(buf / "sample" / "0"), E.EINVAL),
        ("sample/ over max_batch_entries", lambda: _read(buf / "sample" / "99999999"), E.EINVAL),
        ("sample/-1", lambda: _read(buf / "sample" / "-1"), E.ENOENT),
        ("sample/007", lambda: _read(buf / "sample" / "007"), E.ENOENT),
        ("batch/4 without .npz", lambda: _read(buf / "batch" / "4"), E.ENOENT),
        ("O_NONBLOCK sample of an empty buffer", lambda: _open_nonblock(empty / "sample" / "1"), E.EAGAIN),
        ("bank at/ past the end", lambda: _read(bank / "at" / "99"), E.ENOENT),
        ("bank at/-1", lambda: _read(bank / "at" / "-1"), E.ENOENT),
        # tree operations
        ("mkdir an existing buffer", lambda: os.mkdir(buf), E.EEXIST),
        ("rmdir a bank with entries", lambda: os.rmdir(bank), E.ENOTEMPTY),
        ("rename an entry to another buffer", lambda: os.rename(buf / "entries" / "keep0",
                                                                other / "entries" / "keep0"), E.EXDEV),
        ("rename a bank entry to a buffer", lambda: os.rename(bank / "entries" / "b0", buf / "entries" / "b0"),
         E.EXDEV),
        ("write over a weights directory", lambda: _write(model / "sub"), E.EISDIR),
        ("rmdir a non-empty weights dir", lambda: os.rmdir(model), E.ENOTEMPTY),
        ("unlink a weights directory", lambda: os.unlink(model / "sub"), (E.EISDIR, E.EPERM, E.EACCES)),
        ("move a weights dir into itself", lambda: os.rename(model, model / "sub" / "inner"), E.EINVAL),
        ("replace a weights dir by a file", lambda: os.rename(model / "w.bin", model / "sub"),
         (E.EISDIR, E.EACCES, E.EPERM)),
        ("wait: a request without a version", lambda: _wait_request(mnt, b"model/w.bin\n", False), E.EINVAL),
        ("wait: a read before any request", lambda: _wait_request(mnt, b"", True), E.EINVAL),
    ]


def test_bad_input_table(fresh_mount):
    m = fresh_mount()
    mnt = m.mnt
    buf = m.buffer("bad", {"max_entry_bytes": 1 << 20})
    other = m.buffer("other")
    empty = m.buffer("empty")
    bank = mnt / "banks" / "mem"
    bank.mkdir()
    set_config(bank, {"max_entry_bytes": 4096})
    keep = {f"keep{i}": make_payload(f"keep{i}", 2000 + 700 * i) for i in range(4)}
    for k, v in keep.items():
        write_entry(buf, k, v)
    write_entry(bank, "b0", b"bank zero")
    model = mnt / "weights" / "model"
    (model / "sub").mkdir(parents=True)
    (model / "w.bin").write_bytes(b"weights v1")
    os.setxattr(buf / "entries" / "keep0", "user.distorefs.priority", b"3")

    def snapshot():
        return {
            "buf": {k: read_entry(buf, k) for k in entry_names(buf)},
            "bank": {k: read_entry(bank, k) for k in entry_names(bank)},
            "prio": (buf / "priorities").read_text(),
            "configs": [get_config(buf), get_config(bank), get_config(mnt / "weights")],
            "weights": sorted(str(p.relative_to(model)) for p in model.rglob("*")),
            "w.bin": (model / "w.bin").read_bytes(),
            "buffers": sorted(os.listdir(mnt / "buffers")),
        }

    before = snapshot()
    cases = bad_inputs(mnt, buf, bank, empty, model, other)
    for label, call, expected in cases:
        try:
            assert_errno(expected, call)
        except BaseException as exc:
            raise AssertionError(f"{label}: {exc}") from None
        assert m.alive(), f"daemon gone after: {label}"
        assert snapshot() == before, f"something changed after: {label}"
    assert {k: verify_payload(v, k) for k, v in before["buf"].items()} == {k: True for k in keep}

    # inputs that look odd but are valid: accepted, and stored exactly
    odd = [b"\xff\xfe-not-utf8", b"with space and\nnewline", b"x" * 255, "ünïcødé".encode(), b"-leading-dash"]
    for name in odd:
        path = os.path.join(os.fsencode(buf / "entries"), name)
        with open(path, "wb") as f:
            f.write(name * 3)
        with open(path, "rb") as f:
            assert f.read() == name * 3
    listed = set(os.listdir(os.fsencode(buf / "entries")))
    assert set(odd) <= listed
    write_entry(buf, "empty-entry", b"")  # created, never written: appears at release, just after close
    deadline = time.monotonic() + 5
    while "empty-entry" not in entry_names(buf) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert read_entry(buf, "empty-entry") == b""
    # an O_DIRECT write (page-aligned buffer, as the kernel requires) commits like any other
    page = mmap.mmap(-1, 8192)
    page.write(b"D" * 8192)
    fd = os.open(buf / "entries" / "direct", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, page) == 8192
    finally:
        os.close(fd)
    assert read_entry(buf, "direct") == b"D" * 8192
    assert get_stats(buf)["entries"] == len(keep) + len(odd) + 2
    m.umount()
    assert_verify_clean(m.store)
    print(f"\nbad inputs: {len(cases)} refused with their errno, {len(odd) + 2} odd but valid accepted")


# ----- a full disk -------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (root only), unmounted afterwards."""
    with small_tmpfs(tmp_path / "disk", 64) as disk:
        yield disk


def test_full_disk_gives_enospc_and_keeps_everything_committed(small_disk):
    m = Mount(small_disk)
    try:
        m.mount("sync_interval=0.2", "segment_bytes=1048576")  # one big value per segment file
        b = m.buffer("full", {"compression": "none", "evict_when_full": False})
        (m.mnt / "weights" / "w.bin").write_bytes(b"v1")
        committed: dict[str, bytes] = {}
        failed = None
        for i in range(200):  # 1.5 MiB entries go to segment files: the disk fills near 64 MiB
            key = f"big{i:03d}"
            data = make_payload(key, 3 << 19, seed=i)
            try:
                write_entry(b, key, data)
            except OSError as exc:
                failed = exc
                break
            committed[key] = data
        assert failed is not None and failed.errno == errno.ENOSPC, failed
        assert len(committed) > 20
        assert "big%03d" % len(committed) not in entry_names(b)  # nothing of the failed one
        # small values (LMDB) until they fail too; then a weights publish fails as well
        for i in range(2000):
            key = f"small{i:04d}"
            data = make_payload(key, 60_000, seed=i)
            try:
                write_entry(b, key, data)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
            committed[key] = data
        else:
            raise AssertionError("small inserts never hit ENOSPC")
        assert_errno(errno.ENOSPC, (m.mnt / "weights" / "w.bin").write_bytes, os.urandom(8 << 20))
        assert (m.mnt / "weights" / "w.bin").read_bytes() == b"v1"
        assert m.alive()
        # everything committed stays readable
        assert sorted(entry_names(b)) == sorted(committed)
        for key, data in committed.items():
            assert read_entry(b, key) == data, key
        # deleting frees room (segment files are collected): inserts work again
        for key in sorted(committed)[:12]:
            os.unlink(b / "entries" / key)
            del committed[key]
        subprocess.run(list(CLI) + ["gc", str(m.mnt)], capture_output=True, timeout=60, check=True)
        write_entry(b, "after", make_payload("after", 3 << 19))
        committed["after"] = read_entry(b, "after")
        m.umount()
        assert_verify_clean(m.store)
        m.mount()
        assert sorted(entry_names(b)) == sorted(committed)
        assert all(read_entry(b, k) == v for k, v in committed.items())
        # a buffer that may evict: a full disk makes room by evicting its oldest entries
        set_config(b, {"evict_when_full": True})
        fifo = entry_names(b)  # oldest first
        for i in range(40):
            key = f"late{i:02d}"
            write_entry(b, key, make_payload(key, 3 << 19, seed=i))
        names = entry_names(b)
        assert get_stats(b)["evictions_for_space"] > 0 and "late39" in names
        assert fifo[0] not in names and names[0] in fifo  # the oldest went first
        for key in names:
            data = read_entry(b, key)
            assert data == committed[key] if key in committed else verify_payload(data, key), key
        m.umount()
        assert_verify_clean(m.store)
    finally:
        m.cleanup()


# ----- flipped bytes -------------------------------------------------------------------------

def test_flipped_lmdb_value_bytes_read_eio_and_verify_names_the_entry(fresh_mount):
    """Corruption of a small value inside LMDB's data file (segments: test_durability, test_tools)."""
    m = fresh_mount()
    b = m.buffer("flip", {"compression": "none"})
    marker = b"<<lmdb-victim-4c1e>>"
    victim = make_payload("victim", 30_000)
    victim = victim[:10_000] + marker + victim[10_000 + len(marker):]
    write_entry(b, "victim", victim)
    write_entry(b, "fine", make_payload("fine", 30_000))
    m.umount()
    data = m.store / "meta" / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(marker)
    assert at >= 0 and raw.find(marker, at + 1) < 0
    raw[at + 3] ^= 0x55
    data.write_bytes(bytes(raw))
    report = verify_cli(m.store)
    bad = [f for f in report["findings"] if f["kind"] == "error"]
    assert report["returncode"] == 4 and len(bad) == 1 and "buffers/flip/entries/victim" in bad[0]["message"]
    m.mount()
    assert_errno(errno.EIO, read_entry, b, "victim")
    assert verify_payload(read_entry(b, "fine"), "fine")
    assert m.alive()


# ----- kill -9 at random moments -------------------------------------------------------------

CRASH_CYCLES = int(os.environ.get("DISTOREFS_CRASH_CYCLES", "10"))
EXPECTED_AFTER_KILL = (errno.ENOTCONN, errno.ECONNABORTED)


class OpLog:
    """A worker's log: `attempt` before an operation, `ack` once it returned."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, *parts) -> None:
        os.write(self.fd, (" ".join(str(p) for p in parts) + "\n").encode())


def checkpoint_files(step: str) -> dict[str, tuple[int, int]]:
    """The files of checkpoint step `step`, name -> (size, seed): a function of the step's
    name, so the checker knows what a step must hold. Tens of KB to about a MB each."""
    r = random.Random(step)
    return {"model.bin": (r.randint(100_000, 1_200_000), r.randrange(1 << 30)),
            "optim.bin": (r.randint(20_000, 300_000), r.randrange(1 << 30)),
            "meta.json": (r.randint(200, 2000), r.randrange(1 << 30))}


def check_checkpoint_step(step_dir: Path) -> None:
    """Every file of the step, and only those, whole (AssertionError otherwise)."""
    step = step_dir.name
    files = checkpoint_files(step)
    assert sorted(os.listdir(step_dir)) == sorted(files), f"{step}: {sorted(os.listdir(step_dir))}"
    for name, (size, seed) in files.items():
        assert (step_dir / name).read_bytes() == make_payload(f"{step}/{name}", size, seed), f"{step}/{name}"


def _worker(kind: str, mnt: str, log_path: str, cycle: int, seed: int) -> None:
    rng = random.Random(seed)
    log = OpLog(log_path)
    mnt = Path(mnt)
    buf, bank, model = mnt / "buffers" / "crash", mnt / "banks" / "crash", mnt / "weights" / "model"
    run = mnt / "checkpoints" / "crash"
    mine: list[str] = []
    parent = os.getppid()
    i = 0
    try:
        while os.getppid() == parent:  # ends with the daemon (an error) or with the test run
            i += 1
            if kind == "insert":
                key = rng.choice(mine) if mine and rng.random() < 0.15 else f"c{cycle}-{i}"
                size = rng.randint(600 << 10, 800 << 10) if rng.random() < 0.05 else rng.randint(100, 60_000)
                s = rng.randrange(1 << 30)
                log.line("a", key, size, s)
                write_entry(buf, key, make_payload(key, size, s))
                log.line("I", key, size, s)
                if key not in mine:
                    mine.append(key)
            elif kind == "bank":
                if mine and rng.random() < 0.3:
                    key = mine.pop(rng.randrange(len(mine)))
                    log.line("d", key)
                    os.unlink(bank / "entries" / key)
                    log.line("D", key)
                else:
                    key = f"c{cycle}-{i}"
                    size, s = rng.randint(100, 20_000), rng.randrange(1 << 30)
                    log.line("a", key, size, s)
                    write_entry(bank, key, make_payload(key, size, s))
                    log.line("I", key, size, s)
                    mine.append(key)
            elif kind == "sample":
                with open(buf / "sample" / "8", "rb") as f:
                    keys = [line.split()[0].decode() for line in f.read().splitlines()]
                for key in keys[:3]:
                    data = read_entry(buf, key)
                    if not verify_payload(data, key):
                        log.line("ERR", "torn-entry", key)
                lines = []
                for key in set(keys):
                    value = round(rng.uniform(0.1, 50), 3)
                    log.line("p", key, value)
                    lines.append((key, value))
                _priorities(buf, "".join(f"{k} {v}\n" for k, v in lines).encode())
                for key, value in lines:
                    log.line("P", key, value)
                target = os.readlink(model / "latest") if os.path.lexists(model / "latest") else None
                if target:
                    try:
                        data = (model / target / "w.bin").read_bytes()
                    except FileNotFoundError:
                        pass  # that version was removed since the readlink
                    else:
                        if not verify_payload(data, target):
                            log.line("ERR", "torn-weights", target)
            elif kind == "publish":
                v = f"c{cycle}v{i}"
                d = model / v
                d.mkdir()
                log.line("w", v)
                write_entry_plain(d / "w.bin", make_payload(v, rng.randint(1000, 900_000), i))
                write_entry_plain(d / "meta.json", json.dumps({"version": v}).encode())
                if os.path.lexists(model / "latest.tmp"):  # left by a publisher killed mid-swap (ln -sfn)
                    os.unlink(model / "latest.tmp")
                os.symlink(v, model / "latest.tmp")
                os.rename(model / "latest.tmp", model / "latest")
                log.line("W", v)
                s = rng.randrange(1 << 30)
                log.line("h", s)
                write_entry_plain(model / "hot.bin", make_payload("hot", 50_000, s))
                log.line("H", s)
                mine.append(v)
                if len(mine) > 3:  # old versions go (their readers keep reading them)
                    shutil.rmtree(model / mine.pop(0))
            elif kind == "checkpoint":
                step = f"c{cycle:04d}-{i:05d}"  # names sort in creation order
                log.line("k", step)
                (run / step).mkdir()
                for name, (size, s) in checkpoint_files(step).items():
                    write_entry_plain(run / step / name, make_payload(f"{step}/{name}", size, s))
                fsync_dir(run / step)  # returns once the step is complete and durable
                log.line("K", step)
            if kind != "sample" and i % 7 == 0:
                time.sleep(0.001)
    except OSError as exc:
        log.line("E", exc.errno, kind, f"@{time.monotonic():.3f}", exc)
    except Exception as exc:  # noqa: BLE001 - reported to the harness
        log.line("ERR", "exception", repr(exc).replace("\n", " "))


def write_entry_plain(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def wait_store_unlocked(store: Path, timeout: float = 30) -> None:
    """Until no process (a killed daemon whose last threads are still exiting) holds the store."""
    import fcntl
    fd = os.open(store / "lock", os.O_RDWR)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{store} still locked {timeout}s after the kill"
                time.sleep(0.05)
    finally:
        os.close(fd)


def _worth_reading(present: set, touched: set, expect: dict, rng, sample: int = 300) -> list:
    """Keys whose content to check this cycle: those written in it, those not settled yet,
    and a random sample of the rest (all were checked whole in the cycle that wrote them;
    every cycle still checks that every acknowledged key is there)."""
    must = {k for k in present if k in touched or (expect and len(expect.get(k, ())) != 1)}
    rest = sorted(present - must)
    return sorted(must) + rng.sample(rest, min(sample, len(rest)))


def _read_log(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split(" ") for line in path.read_text().splitlines() if line]


def _attempts(lines, start_tag: str, ack_tag: str):
    """Per key: the acknowledged value and the values attempted after it (any may be there)."""
    acked, later = {}, {}
    for parts in lines:
        if parts[0] == start_tag:
            later.setdefault(parts[1], []).append(tuple(parts[2:]))
        elif parts[0] == ack_tag:
            acked[parts[1]] = tuple(parts[2:])
            later[parts[1]] = []
    return acked, later


@pytest.mark.timeout(120 + 8 * CRASH_CYCLES)
def test_crash_harness_kill9_at_random_moments(fresh_mount, tmp_path):
    m = fresh_mount("sync_interval=0.3", "segment_bytes=4194304")
    (m.mnt / "buffers" / "crash").mkdir()
    set_config(m.mnt / "buffers" / "crash", {"sampler": "prioritized", "capacity": 1_000_000})
    (m.mnt / "banks" / "crash").mkdir()
    (m.mnt / "weights" / "model").mkdir()
    (m.mnt / "checkpoints" / "crash").mkdir()
    with open(m.mnt / "checkpoints" / "config.json", "w") as f:
        f.write(json.dumps({"seal_after": 0}))  # a step closes only by its fsync (or a newer step)
    buf, bank, model = m.mnt / "buffers" / "crash", m.mnt / "banks" / "crash", m.mnt / "weights" / "model"
    run = m.mnt / "checkpoints" / "crash"
    write_entry(buf, "seed", make_payload("seed", 1000))  # so sample/8 never waits
    rng = random.Random(1234)
    ctx = multiprocessing.get_context("fork")
    # what must be there after every crash: key -> acceptable (size, seed) values
    expect_buf: dict[str, set] = {"seed": {("1000", "0")}}
    expect_bank: dict[str, set] = {}
    prio: dict[str, set] = {}
    latest_floor = None
    step_floor = None  # the newest acknowledged checkpoint step
    steps_acked: set[str] = set()
    recovery_s: list[float] = []
    totals = {"acked": 0, "cycles": 0, "verify_runs": 0, "forced": 0, "steps": 0, "steps_cut": 0}
    for cycle in range(CRASH_CYCLES):
        logs = {kind: tmp_path / f"c{cycle}-{kind}.log"
                for kind in ("insert", "bank", "sample", "publish", "checkpoint")}
        procs = [ctx.Process(target=_worker, args=(kind, str(m.mnt), str(path), cycle, rng.randrange(1 << 30)))
                 for kind, path in logs.items()]
        for p in procs:
            p.start()
        time.sleep(rng.uniform(0.3, 1.5))
        t_kill = time.monotonic()
        killed = m.kill9()
        deadline = time.monotonic() + 10
        t_detach = None
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            # The killed daemon cannot exit while a thread of it is stuck in the kernel sending
            # an invalidation that waits for a directory lock a worker holds while it waits for
            # the daemon: its /dev/fuse stays open and nothing fails. The operator's way out:
            t_detach = time.monotonic()
            res = subprocess.run(list(CLI) + ["umount", "--force", str(m.mnt)], capture_output=True, text=True,
                                 timeout=60)
            assert res.returncode == 0, res.stderr
            totals["forced"] += 1
            for p in procs:
                p.join(timeout=20)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        assert not hung, f"cycle {cycle}: workers hung after the daemon died"
        m.lazy_umount()
        m.pid = None
        wait_store_unlocked(m.store)
        assert not is_mounted(m.mnt) and not pid_alive(killed)

        lines = {kind: _read_log(path) for kind, path in logs.items()}
        for kind, ls in lines.items():
            # an OSError without an errno is never expected (its text is in the line). Once the
            # mount is forced off, its path names the empty directory beneath: ENOENT is then right
            bad = [parts for parts in ls if parts[0] == "ERR" or (parts[0] == "E" and (
                not parts[1].isdigit() or int(parts[1]) not in EXPECTED_AFTER_KILL) and not (
                    t_detach is not None and parts[1] == str(errno.ENOENT) and float(parts[3][1:]) >= t_detach))]
            assert not bad, (f"cycle {cycle} {kind}: {bad[:3]} (killed @{t_kill:.3f}, "
                             f"{'forced off @%.3f' % t_detach if t_detach else 'not forced off'})")
            totals["acked"] += sum(1 for parts in ls if parts[0] in "IDPWHK")
        # verify the crashed store before anything opens it again
        assert_verify_clean(m.store)
        totals["verify_runs"] += 1
        m.mount()
        rec = m.recovery()  # the store was left open: the mount recovered it first
        assert rec["ran"] and rec["unrepaired"] == 0 and rec["blocking"] == 0, rec
        recovery_s.append(rec["seconds"])

        # buffer: every acknowledged insert or rewrite, whole; unacknowledged ones whole or absent
        acked, later = _attempts(lines["insert"], "a", "I")
        for key, value in acked.items():
            expect_buf[key] = {value}
        for key, values in later.items():  # written after their last acknowledgement: may be there
            if key in expect_buf:
                expect_buf[key].update(values)
        present = set(entry_names(buf))
        missing = sorted(set(expect_buf) - present)
        assert not missing, f"cycle {cycle}: acknowledged entries lost: {missing[:5]}"
        for key in _worth_reading(present, set(acked) | set(later), expect_buf, rng):
            data = read_entry(buf, key)
            options = expect_buf.get(key) or set(later.get(key, []))
            found = next((v for v in options if data == make_payload(key, int(v[0]), int(v[1]))), None)
            assert found is not None, f"cycle {cycle}: {key} holds none of its written versions ({len(data)} bytes)"
            expect_buf[key] = {found}
        # bank: inserts acknowledged and not deleted are there; acknowledged deletes are gone
        acked, later = _attempts(lines["bank"], "a", "I")
        deleted = {parts[1] for parts in lines["bank"] if parts[0] == "D"}
        maybe_deleted = {parts[1] for parts in lines["bank"] if parts[0] == "d"}
        written = {key: set(values) for key, values in later.items()}  # what each key may hold
        for key, value in acked.items():
            written[key].add(value)
            expect_bank[key] = written[key]
        for key in maybe_deleted:  # a delete in flight at the kill: there or not
            expect_bank.pop(key, None)
        in_bank = set(entry_names(bank))
        assert not (deleted & in_bank), f"cycle {cycle}: deleted entries came back: {sorted(deleted & in_bank)[:5]}"
        lost = sorted(set(expect_bank) - in_bank)
        assert not lost, f"cycle {cycle}: acknowledged bank entries lost: {lost[:5]}"
        for key in _worth_reading(in_bank, set(written), expect_bank, rng):
            data = read_entry(bank, key)
            options = expect_bank.get(key) or written.get(key, set())
            found = next((v for v in options if data == make_payload(key, int(v[0]), int(v[1]))), None)
            assert found is not None, f"cycle {cycle}: bank {key} holds none of its written versions"
            expect_bank[key] = {found}  # kept from now on, even if its delete was in flight
        # priorities: the acknowledged value or a later attempt
        acked, later = _attempts(lines["sample"], "p", "P")
        for key, value in acked.items():
            prio[key] = {float(value[0])}
        for key, values in later.items():
            if key in prio:
                prio[key].update(float(v[0]) for v in values)
        for key in _worth_reading(set(prio), set(acked) | set(later), prio, rng):
            values = prio[key]
            got = float(xattr(buf / "entries" / key, "priority"))
            assert any(abs(got - v) < 1e-9 for v in values), f"cycle {cycle}: priority of {key} is {got}, not {values}"
            prio[key] = {got}
        # weights: `latest` names a version at least as new as the last acknowledged one, whole
        pub = lines["publish"]
        acked_v = [parts[1] for parts in pub if parts[0] == "W"]
        if acked_v:
            latest_floor = acked_v[-1]
        if latest_floor is not None:
            target = os.readlink(model / "latest")
            order = [parts[1] for parts in pub if parts[0] == "w"]
            if target != latest_floor:  # a newer one, published (maybe unacknowledged) in this cycle
                newer = order[order.index(latest_floor) + 1:] if latest_floor in order else order
                assert target in newer, f"cycle {cycle}: latest -> {target}, acknowledged {latest_floor}"
            assert verify_payload((model / target / "w.bin").read_bytes(), target)
            assert json.loads((model / target / "meta.json").read_bytes()) == {"version": target}
            latest_floor = target
        acked_h, later_h = _attempts([["h", "hot", *p[1:]] if p[0] == "h" else ["H", "hot", *p[1:]] if p[0] == "H"
                                      else p for p in pub], "h", "H")
        if "hot" in acked_h:
            data = (model / "hot.bin").read_bytes()
            seeds = {acked_h["hot"][0], *[v[0] for v in later_h["hot"]]}
            assert any(data == make_payload("hot", 50_000, int(s)) for s in seeds), f"cycle {cycle}: hot.bin"
        # checkpoints: `latest` names a step at least as new as the last acknowledged one,
        # whole; any step that shows as complete is whole; the others are incomplete
        ck = lines["checkpoint"]
        acked_steps = [parts[1] for parts in ck if parts[0] == "K"]
        steps_acked.update(acked_steps)
        totals["steps"] += len(acked_steps)
        if acked_steps:
            step_floor = acked_steps[-1]
        if step_floor is not None:
            target = os.readlink(run / "latest")
            assert target >= step_floor, f"cycle {cycle}: latest -> {target}, acknowledged {step_floor}"
            assert xattr(run / target, "state") == "durable", (target, xattr(run / target, "state"))
            check_checkpoint_step(run / target)
        for step in sorted(os.listdir(run)):
            if step == "latest":
                continue
            try:
                state = xattr(run / step, "state")
                if state == "durable":
                    check_checkpoint_step(run / step)
                else:
                    assert state == "incomplete" and step not in steps_acked, f"cycle {cycle}: {step} {state}"
                    totals["steps_cut"] += step.startswith(f"c{cycle:04d}-")  # cut short by this kill
            except FileNotFoundError:
                pass  # an interrupted or old step being removed in the background
        assert get_stats(buf)["entries"] == len(present)
        totals["cycles"] += 1
    m.umount()
    assert_verify_clean(m.store)
    assert totals["acked"] > 20 * CRASH_CYCLES, totals
    assert totals["steps"] > 0, totals
    print(f"\ncrash harness: {totals['cycles']} kill -9 cycles, {totals['acked']} acknowledged operations "
          f"checked ({totals['steps']} checkpoint steps, {totals['steps_cut']} cut short), verify clean {totals['verify_runs'] + 1} times, "
          f"{totals['forced']} forced unmounts, recovery at mount {sum(recovery_s) / len(recovery_s):.3f} s "
          f"on average (max {max(recovery_s):.3f} s)")


def test_kill9_while_replaced_weights_are_still_read_leaks_nothing(fresh_mount):
    """A version unlinked or replaced while open is freed when its reader closes; a crash
    before that used to leak its chunks (verify: leak). Its record now stays until then."""
    m = fresh_mount()
    w = m.mnt / "weights"
    big, small = make_payload("big", 3 << 20), make_payload("small", 200_000)
    (w / "big.bin").write_bytes(big)
    (w / "small.bin").write_bytes(small)
    readers = [open(w / "big.bin", "rb"), open(w / "small.bin", "rb")]
    try:
        assert readers[0].read(10) == big[:10] and readers[1].read(10) == small[:10]
        os.unlink(w / "big.bin")
        (w / "new.bin").write_bytes(b"new")
        os.rename(w / "new.bin", w / "small.bin")  # replaces the version being read
        assert readers[0].read() == big[10:]  # the old reader still reads its version
        m.kill9()
    finally:
        for r in readers:
            try:
                r.close()
            except OSError:
                pass
    m.lazy_umount()
    m.pid = None
    report = assert_verify_clean(m.store)
    assert "unlinked while read" in report["passes"]["weights-tree"]
    m.mount()
    assert sorted(os.listdir(w)) == ["config.json", "small.bin", "stats.json"]
    assert (w / "small.bin").read_bytes() == b"new"
    subprocess.run(list(CLI) + ["gc", str(m.mnt)], check=True, capture_output=True, timeout=60)
    m.umount()
    report = assert_verify_clean(m.store)
    assert "unlinked" not in report["passes"]["weights-tree"]
    assert report["counts"]["segments"] == 0  # the big version's segment file is gone too


# ----- concurrency stress --------------------------------------------------------------------

STRESS_SECONDS = float(os.environ.get("DISTOREFS_STRESS_SECONDS", "4"))


def _stress(kind: str, root: str, seconds: float, seed: int, q) -> None:
    rng = random.Random(seed)
    buf = Path(root)
    counts = {"ok": 0, "enoent": 0, "inserts": 0, "deletes": 0, "opens": 0}
    errors = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        try:
            if kind == "insert":
                key = f"{seed}-{i}"
                size = rng.randint(600 << 10, 700 << 10) if rng.random() < 0.03 else rng.randint(100, 40_000)
                write_entry(buf, key, make_payload(key, size, i))
                counts["inserts"] += 1
            elif kind == "delete":
                names = os.listdir(buf / "entries")
                if names:
                    os.unlink(buf / "entries" / rng.choice(names))
                    counts["deletes"] += 1
            elif kind == "sample":
                if rng.random() < 0.5:
                    with open(buf / "sample" / "16", "rb") as f:
                        keys = [line.split()[0].decode() for line in f.read().splitlines()]
                    counts["opens"] += 1
                    for key in keys[:4]:
                        try:
                            if not verify_payload(read_entry(buf, key), key):
                                errors.append(("torn", key))
                        except FileNotFoundError:
                            counts["enoent"] += 1
                    with open(buf / "priorities", "w") as f:
                        f.write("".join(f"{k} {rng.uniform(0.1, 9):.3f}\n" for k in keys))
                else:
                    with np.load(buf / "batch" / "8.npz") as z:
                        assert len(z["keys"]) == 8 and z["offsets"][-1] == len(z["data"])
                    counts["opens"] += 1
            elif kind == "read":
                names = os.listdir(buf / "entries")
                for name in rng.sample(names, min(4, len(names))):
                    try:
                        xattr(buf / "entries" / name, "seq")
                        if not verify_payload(read_entry(buf, name), name):
                            errors.append(("torn", name))
                    except FileNotFoundError:
                        counts["enoent"] += 1
                    except OSError as exc:
                        if exc.errno != errno.ENODATA:  # getxattr on an entry just removed
                            raise
                        counts["enoent"] += 1
                json.loads((buf / "stats.json").read_bytes())
            counts["ok"] += 1
        except FileNotFoundError:
            counts["enoent"] += 1  # an entry deleted or evicted by another worker
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append((kind, repr(exc)))
    q.put((kind, counts, errors))


def test_concurrency_stress_consistent_stats(fresh_mount):
    m = fresh_mount("cache_bytes=4194304")
    buf = m.buffer("stress", {"capacity": 300, "sampler": "prioritized", "compression": "none"})
    for i in range(40):
        write_entry(buf, f"init-{i}", make_payload(f"init-{i}", 5000, i))
    kinds = ["insert", "insert", "delete", "sample", "sample", "read"]
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_stress, args=(k, str(buf), STRESS_SECONDS, 100 + n, q)) for n, k in enumerate(kinds)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    results = [q.get(timeout=STRESS_SECONDS + 60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert not [p for p in procs if p.is_alive()], "a worker is stuck (deadlock?)"
    assert time.monotonic() - t0 < STRESS_SECONDS + 30
    errors = [e for _, _, errs in results for e in errs]
    assert not errors, errors[:5]
    total = {k: sum(c[k] for _, c, _ in results) for k in ("ok", "enoent", "inserts", "deletes", "opens")}
    assert total["inserts"] > 50 and total["opens"] > 10 and total["deletes"] > 10, total

    assert m.alive()
    stats = get_stats(buf)
    names = entry_names(buf)
    assert stats["entries"] == len(names) == len(set(names))
    assert len((buf / "priorities").read_text().splitlines()) == len(names)
    assert stats["inserts"] == 40 + total["inserts"]
    assert stats["deletes"] == total["deletes"]
    assert stats["inserts"] - stats["deletes"] - stats["evictions"] - stats["exhausted"] == stats["entries"]
    assert stats["batches"] >= total["opens"]
    assert stats["entries"] <= 300
    whole = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert whole["corrupt_reads"] == 0 and whole["commits"]["failures"] == 0
    assert whole["mount"]["open_handles"] == 0
    for name in names:
        assert verify_payload(read_entry(buf, name), name)
    m.umount()
    assert_verify_clean(m.store)
    print(f"\nstress: {sum(c['ok'] for _, c, _ in results)} operations by {len(procs)} processes in "
          f"{STRESS_SECONDS}s, {total['enoent']} ENOENT races, stats consistent")


# ----- permissions -------------------------------------------------------------------------

def _as_user(uid: int, gid: int, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *cmd],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def other_user():
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    import pwd
    for name in ("distorefs-test", "nobody"):
        try:
            pw = pwd.getpwnam(name)
            return pw.pw_uid, pw.pw_gid
        except KeyError:
            pass
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "distorefs-test"],
                   check=True, capture_output=True)
    pw = pwd.getpwnam("distorefs-test")
    return pw.pw_uid, pw.pw_gid


def test_permissions_default_permissions_and_allow_other(other_user):
    if not have_fuse():
        pytest.skip("needs /dev/fuse")
    uid, gid = other_user
    # the mount point must be reachable by the other user: not below pytest's 0700 tmp dir
    root = Path(tempfile.mkdtemp(prefix="distorefs-perm-", dir="/tmp"))
    os.chmod(root, 0o755)
    m = Mount(root)
    os.chmod(m.mnt, 0o755)
    try:
        m.mount()
        b = m.buffer("private")
        os.chmod(b, 0o755)
        write_entry(b, "secret", b"root's secret")
        os.chmod(b / "entries" / "secret", 0o600)
        write_entry(b, "public", b"for everyone")
        os.chmod(b / "entries" / "public", 0o644)
        # without allow_other, another user cannot even look at the mount
        res = _as_user(uid, gid, "cat", str(b / "entries" / "public"))
        assert res.returncode != 0 and "Permission denied" in res.stderr, res
        assert "allow_other" not in open("/proc/mounts").read().split(str(m.mnt))[1].splitlines()[0]
        m.umount()

        res = subprocess.run(list(CLI) + ["mount", "--allow-other", str(m.store), str(m.mnt)],
                             capture_output=True, text=True, timeout=90)
        assert res.returncode == 0, res.stderr
        import re
        m.pid = int(re.search(r"daemon pid (\d+)", res.stdout).group(1))
        m.pids.add(m.pid)
        assert "allow_other" in [line for line in open("/proc/mounts") if str(m.mnt) in line][0]
        # default_permissions: the modes decide
        res = _as_user(uid, gid, "cat", str(b / "entries" / "public"))
        assert res.returncode == 0 and res.stdout == "for everyone", res
        res = _as_user(uid, gid, "cat", str(b / "entries" / "secret"))
        assert res.returncode != 0 and "Permission denied" in res.stderr, res
        res = _as_user(uid, gid, "sh", "-c", f"echo x > '{b}/entries/intruder'")
        assert res.returncode != 0 and "Permission denied" in res.stderr, res
        res = _as_user(uid, gid, "setfattr", "-n", "user.distorefs.priority", "-v", "9", str(b / "entries" / "public"))
        assert res.returncode != 0, res
        assert float(xattr(b / "entries" / "public", "priority")) != 9
        res = _as_user(uid, gid, "sh", "-c", f"echo 1 > '{m.mnt}/.distorefs/gc'")
        assert res.returncode != 0, res  # collection on demand is the owner's
        # a buffer the other user owns: its entries carry the user's uid and mode
        shared = m.buffer("theirs")
        os.chown(shared, uid, gid)  # chown of a buffer reaches entries/ too, and persists
        assert (os.stat(shared).st_uid, os.stat(shared / "entries").st_uid) == (uid, uid)
        res = _as_user(uid, gid, "sh", "-c", f"umask 077; echo mine > '{shared}/entries/e'")
        assert res.returncode == 0, res
        st = os.stat(shared / "entries" / "e")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o600)
        # chmod of a buffer closes it to others (it used to be accepted and ignored)
        os.chmod(b, 0o700)
        res = _as_user(uid, gid, "cat", str(b / "entries" / "public"))
        assert res.returncode != 0 and "Permission denied" in res.stderr, res
        assert read_entry(b, "secret") == b"root's secret"  # root still reads it (and nothing changed)
        assert sorted(entry_names(b)) == ["public", "secret"]
        m.umount()
        m.mount()
        assert os.stat(b).st_mode & 0o777 == 0o700 and os.stat(shared).st_uid == uid
        m.umount()
    finally:
        m.cleanup()
        shutil.rmtree(root, ignore_errors=True)

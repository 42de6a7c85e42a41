"""Helpers of the integration tests: real FUSE mounts of fresh stores, made and removed through the CLI.

Every mount made here is unmounted in teardown whatever happened: `distorefs umount`,
then `fusermount3 -uz`, then SIGKILL of the daemon PID this fixture started (read from
the mount's output and STORE/lock), never anything else.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

PYTHON = sys.executable
CLI = [PYTHON, "-m", "distorefs.tools.cli"]


def have_fuse() -> bool:
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


def is_mounted(mnt: Path) -> bool:
    target = str(Path(mnt).resolve())
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[1].replace("\\040", " ") == target:
                return True
    return False


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Mount:
    """One store and its mount point; mount()/umount() may be called repeatedly."""

    def __init__(self, root: Path, options: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.store = self.root / "store"
        self.mnt = self.root / "mnt"
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.options = options
        self.pids: set[int] = set()  # every daemon this object started
        self.pid: int | None = None

    # ----- lifecycle -----------------------------------------------------------------

    def mount_allow_other(self) -> subprocess.CompletedProcess:
        return self.mount(flags=("--allow-other",))

    def mount(self, *extra: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        args = list(CLI) + ["mount", *flags]
        for opt in self.options + extra:
            args += ["-o", opt]
        args += [str(self.store), str(self.mnt)]
        res = subprocess.run(args, capture_output=True, text=True, timeout=90)
        m = re.search(r"daemon pid (\d+)", res.stdout)
        if m:
            self.pid = int(m.group(1))
            self.pids.add(self.pid)
        if res.returncode != 0:
            raise AssertionError(f"mount failed ({res.returncode}): {res.stdout}{res.stderr}\n"
                                 f"log tail:\n{self.log_tail()}")
        assert is_mounted(self.mnt), "mount returned but the mount point is not in /proc/mounts"
        lock_pid = self.lock_pid()
        assert lock_pid == self.pid, f"STORE/lock says {lock_pid}, mount printed {self.pid}"
        return res

    def umount(self) -> None:
        res = subprocess.run(list(CLI) + ["umount", str(self.mnt)], capture_output=True, text=True, timeout=150)
        assert res.returncode == 0, f"umount failed: {res.stdout}{res.stderr}"
        assert not is_mounted(self.mnt)
        if self.pid is not None:
            deadline = time.monotonic() + 30
            while pid_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not pid_alive(self.pid), f"daemon {self.pid} still alive after umount"
        self.pid = None

    def remount(self) -> None:
        self.umount()
        self.mount()

    def kill9(self) -> int:
        """SIGKILL the daemon (PID from STORE/lock, which must be the one we started)."""
        pid = self.lock_pid()
        assert pid is not None and pid in self.pids, f"lock pid {pid} is not a daemon we started ({self.pids})"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return pid

    def lazy_umount(self) -> None:
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True, timeout=30)

    def cleanup(self) -> None:
        """Teardown: leave no mount and no daemon of ours behind."""
        if is_mounted(self.mnt):
            try:
                subprocess.run(list(CLI) + ["umount", "--timeout", "30", str(self.mnt)],
                               capture_output=True, timeout=60)
            except subprocess.TimeoutExpired:
                pass
        if is_mounted(self.mnt):
            self.lazy_umount()
        for pid in self.pids:
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ----- helpers -------------------------------------------------------------------

    def lock_pid(self) -> int | None:
        try:
            parts = (self.store / "lock").read_text().split()
        except OSError:
            return None
        if len(parts) >= 2 and parts[0] == "pid" and parts[1].isdigit():
            return int(parts[1])
        return None

    def log(self) -> str:
        try:
            return (self.store / "daemon.log").read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def recovery(self) -> dict:
        """What recovery at open did for the running daemon (stats.json "recovery")."""
        return json.loads((self.mnt / ".distorefs" / "stats.json").read_bytes())["recovery"]

    def alive(self) -> bool:
        """The daemon still answers: stats.json reads and parses."""
        json.loads((self.mnt / ".distorefs" / "stats.json").read_bytes())
        return self.pid is not None and pid_alive(self.pid)

    def buffer(self, name: str, config: dict | None = None) -> Path:
        path = self.mnt / "buffers" / name
        path.mkdir()
        if config:
            set_config(path, config)
        return path


def wait_for(cond, timeout: float = 15.0):
    """Poll `cond` until it gives something true or `timeout` seconds passed; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def reclaimed() -> int:
    """What the kernel has reclaimed since boot: page-cache pages taken (pgsteal_*), slab
    objects its shrinkers scanned (they drop unused inodes, their pages with them) and the
    bytes DAMON's schemes paged out. This machine's memory can be taken back by its host at
    any time (here a DAMON `pageout` scheme on physical memory pages cold memory out every
    few seconds, and /proc/vmstat's pgsteal counters do not count it), so a test can hold
    the kernel to keeping pages only over a window in which this did not move."""
    with open("/proc/vmstat") as f:
        total = sum(int(v) for k, v in (line.split() for line in f)
                    if k.startswith("pgsteal_") or k == "slabs_scanned")
    return total + _damon_paged_out()


def _damon_paged_out() -> int:
    """Bytes DAMON's schemes applied their action to, over every kdamond (0 without DAMON
    or without the right to ask it for fresh counts: `update_schemes_stats` only refreshes
    them)."""
    total = 0
    for kdamond in Path("/sys/kernel/mm/damon/admin/kdamonds").glob("[0-9]*"):
        try:
            (kdamond / "state").write_text("update_schemes_stats")
            total += sum(int(p.read_text()) for p in kdamond.glob("contexts/*/schemes/*/stats/sz_applied"))
        except (OSError, ValueError):
            continue
    return total


def set_config(buf: Path, config: dict) -> None:
    with open(buf / "config.json", "w") as f:
        f.write(json.dumps(config))


def get_config(buf: Path) -> dict:
    return json.loads((buf / "config.json").read_bytes())


def get_stats(buf: Path) -> dict:
    return json.loads((buf / "stats.json").read_bytes())


def mount_stats(m) -> dict:
    """The `mount` section of a mount's stats.json (`m`: a Mount): what its daemon and the
    library's front answered."""
    return json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())["mount"]


def write_entry(buf: Path, key: str, data: bytes) -> None:
    with open(buf / "entries" / key, "wb") as f:
        f.write(data)


def read_entry(buf: Path, key: str) -> bytes:
    with open(buf / "entries" / key, "rb") as f:
        return f.read()


def entry_names(buf: Path) -> list[str]:
    return os.listdir(buf / "entries")


def drop_page_cache(paths) -> None:
    """Drop the kernel's cached pages of these files only (POSIX_FADV_DONTNEED), not the
    whole host's page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def xattr(path: Path, name: str) -> str:
    return os.getxattr(path, "user.distorefs." + name).decode()


def fsync_dir(path: Path) -> None:
    """fsync a directory (under checkpoints/: returns once what was written below is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----- self-verifying payloads --------------------------------------------------------

_TAG = b"DFSTEST1"
_HDR = struct.Struct("<8sI32s")  # tag, body length, sha256 of body


def npy(a) -> bytes:
    """The bytes np.save writes for `a` (an entry's file)."""
    out = io.BytesIO()
    np.save(out, a)
    return out.getvalue()


def npz(**arrays) -> bytes:
    """The bytes np.savez writes for `arrays`."""
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def make_payload(key: str, size: int, seed: int = 0) -> bytes:
    """`size` incompressible bytes that name `key` and carry a sha256 of their body."""
    body_len = size - _HDR.size
    assert body_len > 0
    prefix = (key + "|").encode()
    rng_seed = int.from_bytes(hashlib.sha256(f"{key}/{seed}".encode()).digest()[:8], "little")
    body = (prefix + np.random.default_rng(rng_seed).bytes(body_len))[:body_len]
    return _HDR.pack(_TAG, body_len, hashlib.sha256(body).digest()) + body


def verify_payload(data: bytes, key: str | None = None) -> bool:
    if len(data) < _HDR.size:
        return False
    tag, body_len, digest = _HDR.unpack_from(data)
    body = data[_HDR.size:]
    if tag != _TAG or body_len != len(body) or hashlib.sha256(body).digest() != digest:
        return False
    if key is not None and not body.startswith((key + "|").encode()):
        return False
    return True


def as_user(user: str, *cmd: str, cwd: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `cmd` as `user` (runuser: its uid, gid and groups), output captured as text."""
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def in_child_as(uid: int, gid: int, fn, *args, timeout: float = 120):
    """fn(*args) in a forked child that runs as uid/gid (no other groups); its result (JSON)
    comes back, an exception in it becomes an AssertionError here. For steps that need
    Python as another user: the interpreter under /root is not theirs to start."""
    import traceback
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the user, run, report, never return into pytest
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = {"ok": fn(*args)}
        except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}", "errno": getattr(exc, "errno", None),
                   "trace": traceback.format_exc()}
            code = 1
        try:
            os.write(write_fd, json.dumps(out, default=str).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise AssertionError("the child did not finish in time")
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "no answer"}')
    if "error" in out:
        raise ChildFailed(out["error"], out.get("errno"), out.get("trace", ""))
    return out["ok"]


class ChildFailed(AssertionError):
    def __init__(self, message: str, errno_: int | None, trace: str) -> None:
        super().__init__(f"{message}\n{trace}")
        self.errno = errno_


def assert_errno(expected, fn, *args, **kwargs):
    """Call fn and check it fails with OSError whose errno is `expected` (int or tuple)."""
    codes = expected if isinstance(expected, tuple) else (expected,)
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    assert info.value.errno in codes, (
        f"expected {[errno.errorcode[c] for c in codes]}, got "
        f"{errno.errorcode.get(info.value.errno, info.value.errno)}: {info.value}")
    return info.value


@contextlib.contextmanager
def small_tmpfs(disk: Path, size_mb: int):
    """A tmpfs of `size_mb` MiB mounted at `disk` (root only; the test is skipped otherwise),
    unmounted afterwards: a small disk to fill."""
    import pytest
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(disk)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)

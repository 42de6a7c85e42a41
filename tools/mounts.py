"""Finding distorefs mounts and their daemons (from /proc/mounts and the store lock file)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FSTYPE = "fuse.distorefs"


@dataclass(frozen=True)
class MountInfo:
    store: Path
    mountpoint: Path

    @property
    def pid(self) -> int | None:
        return daemon_pid(self.store)


def _unescape(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mounts() -> list[MountInfo]:
    out = []
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == FSTYPE:
                out.append(MountInfo(Path(_unescape(parts[0])), Path(_unescape(parts[1]))))
    return out


def mountpoints_under(path: str | os.PathLike) -> list[Path]:
    """Every mount point (of any filesystem) at or below `path`."""
    top = os.path.realpath(path)
    with open("/proc/mounts") as f:
        points = [_unescape(line.split()[1]) for line in f if len(line.split()) >= 2]
    return [Path(p) for p in points if p == top or p.startswith(top.rstrip("/") + "/")]


def find_mount(mountpoint: str | os.PathLike) -> MountInfo | None:
    target = Path(mountpoint).resolve()
    for m in mounts():
        if m.mountpoint == target:
            return m
    return None


def daemon_pid(store: Path) -> int | None:
    try:
        text = (store / "lock").read_text()
    except OSError:
        return None
    parts = text.split()
    if len(parts) >= 2 and parts[0] == "pid" and parts[1].isdigit():
        pid = int(parts[1])
        return pid if Path(f"/proc/{pid}").exists() else None
    return None


FUSECTL = Path("/sys/fs/fuse/connections")


def fuse_connection(mountpoint: str | os.PathLike) -> int | None:
    """The FUSE connection number of a mount (the minor of its device): FUSECTL/N."""
    target = str(Path(mountpoint).resolve())
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            # id parent major:minor root mountpoint options [optional...] - fstype source superopts
            if len(parts) > 6 and _unescape(parts[4]) == target and "-" in parts:
                if parts[parts.index("-") + 1].startswith("fuse"):
                    return int(parts[2].split(":")[1])
    return None


def abort_connection(conn: int) -> bool:
    """Abort FUSE connection `conn`: every request waiting on its daemon fails (ENOTCONN,
    ECONNABORTED) and the daemon's reads end. The way out when a daemon is hung, or dead but
    unable to exit (after a kill -9, a thread of it can be stuck in the kernel sending an
    invalidation that waits for a directory lock a client holds while it waits for the
    daemon). Needs root (fusectl)."""
    if FUSECTL.is_dir() and not any(FUSECTL.iterdir()):
        import subprocess
        subprocess.run(["mount", "-t", "fusectl", "none", str(FUSECTL)], capture_output=True)
    try:
        (FUSECTL / str(conn) / "abort").write_text("1")
    except OSError:
        return False
    return True


def read_with_timeout(path: Path, timeout: float) -> bytes:
    """The content of `path`, read by a child process given `timeout` seconds: a hung FUSE
    daemon leaves its callers in uninterruptible sleep, so the read must not be ours. On
    TimeoutError the child is killed and left behind (it ends once the mount answers or
    is aborted); OSError with the child's message if the read fails."""
    import subprocess
    proc = subprocess.Popen(["cat", "--", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # not waited for: it may not die until the mount answers
        raise TimeoutError(f"{path}: no answer in {timeout} s") from None
    if proc.returncode != 0:
        message = err.decode(errors="replace").strip().rsplit(": ", 1)[-1]
        raise OSError(0, message or "read failed")
    return out


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str
    what: str  # "working directory", "open file PATH", ...


def holders(mountpoint: str | os.PathLike) -> list[Holder]:
    """Processes that keep a mount busy: a working or root directory, an open file or a
    mapping below it (from /proc, whose links are read without touching the mount)."""
    root = str(Path(mountpoint))
    inside = lambda p: p == root or p.startswith(root + "/")  # noqa: E731
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            command = (entry / "comm").read_text().strip()
        except OSError:
            continue
        what = None
        for link, label in (("cwd", "working directory"), ("root", "root directory")):
            try:
                if inside(os.readlink(entry / link)):
                    what = label
                    break
            except OSError:
                pass
        if what is None:
            try:
                for fd in (entry / "fd").iterdir():
                    target = os.readlink(fd)
                    if inside(target):
                        what = f"open file {target}"
                        break
            except OSError:
                pass
        if what is None:
            try:
                for line in (entry / "maps").read_text().splitlines():
                    parts = line.split(None, 5)
                    if len(parts) == 6 and inside(parts[5].removesuffix(" (deleted)")):
                        what = f"mapped file {parts[5]}"
                        break
            except OSError:
                pass
        if what is not None:
            found.append(Holder(pid, command, what))
    return found

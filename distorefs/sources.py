"""Opening and reading the source files of `distorefs stage` safely: by the daemon, and by
the stager itself for the small files it reads and sends (distorefs/stagewire.py).

The daemon usually runs as root and serves every user of the mount, so a request to stage
`/some/path` must not become a way to read what the asking user could not read himself.
This module owns the three rules that prevent it:

- **Rights of the asker.** Sources are opened with the caller's credentials: the worker
  thread that opens them switches its filesystem uid and gid (setfsuid/setfsgid) and its
  supplementary groups (the raw setgroups syscall: glibc's setgroups() would change every
  thread of the daemon) to the caller's, opens, and switches back before it does anything
  else. Linux keeps credentials per thread, so the kernel itself checks modes, ACLs and
  security modules for exactly this user; nothing is re-implemented here. Only the open
  runs with the caller's rights: reading an open descriptor needs none.
- **Beneath the source root.** A source is opened relative to the tree (or list) it came
  from, with openat2(RESOLVE_BENEATH): a relative symlink that stays inside the tree is
  followed (its target's content is staged under the link's name), while an absolute link
  or one that leads out of the tree fails (EXDEV) and that file is refused. Where openat2
  is missing the path is resolved, checked to be inside the root, opened without following
  a last link, and the descriptor's real path checked again after the open.
  `follow_symlinks` opts out (every link is followed, still with the caller's rights).
- **Regular files, bounded reads.** Sources are opened O_NONBLOCK (a FIFO cannot hang the
  open) and anything but a regular file is refused (FIFO, device, socket). The size is the
  one fstat gives at open, never the size the request declares; reads stop there, and a
  file found longer or shorter than that (it changed while staged) fails.

What is in memory is taken without threads: a stage opens each source first with
RESOLVE_CACHED and reads it with RWF_NOWAIT, in one thread, and only what would wait for
the disk (or a network filesystem's server) goes further (`NotCached`). Each open and read
lets go of the GIL; with several threads doing that for small cached files, the daemon
spent nearly half its CPU handing the GIL between them (240,000 context switches for
20,000 files of 10 KB). What is not cached is not read by many threads either: the
kernel is asked to read a batch's files ahead (`read_ahead`), all at once, and one thread
reads them as they land.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from .errors import InvalidArgument, NotPermitted

log = logging.getLogger(__name__)

T = TypeVar("T")

_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159, "ppc64le": 81, "s390x": 206, "riscv64": 159}
_SYS_OPENAT2 = 437  # the same number on every architecture (added after the tables were unified)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
_RESOLVE_CACHED = 0x20  # fail with EAGAIN unless every component is in the kernel's lookup cache
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@dataclass(frozen=True)
class Credentials:
    """Who asked: the uid, gid and supplementary groups sources are opened with."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @classmethod
    def of_caller(cls, pid: int, uid: int, gid: int) -> "Credentials":
        """The credentials of the process (thread) `pid` that made a FUSE request as uid/gid;
        its supplementary groups come from /proc (FUSE passes only uid and gid)."""
        groups: tuple[int, ...] = ()
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        groups = tuple(int(g) for g in line.split()[1:])
                        break
        except (OSError, ValueError):
            groups = ()  # the caller is gone: its own uid and gid only
        return cls(uid, gid, groups)

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def may(self, mode: int, uid: int, gid: int, want: int) -> bool:
        """Whether the permission bits `want` (r=4, w=2, x=1) of a file of `mode`, uid, gid
        are this caller's (POSIX classes; root may everything)."""
        if self.uid == 0:
            return True
        if self.uid == uid:
            bits = mode >> 6
        elif gid == self.gid or gid in self.groups:
            bits = mode >> 3
        else:
            bits = mode
        return bits & want == want


def check_can_act_for(cred: Credentials) -> None:
    """Refuse at once (EACCES) a caller whose rights this daemon cannot take."""
    if os.geteuid() == 0 or cred.uid == os.geteuid():
        return
    raise NotPermitted(f"the daemon runs as uid {os.geteuid()} and cannot read files with the rights of uid "
                       f"{cred.uid}: only that user or root may stage")


def _setgroups_this_thread(groups: tuple[int, ...]) -> None:
    number = _SYS_SETGROUPS.get(platform.machine())
    if number is None:
        raise NotPermitted(f"cannot switch supplementary groups per thread on {platform.machine()}")
    array = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if _libc.syscall(number, len(groups), array) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setgroups: {os.strerror(err)}")


def _setfsid(fn, value: int) -> None:
    fn(value)
    if fn(-1) != value:  # setfs*id report no error: ask which one is in force
        raise OSError(errno.EPERM, f"cannot switch the thread's filesystem id to {value}")


@contextmanager
def acting_as(cred: Credentials | None) -> Iterator[None]:
    """Within this block the calling thread opens files with `cred`'s rights (worker thread
    only: never on the event loop). None, or the daemon's own user: nothing changes."""
    if cred is None or cred.uid == os.geteuid():
        yield  # the daemon's own user (or root for root): its rights are the caller's
        return
    check_can_act_for(cred)
    uid, gid, groups = os.geteuid(), os.getegid(), tuple(os.getgroups())
    try:
        _setgroups_this_thread(cred.groups)
        _setfsid(_libc.setfsgid, cred.gid)
        _setfsid(_libc.setfsuid, cred.uid)
        yield
    finally:
        try:
            _setfsid(_libc.setfsuid, uid)
            _setfsid(_libc.setfsgid, gid)
            _setgroups_this_thread(groups)
        except OSError:
            # A worker thread left with a user's rights would serve later requests with
            # them: stop the daemon rather than go on (the mount ends, nothing is lost).
            log.critical("could not restore the daemon's credentials after staging: exiting")
            os._exit(70)


def run_as(cred: Credentials | None, fn: Callable[[], T]) -> T:
    with acting_as(cred):
        return fn()


@dataclass
class OpenSource:
    """An opened source: its descriptor and what fstat said at open."""

    fd: int
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class SourceRefused(InvalidArgument):
    """A source that is not staged: outside the tree, not a regular file, unreadable."""


class NotCached(Exception):
    """Opening or reading a source would wait for the disk (or the server of a network
    filesystem): see `open_source(cached=True)` and `read_cached`."""


def open_root(root: str) -> int:
    """A descriptor of the source tree's root directory (with the caller's rights)."""
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise SourceRefused(f"cannot open the source directory {root}: {exc.strerror}") from None


def relative_to_root(src: str, root: str) -> str:
    """`src` as a path below `root`; SourceRefused if it is not below it."""
    rel = _plainly_below(src, root)
    if rel is not None:
        return rel
    rel = os.path.relpath(os.path.normpath(src), os.path.normpath(root))
    if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise SourceRefused(f"{src} is outside the source tree {root}")
    return rel


def _plainly_below(src: str, root: str) -> str | None:
    """`src` below `root` when it plainly is: `root`, a slash, then components none of them
    empty, `.` or `..` (what a listing of the tree gives); None to work it out in full.
    os.path.relpath costs more than the open it prepares."""
    prefix = root if root.endswith("/") else root + "/"
    if not src.startswith(prefix) or not root.startswith("/"):
        return None
    rel = src[len(prefix):]
    if not rel or rel.startswith("/") or rel.endswith("/") or "//" in rel or rel in (".", "..") \
            or rel.startswith(("./", "../")) \
            or "/./" in rel or "/../" in rel or rel.endswith(("/.", "/..")):
        return None
    return rel


def open_source(root_fd: int | None, root: str, src: str, follow_symlinks: bool, cached: bool = False) -> OpenSource:
    """Open `src` for reading (call inside `acting_as`): beneath `root` unless `root_fd` is
    None (a list whose paths may lie anywhere: a last symlink is then not followed) or
    `follow_symlinks`. Only a regular file is accepted. `cached`: only if the kernel can
    resolve the path from its lookup cache (NotCached otherwise, and for sources opened
    without openat2)."""
    if cached and (follow_symlinks or root_fd is None or not _have_openat2):
        raise NotCached(src)
    try:
        if follow_symlinks:
            fd = os.open(src, _OPEN_FLAGS)
        elif root_fd is None:
            fd = os.open(src, _OPEN_FLAGS | os.O_NOFOLLOW)
        else:
            fd = _open_beneath(root_fd, root, relative_to_root(src, root), cached)
    except OSError as exc:
        if cached and exc.errno in (errno.EAGAIN, errno.ENOSYS, errno.EPERM, errno.EINVAL):
            raise NotCached(src) from None  # (EINVAL: a kernel without RESOLVE_CACHED)
        if exc.errno == errno.EXDEV:
            raise SourceRefused(f"{src} is a symlink that leads outside the source tree {root} "
                                f"(--follow-symlinks stages what links name)") from None
        if exc.errno == errno.ELOOP:
            raise SourceRefused(f"{src} is a symlink (not followed: --follow-symlinks stages what links name)") \
                from None
        raise SourceRefused(f"cannot read {src}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceRefused(f"{src} is not a regular file ({_kind(st.st_mode)}): refused")
    except BaseException:
        os.close(fd)
        raise
    return OpenSource(fd, st.st_size, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


_have_openat2 = True


def _open_beneath(root_fd: int, root: str, rel: str, cached: bool = False) -> int:
    global _have_openat2
    if _have_openat2:
        how = _OpenHow(_OPEN_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS | (_RESOLVE_CACHED if cached else 0))
        fd = _libc.syscall(_SYS_OPENAT2, root_fd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if cached or err not in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter that does not know openat2
            raise OSError(err, os.strerror(err), rel)
        _have_openat2 = False
    # Fallback: resolve, check, open without following a last link, check what was opened.
    real_root = os.path.realpath(root)
    target = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real_root, target]) != real_root:
        raise OSError(errno.EXDEV, "outside the source tree", rel)
    fd = os.open(target, _OPEN_FLAGS | os.O_NOFOLLOW)
    opened = os.readlink(f"/proc/self/fd/{fd}")
    if os.path.commonpath([real_root, opened]) != real_root:
        os.close(fd)
        raise OSError(errno.EXDEV, "outside the source tree", rel)
    return fd


def dir_owners(root_fd: int, rel: str) -> list[tuple[int, int, int]]:
    """(mode, uid, gid) of each directory between the root and the source `rel` (call inside
    `acting_as`), so staged directories keep the source's modes."""
    out = []
    parts = rel.split(os.sep)[:-1]
    for i in range(len(parts)):
        try:
            st = os.stat(os.sep.join(parts[:i + 1]), dir_fd=root_fd, follow_symlinks=False)
        except OSError:
            return []
        if not stat.S_ISDIR(st.st_mode):
            return []
        out.append((st.st_mode, st.st_uid, st.st_gid))
    return out


class SourceRoots:
    """Opening a batch's sources under these rules: the descriptor of each source tree's
    root, opened once for all its files (with the rights in force: call inside `acting_as`
    where the daemon opens). close() closes them."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def _fd(self, root: str | None, follow: bool) -> int | None:
        if root is None or follow:
            return None
        fd = self._fds.get(root)
        if fd is None:
            fd = self._fds[root] = open_root(root)
        return fd

    def open(self, src: str, root: str | None, follow: bool, cached: bool = False) -> OpenSource:
        """`src` opened as `open_source` does: beneath `root` (None: a list's file that may
        lie anywhere) unless `follow`."""
        return open_source(self._fd(root, follow), root or "/", src, follow, cached)

    def tree_dirs(self, src: str, root: str | None, follow: bool, path: str) -> list[tuple[int, int, int]]:
        """`dir_owners` of the directories above `src` when it is staged at its place in
        its tree (`path` is its path below `root`); [] for a list's file."""
        fd = self._fd(root, follow)
        if fd is None or root is None:
            return []
        rel = _plainly_below(src, root) or os.path.relpath(src, root)
        if rel.split(os.sep) != [p for p in path.split("/") if p]:
            return []
        return dir_owners(fd, rel)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class CachedFirst:
    """Whether trying the kernel's caches first pays off: after a batch where most sources
    were not cached (a cold tree: every try fails, and costs a syscall), the next
    RETRY_EVERY batches go straight to the parallel path; then it tries again."""

    RETRY_EVERY = 16

    def __init__(self) -> None:
        self._skip = 0

    def worth_trying(self) -> bool:
        if self._skip:
            self._skip -= 1
            return False
        return True

    def tried(self, cached: int, total: int) -> None:
        if total and cached * 2 < total:
            self._skip = self.RETRY_EVERY


def read_cached(src: OpenSource) -> bytes:
    """The whole content of an opened source if the page cache holds it (a read with
    RWF_NOWAIT, which never waits for the disk); NotCached if it does not, or if the read
    is short or long (the file changed: `read_bounded` then says how)."""
    buf = bytearray(src.size + 1)  # one more byte: a file that grew reads long
    try:
        n = os.preadv(src.fd, [buf], 0, os.RWF_NOWAIT)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
            raise NotCached(str(src.fd)) from None
        raise
    if n != src.size:
        raise NotCached(str(src.fd))
    del buf[n:]
    return bytes(buf)


def read_ahead(src: OpenSource) -> None:
    """Ask the kernel to start reading the whole of an opened source now, without waiting
    (POSIX_FADV_WILLNEED). Given for many files before the first is read, the disk (or a
    network filesystem's client) gets their reads at once instead of one file at a time.
    A filesystem that does not take the advice is read as before."""
    try:
        os.posix_fadvise(src.fd, 0, src.size, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass


def read_bounded(src: OpenSource, what: str, chunk: int = 8 << 20) -> Iterator[bytes]:
    """The content of an opened source in pieces of at most `chunk` bytes: exactly the size
    fstat gave at open. A file that turns out shorter, or longer, fails (it changed)."""
    off = 0
    while off < src.size:
        data = os.pread(src.fd, min(chunk, src.size - off), off)
        if not data:
            raise SourceRefused(f"{what} shrank while it was staged ({off} of {src.size} bytes): stage it again")
        off += len(data)
        yield data
    if os.pread(src.fd, 1, off):
        raise SourceRefused(f"{what} grew while it was staged (past {src.size} bytes): stage it again")


__all__ = ["Credentials", "OpenSource", "SourceRefused", "NotCached", "CachedFirst", "read_cached", "acting_as", "run_as",
           "SourceRoots", "open_root", "open_source", "read_ahead", "read_bounded", "dir_owners", "relative_to_root", "check_can_act_for"]

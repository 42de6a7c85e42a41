"""The floor: a minimal in-memory pyfuse3 filesystem, for benchmarks only.

It does the least a pyfuse3 filesystem can do per request (a dict lookup, a slice), so
what it costs is pyfuse3's and the kernel's own cost: `distorefs bench ops` sets the
daemon's cost per request against it. Files keep their pages in the kernel page cache
(keep_cache, long timeouts), as distorefs does for content that never changes.

Files whose name ends in `.direct` are opened with direct_io (every read reaches the
daemon): the floor of content that is new at every open, like a sampled batch.

It counts the requests it answers by type; reading the file `.requests` in its root
returns the counts as JSON (that read adds its own LOOKUP/OPEN/READ/FLUSH/RELEASE). The
IOCTLs that no pyfuse3 handler sees (isatty at every open by Python) are counted by
distorefs' libfuse library (mount/interpose.py), loaded for that alone: as in distorefs.

    python -m distorefs.tools.floorfs MOUNTPOINT [--ready-file PATH]

`FloorMount` starts and stops one for a benchmark.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from distorefs.mount import interpose  # before pyfuse3: its calls bind to the library's

import pyfuse3  # noqa: E402
import trio  # noqa: E402

interpose.count_only()

TIMEOUT = 300.0
CONTROL = b".requests"


class _Node:
    __slots__ = ("ino", "mode", "data", "children", "mtime_ns", "uid", "gid", "direct")

    def __init__(self, ino: int, mode: int, uid: int, gid: int, direct: bool = False) -> None:
        self.direct = direct
        self.ino = ino
        self.mode = mode
        self.data = bytearray()
        self.children: dict[bytes, int] | None = {} if stat.S_ISDIR(mode) else None
        self.mtime_ns = time.time_ns()
        self.uid = uid
        self.gid = gid


class FloorFs(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self) -> None:
        super().__init__()
        self.requests: Counter[str] = Counter()
        self.nodes = {pyfuse3.ROOT_INODE: _Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, os.getuid(), os.getgid())}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.control_ino = self._new(stat.S_IFREG | 0o444, os.getuid(), os.getgid()).ino
        self.control_fh = 1 << 40
        self.snapshots: dict[int, bytes] = {}
        self.next_fh = 1

    def _new(self, mode: int, uid: int, gid: int, direct: bool = False) -> _Node:
        node = _Node(self.next_ino, mode, uid, gid, direct)
        self.nodes[node.ino] = node
        self.next_ino += 1
        return node

    def _attrs(self, node: _Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.st_mode = node.mode
        a.st_nlink = 2 if node.children is not None else 1
        a.st_uid, a.st_gid = node.uid, node.gid
        a.st_size = len(node.data)
        a.st_blksize = 128 << 10
        a.st_blocks = (len(node.data) + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        a.entry_timeout = a.attr_timeout = TIMEOUT
        if node.ino == self.control_ino:
            a.attr_timeout = 0
            a.st_size = 1 << 20
        return a

    def _dir(self, ino: int) -> _Node:
        node = self.nodes.get(ino)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if node.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node

    async def lookup(self, parent_inode, name, ctx=None):
        self.requests["lookup"] += 1
        if parent_inode == pyfuse3.ROOT_INODE and name == CONTROL:
            return self._attrs(self.nodes[self.control_ino])
        ino = self._dir(parent_inode).children.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(self.nodes[ino])

    async def forget(self, inode_list):
        self.requests["forget"] += 1

    async def getattr(self, inode, ctx=None):
        self.requests["getattr"] += 1
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(node)

    async def setattr(self, inode, attr, fields, fh, ctx):
        self.requests["setattr"] += 1
        node = self.nodes[inode]
        if fields.update_size:
            size = attr.st_size
            if size < len(node.data):
                del node.data[size:]
            else:
                node.data.extend(bytes(size - len(node.data)))
        if fields.update_mode:
            node.mode = (node.mode & ~0o7777) | (attr.st_mode & 0o7777)
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        return self._attrs(node)

    async def statfs(self, ctx):
        self.requests["statfs"] += 1
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        st.f_blocks = st.f_bfree = st.f_bavail = 1 << 30
        st.f_files = st.f_ffree = st.f_favail = 1 << 20
        st.f_namemax = 255
        return st

    async def mkdir(self, parent_inode, name, mode, ctx):
        self.requests["mkdir"] += 1
        parent = self._dir(parent_inode)
        if name in parent.children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = self._new(stat.S_IFDIR | (mode & 0o7777), ctx.uid, ctx.gid)
        parent.children[name] = node.ino
        return self._attrs(node)

    async def unlink(self, parent_inode, name, ctx):
        self.requests["unlink"] += 1
        parent = self._dir(parent_inode)
        if parent.children.pop(name, None) is None:
            raise pyfuse3.FUSEError(errno.ENOENT)

    async def opendir(self, inode, ctx):
        self.requests["opendir"] += 1
        self._dir(inode)
        return inode

    async def readdir(self, fh, start_id, token):
        self.requests["readdir"] += 1
        items = list(self.nodes[fh].children.items())
        for i, (name, ino) in enumerate(items[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, name, self._attrs(self.nodes[ino]), i):
                break

    async def releasedir(self, fh):
        self.requests["releasedir"] += 1

    async def create(self, parent_inode, name, mode, flags, ctx):
        self.requests["create"] += 1
        parent = self._dir(parent_inode)
        ino = parent.children.get(name)
        if ino is None:
            node = self._new(stat.S_IFREG | (mode & 0o7777), ctx.uid, ctx.gid, name.endswith(b".direct"))
            parent.children[name] = node.ino
        else:
            node = self.nodes[ino]
            node.data.clear()
        return self._info(node), self._attrs(node)

    @staticmethod
    def _info(node: _Node) -> pyfuse3.FileInfo:
        if node.direct:
            return pyfuse3.FileInfo(fh=node.ino, direct_io=True)
        return pyfuse3.FileInfo(fh=node.ino, keep_cache=True)

    async def open(self, inode, flags, ctx):
        self.requests["open"] += 1
        if inode == self.control_ino:
            fh = self.control_fh = self.control_fh + 1
            counts = dict(self.requests)
            ioctls = interpose.ioctl_replies()
            if ioctls:
                counts["ioctl"] = ioctls
            self.snapshots[fh] = (json.dumps(counts) + "\n").encode()
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        node = self.nodes[inode]
        if flags & os.O_TRUNC:
            node.data.clear()
        return self._info(node)

    async def read(self, fh, off, size):
        self.requests["read"] += 1
        snap = self.snapshots.get(fh)
        if snap is not None:
            return snap[off:off + size]
        return memoryview(self.nodes[fh].data)[off:off + size].tobytes()

    async def write(self, fh, off, buf):
        self.requests["write"] += 1
        data = self.nodes[fh].data
        end = off + len(buf)
        if off > len(data):
            data.extend(bytes(off - len(data)))
        data[off:end] = buf
        return len(buf)

    async def flush(self, fh):
        self.requests["flush"] += 1

    async def fsync(self, fh, datasync):
        self.requests["fsync"] += 1

    async def release(self, fh):
        self.requests["release"] += 1
        self.snapshots.pop(fh, None)


def _is_mounted(mnt: Path) -> bool:
    target = str(mnt.resolve())
    with open("/proc/mounts") as f:
        return any(line.split()[1].replace("\\040", " ") == target for line in f)


class FloorMount:
    """A floor filesystem mounted at `mnt` in a child process of ours."""

    name = "floor"

    def __init__(self, mnt: Path) -> None:
        self.mnt = Path(mnt)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def mount(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        ready = self.mnt.parent / f"{self.mnt.name}.ready"
        ready.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "distorefs.tools.floorfs", str(self.mnt),
                                      "--ready-file", str(ready)], stdin=subprocess.DEVNULL, cwd="/")
        deadline = time.monotonic() + 30
        while not (ready.exists() and _is_mounted(self.mnt)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the floor filesystem did not mount")
            time.sleep(0.02)

    def umount(self) -> None:
        if self.proc is None:
            return
        if _is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own floor process
            self.proc.wait(timeout=10)
        self.proc = None

    def requests(self) -> Counter:
        with open(self.mnt / CONTROL.decode(), "rb") as f:
            return Counter(json.loads(f.read()))


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    ready = None
    if "--ready-file" in args:
        i = args.index("--ready-file")
        ready = args[i + 1]
        del args[i:i + 2]
    mountpoint = args[0]
    fs = FloorFs()
    options = set(pyfuse3.default_options) | {"fsname=floorfs", "subtype=floorfs"}
    pyfuse3.init(fs, mountpoint, options)
    if ready:
        with open(ready, "w") as f:
            f.write(f"{os.getpid()}\n")
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()

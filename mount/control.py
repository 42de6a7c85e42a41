"""Control files of `.distorefs/` whose behaviour depends on the caller.

`wait`: block until a weights file passes a version, without polling. Write one line
"PATH VERSION" (PATH below weights/, e.g. "MODEL/model.bin 12"), then read: the read
returns "NEWVERSION\\n" once the file's version is above VERSION, at once if it already
is. Under O_NONBLOCK the read fails with EAGAIN instead of waiting.

`stats.json` and `metrics`: the store's statistics as the caller may see them: the
sections of namespaces the caller may not list (read and search on their directory) are
left out, and recovery's findings (which name entries) are the mount owner's and root's.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

import pyfuse3

from distorefs.errors import InvalidArgument, NotPermitted
from distorefs.sources import Credentials

from .callers import abandoned_by
from .handles import BytesReader, Handle, wants_write
from .nodes import NO_CACHE, Node, make_attrs

if TYPE_CHECKING:
    from .operations import Filesystem


class WaitHandle(Handle):
    direct_io = True

    def __init__(self, fs: "Filesystem", nonblocking: bool, pid: int) -> None:
        self.fs = fs
        self.nonblocking = nonblocking
        # READ carries no caller: the process that opened the file is the one watched.
        self.abandoned = abandoned_by(pid)
        self.request: tuple[str, int] | None = None
        self.answer: bytes | None = None
        self.served = 0

    async def write(self, off: int, buf: bytes) -> int:
        try:
            path, version = buf.decode().strip().rsplit(None, 1)
            number = int(version)
        except ValueError:
            raise InvalidArgument(f"expected 'PATH VERSION', got {buf[:80]!r}") from None
        path = path.strip("/")
        if path.startswith("weights/"):
            path = path[len("weights/"):]
        self.request = (path, number)
        self.answer = None
        self.served = 0
        return len(buf)

    async def read(self, off: int, size: int) -> bytes:
        # The read follows the write on the same descriptor, so `off` is past the request:
        # the answer is served from its own cursor (then EOF), whatever the file offset.
        if self.request is None:
            raise InvalidArgument("write 'PATH VERSION' first")
        if self.answer is None:
            number = await self.fs.store.weights.wait_newer(*self.request, self.nonblocking, self.abandoned)
            self.answer, self.served = b"%d\n" % number, 0
        chunk = self.answer[self.served:self.served + size]
        self.served += len(chunk)
        return chunk


class WaitFile(Node):
    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        return make_attrs(self.ino, stat.S_IFREG | 0o666, 0, self.fs.uid, self.fs.gid, self.fs.started_ns, NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        return WaitHandle(self.fs, bool(flags & os.O_NONBLOCK), ctx.pid if ctx is not None else 0)

    async def setattr(self, attr, fields, handle, ctx) -> None:
        pass  # `>` truncates first: nothing to truncate


def caller(ctx) -> Credentials | None:
    return None if ctx is None else Credentials.of_caller(ctx.pid, ctx.uid, ctx.gid)


def stats_for(fs: "Filesystem", cred: Credentials | None) -> dict:
    """The mount's stats with what `cred` may not list left out (None: everything)."""
    stats = fs.stats()
    if cred is None or cred.uid in (0, fs.uid):
        return stats
    for kind in ("buffers", "banks", "datasets"):
        section, spaces = stats.get(kind), fs.store.namespaces[kind]
        if isinstance(section, dict):
            stats[kind] = {name: value for name, value in section.items()
                           if name in spaces and cred.may(spaces[name].owner.mode, spaces[name].owner.uid,
                                                          spaces[name].owner.gid, 0o5)}
    if isinstance(stats.get("recovery"), dict):
        stats["recovery"] = {k: v for k, v in stats["recovery"].items() if k != "findings"}
    return stats


class CallerStatsFile(Node):
    """.distorefs/stats.json or metrics, rendered for whoever opens it (see the module)."""

    def __init__(self, fs: "Filesystem", render) -> None:
        super().__init__(fs)
        self.render = render  # stats dict -> bytes

    def attributes(self, ctx=None) -> pyfuse3.EntryAttributes:
        # Size 0, as /proc files: read with direct_io to the end; a size that moved with the
        # content made `tar c MNT` report the file changed as it read it.
        return make_attrs(self.ino, stat.S_IFREG | 0o444, 0, self.fs.uid, self.fs.gid, self.fs.started_ns, NO_CACHE)

    async def open(self, flags: int, ctx) -> Handle:
        if wants_write(flags):
            raise NotPermitted("read-only file")
        return BytesReader(self.render(stats_for(self.fs, caller(ctx))), cacheable=False)

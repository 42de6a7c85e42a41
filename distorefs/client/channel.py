"""The client's end of `buffers/NAME/client`: requests written, replies read back.

One open file is one session with the daemon (distorefs/clientsession.py). A request is
one pwrite at offset 0; a reply is read from offset 0 until the length its first four
bytes give. The daemon's errors arrive as the write's OSError, with the errno the file
path would give (EAGAIN, EINVAL, ENOENT ...).
"""

from __future__ import annotations

import os
import struct

from .. import clientwire as wire

_U32 = struct.Struct("<I")
FIRST_READ = 256 << 10


class Channel:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self.pid = os.getpid()

    def send(self, request: bytes | memoryview) -> None:
        """Write one or more request frames (at offset 0: the daemon reads them in order)."""
        view = memoryview(request)
        done = 0
        while done < len(view):  # a FUSE write is whole or fails; a short one continues
            done += os.pwrite(self.fd, view[done:], done)

    def call(self, request: bytes) -> tuple[dict, dict]:
        """Send a request that has a reply; the reply's (meta, arrays)."""
        self.send(request)
        return wire.unpack_tables(self.read_reply())

    def read_reply(self) -> memoryview:
        head = os.pread(self.fd, FIRST_READ, 0)
        if len(head) < 4:
            raise OSError(f"{self.path}: no reply")
        (total,) = _U32.unpack_from(head)
        if total <= len(head):
            return memoryview(head)[4:total]
        out = bytearray(total)
        out[:len(head)] = head
        got = len(head)
        while got < total:
            chunk = os.pread(self.fd, total - got, got)
            if not chunk:
                raise OSError(f"{self.path}: reply cut short at {got} of {total} bytes")
            out[got:got + len(chunk)] = chunk
            got += len(chunk)
        return memoryview(out)[4:]

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

"""A file's content while it is being written: sparse, copy-on-write staging.

A draft starts from a published content (a list of stored chunks, None for a hole) and
keeps only what is written since, in a sparse spool file on disk: memory stays bounded
whatever the file size, holes stay holes (a 1 TB ftruncate writes nothing), and a chunk
not written is read from its stored value until it is. A chunk is copied into the spool
the first time a write or a truncate changes part of it (copy on write, a chunk at a time),
so opening a big file for writing copies nothing, and publishing stores only the chunks
written (`plan`): the others are kept as they are.

Concurrency: every change runs on the event loop and holds the draft's lock around its
thread hand-off, so a publish (which reads the spool in a worker thread) sees no write
half done.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import trio

from .errors import TooLarge
from .values import StoredValue

Fetch = Callable[[int, StoredValue], Awaitable[bytes]]


class Draft:
    def __init__(self, spool_dir: Path, chunk_bytes: int, limit: int, base: Sequence[StoredValue | None],
                 base_size: int, fetch: Fetch) -> None:
        self.chunk_bytes = chunk_bytes
        self.limit = limit
        self.base: list[StoredValue | None] = list(base)
        self.size = base_size
        self.fetch = fetch
        self.written: set[int] = set()  # chunks whose content is in the spool
        self.lock = trio.Lock()
        self.fd, self.path = tempfile.mkstemp(dir=spool_dir, prefix="draft-")
        self.changes = 0  # writes and truncates since it was made (0: nothing to publish)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # ----- reads ------------------------------------------------------------------------

    async def read(self, off: int, size: int) -> bytes:
        end = min(off + size, self.size)
        if off >= end:
            return b""
        step = self.chunk_bytes
        parts = []
        for i in range(off // step, (end - 1) // step + 1):
            lo, hi = max(off, i * step), min(end, (i + 1) * step)
            parts.append(await self._chunk_range(i, lo, hi))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _chunk_range(self, i: int, lo: int, hi: int) -> bytes:
        if i in self.written:
            got = await trio.to_thread.run_sync(os.pread, self.fd, hi - lo, lo)
        else:
            base = self.base[i] if i < len(self.base) else None
            if base is None:
                return bytes(hi - lo)
            data = await self.fetch(i, base)
            start = i * self.chunk_bytes
            got = bytes(memoryview(data)[lo - start:hi - start])
        return got if len(got) == hi - lo else got + bytes(hi - lo - len(got))

    # ----- changes ----------------------------------------------------------------------

    async def write(self, off: int, data) -> int:
        end = off + len(data)
        if end > self.limit:
            raise TooLarge(f"a write up to byte {end} passes the file size limit of {self.limit} bytes")
        async with self.lock:
            step = self.chunk_bytes
            await self._extend(end)
            if len(data):
                for i in range(off // step, (end - 1) // step + 1):
                    whole = off <= i * step and end >= min((i + 1) * step, max(self.size, end))
                    await self._own(i, copy=not whole)
                await trio.to_thread.run_sync(os.pwrite, self.fd, data, off)
            self.size = max(self.size, end)
            self.changes += 1
        return len(data)

    async def truncate(self, size: int) -> None:
        if size > self.limit:
            raise TooLarge(f"size {size} passes the file size limit of {self.limit} bytes")
        async with self.lock:
            if size == self.size:
                return  # nothing changes (an O_TRUNC of an empty file)
            step = self.chunk_bytes
            if size < self.size:
                keep = -(-size // step)
                if size % step and (size // step) < len(self.base):
                    await self._own(size // step, copy=True)  # its tail becomes zeros
                del self.base[keep:]
                self.written = {i for i in self.written if i < keep}
            await self._extend(size)
            await trio.to_thread.run_sync(os.ftruncate, self.fd, size)
            self.size = size
            self.changes += 1

    async def _extend(self, new_size: int) -> None:
        """The file grows past its last chunk: a stored last chunk shorter than a chunk goes to
        the spool first, so every chunk but the last stays whole (readers count on it)."""
        if new_size <= self.size or not self.size % self.chunk_bytes:
            return
        last = (self.size - 1) // self.chunk_bytes
        if new_size > (last + 1) * self.chunk_bytes and last < len(self.base) and self.base[last] is not None:
            await self._own(last, copy=True)

    async def _own(self, i: int, copy: bool) -> None:
        """Chunk i is about to change: its stored content (if any) into the spool first."""
        if i in self.written:
            return
        base = self.base[i] if i < len(self.base) else None
        if base is not None and copy:
            data = await self.fetch(i, base)
            start = i * self.chunk_bytes
            view = memoryview(data)[:max(0, min(len(data), self.size - start))]
            if len(view):
                await trio.to_thread.run_sync(os.pwrite, self.fd, view, start)
        if i < len(self.base):
            self.base[i] = None
        self.written.add(i)

    # ----- publishing -------------------------------------------------------------------

    def plan(self) -> list[StoredValue | int | None]:
        """The content as chunks: a stored chunk kept as it is, an int (the index of a chunk
        to read from the spool with `chunk`), or None (a hole)."""
        step = self.chunk_bytes
        out: list[StoredValue | int | None] = []
        for i in range(-(-self.size // step)):
            if i in self.written:
                out.append(i)
            else:
                out.append(self.base[i] if i < len(self.base) else None)
        return out

    def chunk(self, i: int, holes: bool = True) -> bytes | None:
        """Chunk i of the spool (worker thread); None when it is all zeros (a hole) and the
        caller keeps holes."""
        start = i * self.chunk_bytes
        n = max(0, min(self.chunk_bytes, self.size - start))
        raw = os.pread(self.fd, n, start)
        if len(raw) < n:
            raw += bytes(n - len(raw))
        return None if holes and raw.count(0) == n else raw


__all__ = ["Draft"]

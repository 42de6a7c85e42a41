"""The Python client beside the mount: the daemon decides, the caller's process reads.

    from distorefs.client import open_buffer
    buf = open_buffer("/mnt/rl/buffers/replay")
    batch = buf.sample(256)                   # dict of arrays, as batch/256.npz holds them
    buf.update_priorities(batch["keys"], new_priorities)
    buf.insert("step-1", {"obs": obs, "reward": r})   # streamed; committed behind
    buf.flush()                               # returns once every insert so far is committed

Draws, times-sampled counts, eviction and priorities stay with the daemon; the bytes of
the values are read from the store's files here (LMDB read-only, segment files),
verified and decoded on the caller's cores. A caller that may not read the store's files
gets the same interface through the file path (`FileBuffer`), told once by a warning.
Imports neither pyfuse3 nor trio.
"""

from __future__ import annotations

import os
import warnings

from .buffer import ClientBuffer, InsertFailed
from .filepath import FileBuffer

_warned: set[str] = set()


def open_buffer(path: str | os.PathLike, *, direct: bool | None = None,
                read_ahead: bool = False) -> ClientBuffer | FileBuffer:
    """buffers/NAME of a mounted store. `direct` None: read the store's files when this
    process may, else (said once, as a warning) the file path; True: the store's files or an
    error; False: the file path. `read_ahead`: each sample(n) has the next batch of
    n drawn while the caller works (see ClientBuffer.sample)."""
    if direct is False:
        return FileBuffer(path)
    try:
        return ClientBuffer.open(path, read_ahead=read_ahead)
    except OSError as exc:
        if direct:
            raise
        mount = os.fspath(path)
        if mount not in _warned:
            _warned.add(mount)
            warnings.warn(f"distorefs.client: {mount}: cannot read the store directly ({exc}); "
                          f"using the file path (same results, more daemon round trips)", stacklevel=2)
        return FileBuffer(path)


__all__ = ["open_buffer", "ClientBuffer", "FileBuffer", "InsertFailed"]

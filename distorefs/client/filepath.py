"""The same replay-buffer interface through the file path, for callers that cannot read
the store's files (another user's store, a mount with allow_other, a read-only mount).

Identical results, more daemon round trips: `sample(n)` is `np.load(batch/N.npz)`,
priorities are lines written to `priorities`, an insert is a file written to
`entries/KEY` (committed at its close), stats come from `stats.json`.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..names import escape_key
from ..layout import Layout, place
from .buffer import InsertFailed, encode_entry, entry_key, stack


class FileBuffer:
    """buffers/NAME through its files (see module docstring)."""

    direct = False

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.isdir(os.path.join(self.path, "entries")):
            raise FileNotFoundError(errno.ENOENT, "not a buffer of a mounted store", self.path)
        self.committed = 0
        self.failures: list = []

    def sample(self, n: int, *, nonblocking: bool = False) -> dict[str, np.ndarray]:
        flags = os.O_RDONLY | (os.O_NONBLOCK if nonblocking else 0)
        fd = os.open(os.path.join(self.path, "batch", f"{n}.npz"), flags)
        with os.fdopen(fd, "rb") as f, np.load(f) as npz:
            return {name: npz[name] for name in npz.files}

    def get(self, keys: Sequence[str | bytes] | np.ndarray) -> dict[str, np.ndarray]:
        """The entries named `keys`, stacked as a batch is (see ClientBuffer.get), each read
        from entries/KEY; arrays by the buffer's layout, plain bytes as data and offsets."""
        from ..errors import NotFound
        values = []
        for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys):
            try:
                with open(os.path.join(os.fsencode(self.path), b"entries", entry_key(k)), "rb") as f:
                    values.append(f.read())
            except FileNotFoundError:
                raise NotFound(f"{self.path}: no entry {k!r}") from None
        raw = [entry_key(k) for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys)]
        seqs = [int(os.getxattr(os.path.join(os.fsencode(self.path), b"entries", k), "user.distorefs.seq"))
                for k in raw]
        with open(os.path.join(self.path, "config.json"), "rb") as f:
            config = json.loads(f.read())
        layout = None if config.get("raw") or config.get("schema") is None else Layout.from_json(config["schema"])
        places = np.array([place(layout, v) for v in values], dtype=np.int64) if layout is not None else None
        return stack(layout, places, values, raw, np.array(seqs, dtype=np.int64))

    def update_priorities(self, keys: Sequence[str | bytes] | np.ndarray, priorities: Sequence[float] | np.ndarray
                          ) -> None:
        raw = [entry_key(k) for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys)]
        values = np.asarray(priorities, dtype=np.float64)
        if values.shape != (len(raw),):
            raise ValueError(f"{len(raw)} keys but {values.size} priorities")
        text = b"".join(b"%s %r\n" % (escape_key(k), float(v)) for k, v in zip(raw, values.tolist()))
        with open(os.path.join(self.path, "priorities"), "wb") as f:
            f.write(text)

    def insert(self, key: str | bytes, data: Any) -> None:
        raw = entry_key(key)
        try:
            with open(os.path.join(os.fsencode(self.path), b"entries", raw), "wb") as f:
                f.write(encode_entry(data))
            self.committed += 1
        except OSError as exc:
            self.failures.append((raw.decode("utf-8", "surrogateescape"), exc.errno, str(exc)))

    def insert_many(self, items: Mapping[str | bytes, Any] | Sequence[tuple[str | bytes, Any]]) -> None:
        pairs = items.items() if isinstance(items, Mapping) else items
        for key, data in pairs:
            self.insert(key, data)

    def flush(self, keep: int = 0) -> int:
        """Every insert is committed by its close() already: `keep` changes nothing."""
        committed, failures = self.committed, self.failures
        self.committed, self.failures = 0, []
        if failures:
            raise InsertFailed(failures)
        return committed

    def stats(self) -> dict:
        with open(os.path.join(self.path, "stats.json"), "rb") as f:
            return json.loads(f.read())

    def close(self) -> None:
        pass

    def __enter__(self) -> "FileBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""A replay buffer used from the caller's process: the daemon decides, the caller reads.

`ClientBuffer.sample(n)` asks the daemon for a draw (keys, value locations, probabilities,
weights) through `buffers/NAME/client`, then reads the values from the store's files,
verifies and decodes them here, and stacks them exactly as `batch/N.npz` would. A value
that is not where the draw said (demoted, compacted, evicted, rewritten meanwhile) is
asked for again (LOCATE): moved, it is read at its new place; gone or rewritten, the whole
batch is drawn again (as the daemon does for `batch/N.npz`). A value still at the place the
daemon gives that does not verify is read once through the mount (`entries/KEY`): the
daemon's EIO there makes it a CorruptValue naming the entry.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from .. import clientwire as wire
from ..errors import CorruptValue, NotFound
from ..layout import Layout, batch_name
from ..names import check_name
from .channel import Channel
from .storereader import StoreReader, Wanted, segment_of
from ..placement import TIER_NVME

DRAW_ATTEMPTS = 3  # batches drawn again when an entry went meanwhile
LOCATE_ROUNDS = 8  # times a moving value is looked for again
SEND_BYTES = 1 << 20  # inserts sent to the daemon once this much is waiting
SEND_COUNT = 64


class InsertFailed(OSError):
    """Inserts that the daemon refused: `failures` is [(key, errno, message), ...]."""

    def __init__(self, failures: list) -> None:
        self.failures = failures
        key, code, message = failures[0]
        super().__init__(code, f"{len(failures)} insert(s) failed, first {key!r}: {message}")


def encode_entry(data: Any) -> bytes:
    """An entry's bytes: bytes as they are, an array as `.npy`, a dict of arrays as the
    `.npz` the file path stores (np.savez)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    out = io.BytesIO()
    if isinstance(data, np.ndarray):
        np.save(out, data, allow_pickle=False)
    elif isinstance(data, Mapping):
        np.savez(out, **{k: np.asarray(v) for k, v in data.items()})
    else:
        raise TypeError(f"an entry is bytes, an array or a dict of arrays, not {type(data).__name__}")
    return out.getvalue()


def entry_key(key: str | bytes) -> bytes:
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else bytes(key)
    check_name(raw)
    return raw


class ClientBuffer:
    """buffers/NAME of a mounted store, read from the caller's process (see module docstring)."""

    direct = True  # values are read from the store's files here

    def __init__(self, path: str | os.PathLike, channel: Channel, reader: StoreReader) -> None:
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path.rstrip("/"))
        self.channel = channel
        self.reader = reader
        self._lock = threading.RLock()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self.counters = {"draws": 0, "redraws": 0, "relocated": 0, "read_through_mount": 0}

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ClientBuffer":
        """Open a session; OSError (Unreadable among them) when the caller cannot use this way."""
        channel = Channel(os.path.join(os.fspath(path), "client"))
        try:
            meta, _ = channel.call(wire.frame(wire.HELLO))
            if meta.get("protocol") != wire.PROTOCOL:
                raise OSError(f"{path}: the daemon speaks client protocol {meta.get('protocol')}, "
                              f"this client {wire.PROTOCOL}")
            reader = StoreReader(meta["lmdb"])
        except BaseException:
            channel.close()
            raise
        return cls(path, channel, reader)

    def _check_fork(self) -> None:
        """A forked child (a DataLoader worker) opens its own session and environment."""
        if self.channel.pid != os.getpid():
            fresh = ClientBuffer.open(self.path)
            self.channel, self.reader = fresh.channel, fresh.reader
            self._lock = threading.RLock()
            self._pending, self._pending_bytes = [], 0

    # ----- sampling ---------------------------------------------------------------------------

    def sample(self, n: int, *, nonblocking: bool = False) -> dict[str, np.ndarray]:
        """Draw a batch of n: the arrays `batch/N.npz` would hold for this draw."""
        self._check_fork()
        with self._lock:
            for attempt in range(DRAW_ATTEMPTS):
                meta, arrays = self.channel.call(wire.draw_request(n, nonblocking))
                self.counters["draws"] += 1
                self.reader.learn_segments(meta["segments"])
                values = self._read_entries(arrays)
                if values is not None:
                    return self._assemble(meta, arrays, values)
                self.counters["redraws"] += 1
            raise NotFound(f"{self.path}: entries of {DRAW_ATTEMPTS} draws in a row went while being read; "
                           f"try again")

    def _wanted(self, arrays: dict, i: int, keys: list[bytes]) -> Wanted:
        lo, hi = arrays["loc_offsets"][i], arrays["loc_offsets"][i + 1]
        return Wanted(int(arrays["tiers"][i]), arrays["locs"][lo:hi].tobytes(), int(arrays["sizes"][i]),
                      int(arrays["stored_sizes"][i]), int(arrays["checksums"][i]), int(arrays["codecs"][i]),
                      self._what(keys[i], int(arrays["seqs"][i])))

    def _what(self, key: bytes, seq: int) -> str:
        return f"buffers/{self.name}/entries/{key.decode(errors='replace')} (seq {seq})"

    def _read_entries(self, arrays: dict) -> list[bytes] | None:
        """The drawn entries' values; None when one went (evicted, rewritten) meanwhile."""
        keys = wire.keys_of(arrays)
        wanted = [self._wanted(arrays, i, keys) for i in range(len(keys))]
        results = self.reader.read(wanted)
        for _round in range(LOCATE_ROUNDS):
            failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
            if not failed:
                return results  # type: ignore[return-value]
            for i in failed:
                if wanted[i].tier == TIER_NVME:
                    self.reader.forget_segment(segment_of(wanted[i].loc))
            seqs = arrays["seqs"][failed]
            meta, now = self.channel.call(wire.locate_request(seqs))
            self.reader.learn_segments(meta["segments"])
            present = now["present"]
            if not present.all():
                return None
            now_keys = wire.keys_of(now)
            retry = []
            for j, i in enumerate(failed):
                current = self._wanted(now, j, now_keys)
                old = wanted[i]
                if current.checksum != old.checksum or current.size != old.size or now_keys[j] != keys[i]:
                    return None  # rewritten (or renamed): not the entry that was drawn
                if current.tier == old.tier and current.loc == old.loc:
                    results[i] = self._read_through_mount(keys[i], old, results[i])  # type: ignore[arg-type]
                else:
                    self.counters["relocated"] += 1
                    wanted[i] = current
                    retry.append(i)
            for i, r in zip(retry, self.reader.read([wanted[i] for i in retry])):
                results[i] = r
        raise NotFound(f"{self.path}: drawn values keep moving; try again")

    def _read_through_mount(self, key: bytes, w: Wanted, error: Exception) -> bytes:
        """A value at its current place that did not verify here: the daemon reads it (its
        EIO is damage, logged and counted there) or the mount refuses it."""
        self.counters["read_through_mount"] += 1
        try:
            with open(os.path.join(self.path, "entries", os.fsdecode(key)), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise NotFound(f"{w.what} was removed while being read") from None
        except OSError as exc:
            raise CorruptValue(f"{w.what}: {error} (and the mount: {exc.strerror})") from None
        from .. import codec
        if len(data) != w.size or codec.checksum(data) != w.checksum:
            raise CorruptValue(f"{w.what}: {error}")
        return data

    def _assemble(self, meta: dict, arrays: dict, values: list[bytes]) -> dict[str, np.ndarray]:
        n = len(values)
        out: dict[str, np.ndarray] = {}
        layout = meta.get("layout")
        if layout is not None:
            places = arrays["places"]
            for j, f in enumerate(Layout.from_json(layout).fields):
                stacked = np.empty((n, *f.shape), dtype=np.dtype(f.dtype))
                rows = stacked.reshape(n, -1).view(np.uint8) if stacked.size else None
                nbytes = f.nbytes
                if rows is not None:
                    rows = rows.reshape(n, nbytes)
                    for i, (value, off) in enumerate(zip(values, places[:, j].tolist())):
                        rows[i] = np.frombuffer(value, dtype=np.uint8, count=nbytes, offset=off)
                out[batch_name(f)] = stacked
        else:
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([len(v) for v in values], out=offsets[1:])
            out["data"] = np.frombuffer(b"".join(values), dtype=np.uint8)
            out["offsets"] = offsets
        keys = [k.decode("utf-8", "surrogateescape") for k in wire.keys_of(arrays)]
        out["keys"] = np.array(keys) if keys else np.zeros(0, dtype="<U1")
        out["seqs"] = arrays["seqs"].astype(np.int64)
        out["probabilities"] = arrays["probabilities"].astype(np.float64)
        out["weights"] = arrays["weights"].astype(np.float64)
        return out

    # ----- priorities -------------------------------------------------------------------------

    def update_priorities(self, keys: Sequence[str | bytes] | np.ndarray, priorities: Sequence[float] | np.ndarray
                          ) -> None:
        """Set the priorities of entries (unknown keys, evicted since they were drawn, are
        skipped); the next draw of this buffer object sees them."""
        self._check_fork()
        raw = [entry_key(k) for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys)]
        with self._lock:
            self._send_pending()
            self.channel.send(wire.priorities_request(raw, priorities))

    # ----- inserts ----------------------------------------------------------------------------

    def insert(self, key: str | bytes, data: Any) -> None:
        """Queue an insert (bytes, an array, or a dict of arrays stored as `.npz`); it streams
        to the daemon and commits behind; `flush()` returns once it is committed."""
        self._check_fork()
        request = wire.insert_request(entry_key(key), encode_entry(data))
        with self._lock:
            self._pending.append(request)
            self._pending_bytes += len(request)
            if self._pending_bytes >= SEND_BYTES or len(self._pending) >= SEND_COUNT:
                self._send_pending()

    def insert_many(self, items: Mapping[str | bytes, Any] | Sequence[tuple[str | bytes, Any]]) -> None:
        """Queue many inserts, in order (a dict, or (key, data) pairs)."""
        pairs = items.items() if isinstance(items, Mapping) else items
        for key, data in pairs:
            self.insert(key, data)

    def _send_pending(self) -> None:
        if self._pending:
            batch, self._pending, self._pending_bytes = self._pending, [], 0
            self.channel.send(b"".join(batch))

    def flush(self) -> int:
        """Wait until every insert queued so far (and every priority update) is committed;
        how many inserts were committed since the last flush. InsertFailed names those refused."""
        self._check_fork()
        with self._lock:
            self._send_pending()
            meta, _ = self.channel.call(wire.frame(wire.FLUSH))
        if meta["errors"]:
            raise InsertFailed([tuple(e) for e in meta["errors"]])
        return int(meta["committed"])

    # ----- the rest ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """The buffer's stats.json."""
        self._check_fork()
        with self._lock:
            return self.channel.call(wire.frame(wire.STATS))[0]

    def close(self) -> None:
        """Send what is queued and end the session (inserts sent still commit)."""
        if self.channel.pid == os.getpid():
            with self._lock:
                try:
                    self._send_pending()
                finally:
                    self.channel.close()
        self.reader.close()

    def __enter__(self) -> "ClientBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

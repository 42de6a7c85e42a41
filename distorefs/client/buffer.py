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

import collections
import functools
import io
import json
import os
import queue
import threading
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import numpy as np

from .. import clientwire as wire
from ..backends.crc import crc32
from ..errors import CorruptValue, NotFound
from ..layout import Layout, batch_name
from ..names import check_name
from ..rows import field_columns
from .batchmemory import BatchMemory
from .channel import Channel
from .spool import Spool
from .storereader import StoreReader, Wanted, store_reader, segment_of
from ..placement import TIER_NVME

if TYPE_CHECKING:
    from typing_extensions import Buffer

DRAW_ATTEMPTS = 3  # batches drawn again when an entry went meanwhile
LOCATE_ROUNDS = 8  # times a moving value is looked for again
SEND_BYTES = 1 << 20  # inserts sent to the daemon once this much is waiting
SEND_COUNT = 64
SENDS_AHEAD = 2  # writes of inserts handed to the sender thread and not sent yet, at most
# Values from this size on go to the spool. Smaller ones cost the daemon little to take
# (about 0.1 ms whatever their size, against 0.5 ms for 113 KB) and are better in its LMDB
# tier, where a reader takes them from the map without a read call each.
SPOOL_MIN_BYTES = 16 << 10
SMALL_BATCH = 256 << 10  # a batch of values up to this many bytes is gathered field by field
RECENT_BATCHES = 4  # batches whose keys update_priorities knows by their sequence numbers
# Batches drawn ahead per request (read_ahead, a buffer that keeps rows): the thread hand-offs
# and the daemon's requests per batch halve; priorities written reach the draws two batches on.
READ_AHEAD_BATCHES = 2


@functools.lru_cache(maxsize=64)
def _layout(text: str) -> Layout:
    return Layout.from_json(json.loads(text))


class InsertFailed(OSError):
    """Inserts that the daemon refused: `failures` is [(key, errno, message), ...]."""

    def __init__(self, failures: list) -> None:
        self.failures = failures
        key, code, message = failures[0]
        super().__init__(code, f"{len(failures)} insert(s) failed, first {key!r}: {message}")


@functools.lru_cache(maxsize=256)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": shape})
    return out.getvalue()


def encode_entry(data: Any) -> bytes:
    """An entry's bytes: bytes as they are, an array as `.npy`, a dict of arrays as the
    `.npz` the file path stores (np.savez)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, np.ndarray) and data.flags.c_contiguous and not data.dtype.hasobject \
            and data.dtype.fields is None:
        # np.save's bytes, with its header made once per dtype and shape and the array
        # copied once (np.save goes through a BytesIO: 14 us for 113 KB against 4)
        # (numpy's stubs give an array __buffer__ only on Python 3.12 and later)
        return b"".join([_npy_header(data.dtype, data.shape), memoryview(cast("Buffer", data)).cast("B")])
    out = io.BytesIO()
    if isinstance(data, np.ndarray):
        np.save(out, data, allow_pickle=False)
    elif isinstance(data, Mapping):
        # (values typed Any: mypy matches **arrays against savez's allow_pickle: bool too)
        arrays: dict[str, Any] = {k: np.asarray(v) for k, v in data.items()}
        np.savez(out, **arrays)
    else:
        raise TypeError(f"an entry is bytes, an array or a dict of arrays, not {type(data).__name__}")
    return out.getvalue()


def entry_key(key: str | bytes) -> bytes:
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else bytes(key)
    check_name(raw)
    return raw


class RowMismatch(Exception):
    """An array copied into a batch does not have its CRC-32 (see `stack`'s `crcs`)."""


def stack(layout: Layout | None, places: np.ndarray | None, values: list[bytes], keys: list[bytes],
          seqs: np.ndarray, mask: np.ndarray | None = None,
          crcs: np.ndarray | None = None, memory: BatchMemory | None = None) -> dict[str, np.ndarray]:
    """Entries as `batch/N.npz` holds them: each field of `layout` stacked (`places`: where
    each entry's fields start, (N, fields)), or raw (`data`, `offsets`); `keys`, `seqs`.
    `mask` (sequences): the entries are the real steps of mask.shape sequences and steps, row
    by row; fields, keys and seqs are (N, L, ...), padded as batch/N.npz pads them.
    `crcs` (N, fields): each array's CRC-32, checked on its copy in the batch, where it is
    still in the CPU's cache (RowMismatch); for values not verified when read. `memory`: where
    big arrays are made (memory of earlier batches the caller let go of)."""
    return _padded(_stack(layout, places, values, keys, seqs, mask is not None, crcs, memory), mask)


def stack_rows(layout: Layout, rows: np.ndarray, keys: list[bytes], seqs: np.ndarray,
               mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """`stack` of entries given as rows (N, width): each entry's fields side by side, in the
    layout's order (distorefs/rows.py), as a draw of a buffer that keeps rows answers."""
    out = {batch_name(f, mask is not None): column.view(np.dtype(f.dtype)).reshape((len(rows), *f.shape))
           for f, column in field_columns(layout, rows)}
    out.update(_keys_and_seqs(keys, seqs))
    return _padded(out, mask)


def _keys_and_seqs(keys: list[bytes], seqs: np.ndarray) -> dict[str, np.ndarray]:
    texts = [k.decode("utf-8", "surrogateescape") for k in keys]
    return {"keys": np.array(texts) if texts else np.zeros(0, dtype="<U1"), "seqs": np.asarray(seqs, dtype=np.int64)}


def _padded(out: dict[str, np.ndarray], mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """Sequences (`mask`): the real steps' arrays placed in (N, L, ...), padded as batch/N.npz pads."""
    if mask is None:
        return out
    for name, array in out.items():
        if name in ("data", "offsets"):
            continue  # raw mode: the real steps' bytes, as they are
        full = np.zeros(mask.shape + array.shape[1:], dtype=array.dtype)  # padding: zeros, '' keys
        if name == "seqs":
            full[:] = -1
        full[mask] = array
        out[name] = full
    out["mask"] = np.array(mask, dtype=bool)  # a copy: the reply's own bytes are read-only
    return out


def _stack(layout: Layout | None, places: np.ndarray | None, values: list[bytes], keys: list[bytes],
           seqs: np.ndarray, sequences: bool, crcs: np.ndarray | None = None,
           memory: BatchMemory | None = None) -> dict[str, np.ndarray]:
    n = len(values)
    out: dict[str, np.ndarray] = {}
    if layout is not None and places is not None:
        total = sum(len(v) for v in values)
        small = total <= SMALL_BATCH  # small values: one gather per field, not one copy per entry
        if small and crcs is not None:
            raise ValueError("arrays are checked as they are copied: for batches over SMALL_BATCH")
        if small:
            joined = np.frombuffer(b"".join(values), dtype=np.uint8)
            starts = np.zeros(n, dtype=np.int64)
            np.cumsum([len(v) for v in values[:-1]], out=starts[1:])
        for j, f in enumerate(layout.fields):
            nbytes = f.nbytes
            if small:
                index = (starts + places[:, j])[:, None] + np.arange(nbytes, dtype=np.int64)
                stacked = joined[index].view(np.dtype(f.dtype)).reshape((n, *f.shape))
            else:
                stacked = (memory.empty if memory is not None else np.empty)((n, *f.shape), np.dtype(f.dtype))
                rows = stacked.reshape(n, -1).view(np.uint8).reshape(n, nbytes)
                want = crcs[:, j].tolist() if crcs is not None else None
                for i, (value, off) in enumerate(zip(values, places[:, j].tolist())):
                    rows[i] = np.frombuffer(value, dtype=np.uint8, count=nbytes, offset=off)
                    if want is not None and crc32(rows[i]) != want[i]:
                        raise RowMismatch(i)
            out[batch_name(f, sequences)] = stacked
    else:
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        out["data"] = np.frombuffer(b"".join(values), dtype=np.uint8)
        out["offsets"] = offsets
    out.update(_keys_and_seqs(keys, seqs))
    return out


def _with_draw_columns(out: dict[str, np.ndarray], probabilities: np.ndarray, weights: np.ndarray
                       ) -> dict[str, np.ndarray]:
    out["probabilities"] = probabilities.astype(np.float64)
    out["weights"] = weights.astype(np.float64)
    return out


def _rows_parts(meta: dict, arrays: dict) -> list[tuple]:
    """The batches of a rows reply (one, or several drawn ahead: `sizes`), each as the
    arguments of `_rows_batch`."""
    layout = _layout(json.dumps(meta["layout"]))
    keys = wire.keys_of(arrays)
    mask = arrays.get("mask")
    sizes = arrays["sizes"].tolist() if "sizes" in arrays else [len(keys)]
    if len(sizes) == 1:  # (sequences: probabilities and weights are per sequence, not per step)
        return [(layout, arrays["rows"], keys, arrays["seqs"], mask, arrays["probabilities"], arrays["weights"])]
    parts, at = [], 0
    for size in sizes:
        cut = slice(at, at + size)
        parts.append((layout, arrays["rows"][cut], keys[cut], arrays["seqs"][cut], None,
                      arrays["probabilities"][cut], arrays["weights"][cut]))
        at += size
    return parts


def _rows_batch(layout: Layout, rows: np.ndarray, keys: list[bytes], seqs: np.ndarray, mask: np.ndarray | None,
                probabilities: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
    return _with_draw_columns(stack_rows(layout, rows, keys, seqs, mask), probabilities, weights)


class ClientBuffer:
    """buffers/NAME of a mounted store, read from the caller's process (see module docstring)."""

    direct = True  # values are read from the store's files here

    def __init__(self, path: str | os.PathLike, channel: Channel, reader: StoreReader, *,
                 read_ahead: bool = False) -> None:
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path.rstrip("/"))
        self.channel = channel
        self.reader = reader
        self.read_ahead = read_ahead
        self._lock = threading.RLock()  # the session: one request and its reply at a time
        self._queue_lock = threading.Lock()  # requests queued to go with the next one
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._ahead: int | None = None  # n of the batch drawn ahead (read_ahead)
        self._recent: collections.deque = collections.deque(maxlen=RECENT_BATCHES)  # (keys, seqs) handed out
        self._drawn: memoryview | OSError | None = None  # its reply, once the sender thread read it
        self._kept: list[tuple[int, tuple]] = []  # batches of a reply not handed out yet (read ahead)
        self._memory = BatchMemory()  # big batches' arrays, in memory of batches let go of
        self.counters = {"draws": 0, "rows": 0, "redraws": 0, "relocated": 0, "read_through_mount": 0}
        self._spool: Spool | None = None
        self._retired_spools: list[Spool] = []  # full ones, closed with the session
        self._no_spool: str | None = None  # why values go through the channel
        self._ask_spool_again = False
        self._sends: queue.Queue | None = None  # writes handed to the sender thread (see _hand_off)
        self._send_error: BaseException | None = None
        self._inserts = 0  # queued in this session

    @classmethod
    def open(cls, path: str | os.PathLike, *, read_ahead: bool = False) -> "ClientBuffer":
        """Open a session; OSError (Unreadable among them) when the caller cannot use this way."""
        channel = Channel(os.path.join(os.fspath(path), "client"))
        try:
            meta, _ = channel.call(wire.frame(wire.HELLO))
            if meta.get("protocol") != wire.PROTOCOL:
                raise OSError(f"{path}: the daemon speaks client protocol {meta.get('protocol')}, "
                              f"this client {wire.PROTOCOL}")
            reader = store_reader(meta["lmdb"])
        except BaseException:
            channel.close()
            raise
        return cls(path, channel, reader, read_ahead=read_ahead)

    def _check_fork(self) -> None:
        """A forked child (a DataLoader worker) opens its own session and environment."""
        if self.channel.pid != os.getpid():
            fresh = ClientBuffer.open(self.path)
            self.channel, self.reader = fresh.channel, fresh.reader
            self._lock, self._queue_lock = threading.RLock(), threading.Lock()
            self._pending, self._pending_bytes = [], 0
            self._ahead, self._drawn, self._kept = None, None, []  # the parent's session's
            self._spool, self._retired_spools, self._no_spool = None, [], None  # the parent's session's
            self._ask_spool_again = False
            self._sends, self._send_error, self._inserts = None, None, 0

    # ----- sampling ---------------------------------------------------------------------------

    def sample(self, n: int, *, nonblocking: bool = False) -> dict[str, np.ndarray]:
        """Draw a batch of n: the arrays `batch/N.npz` would hold for this draw. With
        `read_ahead`, the next batch of n is drawn meanwhile (as Reverb's datasets stream
        samples ahead): the sender thread writes the request, with the priorities queued,
        and reads the daemon's answer while the caller goes on; the next sample(n) assembles
        it. Priorities written now reach the draw after it; a batch drawn ahead that is
        never taken (the caller stops, or asks for another size) still counts as drawn
        (times sampled, max_times_sampled). A draw ahead never waits for
        min_size_to_sample: the next sample does. (The thread does no more than the two
        calls: the caller's own thread assembles, so the two never take turns at the
        interpreter while the caller trains.)"""
        self._check_fork()
        ahead = self.read_ahead and not nonblocking
        with self._lock:
            kept = None
            if ahead and self._kept:
                if self._kept[0][0] == n:
                    kept = self._kept.pop(0)[1]
                else:
                    self._kept.clear()  # batches of another size: drawn, never taken
        batch: dict[str, np.ndarray] | None
        if kept is not None:
            batch = _rows_batch(*kept)
        else:
            if ahead:
                self._drain()  # the write that asked for the batches drawn ahead went (the sender thread's)
            with self._lock:
                batch = None
                drawn, self._ahead = self._ahead, None
                reply, self._drawn = self._drawn, None
                if isinstance(reply, OSError) and not isinstance(reply, BlockingIOError):
                    raise reply  # the write that carried it failed (a priority refused, say): told now
                # BlockingIOError: drawn ahead before min_size_to_sample entries were there: draw now, waiting
                if isinstance(reply, memoryview) and drawn == n and not nonblocking:
                    batch = self._draw(n, False, reply)
                if batch is None:
                    batch = self._draw(n, nonblocking)
        with self._lock:
            if batch["keys"].ndim == 1:  # (not sequences: their keys are (N, L))
                self._recent.append((batch["keys"], batch["seqs"]))
            send = ahead and not self._kept and self._ahead is None
            if send:
                self._ahead = n
        if send:
            # Written by the sender thread, with the priorities queued: the caller goes on at
            # once. Nonblocking: a draw ahead never waits in the daemon (nor keeps a process
            # from exiting).
            self._hand_off(wire.draw_request(n, True, READ_AHEAD_BATCHES))
        return batch

    def _draw(self, n: int, nonblocking: bool, reply: memoryview | None = None) -> dict[str, np.ndarray]:
        """A batch of n: drawn now, or the daemon's `reply` to a draw ahead."""
        with self._lock:
            for attempt in range(DRAW_ATTEMPTS):
                if reply is None:
                    meta, arrays = self.channel.call(self._with_pending(wire.draw_request(n, nonblocking)))
                else:
                    meta, arrays = wire.unpack_tables(reply)
                    reply = None
                self.counters["draws"] += 1
                if meta.get("rows"):  # the daemon keeps this buffer's rows: the batches are in the reply
                    parts = _rows_parts(meta, arrays)
                    self.counters["rows"] += len(parts)
                    self.counters["draws"] += len(parts) - 1
                    self._kept = [(n, part) for part in parts[1:]]  # read ahead: taken by the next samples
                    return _rows_batch(*parts[0])
                arrays = wire.entry_columns(arrays)
                self.reader.learn_segments(meta["segments"])
                keys = wire.keys_of(arrays)
                wanted = self._wanted_all(arrays, keys)
                # Big batches of arrays: each array checked as it is copied into the batch,
                # against its CRC-32 (read from memory once, not once to verify and again to copy).
                light = ("place_crcs" in arrays and "mask" not in arrays and meta.get("layout") is not None
                         and int(arrays["sizes"].sum()) > SMALL_BATCH)
                with self.reader.snapshot() as snapshot:  # values used in place, copied once: into the batch
                    first = snapshot.read(wanted, verify=not light)
                    if not any(isinstance(r, Exception) for r in first):
                        try:
                            return self._assemble(meta, arrays, first,  # type: ignore[arg-type]
                                                  arrays["place_crcs"] if light else None)
                        except RowMismatch:  # read it all again, verified: the errors say which
                            first = snapshot.read(wanted)
                            if not any(isinstance(r, Exception) for r in first):
                                return self._assemble(meta, arrays, first)  # type: ignore[arg-type]
                    first = [bytes(r) if isinstance(r, memoryview) else r for r in first]
                values = self._read_entries(arrays, keys, wanted, first)
                if values is not None:
                    return self._assemble(meta, arrays, values)
                self.counters["redraws"] += 1
            raise NotFound(f"{self.path}: entries of {DRAW_ATTEMPTS} draws in a row went while being read; "
                           f"try again")

    def get(self, keys: Sequence[str | bytes] | np.ndarray) -> dict[str, np.ndarray]:
        """The entries named `keys`, stacked as a batch is (without probabilities and
        weights): read by key, as a TorchRL storage reads. NotFound names a key not there."""
        self._check_fork()
        raw = [entry_key(k) for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys)]
        with self._lock:
            for attempt in range(DRAW_ATTEMPTS):
                meta, arrays = self.channel.call(self._with_pending(wire.get_request(raw)))
                arrays = wire.entry_columns(arrays)
                if not arrays["present"].all():
                    missing = raw[int(np.flatnonzero(~arrays["present"])[0])]
                    raise NotFound(f"buffers/{self.name}: no entry {missing.decode(errors='replace')!r}")
                self.reader.learn_segments(meta["segments"])
                keys = wire.keys_of(arrays)
                wanted = self._wanted_all(arrays, keys)
                values = self._read_entries(arrays, keys, wanted, self.reader.read(wanted))
                if values is not None:
                    return self._assemble(meta, arrays, values)
            raise NotFound(f"{self.path}: entries asked for keep changing while being read; try again")

    def _wanted_all(self, arrays: dict, keys: list[bytes]) -> list[Wanted]:
        """Where each entry of a draw's (or a locate's) tables is, and how to check it."""
        locs = arrays["locs"].tobytes()
        bounds = arrays["loc_offsets"].tolist()
        what = f"buffers/{self.name}/entries/"
        return [Wanted(tier, locs[bounds[i]:bounds[i + 1]], size, stored, crc, cdc,
                       f"{what}{keys[i].decode(errors='replace')} (seq {seq})")
                for i, (tier, size, stored, crc, cdc, seq) in enumerate(zip(
                    arrays["tiers"].tolist(), arrays["sizes"].tolist(), arrays["stored_sizes"].tolist(),
                    arrays["checksums"].tolist(), arrays["codecs"].tolist(), arrays["seqs"].tolist()))]

    def _read_entries(self, arrays: dict, keys: list[bytes], wanted: list[Wanted], results: list
                      ) -> list[bytes] | None:
        """The entries' values (of a draw, or asked for by key), given what a first read of
        them gave (`results`); None when one went (evicted, rewritten) meanwhile."""
        for _round in range(LOCATE_ROUNDS):
            failed = [i for i, r in enumerate(results) if isinstance(r, Exception)]
            if not failed:
                return results  # type: ignore[return-value]
            for i in failed:
                if wanted[i].tier == TIER_NVME:
                    self.reader.forget_segment(segment_of(wanted[i].loc))
            seqs = arrays["seqs"][failed]
            meta, now = self.channel.call(wire.locate_request(seqs))
            now = wire.entry_columns(now)
            self.reader.learn_segments(meta["segments"])
            present = now["present"]
            if not present.all():
                return None
            now_keys = wire.keys_of(now)
            now_wanted = self._wanted_all(now, now_keys)
            retry = []
            for j, i in enumerate(failed):
                current = now_wanted[j]
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

    def _assemble(self, meta: dict, arrays: dict, values: list[bytes],
                  crcs: np.ndarray | None = None) -> dict[str, np.ndarray]:
        layout = meta.get("layout")
        out = stack(_layout(json.dumps(layout)) if layout is not None else None,  # field order: as given
                    arrays.get("places"), values, wire.keys_of(arrays), arrays["seqs"], arrays.get("mask"), crcs,
                    self._memory)
        if "probabilities" not in arrays:  # a get's, not a draw's
            return out
        return _with_draw_columns(out, arrays["probabilities"], arrays["weights"])

    # ----- priorities -------------------------------------------------------------------------

    def update_priorities(self, keys: Sequence[str | bytes] | np.ndarray, priorities: Sequence[float] | np.ndarray
                          ) -> None:
        """Set the priorities of entries (unknown keys, evicted since they were drawn, are
        skipped). They go to the daemon with the next request of this buffer object and are
        committed behind it, in order (a draw right after may not see them yet); `flush()`
        returns once they are committed. The `keys` of one of the last batches drawn (a
        learner giving back its batch's TD errors) go by the entries' sequence numbers: an
        entry evicted since is skipped even when a newer one took its key."""
        self._check_fork()
        seqs = self._seqs_of(keys)
        if seqs is not None:  # nothing to encode or look up: one round trip and the keys saved
            self._queue(wire.priorities_seqs_request(seqs, priorities))
            return
        # not checked here: the daemon skips keys it does not have, as it does evicted ones
        raw = [k.encode("utf-8", "surrogateescape") if isinstance(k, str) else bytes(k)
               for k in (keys.tolist() if isinstance(keys, np.ndarray) else keys)]
        self._queue(wire.priorities_request(raw, priorities))  # sent with the next request: one round trip saved

    def _seqs_of(self, keys: object) -> np.ndarray | None:
        """The sequence numbers of `keys` when they are the keys of one of the last batches
        drawn (the same array, or an equal one), else None."""
        if not isinstance(keys, np.ndarray) or keys.ndim != 1:
            return None
        for drawn, seqs in reversed(self._recent):
            if keys is drawn or (keys.shape == drawn.shape and keys.dtype == drawn.dtype
                                 and np.array_equal(keys, drawn)):
                return seqs
        return None

    # ----- inserts ----------------------------------------------------------------------------

    def insert(self, key: str | bytes, data: Any) -> None:
        """Queue an insert (bytes, an array, or a dict of arrays stored as `.npz`); it streams
        to the daemon and commits behind; `flush()` returns once it is committed. With a
        spool (distorefs/client/spool.py) a value of SPOOL_MIN_BYTES or more is encoded and
        written to the store here, and only its description goes to the daemon."""
        self._check_fork()
        raw_key, raw = entry_key(key), encode_entry(data)
        self._inserts += 1  # counted as the daemon counts them (see flush's keep)
        spool = self._spool_now() if len(raw) >= SPOOL_MIN_BYTES else None
        request = spool.store(raw_key, raw) if spool is not None else None
        self._queue(request if request is not None else wire.insert_request(raw_key, raw))

    def _spool_now(self) -> Spool | None:
        """The spool to write a value to: asked for on the first insert (and again when full,
        or after a flush when the buffer had no layout yet); None: the channel carries values."""
        spool = self._spool
        if spool is not None and not spool.full:
            return spool
        if self._no_spool is not None:
            return None
        with self._lock:
            if self._spool is not spool:  # another thread got the next one meanwhile
                return self._spool
            meta, _ = self.channel.call(self._with_pending(wire.frame(wire.SPOOL)))
            if meta.get("path") is None:
                self._no_spool = str(meta.get("why"))
                self._ask_spool_again = bool(meta.get("later"))
                return None
            try:
                fresh = Spool(meta)
            except OSError as exc:  # the store's files are the daemon's user's
                self._no_spool = f"cannot write {meta['path']}: {exc.strerror}"
                warnings.warn(f"{self.path}: values go through the mount ({self._no_spool})", stacklevel=3)
                return None
            if spool is not None:
                self._retired_spools.append(spool)
            self._spool = fresh
            return fresh

    def insert_many(self, items: Mapping[str | bytes, Any] | Sequence[tuple[str | bytes, Any]]) -> None:
        """Queue many inserts, in order (a dict, or (key, data) pairs)."""
        pairs = items.items() if isinstance(items, Mapping) else items
        for key, data in pairs:
            self.insert(key, data)

    def _queue(self, request: bytes) -> None:
        with self._queue_lock:
            self._pending.append(request)
            self._pending_bytes += len(request)
            full = self._pending_bytes >= SEND_BYTES or len(self._pending) >= SEND_COUNT
        if full:
            self._hand_off()

    def _hand_off(self, request: bytes | None = None) -> None:
        """What is queued (and `request`, a draw ahead, last) goes to the sender thread:
        the caller goes on encoding and writing values, or training, while the daemon takes
        these (its write returns once it has), up to SENDS_AHEAD writes ahead; then it
        waits for the daemon, as Reverb's writers do."""
        self._raise_send_error()
        pending = self._take_pending()
        if request is not None:
            pending.append(request)
        if not pending:
            return
        if self._sends is None:
            self._sends = queue.Queue(maxsize=SENDS_AHEAD)
            threading.Thread(target=self._send_loop, args=(self._sends,), daemon=True,
                             name="distorefs-client-sender").start()
        self._sends.put((b"".join(pending), request is not None))

    def _send_loop(self, sends: queue.Queue) -> None:
        while True:
            item = sends.get()
            try:
                if item is None:
                    return
                data, draw = item
                with self._lock:
                    if not draw:
                        self.channel.send(data)
                        continue
                    try:  # the batch drawn ahead: its reply (or the write's error) for the next sample()
                        self.channel.send(data)
                        self._drawn = self.channel.read_reply()
                    except OSError as exc:
                        self._drawn = exc
            except BaseException as exc:  # told to the caller at its next insert or flush
                if self._send_error is None:
                    self._send_error = exc
            finally:
                sends.task_done()

    def _drain(self) -> None:
        """Wait for the sender thread's writes (before a request that must follow them:
        FLUSH, the end of the session); call it without holding the session's lock."""
        if self._sends is not None:
            self._sends.join()
        self._raise_send_error()

    def _raise_send_error(self) -> None:
        error, self._send_error = self._send_error, None
        if error is not None:
            raise error

    def _take_pending(self) -> list[bytes]:
        with self._queue_lock:
            pending, self._pending, self._pending_bytes = self._pending, [], 0
        return pending

    def _with_pending(self, request: bytes) -> bytes:
        """`request` after what is queued (inserts, priorities), to go in one write."""
        pending = self._take_pending()
        return b"".join(pending + [request]) if pending else request

    def _send_pending(self) -> None:
        pending = self._take_pending()
        if pending:
            self.channel.send(b"".join(pending))

    def flush(self, keep: int = 0) -> int:
        """Wait until every insert queued so far (and every priority update) is committed;
        how many inserts were committed since the last flush. InsertFailed names those refused.
        `keep`: all but the last `keep` inserts (and no priority update), as a Reverb writer's
        flush(block_until_num_items=keep) leaves that many in flight: every insert is sent,
        the newest go on committing while the caller writes more."""
        self._check_fork()
        self._drain()
        with self._lock:
            request = wire.flush_request(max(0, self._inserts - keep) if keep > 0 else None)
            meta, _ = self.channel.call(self._with_pending(request))
            if self._ask_spool_again:  # the first entry may have fixed the layout: ask at the next insert
                self._no_spool, self._ask_spool_again = None, False
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
        self._ahead = None  # a batch drawn ahead is released by the daemon when the session ends
        if self.channel.pid == os.getpid():
            try:
                self._drain()
            finally:
                if self._sends is not None:
                    self._sends.put(None)  # the sender thread ends
                    self._sends = None
            with self._lock:
                try:
                    self._send_pending()
                finally:
                    self.channel.close()
                    for spool in self._retired_spools + ([self._spool] if self._spool is not None else []):
                        spool.close()
        self.reader.close()
        self._memory.clear()

    def __enter__(self) -> "ClientBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

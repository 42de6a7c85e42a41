"""The daemon's side of the client beside the mount: one session per open `buffers/NAME/client`.

The daemon keeps every decision - what is drawn, times-sampled counts, max_times_sampled,
min_size_to_sample, eviction, priorities - and the client reads the bytes: a draw answers
with the entries' keys and value locations (distorefs/clientwire.py), and the client
reads, verifies and decodes the values in its own process (distorefs/client).

Invariants:
- A drawn batch stays the session's until its next draw or its close: entries it spent
  (max_times_sampled) are removed only then, so the client reads their values first.
- A location handed out is that of a committed value. It may move (demotion, compaction)
  or go (eviction, rewrite) right after; the client finds out by the checksum or a missing
  value and asks again (LOCATE), never trusting bytes that do not verify.
- Inserts are committed behind the write that sent them, in the order sent, many to a
  commit group; FLUSH returns once every insert sent before it is committed (or failed),
  with the failures. What a session holds of unsent inserts is bounded (MAX_INFLIGHT):
  a write waits for commits past it, a wait bounded by the caller's interest.
- Spools: a session that may write gets, on asking (SPOOL), a segment of the store of its
  own, and writes its values there itself (encoded and checksummed in its process, on its
  cores); a STORED request then names the record, and the insert commits like any other,
  adopting the value where it is (distorefs/backends/segments.py, `adopt`). Only the
  session's own spools are adopted from; they stay open until the session is closed and
  its queued inserts are committed.
- The rate limiter (distorefs/ratelimit.py) admits an insert of a new key when it arrives,
  before it is queued: the write carrying it waits there (bounded by the caller's interest
  like every wait), and the insert's ticket is released once its commit is done.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import trio

from . import clientwire as wire
from .backends.segments import LOCATION
from .batch import Batch, SequenceBatch
from .buffer import Buffer
from .dataset import Dataset
from .errors import DistorefsError, InvalidArgument
from .layout import Layout
from .owner import Owner
from .placement import TIER_NVME
from .ratelimit import InsertTicket
from .ring import SpooledEntry, value_size
from .values import Spooled, StoredValue, ValueLayer
from .waiting import Abandoned, wait_event

log = logging.getLogger(__name__)

MAX_INFLIGHT = 64 << 20  # bytes of sent, uncommitted inserts a session holds
SPOOLED_BYTES = 1024  # what a queued insert of a spooled value counts against MAX_INFLIGHT
MAX_PRIORITY_UPDATES = 256  # priority writes of a session not committed yet before a draw waits


def _held(data: bytes | SpooledEntry) -> int:
    """What a queued insert counts against MAX_INFLIGHT."""
    return SPOOLED_BYTES if isinstance(data, SpooledEntry) else len(data)


class ClientSession:
    def __init__(self, buffer: Buffer, values: ValueLayer, lmdb_path: Path, owner: Owner, *,
                 abandoned: Abandoned | None = None, read_only: bool = False) -> None:
        """A session of a client of `buffer`; inserts are made with `owner` (the opener's)."""
        self.buffer = buffer
        self.values = values
        self.lmdb_path = lmdb_path
        self.owner = owner
        self.abandoned = abandoned
        self.read_only = read_only
        self.held: list[Batch] = []  # the batches of the last draw (their spent entries go at the next)
        self.told: set[int] = set()  # segments whose path the client was given
        self.priorities: list = []  # queued priority commits (failed or not done yet), waited for by FLUSH
        self.queue: list[tuple[bytes, bytes | SpooledEntry]] = []
        self.tickets: list[InsertTicket] = []  # the rate limiter's, of the queued inserts of new keys
        self.inflight = 0  # bytes sent and not yet committed
        self.committing = False
        self.committed = 0
        self.received = 0  # inserts the client sent (its count: see flush's `upto`)
        self.done = 0  # of those, committed or failed
        self.errors: list[list] = []
        self.changed = trio.Event()
        self.closed = False
        self.spools: list[int] = []  # segments this session's client appends to

    # ----- requests --------------------------------------------------------------------------

    async def request(self, op: int, payload: memoryview) -> bytes | None:
        """Carry out one request; its reply, if the op has one."""
        if op == wire.HELLO:
            return wire.reply_json({"protocol": wire.PROTOCOL, "lmdb": str(self.lmdb_path),
                                    "buffer": self.buffer.name, "read_only": self.read_only})
        if op == wire.DRAW:
            n, nonblocking, batches = wire.parse_draw(payload)
            return await self.draw(n, nonblocking, batches)
        if op == wire.LOCATE:
            return await self.locate(wire.parse_numbers(payload))
        if op == wire.GET:
            return await self.get(wire.parse_get(payload))
        if op == wire.PRIORITIES:
            self.set_priorities(wire.parse_priorities(payload))
            return None
        if op == wire.PRIORITIES_SEQS:
            seqs, values = wire.parse_priorities_seqs(payload)
            self._queued(self.buffer.queue_priorities_of(seqs, values))
            return None
        if op == wire.INSERT:
            key, data = wire.parse_insert(payload)
            await self.insert(key, bytes(data))
            return None
        if op == wire.SPOOL:
            return wire.reply_json(self.spool())
        if op == wire.STORED:
            st = wire.parse_stored(payload)
            if st.segment not in self.spools:
                raise InvalidArgument(f"buffers/{self.buffer.name}: segment {st.segment} is no spool of this session")
            value = Spooled(st.segment, st.offset, st.vkey_len, st.size, st.stored_size, st.checksum, st.codec)
            await self.insert(st.key, SpooledEntry(value, st.offsets, st.crcs))
            return None
        if op == wire.FLUSH:
            return wire.reply_json(await self.flush(wire.parse_flush(payload)))
        if op == wire.STATS:
            return wire.reply_json(self.buffer.stats())
        raise InvalidArgument(f"unknown client request {op}")

    async def draw(self, n: int, nonblocking: bool, batches: int = 1) -> bytes:
        """Draw a batch of n (and, for a buffer that keeps rows, up to `batches` - 1 more,
        drawn one after another as if asked for one by one, never waiting: a client's
        read-ahead). The batches are the session's until its next draw."""
        self.release()
        # Priority updates commit behind (a draw does not wait for them: the learner's loop
        # would take a commit's latency per step); FLUSH waits for them.
        self.priorities = [p for p in self.priorities if not p.done.is_set() or p.error is not None]
        while len(self.priorities) > MAX_PRIORITY_UPDATES:  # commits lag far behind: wait for the oldest
            await wait_event(self.priorities[0].done, self.abandoned, f"buffers/{self.buffer.name}: priorities")
            self.priorities = [p for p in self.priorities if not p.done.is_set() or p.error is not None]
        buf = self.buffer
        batch = await buf.sample(n, nonblocking, self.abandoned, presample=False)
        self.held = [batch]
        if batch.rows is not None and buf.layout is not None:  # the fields themselves: nothing to read
            rowed = [batch]
            while len(rowed) < batches and not isinstance(batch, SequenceBatch):
                try:
                    more = await buf.sample(n, True, self.abandoned, presample=False)
                except DistorefsError:  # too few entries left, the rate limiter, ...: the first ones answer
                    break
                self.held.append(more)  # (one without rows is never handed out: it counts as drawn)
                if more.rows is None:
                    break
                rowed.append(more)
            metas = [m for b in rowed for m in b.metas]
            tables = {"seqs": np.array([m.seq for m in metas], dtype=np.int64),
                      **wire.key_table([m.key for m in metas]),
                      "probabilities": np.concatenate([np.asarray(b.probabilities, dtype=np.float64) for b in rowed]),
                      "weights": np.concatenate([np.asarray(b.weights, dtype=np.float64) for b in rowed]),
                      "rows": np.concatenate([b.rows for b in rowed]),  # type: ignore[misc]
                      "sizes": np.array([len(b.metas) for b in rowed], dtype=np.int64)}
            if isinstance(batch, SequenceBatch):
                tables["mask"] = batch.mask
            return wire.pack_tables(_rows_meta(buf.layout), tables)
        tables = wire.entry_tables(batch.metas)
        tables["probabilities"] = np.asarray(batch.probabilities, dtype=np.float64)
        tables["weights"] = np.asarray(batch.weights, dtype=np.float64)
        stacked = buf.layout is not None and batch.places is not None and bool(batch.metas)
        if stacked:
            tables["places"] = np.asarray(batch.places[0], dtype=np.int64)  # type: ignore[index]
            tables["place_crcs"] = np.asarray(batch.places[1], dtype=np.uint32)  # type: ignore[index]
        if isinstance(batch, SequenceBatch):  # the entries are the real steps, row by row where mask is True
            tables["mask"] = batch.mask
        meta = {"layout": buf.layout.to_json() if stacked else None,  # type: ignore[union-attr]
                "segments": self._segment_paths(batch.metas)}
        return wire.pack_tables(meta, tables)

    async def locate(self, seqs: np.ndarray) -> bytes:
        """Where the entries `seqs` are now (after any commit being applied)."""
        await self.buffer.committer.settle()
        by_seq = self.buffer.ring.by_seq
        found = [by_seq.get(int(s)) for s in seqs.tolist()]
        present = np.array([m is not None for m in found], dtype=np.bool_)
        metas = [m for m in found if m is not None]
        tables = wire.entry_tables(metas)
        tables["present"] = present
        return wire.pack_tables({"segments": self._segment_paths(metas)}, tables)

    async def get(self, keys: list[bytes]) -> bytes:
        """Where the entries named `keys` are now, with the places of their arrays (a read by
        key: a TorchRL storage's get)."""
        await self.buffer.committer.settle()
        buf = self.buffer
        found = [buf.ring.by_key.get(k) for k in keys]
        metas = [m for m in found if m is not None]
        tables = wire.entry_tables(metas)
        tables["present"] = np.array([m is not None for m in found], dtype=np.bool_)
        stacked = buf.layout is not None and bool(metas)
        if stacked:
            slots = np.array([m.slot for m in metas], dtype=np.int64)
            places = buf.places.take(slots)
            stacked = places is not None
            if stacked:
                tables["places"] = np.asarray(places[0], dtype=np.int64)  # type: ignore[index]
                tables["place_crcs"] = np.asarray(places[1], dtype=np.uint32)  # type: ignore[index]
        return wire.pack_tables({"layout": buf.layout.to_json() if stacked else None,  # type: ignore[union-attr]
                                 "segments": self._segment_paths(metas)}, tables)

    def _segment_paths(self, metas) -> dict[str, str | None]:
        return segment_paths(self.values, self.told, [m.value for m in metas])

    def set_priorities(self, pairs: list[tuple[bytes, float]]) -> None:
        """Checked now (the write fails on a bad value), committed behind it."""
        self._queued(self.buffer.queue_priorities(pairs))

    def _queued(self, queued: tuple) -> None:
        pending, _count = queued
        if pending is not None:
            self.priorities.append(pending)

    # ----- inserts ---------------------------------------------------------------------------

    def spool(self) -> dict:
        """A new spool for this session's values (the one before stays open until the session
        ends: inserts queued may still name it), or why not: the client then sends values
        through the channel."""
        buffer, config = self.buffer, self.buffer.config
        why = None
        if self.read_only:
            why = "the store is read-only"
        elif buffer.ring.shared is not None:
            why = "a shared store's values go to its cluster"
        elif not config.raw and config.schema is None:
            why = "the buffer's layout is not fixed yet (its first entry fixes it)"
        elif os.geteuid() != 0 and self.owner.uid != os.geteuid():
            why = "the daemon runs as another user"
        if why is not None:  # `later`: worth asking again once an entry is committed
            return {"path": None, "why": why, "later": not config.raw and config.schema is None}
        seg, path = self.values.open_spool(buffer.ring.ns_id,
                                           (self.owner.uid, self.owner.gid) if os.geteuid() == 0 else None)
        self.spools.append(seg)
        return {"path": path, "segment": seg, "ns": buffer.ring.ns_id, "compression": config.compression,
                "level": config.compression_level, "schema": config.schema, "raw": config.raw,
                "segment_bytes": self.values.config.segment_bytes}

    async def insert(self, key: bytes, data: bytes | SpooledEntry) -> None:
        """Queue an insert and return (one refused, for a bad name or size, is reported by
        the next flush, never by the write: the inserts sent with it go on); waits while the
        session holds MAX_INFLIGHT bytes of uncommitted inserts (a spooled value counts
        SPOOLED_BYTES: its bytes are in the client's file, not here)."""
        held = _held(data)
        self.received += 1
        try:
            self.buffer.ring.check_insert(key, value_size(data))
        except DistorefsError as exc:
            self.errors.append([key.decode("utf-8", "surrogateescape"), exc.errno, str(exc)])
            self.done += 1
            return
        while self.inflight and self.inflight + held > MAX_INFLIGHT:
            await wait_event(self.changed, self.abandoned, f"buffers/{self.buffer.name}: client inserts")
        if key not in self.buffer.ring.by_key:  # a new entry (a rewrite is no insert)
            ticket = await self.buffer.admit_insert(False, self.abandoned)
            if ticket is not None:
                self.tickets.append(ticket)
        self.queue.append((key, data))
        self.inflight += held
        if not self.committing:
            self.committing = True
            self.buffer.spawn(self._commit_queued)

    async def _commit_queued(self) -> None:
        """Commit what is queued, in order, many to a group, until the queue is empty."""
        try:
            while self.queue:
                items, self.queue = self.queue, []
                tickets, self.tickets = self.tickets, []
                try:
                    results = await self.buffer.insert_many(items, self.owner)
                except Exception as exc:  # never the daemon: every insert of the lot fails
                    log.exception("client inserts into buffers/%s", self.buffer.name)
                    results = [exc] * len(items)
                finally:
                    for ticket in tickets:  # committed (counted as inserts) or failed
                        ticket.release()
                for (key, data), result in zip(items, results):
                    self.inflight -= _held(data)
                    self.done += 1
                    if isinstance(result, BaseException):
                        code = result.errno if isinstance(result, DistorefsError) else errno.EIO
                        self.errors.append([key.decode("utf-8", "surrogateescape"), code, str(result)])
                    else:
                        self.committed += 1
                self._wake()
        finally:
            self.committing = False
            self._wake()
            if self.closed:
                self._close_spools()

    async def flush(self, upto: int | None = None) -> dict:
        """Wait until every insert sent so far is committed (or failed), and the session's
        priority updates; what was committed and what failed since the last flush. `upto`:
        only until the session's first `upto` inserts are (a writer that keeps the last few
        in flight, as Reverb's do), and no priority update."""
        if upto is not None:
            while self.done < min(upto, self.received):
                await wait_event(self.changed, self.abandoned, f"buffers/{self.buffer.name}: client flush")
        else:
            while self.committing or self.queue:
                await wait_event(self.changed, self.abandoned, f"buffers/{self.buffer.name}: client flush")
            priorities, self.priorities = self.priorities, []
            for pending in priorities:
                try:
                    await pending.wait()
                except DistorefsError as exc:
                    self.errors.append(["", exc.errno, str(exc)])
        out = {"committed": self.committed, "errors": self.errors}
        self.committed, self.errors = 0, []
        return out

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    # ----- end ------------------------------------------------------------------------------

    def release(self) -> None:
        """The client is done with the last batch: entries it spent go now."""
        held, self.held = self.held, []
        for batch in held:
            self.buffer.release(batch)

    def close(self) -> None:
        """The handle was closed: the last batch is released; queued inserts still commit."""
        self.release()
        self.closed = True
        if not self.committing:
            self._close_spools()

    def _close_spools(self) -> None:
        spools, self.spools = self.spools, []
        for seg in spools:
            self.values.close_spool(seg)


@functools.lru_cache(maxsize=64)
def _rows_meta(layout: Layout) -> str:
    """The JSON of a rows reply's meta (made once per layout)."""
    return json.dumps({"layout": layout.to_json(), "rows": True}, separators=(",", ":"))


def segment_paths(values: ValueLayer, told: set[int], stored: list[StoredValue]) -> dict[str, str | None]:
    """Paths of the segments `stored` values are in that a session has not given yet."""
    out: dict[str, str | None] = {}
    for v in stored:
        if v.tier == TIER_NVME:
            seg = LOCATION.unpack(v.loc)[0]
            if seg not in told:
                told.add(seg)
                path = values.nvme.path_of(seg)
                out[str(seg)] = str(path) if path is not None else None
    return out


class LocatedBlocks:
    """The ITEMS tables of a sealed dataset's runs of consecutive item numbers (the blocks
    MountedDataset asks for), kept for the next session that asks: sealed items never
    change, and each reader process of an epoch asks for every block. Built once, not once
    per reader (26 ms of daemon CPU per 4,096 items, mostly parsing the item records).
    Least recently used go past `capacity` bytes of tables."""

    def __init__(self, capacity: int = 16 << 20) -> None:
        self.capacity = capacity
        self.used = 0
        # (first number, count) -> (tables, NVMe chunks, bytes counted against capacity)
        self._blocks: OrderedDict[tuple[int, int], tuple[dict[str, np.ndarray], list[StoredValue], int]] = \
            OrderedDict()
        self._lock = threading.Lock()  # built and looked up in worker threads
        self.counters = {"hits": 0, "built": 0}

    def tables(self, dataset: Dataset, numbers: np.ndarray) -> tuple[dict[str, np.ndarray], list[StoredValue]]:
        """The ITEMS tables of items `numbers`, and their chunks on NVMe (whose segment
        paths a session tells its client once); worker thread."""
        run = len(numbers) > 0 and bool(np.all(np.diff(numbers) == 1))
        key = (int(numbers[0]), len(numbers)) if run else None
        if key is not None:
            with self._lock:
                found = self._blocks.get(key)
                if found is not None:
                    self._blocks.move_to_end(key)
                    self.counters["hits"] += 1
                    return found[0], found[1]
        items = dataset.sealed_items(numbers.tolist())
        tables = wire.item_tables(items)
        nvme = [c for it in items if it is not None for c in it.chunks if c.tier == TIER_NVME]
        if key is not None:
            size = sum(a.nbytes for a in tables.values()) + 64 * len(nvme)  # (a StoredValue: about 64 B)
            with self._lock:
                self.counters["built"] += 1
                if key not in self._blocks and size <= self.capacity:
                    self._blocks[key] = (tables, nvme, size)
                    self.used += size
                    while self.used > self.capacity:
                        self.used -= self._blocks.popitem(last=False)[1][2]
        return tables, nvme


class DatasetSession:
    """A session of a client of a sealed dataset: where items' chunks are (ITEMS), so that
    MountedDataset reads them in its own process; the dataset's stats. Sealed items never
    change, so locations handed out stay good until the dataset is dropped."""

    def __init__(self, dataset: Dataset, values: ValueLayer, lmdb_path: Path, lineage: frozenset[int] = frozenset(),
                 *, read_only: bool = False, located: LocatedBlocks | None = None) -> None:
        """`lineage`: the process that opened the session and its ancestors (an order one of
        them declares is read by this session's process itself: not read ahead for it);
        `located`: the dataset's tables kept for all its sessions."""
        self.dataset = dataset
        self.located = located if located is not None else LocatedBlocks()
        self.values = values
        self.lmdb_path = lmdb_path
        self.read_only = read_only
        self.told: set[int] = set()
        self.lineage = lineage
        dataset.session_started(lineage)
        self.closed = False

    async def request(self, op: int, payload: memoryview) -> bytes | None:
        ds = self.dataset
        if op == wire.HELLO:
            return wire.reply_json({"protocol": wire.PROTOCOL, "lmdb": str(self.lmdb_path), "dataset": ds.name,
                                    "items": ds.counters.items, "read_only": self.read_only})
        if op == wire.ITEMS:
            numbers = wire.parse_numbers(payload)
            if not ds.sealed:
                raise InvalidArgument(f"datasets/{ds.name} is not sealed: its items are read through the mount")
            if len(numbers) and numbers.min() < 0:
                raise InvalidArgument("item numbers are >= 0")
            if len(numbers) > MAX_ITEMS:
                raise InvalidArgument(f"at most {MAX_ITEMS} items a request, got {len(numbers)}")
            tables, nvme = await trio.to_thread.run_sync(self.located.tables, ds, numbers)
            return wire.pack_tables({"segments": segment_paths(self.values, self.told, nvme)}, tables)
        if op == wire.STATS:
            return wire.reply_json({**ds.stats(), "located_blocks": dict(self.located.counters)})
        raise InvalidArgument(f"a dataset's client has no request {wire.OPS.get(op, op)}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.dataset.session_ended(self.lineage)


MAX_ITEMS = 1 << 16  # items one ITEMS request may ask for


__all__ = ["ClientSession", "DatasetSession", "LocatedBlocks", "MAX_INFLIGHT", "MAX_ITEMS"]

"""Replay buffers (buffers/NAME): a ring of entries plus a sampler and its priorities.

Composed like Reverb's tables: the ring decides what is stored and evicted, the sampler
what is drawn. Batches are drawn ahead of their opens (pre-sampling, `presample_batches`
per batch size) and their payloads pulled into the memory tier, so an open of
`batch/N.npz` or of the entries a `sample/N` named is usually served from memory. A
pre-drawn batch is checked at hand-out: entries evicted or replaced since are redrawn,
probabilities and weights are those of the moment of hand-out.

Every entry of a buffer has the buffer's layout (distorefs/layout.py): the `schema` of
its config.json, fixed by the first entry when none was given; an entry of another layout
is refused (EINVAL) unless the buffer is in raw mode. Where each entry's arrays are is
found when it commits and kept by slot (`SlotPlaces`), so `batch/N.npz` is a gather of
byte slices (distorefs/batch.py).

With `sequence_length` set, entries are the steps of episodes (their keys say which:
distorefs/sequences.py) and a draw is of sequences of consecutive steps (a `SequenceBatch`).

A buffer may hold its actors and learners to a samples-per-insert ratio (Reverb's
SampleToInsertRatio, distorefs/ratelimit.py): inserts are admitted (`admit_insert`) before
their data is written and counted when they commit; draws wait in `sample` like the wait
for `min_size_to_sample`.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import deque
from typing import Callable

import numpy as np
import trio

from .batch import Batch, BatchFile, SequenceBatch, batch_file
from . import priojournal, priowal
from .catalog import DB_SAMPLED, EntryMeta, entry_key, entry_keys, pack_u32, pack_u32s
from .committer import Change, Overlay
from .config import MAX_PRIORITY, BufferConfig, RingConfig, check_priority, priority_text
from .errors import DistorefsError, InvalidArgument, InvalidConfig, NotFound, TooLarge, WouldBlock
from .layout import Layout, NotStackable, SlotPlaces, parse, place
from .namespace import update_record
from .names import escape_key
from .owner import Owner
from .ring import RemoveEntry, RingNamespace, SpooledEntry
from .waiting import Abandoned, Outcome, wait_event
from .prefetcher import Prefetcher
from .removers import LowestPriority, Remover, ring_remover
from .ratelimit import InsertTicket, Ratio, RateLimiter, SampleClaim
from .rows import BufferRows
from .sampler import Sampler
from .sequences import SequenceIndex
from .services import Services


class Buffer(RingNamespace):
    kind = "buffers"
    config_type = BufferConfig

    def __init__(self, services: Services, ns_id: int, name: str, config: BufferConfig, owner: Owner,
                 ctime_ns: int) -> None:
        # built batches set aside for an open to come (reserve_ahead); held by their takers
        self._reserved: weakref.WeakSet[Reservation] = weakref.WeakSet()
        self.sampler = Sampler(config)
        self.sequences = SequenceIndex(config, self.sampler)
        super().__init__(services, ns_id, name, config, owner, ctime_ns, observer=self,
                         make_remover=self._remover)
        self.read_only = services.read_only  # draws keep no counts, spend no entries; no rate limiter
        self.limiter = RateLimiter(name, lambda: len(self.ring), None if self.read_only else _ratio(config))
        self.layout: Layout | None = None
        self.places = SlotPlaces(0)
        # a narrow layout's fields by slot (distorefs/rows.py)
        self.rows = BufferRows(name, self.ring, services.values.cache, services.spawn, services.read_only)
        self._set_layout(config)
        self.committer = services.committer
        self.limits = services.config  # max_batch_entries, max_batch_bytes
        self.spawn = services.spawn
        # Pre-sampled batches are the order this buffer's prefetcher reads ahead along.
        self.prefetcher = self.ring.prefetcher = Prefetcher(services.prefetch_budget, self.ring.prefetch_loader,
                                                            spawn=services.spawn, lag=4096)
        self.ring.place = self._place
        self.ring.place_spooled = self._place_spooled
        self._presampled: dict[int, deque] = {}
        # Entries drawn since their times-sampled counts were last written: written behind,
        # SAMPLED_FLUSH_S after the first draw, in one commit (a crash loses at most those).
        self._sampled: list[tuple[np.ndarray, np.ndarray]] = []  # (slots, seqs) of each draw
        self._sampled_count = 0
        self._sampled_due = False
        self._refilling: set[int] = set()
        self._npz_sizes: set[int] = set()  # batch sizes last drawn for a batch/N.npz: built ahead
        self._changed = trio.Event()
        self._waiting = 0  # tasks waiting for min_size_to_sample
        self._priorities_queued = 0  # SetPriorities queued and not yet applied (or failed)
        self._priorities_last: Outcome | None = None  # the SetPriorities queued last
        self._snapshot_queued = False  # a SnapshotPriorities queued and not yet applied (or failed)
        self.counters = {"batches": 0, "sampled_entries": 0, "presampled_used": 0, "built_ahead_used": 0,
                         "priority_updates": 0, "priority_unknown_keys": 0, "exhausted": 0,
                         "priority_snapshots": 0}

    # ----- ring observer -------------------------------------------------------------

    def entry_added(self, meta: EntryMeta, priority: float | None, times_sampled: int) -> None:
        if self._reserved:
            self._void_reserved(meta.slot)
        value = self.sampler.max_priority if priority is None else priority
        self.sampler.add(meta.slot, value, times_sampled)
        remover = self.ring.remover
        if isinstance(remover, LowestPriority):  # told of every priority it orders by
            remover.changed(meta.slot, meta.seq, value)
        self.sequences.add(meta.slot, meta.key)
        self.places.set(meta.slot, meta.places)
        self.rows.clear(meta.slot)  # filled by entry_value, or read later
        self.limiter.inserted()
        self._wake()

    def entry_replaced(self, old: EntryMeta, new: EntryMeta) -> None:
        if self._reserved:
            self._void_reserved(new.slot)
        self.places.set(new.slot, new.places)  # same slot: priority and times sampled carry over
        self.rows.clear(new.slot)
        if old.key != new.key:  # renamed: maybe another episode and step
            self.sequences.rename(new.slot, new.key)

    def entry_removed(self, meta: EntryMeta) -> None:
        if self._reserved:
            self._void_reserved(meta.slot)
        self.sampler.remove(meta.slot)
        self.sequences.remove(meta.slot)
        self.places.clear(meta.slot)
        self.rows.clear(meta.slot)
        self.limiter.wake()  # below min_size_to_sample inserts go freely

    def entry_value(self, meta: EntryMeta, value: bytes) -> None:
        """The decoded value of an entry just added or rewritten: its row."""
        self.rows.value(meta, value)

    def entries_loaded(self) -> None:
        self.limiter.restart()  # what was loaded is no insert of this run (see distorefs/ratelimit.py)

    def slots_grown(self, capacity: int) -> None:
        self.sampler.grow(capacity)
        self.sequences.grow(capacity)
        self.places.grow(capacity)
        self.rows.grown(capacity)

    def _remover(self, config: RingConfig) -> Remover:
        return LowestPriority(self.sampler) if config.evict == "lowest_priority" else ring_remover(config)

    def priorities_set(self, slots: np.ndarray, values: np.ndarray) -> None:
        self.sampler.set_priorities(slots, values)
        self.sequences.priorities_changed(slots)
        remover = self.ring.remover
        if isinstance(remover, LowestPriority):
            remover.changed_many(slots, self.ring.slot_seq[slots], values)

    def _wake(self) -> None:
        if self._waiting:  # a fresh Event per insert would cost at load
            self._changed.set()
            self._changed = trio.Event()

    # ----- entries -------------------------------------------------------------------

    def initial_priority(self) -> float:
        return self.config.initial_priority or self.sampler.max_priority

    async def admit_insert(self, nonblocking: bool = False, abandoned: Abandoned | None = None
                           ) -> InsertTicket | None:
        """Wait until the rate limiter lets one more new entry in (WouldBlock if
        `nonblocking`, Interrupted once `abandoned()`); the ticket is released once the insert
        committed or failed. None: no rate limiter. `insert` itself never waits: a caller
        that makes new entries is admitted first (the mount at the create or the first write,
        the client session when an insert arrives)."""
        return await self.limiter.admit_insert(nonblocking, abandoned)

    def insert_held_back(self) -> bool:
        """Whether `admit_insert` would wait now."""
        return not self.limiter.insert_allowed()

    async def insert(self, key: bytes, data: "bytes | SpooledEntry", owner: Owner) -> EntryMeta:
        """Insert or rewrite an entry; the first entry of a buffer without a schema fixes it."""
        if isinstance(data, SpooledEntry):
            return await self.ring.insert(key, data, owner, self.initial_priority())
        if self.layout is None and not self.config.raw:
            self.ring.check_insert(key, len(data))
            self._check_key(key)  # a refused first entry fixes no layout
            try:
                layout: Layout | None = parse(data)[0]  # headers only
            except NotStackable as exc:  # plain bytes (or arrays that cannot stack): raw mode
                log.info("buffers/%s: the first entry is not stackable arrays (%s): raw mode", self.name, exc)
                layout = None
            shared = self.ring.shared
            if shared is not None:  # the first layout in the cluster's log wins, on every node
                await shared.publish(shared.log.set_layout, self.kind, self.name,
                                     None if layout is None else layout.to_json())
            else:
                await self.committer.submit(FixLayout(self, layout))
        return await self.ring.insert(key, data, owner, self.initial_priority())

    async def insert_many(self, items: "list[tuple[bytes, bytes | SpooledEntry]]",
                          owner: Owner) -> list[EntryMeta | BaseException]:
        """Insert many entries in order, sharing commit groups (see Ring.insert_many); the
        first of a buffer without a schema fixes it, as with `insert`."""
        if items and self.layout is None and not self.config.raw and not isinstance(items[0][1], SpooledEntry):
            first = await self._insert_first(*items[0], owner)
            return [first] + await self.ring.insert_many(items[1:], owner, self.initial_priority())
        return await self.ring.insert_many(items, owner, self.initial_priority())

    async def _insert_first(self, key: bytes, data: "bytes | SpooledEntry", owner: Owner) -> EntryMeta | BaseException:
        try:
            return await self.insert(key, data, owner)
        except DistorefsError as exc:
            return exc

    def _place(self, key: bytes, data: bytes) -> list[tuple[int, int]] | None:
        """Where the arrays of a new entry are (the ring calls it when the insert is
        planned): InvalidArgument if they do not fit the buffer's layout, or if its key
        names no step of an episode of a buffer of sequences."""
        self._check_key(key)
        if self.config.raw:
            return None
        layout = self.layout
        if layout is None:
            raise InvalidArgument(f"buffers/{self.name}: its layout changed while this entry was written; retry")
        return [(off, f.nbytes) for off, f in zip(place(layout, data), layout.fields)]

    def _place_spooled(self, key: bytes, entry: SpooledEntry) -> list[tuple[int, int]] | None:
        """`_place` for a value a client stored itself: the arrays where it says they are,
        checked against the layout (one per field, each of the field's size, inside the value,
        none overlapping); InvalidArgument otherwise. The bytes are not read: a client that
        describes them wrongly has stored wrong bytes, which their CRC-32s then catch."""
        self._check_key(key)
        if self.config.raw:
            if entry.offsets:
                raise InvalidArgument(f"buffers/{self.name} is raw: a spooled entry names no arrays")
            return None
        layout = self.layout
        if layout is None:
            raise InvalidArgument(f"buffers/{self.name}: no layout is fixed yet; insert the first entry whole")
        if len(entry.offsets) != len(layout.fields) or len(entry.crcs) != len(layout.fields):
            raise InvalidArgument(f"buffers/{self.name}: a spooled entry names {len(entry.offsets)} arrays, the "
                                  f"layout has {len(layout.fields)}")
        regions = [(off, f.nbytes) for off, f in zip(entry.offsets, layout.fields)]
        end = 0
        for off, n in sorted(regions):
            if off < end or off + n > entry.value.size:
                raise InvalidArgument(f"buffers/{self.name}: a spooled entry's arrays overlap or lie outside "
                                      f"its {entry.value.size} bytes")
            end = off + n
        return regions

    def _check_key(self, key: bytes) -> None:
        if self.sequences.on:
            current = self.ring.by_key.get(key)
            self.sequences.check(key, current.slot if current is not None else -1)

    def _set_layout(self, config: BufferConfig) -> None:
        layout = None if config.raw or config.schema is None else Layout.from_json(config.schema)
        if layout != self.layout:
            self._void_reserved(None)
            self.layout = layout
            self.places = SlotPlaces(len(layout.fields) if layout else 0)
            self.places.grow(len(self.ring.slot_meta))
            for meta in self.ring.oldest():
                self.places.set(meta.slot, meta.places)
            self.rows.configure(layout, self.places)

    def journal_written(self) -> None:
        """A record of the priority journal was applied: once the journal holds as many
        updates as the buffer has entries (SNAPSHOT_UPDATES at least), a snapshot folds it,
        so a load reads no more than about twice the buffer's priorities."""
        ring = self.ring
        if not self._snapshot_queued and ring.journal_updates >= max(SNAPSHOT_UPDATES, len(ring)):
            self._snapshot_queued = True
            self.committer.submit_nowait(SnapshotPriorities(self))

    def drop_txn(self, txn) -> None:
        """The buffer is dropped (it holds no entries): its priority journal goes too."""
        priojournal.drop(txn, self.ns_id)

    def dropped(self) -> None:
        """The buffer was removed: what it holds of the memory budget goes back."""
        self._void_reserved(None)
        self.rows.close()

    def spent_at_load(self) -> list[EntryMeta]:
        """Entries already sampled max_times_sampled times (a crash came before their removal)."""
        return [m for m in self.ring.oldest() if self.sampler.exhausted[m.slot]]

    # ----- sampling ------------------------------------------------------------------

    def check_batch_size(self, n: int) -> None:
        limit = self.limits.max_batch_entries
        length = self.config.sequence_length
        if length and 1 <= n and n * length > limit:
            raise InvalidArgument(f"a batch of {n} sequences of {length} steps is {n * length} entries, over "
                                  f"max_batch_entries ({limit})")
        if not 1 <= n <= limit:
            raise InvalidArgument(f"batch size must be in 1..{limit}, got {n}")

    async def sample(self, n: int, nonblocking: bool = False, abandoned: Abandoned | None = None, *,
                     presample: bool = True) -> Batch:
        """Draw a batch of n entries (waiting for `min_size_to_sample` entries unless nonblocking;
        the wait ends with Interrupted once `abandoned()` says the caller gave up), then for
        the rate limiter to allow n samples. `presample` False: the caller reads the values
        itself (the client beside the mount), so nothing is drawn and read ahead into the
        daemon's memory for it."""
        self._npz_sizes.discard(n)  # a manifest (sample/N) or a client's draw: no file to build ahead
        return (await self._sample(n, nonblocking, abandoned, presample))[0]

    async def _sample(self, n: int, nonblocking: bool, abandoned: Abandoned | None,
                      presample: bool) -> tuple[Batch, SampleClaim]:
        """`sample`, with the samples the rate limiter counted for it (to give back those
        of a batch not handed out after all)."""
        self.check_batch_size(n)
        sequences = self.sequences
        if not self._presampled.get(n):  # drawn now, from the current priorities (a batch drawn ahead is not)
            await self.settled()
        while True:
            while (self.sampler.drawable_count() < self.config.min_size_to_sample
                   or (sequences.on and not sequences.count())):
                if nonblocking:
                    raise WouldBlock(f"buffers/{self.name}: {self.sampler.drawable_count()} drawable entries "
                                     f"({sequences.count()} sequences), min_size_to_sample is "
                                     f"{self.config.min_size_to_sample}")
                self._waiting += 1
                try:
                    await wait_event(self._changed, abandoned, f"buffers/{self.name}: sampling")
                finally:
                    self._waiting -= 1
            want = n
            if self.config.sampler in ("fifo", "lifo"):  # they hand out at most the entries there are
                want = min(n, self.sampler.drawable_count())
            elif sequences.on:  # each real step handed out counts: at most n x sequence_length
                want = n * self.config.sequence_length
            claim = await self.limiter.admit_sample(want, nonblocking, abandoned)
            try:
                batch = self._draw(n, presample)
                counted = await self._count_globally(batch)
            except BaseException:
                claim.give_back()
                raise
            if counted:
                claim.give_back(want - len(batch.metas))  # fewer after all (entries spent meanwhile)
                return batch, claim
            claim.give_back()  # drawn again, from fewer drawable entries: counted again

    async def _count_globally(self, batch: Batch) -> bool:
        """A shared buffer with max_times_sampled counts every node's draws together (the
        local counts see this node's only): the batch's draws are counted in the cluster
        (SharedLog.claim_draws) and the local counts become the global ones, the entries the
        batch takes to the limit its spent ones. False: some entry was drawn to the limit on
        other nodes (or is gone): nothing is counted, those entries are not drawn here any
        more, and the caller draws again."""
        shared = self.ring.shared
        limit = self.config.max_times_sampled
        if shared is None or not limit or self.read_only or not batch.metas:
            return True
        metas = batch.metas
        try:
            ok, answer = await trio.to_thread.run_sync(shared.log.claim_draws, self.kind, self.name, limit,
                                                       [(m.seq, m.key) for m in metas])
        except BaseException:
            self._count_locally(metas, {}, limit)  # undone: this batch is not handed out
            raise
        if ok:
            counts = {m.seq: c for m, c in zip(metas, answer)}  # the last of an entry's is its count
            self._count_locally(metas, counts, limit)
            spent = {m.seq: m for m in metas if counts[m.seq] >= limit and self.ring.by_seq.get(m.seq) is m}
            batch.spent = list(spent.values())
            return True
        # The entries refused take their counts from the cluster: one drawn `limit` times
        # in all (or gone) is spent here too; one the batch drew more often than it had
        # left stays drawable, as often as it has left. (Setting them all to the limit lost
        # draws: an entry at 2 of 3 that a batch drew twice was never handed out again.)
        self._count_locally(metas, dict(zip(answer[0::2], answer[1::2])), limit)
        return False

    def _count_locally(self, metas: list[EntryMeta], counts: dict[int, int], limit: int) -> None:
        """Set the times-sampled count of the drawn entries still here: `counts` by seq, or
        the count before this batch drew them (what `Sampler.select` added taken back)."""
        ring, sampler = self.ring, self.sampler
        drawn: dict[int, int] = {}
        for m in metas:
            if ring.slot_meta[m.slot] is m:
                drawn[m.slot] = drawn.get(m.slot, 0) + 1
        if not drawn:
            return
        slots = np.fromiter(drawn, dtype=np.int64, count=len(drawn))
        times = np.array([counts.get(ring.slot_meta[s].seq, int(sampler.times[s]) - k)  # type: ignore[union-attr]
                          for s, k in drawn.items()], dtype=np.int64)
        sampler.set_times(slots, np.minimum(times, limit))

    def _draw(self, n: int, presample: bool) -> Batch:
        hint = None
        ahead: BuiltAhead | None = None
        queue = self._presampled.get(n)
        if queue:
            hint, ahead = queue.popleft()
            self.counters["presampled_used"] += 1
        ring = self.ring

        def valid(slots: np.ndarray, seqs: np.ndarray) -> np.ndarray:
            return ring.slot_seq[slots] == seqs  # still the entry it held when drawn ahead

        if self.sequences.on:
            batch: Batch = self._draw_sequences(n, hint, valid)
        elif ahead is not None and ahead.current(self):
            batch = ahead.batch
            self.sampler.count_draws(ahead.slots)  # what `select` counts for a hint
            self.counters["built_ahead_used"] += 1
        else:
            slots, spent = self.sampler.select(n, self._order, hint, valid)
            probs, weights = self.sampler.probabilities(slots, spent)
            batch = Batch([ring.slot_meta[s] for s in slots.tolist()], probs, weights,  # type: ignore[misc]
                          [ring.slot_meta[s] for s in spent.tolist()],  # type: ignore[misc]
                          self.places.take(slots) if self.layout is not None and len(slots) else None,
                          self.rows.of(slots), slots=slots, seqs=ring.slot_seq[slots], names=ring.names_of(slots))
        self.counters["batches"] += 1
        self.counters["sampled_entries"] += len(batch.metas)
        self._record_sampled(batch.slots, batch.seqs)
        if presample:  # this daemon reads the batch's values (not a client beside it)
            ring.note_read(len(batch.metas))
            self.refill(n, now=False)
        return batch

    def _draw_sequences(self, n: int, hint, valid) -> SequenceBatch:
        """n sequences (a buffer with sequence_length set): their real steps, row by row."""
        drawn = self.sequences.select(n, hint, valid)
        slot_meta = self.ring.slot_meta
        real = drawn.slots[drawn.mask]
        return SequenceBatch([slot_meta[s] for s in real.tolist()], drawn.probabilities,  # type: ignore[misc]
                             drawn.weights, [],
                             self.places.take(real) if self.layout is not None and len(real) else None,
                             self.rows.of(real),
                             starts=[slot_meta[s] for s in drawn.starts.tolist()],  # type: ignore[misc]
                             mask=drawn.mask, slots=real, seqs=self.ring.slot_seq[real])

    def _record_sampled(self, slots: np.ndarray, seqs: np.ndarray) -> None:
        """The entries in `slots` (their sequence numbers `seqs`) were handed out: their
        times-sampled counts are written behind."""
        if self.read_only or not len(slots):
            return
        self._sampled.append((slots, seqs))
        self._sampled_count += len(slots)
        if self._sampled_count >= SAMPLED_FLUSH_ENTRIES:
            self.flush_sampled()
        elif not self._sampled_due:
            self._sampled_due = True
            self.spawn(self._flush_sampled_later)

    async def _flush_sampled_later(self) -> None:
        await trio.sleep(SAMPLED_FLUSH_S)
        self.flush_sampled()

    def flush_sampled(self) -> None:
        """Queue the times-sampled counts not written yet (the store calls it at shutdown)."""
        self._sampled_due = False
        if self._sampled:
            drawn, self._sampled, self._sampled_count = self._sampled, [], 0
            slots = np.concatenate([slots for slots, _ in drawn])
            seqs = np.concatenate([seqs for _, seqs in drawn])
            self.committer.submit_nowait(RecordSampled(self, slots, seqs))

    async def sample_npz(self, n: int, nonblocking: bool = False,
                         abandoned: Abandoned | None = None) -> tuple[Batch, BatchFile]:
        """Draw a batch and describe its npz (no copy: see distorefs/batch.py); a batch that
        lost an entry to eviction or a rewrite while its values were read is drawn again."""
        # On a shared store an entry drawn here may be evicted by another node before its
        # value is fetched, and again after this node caught up (a small buffer churned by
        # fast writers): more tries there than for this node's own evictions.
        attempts = SHARED_DRAW_ATTEMPTS if self.ring.shared is not None else 3
        self._npz_sizes.add(n)
        for attempt in range(attempts):
            batch, claim = await self._sample(n, nonblocking, abandoned, True)
            try:
                size = sum(m.size for m in batch.metas)
                if size > self.limits.max_batch_bytes:  # the values are held while the file is open
                    raise TooLarge(f"buffers/{self.name}: a batch of {n} is {size} bytes, over "
                                   f"max_batch_bytes ({self.limits.max_batch_bytes})")
                if batch.file is not None:  # built ahead of this open
                    return batch, batch.file
                values = None  # the buffer's rows hold the fields: nothing to read
                if batch.rows is None:
                    values = await self.ring.read_many(batch.metas, follow_rewrites=False)
                    self.rows.fill(batch.metas, values)
                if len(batch.metas) > BUILD_INLINE:  # work per entry: off the event loop when large
                    data = await trio.to_thread.run_sync(batch_file, batch, values, self.layout)
                else:
                    data = batch_file(batch, values, self.layout)
            except NotFound:
                self.release(batch)
                claim.give_back()  # drawn again: counted again
                if attempt == attempts - 1:
                    raise
                continue
            except BaseException:
                self.release(batch)
                claim.give_back()
                raise
            return batch, data
        raise AssertionError("unreachable")

    def release(self, batch: Batch) -> None:
        """The handle holding `batch` is closed: remove the entries it spent."""
        self.remove_spent(batch.spent)

    def reserve_ahead(self, n: int, on_void: Callable[[], None]) -> "Reservation | None":
        """Set aside the next batch of n built ahead for a batch/N.npz open to come, one
        that will not go through `sample_npz`: the mount puts its file into a learner's
        page cache while the learner trains, and the library's front answers the next open
        without Python. Nothing is counted until `take_ahead` (a batch set aside and never
        taken was not drawn). Only where a draw needs no wait (no rate limiter,
        min_size_to_sample met). `on_void()` runs (on the event loop) when the batch stops
        being what an open would be given: an entry of it removed or replaced, the layout
        or the configuration changed; the taker then uses it only if it was opened before.
        The queue it came from is the caller's to `refill` once its own work is done."""
        if (self.read_only or self.limiter.enabled or self.sequences.on or n not in self._npz_sizes
                or self.sampler.drawable_count() < self.config.min_size_to_sample):
            return None
        queue = self._presampled.get(n)
        if not queue:
            return None
        hint, ahead = queue[0]
        if ahead is None or not ahead.current(self):
            return None
        queue.popleft()
        reservation = Reservation(n, hint, ahead, on_void)
        self._reserved.add(reservation)
        return reservation  # (the queue is refilled by the caller: `refill`)

    async def reserve_large(self, n: int) -> "Reservation | None":
        """`reserve_ahead` for a batch too large to be built while it waits in the queue
        (BuiltAhead.MAX_BYTES): the next batch of n drawn ahead is taken from the queue, its
        values read and its file described now, for the mount to write into a memfd the
        kernel will read the next open from (FUSE passthrough) while the learner reads the
        batch before.
        Nothing is counted until `take_ahead`; a reservation dropped was never drawn. None
        where a draw ahead is not handed out as drawn (see reserve_ahead; also a limit on
        times sampled, a shared store). With nothing drawn ahead left (several learners
        took it), it draws now, as the presampler would."""
        layout, config = self.layout, self.config
        if (self.read_only or self.limiter.enabled or self.sequences.on or n not in self._npz_sizes
                or layout is None or config.max_times_sampled or self.ring.shared is not None
                or config.sampler not in ("uniform", "prioritized")  # (fifo and lifo hand out in order)
                or self.sampler.drawable_count() < config.min_size_to_sample):
            return None
        queue = self._presampled.get(n)
        ring = self.ring
        if queue and queue[0][1] is not None:  # (a small one, built already: reserve_ahead's)
            return None
        if queue:
            hint = queue.popleft()[0]
        else:  # several learners took what was drawn ahead: drawn now, as the presampler does
            slots = self.sampler.draw(n, self._order)
            hint = (slots, ring.slot_seq[slots])
        self.refill(n, now=False)
        slots, seqs = hint
        if not len(slots) or not (ring.slot_seq[slots] == seqs).all():
            return None  # an entry of it removed or replaced since: the open draws instead
        metas = [ring.slot_meta[s] for s in slots.tolist()]
        gens = ring.slot_gen[slots]  # the versions read: the file is handed out only while they are there
        if sum(m.size for m in metas) > self.limits.max_batch_bytes:
            return None
        try:
            values = await ring.read_many(metas, follow_rewrites=False)
        except NotFound:
            return None
        if self.layout is not layout or self.config is not config or not (ring.slot_seq[slots] == seqs).all():
            return None
        self.rows.fill(metas, values)
        batch = BuiltAhead.drawn(self, slots, None)
        batch.file = await trio.to_thread.run_sync(batch_file, batch, values, layout)
        ahead = BuiltAhead(batch, slots, gens, config, layout)
        if not ahead.current(self):
            return None
        reservation = Reservation(n, hint, ahead, _nothing)
        self._reserved.add(reservation)
        return reservation

    def drop_reserved(self, reservation: "Reservation") -> None:
        """A reservation that will not be handed out: it was never drawn (nothing counted)."""
        self._reserved.discard(reservation)

    def take_ahead(self, reservation: "Reservation") -> Batch:
        """The reserved batch, handed out: counted as a draw now (its entries still held)."""
        self._reserved.discard(reservation)
        ahead = reservation.ahead
        batch = ahead.batch
        held = ahead.held(self)
        slots, seqs = (ahead.slots, batch.seqs) if held.all() else (ahead.slots[held], batch.seqs[held])
        self.sampler.count_draws(slots)
        counters = self.counters
        counters["presampled_used"] += 1
        counters["built_ahead_used"] += 1
        counters["batches"] += 1
        counters["sampled_entries"] += len(batch.metas)
        self._record_sampled(slots, seqs)
        self.ring.note_read(len(batch.metas))  # (its queue was refilled when it was set aside)
        return batch

    def put_back(self, reservation: "Reservation") -> None:
        """A reserved batch that will not be handed out after all: first in its queue
        again, if it still is what an open would be given."""
        self._reserved.discard(reservation)
        if not reservation.void and reservation.ahead.current(self):
            self._presampled.setdefault(reservation.n, deque()).appendleft((reservation.hint, reservation.ahead))

    def _void_reserved(self, slot: int | None) -> None:
        """The reserved batches holding `slot` (all of them: None) are void."""
        for reservation in list(self._reserved):
            if slot is None or slot in reservation.slots:
                self._reserved.discard(reservation)
                reservation.void = True
                reservation.on_void()

    def remove_spent(self, metas: list[EntryMeta]) -> None:
        """Remove entries sampled max_times_sampled times (in the background)."""
        if self.read_only:
            return
        shared = self.ring.shared
        for meta in metas:
            self.counters["exhausted"] += 1
            if shared is not None:  # through the log: spent on every node
                shared.publish_soon(shared.log.delete, self.kind, self.name, meta.key, meta.seq)
            else:
                self.committer.submit_nowait(RemoveEntry(self.ring, meta.key, meta.seq, "exhausted"))

    def _order(self, kind: str):
        return self.ring.oldest() if kind == "fifo" else self.ring.newest()

    def refill(self, n: int, now: bool) -> None:
        """Draw ahead what the queue of batches of n lacks (after a draw took from it, or
        `reserve_ahead`): `now`, in this call, where nothing waits for the caller (a learner's
        loop takes one batch set aside per step, and a task spawned for each refill, its
        spawn and first step, cost some 20 us of a batch's 300 here); else in a task of its
        own, after the caller's reply."""
        if (not self.config.presample_batches or self.config.sampler not in ("uniform", "prioritized")
                or n in self._refilling):  # (none drawn ahead, or being drawn already)
            return
        self._refilling.add(n)
        if not now:
            self.spawn(self._presample, n)
            return
        try:
            self._presample_now(n)
        except Exception:  # a bug must not fail the caller (the next open draws instead)
            log.exception("buffers/%s: drawing batches of %d ahead failed", self.name, n)

    async def _presample(self, n: int) -> None:
        self._presample_now(n)

    def _presample_now(self, n: int) -> None:
        try:
            queue = self._presampled.setdefault(n, deque())
            while len(queue) < self.config.presample_batches:
                built = None
                if self.sequences.on:  # the sequences' starts are drawn ahead, their steps read ahead
                    slots = self.sequences.draw(n)
                    steps = self.sequences.windows(slots)[0]
                    ahead = steps[steps >= 0]
                else:
                    weighted = self.sampler.draw_weighted(n) if n in self._npz_sizes else None
                    slots = ahead = weighted[0] if weighted is not None else self.sampler.draw(n, self._order)
                    if n in self._npz_sizes:
                        built = BuiltAhead.build(self, slots, weighted[1:] if weighted is not None else None)
                if len(slots) == 0:
                    return
                queue.append(((slots, self.ring.slot_seq[slots]), built))
                # only what neither the rows kept nor the memory tier hold needs reading ahead
                # (and with nothing to read, the prefetcher is not woken)
                ahead = self.ring.uncached_slots(self.rows.unfilled(ahead))
                if len(ahead):
                    assert self.ring.prefetcher is not None  # (set in __init__)
                    self.ring.prefetcher.extend(dict.fromkeys(zip(self.ring.slot_seq[ahead].tolist(),
                                                                  self.ring.slot_gen[ahead].tolist())))
        finally:
            self._refilling.discard(n)

    # ----- priorities ----------------------------------------------------------------

    async def set_priorities(self, pairs: list[tuple[bytes, float]], strict: bool = False) -> int:
        """Set priorities; unknown keys (evicted since they were sampled) are skipped and
        counted, or raise NotFound if `strict`. Returns how many were applied."""
        pending, count = self.queue_priorities(pairs, strict)
        if pending is not None:
            await pending.wait()
        return count

    def queue_priorities(self, pairs: list[tuple[bytes, float]], strict: bool = False, wal_number: int = 0):
        """Check the priorities now (InvalidArgument, NotFound if `strict`) and queue their
        commit: (something to `await .wait()` on, or None when no key is known; how many).
        `wal_number`: they are that record of the priority write-ahead file
        (distorefs/priowal.py), whose commit notes it (queued even with no key known)."""
        if pairs:
            _check_priorities([k for k, _ in pairs], np.fromiter((v for _, v in pairs), dtype=np.float64,
                                                                   count=len(pairs)))
        metas, values = [], []
        for key, value in pairs:
            meta = self.ring.by_key.get(key)
            if meta is None:
                if strict:
                    raise NotFound(f"buffers/{self.name}: no entry {key!r}")
                self.counters["priority_unknown_keys"] += 1
                continue
            metas.append(meta)
            values.append(value)
        return self._queue_priorities(metas, values, wal_number)

    def queue_priorities_of(self, seqs: np.ndarray, given: np.ndarray):
        """`queue_priorities` of the entries named by sequence number (those not there any
        more skipped and counted)."""
        _check_priorities(seqs.tolist(), given)
        by_seq = self.ring.by_seq
        metas, values = [], []
        for seq, value in zip(seqs.tolist(), given.tolist()):
            meta = by_seq.get(seq)
            if meta is None:
                self.counters["priority_unknown_keys"] += 1
            else:
                metas.append(meta)
                values.append(value)
        return self._queue_priorities(metas, values)

    def _queue_priorities(self, metas: list[EntryMeta], values: list[float], wal_number: int = 0):
        if not metas and not wal_number:
            return None, 0
        shared = self.ring.shared
        if shared is not None:
            pairs = [(m.key, v) for m, v in zip(metas, values)]
            return shared.publish_soon(shared.log.priorities, self.kind, self.name, pairs), len(metas)
        self._priorities_queued += 1
        pending = self._priorities_last = self.committer.enqueue(SetPriorities(self, metas, values, wal_number))
        return pending, len(metas)

    async def set_times_sampled(self, key: bytes, times: int) -> None:
        """Set an entry's times-sampled count (restoring a buffer: `distorefs import`).
        InvalidArgument for a negative count, one past 2**32 - 1, or one that reaches
        `max_times_sampled` (the entry would be spent: such entries are removed, never kept)."""
        limit = self.config.max_times_sampled
        if not 0 <= times < 1 << 32:
            raise InvalidArgument(f"times_sampled must be in 0..{(1 << 32) - 1}, got {times}")
        if limit and times >= limit:
            raise InvalidArgument(f"buffers/{self.name}: times_sampled {times} reaches max_times_sampled "
                                  f"({limit}): the entry would be spent")
        meta = self.ring.by_key.get(key)
        if meta is None:
            raise NotFound(f"buffers/{self.name}: no entry {key!r}")
        await self.committer.submit(SetTimesSampled(self, meta, times))

    async def settled(self) -> None:
        """Wait until the priorities queued so far are applied here: a `priorities` close
        may be answered as its transaction commits, a moment before it is applied
        (mount/handles.py PrioritiesWriter), or once the mount's front wrote it ahead, before
        it is committed (distorefs/priowal.py). Draws, the `priorities` file and the
        priority xattr look at the sampler after this."""
        if self._priorities_queued:
            last = self._priorities_last
            if last is not None:  # applied in the order queued: the last one applied, all are
                await last.done.wait()
            await self.committer.settle()

    async def priorities_text(self) -> bytes:
        await self.settled()
        prio = self.sampler.priority
        return b"".join(b"%s %s\n" % (escape_key(m.key), priority_text(prio[m.slot])) for m in self.ring.oldest())

    # ----- configuration and stats ---------------------------------------------------

    def check_reconfigure(self, config: BufferConfig) -> None:
        """A layout changes only while the buffer is empty (InvalidConfig otherwise)."""
        old = self.config
        if not len(self.ring):
            return
        if (config.schema != old.schema and not config.raw) or (old.raw and not config.raw):
            raise InvalidConfig(f"buffers/{self.name} holds {len(self.ring)} entries of its layout: "
                                f"schema and raw change only while it is empty (raw: true is always allowed)")

    def reconfigure(self, config: BufferConfig) -> None:
        self.ring.configure(config)
        self.sampler.reconfigure(config)
        self.sequences.reconfigure(config, self.ring.oldest)
        self._set_layout(config)
        self._presampled.clear()
        self._void_reserved(None)
        if not self.read_only:
            self.limiter.configure(_ratio(config))  # wakes its waiters: the new settings apply to them
        self._wake()

    def stats(self) -> dict:
        s = self.sampler
        extra = {"sequences": self.sequences.stats()} if self.sequences.on else {}
        return {
            "name": self.name,
            "sampler": self.config.sampler,
            "evict": self.config.evict,
            **self.ring.stats(),
            "drawable": s.drawable_count(),
            "max_priority": s.max_priority,
            "priority_total": self.sampler.weighted_total(),
            "presampled_batches": {str(n): len(q) for n, q in self._presampled.items()},
            **self.counters,
            "rate_limiter": self.limiter.stats(),
            "rows": self.rows.stats(),
            **extra,
        }


def _check_priorities(names: list, given: np.ndarray) -> None:
    """InvalidArgument naming the first of `names` whose priority is not finite and in
    0..MAX_PRIORITY (checked at once, then one by one to say which)."""
    if not (np.isfinite(given).all() and (given >= 0).all() and (given <= MAX_PRIORITY).all()):
        for name, value in zip(names, given.tolist()):
            check_priority(name, value)


def _ratio(config: BufferConfig) -> Ratio | None:
    return Ratio.of(config.samples_per_insert, config.error_buffer, config.min_size_to_sample)


BUILD_INLINE = 1024  # a batch of more entries is described in a worker thread
SHARED_DRAW_ATTEMPTS = 10  # draws of a batch/N.npz on a shared store before ENOENT
SAMPLED_FLUSH_S = 0.5  # times-sampled counts are written this long after a draw...
# ... or once this many entries wait to be written (1 MiB of slots and sequence numbers). A
# learner drawing batch/64.npz 2,500 times a second wrote 20 commits of ~1,700 counts a
# second at 8,192, 15 % of the daemon's CPU per draw: most of a buffer's entries are drawn
# again between two commits, so fewer commits write fewer counts, not just fewer times.
SAMPLED_FLUSH_ENTRIES = 1 << 16
SNAPSHOT_UPDATES = 65536  # priority updates journaled before a snapshot, at the least (1 MiB)
log = logging.getLogger(__name__)


class FixLayout(Change):
    """The first entry of a buffer without a schema fixes it: its arrays' layout, or raw mode
    for plain bytes (nothing if a schema or raw mode was set since)."""

    def __init__(self, buffer: Buffer, layout: Layout | None) -> None:
        self.buffer = buffer
        self.layout = layout
        self.conflict_key = ("ns", buffer.kind, buffer.name)
        self.config: BufferConfig | None = None

    def plan(self, overlay: Overlay) -> None:
        config = self.buffer.config
        if config.raw or config.schema is not None:
            self.config = None
        elif self.layout is None:
            self.config = dataclasses.replace(config, raw=True)
        else:
            self.config = dataclasses.replace(config, schema=self.layout.to_json())

    def txn(self, txn) -> None:
        if self.config is not None:
            update_record(txn, self.buffer.kind, self.buffer.name, config=self.config.to_dict())

    def apply(self) -> None:
        if self.config is not None:
            self.buffer.reconfigure(self.config)


class RecordSampled(Change):
    """Persist times-sampled counters (fire and forget: a crash loses at most the last)."""

    def __init__(self, buffer: Buffer, slots: np.ndarray, seqs: np.ndarray) -> None:
        """The entries drawn: (slot, seq) pairs, an entry drawn many times many times."""
        self.buffer = buffer
        self.seqs, first = np.unique(seqs, return_index=True)
        self.slots = slots[first]

    def plan(self, overlay: Overlay) -> None:
        ring = self.buffer.ring
        removed = overlay.ring(ring.ns_id).removed
        live = ring.slot_seq[self.slots] == self.seqs  # still in the slot it was drawn from
        seqs, times = self.seqs[live], self.buffer.sampler.times[self.slots[live]]
        if removed:
            kept = np.fromiter((seq not in removed for seq in seqs.tolist()), dtype=bool, count=len(seqs))
            seqs, times = seqs[kept], times[kept]
        self.written, self.times = seqs, times

    def txn(self, txn) -> None:
        # (in key order: np.unique sorted the sequence numbers, and a ring's keys are big-endian)
        txn.put_many(list(zip(entry_keys(self.buffer.ns_id, self.written), pack_u32s(self.times))), db=DB_SAMPLED)


class SetTimesSampled(Change):
    """One entry's times-sampled count, set (an entry removed meanwhile: nothing)."""

    def __init__(self, buffer: Buffer, meta: EntryMeta, times: int) -> None:
        self.buffer = buffer
        self.meta = meta
        self.times = times
        self.keep = False

    def plan(self, overlay: Overlay) -> None:
        ring = self.buffer.ring
        self.keep = (self.meta.seq not in overlay.ring(ring.ns_id).removed
                     and ring.by_seq.get(self.meta.seq) is not None)

    def txn(self, txn) -> None:
        if self.keep:
            txn.put(entry_key(self.buffer.ns_id, self.meta.seq), pack_u32(self.times), db=DB_SAMPLED)

    def apply(self) -> None:
        ring = self.buffer.ring
        m = ring.slot_meta[self.meta.slot]
        if self.keep and m is not None and m.seq == self.meta.seq:
            self.buffer.sampler.set_times(np.array([self.meta.slot]), np.array([self.times]))


class BuiltAhead:
    """A batch drawn ahead of its open (pre-sampling) with its batch/N.npz already built, so
    that the open only hands it out: the draw, the importance weights and the file's members
    are some 300-450 us of event-loop time on this machine, which a learner otherwise waits
    for in every step. Only where handing out is nothing but counting the draws: a buffer
    of one layout whose rows hold every drawn entry (distorefs/rows.py), no
    max_times_sampled, no sequences, not shared with other nodes, a file up to MAX_BYTES.

    Its probabilities and weights are those of the distribution the entries were drawn
    from, at the time they were drawn (pre-sampling draws then, whatever priorities
    changed since). It is handed out only if nothing it was built from changed: the same
    configuration and layout object, and every slot holding the same entry version."""

    MAX_BYTES = 1 << 20  # held while queued (presample_batches of them per batch size)

    def __init__(self, batch: Batch, slots: np.ndarray, gens: np.ndarray, config: BufferConfig,
                 layout: Layout) -> None:
        self.batch = batch
        self.slots = slots
        self.gens = gens  # the entry versions it was built from (Ring.slot_gen)
        self.config = config
        self.layout = layout

    @staticmethod
    def build(buf: "Buffer", slots: np.ndarray, weighted: tuple[np.ndarray, np.ndarray] | None = None
              ) -> "BuiltAhead | None":
        """`weighted`: the probabilities and weights of `slots`, given with the draw
        (Sampler.draw_weighted); None: computed here."""
        layout, config = buf.layout, buf.config
        if (layout is None or not len(slots) or config.max_times_sampled or buf.sequences.on
                or buf.ring.shared is not None or buf.read_only):
            return None
        rows = buf.rows.of(slots)
        if rows is None or rows.nbytes > BuiltAhead.MAX_BYTES:
            return None
        gens = buf.ring.slot_gen[slots]
        batch = BuiltAhead.drawn(buf, slots, rows, weighted)
        batch.file = batch_file(batch, None, layout)
        return BuiltAhead(batch, slots, gens, config, layout)

    @staticmethod
    def drawn(buf: "Buffer", slots: np.ndarray, rows: np.ndarray | None,
              weighted: tuple[np.ndarray, np.ndarray] | None = None) -> Batch:
        """The batch of `slots`, drawn ahead and not counted: its probabilities and weights
        are those of the distribution it is drawn from now (`weighted`, given with the draw).
        Its entries' places only without `rows`: a batch with rows is made from them alone."""
        probs, weights = weighted if weighted is not None else \
            buf.sampler.probabilities(slots, np.zeros(0, dtype=np.int64))
        return Batch([buf.ring.slot_meta[s] for s in slots.tolist()], probs, weights,  # type: ignore[misc]
                     [], buf.places.take(slots) if rows is None else None, rows, slots=slots,
                     seqs=buf.ring.slot_seq[slots], names=buf.ring.names_of(slots))

    def held(self, buf: "Buffer") -> np.ndarray:
        """For each entry, whether its slot still holds the version it was built from."""
        return buf.ring.slot_gen[self.slots] == self.gens

    def current(self, buf: "Buffer") -> bool:
        if buf.config is not self.config or buf.layout is not self.layout:
            return False
        return bool(self.held(buf).all())


class Reservation:
    """A batch built ahead and set aside for one open (Buffer.reserve_ahead)."""

    __slots__ = ("n", "hint", "ahead", "on_void", "slots", "void", "__weakref__")

    def __init__(self, n: int, hint, ahead: BuiltAhead, on_void: Callable[[], None]) -> None:
        self.n = n
        self.hint = hint
        self.ahead = ahead
        self.on_void = on_void
        self.slots = frozenset(ahead.slots.tolist())
        self.void = False

    @property
    def file(self) -> BatchFile:
        assert self.ahead.batch.file is not None  # (built ahead)
        return self.ahead.batch.file


class SetPriorities(Change):
    """Priorities set: one record of the buffer's priority journal (distorefs/priojournal.py).

    The entries are held as arrays (seq, slot, priority): whether each is still there is one
    comparison with the ring's slot table, at plan and again at apply, not a lookup apiece."""

    def __init__(self, buffer: Buffer, metas: list[EntryMeta], values: list[float], wal_number: int = 0) -> None:
        self.buffer = buffer
        self.wal_number = wal_number  # the priority write-ahead file's record these are (0: none)
        self.count = n = len(metas)
        self.named = (np.fromiter((m.seq for m in metas), dtype=np.int64, count=n),
                      np.fromiter((m.slot for m in metas), dtype=np.int64, count=n),
                      np.asarray(values, dtype=np.float64).reshape(-1))
        self.seqs, self.slots, self.values = self.named  # those planned (plan may run again)
        self.number = -1

    def plan(self, overlay: Overlay) -> None:
        ring = self.buffer.ring
        seqs, slots, values = self.named
        # still in its slot: neither removed nor replaced by another entry since it was named
        keep = ring.slot_seq[slots] == seqs
        removed = overlay.ring(ring.ns_id).removed
        if removed:  # evicted earlier in this group: still in its slot until the group applies
            keep &= np.fromiter((seq not in removed for seq in seqs.tolist()), dtype=bool, count=self.count)
        self.seqs, self.slots, self.values = seqs[keep], slots[keep], values[keep]
        if len(self.seqs):  # numbered in the order planned, which is the order committed and applied
            self.number = ring.journal_next
            ring.journal_next += 1

    def txn(self, txn) -> None:
        if len(self.seqs):
            priojournal.put_record(txn, self.buffer.ns_id, self.number, self.seqs.astype(np.uint64), self.values)
        if self.wal_number:  # (records are queued in their order, so this only grows)
            priowal.put_applied(txn, self.wal_number)

    def failed(self) -> None:
        self.buffer._priorities_queued -= 1

    def apply(self) -> None:
        buffer = self.buffer
        buffer._priorities_queued -= 1
        ring = buffer.ring
        if len(self.seqs):
            ring.journal_applied = max(ring.journal_applied, self.number + 1)
            ring.journal_updates += len(self.seqs)
            buffer.journal_written()
        here = ring.slot_seq[self.slots] == self.seqs
        slots, values = self.slots[here], self.values[here]
        if len(slots):
            buffer.priorities_set(slots, values)
        buffer.counters["priority_updates"] += len(slots)
        # entries evicted between the write and its commit: skipped like unknown keys
        buffer.counters["priority_unknown_keys"] += self.count - len(slots)


class SnapshotPriorities(Change):
    """The buffer's priorities as memory holds them, written as its journal's snapshot; the
    records already applied (whose updates memory holds) go (distorefs/priojournal.py)."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer
        self.conflict_key = ("priority snapshot", buffer.ns_id)

    def plan(self, overlay: Overlay) -> None:
        ring = self.buffer.ring
        # Records below `upto` are applied; those planned in this group before this change
        # are not (their numbers are higher), and stay in the journal.
        self.upto = ring.journal_applied
        self.covered = ring.journal_updates
        slots = np.flatnonzero(ring.slot_seq[:len(ring.slot_meta)] >= 0)
        self.seqs = ring.slot_seq[slots].astype(np.uint64)
        self.priorities = self.buffer.sampler.priority[slots].copy()

    def txn(self, txn) -> None:
        priojournal.put_snapshot(txn, self.buffer.ns_id, self.upto, self.seqs, self.priorities)

    def failed(self) -> None:
        self.buffer._snapshot_queued = False

    def apply(self) -> None:
        self.buffer._snapshot_queued = False
        self.buffer.ring.journal_updates -= self.covered
        self.buffer.counters["priority_snapshots"] += 1


def _nothing() -> None:
    """(a reservation whose taker checks `void` itself at its open)"""

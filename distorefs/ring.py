"""The ring: a FIFO of keyed, immutable-per-version entries with capacity eviction.

Replay buffers and memory banks share it. An entry becomes visible whole when its
insert commits; it gets the next sequence number then, which fixes its FIFO position.
Rewriting an entry keeps its position; removal frees its slot. When the ring passes
`capacity` or `max_bytes`, entries are evicted (the oldest unless `evict` names another
remover: distorefs/removers.py) in the same transaction as the insert that needed the
room, so a crash never leaves the ring over its bounds.

Every entry holds a slot (a dense small integer) so samplers can keep per-entry arrays.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import time
import weakref
from typing import TYPE_CHECKING, Callable, Hashable, Iterator, Protocol, TypeVar, cast

import numpy as np
import trio
from sortedcontainers import SortedDict

from . import codec, priojournal
from .clusterlog import Insert
from .catalog import DB_ENTRIES, DB_PRIO, DB_SAMPLED, EntryMeta, entry_key, ns_prefix, pack_f64
from .committer import Change, Overlay, Replan
from .config import RingConfig
from .errors import CorruptValue, CrossDevice, DistorefsError, InvalidArgument, NoSpace, NotFound, TooLarge
from .layout import pack_places
from .room import plan_room
from .names import check_name
from .owner import Owner
from .placement import TIER_LMDB, TIER_NAMES
from .removers import Candidates, Remover, ring_remover
from .services import Services
from .values import Spooled, ValueLayer
from .waiting import Outcome

if TYPE_CHECKING:
    from .backends.base import Txn
    from .prefetcher import Prefetcher
    from .values import WarmResult

log = logging.getLogger(__name__)

READING_S = 5.0  # the window of _Reading
FETCH_PENDING = 4096  # entries waiting for Ring.fetch_applied's fetch at most; older ones are left to their draw
NAME_TABLE_BYTES = 64  # longer entry names are not kept per slot (Ring.slot_name)


class _Reading:
    """What this node drew from a ring and what other nodes added to it, over the last
    READING_S to 2 x READING_S: new values are worth fetching as they are applied while the
    node draws at least as many entries as are added (a learner's node). A node that draws
    less (an evaluator now and then) fetches at most as many values as it draws, and a node
    that does not draw fetches none."""

    def __init__(self) -> None:
        self.start = float("-inf")  # time.monotonic() the current window began
        self.drawn = self.added = 0
        self.before = (0, 0)  # (drawn, added) of the window before

    def _roll(self) -> None:
        now = time.monotonic()
        if now - self.start > READING_S:
            self.before = (self.drawn, self.added) if now - self.start <= 2 * READING_S else (0, 0)
            self.drawn = self.added = 0
            self.start = now

    def drew(self, entries: int) -> None:
        self._roll()
        self.drawn += entries

    def add_worth_fetching(self) -> bool:
        """Count an entry another node added; True if its value is worth fetching now."""
        self._roll()
        self.added += 1
        drawn = self.drawn + self.before[0]
        return drawn > 0 and drawn >= self.added + self.before[1]


class RingObserver(Protocol):
    def entry_added(self, meta: EntryMeta, priority: float | None, times_sampled: int) -> None: ...
    def entry_replaced(self, old: EntryMeta, new: EntryMeta) -> None: ...
    def entry_removed(self, meta: EntryMeta) -> None: ...
    def entry_value(self, meta: EntryMeta, value: bytes) -> None: ...
    def slots_grown(self, capacity: int) -> None: ...
    def entries_loaded(self) -> None: ...


class Ring:
    def __init__(self, services: Services, ns_id: int, kind: str, name: str, config: RingConfig,
                 observer: RingObserver | None = None,
                 make_remover: Callable[[RingConfig], Remover] = ring_remover) -> None:
        self.values = services.values
        self.committer = services.committer
        self.compressibility = codec.Compressibility()  # of its entries' values, as they are encoded
        self._collect = services.collect
        self._entry_changed = services.entry_changed
        self._hot_value_added = services.hot_value_added
        self.ns_id = ns_id
        self.kind = kind
        self.name = name
        self.config = config
        self.observer = observer
        self.make_remover = make_remover
        self.remover = make_remover(config)
        self.by_seq: SortedDict = SortedDict()
        self.by_key: dict[bytes, EntryMeta] = {}
        self.next_seq = 1
        self.bytes = 0
        self.stored_bytes = 0
        self.tier_count = {t: 0 for t in TIER_NAMES}
        self.tier_bytes = {t: 0 for t in TIER_NAMES}
        self.slot_meta: list[EntryMeta | None] = []
        self.slot_seq = np.zeros(0, dtype=np.int64)  # seq of each slot's entry, -1 when free (vectorised checks)
        # Whether the memory tier holds each slot's value: a draw's entries to read ahead, in
        # one numpy step. Asking the tier key by key touched each drawn entry's objects, cold
        # in the CPU's caches by then: 60-100 µs a draw of 64 in the daemon, 8 µs warm.
        self.slot_cached = np.zeros(0, dtype=bool)
        # The generation (EntryMeta.gen) of each slot's entry, 0 when free: a gen is never
        # handed out twice, so it names the entry version a slot holds (a drawn batch's
        # entries are all still there: one comparison, not an object per entry).
        self.slot_gen = np.zeros(0, dtype=np.int64)
        # Each slot's entry name, for names of at most NAME_TABLE_BYTES ASCII bytes (the
        # width grows to the longest so far), and whether it is there (slot_named): a draw's
        # keys (`sample/N` lines, batch/N.npz's keys.npy) in one numpy step, not one cold
        # entry object and its key per entry (33 us a batch of 64 in the daemon).
        self.slot_name = np.zeros(0, dtype="S16")
        self.slot_named = np.zeros(0, dtype=bool)
        self._free_slots: list[int] = []
        self.counters = {"inserts": 0, "rewrites": 0, "deletes": 0, "evictions": 0,
                         "reads": 0, "read_bytes": 0, "inserted_bytes": 0,
                         "spooled_inserts": 0,  # of values a client stored itself (clientsession.py)
                         "fetched_applied": 0, "fetched_applied_bytes": 0}  # Ring.fetch_applied: handed, loaded
        # Entries with a smaller seq were demoted to NVMe (placement.py); a rewrite of one
        # goes to NVMe too.
        self.demote_front = 0
        # The priority journal (distorefs/priojournal.py): the next record's number, and the
        # updates its records hold since the last snapshot (the buffer writes and folds it).
        self.journal_next = 0
        self.journal_applied = 0  # records below it are applied (and any other is numbered above)
        self.journal_updates = 0
        self._room_lock = trio.Lock()
        self._room_epoch = 0  # bumped by every eviction that made room
        # Set by namespaces that read ahead (buffers: pre-sampled batches); keys (seq, gen).
        self.prefetcher: Prefetcher | None = None
        self.values.cache.watch(ns_id, self._cache_changed)
        # Told whenever a key enters `by_key` (True) or leaves it (False): the mount's
        # directory of the ring's names keeps the front's copy of them (mount/nodes.py).
        # Bound methods, held weakly: a forgotten directory's goes with it.
        self._name_watchers: list[weakref.WeakMethod] = []
        # Set by namespaces whose entries hold arrays (buffers): given an entry's key and
        # content, the (offset, length) of each array in it, None for an entry kept as plain
        # bytes; raises InvalidArgument for an entry the namespace refuses. Called when the
        # insert is planned.
        self.place: Callable[[bytes, bytes], list[tuple[int, int]] | None] | None = None
        # The same for a value a client stored itself: the regions it names, checked.
        self.place_spooled: Callable[[bytes, SpooledEntry], list[tuple[int, int]] | None] | None = None
        # A ring of a store shared on a Redis Cluster: every change goes through the
        # cluster's log and is applied here (as on every node) by its follower, which alone
        # evicts, in the log's global FIFO order.
        self.shared = services.follower
        self._shared_queue: list[_SharedInsert] = []
        self._shared_busy = False  # a task is publishing the queue
        self._shared_progress = trio.Event()  # set when a batch is published or that task stops
        self._spawn = services.spawn
        self._reading = _Reading()
        self._fetch_pending: list[EntryMeta] = []
        self._fetching = False  # a task fetches _fetch_pending
        self._publishing: set[bytes] = set()  # keys this node is inserting: their values are here

    # ----- queries -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, key: bytes) -> EntryMeta:
        meta = self.by_key.get(key)
        if meta is None:
            raise NotFound(f"{self.kind}/{self.name}: no entry {key!r}")
        return meta

    def at(self, index: int) -> EntryMeta:
        """The entry at FIFO position `index` (0 = oldest), in O(log n)."""
        if not 0 <= index < len(self.by_seq):
            raise NotFound(f"{self.kind}/{self.name}: no entry at position {index}")
        return self.by_seq.peekitem(index)[1]

    def iter_from(self, seq: int) -> Iterator[EntryMeta]:
        """Entries in FIFO order starting at sequence number `seq` (readdir resumes here)."""
        for s in self.by_seq.irange(minimum=seq):
            yield self.by_seq[s]

    def oldest(self) -> Iterator[EntryMeta]:
        return iter(self.by_seq.values())

    def newest(self) -> Iterator[EntryMeta]:
        return reversed(self.by_seq.values())

    def stats(self) -> dict:
        return {
            "entries": len(self.by_key),
            "capacity": self.config.capacity,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "compression_ratio": round(self.bytes / self.stored_bytes, 3) if self.stored_bytes else None,
            "tiers": {TIER_NAMES[t]: {"entries": self.tier_count[t], "stored_bytes": self.tier_bytes[t]}
                      for t in TIER_NAMES},
            **self.counters,
        }

    # ----- reads ---------------------------------------------------------------------

    def _cache_key(self, meta: EntryMeta) -> tuple[int, int, int]:
        return (self.ns_id, meta.seq, meta.gen)

    def _cache_changed(self, key: Hashable, held: bool) -> None:
        ring_key = cast("tuple[int, int, int]", key)  # (ns_id, seq, gen): _cache_key
        meta = self.by_seq.get(ring_key[1])
        if meta is not None and meta.gen == ring_key[2]:
            self.slot_cached[meta.slot] = held

    def watch_names(self, fn: Callable[[bytes, bool], None]) -> None:
        """Call `fn(key, True)` (a bound method, held weakly) whenever a key enters the ring
        (an insert, a rename's new name, an entry loaded) and `fn(key, False)` when one
        leaves it."""
        self._name_watchers.append(weakref.WeakMethod(fn))  # type: ignore[arg-type]

    def _names_changed(self, key: bytes, present: bool) -> None:
        for ref in list(self._name_watchers):
            fn = ref()
            if fn is None:
                self._name_watchers.remove(ref)
            else:
                fn(key, present)

    def names_of(self, slots: np.ndarray) -> np.ndarray | None:
        """The names of the entries in `slots` (a bytes array), or None if one of them is
        not in the name table (a long or non-ASCII name: read it from its entry)."""
        if not self.slot_named[slots].all():
            return None
        return self.slot_name[slots]

    def _name_slot(self, slot: int, key: bytes) -> None:
        if len(key) <= NAME_TABLE_BYTES and key.isascii() and b"\0" not in key:
            width = self.slot_name.dtype.itemsize
            if len(key) > width:
                self.slot_name = self.slot_name.astype(f"S{min(NAME_TABLE_BYTES, max(len(key), 2 * width))}")
            self.slot_name[slot] = key
            self.slot_named[slot] = True
        else:
            self.slot_named[slot] = False

    def uncached_slots(self, slots: np.ndarray) -> np.ndarray:
        """Those of `slots` whose values the memory tier does not hold."""
        return slots[~self.slot_cached[slots]]

    def cached(self, meta: EntryMeta) -> bytes | None:
        return self.values.cache.get(self._cache_key(meta))

    def fetch_item(self, meta: EntryMeta) -> tuple:
        """What ValueLayer.fetch takes to read `meta`'s value."""
        return self._cache_key(meta), meta.value, self._what(meta)

    def note_read(self, entries: int) -> None:
        """A batch of `entries` was drawn here, and this daemon reads its values."""
        self._reading.drew(entries)

    def fetch_applied(self, meta: EntryMeta) -> None:
        """A new entry of a shared ring, applied from the cluster's log. While this node
        reads the ring, its value is fetched into the memory tier now, together with the
        others applied meanwhile (one pipeline, one thread hand-off), instead of alone when
        a batch first draws it: that costs a hand-off and a round trip per one or two values
        and made a learner beside 2 inserting nodes lose 15-20 % of its rate. Only while
        the node draws at least as many entries as the others add (`_Reading`): so it never
        fetches more values than it draws, and a node that does not draw (an actor's)
        fetches none."""
        if meta.key in self._publishing or not self._reading.add_worth_fetching():
            return
        pending = self._fetch_pending
        pending.append(meta)
        if len(pending) > FETCH_PENDING:
            del pending[:len(pending) - FETCH_PENDING]
        if not self._fetching:
            self._fetching = True
            self._spawn(self._fetch_pending_values)

    async def _fetch_pending_values(self) -> None:
        try:
            while self._fetch_pending:
                metas, self._fetch_pending = self._fetch_pending, []
                items = [self.fetch_item(m) for m in metas if self.by_seq.get(m.seq) is m]  # not gone meanwhile
                if items:
                    result = await self.values.warm(items)
                    self.counters["fetched_applied"] += len(items)
                    self.counters["fetched_applied_bytes"] += result.loaded
        finally:
            self._fetching = False

    def value_known(self, meta: EntryMeta, value: bytes) -> None:
        """The decoded value of an entry just committed: into the memory tier, and told to
        the observer (a buffer's rows)."""
        self.values.cache.put(self._cache_key(meta), value)
        if self.observer is not None:
            self.observer.entry_value(meta, value)

    async def read(self, meta: EntryMeta, follow_rewrites: bool = True) -> bytes:
        """The whole decoded value of `meta` (memory tier first, then its disk tier).

        If the entry was rewritten while its value was being read, the current version is
        returned (NotFound without `follow_rewrites`); if it was removed, NotFound. Only a
        current value that does not verify is corruption (EIO, logged, counted).
        """
        value = await self._load(meta, follow_rewrites)
        self.counters["reads"] += 1
        self.counters["read_bytes"] += len(value)
        return value

    async def _load(self, meta: EntryMeta, follow_rewrites: bool = True) -> bytes:
        for _ in range(8):
            key = self._cache_key(meta)
            result = (await self.values.fetch([self.fetch_item(meta)], cache=False))[0]
            if isinstance(result, bytes):
                if self.by_seq.get(meta.seq) is meta:
                    self.values.cache.put(key, result)
                return result
            if not isinstance(result, (NotFound, CorruptValue)):
                raise result
            if self.by_key.get(meta.key) is meta:
                # A group that removes or rewrites it may have committed without being
                # applied yet: let the committer catch up before calling it damage.
                await self.committer.settle()
            if self.shared is not None and self.by_key.get(meta.key) is meta:
                # A shared store's value leaves the cluster once any node applied the record
                # that evicted or deleted its entry, maybe before this node did: catch up.
                await self.shared.catch_up(SHARED_CATCH_UP_S)
            current = self.by_key.get(meta.key)
            if current is meta:
                raise self.values.report_corrupt(result) from None
            if current is None or current.seq != meta.seq:
                raise NotFound(f"{self._what(meta)} was removed while being read") from None
            if not follow_rewrites and not meta.same_content(current):
                raise NotFound(f"{self._what(meta)} was rewritten while being read") from None
            meta = current  # moved meanwhile (or rewritten: read the new version)
        raise NotFound(f"{self._what(meta)} keeps changing; try again")

    async def read_many(self, metas: list[EntryMeta], follow_rewrites: bool = True) -> list[bytes]:
        """Values of many entries: the memory tier, then prefetched values, then one read
        hand-off for all the rest (races and damage then one at a time). Without
        `follow_rewrites`, an entry rewritten meanwhile is NotFound, not its new version."""
        cache = self.values.cache
        values: list[bytes | None] = [cache.get(self._cache_key(m)) for m in metas]
        if self.prefetcher is not None:
            for i, m in enumerate(metas):
                if values[i] is None:
                    taken = values[i] = await self.prefetcher.take((m.seq, m.gen))
                    if taken is not None:
                        cache.put(self._cache_key(m), taken)  # drawn again soon, maybe
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            loaded = await self.values.fetch([self.fetch_item(metas[i]) for i in missing])
            for i, value in zip(missing, loaded):
                values[i] = value if isinstance(value, bytes) else await self._load(metas[i], follow_rewrites)
        read = cast("list[bytes]", values)  # every None was filled above
        self.counters["reads"] += len(metas)
        self.counters["read_bytes"] += sum(len(v) for v in read)
        return read

    async def warm(self, meta: EntryMeta) -> "WarmResult":
        """Load an entry's value into the memory tier (distorefs warmup)."""
        return await self.values.warm([self.fetch_item(meta)])

    def prefetch_loader(self, keys: list[tuple[int, int]]) -> list[bytes | None]:
        """The prefetcher's loader (worker thread): values not in the memory tier already,
        read together (those in a shared store's cluster in one pipeline, not a round trip
        each); a value that fails to read is None (the read itself reports it)."""
        out: list[bytes | None] = [None] * len(keys)
        wanted: list[tuple[int, EntryMeta]] = []
        for i, (seq, gen) in enumerate(keys):
            meta = self.by_seq.get(seq)
            if meta is not None and meta.gen == gen and self.values.cache.peek(self._cache_key(meta)) is None:
                wanted.append((i, meta))
        results = self.values.read_all([(meta.value, self._what(meta)) for _, meta in wanted])
        for (i, _), result in zip(wanted, results):
            if not isinstance(result, BaseException):
                out[i] = result
        return out

    def _what(self, meta: EntryMeta) -> str:
        return f"{self.kind}/{self.name}/entries/{meta.key.decode(errors='replace')} (seq {meta.seq})"

    # ----- writes --------------------------------------------------------------------

    def check_insert(self, key: bytes, size: int) -> None:
        check_name(key)
        limit = self.config.max_entry_bytes
        if self.config.max_bytes:
            limit = min(limit, self.config.max_bytes)
        if size > limit:
            raise TooLarge(f"{self.kind}/{self.name}: entry of {size} bytes exceeds the limit of {limit}")

    async def insert(self, key: bytes, data: "bytes | SpooledEntry", owner: Owner,
                     priority: float | None = None) -> EntryMeta:
        """Insert or rewrite `key` with `data`; returns once committed. With the disk full,
        the oldest entries make room if the ring allows it (`evict_when_full`)."""
        self.check_insert(key, value_size(data))
        if self.shared is not None:
            return await self._insert_shared(key, data, owner, priority)
        for attempt in range(4):
            change = InsertEntry(self, key, data, owner, priority)
            epoch = self._room_epoch
            try:
                await self.committer.submit(change)
            except NoSpace:
                if not self.config.evict_when_full or attempt == 3 or not await self._make_room(value_size(data), epoch):
                    raise
                continue
            return change.meta  # type: ignore[return-value]
        raise AssertionError("unreachable")

    async def _insert_shared(self, key: bytes, data: "bytes | SpooledEntry", owner: Owner,
                             priority: float | None) -> EntryMeta:
        """The value to the cluster, then the insert to its log (both durable), then the
        entry as this node's follower applied it. Inserts waiting meanwhile go together:
        their values in a round trip per master, their records in one script."""
        item = self._queue_shared(key, data, owner, priority)
        await self._publish_queued(item)
        return await self._shared_done(item)

    def _queue_shared(self, key: bytes, data: "bytes | SpooledEntry", owner: Owner,
                      priority: float | None) -> "_SharedInsert":
        if isinstance(data, SpooledEntry):
            raise InvalidArgument(f"{self.kind}/{self.name}: a shared store's values go to its cluster, "
                                  "not to a client's spool")
        regions = self.place(key, data) if self.place is not None else None  # refused here, not in the log
        item = _SharedInsert(key, data, regions, owner, priority)
        self._shared_queue.append(item)
        return item

    async def _publish_queued(self, mine: "_SharedInsert") -> None:
        """Return once `mine` (the last of a caller's queued inserts) is published: publish
        what is queued when no task does, else wait for the task that does. A task publishes
        only up to its own caller's inserts (and those in the same batch), then hands on: a
        close() never waits for inserts queued after its own, which with writers that keep
        coming could be for ever (and its own entry evicted meanwhile)."""
        while not mine.outcome.done.is_set():
            if self._shared_busy:
                await self._shared_progress.wait()
                continue
            self._shared_busy = True
            try:
                with trio.CancelScope(shield=True):  # others' inserts ride on this task
                    while self._shared_queue and not mine.outcome.done.is_set():
                        batch = self._shared_queue[:SHARED_BATCH]
                        del self._shared_queue[:SHARED_BATCH]
                        await self._publish_inserts(batch)
                        self._progressed()
            finally:
                self._shared_busy = False
                self._progressed()  # a waiter takes over what is still queued

    def _progressed(self) -> None:
        self._shared_progress.set()
        self._shared_progress = trio.Event()

    async def _shared_done(self, item: "_SharedInsert") -> EntryMeta:
        await item.outcome.wait()
        meta = self.by_key.get(item.key)
        if meta is None:  # evicted (or deleted) again by the records that followed it
            raise NotFound(f"{self.kind}/{self.name}: {item.key!r} was inserted and removed again at once")
        self.value_known(meta, bytes(item.data))
        return meta

    async def _publish_inserts(self, batch: list["_SharedInsert"]) -> None:
        shared = self.shared
        assert shared is not None
        config = self.config

        def append() -> list[bytes]:
            encs, places = zip(*(encode_entry(it.data, it.regions, config, self.compressibility) for it in batch))
            values = self.values.put_shared_many(encs)
            now = time.time_ns()
            return shared.log.insert(self.kind, self.name, [
                Insert(it.key, len(it.data), v.pack(), p, it.owner, now, it.priority)
                for it, v, p in zip(batch, values, places)])

        publishing = self._publishing
        publishing.update(it.key for it in batch)
        try:
            ids = await trio.to_thread.run_sync(append)
            await shared.until(ids[-1])
        except BaseException as exc:
            for it in batch:
                it.outcome.finish(exc if isinstance(exc, DistorefsError) else DistorefsError(f"insert failed: {exc}"))
            if not isinstance(exc, Exception):
                raise
            if not isinstance(exc, DistorefsError):
                log.exception("%s/%s: shared inserts failed", self.kind, self.name)
            return
        finally:
            publishing.difference_update(it.key for it in batch)
        for it in batch:
            it.outcome.finish()

    async def insert_many(self, items: "list[tuple[bytes, bytes | SpooledEntry]]", owner: Owner,
                          priority: float | None = None) -> list["EntryMeta | BaseException"]:
        """Insert or rewrite many entries in the order given, sharing commit groups; each
        result is the entry committed or the error of its insert. One refused for lack of
        room is retried alone, as `insert` does (the oldest entries may make room)."""
        out: list[EntryMeta | BaseException] = []
        if self.shared is not None:  # all queued first: they are published together
            queued: list[_SharedInsert | DistorefsError] = []
            for key, data in items:
                try:
                    self.check_insert(key, value_size(data))
                    queued.append(self._queue_shared(key, data, owner, priority))
                except DistorefsError as exc:
                    queued.append(exc)
            last = next((q for q in reversed(queued) if isinstance(q, _SharedInsert)), None)
            if last is not None:
                await self._publish_queued(last)
            for queued_item in queued:
                try:
                    out.append(queued_item if isinstance(queued_item, DistorefsError)
                               else await self._shared_done(queued_item))
                except DistorefsError as exc:
                    out.append(exc)
            return out
        changes: list[InsertEntry] = []
        for key, data in items:
            try:
                self.check_insert(key, value_size(data))
            except DistorefsError as exc:
                out.append(exc)
                continue
            change = InsertEntry(self, key, data, owner, priority)
            changes.append(change)
            out.append(change)  # type: ignore[arg-type]  # replaced below
        errors = iter(await self.committer.submit_all(changes))
        for i, item in enumerate(out):
            if not isinstance(item, InsertEntry):
                continue
            error = next(errors)
            if isinstance(error, NoSpace) and self.config.evict_when_full:
                try:
                    out[i] = await self.insert(item.key, item.data, owner, priority)
                except DistorefsError as exc:
                    out[i] = exc
            else:
                out[i] = error if error is not None else item.meta  # type: ignore[assignment]
        return out

    async def _make_room(self, need: int, epoch: int) -> bool:
        """Evict the oldest entries whose space would hold the new value, and give it back
        (sync, then unlink the segments they emptied). False if evicting would not make
        room (distorefs/room.py): then nothing is evicted."""
        async with self._room_lock:
            if self._room_epoch != epoch:
                return True  # another insert made room since our attempt: try again first
            victims = await trio.to_thread.run_sync(plan_room, self.values, list(self.by_seq.values()), need)
            total = sum(m.stored_size for m in victims)
            if not victims:
                log.warning("%s/%s: disk full, and evicting its entries would not make room for %d bytes: "
                            "ENOSPC", self.kind, self.name, need)
                return False
            errors = await self.committer.submit_all(
                [RemoveEntry(self, m.key, m.seq, "evictions_for_space") for m in victims])
            await self._collect()
            self._room_epoch += 1
            log.warning("%s/%s: disk full, evicted the %d oldest entries (%d bytes)", self.kind, self.name,
                        sum(e is None for e in errors), total)
            return True

    async def delete(self, key: bytes, expect_seq: int | None = None, reason: str = "deletes") -> None:
        if self.shared is not None:
            self.get(key)  # NotFound here, before the log
            await self.shared.publish(self.shared.log.delete, self.kind, self.name, key)
            return
        await self.committer.submit(RemoveEntry(self, key, expect_seq, reason))

    async def rename(self, old: bytes, new: bytes) -> None:
        check_name(new)
        if self.shared is not None:  # `mv` copies and unlinks instead
            raise CrossDevice(f"{self.kind}/{self.name}: entries of a shared store are not renamed in place")
        await self.committer.submit(RenameEntry(self, old, new))

    async def set_attrs(self, key: bytes, *, mode: int | None = None, uid: int | None = None,
                        gid: int | None = None, mtime_ns: int | None = None) -> EntryMeta:
        change = SetEntryAttrs(self, key, mode, uid, gid, mtime_ns)
        await self.committer.submit(change)
        return change.meta  # type: ignore[return-value]

    def configure(self, config: RingConfig) -> None:
        """A new configuration: its bounds, and the remover its `evict` names."""
        if config.evict != self.config.evict:
            self.remover = self.make_remover(config)
        self.config = config

    def over_bounds(self, ro, config: RingConfig | None = None) -> bool:
        """Whether the ring, with the group's planned changes `ro`, passes its bounds."""
        config = config or self.config
        if self.shared is not None:
            return False  # the log's records say what leaves (global FIFO)
        return (len(self.by_key) + ro.count > config.capacity
                or bool(config.max_bytes and self.bytes + ro.bytes > config.max_bytes))

    def plan_evictions(self, ro, protect: int = -1, config: RingConfig | None = None) -> list[EntryMeta]:
        """Entries to evict, in the order the remover gives (`evict`), so the ring fits its
        bounds after the planned changes."""
        victims: list[EntryMeta] = []
        config = config or self.config

        def over() -> bool:
            return self.over_bounds(ro, config)

        if not over():
            return victims
        own = config.evict == self.config.evict
        if own:  # shared by the group's plans; the committer closes it
            if ro.candidates is None:
                ro.candidates = Candidates(self.remover.candidates(self))
            candidates = ro.candidates
        else:  # a new configuration's remover, for the evictions it makes itself
            candidates = Candidates(self.make_remover(config).candidates(self))
        try:
            while over():
                victim = candidates.next(ro.removed, protect)
                if victim is None:
                    break
                ro.removed.add(victim.seq)
                ro.count -= 1
                ro.bytes -= victim.size
                victims.append(victim)
        finally:
            if not own:
                candidates.close()
        return victims

    # ----- transaction and apply steps shared by the changes -------------------------

    def txn_remove(self, txn, meta: EntryMeta) -> None:
        k = entry_key(self.ns_id, meta.seq)
        txn.delete(k, db=DB_ENTRIES)
        txn.delete(k, db=DB_PRIO)
        txn.delete(k, db=DB_SAMPLED)
        self.values.delete(txn, meta.value)

    def txn_put(self, txn, meta: EntryMeta, priority: float | None) -> None:
        """An entry's record (and a new entry's first priority, if it has one)."""
        k = entry_key(self.ns_id, meta.seq)
        txn.put(k, meta.pack(), db=DB_ENTRIES)
        if priority is not None:
            txn.put(k, pack_f64(priority), db=DB_PRIO)

    def apply_written(self, victims: list[EntryMeta], old: EntryMeta | None, meta: EntryMeta,
                      priority: float | None) -> None:
        """An insert (`old` None) or rewrite committed, and the entries it evicted."""
        for victim in victims:
            self.apply_remove(victim, "evictions")
        if old is not None:
            self.apply_replace(old, meta)
            self.counters["rewrites"] += 1
        else:
            self.apply_add(meta, priority)
            self.counters["inserts"] += 1
        self.counters["inserted_bytes"] += meta.size

    def apply_add(self, meta: EntryMeta, priority: float | None = None, times_sampled: int = 0,
                  indexed: bool = False) -> None:
        meta.gen = self.values.next_gen()
        meta.slot = self._take_slot()
        self.slot_meta[meta.slot] = meta
        self.slot_seq[meta.slot] = meta.seq
        self.slot_gen[meta.slot] = meta.gen
        self.slot_cached[meta.slot] = False
        self._name_slot(meta.slot, meta.key)
        if not indexed:
            self.by_seq[meta.seq] = meta
        self.by_key[meta.key] = meta
        self.next_seq = max(self.next_seq, meta.seq + 1)
        if self._name_watchers:
            self._names_changed(meta.key, True)
        self._account(meta, +1)
        if self.observer is not None:
            self.observer.entry_added(meta, priority, times_sampled)

    def apply_replace(self, old: EntryMeta, new: EntryMeta) -> None:
        new.gen = self.values.next_gen()
        new.slot = old.slot
        self.slot_meta[new.slot] = new
        self.slot_gen[new.slot] = new.gen
        self.slot_cached[new.slot] = False  # the new generation's value: until it is put
        self.by_seq[new.seq] = new
        if old.key != new.key:
            del self.by_key[old.key]
            self._name_slot(new.slot, new.key)
            if self._name_watchers:
                self._names_changed(new.key, True)  # (first: the name is never missing in between)
                self._names_changed(old.key, False)
        self.by_key[new.key] = new
        self._account(old, -1)
        self._account(new, +1)
        cache = self.values.cache
        cached = cache.peek(self._cache_key(old))
        cache.discard(self._cache_key(old))
        if self.prefetcher is not None:
            self.prefetcher.forget((old.seq, old.gen))
        if cached is not None and new.value == old.value:
            cache.put(self._cache_key(new), cached)  # same value, new name or attrs
        if self.observer is not None:
            self.observer.entry_replaced(old, new)
        self._entry_changed(self, old, new)

    def apply_relocate(self, old: EntryMeta, new: EntryMeta) -> None:
        """The same value moved to another tier or location (demotion, compaction): the
        entry keeps its slot, generation (cached copies stay valid) and priority."""
        new.gen = old.gen
        new.slot = old.slot
        self.slot_meta[new.slot] = new
        self.by_seq[new.seq] = new
        self.by_key[new.key] = new
        self._account(old, -1)
        self._account(new, +1)

    def apply_remove(self, meta: EntryMeta, reason: str) -> None:
        del self.by_seq[meta.seq]
        del self.by_key[meta.key]
        if self._name_watchers:
            self._names_changed(meta.key, False)
        self.slot_meta[meta.slot] = None
        self.slot_seq[meta.slot] = -1
        self.slot_gen[meta.slot] = 0
        self.slot_cached[meta.slot] = False
        self.slot_named[meta.slot] = False
        self._free_slots.append(meta.slot)
        self._account(meta, -1)
        self.counters[reason] = self.counters.get(reason, 0) + 1
        self.values.cache.discard(self._cache_key(meta))
        if self.prefetcher is not None:
            self.prefetcher.forget((meta.seq, meta.gen))
        if self.observer is not None:
            self.observer.entry_removed(meta)
        self._entry_changed(self, meta, None)

    def _account(self, meta: EntryMeta, sign: int) -> None:
        self.bytes += sign * meta.size
        self.stored_bytes += sign * meta.stored_size
        self.tier_count[meta.tier] += sign
        self.tier_bytes[meta.tier] += sign * meta.stored_size

    def _take_slot(self) -> int:
        if not self._free_slots:
            old = len(self.slot_meta)
            new = max(1024, old * 2)
            self.slot_meta.extend([None] * (new - old))
            self.slot_seq = np.concatenate([self.slot_seq, np.full(new - old, -1, dtype=np.int64)])
            self.slot_cached = np.concatenate([self.slot_cached, np.zeros(new - old, dtype=bool)])
            self.slot_gen = np.concatenate([self.slot_gen, np.zeros(new - old, dtype=np.int64)])
            self.slot_name = np.concatenate([self.slot_name, np.zeros(new - old, dtype=self.slot_name.dtype)])
            self.slot_named = np.concatenate([self.slot_named, np.zeros(new - old, dtype=bool)])
            self._free_slots.extend(range(new - 1, old - 1, -1))
            if self.observer is not None:
                self.observer.slots_grown(new)
        return self._free_slots.pop()

    # ----- loading -------------------------------------------------------------------

    def load(self, txn) -> None:
        """Rebuild the in-memory ring from the catalog (at store open, in a worker thread)."""
        prefix = ns_prefix(self.ns_id)
        prio = _scan(txn, DB_PRIO, prefix, lambda v: float(memoryview(v).cast("d")[0]))
        journal = priojournal.read(txn, self.ns_id)  # newer than the rows: the last pair of a seq holds
        prio.update(zip(journal.seqs.tolist(), journal.priorities.tolist()))
        self.journal_next = self.journal_applied = journal.next_record
        self.journal_updates = journal.updates
        sampled = _scan(txn, DB_SAMPLED, prefix, lambda v: int(memoryview(v).cast("I")[0]))
        cursor = txn.cursor(DB_ENTRIES)
        metas = []
        if cursor.set_range(prefix):
            for k, v in cursor:
                if not bytes(k[:4]) == prefix:
                    break
                metas.append(EntryMeta.unpack(_SEQ.unpack_from(k, 4)[0], v))
        # In seq order: one bulk update of the sorted index instead of an insert per entry.
        self.by_seq.update((m.seq, m) for m in metas)
        for meta in metas:
            self.apply_add(meta, prio.get(meta.seq), sampled.get(meta.seq, 0), indexed=True)
        if self.observer is not None:
            self.observer.entries_loaded()


SHARED_BATCH = 64  # inserts of a shared ring published together at most
SHARED_CATCH_UP_S = 3.0  # a read whose value left the cluster waits this long at most for the log


@dataclasses.dataclass(frozen=True)
class SpooledEntry:
    """An entry whose value a client beside the mount stored in its spool: the value, and
    where the client says the arrays of the buffer's layout are in it (offsets into the
    decoded value, and their CRC-32s, as an entry's places keep them)."""

    value: Spooled
    offsets: tuple[int, ...] = ()
    crcs: tuple[int, ...] = ()


def value_size(data: "bytes | SpooledEntry") -> int:
    """The decoded size of an insert's value."""
    return data.value.size if isinstance(data, SpooledEntry) else len(data)


def encode_entry(raw: bytes, regions: list[tuple[int, int]] | None, config: RingConfig,
                 stream: codec.Compressibility | None = None, hot: bool = False) -> tuple[codec.Encoded, bytes]:
    """An entry's stored form and its packed places (the arrays' offsets and CRCs, b"" for
    none): the arrays' CRCs and the whole's in one pass. `stream`: its ring's (codec.encode).
    `hot`: it lands in the hot tier, stored as written (`RingConfig.compress_hot`)."""
    crc, places = None, b""
    if regions:
        crc, crcs = codec.checksums(raw, regions)
        places = pack_places([off for off, _ in regions], crcs)
    compression = "none" if hot else config.compression
    return codec.encode(raw, compression, config.compression_level, crc=crc, stream=stream), places


def stored_as_written(config: RingConfig, values: ValueLayer, size: int, cold: bool,
                      txn: Txn | None = None) -> bool:
    """Whether a ring value of `size` bytes is stored as written, its compression left to
    its demotion: it lands in the hot tier, and the ring compresses only cold values. The
    insert's CPU is then the copy and the checksum (zstd was a third of it), and a value
    evicted before it is demoted is never compressed."""
    return config.compression != "none" and not config.compress_hot and values.lands_hot(size, cold, txn)


class _SharedInsert:
    __slots__ = ("key", "data", "regions", "owner", "priority", "outcome")

    def __init__(self, key: bytes, data: bytes, regions, owner: Owner, priority: float | None) -> None:
        self.key, self.data, self.regions, self.owner, self.priority = key, data, regions, owner, priority
        self.outcome = Outcome()


class RingNamespace:
    """A namespace whose entries live in one ring: buffers/NAME and banks/NAME."""

    kind = ""
    config_type: type = RingConfig

    def __init__(self, services: Services, ns_id: int, name: str, config: RingConfig, owner: Owner,
                 ctime_ns: int, observer: RingObserver | None = None,
                 make_remover: Callable[[RingConfig], Remover] = ring_remover) -> None:
        self.name = name
        self.owner = owner
        self.ctime_ns = ctime_ns
        self.ring = Ring(services, ns_id, self.kind, name, config, observer=observer, make_remover=make_remover)

    @property
    def config(self):
        return self.ring.config

    @property
    def ns_id(self) -> int:
        return self.ring.ns_id


_SEQ = struct.Struct(">Q")
_T = TypeVar("_T")


def _scan(txn, db: bytes, prefix: bytes, decode: Callable[[memoryview], _T]) -> dict[int, _T]:
    out: dict[int, _T] = {}
    cursor = txn.cursor(db)
    if cursor.set_range(prefix):
        for k, v in cursor:
            if bytes(k[:4]) != prefix:
                break
            out[_SEQ.unpack_from(k, 4)[0]] = decode(v)
    return out


# ----- changes ---------------------------------------------------------------------------


class InsertEntry(Change):
    """Insert or rewrite. The value is compressed in `prepare`, inside the commit
    group's one thread call (one thread hop per insert instead of two); zstd releases
    the GIL, so the event loop keeps serving requests meanwhile. A value that lands in
    the hot tier is only checksummed there (`stored_as_written`): its demotion compresses it."""

    def __init__(self, ring: Ring, key: bytes, data: "bytes | SpooledEntry", owner: Owner,
                 priority: float | None) -> None:
        """`data`: the entry's bytes, or a value a client stored in its spool already (then
        nothing is encoded or written here: the value is adopted where it is)."""
        self.ring = ring
        self.key = key
        self.enc: codec.Encoded | None = None
        self.spooled: SpooledEntry | None = data if isinstance(data, SpooledEntry) else None
        self.raw: bytes | None = None if isinstance(data, SpooledEntry) else data
        self.data = data
        self.size = value_size(data)
        self.owner = owner
        self.priority = priority
        self.conflict_key = (ring.ns_id, key)
        self.meta: EntryMeta | None = None
        self.regions: list[tuple[int, int]] | None = None
        self.places = b""
        self.hot = False  # stored as written (stored_as_written), as planned

    def plan(self, overlay: Overlay) -> None:
        ring = self.ring
        if self.spooled is not None:  # where the client says they are, checked against the layout
            self.regions = ring.place_spooled(self.key, self.spooled) if ring.place_spooled is not None else None
        elif ring.place is not None and self.raw is not None:  # the arrays in it, from their headers
            self.regions = ring.place(self.key, self.raw)
        ro = overlay.ring(ring.ns_id)
        old = ring.by_key.get(self.key)
        if old is not None and old.seq in ro.removed:
            old = None  # evicted earlier in this group: this insert makes a new entry
        self.old = old
        if old is not None:
            self.seq = old.seq
            ro.bytes += self.size - old.size
        else:
            self.seq = ring.next_seq
            ring.next_seq += 1
            ro.count += 1
            ro.bytes += self.size
        self.victims = ring.plan_evictions(ro, protect=self.seq)
        if ro.inserts and ring.over_bounds(ro):
            # Only entries committed before the group can be evicted, and the group's earlier
            # inserts already took what fits: this one waits for the next group, where
            # they are evictable (so the ring never commits over its bounds).
            self._unplan(ro)
            raise Replan(f"{ring.kind}/{ring.name}: full with this group's inserts")
        ro.inserts += 1
        self.mtime_ns = time.time_ns()
        self.hot = self.raw is not None and stored_as_written(ring.config, ring.values, self.size,
                                                               self.seq < ring.demote_front)

    def _unplan(self, ro) -> None:
        ring = self.ring
        for victim in self.victims:
            ro.removed.discard(victim.seq)
            ro.count += 1
            ro.bytes += victim.size
        if self.old is not None:
            ro.bytes -= self.size - self.old.size
        else:
            ro.count -= 1
            ro.bytes -= self.size
            if ring.next_seq == self.seq + 1:
                ring.next_seq = self.seq  # no gap in the sequence numbers
        self.victims = []

    def prepare_bytes(self) -> int:
        # a spooled value was encoded by its client; one stored as written is only checksummed
        # (in the transaction: a pool thread's hop would cost more)
        return len(self.raw) if self.spooled is None and self.raw is not None and not self.hot else 0

    def prepare(self) -> None:
        if self.spooled is not None:
            if self.regions:
                self.places = pack_places([off for off, _ in self.regions], list(self.spooled.crcs))
        elif self.enc is None and self.raw is not None:  # kept across a rerun of the transaction
            self.enc, self.places = encode_entry(self.raw, self.regions, self.ring.config, self.ring.compressibility,
                                                 hot=self.hot)

    def txn(self, txn) -> None:
        ring, values = self.ring, self.ring.values
        cold = self.seq < ring.demote_front
        if self.hot and self.raw is not None and not stored_as_written(ring.config, values, self.size, cold, txn):
            self.hot, self.enc = False, None  # the hot tier filled since it was planned: compressed after all
        self.prepare()
        for victim in self.victims:
            ring.txn_remove(txn, victim)
        if self.old is not None:
            values.delete(txn, self.old.value)
        if self.spooled is not None:
            value = values.adopt(txn, self.spooled.value)
        else:
            assert self.enc is not None
            value = values.put(txn, entry_key(ring.ns_id, self.seq), self.enc, stream=ring.ns_id, cold=cold)
        self.meta = EntryMeta(self.seq, self.key, value, self.owner.mode, self.owner.uid, self.owner.gid,
                              self.mtime_ns, self.places)
        ring.txn_put(txn, self.meta, None if self.old is not None else self.priority)

    def apply(self) -> None:
        ring = self.ring
        assert self.meta is not None
        ring.apply_written(self.victims, self.old, self.meta, self.priority)
        if self.raw is not None:
            ring.value_known(self.meta, bytes(self.raw))
        else:  # a spooled value: read from its spool when wanted
            ring.counters["spooled_inserts"] += 1
        if self.meta.tier == TIER_LMDB:
            ring._hot_value_added()


class RemoveEntry(Change):
    def __init__(self, ring: Ring, key: bytes, expect_seq: int | None, reason: str) -> None:
        self.ring = ring
        self.key = key
        self.expect_seq = expect_seq
        self.reason = reason
        self.conflict_key = (ring.ns_id, key)

    def plan(self, overlay: Overlay) -> None:
        ro = overlay.ring(self.ring.ns_id)
        meta = self.ring.get(self.key)
        if meta.seq in ro.removed or (self.expect_seq is not None and meta.seq != self.expect_seq):
            raise NotFound(f"{self.ring.kind}/{self.ring.name}: no entry {self.key!r}")
        ro.removed.add(meta.seq)
        ro.count -= 1
        ro.bytes -= meta.size
        self.meta = meta

    def txn(self, txn) -> None:
        self.ring.txn_remove(txn, self.meta)

    def apply(self) -> None:
        self.ring.apply_remove(self.meta, self.reason)


class RenameEntry(Change):
    """Rename keeps the FIFO position; an existing entry under the new name is replaced."""

    def __init__(self, ring: Ring, old: bytes, new: bytes) -> None:
        self.ring = ring
        self.old_key = old
        self.new_key = new
        self.conflict_key = (ring.ns_id, "rename")

    def plan(self, overlay: Overlay) -> None:
        ro = overlay.ring(self.ring.ns_id)
        self.meta = self.ring.get(self.old_key)
        if self.meta.seq in ro.removed:
            raise NotFound(f"no entry {self.old_key!r}")
        target = self.ring.by_key.get(self.new_key)
        self.target = target if target is not None and target.seq != self.meta.seq else None
        if self.target is not None:
            ro.removed.add(self.target.seq)
            ro.count -= 1
            ro.bytes -= self.target.size

    def txn(self, txn) -> None:
        if self.target is not None:
            self.ring.txn_remove(txn, self.target)
        self.new = dataclasses.replace(self.meta, key=self.new_key)
        txn.put(entry_key(self.ring.ns_id, self.new.seq), self.new.pack(), db=DB_ENTRIES)

    def apply(self) -> None:
        if self.target is not None:
            self.ring.apply_remove(self.target, "deletes")
        self.ring.apply_replace(self.meta, self.new)


class SetEntryAttrs(Change):
    def __init__(self, ring: Ring, key: bytes, mode, uid, gid, mtime_ns) -> None:
        self.ring = ring
        self.key = key
        self.attrs = (mode, uid, gid, mtime_ns)
        self.conflict_key = (ring.ns_id, key)

    def plan(self, overlay: Overlay) -> None:
        self.old = self.ring.get(self.key)
        changes = dict(zip(("mode", "uid", "gid", "mtime_ns"), self.attrs))
        self.meta = dataclasses.replace(self.old, **{k: v for k, v in changes.items() if v is not None})

    def txn(self, txn) -> None:
        txn.put(entry_key(self.ring.ns_id, self.meta.seq), self.meta.pack(), db=DB_ENTRIES)

    def apply(self) -> None:
        self.ring.apply_replace(self.old, self.meta)

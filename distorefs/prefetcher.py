"""The prefetcher: reads values ahead of a declared order, within a byte budget.

One mechanism, two sources of order: a dataset's `order` file (the item numbers of the
next epoch) and a replay buffer's pre-sampled batches (entries drawn ahead of their
opens). The source hands over keys in the order they will be read; the prefetcher loads
them in worker threads, several batches at once (a cold disk serves many small reads
in parallel far faster than one after another), and holds the values until they are
read. A read takes its value (a *hit*), waits for it if it is being loaded (*late*), or
finds nothing (a *miss*: the caller reads the disk). An open whose reads the kernel page
cache served from an earlier read, so that none reached us, counts as *page_cache*. What was read is dropped; values the
reader went past without reading are dropped once it is `lag` keys beyond them.

All prefetchers of a store share one `PrefetchBudget` (config `prefetch_bytes`); a value
may also be pushed straight into the kernel page cache by the `push` hook (the mount layer
does this for files whose inode the kernel already holds) and then needs no memory here.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterable, Sequence, TypeVar

import trio

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


def hit_rate(counters: dict) -> float | None:
    """The share of reads served from memory: prefetched, or already in the page cache."""
    served = counters["hits"] + counters["late"] + counters["page_cache"]
    reads = served + counters["misses"]
    return round(served / reads, 4) if reads else None


class PrefetchBudget:
    """Bytes held by every prefetcher of a store, against `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0


class Prefetcher(Generic[K]):
    def __init__(self, budget: PrefetchBudget, fetch: Callable[[list[K]], list[bytes | None]], *,
                 spawn: Callable, workers: int = 4, batch_items: int = 32, lag: int = 1024,
                 push: Callable[[K, bytes], bool] | None = None,
                 elsewhere: Callable[[], bool] | None = None) -> None:
        """`fetch(keys)` loads values in a worker thread (None where a key has no value);
        `spawn(fn)` starts the background task in the owner's nursery; `elsewhere()`: the
        plan's keys are read without us now (by a client reading the store's files itself),
        so they are passed over, not loaded."""
        self.budget = budget
        self.fetch = fetch
        self.spawn = spawn
        self.workers = workers
        self.batch_items = batch_items
        self.lag = lag
        self.push = push
        self.elsewhere = elsewhere
        self._plan: Sequence[K] = []
        self._next = 0  # index in _plan of the next key to load
        self._base = 0  # plan positions consumed and trimmed from the head of _plan
        self._gen = 0  # bumped by declare(): loads of an older plan are dropped
        self._pos: dict[K, int] = {}  # plan position of every held or in-flight key
        self._behind: list[tuple[int, int, K]] = []  # heap of (position, tie, key) of held values
        self._tie = 0
        self._held: OrderedDict[K, bytes] = OrderedDict()
        self._held_bytes = 0
        self._inflight: dict[K, trio.Event] = {}
        self._active = 0  # batches being loaded
        self._avg = 64 << 10  # running mean value size, to keep loads within the budget
        self._pushed: set[K] = set()
        self._wake = trio.Event()
        self._running = False
        self.counters = {"hits": 0, "late": 0, "misses": 0, "skipped": 0, "loaded": 0, "loaded_bytes": 0,
                         "pushed": 0, "failed": 0, "plans": 0, "page_cache": 0, "elsewhere": 0}

    # ----- the source says what comes next --------------------------------------------

    def declare(self, keys: Sequence[K]) -> None:
        """A new plan (a new epoch): what was held for the old one is dropped."""
        self._gen += 1
        self._drop_all()
        self._plan = keys
        self._next = 0
        self._base = 0
        self.counters["plans"] += 1
        self._kick()

    def extend(self, keys: Iterable[K]) -> None:
        """Append to the plan (pre-sampled batches arrive one at a time)."""
        if not isinstance(self._plan, list):
            self._plan = list(self._plan[self._next:])
            self._base += self._next
            self._next = 0
        elif self._next > 4096:  # keep the consumed head from growing without bound
            del self._plan[:self._next]
            self._base += self._next
            self._next = 0
        self._plan.extend(keys)
        self._kick()

    def forget(self, key: K) -> None:
        """`key` no longer has this value (rewritten, removed): drop what is held for it."""
        value = self._held.pop(key, None)
        if value is not None:
            self._release(key, value)

    # ----- the reader -----------------------------------------------------------------

    def take_nowait(self, key: K) -> tuple[bytes | None, bool]:
        """(the held value of `key` or None, whether this counted as a hit); never waits.
        A value pushed into the kernel page cache is a hit with no value here: the reads
        of it will not reach us."""
        value = self._held.pop(key, None)
        if value is None:
            if key in self._pushed:
                self._pushed.discard(key)
                self.counters["hits"] += 1
                return None, True
            return None, False
        self.counters["hits"] += 1
        self._consumed(key, value)
        return value, True

    async def take(self, key: K) -> bytes | None:
        """The value of `key` if it was prefetched (waiting for a load in flight), else None
        (also when it was pushed into the page cache: counted as the hit it is, once)."""
        value, hit = self.take_nowait(key)
        if hit:
            return value
        event = self._inflight.get(key)
        if event is not None:
            await event.wait()
            value = self._held.pop(key, None)
            if value is not None:
                self.counters["late"] += 1
                self._consumed(key, value)
                return value
        self.counters["misses"] += 1
        return None

    def served_by_page_cache(self) -> None:
        """An open of a planned key read nothing from us: the kernel page cache had it."""
        self.counters["page_cache"] += 1

    def push_held(self, key: K) -> bool:
        """Push `key`'s held value now, if the push hook takes it (it refused at the load:
        the kernel did not hold the key's inode yet). Its read is then a hit with no value
        here, as for a value pushed at its load."""
        value = self._held.get(key)
        if value is None or self.push is None or not self.push(key, value):
            return False
        del self._held[key]
        self._release(key, value)
        self._pushed.add(key)
        self.counters["pushed"] += 1
        return True

    def _consumed(self, key: K, value: bytes) -> None:
        position = self._release(key, value)
        # Values the reader went past (it skipped them, or read them elsewhere) leave too.
        # Loads finish out of order, so the held values are kept in a heap by position.
        while self._behind and self._behind[0][0] < position - self.lag:
            pos, _, first = heapq.heappop(self._behind)
            if first in self._held and self._pos.get(first) == pos:
                self._release(first, self._held.pop(first))
                self.counters["skipped"] += 1

    def _release(self, key: K, value: bytes) -> int:
        self._held_bytes -= len(value)
        self.budget.used -= len(value)
        self._kick()
        return self._pos.pop(key, 0)

    def _drop_all(self) -> None:
        for key, value in self._held.items():
            self._held_bytes -= len(value)
            self.budget.used -= len(value)
        self._held.clear()
        self._behind.clear()
        # Loads in flight for the old plan finish by themselves (their values are dropped);
        # the new plan loads its keys anew, whatever is in flight.
        self._pos = {}
        self._pushed.clear()

    # ----- loading --------------------------------------------------------------------

    def _kick(self) -> None:
        if not self._running:
            self._running = True
            self.spawn(self._run)
        self._wake.set()

    def _room(self) -> bool:
        if not self._inflight and not self._held:
            return True  # always one batch, however small the budget
        ahead = self.budget.used + (len(self._inflight) + self.batch_items) * self._avg
        return ahead <= self.budget.capacity

    async def _run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    while self._next < len(self._plan) and self._active < self.workers and self._room():
                        keys: list[tuple[K, trio.Event]] = []
                        while self._next < len(self._plan) and len(keys) < self.batch_items:
                            key = self._plan[self._next]
                            if not isinstance(key, tuple):
                                key = key.item() if hasattr(key, "item") else key  # numpy scalars
                            if self.elsewhere is not None and self.elsewhere():
                                self.counters["elsewhere"] += 1
                            elif key not in self._pos:
                                self._pos[key] = self._base + self._next
                                event = self._inflight[key] = trio.Event()
                                keys.append((key, event))
                            self._next += 1
                        if keys:
                            self._active += 1
                            nursery.start_soon(self._load, self._gen, keys)
        finally:
            self._running = False

    async def _load(self, gen: int, keys: list[tuple[K, trio.Event]]) -> None:
        try:
            try:
                results = await trio.to_thread.run_sync(self._load_blocking, [k for k, _ in keys])
            except Exception:
                log.exception("prefetch load failed")
                results = [(None, False)] * len(keys)
            for (key, event), (value, pushed) in zip(keys, results):
                if self._inflight.get(key) is event:
                    del self._inflight[key]
                if gen != self._gen:
                    pass  # the plan changed while it loaded: the new one loads it again if it needs it
                elif value is None:
                    self.counters["failed"] += 1
                    self._pos.pop(key, None)
                else:
                    self.counters["loaded"] += 1
                    self.counters["loaded_bytes"] += len(value)
                    self._avg = max(1, self.counters["loaded_bytes"] // self.counters["loaded"])
                    if pushed:
                        self.counters["pushed"] += 1
                        self._pushed.add(key)
                        self._pos.pop(key, None)
                    else:
                        self._held[key] = value
                        self._tie += 1
                        heapq.heappush(self._behind, (self._pos[key], self._tie, key))
                        self._held_bytes += len(value)
                        self.budget.used += len(value)
                event.set()
        finally:
            self._active -= 1
            self._wake.set()

    def _load_blocking(self, keys: list[K]) -> list[tuple[bytes | None, bool]]:
        values = self.fetch(keys)
        out = []
        for key, value in zip(keys, values):
            pushed = False
            if value is not None and self.push is not None:
                try:
                    pushed = self.push(key, value)
                except Exception:
                    log.debug("push of %r failed", key, exc_info=True)
            out.append((value, pushed))
        return out

    # ----- reporting ------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.counters
        return {**c, "hit_rate": hit_rate(c),
                "planned": len(self._plan), "position": self._next, "held": len(self._held),
                "bytes_ahead": self._held_bytes, "in_flight": len(self._inflight)}


class PrefetchStreams(Generic[K]):
    """Several plans read ahead at once, one per stream: the ranks of a DDP job each declare
    their own part of an epoch, and a declaration replaces only its own stream's plan. A
    read takes its value from whichever plan holds it. The streams share one budget; past
    MAX_STREAMS the stream declared longest ago is dropped."""

    MAX_STREAMS = 64

    def __init__(self, budget: PrefetchBudget, fetch: Callable[[list[K]], list[bytes | None]], *,
                 spawn: Callable, elsewhere: Callable[[Hashable], bool] | None = None, **options) -> None:
        """`elsewhere(stream)`: the stream's keys are read without us (see Prefetcher)."""
        self._elsewhere = elsewhere
        self._budget = budget
        self._fetch = fetch
        self._spawn = spawn
        self._options = options
        self._push: Callable[[K, bytes], bool] | None = None
        self.streams: OrderedDict[Hashable, Prefetcher[K]] = OrderedDict()
        self._own = {"misses": 0, "page_cache": 0}

    @property
    def push(self) -> Callable[[K, bytes], bool] | None:
        return self._push

    @push.setter
    def push(self, hook: Callable[[K, bytes], bool] | None) -> None:
        self._push = hook
        for p in self.streams.values():
            p.push = hook

    def declare(self, keys: Sequence[K], stream: Hashable = None) -> None:
        """`stream`'s new plan (its next epoch); the other streams' plans stay."""
        p = self.streams.pop(stream, None)
        if p is None:
            test = self._elsewhere
            p = Prefetcher(self._budget, self._fetch, spawn=self._spawn, push=self._push,
                           elsewhere=(lambda: test(stream)) if test is not None else None, **self._options)
        self.streams[stream] = p
        p.declare(keys)
        while len(self.streams) > self.MAX_STREAMS:
            self.streams.popitem(last=False)[1].declare([])

    def release_held(self, streams: Iterable[Hashable]) -> None:
        """What the plans of `streams` hold goes (their readers read elsewhere now); the plans stay."""
        for stream in streams:
            p = self.streams.get(stream)
            for key in list(p._held) if p is not None else ():
                assert p is not None  # (no keys without a plan)
                p.forget(key)

    def drop(self, stream: Hashable) -> None:
        """Forget `stream`'s plan (its process is gone): what it held is released."""
        p = self.streams.pop(stream, None)
        if p is not None:
            p.declare([])

    def take_nowait(self, key: K) -> tuple[bytes | None, bool]:
        for p in self.streams.values():
            value, hit = p.take_nowait(key)
            if hit:
                return value, True
        return None, False

    async def take(self, key: K) -> bytes | None:
        value, hit = self.take_nowait(key)
        if hit:  # (None: pushed into the page cache, counted there)
            return value
        for p in self.streams.values():
            if key in p._inflight:
                return await p.take(key)
        self._own["misses"] += 1
        return None

    def served_by_page_cache(self) -> None:
        self._own["page_cache"] += 1

    def push_held(self, key: K) -> bool:
        return any(p.push_held(key) for p in self.streams.values())

    @property
    def counters(self) -> dict:
        out = {k: sum(p.counters[k] for p in self.streams.values()) for k in _COUNTER_NAMES}
        for k, v in self._own.items():
            out[k] += v
        return out

    def stats(self) -> dict:
        parts = [p.stats() for p in self.streams.values()]
        c = self.counters
        return {**c, "hit_rate": hit_rate(c), "streams": len(parts),
                **{k: sum(s[k] for s in parts) for k in ("planned", "position", "held", "bytes_ahead", "in_flight")}}


_COUNTER_NAMES = ("hits", "late", "misses", "skipped", "loaded", "loaded_bytes", "pushed", "failed", "plans",
                  "page_cache", "elsewhere")

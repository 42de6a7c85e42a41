"""Removers: which entries leave a ring that is over its `capacity` or `max_bytes`.

A ring's `evict` setting names one (Reverb's removers; TorchRL's writers): `fifo` (the
oldest first, the default), `lifo` (the newest first: a stack), `uniform` (any entry,
at random) and, for replay buffers, `lowest_priority` (the smallest priority first; the
oldest first among equal priorities, so a buffer whose priorities were never set evicts
as `fifo`). A remover only orders candidates: the ring skips those already leaving in
the same commit group and the entry being written, and stops once it fits its bounds.

Eviction is decided when an insert is planned, among the entries committed before it:
two inserts committed in one group never evict each other (with `lifo`, concurrent
writers each push out an older entry rather than each other's). `max_times_sampled`
is a separate limit, and a full disk still frees the oldest entries (distorefs/room.py:
that is about the space of segments, not the policy of the buffer).
"""

from __future__ import annotations

import heapq
import random
from typing import TYPE_CHECKING, Iterator, Protocol

import numpy as np

from .config import RingConfig

if TYPE_CHECKING:
    from sortedcontainers import SortedDict

    from .catalog import EntryMeta
    from .sampler import Sampler


class Ring(Protocol):
    """What a remover reads of the ring it serves (distorefs/ring.py)."""

    by_seq: "SortedDict"  # seq -> EntryMeta, oldest first
    slot_seq: np.ndarray  # seq of each slot's entry, -1 when free
    slot_meta: list["EntryMeta | None"]


class Remover(Protocol):
    name: str

    def candidates(self, ring: Ring) -> Iterator["EntryMeta"]:
        """The ring's entries in the order they should leave (each at most once)."""
        ...


class Fifo:
    name = "fifo"

    def candidates(self, ring: Ring) -> Iterator["EntryMeta"]:
        return iter(ring.by_seq.values())


class Lifo:
    name = "lifo"

    def candidates(self, ring: Ring) -> Iterator["EntryMeta"]:
        return reversed(ring.by_seq.values())


class Uniform:
    name = "uniform"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed or None)

    def candidates(self, ring: Ring) -> Iterator["EntryMeta"]:
        # Random positions of the sorted index (O(log n) each); an eviction needs one or
        # a few, so no permutation of the whole ring is drawn. Repeats are skipped; after
        # many, the rest in order (the ring is then nearly all leaving anyway).
        entries = ring.by_seq
        n = len(entries)
        if not n:
            return
        seen: set[int] = set()
        for _ in range(4 * n):
            meta = entries.peekitem(self.rng.randrange(n))[1]
            if meta.seq not in seen:
                seen.add(meta.seq)
                yield meta
            if len(seen) == n:
                return
        yield from (m for m in entries.values() if m.seq not in seen)


class LowestPriority:
    """Entries by (priority, seq), from a heap fed by the buffer as priorities change.

    The heap is lazy: an entry removed or given a new priority leaves its old tuple behind,
    recognised when it comes to the top (its slot holds another seq, or its priority
    differs) and dropped. When stale tuples outnumber the live entries the heap is
    rebuilt from the sampler's arrays (one numpy sort). It is built on first use, so
    loading a store pushes nothing.
    """

    name = "lowest_priority"

    def __init__(self, sampler: "Sampler") -> None:
        # The buffer's sampler holds each slot's priority and liveness (arrays it replaces
        # when slots grow, so they are looked up on it each time).
        self.sampler = sampler
        self._heap: list[tuple[float, int, int]] | None = None
        self._limit = 0  # past this many tuples the heap is rebuilt (twice the live entries at build)

    def _stale(self) -> bool:
        return len(self._heap or ()) > self._limit

    def changed(self, slot: int, seq: int, priority: float) -> None:
        """An entry was added or its priority set."""
        heap = self._heap
        if heap is None:
            return
        heapq.heappush(heap, (priority, seq, slot))
        if self._stale():
            self._heap = None  # mostly stale: rebuilt at the next eviction

    def changed_many(self, slots: np.ndarray, seqs: np.ndarray, priorities: np.ndarray) -> None:
        if self._heap is None:
            return
        for item in zip(priorities.tolist(), seqs.tolist(), slots.tolist()):
            heapq.heappush(self._heap, item)
        if self._stale():
            self._heap = None

    def _build(self, ring: Ring) -> list[tuple[float, int, int]]:
        slots = np.flatnonzero(self.sampler.live[:len(ring.slot_seq)])
        seqs = ring.slot_seq[slots]
        prios = self.sampler.priority[slots]
        order = np.lexsort((seqs, prios))  # a sorted list is already a heap
        return list(zip(prios[order].tolist(), seqs[order].tolist(), slots[order].tolist()))

    def candidates(self, ring: Ring) -> Iterator["EntryMeta"]:
        if self._heap is None:
            self._heap = self._build(ring)
            self._limit = 2 * len(self._heap) + 4096
        heap = self._heap
        live, priority = self.sampler.live, self.sampler.priority
        taken: list[tuple[float, int, int]] = []
        try:
            while heap:
                item = heapq.heappop(heap)
                prio, seq, slot = item
                if (slot >= len(ring.slot_seq) or ring.slot_seq[slot] != seq or not live[slot]
                        or priority[slot] != prio):
                    continue  # stale: removed, or given another priority since
                taken.append(item)
                meta = ring.slot_meta[slot]
                if meta is not None:
                    yield meta
        finally:
            # The plan may still fail, and evicted entries become stale on their own:
            # everything looked at goes back.
            for item in taken:
                heapq.heappush(heap, item)


class Candidates:
    """A remover's candidates as one commit group's plans take them: each plan continues
    where the previous one stopped, skipping entries already leaving; an entry passed over
    because a plan protects it (the entry that plan rewrites) is offered again first."""

    def __init__(self, entries: Iterator["EntryMeta"]) -> None:
        self._entries = entries
        self._held: list["EntryMeta"] = []

    def next(self, removed: set[int], protect: int) -> "EntryMeta | None":
        for i, meta in enumerate(self._held):
            if meta.seq in removed:
                continue
            if meta.seq != protect:
                del self._held[i]
                return meta
        for meta in self._entries:
            if meta.seq in removed:
                continue
            if meta.seq == protect:
                self._held.append(meta)
                continue
            return meta
        return None

    def close(self) -> None:
        close = getattr(self._entries, "close", None)
        if close is not None:
            close()  # a lazy remover puts back what it looked at


def ring_remover(config: RingConfig) -> Remover:
    """The remover a ring's config names (`lowest_priority` needs priorities: buffers build it)."""
    if config.evict == "lifo":
        return Lifo()
    if config.evict == "uniform":
        return Uniform(getattr(config, "seed", 0))
    if config.evict == "fifo":
        return Fifo()
    raise ValueError(f"evict {config.evict!r} needs priorities: only replay buffers have them")


__all__ = ["Remover", "Fifo", "Lifo", "Uniform", "LowestPriority", "Candidates", "ring_remover"]

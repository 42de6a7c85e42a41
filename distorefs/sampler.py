"""Sampling state of one replay buffer, indexed by ring slot.

Holds each entry's raw priority and times sampled, and two trees over the slots: one
with 1 per drawable entry (uniform draws and counts) and one with priority**alpha
(proportional prioritized draws). An entry stops being drawable when it has been
sampled `max_times_sampled` times; the buffer removes it once the batch holding it is
released. Probabilities and importance weights follow the PER paper:
P(i) = p_i^a / sum_k p_k^a, w_i = (N P(i))^-b / max_j w_j, with the max taken over the
whole buffer (the entry with the smallest probability).
"""

from __future__ import annotations

import numpy as np

from .config import BufferConfig
from .sumtree import SumTree


QUEUED_MAX = 4096  # slots waiting for the trees' update, at most


class Sampler:
    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self.priority = np.zeros(0, dtype=np.float64)
        self.times = np.zeros(0, dtype=np.int64)
        self.live = np.zeros(0, dtype=bool)
        self.exhausted = np.zeros(0, dtype=bool)
        self.uniform = SumTree(1)
        self.weighted = SumTree(1)
        self.max_priority = 1.0
        self.rng = np.random.default_rng(config.seed or None)
        self._queued: list[int] = []

    # ----- membership -----------------------------------------------------------------

    def grow(self, capacity: int) -> None:
        self._flush()
        old = len(self.priority)
        if capacity <= old:
            return
        pad = capacity - old
        self.priority = np.concatenate([self.priority, np.zeros(pad)])
        self.times = np.concatenate([self.times, np.zeros(pad, dtype=np.int64)])
        self.live = np.concatenate([self.live, np.zeros(pad, dtype=bool)])
        self.exhausted = np.concatenate([self.exhausted, np.zeros(pad, dtype=bool)])
        self.uniform.grow(capacity)
        self.weighted.grow(capacity)

    def add(self, slot: int, priority: float, times: int = 0) -> None:
        """Queue a new entry; queued entries reach the trees in one vectorised update
        before the next read of the sampler (one numpy call per insert is the cost)."""
        self.priority[slot] = priority
        self.times[slot] = times
        self.live[slot] = True
        limit = self.config.max_times_sampled
        self.exhausted[slot] = bool(limit and times >= limit)
        self.max_priority = max(self.max_priority, priority)
        self._queue(slot)

    def _queue(self, slot: int) -> None:
        self._queued.append(slot)
        if len(self._queued) >= QUEUED_MAX:  # inserts with no read between them: bounded all the same
            self._flush()

    def _flush(self) -> None:
        if self._queued:
            slots = np.array(self._queued, dtype=np.int64)
            self._queued.clear()
            self._refresh(slots)

    def remove(self, slot: int) -> None:
        """Queue a removal, as `add` queues a new entry: a buffer at capacity evicts one
        entry per insert, and a tree update of its own each cost the daemon more than the
        rest of the insert (two trees, some twenty numpy calls; 37 % of its time when 113 KB
        inserts evicted). The trees read the slot's state when they are brought up to date."""
        self.live[slot] = False
        self.exhausted[slot] = False
        self.priority[slot] = 0.0
        self.times[slot] = 0
        self._queue(slot)

    def set_priorities(self, slots: np.ndarray, values: np.ndarray) -> None:
        self._flush()
        self.priority[slots] = values
        if len(values):
            self.max_priority = max(self.max_priority, float(values.max()))
        self._refresh(slots, drawable_changed=False)

    def set_times(self, slots: np.ndarray, times: np.ndarray) -> None:
        """Set entries' times-sampled counts (a restore: `distorefs import`; the global
        counts of a shared buffer); an entry at `max_times_sampled` is no longer drawable."""
        self._flush()
        self.times[slots] = times
        limit = self.config.max_times_sampled
        exhausted = times >= limit if limit else np.zeros(len(slots), dtype=bool)
        changed = exhausted != self.exhausted[slots]
        if changed.any():
            self.exhausted[slots] = exhausted
            self._refresh(slots[changed])

    def reconfigure(self, config: BufferConfig) -> None:
        self._flush()
        old = self.config
        self.config = config
        if config.seed != old.seed:
            self.rng = np.random.default_rng(config.seed or None)
        if config.alpha != old.alpha or config.max_times_sampled != old.max_times_sampled:
            limit = config.max_times_sampled
            self.exhausted = self.live & (self.times >= limit) if limit else np.zeros_like(self.live)
            self._refresh(np.flatnonzero(self.live))  # removed slots are already 0 in both trees

    def _refresh(self, slots: np.ndarray, drawable_changed: bool = True) -> None:
        """Bring both trees up to date for `slots`; `drawable_changed` False (a priority
        update): which slots may be drawn is unchanged, so the uniform tree is too."""
        drawable = self.live[slots] & ~self.exhausted[slots]
        if drawable_changed:
            self.uniform.update(slots, drawable.astype(np.float64))
        self.weighted.update(slots, np.where(drawable, self.priority[slots] ** self.config.alpha, 0.0))

    # ----- drawing --------------------------------------------------------------------

    def weighted_total(self) -> float:
        """Sum of priority**alpha over drawable entries."""
        self._flush()
        return self.weighted.total()

    def drawable_count(self) -> int:
        self._flush()
        return int(round(self.uniform.total()))

    def draw(self, n: int, order) -> np.ndarray:
        """Draw n slots without counting them (pre-sampling and `select` use this).

        `order` yields the ring's entries oldest or newest first for fifo/lifo.
        """
        self._flush()
        kind = self.config.sampler
        if kind in ("fifo", "lifo"):
            out = []
            for meta in order(kind):
                if not self.exhausted[meta.slot]:
                    out.append(meta.slot)
                    if len(out) == n:
                        break
            return np.array(out, dtype=np.int64)
        if self.drawable_count() == 0:
            return np.zeros(0, dtype=np.int64)
        if kind == "prioritized" and self.weighted.total() > 0:
            return self.weighted.sample(n, self.rng)
        return self.uniform.sample(n, self.rng)

    def draw_weighted(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """`draw` of a prioritized buffer with what `probabilities` gives for the slots drawn
        (no spent ones), in one call: (slots, probabilities, weights); None where the buffer
        draws otherwise (then `draw` and `probabilities`)."""
        if self.config.sampler != "prioritized":
            return None
        self._flush()
        # (None from an empty tree: nothing drawable, or every priority 0, as `draw` reads it)
        drawn = self.weighted.sample_weighted(n, self.rng, self.config.beta)
        if drawn is None:
            return None
        slots, pw = drawn
        return slots, pw[0], pw[1]

    def select(self, n: int, order, hint=None, valid=None) -> tuple[np.ndarray, np.ndarray]:
        """Draw a batch of n, count the draws, and return (slots, slots now exhausted).

        `hint` is a pre-drawn (slots, seqs) pair; `valid(slots, seqs)` tells (a bool array)
        whether each hinted slot still holds the entry it held when drawn. An entry is never
        handed out more than `max_times_sampled` times: once spent it leaves the trees and
        is redrawn.
        """
        self._flush()
        limit = self.config.max_times_sampled
        if hint is not None:
            hslots, hseqs = hint
            keep = valid(hslots, hseqs) & ~self.exhausted[hslots]
            hint = (hslots[keep], hseqs[keep])
        if not limit and self.config.sampler not in ("fifo", "lifo"):
            # Nothing to count against a limit: the whole batch in a few numpy calls.
            parts = [hint[0][:n]] if hint is not None else []
            have = len(parts[0]) if parts else 0
            if have < n:
                parts.append(self.draw(n - have, order))
            slots = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
            self.count_draws(slots)
            return slots, np.zeros(0, dtype=np.int64)
        out: list[int] = []
        budget: dict[int, int] = {}

        def accept(slot: int) -> None:
            if limit:
                left = budget.get(slot, limit - int(self.times[slot]))
                if left <= 0:
                    return
                budget[slot] = left - 1
                if left == 1:  # spent by this batch: nobody may draw it again
                    self.exhausted[slot] = True
                    self._refresh(np.array([slot]))
            out.append(slot)

        if hint is not None:
            for slot in hint[0].tolist():
                if len(out) < n and not self.exhausted[slot]:
                    accept(slot)
        deterministic = self.config.sampler in ("fifo", "lifo")
        while len(out) < n and self.drawable_count() > 0:
            before = len(out)
            for slot in self.draw(n - len(out), order):
                if deterministic and slot in budget:
                    continue
                accept(int(slot))
            if deterministic or len(out) == before and not limit:
                break
        slots = np.array(out, dtype=np.int64)
        if len(slots):
            np.add.at(self.times, slots, 1)
        spent = np.array(sorted(s for s, left in budget.items() if left == 0), dtype=np.int64)
        return slots, spent

    def count_draws(self, slots: np.ndarray) -> None:
        """Count the draws of `slots` handed out (no max_times_sampled: nothing to check)."""
        if len(slots):
            np.add.at(self.times, slots, 1)

    def probabilities(self, slots: np.ndarray, spent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sampling probability and normalised importance weight of each drawn slot.

        `spent` are the slots this batch exhausted: they already left the trees, so their
        mass is added back to give the distribution the batch was drawn from.
        """
        self._flush()
        n = len(slots)
        kind = self.config.sampler
        if n == 0:
            return np.zeros(0), np.zeros(0)
        if kind in ("fifo", "lifo"):
            return np.ones(n), np.ones(n)
        alpha = self.config.alpha
        spent_p = self.priority[spent] ** alpha if len(spent) else None  # (most batches spend none)
        total = self.weighted.total() + (float(spent_p.sum()) if spent_p is not None else 0.0)
        if kind == "prioritized" and total > 0:
            p = self.priority[slots] ** alpha
            probs = p / total
            smallest = self.weighted.min_positive()
            if spent_p is not None and (spent_p > 0).any():
                smallest = min(smallest, float(spent_p[spent_p > 0].min()))
            # 0 where a drawn entry's priority is 0 now (drawn ahead): no 0 ** -beta computed
            ratio = p / smallest
            weights = np.zeros(n)
            np.power(ratio, -self.config.beta, out=weights, where=ratio > 0)
            return probs, weights
        count = max(self.drawable_count() + len(spent), 1)
        return np.full(n, 1.0 / count), np.ones(n)

"""Sequence sampling of one replay buffer: entries grouped into episodes, drawn as runs of
consecutive steps (R2D2's sequences, TorchRL's slices).

This module owns the episode index of a buffer whose `sequence_length` L is set: which
episode and step each entry is (from its key, `split_key`), each episode's steps by step
number, which steps may start a sequence (a present step whose number is a multiple of
`sequence_stride`), and two sum trees over the ring's slots holding, at each start, 1
(uniform draws) and the sequence's priority ** alpha (prioritized draws), where a
sequence's priority is the max or the mean (`sequence_priority`) of its real steps'
priorities. It reads the step priorities and the random generator of the buffer's
`Sampler` and adds each drawn step to its times-sampled counts; it knows nothing of the
ring's storage, the batch file or FUSE.

A sequence is the steps s, s+1, ..., s+L-1 of its start's episode, up to the first step
that is absent (past the episode's end, evicted, deleted, not written yet): those and all
after them are padding (`mask` False). So a sequence never mixes episodes and its real
steps are always consecutive.

Cost: the index is kept up to date lazily. An insert, a removal or a priority change of
step k marks the starts k-L+1..k of its episode dirty (their windows hold k); before the
next draw the dirty starts are recomputed all at once with numpy (one gather of their
(S, L) windows, whatever the number of episodes), never with a Python loop per step.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from .catalog import EntryMeta
from .config import BufferConfig
from .errors import InvalidArgument
from .sampler import Sampler
from .sumtree import SumTree

MAX_SPAN = 1 << 20  # step numbers one episode's present steps may span (its index is one int64 per step)
MAX_STEP_DIGITS = 18  # a step number fits an int64
_CHUNK = 1 << 16  # starts recomputed per numpy pass (bounds the (S, L) windows held at once)
_PENDING = 1 << 16  # changes held before they are applied without waiting for a draw (bounds memory)


def split_key(key: bytes, separator: bytes) -> tuple[bytes, int] | None:
    """(episode, step) of an entry key `EPISODE<separator>STEP`, optionally followed by an
    extension `.EXT` (a letter, then letters and digits: `ep7.000012.npy`); None if the key
    is not of that form. The step is decimal digits; the episode is any non-empty text."""
    found = _split(key, separator)
    if found is None:
        dot = key.rfind(b".")
        ext = key[dot + 1:]
        if dot > 0 and 0 < len(ext) <= 16 and ext[:1].isalpha() and ext.isalnum():
            found = _split(key[:dot], separator)
    return found


def _split(stem: bytes, separator: bytes) -> tuple[bytes, int] | None:
    at = stem.rfind(separator)
    if at <= 0:
        return None
    digits = stem[at + len(separator):]
    if not digits.isdigit() or len(digits) > MAX_STEP_DIGITS:  # isdigit on bytes: ASCII digits only
        return None
    return stem[:at], int(digits)


class _Episode:
    """The steps of one episode: `slots[i]` is the ring slot of step `base + i`, -1 where
    absent; `first`..`last` are the offsets of its lowest and highest present step."""

    __slots__ = ("id", "name", "base", "slots", "first", "last", "count")

    def __init__(self, eid: int, name: bytes, step: int) -> None:
        self.id = eid
        self.name = name
        self.base = step
        self.slots = np.full(16, -1, dtype=np.int64)
        self.first = self.last = 0
        self.count = 0

    def span_with(self, step: int) -> int:
        """Step numbers the present steps would span with `step` added."""
        if not self.count:
            return 1
        lo, hi = self.base + self.first, self.base + self.last
        return max(hi, step) - min(lo, step) + 1

    def make_room(self, step: int) -> int:
        """The offset of `step`, the array grown (or moved) so that it is inside."""
        off = step - self.base
        size = len(self.slots)
        if off < 0:  # a step before the first one seen: room in front, doubling
            grow = max(-off, size)
            self.slots = np.concatenate([np.full(grow, -1, dtype=np.int64), self.slots])
            self.base -= grow
            self.first += grow
            self.last += grow
            off += grow
        elif off >= size:
            if self.count and self.first >= size // 2:  # the front is dead (evicted): slide instead of growing
                live = self.slots[self.first:self.last + 1].copy()
                self.slots[:] = -1
                self.slots[:len(live)] = live
                self.base += self.first
                off -= self.first
                self.last -= self.first
                self.first = 0
            if off >= len(self.slots):
                new = max(off + 1, 2 * len(self.slots))
                self.slots = np.concatenate([self.slots, np.full(new - len(self.slots), -1, dtype=np.int64)])
        return off


class SequenceIndex:
    """The episodes of one buffer and its sequence starts (see the module docstring)."""

    def __init__(self, config: BufferConfig, sampler: Sampler) -> None:
        self.sampler = sampler
        self.capacity = 0
        self.episode_of = np.zeros(0, dtype=np.int64)  # episode id of each slot, -1: not a step
        self.step_of = np.zeros(0, dtype=np.int64)
        self._set(config)
        self._reset()

    def _set(self, config: BufferConfig) -> None:
        self.config = config
        self.length = config.sequence_length
        self.stride = config.sequence_stride
        self.separator = config.sequence_separator.encode()

    def _reset(self) -> None:
        self.episodes: dict[int, _Episode] = {}
        self.by_name: dict[bytes, _Episode] = {}
        self._next_id = 0
        self.episode_of[:] = -1
        self.unkeyed: set[int] = set()  # slots of entries whose key names no episode step
        self._dirty: list[tuple[int, int]] = []  # (episode id, step) whose windows changed
        self._dirty_slots: list[np.ndarray] = []  # slots whose priority changed
        self._zero: list[int] = []  # slots no longer steps: cleared from the trees
        size = max(self.capacity, 1) if self.on else 1  # nothing held while off
        self.uniform = SumTree(size)
        self.weighted = SumTree(size)

    @property
    def on(self) -> bool:
        return self.length > 0

    # ----- membership (the buffer's ring observer calls these) ------------------------------

    def grow(self, capacity: int) -> None:
        pad = capacity - self.capacity
        if pad <= 0:
            return
        self._flush()
        self.episode_of = np.concatenate([self.episode_of, np.full(pad, -1, dtype=np.int64)])
        self.step_of = np.concatenate([self.step_of, np.zeros(pad, dtype=np.int64)])
        self.capacity = capacity
        if self.on:
            self.uniform.grow(capacity)
            self.weighted.grow(capacity)

    def check(self, key: bytes, slot: int = -1) -> None:
        """InvalidArgument unless an entry `key` (now at `slot`, -1 if new) can be a step:
        its key names an episode and a step that no other entry holds, near enough its
        episode's other steps."""
        if not self.on:
            return
        parsed = split_key(key, self.separator)
        if parsed is None:
            raise InvalidArgument(f"key {key!r} does not name an episode step: sequence_length is set, so keys are "
                                  f"EPISODE{self.config.sequence_separator}STEP (STEP decimal digits, then "
                                  f"optionally .EXT)")
        name, step = parsed
        ep = self.by_name.get(name)
        if ep is None:
            return
        off = step - ep.base
        holder = int(ep.slots[off]) if 0 <= off < len(ep.slots) else -1
        if holder >= 0 and holder != slot:
            raise InvalidArgument(f"key {key!r}: step {step} of episode {name!r} is another entry already")
        if ep.span_with(step) > MAX_SPAN:
            raise InvalidArgument(f"key {key!r}: episode {name!r} would span more than {MAX_SPAN} step numbers")

    def add(self, slot: int, key: bytes) -> None:
        """A new entry at `slot`."""
        if not self.on:
            return
        parsed = split_key(key, self.separator)
        if parsed is None:
            self.unkeyed.add(slot)
            return
        name, step = parsed
        ep = self.by_name.get(name)
        if ep is None:
            ep = self.by_name[name] = self.episodes[self._next_id] = _Episode(self._next_id, name, step)
            self._next_id += 1
        elif ep.span_with(step) > MAX_SPAN:
            self.unkeyed.add(slot)  # refused at insert (check); here only through a rename or a config change
            return
        off = ep.make_room(step)
        if ep.slots[off] >= 0:  # two keys of one step ('ep.5', 'ep.05'): the first keeps it
            self.unkeyed.add(slot)
            return
        ep.slots[off] = slot
        if ep.count:
            ep.first, ep.last = min(ep.first, off), max(ep.last, off)
        else:
            ep.first = ep.last = off
        ep.count += 1
        self.episode_of[slot] = ep.id
        self.step_of[slot] = step
        self._changed(ep.id, step)

    def remove(self, slot: int) -> None:
        """The entry at `slot` is gone (evicted, deleted, spent)."""
        if not self.on:
            return
        if len(self._zero) >= _PENDING:  # a long run of evictions without draws: apply as it goes
            self._flush()
        if slot in self.unkeyed:
            self.unkeyed.discard(slot)
            return
        eid = int(self.episode_of[slot])
        if eid < 0:
            return
        ep = self.episodes[eid]
        step = int(self.step_of[slot])
        off = step - ep.base
        ep.slots[off] = -1
        ep.count -= 1
        self.episode_of[slot] = -1
        self._zero.append(slot)
        if not ep.count:
            del self.episodes[eid]
            del self.by_name[ep.name]
            return
        if off == ep.first:  # eviction takes an episode's steps from the front: find the next one
            ep.first += int(np.argmax(ep.slots[off:ep.last + 1] >= 0))
        elif off == ep.last:
            ep.last = ep.first + int(np.flatnonzero(ep.slots[ep.first:off] >= 0)[-1])
        self._changed(eid, step)

    def _changed(self, eid: int, step: int) -> None:
        self._dirty.append((eid, step))
        if len(self._dirty) >= _PENDING:  # a long fill without draws: apply as it goes
            self._flush()

    def rename(self, slot: int, key: bytes) -> None:
        """The entry at `slot` has a new key (so maybe another episode and step)."""
        self.remove(slot)
        self.add(slot, key)

    def priorities_changed(self, slots: np.ndarray) -> None:
        """Step priorities were set: the sequences through those steps are recomputed."""
        if self.on and len(slots):
            self._dirty_slots.append(np.asarray(slots, dtype=np.int64))
            if len(self._dirty_slots) >= 1024:
                self._flush()

    def reconfigure(self, config: BufferConfig, entries: Callable[[], Iterable[EntryMeta]]) -> None:
        """A new configuration; if it changes how entries group or sequences weigh, the index
        is rebuilt from `entries()` (every entry of the buffer)."""
        old = self.config
        settings = ("sequence_length", "sequence_stride", "sequence_priority", "sequence_separator", "alpha")
        if all(getattr(old, s) == getattr(config, s) for s in settings):
            self.config = config
            return
        self._set(config)
        self._reset()
        if self.on:
            for meta in entries():
                self.add(meta.slot, meta.key)
            self._flush()

    # ----- the starts and their weights -----------------------------------------------------

    def _flush(self) -> None:
        """Bring both trees up to date: clear slots that left, recompute dirty starts."""
        if self._zero:
            gone = np.unique(np.array(self._zero, dtype=np.int64))
            self._zero.clear()
            self.uniform.update(gone, 0.0)
            self.weighted.update(gone, 0.0)
        eids: list[np.ndarray] = []
        steps: list[np.ndarray] = []
        if self._dirty:
            pairs = np.array(self._dirty, dtype=np.int64).reshape(-1, 2)
            self._dirty.clear()
            eids.append(pairs[:, 0])
            steps.append(pairs[:, 1])
        if self._dirty_slots:
            slots = np.concatenate(self._dirty_slots)
            self._dirty_slots.clear()
            slots = slots[self.episode_of[slots] >= 0]
            eids.append(self.episode_of[slots])
            steps.append(self.step_of[slots])
        if eids and sum(len(e) for e in eids):
            self._recompute(*_intervals(np.concatenate(eids), np.concatenate(steps), self.length))

    def _recompute(self, eids: np.ndarray, lows: np.ndarray, highs: np.ndarray) -> None:
        """Recompute the starts of steps lows[i]..highs[i] of episode eids[i] (disjoint ranges)."""
        length = self.length
        parts: list[tuple[np.ndarray, int, int]] = []  # (window slots, first step, starts)
        held = 0
        for eid, lo, hi in zip(eids.tolist(), lows.tolist(), highs.tolist()):
            ep = self.episodes.get(eid)
            if ep is None:
                continue  # gone since (its slots were cleared)
            a, b = max(lo - ep.base, ep.first), min(hi - ep.base, ep.last)
            for start in range(a, b + 1, _CHUNK):
                end = min(start + _CHUNK - 1, b)
                parts.append((ep.slots[start:end + length], ep.base + start, end - start + 1))
                held += end - start + 1
                if held >= _CHUNK:
                    self._weigh(parts)
                    parts, held = [], 0
        if parts:
            self._weigh(parts)

    def _weigh(self, parts: list[tuple[np.ndarray, int, int]]) -> None:
        """Write the tree values of the starts in `parts`, all in one gather of their windows."""
        length = self.length
        counts = np.array([p[2] for p in parts], dtype=np.int64)
        seg_lens = counts + length - 1  # each part's segment, padded with -1 to whole windows
        seg_at = np.zeros(len(parts), dtype=np.int64)
        np.cumsum(seg_lens[:-1], out=seg_at[1:])
        flat = np.full(int(seg_lens.sum()), -1, dtype=np.int64)
        for (seg, _, _), offset in zip(parts, seg_at.tolist()):
            flat[offset:offset + len(seg)] = seg
        total = int(counts.sum())
        first_of = np.zeros(len(parts), dtype=np.int64)
        np.cumsum(counts[:-1], out=first_of[1:])
        local = np.arange(total, dtype=np.int64) - np.repeat(first_of, counts)  # index within its part
        at = np.repeat(seg_at, counts) + local
        steps = np.repeat(np.array([p[1] for p in parts], dtype=np.int64), counts) + local
        windows = flat[at[:, None] + np.arange(length)]  # (S, L) slots, -1 absent
        present = windows >= 0
        real = _prefix(present)
        lengths = real.sum(axis=1)
        head = windows[:, 0]
        live = head >= 0  # the start step itself is present: its slot gets values
        is_start = live & (steps % self.stride == 0)
        prio = np.where(real, self.sampler.priority[np.where(present, windows, 0)], 0.0)
        if self.config.sequence_priority == "max":
            agg = prio.max(axis=1)
        else:
            agg = prio.sum(axis=1) / np.maximum(lengths, 1)
        slots = head[live]
        self.uniform.update(slots, is_start[live].astype(np.float64))
        self.weighted.update(slots, np.where(is_start, agg ** self.config.alpha, 0.0)[live])

    def count(self) -> int:
        """How many sequences may be drawn (their starts)."""
        if not self.on:
            return 0
        self._flush()
        return int(round(self.uniform.total()))

    def is_start(self, slots: np.ndarray) -> np.ndarray:
        self._flush()
        return self.uniform.get(slots) > 0

    def _prioritized(self) -> bool:
        return self.config.sampler == "prioritized" and self.weighted.total() > 0

    def draw(self, n: int) -> np.ndarray:
        """n start slots (stratified, with replacement), without counting them."""
        if self.count() == 0:
            return np.zeros(0, dtype=np.int64)
        tree = self.weighted if self._prioritized() else self.uniform
        return tree.sample(n, self.sampler.rng)

    def windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (N, L) slots of the sequences that start at `starts` (-1: padding) and the
        (N, L) mask of real steps."""
        out = np.full((len(starts), self.length), -1, dtype=np.int64)
        eps = self.episodes
        for i, (eid, step) in enumerate(zip(self.episode_of[starts].tolist(), self.step_of[starts].tolist())):
            ep = eps[eid]
            off = step - ep.base
            run = ep.slots[off:off + self.length]
            out[i, :len(run)] = run
        mask = _prefix(out >= 0)
        out[~mask] = -1
        return out, mask

    def probabilities(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Probability and normalised importance weight of each drawn sequence (as the
        buffer's Sampler gives them for entries, over sequences)."""
        n = len(starts)
        if n == 0:
            return np.zeros(0), np.zeros(0)
        if self._prioritized():
            p = self.weighted.get(starts)
            probs = p / self.weighted.total()
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                weights = np.where(probs > 0, (p / self.weighted.min_positive()) ** (-self.config.beta), 0.0)
            return probs, weights
        return np.full(n, 1.0 / max(self.count(), 1)), np.ones(n)

    def select(self, n: int, hint: tuple[np.ndarray, np.ndarray] | None,
               valid: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> "Drawn":
        """Draw n sequences, counting their real steps as sampled. `hint` is a pre-drawn
        (start slots, their seqs); `valid(slots, seqs)` says which slots still hold the
        entry they held (those that do and still start a sequence are taken first)."""
        self._flush()
        parts = []
        if hint is not None:
            slots, seqs = hint
            parts.append(slots[valid(slots, seqs) & self.is_start(slots)][:n])
        have = len(parts[0]) if parts else 0
        if have < n:
            parts.append(self.draw(n - have))
        starts = np.concatenate(parts).astype(np.int64)
        slots, mask = self.windows(starts)
        probs, weights = self.probabilities(starts)
        real = slots[mask]
        np.add.at(self.sampler.times, real, 1)
        return Drawn(starts, slots, mask, probs, weights)

    def stats(self) -> dict:
        return {"length": self.length, "stride": self.stride, "priority": self.config.sequence_priority,
                "episodes": len(self.episodes), "starts": self.count(), "unkeyed_entries": len(self.unkeyed)}


class Drawn:
    """A draw of sequences: start slots (N), step slots (N, L; -1 padding), the mask of
    real steps, and per sequence its probability and importance weight."""

    __slots__ = ("starts", "slots", "mask", "probabilities", "weights")

    def __init__(self, starts: np.ndarray, slots: np.ndarray, mask: np.ndarray, probabilities: np.ndarray,
                 weights: np.ndarray) -> None:
        self.starts = starts
        self.slots = slots
        self.mask = mask
        self.probabilities = probabilities
        self.weights = weights


def _prefix(present: np.ndarray) -> np.ndarray:
    """Per row, True up to (not including) the first False of `present` (an (S, L) bool)."""
    length = present.shape[1]
    upto = np.where(present.all(axis=1), length, present.argmin(axis=1))
    return np.arange(length) < upto[:, None]


def _intervals(eids: np.ndarray, steps: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The starts whose windows hold the changed (episode, step) pairs, as disjoint ranges
    of step numbers per episode: (episode ids, lows, highs)."""
    order = np.lexsort((steps, eids))
    eids, steps = eids[order], steps[order]
    lows, highs = steps - (length - 1), steps
    # sorted by step within an episode, all ranges L long: one joins the previous one when it
    # starts at most one past the previous end
    new = np.ones(len(eids), dtype=bool)
    new[1:] = (eids[1:] != eids[:-1]) | (lows[1:] > highs[:-1] + 1)
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(eids) - 1)
    return eids[first], lows[first], highs[last]

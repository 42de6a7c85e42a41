"""Proportional-sampling sum tree over a fixed number of slots.

This module owns `SumTree`: a vectorised (numpy) structure mapping slot
indexes to non-negative priorities, supporting batched priority updates, the
running total, the smallest positive priority, prefix-sum search and
stratified proportional sampling. It knows nothing about what a slot holds
and is not thread-safe: callers serialise access. Two loops run in C when
distorefs/_sumtree.c is built (it is optional): the ancestors of a small
update, and the descent of find(); they give the same tree and the same slots.

Layout: a wide B-ary tree stored as one flat float64 array per level. Level 0
holds the leaves; node i of level k+1 is the sum of nodes i*B .. i*B+B-1 of
level k, so `levels[k].reshape(-1, B)` turns "the children of each parent"
into rows. Levels stop once one has at most TOP_MAX nodes; with B=16 a
million slots need three (1M, 62512, 3920), so a batched update or search is
a few numpy calls per level rather than ~20 binary-tree levels. A parallel
tree keeps, per node, the minimum positive leaf below it.

Speed notes (batch 256, 1M slots; see tools/bench_sumtree.py):
* numpy's axis=1 reductions and cumsum over many short rows are slow (they
  restart a tiny inner loop per row), so prefix sums within rows are a
  matmul with a triangular matrix of ones, row sums a matvec with ones, row
  minima are taken over a transposed copy (an element-wise fold), and
  "how many prefix sums are <= q" is a popcount over the comparison bytes.
* Parents are always recomputed from their children, never patched with
  deltas, so sums do not drift however many updates are applied.
"""

from __future__ import annotations

import math

import numpy as np

try:  # the loops of a small update and of find() in C (distorefs/_sumtree.c); numpy without it
    from . import _sumtree as _native  # type: ignore[attr-defined]
except ImportError:  # no C compiler at install
    _native = None

__all__ = ["SumTree", "DEFAULT_BRANCHING"]

# Measured at 1M slots, batch 256 (sample / update, us): 8 -> 92 / 45 (one
# more level to update), 16 -> 95 / 38, 32 -> 108 / 54 (per-row work grows
# as B^2 in the prefix-sum matmul).
DEFAULT_BRANCHING = 16

# The tree stops at a level of at most this many nodes. find() does one
# sequential cumsum over it per call, and total()/min_positive() scan it once
# per update; in exchange updates recompute fewer levels. At 1M slots, B=16,
# 4096 (levels 1M / 62512 / 3920) cut update time ~25% versus 256 with no
# change to sampling.
TOP_MAX = 4096
_HAS_BITWISE_COUNT = hasattr(np, "bitwise_count")  # numpy >= 2.0


def _round_up(n: int, b: int) -> int:
    return -(-n // b) * b


def _row_min(rows: np.ndarray) -> np.ndarray:
    # min over a transposed contiguous copy folds whole rows element-wise;
    # rows.min(axis=1) runs one tiny reduction per row and is ~3x slower.
    return rows.T.copy().min(axis=0)


class SumTree:
    """Sum tree (plus min tree) over `capacity` slots, all starting at 0."""

    _total: float | None  # cached by total() and min_positive(); None after an update
    _min_positive: float | None

    def __init__(self, capacity: int, *, branching: int = DEFAULT_BRANCHING) -> None:
        """`branching` (a multiple of 8 in [8, 128]) tunes speed and depth only."""
        # Multiple of 8: rows of bools are counted as 64-bit words (_count_le);
        # <= 128: per-row counts are held in uint8.
        if branching < 8 or branching > 128 or branching % 8:
            raise ValueError(f"branching must be a multiple of 8 in [8, 128], got {branching}")
        self._b = int(branching)
        self._native = _native  # (None in tests that check the numpy code against it)
        self._tri = np.triu(np.ones((self._b, self._b)))  # row @ tri = inclusive cumsum
        self._ones = np.ones(self._b)
        self._build(self._checked_capacity(capacity), np.zeros(0))

    # ------------------------------------------------------------------ shape

    @staticmethod
    def _checked_capacity(capacity: int) -> int:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an int, got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        return int(capacity)

    def _build(self, capacity: int, old_leaves: np.ndarray) -> None:
        """(Re)create every level for `capacity` slots, seeding the leaves."""
        b = self._b
        sizes = [_round_up(capacity, b)]
        while sizes[-1] > TOP_MAX:
            sizes.append(_round_up(sizes[-1] // b, b))
        self._sums = [np.zeros(size) for size in sizes]
        # mins[k] mirrors sums[k] for k >= 1 (inf = no positive leaf below);
        # leaf minima come from the leaves themselves, so mins[0] is unused.
        self._mins = [np.empty(0)] + [np.full(size, np.inf) for size in sizes[1:]]
        self._rows = [lvl.reshape(-1, b) for lvl in self._sums]
        self._min_rows = [lvl.reshape(-1, b) for lvl in self._mins]
        self._capacity = capacity
        self._sums[0][: len(old_leaves)] = old_leaves
        self._refresh_ancestors(None)

    @property
    def capacity(self) -> int:
        """Number of addressable slots (0 .. capacity-1)."""
        return self._capacity

    def grow(self, capacity: int) -> None:
        """Raise the slot count to `capacity`, keeping existing values.

        O(capacity): every level is rebuilt. New slots start at 0.
        """
        capacity = self._checked_capacity(capacity)
        if capacity < self._capacity:
            raise ValueError(
                f"grow cannot shrink: new capacity {capacity} < current {self._capacity}"
            )
        if capacity != self._capacity:
            self._build(capacity, self._sums[0][: self._capacity])

    # ------------------------------------------------------------- arguments

    def _checked_slots(self, slots: np.ndarray) -> np.ndarray:
        s = np.asarray(slots)
        if s.dtype.kind not in "iu":
            if s.size == 0:
                return np.zeros(0, dtype=np.int64)
            raise TypeError(f"slots must be integers, got dtype {s.dtype}")
        s = s.reshape(-1).astype(np.int64, copy=False)
        # Viewed as unsigned, negative slots become huge: one bound check.
        if s.size and s.view(np.uint64).max() >= self._capacity:
            bad = s[(s < 0) | (s >= self._capacity)][0]
            raise IndexError(f"slot {bad} out of range [0, {self._capacity})")
        return s

    # --------------------------------------------------------------- updates

    def update(self, slots: np.ndarray, values: np.ndarray | float) -> None:
        """Set `values[i]` at `slots[i]`; if a slot repeats, the last value wins.

        Values must be finite and >= 0 (ValueError otherwise, nothing changed).
        `values` may be a scalar, applied to every slot.
        """
        native = self._native
        if (native is not None and type(slots) is np.ndarray and type(values) is np.ndarray
                and slots.dtype == np.int64 and values.dtype == np.float64 and slots.ndim == 1
                and values.shape == slots.shape and slots.flags.c_contiguous and values.flags.c_contiguous
                and slots.size * self._b < self._sums[0].size):
            # A few slots (a learner's priorities, the inserts since a draw): set and summed
            # up the levels in C, not some twenty numpy calls. False: a bad slot or value,
            # nothing changed; the code below says which.
            if native.update(self._sums, self._mins, self._b, self._capacity, slots, values):
                self._total = self._min_positive = None
                return
        s = self._checked_slots(slots)
        v = np.asarray(values, dtype=np.float64)
        if v.ndim == 0:
            v = np.full(s.shape, float(v))
        else:
            v = v.reshape(-1)
            if v.shape != s.shape:
                raise ValueError(
                    f"slots and values differ in length: {s.size} vs {v.size}"
                )
        if s.size == 0:
            return
        if not (v.min() >= 0.0 and v.max() < math.inf):  # a NaN fails both
            bad = v[~(np.isfinite(v) & (v >= 0.0))][0]
            raise ValueError(f"priority must be finite and >= 0, got {float(bad)!r}")

        leaves = self._sums[0]
        leaves[s] = v
        # numpy does not promise which copy of a repeated index it writes last,
        # but whichever it kept, a repeat with differing values leaves some
        # leaves[s] != v. Only then pay for an explicit last-wins pass.
        if (leaves[s] != v).any():
            order = np.argsort(s, kind="stable")
            ordered = s[order]
            last = np.append(ordered[1:] != ordered[:-1], True)
            leaves[ordered[last]] = v[order][last]
        self._refresh_ancestors(s)

    def _refresh_ancestors(self, slots: np.ndarray | None) -> None:
        """Recompute the sums and minima above `slots` (None: above every slot).

        Repeated parents are not deduplicated: they compute and write
        identical values, which costs less than removing them. Once a level's
        parent list is so long that gathering their children would touch
        more than the whole child level, that level and all above it are
        recomputed wholesale instead.
        """
        self._total = self._min_positive = None
        b = self._b
        parents = slots
        for k in range(1, len(self._sums)):
            child_rows, child_mins = self._rows[k - 1], self._min_rows[k - 1]
            if parents is not None:
                parents = parents // b
                if parents.size * b >= child_rows.size:
                    parents = None
            if parents is None:
                where: np.ndarray | slice = slice(0, len(child_rows))
                children, min_children = child_rows, child_mins
            else:
                where = parents
                children = child_rows.take(parents, axis=0)
                min_children = None if k == 1 else child_mins.take(parents, axis=0)
            self._sums[k][where] = children @ self._ones
            if k == 1:  # leaves: a zero is not "positive", so it counts as inf
                t = children.T.copy()
                np.copyto(t, np.inf, where=t == 0.0)
                self._mins[k][where] = t.min(axis=0)
            else:
                self._mins[k][where] = _row_min(min_children)

    # --------------------------------------------------------------- queries

    def get(self, slots: np.ndarray) -> np.ndarray:
        """Leaf values at `slots` (a new float64 array)."""
        return self._sums[0][self._checked_slots(slots)]

    def total(self) -> float:
        """Sum of all leaves (O(TOP_MAX) after an update, then cached)."""
        if self._total is None:
            self._total = float(self._sums[-1].sum())
        return self._total

    def min_positive(self) -> float:
        """Smallest leaf value > 0, or math.inf if every leaf is 0.

        O(TOP_MAX) after an update, then cached.
        """
        if self._min_positive is None:
            if len(self._sums) == 1:
                top = self._sums[0]
                self._min_positive = float(np.where(top > 0.0, top, np.inf).min())
            else:
                self._min_positive = float(self._mins[-1].min())
        return self._min_positive

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """Slots i with cumsum(<i) <= prefix < cumsum(<=i), one per prefix.

        Prefixes are clamped into [0, total). Never returns a slot whose value
        is 0: if rounding lands a prefix on a zero-valued node, the search
        moves to the nearest positive sibling (the next one, else the previous).
        """
        if self._native is not None:  # the descent below, in C
            q = np.ascontiguousarray(prefix, dtype=np.float64).reshape(-1)
            out = np.empty(q.size, dtype=np.int64)
            if q.size:
                self._native.find(self._sums, self._b, q, out)
            return out
        q = np.array(prefix, dtype=np.float64).reshape(-1)  # a copy: mutated below
        if q.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not np.isfinite(q).all():
            raise ValueError("prefix values must be finite")
        np.maximum(q, 0.0, out=q)

        # Top level: one exact sequential cumsum, with a leading 0 so that
        # c[j] is the sum of the nodes before j.
        top = self._sums[-1]
        c = np.zeros(len(top) + 1)
        np.cumsum(top, out=c[1:])
        if not c[-1] > 0.0:
            raise ValueError("cannot find a slot: every priority is 0")
        # A prefix at or past the total (clamping, rounding) goes to the last
        # positive node: the first one whose cumsum reaches the total.
        last = int(np.searchsorted(c, c[-1], side="left")) - 1
        idx = np.searchsorted(c, q, side="right") - 1
        np.minimum(idx, last, out=idx)
        q -= c[idx]

        b, n = self._b, q.size
        row_starts = np.arange(n) * b
        for rows in reversed(self._rows[:-1]):
            children = rows.take(idx, axis=0)
            csum = children @ self._tri  # inclusive prefix sums per row
            j = self._count_le(csum, q)
            # j == b means q reached the row total (rounding or clamping):
            # take the last child; a zero there is repaired just below.
            np.minimum(j, b - 1, out=j)
            flat = row_starts + j
            value = children.reshape(-1)[flat]
            # Offset into the chosen child. It may dip a hair below 0 through
            # rounding; the next level then picks its first positive child.
            q -= csum.reshape(-1)[flat] - value
            if value.min() <= 0.0:
                self._move_off_zeros(children, j, q, value <= 0.0)
            idx = idx * b + j
        return idx

    def _move_off_zeros(
        self, children: np.ndarray, j: np.ndarray, q: np.ndarray, bad: np.ndarray
    ) -> None:
        """Re-point rows whose chosen child is 0 to the nearest positive sibling.

        Only reached through floating-point rounding at a boundary. The parent
        is positive, so each such row has a positive child somewhere.
        """
        rows = children[bad]
        at = j[bad][:, None]
        col = np.arange(self._b)
        right = (rows > 0.0) & (col > at)
        left = (rows > 0.0) & (col < at)
        has_right = right.any(axis=1)
        new = np.where(has_right, right.argmax(axis=1), self._b - 1 - left[:, ::-1].argmax(axis=1))
        j[bad] = new
        # Enter a right sibling at its start, a left sibling at its end.
        q[bad] = np.where(has_right, 0.0, rows[np.arange(len(rows)), new])

    def _count_le(self, csum: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Per row, how many entries of `csum` are <= q (a small uint array)."""
        le = csum <= q[:, None]
        if not _HAS_BITWISE_COUNT:
            return np.count_nonzero(le, axis=1)
        # A row of b bools is b/8 words of 0/1 bytes: popcount the words.
        # Far cheaper than count_nonzero(axis=1) over many short rows.
        words = np.bitwise_count(le.view(np.uint64))
        count = words[:, 0].copy()
        for w in range(1, words.shape[1]):
            count += words[:, w]
        return count

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` slots drawn proportionally to value, stratified.

        [0, total) is cut into n equal segments with one uniform draw in each,
        which lowers variance versus n independent draws.
        """
        if n < 0:
            raise ValueError(f"sample size must be >= 0, got {n}")
        total = self.total()
        if not total > 0.0:
            raise ValueError("cannot sample: every priority is 0")
        if not math.isfinite(total):
            raise ValueError("cannot sample: sum of priorities overflowed")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        stride = total / n
        if self._native is not None and stride > 0.0:  # the prefixes made in C from the uniforms
            out = np.empty(n, dtype=np.int64)
            self._native.find(self._sums, self._b, rng.random(n), out, stride)
            return out
        return self.find((np.arange(n) + rng.random(n)) * stride)

    def sample_weighted(self, n: int, rng: np.random.Generator, beta: float
                        ) -> tuple[np.ndarray, np.ndarray] | None:
        """`sample` (the same slots from the same generator state), with each slot's
        probability leaf / total and importance weight (leaf / min_positive()) ** -beta: a
        (2, n) array, in the one C call that draws. None without the C module, or from an
        empty tree (the caller draws with `sample`)."""
        total = self.total()
        if self._native is None or n <= 0 or not total > 0.0 or not math.isfinite(total):
            return None
        out = np.empty(n, dtype=np.int64)
        pw = np.empty((2, n))
        self._native.find(self._sums, self._b, rng.random(n), out, total / n, pw, total, self.min_positive(), beta)
        return out, pw

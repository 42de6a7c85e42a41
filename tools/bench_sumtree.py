"""Benchmark distorefs' SumTree against cpprb's C++ PrioritizedReplayBuffer.

Both sides are filled with the same `entries` random priorities. Each then
runs a loop alternating one batched sample and one batched priority update
(the shape of a PER training step), timing every op. The two sides take
turns in short rounds, so a noisy neighbour on the machine slows both alike
instead of skewing the ratio. Reports median microseconds per op, ops/s, and
distorefs/cpprb time ratios (< 1 means distorefs is faster).

What each timed op covers:
* distorefs sample: `tree.sample(batch)` plus the per-slot probabilities
  (`get(slots) / total()`) and PER importance weights (which need
  `min_positive()`), because cpprb's `sample` returns weights too.
* distorefs update: `tree.update(slots, values)` with raw values; cpprb's
  `update_priorities` also raises priorities to alpha internally.
* cpprb: `sample(batch, beta=0.4)` and `update_priorities(indexes, priorities)`.

Random inputs are drawn before timing, so neither side pays for the RNG
outside its own sampler. Run: `python tools/bench_sumtree.py`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

_BETA = 0.4
_ALPHA = 0.6
_POOL = 512  # pre-drawn update batches, cycled
_ROUNDS = 10  # turns each side takes; more rounds = fairer under load


@dataclass
class _Side:
    name: str
    sample: Callable[[], object]
    update: Callable[[int], object]
    fill_s: float
    sample_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)

    def run_for(self, seconds: float) -> None:
        """Alternate sample/update for `seconds`, recording each op's time."""
        clock = time.perf_counter
        deadline = clock() + seconds
        i = len(self.update_s)
        while clock() < deadline:
            t0 = clock()
            self.sample()
            t1 = clock()
            self.update(i)
            t2 = clock()
            self.sample_s.append(t1 - t0)
            self.update_s.append(t2 - t1)
            i += 1

    def summary(self) -> dict:
        s_us = float(np.median(self.sample_s) * 1e6)
        u_us = float(np.median(self.update_s) * 1e6)
        p = self.name
        return {
            f"{p}_sample_us": round(s_us, 2),
            f"{p}_update_us": round(u_us, 2),
            f"{p}_sample_ops_s": round(1e6 / s_us),
            f"{p}_update_ops_s": round(1e6 / u_us),
            f"{p}_ops_timed": len(self.sample_s),
            f"{p}_fill_s": round(self.fill_s, 3),
        }


def _distorefs_side(priorities: np.ndarray, slots: np.ndarray, values: np.ndarray,
                    batch: int) -> _Side:
    from distorefs.sumtree import SumTree

    entries = priorities.size
    tree = SumTree(entries)
    t0 = time.perf_counter()
    tree.update(np.arange(entries), priorities)
    fill_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)

    def sample() -> tuple[np.ndarray, np.ndarray]:
        idx = tree.sample(batch, rng)
        total = tree.total()
        probs = tree.get(idx) / total
        max_weight = (tree.min_positive() / total * entries) ** -_BETA
        return idx, (probs * entries) ** -_BETA / max_weight

    def update(i: int) -> None:
        tree.update(slots[i % _POOL], values[i % _POOL])

    return _Side("distorefs", sample, update, fill_s)


def _cpprb_side(priorities: np.ndarray, slots: np.ndarray, values: np.ndarray,
                batch: int) -> _Side:
    from cpprb import PrioritizedReplayBuffer  # lazy: optional dependency

    entries = priorities.size
    rb = PrioritizedReplayBuffer(entries, {"obs": {"shape": 1}}, alpha=_ALPHA)
    chunk = 100_000
    t0 = time.perf_counter()
    for start in range(0, entries, chunk):
        p = priorities[start:start + chunk]
        rb.add(obs=np.zeros((p.size, 1)), priorities=p)
    fill_s = time.perf_counter() - t0

    def sample() -> dict:
        return rb.sample(batch, beta=_BETA)

    def update(i: int) -> None:
        rb.update_priorities(slots[i % _POOL], values[i % _POOL])

    return _Side("cpprb", sample, update, fill_s)


def run(entries: int = 1_000_000, batch: int = 256, seconds: float = 3.0) -> dict:
    """Time both implementations, each for `seconds` of sample+update loop.

    cpprb fields are None (with a "note") when cpprb cannot be imported.
    """
    from distorefs.sumtree import DEFAULT_BRANCHING

    rng = np.random.default_rng(0)
    # Strictly positive so both sides hold exactly the same population.
    priorities = rng.random(entries) + 1e-6
    slots = rng.integers(0, entries, size=(_POOL, batch))
    values = rng.random((_POOL, batch)) + 1e-6

    sides = [_distorefs_side(priorities, slots, values, batch)]
    note = "ratio = distorefs time / cpprb time per op; < 1 means distorefs is faster"
    try:
        sides.append(_cpprb_side(priorities, slots, values, batch))
    except ImportError as exc:
        note = f"cpprb not importable ({exc}); distorefs numbers only"

    for side in sides:  # warm caches and lazy paths, untimed
        side.run_for(0.05)
        side.sample_s.clear()
        side.update_s.clear()
    for _ in range(_ROUNDS):
        for side in sides:
            side.run_for(seconds / _ROUNDS)

    out: dict = {
        "entries": entries,
        "batch": batch,
        "seconds": seconds,
        "numpy": np.__version__,
        "branching": DEFAULT_BRANCHING,
    }
    for side in sides:
        out.update(side.summary())
    if len(sides) == 2:
        out["ratio_sample"] = round(out["distorefs_sample_us"] / out["cpprb_sample_us"], 3)
        out["ratio_update"] = round(out["distorefs_update_us"] / out["cpprb_update_us"], 3)
    else:
        for key in ("sample_us", "update_us", "sample_ops_s", "update_ops_s",
                    "ops_timed", "fill_s"):
            out[f"cpprb_{key}"] = None
        out["ratio_sample"] = out["ratio_update"] = None
    out["note"] = note
    return out


if __name__ == "__main__":
    # Allow `python tools/bench_sumtree.py` from a checkout without installing.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(json.dumps(run(), indent=2))

"""Benchmark distorefs' SumTree against cpprb's C++ PrioritizedReplayBuffer.

Both sides are filled with `entries` random priorities, then a loop alternates
one batched sample and one batched priority update (the shape of a PER
training step) for `seconds` each, timing every op. Reports median
microseconds per op, ops/s, and distorefs/cpprb time ratios (< 1 means
distorefs is faster).

What each timed op covers:
* distorefs sample: `tree.sample(batch)` plus the per-slot probabilities
  (`get(slots) / total()`) and PER importance weights (which need
  `min_positive()`), because cpprb's `sample` returns weights too.
* distorefs update: `tree.update(slots, values)` with raw values; cpprb's
  `update_priorities` also raises priorities to alpha internally.
* cpprb: `sample(batch, beta=0.4)` and `update_priorities(indexes, priorities)`.

Random inputs are drawn before timing, so neither side pays for the RNG
outside its sampler. Run: `PYTHONPATH=. python tools/bench_sumtree.py`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

_BETA = 0.4
_ALPHA = 0.6
_POOL = 512  # pre-drawn update batches, cycled


def _time_alternating(
    sample: Callable[[], object], update: Callable[[int], object], seconds: float
) -> tuple[np.ndarray, np.ndarray]:
    """Alternate sample/update ops for ~2*seconds; per-op times in seconds."""
    for i in range(20):  # warm caches and lazy paths before timing
        sample()
        update(i)
    ts: list[float] = []
    tu: list[float] = []
    clock = time.perf_counter
    deadline = clock() + 2 * seconds
    i = 0
    while clock() < deadline:
        t0 = clock()
        sample()
        t1 = clock()
        update(i)
        t2 = clock()
        ts.append(t1 - t0)
        tu.append(t2 - t1)
        i += 1
    return np.array(ts), np.array(tu)


def _summary(prefix: str, ts: np.ndarray, tu: np.ndarray) -> dict:
    s_us = float(np.median(ts) * 1e6)
    u_us = float(np.median(tu) * 1e6)
    return {
        f"{prefix}_sample_us": round(s_us, 2),
        f"{prefix}_update_us": round(u_us, 2),
        f"{prefix}_sample_ops_s": round(1e6 / s_us),
        f"{prefix}_update_ops_s": round(1e6 / u_us),
        f"{prefix}_ops_timed": int(ts.size),
    }


def _bench_distorefs(priorities: np.ndarray, slots: np.ndarray, values: np.ndarray,
                     batch: int, seconds: float) -> dict:
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
        weights = (probs * entries) ** -_BETA / (tree.min_positive() / total * entries) ** -_BETA
        return idx, weights

    def update(i: int) -> None:
        tree.update(slots[i % _POOL], values[i % _POOL])

    ts, tu = _time_alternating(sample, update, seconds)
    return {**_summary("distorefs", ts, tu), "distorefs_fill_s": round(fill_s, 3)}


def _bench_cpprb(priorities: np.ndarray, slots: np.ndarray, values: np.ndarray,
                 batch: int, seconds: float) -> dict:
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

    ts, tu = _time_alternating(sample, update, seconds)
    return {**_summary("cpprb", ts, tu), "cpprb_fill_s": round(fill_s, 3)}


def run(entries: int = 1_000_000, batch: int = 256, seconds: float = 3.0) -> dict:
    """Time both implementations; `seconds` is spent per side, per op kind.

    cpprb fields are None (with a "note") when cpprb cannot be imported.
    """
    from distorefs.sumtree import DEFAULT_BRANCHING

    rng = np.random.default_rng(0)
    # Strictly positive so cpprb and distorefs see the same population.
    priorities = rng.random(entries) + 1e-6
    slots = rng.integers(0, entries, size=(_POOL, batch))
    values = rng.random((_POOL, batch)) + 1e-6

    out: dict = {
        "entries": entries,
        "batch": batch,
        "seconds": seconds,
        "numpy": np.__version__,
        "branching": DEFAULT_BRANCHING,
    }
    out.update(_bench_distorefs(priorities, slots, values, batch, seconds))
    cp_keys = [f"cpprb_{k}" for k in
               ("sample_us", "update_us", "sample_ops_s", "update_ops_s", "ops_timed", "fill_s")]
    try:
        out.update(_bench_cpprb(priorities, slots, values, batch, seconds))
    except ImportError as exc:
        out.update({k: None for k in cp_keys})
        out.update(ratio_sample=None, ratio_update=None,
                   note=f"cpprb not importable ({exc}); distorefs numbers only")
        return out
    out["ratio_sample"] = round(out["distorefs_sample_us"] / out["cpprb_sample_us"], 3)
    out["ratio_update"] = round(out["distorefs_update_us"] / out["cpprb_update_us"], 3)
    out["note"] = "ratio = distorefs time / cpprb time per op; < 1 means distorefs is faster"
    return out


if __name__ == "__main__":
    # Allow `python tools/bench_sumtree.py` from a checkout without installing.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(json.dumps(run(), indent=2))

"""The daemon's cycle collector: when it runs, and the pauses it made (stats.json mount.gc).

CPython's collector stops every thread of the daemon while it walks the objects of the
generations it collects. The daemon keeps an object or more per inode, buffer entry and
dataset item, and makes many more per request; at CPython's thresholds (a young collection
every 700 net allocations, a full one whenever a quarter more objects became old) a cold
epoch of 100,000 dataset items made 11 full collections of up to 265 ms each, 2.1 s of its
15, every request waiting. With young collections every 20,000 allocations and the objects
made at start left out of every collection (`gc.freeze`: modules, the store's state, which
live as long as the daemon), the same epoch made none. Objects are still freed by their
reference counts at once: only cycles wait longer to be found.
"""

from __future__ import annotations

import gc
import time

THRESHOLDS = (20_000, 10, 10)


class CollectorPauses:
    """Counts and times the collector's runs, per generation."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        generation = info.get("generation", 2)
        self.runs[generation] += 1
        self.seconds[generation] += took
        self.longest = max(self.longest, took)

    def stats(self) -> dict:
        return {"runs": list(self.runs), "ms": [round(s * 1e3, 1) for s in self.seconds],
                "longest_ms": round(self.longest * 1e3, 1), "thresholds": list(gc.get_threshold()),
                "frozen": gc.get_freeze_count()}


def tune() -> CollectorPauses:
    """Set the daemon's thresholds, freeze what exists now (call it once the store is open
    and the tree built) and start counting the pauses."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    pauses = CollectorPauses()
    gc.callbacks.append(pauses)
    return pauses

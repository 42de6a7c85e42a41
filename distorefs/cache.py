"""The memory tier: a byte-bounded LRU of decoded values shared by every namespace.

Values enter on insert (write-through), on read misses, from the prefetcher and when a
file is warmed (`distorefs warmup`: ValueLayer.warm); the least recently used leave when
`capacity_bytes` is exceeded. A value larger than a quarter of the budget is never cached,
so one huge entry cannot flush everything. Tables of decoded fields kept beside it (a
buffer's rows, distorefs/rows.py) reserve their bytes from the same budget: at most half
of it, the LRU holding what is left. A namespace may `watch` its keys come and go (a ring
keeps, per slot, whether its value is here: distorefs/ring.py slot_cached).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Hashable

# Told whenever a watched key enters the tier (True) or leaves it (False).
Watcher = Callable[[Hashable, bool], None]


class ValueCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.reserved_bytes = 0  # held by tables beside the LRU (reserve)
        self.hits = 0
        self.misses = 0
        self.warmed_bytes = 0  # loaded by warm requests
        self.warm_refused_bytes = 0  # asked for by warm requests, not taken (budget)
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        # Whoever keeps its own record of which of its keys the tier holds (a ring, per slot:
        # a draw then asks a numpy array, not the LRU key by key), by the first item of the
        # key tuple. Weak: a dropped namespace's watcher goes with it.
        self._watchers: dict[Hashable, weakref.WeakMethod] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable) -> bytes | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def peek(self, key: Hashable) -> bytes | None:
        """Like get, but counts neither a hit nor a miss (for the prefetcher's bookkeeping)."""
        return self._items.get(key)

    def watch(self, prefix: Hashable, fn: Watcher) -> None:
        """Call `fn(key, held)` (a bound method, held weakly) whenever a key tuple starting
        with `prefix` enters the tier (held True) or leaves it (False)."""
        self._watchers[prefix] = weakref.WeakMethod(fn)  # type: ignore[arg-type]

    def _tell(self, key: Hashable, held: bool) -> None:
        ref = self._watchers.get(key[0]) if type(key) is tuple and key else None  # type: ignore[index]
        if ref is not None:
            fn = ref()
            if fn is None:
                del self._watchers[key[0]]  # type: ignore[index]
            else:
                fn(key, held)

    def admits(self, size: int) -> bool:
        """Whether a value of `size` bytes may be cached at all."""
        return size <= self.capacity_bytes // 4

    def put(self, key: Hashable, value: bytes) -> None:
        if not self.admits(len(value)):
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old)
        self._items[key] = value
        self.used_bytes += len(value)
        if self._watchers:
            self._tell(key, True)
        self._shrink()

    def reserve(self, nbytes: int) -> bool:
        """Take `nbytes` of the budget for a table kept beside the LRU; False (nothing
        taken) when the tables would hold more than half of the budget."""
        if self.reserved_bytes + nbytes > self.capacity_bytes // 2:
            return False
        self.reserved_bytes += nbytes
        self._shrink()
        return True

    def release(self, nbytes: int) -> None:
        self.reserved_bytes = max(0, self.reserved_bytes - nbytes)

    def resize(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._shrink()

    def _shrink(self) -> None:
        while self.used_bytes + self.reserved_bytes > self.capacity_bytes and self._items:
            key, evicted = self._items.popitem(last=False)
            self.used_bytes -= len(evicted)
            if self._watchers:
                self._tell(key, False)

    def discard(self, key: Hashable) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old)
            if self._watchers:
                self._tell(key, False)

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "reserved_bytes": self.reserved_bytes,
            "values": len(self._items),
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hits / total, 4) if total else None,
            "warmed_bytes": self.warmed_bytes,
            "warm_refused_bytes": self.warm_refused_bytes,
        }

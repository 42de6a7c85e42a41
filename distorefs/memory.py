"""The memory budget: how `memory_bytes` is shared among what the daemon holds.

Everything the daemon keeps in memory because of the data it serves draws on one of
four shares of `memory_bytes`:

  cache      the memory tier (decoded values, LRU; buffers' rows tables,  35 %
             distorefs/rows.py, reserve up to half of it)
  prefetch   values read ahead: dataset prefetch, pre-sampled batches    25 %
  writeback  checkpoint data held until persisted                        30 %
  transfer   values queued for the kernel page cache (notify_store)     10 %

A share set explicitly (`cache_bytes`, `prefetch_bytes`, checkpoints' `writeback_bytes`)
is taken as is and the derived shares split what is left in the proportions above, so
the sum never exceeds `memory_bytes`. What memory_bytes does not cover, and so counts in
the fixed overhead: the interpreter and libraries, the per-entry index of each ring (a
few hundred bytes an entry), the bytes of one request in flight (an entry being written,
a batch being assembled), and LMDB's map, whose pages are the kernel's page cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import StoreConfig
from .errors import InvalidConfig

SHARES = {"cache": 0.35, "prefetch": 0.25, "writeback": 0.30, "transfer": 0.10}


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    cache: int
    prefetch: int
    writeback: int
    transfer: int

    @classmethod
    def of(cls, config: StoreConfig, writeback_bytes: int | None = None) -> "MemoryPlan":
        explicit = {"cache": config.cache_bytes, "prefetch": config.prefetch_bytes, "writeback": writeback_bytes}
        fixed = {k: v for k, v in explicit.items() if v is not None}
        if sum(fixed.values()) > config.memory_bytes:
            raise InvalidConfig(f"{' + '.join(k + '_bytes' for k in fixed)} ({sum(fixed.values())}) exceed "
                                f"memory_bytes ({config.memory_bytes})")
        left = config.memory_bytes - sum(fixed.values())
        derived = [k for k in SHARES if k not in fixed]
        weight = sum(SHARES[k] for k in derived)
        parts = {k: int(left * SHARES[k] / weight) for k in derived} if weight else {}
        return cls(total=config.memory_bytes, **{**parts, **fixed})

    def as_dict(self) -> dict[str, int]:
        return {"budget_bytes": self.total, "cache_bytes": self.cache, "prefetch_bytes": self.prefetch,
                "writeback_bytes": self.writeback, "transfer_bytes": self.transfer}

"""Placement: the one place that decides which tier holds a value, and which values move.

- A value whose stored size reaches `segment_threshold` goes to NVMe segment files
  (sequential, cheap to read whole).
- A smaller one lands in the LMDB (hot) tier while that tier holds less than
  `lmdb_bytes`; past it, straight to NVMe, so the budget holds even when demotion lags.
- Ring values on NVMe go to the ring's own segment stream, in FIFO order, so evicting
  the oldest entries frees whole segments; every other value goes to stream 0.
- Demotion (`distorefs.tiering`) moves ring values from LMDB to NVMe once the hot tier
  nears its budget, the oldest first (`demotion_target` says how far). A ring keeps a
  *demotion front*: entries before it were demoted, and a rewrite of one of them goes to
  NVMe at once rather than back into the hot tier.
- Reads promote into the memory tier (`ValueCache`), not back into LMDB: the hot tier
  follows FIFO age, the memory tier follows use.
- Compaction rewrites the live values of a ring's segments whose live fraction fell below
  `compaction_threshold`, emptiest first, so that on-disk bytes / live bytes stays under
  `max_space_overhead`.
"""

from __future__ import annotations

from .config import StoreConfig

# The tiers a stored value can be in (`StoredValue.tier`).
TIER_LMDB = 0
TIER_NVME = 1
TIER_CLUSTER = 2  # a shared store's values, in its Redis Cluster (distorefs/clusterlog.py)
TIER_NAMES = {TIER_LMDB: "lmdb", TIER_NVME: "nvme", TIER_CLUSTER: "cluster"}

# Demotion starts once the hot tier is this full and empties it down to DEMOTE_TO, so
# that new values keep landing in it (placement sends them to NVMe only past the budget).
DEMOTE_AT = 0.9
DEMOTE_TO = 0.75


def choose_tier(config: StoreConfig, lmdb_live: int, stored_size: int, cold: bool = False) -> int:
    """The tier of a new value of `stored_size` bytes, the hot tier holding `lmdb_live`
    bytes now; `cold`: the value belongs behind its ring's demotion front."""
    if cold or (config.segment_threshold and stored_size >= config.segment_threshold):
        return TIER_NVME
    if not config.lmdb_bytes or lmdb_live + stored_size > config.lmdb_bytes:
        return TIER_NVME  # lmdb_bytes 0: no hot tier at all, empty values included
    return TIER_LMDB


def demotion_target(config: StoreConfig, lmdb_live: int) -> int:
    """Bytes to move out of the hot tier now (0: within budget)."""
    if lmdb_live <= config.lmdb_bytes * DEMOTE_AT:
        return 0
    return lmdb_live - int(config.lmdb_bytes * DEMOTE_TO)


def compaction_threshold(config: StoreConfig) -> float:
    """Segments whose live fraction is below this are compacted. A segment at the
    threshold costs 1/threshold of its live bytes on disk; the margin leaves room for the
    segments being filled and the dead records compaction has not reached yet."""
    return min(0.9, 0.9 / config.max_space_overhead)

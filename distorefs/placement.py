"""Placement: the one place that decides which tier holds a value.

Today: values whose stored size reaches `segment_threshold` go to NVMe segment files
(sequential, cheap to read whole), smaller ones to LMDB (fast for many small values).
Decoded copies of hot values live in the memory tier (`ValueCache`) on top of either.
"""

from __future__ import annotations

from .catalog import TIER_LMDB, TIER_NVME
from .config import StoreConfig


def choose_tier(stored_size: int, config: StoreConfig) -> int:
    if config.segment_threshold and stored_size >= config.segment_threshold:
        return TIER_NVME
    return TIER_LMDB

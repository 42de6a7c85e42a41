"""Making room on a full disk by evicting a ring's oldest entries, only where that helps.

With no room left for a value, a ring that allows it (`evict_when_full`) evicts its oldest
entries and collects the segment files they empty. Evicting gives room back only where
those entries' space is: a segment file is freed when every live value in it goes (and it
is not being appended to); a value in LMDB frees pages LMDB reuses, which help only a value
that goes to LMDB too. So the plan takes the oldest entries until what they free would hold
the new value (twice, for slack), and takes none at all when even evicting all but the
newest entry would not: the space is held by someone else (another namespace, weights,
checkpoints), and the insert fails with ENOSPC without destroying the ring.
"""

from __future__ import annotations

from collections import Counter

from .catalog import EntryMeta
from .placement import TIER_LMDB, TIER_NVME
from .values import ValueLayer


def plan_room(values: ValueLayer, metas: list[EntryMeta], need: int) -> list[EntryMeta]:
    """The oldest of a ring's entries `metas` (oldest first) whose eviction frees room for a
    value of `need` bytes, or [] if no number of them would (worker thread: it reads the
    segment accounting)."""
    nvme = values.nvme
    segments = {s.seg: s for s in nvme.segments()}
    current = nvme.current_segments()
    threshold = values.config.segment_threshold
    to_lmdb = need < threshold if threshold else False
    goal = 2 * need
    taken: Counter[int] = Counter()
    victims: list[EntryMeta] = []
    useful = 0
    for meta in metas[:-1]:  # never the newest: the ring keeps at least one entry
        if useful >= goal:
            break
        victims.append(meta)
        if meta.tier == TIER_NVME:
            seg = nvme.segment_of(meta.value.loc)
            info = segments.get(seg) if seg is not None else None
            if info is None:
                continue
            assert seg is not None  # (info was found by it)
            taken[seg] += 1
            if taken[seg] == info.live_records and seg not in current:
                useful += info.total_bytes  # the whole file goes at the next collection
        elif meta.tier == TIER_LMDB and to_lmdb:
            useful += meta.stored_size
    return victims if useful >= need else []


__all__ = ["plan_room"]

"""Moving ring values between tiers in the background: demotion and compaction.

Both move a value whose content does not change to a new location and point its entry
there, which is one mechanism (`RelocateEntries`):

- **Demotion**: when the LMDB (hot) tier holds more than `lmdb_bytes`, the oldest ring
  entries still in it are moved to their ring's NVMe segment stream, ring by ring (the
  ring holding most in LMDB first), until it is back under the budget. A value its ring
  stored as written in the hot tier (`RingConfig.compress_hot` false) is compressed on
  the way, in the worker thread that reads it (`_cold_form`).
- **Compaction**: a ring segment whose live fraction has fallen (deletes, rewrites,
  entries spent by `max_times_sampled`) has its live values rewritten at the end of the
  ring's stream; with no live record left, the collector unlinks the file at its next
  sync. Segments below half live are always compacted; sparser-than-the-bound segments
  also while the tier's on-disk / live bytes is near `max_space_overhead`, emptiest first.

Developer note on concurrency. Values are read (worker thread) before the move is
committed; the move is an *exclusive* change (a commit group of its own), planned
against fully applied state, and skips every entry that was rewritten, renamed or
removed since it was read (`ring.by_seq[seq] is meta`). Each old location is deleted
exactly once, in the transaction that writes the new one, so segment accounting stays
exact and the collector never frees a segment still referenced. Readers holding the old
record keep reading the old location until the collector unlinks it after a sync; a read
that finds it gone retries with the current record (`Ring._load`). A crash before the
commit leaves the old location referenced and the copied bytes dead; after it, the new.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import trio

from . import codec
from .catalog import DB_ENTRIES, EntryMeta, entry_key, split_entry_key
from .clientwire import split_spool_vkey
from .committer import Change, Committer, Overlay
from .errors import DistorefsError, NoSpace
from .placement import DEMOTE_AT, TIER_LMDB, TIER_NVME, compaction_threshold, demotion_target
from .ring import Ring
from .values import ValueLayer

log = logging.getLogger(__name__)

MOVE_BYTES = 32 << 20  # values read and moved in one change (at most the memory plan's transfer share)
MOVE_ENTRIES = 512
ALWAYS_COMPACT_BELOW = 0.5


class RelocateEntries(Change):
    """Move the stored values of entries of one ring to NVMe (their ring's stream)."""

    exclusive = True

    def __init__(self, ring: Ring, moves: list[tuple[EntryMeta, bytes, int]]) -> None:
        """`moves`: each entry, its stored bytes to write and their codec."""
        self.ring = ring
        self.moves = moves
        self.new: list[EntryMeta] = []

    def plan(self, overlay: Overlay) -> None:
        self.moves = [move for move in self.moves if self.ring.by_seq.get(move[0].seq) is move[0]]

    def txn(self, txn) -> None:
        ring = self.ring
        self.new = []
        for meta, stored, codec_id in self.moves:
            k = entry_key(ring.ns_id, meta.seq)
            new = dataclasses.replace(meta, value=ring.values.relocate(txn, k, meta.value, stored, ring.ns_id,
                                                                       codec_id))
            txn.put(k, new.pack(), db=DB_ENTRIES)
            self.new.append(new)

    def apply(self) -> None:
        for (old, _, _), new in zip(self.moves, self.new):
            self.ring.apply_relocate(old, new)


class TierMover:
    """The background task that demotes and compacts (started by `Store.running`)."""

    def __init__(self, values: ValueLayer, committer: Committer, rings: Callable[[], list[Ring]],
                 transfer_bytes: Callable[[], int]) -> None:
        """`rings()`: the rings of the store now; `transfer_bytes()`: the memory plan's share
        for values on the move."""
        self.values = values
        self.config = values.config
        self.committer = committer
        self.rings = rings
        self.transfer_bytes = transfer_bytes
        self.counters = {"demoted_entries": 0, "demoted_bytes": 0, "compacted_segments": 0,
                         "compacted_entries": 0, "compacted_bytes": 0, "move_failures": 0, "rounds": 0,
                         "compressed_on_move": 0}
        self._wake = trio.Event()

    def value_added(self) -> None:
        """A commit put values in the hot tier: start demoting as soon as it nears its budget."""
        if self.values.lmdb.recent_live > DEMOTE_AT * self.config.lmdb_bytes:
            self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """A round each `sync_interval`, or sooner when woken, while commits come; none while
        nothing was committed since a round that finished: what either move looks at (the
        hot tier's live bytes, the segments' live records) changes only by a commit, and a
        round's look costs two hops to a worker thread, which an idle daemon paid each
        second."""
        task_status.started()
        looked_at = -1  # the commit groups counted when the last round began, if it finished
        while True:
            await self.committer.committed_after(looked_at)
            with trio.move_on_after(self.config.sync_interval):
                await self._wake.wait()
            self._wake = trio.Event()
            groups = self.committer.groups
            self.counters["rounds"] += 1
            try:
                await self.demote()
                await self.compact()
                looked_at = groups  # (a round's own moves are commits: the next round looks again)
            except NoSpace as exc:  # no room to move into: the next round tries again
                self.counters["move_failures"] += 1
                log.warning("moving values between tiers postponed: %s", exc)
            except DistorefsError as exc:
                self.counters["move_failures"] += 1
                log.warning("moving values between tiers failed: %s", exc)

    # ----- demotion -----------------------------------------------------------------

    async def demote(self) -> None:
        lmdb = self.values.lmdb
        while True:
            excess = demotion_target(self.config, await trio.to_thread.run_sync(lmdb.live_bytes))
            if excess <= 0:
                return
            rings = [r for r in self.rings() if r.tier_bytes[TIER_LMDB] > 0]
            if not rings:
                return  # what is over the budget is not ring values: placement holds the line
            ring = max(rings, key=lambda r: r.tier_bytes[TIER_LMDB])
            metas = self._oldest_hot(ring, min(excess, self._move_bytes()))
            if not metas:
                return
            moved = await self._move(ring, metas)
            self.counters["demoted_entries"] += len(moved)
            self.counters["demoted_bytes"] += sum(m.stored_size for m in moved)

    @staticmethod
    def _oldest_hot(ring: Ring, limit: int) -> list[EntryMeta]:
        """The oldest entries of `ring` still in LMDB, up to `limit` stored bytes; advances
        the ring's demotion front past them."""
        out: list[EntryMeta] = []
        total = 0
        for seq in ring.by_seq.irange(minimum=ring.demote_front):
            meta = ring.by_seq[seq]
            ring.demote_front = seq + 1
            if meta.tier != TIER_LMDB:
                continue
            out.append(meta)
            total += meta.stored_size
            if total >= limit or len(out) >= MOVE_ENTRIES:
                break
        return out

    # ----- compaction ---------------------------------------------------------------

    async def compact(self) -> None:
        nvme = self.values.nvme
        bound = self.config.max_space_overhead
        threshold = compaction_threshold(self.config)
        infos = await trio.to_thread.run_sync(nvme.segments)
        current = nvme.current_segments()
        candidates = sorted((i for i in infos if i.stream and i.seg not in current and i.live_records
                             and i.total_bytes and i.live_bytes < threshold * i.total_bytes),
                            key=lambda i: i.live_bytes / i.total_bytes)
        for info in candidates:
            if info.live_bytes >= ALWAYS_COMPACT_BELOW * info.total_bytes:
                usage = await trio.to_thread.run_sync(nvme.usage)
                if usage.used_bytes <= 0.9 * bound * max(1, usage.live_bytes):
                    return
            await self._compact_segment(info.seg)
            self.counters["compacted_segments"] += 1

    def _rings_by_id(self) -> dict[int, Ring]:
        return {r.ns_id: r for r in self.rings()}

    async def _compact_segment(self, seg: int) -> None:
        records = await trio.to_thread.run_sync(self.values.nvme.records, seg)
        rings = self._rings_by_id()
        by_ring: dict[int, list[EntryMeta]] = {}
        for vkey, loc in records:
            spooled = split_spool_vkey(vkey)  # a value a client wrote: named by its key
            if spooled is not None:
                ring = rings.get(spooled[0])
                meta = ring.by_key.get(spooled[1]) if ring is not None else None
            elif len(vkey) == 12:
                ns_id, seq = split_entry_key(vkey)
                ring = rings.get(ns_id)
                meta = ring.by_seq.get(seq) if ring is not None else None
            else:
                continue  # not a ring entry's value (ring streams hold nothing else)
            if ring is not None and meta is not None and meta.tier == TIER_NVME and meta.value.loc == loc:
                by_ring.setdefault(ring.ns_id, []).append(meta)
        for ns_id, metas in by_ring.items():
            ring = self._rings_by_id().get(ns_id)  # still there after the moves before
            start = 0
            batch: list[EntryMeta]
            while ring is not None and start < len(metas):
                batch, total = [], 0
                while start < len(metas) and total < self._move_bytes() and len(batch) < MOVE_ENTRIES:
                    batch.append(metas[start])
                    total += metas[start].stored_size
                    start += 1
                moved = await self._move(ring, batch)
                self.counters["compacted_entries"] += len(moved)
                self.counters["compacted_bytes"] += sum(m.stored_size for m in moved)

    # ----- the move -----------------------------------------------------------------

    def _move_bytes(self) -> int:
        return max(1 << 20, min(MOVE_BYTES, self.transfer_bytes()))

    async def _move(self, ring: Ring, metas: list[EntryMeta]) -> list[EntryMeta]:
        """Read the stored values of `metas` (worker thread) and move them in one change;
        values that vanished or fail to verify meanwhile are left where they are."""
        values = self.values

        def read() -> list[tuple[EntryMeta, bytes, int]]:
            out = []
            for meta in metas:
                try:
                    stored = values.read_stored(meta.value)
                except DistorefsError:
                    continue  # removed since (NotFound) or damaged (reads report it)
                if len(stored) == meta.stored_size:
                    out.append((meta, *_cold_form(ring, meta, stored)))
            return out

        moves = await trio.to_thread.run_sync(read)
        if not moves:
            return []
        change = RelocateEntries(ring, moves)
        await self.committer.submit(change)
        self.counters["compressed_on_move"] += sum(1 for m, _, c in change.moves if c != m.value.codec)
        return [m for m, _, _ in change.moves]

    def stats(self) -> dict:
        return dict(self.counters)


def _cold_form(ring: Ring, meta: EntryMeta, stored: bytes) -> tuple[bytes, int]:
    """What a moved value is stored as on NVMe, and its codec (worker thread): a value its
    ring stored as written in the hot tier is compressed as it is demoted (codec.encode,
    which keeps it raw when it does not compress), if its bytes are still what was
    checksummed; anything else moves as it is (a damaged value is left for reads to
    report; a raw value compacted on NVMe did not compress when it got there)."""
    cfg = ring.config
    if meta.tier != TIER_LMDB or meta.value.codec != codec.RAW or cfg.compression == "none":
        return stored, meta.value.codec
    enc = codec.encode(stored, cfg.compression, cfg.compression_level, stream=ring.compressibility)
    if enc.checksum != meta.value.checksum:
        return stored, meta.value.codec
    return bytes(enc.stored), enc.codec

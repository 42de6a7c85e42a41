"""Group commit: every mutation of the store passes through one queue, in order.

A `Change` is planned on the event loop (sequence numbers, evictions) against the
applied state plus the group's `Overlay`, written inside one LMDB write transaction in the
committer's own thread (distorefs/lane.py) together with the other changes queued at the
same moment, and applied to the in-memory state on the event loop only after that
transaction committed.

Invariants (what may happen between two awaits):
- Only the committer task applies changes, so planning a group sees every earlier
  group applied and nothing half-applied.
- A group never holds two changes with the same `conflict_key`; the second waits for
  the next group, so a change never plans against a value its group-mate is writing.
- An `exclusive` change (moving values between tiers) is a group of its own: it plans
  against state nothing else in its transaction touches.
- If a group's transaction fails, nothing of it is visible (the transaction aborted and
  nothing was applied); each change is then retried alone so one bad change (ENOSPC on
  a big value, say) fails by itself.
- A kill -9 at any point leaves either the whole transaction or none of it; values
  written to segment files by an aborted or lost transaction are unreferenced garbage.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import trio

from .errors import DistorefsError, from_backend
from .lane import Lane
from .waiting import Outcome

log = logging.getLogger(__name__)

MAX_GROUP = 512


@dataclass
class RingOverlay:
    """What the changes planned so far in a group do to one ring, before they are applied."""

    count: int = 0
    bytes: int = 0
    removed: set[int] = field(default_factory=set)
    inserts: int = 0  # inserts and rewrites planned so far
    # The ring's eviction candidates, shared by the group's plans (each continues where the
    # previous stopped instead of walking past the victims already chosen); closed once
    # the group is planned. A `close()`-able object (distorefs/removers.py Candidates).
    candidates: Any = None


class Replan(Exception):
    """Raised by `plan`: the change does not fit beside what the group planned before it;
    it is planned again, first, in the next group. Never raised by a group's first change,
    so every group makes progress."""


class Overlay:
    """The planned-but-not-applied effects of one commit group."""

    def __init__(self) -> None:
        self._rings: dict[int, RingOverlay] = {}

    def ring(self, ns_id: int) -> RingOverlay:
        ro = self._rings.get(ns_id)
        if ro is None:
            ro = self._rings[ns_id] = RingOverlay()
        return ro

    def close(self) -> None:
        """Planning is over: let go of what the plans held open."""
        for ro in self._rings.values():
            if ro.candidates is not None:
                ro.candidates.close()
                ro.candidates = None


class Change(ABC):
    """One mutation. Subclasses say what it writes and what it does in memory."""

    conflict_key: Hashable | None = None
    exclusive = False

    def plan(self, overlay: Overlay) -> None:
        """Decide the effects (on the event loop). May raise DistorefsError to fail alone."""

    def prepare(self) -> None:
        """CPU work before the transaction, in a worker thread: the committer's own, or the
        pool's in parallel across the group when the group's changes have
        PARALLEL_PREPARE_BYTES of it between them."""

    def prepare_bytes(self) -> int:
        """How many bytes `prepare` works through (compression); 0: it has nothing to do."""
        return 0 if type(self).prepare is Change.prepare else 1

    @abstractmethod
    def txn(self, txn: Any) -> None:
        """Write the change inside the group's LMDB transaction (worker thread; may rerun)."""

    def apply(self) -> None:
        """Make the committed change visible in memory (event loop)."""

    def failed(self) -> None:
        """Its transaction failed after it was planned, and nothing of it is applied: undo
        what planning marked in memory (event loop)."""


class _Pending(Outcome):
    __slots__ = ("change", "waited")

    def __init__(self, change: Change, waited: bool) -> None:
        super().__init__()
        self.change = change
        self.waited = waited


# A group's prepares spread over the pool's threads only when they compress this much
# between them (zstd lets go of the GIL: large values compress side by side). Below it, the
# pool's hand-offs (a future and two wake-ups a share) cost more than the work: 4 writers
# of 300-byte transitions spent more of the daemon's time in them than in compressing.
PARALLEL_PREPARE_BYTES = 256 << 10


def _prepare_all(changes: list[Change]) -> None:
    for change in changes:
        change.prepare()


class Committer:
    def __init__(self, write_txn) -> None:
        """`write_txn(fn)` runs fn(txn) in one write transaction of the engine (a `Txn`,
        backends/base.py), blocking."""
        self._write_txn = write_txn
        self._workers = max(2, os.cpu_count() or 2)
        self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="distorefs-prepare")
        self._lane = Lane("distorefs-commit")  # the groups' transactions, one at a time
        self._send, self._recv = trio.open_memory_channel[_Pending](math.inf)
        self._held: list[_Pending] = []
        self.groups = 0
        self.changes = 0
        self.failures = 0  # changes whose transaction failed (disk full, engine errors)
        self.rejected = 0  # changes refused when planned (no such entry, exists, not empty...)
        self._idle = trio.Event()
        self._idle.set()
        self._queued = 0
        self._started = 0  # groups taken from the queue
        self._finished = 0  # groups committed (or failed) and applied
        self._group_done = trio.Event()

    async def submit(self, change: Change) -> None:
        """Queue `change` and wait until it is committed and applied (or failed)."""
        pending = self._enqueue(change, waited=True)
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error

    async def submit_all(self, changes: Sequence[Change]) -> list[BaseException | None]:
        """Queue many changes at once (they share groups) and wait for all; their errors, in order."""
        pending = [self._enqueue(change, waited=True) for change in changes]
        for p in pending:
            await p.done.wait()
        return [p.error for p in pending]

    def enqueue(self, change: Change) -> "_Pending":
        """Queue `change` now and wait for it later (`await pending.wait()` raises its error)."""
        return self._enqueue(change, waited=True)

    def submit_nowait(self, change: Change) -> None:
        """Queue `change` without waiting; a failure is logged."""
        self._enqueue(change, waited=False)

    def _enqueue(self, change: Change, waited: bool) -> _Pending:
        pending = _Pending(change, waited)
        self._queued += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._send.send_nowait(pending)
        return pending

    async def drain(self) -> None:
        """Wait until the queue is empty (everything queued, now and meanwhile, committed)."""
        while self._queued:
            await self._idle.wait()

    async def settle(self) -> None:
        """Wait until the group being committed right now (if any) is applied in memory."""
        target = self._started
        while self._finished < target:
            await self._group_done.wait()

    async def committed_after(self, groups: int) -> None:
        """Wait until more than `groups` groups are committed (at once if they are): what a
        background task that looks only at committed state waits for while idle."""
        while self.groups <= groups:
            await self._group_done.wait()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            group = await self._next_group()
            self._started += 1
            replanned = await self._commit(group)
            self._finished += 1
            self._group_done.set()
            self._group_done = trio.Event()
            self._queued -= len(group) - len(replanned)
            self._held[:0] = replanned
            if self._queued == 0:
                self._idle.set()

    async def _next_group(self) -> list[_Pending]:
        if not self._held:
            self._held.append(await self._recv.receive())
        while len(self._held) < MAX_GROUP:
            try:
                self._held.append(self._recv.receive_nowait())
            except trio.WouldBlock:
                break
        group: list[_Pending] = []
        keys: set[Hashable] = set()
        rest: list[_Pending] = []
        for i, pending in enumerate(self._held):
            key = pending.change.conflict_key
            if rest or (key is not None and key in keys) or (group and pending.change.exclusive):
                rest.append(pending)  # keep submission order behind a conflict
                continue
            if pending.change.exclusive:  # first in line: a group of its own
                group.append(pending)
                rest.extend(self._held[i + 1:])
                break
            if key is not None:
                keys.add(key)
            group.append(pending)
        self._held = rest
        return group

    async def _commit(self, group: list[_Pending]) -> list[_Pending]:
        """Commit a group; returns the changes to plan again in the next one (Replan)."""
        overlay = Overlay()
        planned: list[_Pending] = []
        replanned: list[_Pending] = []
        for pending in group:
            try:
                pending.change.plan(overlay)
            except Replan:
                if not planned:  # a first change has nothing to wait for: a bug, not a retry
                    log.error("%r asked to be planned again as the first change of its group", pending.change)
                    self._finish(pending, DistorefsError("internal error: nothing to wait for"))
                else:
                    replanned.append(pending)
            except DistorefsError as exc:  # the request's answer (ENOENT, EEXIST...), not a failure
                self.rejected += 1
                self._finish(pending, exc, rejected=True)
            except Exception as exc:  # a bug must fail the request, never the daemon
                log.exception("planning %r failed", pending.change)
                self._finish(pending, DistorefsError(f"internal error: {exc}"))
            else:
                planned.append(pending)
        overlay.close()
        if not planned:
            return replanned

        def write(txn: Any) -> None:
            for pending in planned:
                pending.change.txn(txn)

        # Only changes that do work before the transaction (compression) are prepared; most
        # (priorities, removals, a follower's records) have none.
        sizes = [(p.change, p.change.prepare_bytes()) for p in planned]
        preparing = [change for change, size in sizes if size]
        spread = len(preparing) > 1 and sum(size for _, size in sizes) >= PARALLEL_PREPARE_BYTES

        def work() -> None:
            # One thread hop per group: prepare spreads over the pool when several changes
            # have enough between them, then the transaction runs here.
            if spread:  # one share per pool thread: a future per change costs more than a small one's work
                shares = min(len(preparing), self._workers)
                for future in [self._pool.submit(_prepare_all, preparing[i::shares]) for i in range(shares)]:
                    future.result()
            else:
                _prepare_all(preparing)
            self._write_txn(write)
            for pending in planned:  # committed: whoever asked is told now, not after the hop back
                try:
                    pending.tell()
                except Exception:  # a bug must fail the request, never the commit
                    log.exception("telling the commit of %r failed", pending.change)

        try:
            await self._lane.run(work)
        except Exception as raised:
            mapped = from_backend(raised)  # a full disk, say: ENOSPC
            if len(planned) > 1:
                for pending in planned:
                    await self._commit([pending])  # alone: never replanned
                return replanned
            error = mapped if isinstance(mapped, DistorefsError) else DistorefsError(f"commit failed: {mapped}")
            if not isinstance(mapped, DistorefsError):
                log.error("commit of %r failed", planned[0].change, exc_info=raised)
            try:
                planned[0].change.failed()
            except Exception:  # a bug must fail the request, never the daemon
                log.exception("undoing the plan of %r failed", planned[0].change)
            self._finish(planned[0], error)
            return replanned
        self.groups += 1
        for pending in planned:
            try:
                pending.change.apply()
            except Exception:  # committed already: log, never lose the daemon
                log.exception("applying %r failed", pending.change)
            self.changes += 1
            self._finish(pending, None)
        return replanned

    def _finish(self, pending: _Pending, error: BaseException | None, rejected: bool = False) -> None:
        if error is not None and not pending.waited:
            # a background change refused at planning lost a race (already removed, say)
            (log.debug if rejected else log.warning)("background change %r failed: %s", pending.change, error)
        if error is not None and not rejected:
            self.failures += 1
        pending.finish(error)

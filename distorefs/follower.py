"""Following a shared store's log (distorefs/clusterlog.py): every record, in order, applied
to this node's store, and the changes this node makes published through it.

- `Follower.run` reads the log from the position this node last applied (kept in the
  store's metadata, committed with the changes it covers, so a restart resumes exactly) and
  turns records into ordinary commits of the local store: an insert becomes an entry whose
  value is in the cluster tier; an eviction, a delete, priorities, a layout and namespace
  changes the same as on one node. Records that touch a key an earlier record of the same
  batch touched start a new commit batch, so every record is planned against the state its
  predecessors left.
- `Follower.publish` runs an append in a worker thread and returns once this node has
  applied it (read your writes), waiting at most `APPLY_WAIT_S`: past that the change is
  durable in the cluster and will be applied, so the caller is not failed (it is logged).
- After applying a batch, the follower lingers up to `LINGER_S` before reading again
  unless a caller on this node is waiting for the log (its own publish, a join, a reader
  in `.distorefs/wait`: `attending`): a read and a commit cost about a millisecond of the
  daemon's CPU whether they carry one record or hundreds, so a node that only follows (a
  learner's, say) applies other nodes' records in batches and spends a bounded share of
  its CPU on them however fast they come, at the price of seeing them up to `LINGER_S`
  later when nobody here waits for them.

Applying is idempotent: a record already applied (a replay after a crash between two
batches) finds its entry in place, or its victims gone, and changes nothing.

Snapshots and trimming (distorefs/logsnapshot.py): a node with an empty store loads the
snapshot it registered at, then follows from the snapshot's `at`; every REPORT_S the
follower reports how far it has applied (which lets the log be trimmed), and after
`snapshot_every` records it takes the state of the shared buffers and banks between two
batches and makes the next snapshot from it in the background.
"""

from __future__ import annotations

import itertools
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Iterator

import numpy as np
import trio

from .buffer import Buffer, FixLayout, SetPriorities
from .catalog import DB_META, EntryMeta
from .clusterlog import Record, SharedLog, id_tuple
from .committer import Change, Committer, Overlay
from .errors import AlreadyExists, DistorefsError, InvalidConfig, NotFound
from .layout import Layout
from .logsnapshot import REPORT_S, CapturedNamespace, LogSnapshots, SnapshotInfo, namespace_records, tree_records
from .ring import RemoveEntry, Ring, RingNamespace
from .values import StoredValue
from .waiting import Outcome

log = logging.getLogger(__name__)

APPLY_WAIT_S = 10.0
# 0.2 s, not 0.05: a learner's node beside 2 nodes inserting 145 entries/s kept 0.89-0.94
# of its rate with the others idle, against 0.87-0.90 (fewer reads, commits and hand-offs)
LINGER_S = 0.2
READ_COUNT = 512
READ_BLOCK_MS = 500
POSITION_KEY = b"cluster_pos"
LOADING_KEY = b"cluster_loading"  # set while a snapshot is loaded: a join cut short is refused


@dataclass
class Snapshotting:
    """What the follower needs for snapshots: where they are, the shared buffers and banks
    of this node (kind, namespace), how often to make one, how long a silent node holds the
    log back, and the snapshot to load first (an empty store joining) or None."""

    snapshots: LogSnapshots
    namespaces: Callable[[], Iterable[tuple[str, RingNamespace]]]
    every: int
    node_timeout_s: float
    load: SnapshotInfo | None = None


class PutMeta(Change):
    """A key of the store's metadata set (value) or deleted (None)."""

    def __init__(self, key: bytes, value: bytes | None) -> None:
        self.key, self.value = key, value

    def txn(self, txn) -> None:
        if self.value is None:
            txn.delete(self.key, db=DB_META)
        else:
            txn.put(self.key, self.value, db=DB_META)


def capture(kind: str, ns: RingNamespace) -> CapturedNamespace:
    """A shared buffer or bank as it stands, while the follower waits between two applied
    batches (nothing else changes it): what its snapshot records need, copied."""
    metas = list(ns.ring.oldest())
    entries = [(m.seq, m.key, m.value, m.places, m.mode, m.uid, m.gid, m.mtime_ns) for m in metas]
    prios = None
    if isinstance(ns, Buffer):
        slots = np.fromiter((m.slot for m in metas), dtype=np.int64, count=len(metas))
        prios = ns.sampler.priority[slots].copy()
    return CapturedNamespace(kind, ns.name, ns.config.to_dict(), ns.owner, ns.ctime_ns, entries, prios)


class ApplyInsert(Change):
    """A logged insert or rewrite: the entry with the record's seq and value, and the
    removal of the entries the insert evicted."""

    def __init__(self, ring: Ring, rec: Record) -> None:
        f = rec.fields
        self.ring = ring
        self.key = bytes(f[b"key"])
        self.seq = int(f[b"seq"])
        self.value = StoredValue.unpack_from(f[b"value"])[0]
        self.places = bytes(f[b"places"])
        self.owner, self.mtime_ns = rec.owner()
        self.priority = float(f[b"prio"]) if f.get(b"prio") else None
        self.evicted = rec.evicted()
        self.conflict_key = (ring.ns_id, self.key)

    def plan(self, overlay: Overlay) -> None:
        ring = self.ring
        ro = overlay.ring(ring.ns_id)
        old = ring.by_key.get(self.key)
        self.done = old is not None and old.seq == self.seq and old.value == self.value  # applied already
        self.victims = [m for seq, key in self.evicted
                        if (m := ring.by_key.get(key)) is not None and m.seq == seq and seq not in ro.removed]
        if old is not None and old.seq != self.seq and not self.done:
            self.victims.append(old)  # never the case when every record was applied in order
            old = None
        for v in self.victims:
            ro.removed.add(v.seq)
        self.old = old
        ring.next_seq = max(ring.next_seq, self.seq + 1)

    def txn(self, txn) -> None:
        ring = self.ring
        for victim in self.victims:
            ring.txn_remove(txn, victim)
        if self.done:
            return
        if self.old is not None and self.old.value != self.value:
            ring.values.delete(txn, self.old.value)
        self.meta = EntryMeta(self.seq, self.key, self.value, self.owner.mode, self.owner.uid, self.owner.gid,
                              self.mtime_ns, self.places)
        ring.txn_put(txn, self.meta, None if self.old is not None else self.priority)

    def apply(self) -> None:
        if self.done:
            for victim in self.victims:
                self.ring.apply_remove(victim, "evictions")
            return
        self.ring.apply_written(self.victims, self.old, self.meta, self.priority)
        self.ring.fetch_applied(self.meta)


class Follower:
    def __init__(self, shared: SharedLog, committer: Committer, position: bytes, origin: str,
                 namespace: Callable[[str, str], Any], catalog: Callable[[Record], list[Change]],
                 snapshotting: Snapshotting | None = None) -> None:
        """`position`: the id of the last record this store applied; `origin`: this node's
        id (its own records of file trees it applied already); `namespace(kind, name)` the local
        namespace or None; `catalog(record)` the local changes for a namespace's create,
        drop or configure record; `snapshotting`: see Snapshotting (None: no snapshots, the
        log is never trimmed)."""
        self.snapshotting = snapshotting
        self._since_snapshot = 0  # records applied since the last snapshot this node knows of
        self._snapshot_n = 0
        self._snapshot_records = 0
        self._snapshot_wanted = False
        self._making = False
        self._trimmed_past = False
        self.log = shared
        self.origin = origin
        # Apply another node's record of a file tree, by the tree's name (weights/:
        # distorefs/weightslog.py, ...); set by the store.
        self.trees: dict[str, Callable[[Record], Awaitable[None]]] = {}
        self.committer = committer
        self.applied = position
        self._namespace = namespace
        self._catalog = catalog
        self._advanced = trio.Event()
        self._waiters = 0  # callers waiting for a record to be applied: no lingering then
        self._wanted = trio.Event()  # set when one starts waiting
        self._nursery: trio.Nursery | None = None
        self.counters = {"records_applied": 0, "apply_batches": 0, "apply_errors": 0, "publish_waits_cut": 0,
                         "read_errors": 0, "snapshots_made": 0, "snapshot_records_loaded": 0, "report_errors": 0,
                         "log_length": 0}

    # ----- publishing ----------------------------------------------------------------------

    async def publish(self, append: Callable[..., bytes], *args: Any) -> bytes:
        """Append (in a worker thread) and wait until this node has applied the record."""
        rid = await trio.to_thread.run_sync(append, *args)
        await self.until(rid)
        return rid

    def publish_soon(self, append: Callable[..., bytes], *args: Any) -> Outcome:
        """`publish` in the background; the outcome is set once it is applied here."""
        out = Outcome()

        async def go() -> None:
            error: DistorefsError | None = None
            try:
                await self.publish(append, *args)
            except DistorefsError as exc:
                error = exc
            finally:
                out.finish(error)

        if self._nursery is None:
            out.finish(NotFound("the store's cluster log is not being followed (the store is not running)"))
        else:
            self._nursery.start_soon(go)
        return out

    async def until(self, rid: bytes) -> None:
        if not await self._applied(id_tuple(rid), APPLY_WAIT_S):
            self.counters["publish_waits_cut"] += 1
            log.warning("record %s is in the cluster's log but not applied here within %.0f s", rid.decode(),
                        APPLY_WAIT_S)

    async def catch_up(self, timeout: float) -> bool:
        """Wait until everything in the log now is applied here (a node joining, or coming
        back); False if `timeout` passed first."""
        head = await trio.to_thread.run_sync(self.log.head)
        return await self._applied(id_tuple(head), timeout)

    async def _applied(self, want: tuple[int, int], timeout: float) -> bool:
        """Wait until the record `want` is applied here (True), at most `timeout` seconds."""
        if id_tuple(self.applied) >= want:
            return True
        with self.attending():
            with trio.move_on_after(timeout):
                while id_tuple(self.applied) < want:
                    await self._advanced.wait()
                return True
            return False

    @contextmanager
    def attending(self) -> Iterator[None]:
        """While inside, somebody on this node waits for what the log brings: the follower
        reads at once instead of lingering."""
        self._waiters += 1
        self._wanted.set()  # a lingering follower reads now
        try:
            yield
        finally:
            self._waiters -= 1

    # ----- following -----------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            snap = self.snapshotting
            if snap is not None and snap.load is not None and snap.load.n:
                await self._load_snapshot(snap.load)
            task_status.started()
            if snap is not None:
                nursery.start_soon(self._report_loop, snap)
            await self._follow()

    async def _follow(self) -> None:
        while True:
            try:
                records = await trio.to_thread.run_sync(self.log.read, self.applied, READ_COUNT, READ_BLOCK_MS,
                                                        abandon_on_cancel=True)
            except Exception as exc:  # the daemon goes on serving what it has, and tries again
                self.counters["read_errors"] += 1
                log.warning("reading the cluster's log: %s", exc, exc_info=not isinstance(exc, DistorefsError))
                await trio.sleep(1.0)
                continue
            if records:
                await self._apply(records)
                if len(records) < READ_COUNT and not self._waiters:
                    with trio.move_on_after(LINGER_S):  # more records come meanwhile: one batch
                        await self._wanted.wait()
                self._wanted = trio.Event()
            if self._snapshot_wanted and not self._making:  # between two batches: the state is at `applied`
                await self._start_snapshot()

    async def _apply(self, records: list[Record], save: bool = True) -> None:
        """Apply `records` in order; `save`: they are the log's, and the position moves past
        them (a snapshot's records are not: the position is set once all are applied)."""
        batch: list[Record] = []
        touched: set = set()
        for rec in records:
            keys = self._touches(rec)
            if keys is None or touched & keys:
                await self._commit(batch, save)
                batch, touched = [], set()
            batch.append(rec)
            if keys is None:  # a namespace's create, drop or configure: alone
                await self._commit(batch, save)
                batch = []
            else:
                touched |= keys
        await self._commit(batch, save)

    @staticmethod
    def _touches(rec: Record) -> set | None:
        ns = (rec.kind, rec.name)
        if rec.op == "insert":
            return {(ns, bytes(rec.fields[b"key"]))} | {(ns, k) for _, k in rec.evicted()}
        if rec.op == "delete":
            return {(ns, bytes(rec.fields[b"key"]))}
        if rec.op == "priorities":
            return {(ns, k) for k, _ in rec.priorities()}
        if rec.op == "layout":
            return {(ns, None)}
        return None

    async def _commit(self, batch: list[Record], save: bool = True) -> None:
        if not batch:
            return
        changes: list[Change] = []
        for rec in batch:
            if rec.kind in self.trees:  # alone in its batch (see _touches)
                await self._apply_tree(rec)
                continue
            try:
                changes.extend(self._changes(rec))
            except DistorefsError as exc:
                self._failed(rec, exc)
        if save:
            changes.append(PutMeta(POSITION_KEY, batch[-1].id))
        errors = await self.committer.submit_all(changes) if changes else []
        for change, error in zip(changes, errors):
            if error is not None:
                self._failed(None, error, change)
        if not save:
            self.counters["snapshot_records_loaded"] += len(batch)
            return
        self.applied = batch[-1].id
        self._since_snapshot += len(batch)
        self.counters["records_applied"] += len(batch)
        self.counters["apply_batches"] += 1
        self._advanced.set()
        self._advanced = trio.Event()

    async def _apply_tree(self, rec: Record) -> None:
        if rec.fields.get(b"origin", b"").decode() == self.origin:
            return  # this node's own change: applied before it was logged
        try:
            await self.trees[rec.kind](rec)
        except DistorefsError as exc:
            self._failed(rec, exc)

    def _failed(self, rec: Record | None, exc: BaseException, change: Change | None = None) -> None:
        what = f"record {rec.id.decode()} ({rec.op} {rec.kind}/{rec.name})" if rec else type(change).__name__
        if isinstance(exc, (NotFound, AlreadyExists)):  # a replay, or a record of a namespace gone since
            log.debug("cluster log: %s: %s", what, exc)
            return
        self.counters["apply_errors"] += 1
        log.warning("cluster log: %s not applied: %s", what, exc)

    # ----- snapshots ------------------------------------------------------------------------

    async def _load_snapshot(self, info: SnapshotInfo) -> None:
        """An empty store joining: the snapshot's records, then the position at its `at`. A
        stop in between leaves LOADING_KEY set, and the store is refused at the next start."""
        snaps = self.snapshotting.snapshots  # type: ignore[union-attr]
        await self.committer.submit(PutMeta(LOADING_KEY, str(info.n).encode()))
        records = snaps.read(info.stream)
        while True:
            chunk = await trio.to_thread.run_sync(lambda: list(itertools.islice(records, READ_COUNT)))
            if not chunk:
                break
            await self._apply(chunk, save=False)
        if not await trio.to_thread.run_sync(snaps.exists, info.stream):
            raise InvalidConfig(f"snapshot {info.n} of the shared store was replaced while this node loaded it: "
                                f"start again with an empty STORE directory")
        await self.committer.submit_all([PutMeta(POSITION_KEY, info.at), PutMeta(LOADING_KEY, None)])
        self.applied = info.at
        self._snapshot_n = info.n
        log.info("loaded snapshot %d of the shared store (%d records, up to %s)", info.n,
                 self.counters["snapshot_records_loaded"], info.at.decode())

    async def _report_loop(self, snap: Snapshotting) -> None:
        """Every REPORT_S: tell the cluster how far this node has applied (so the log can be
        trimmed), learn of snapshots other nodes made, and ask for one when due."""
        every = min(REPORT_S, snap.node_timeout_s / 4)  # never silent for a node timeout while alive
        while True:
            await trio.sleep(every)
            try:
                rep = await trio.to_thread.run_sync(snap.snapshots.report, self.origin, self.applied,
                                                    snap.node_timeout_s, abandon_on_cancel=True)
            except Exception as exc:
                self.counters["report_errors"] += 1
                log.warning("reporting this node's position in the cluster's log: %s", exc)
                continue
            self.counters["log_length"] = rep.length
            if rep.n != self._snapshot_n:  # another node made one
                self._snapshot_n, self._snapshot_records, self._since_snapshot = rep.n, rep.records, 0
            if id_tuple(rep.trimmed) > id_tuple(self.applied) and not self._trimmed_past:
                self._trimmed_past = True
                log.error("the cluster's log was trimmed up to %s, past what this node applied (%s): it "
                          "was silent longer than the node timeout; remount it with an empty STORE directory",
                          rep.trimmed.decode(), self.applied.decode())
            if self._since_snapshot >= max(snap.every, self._snapshot_records):
                self._snapshot_wanted = True
                self._wanted.set()  # a lingering follower comes round at once

    async def _start_snapshot(self) -> None:
        """Take the shared buffers' and banks' state now (between two batches; in a worker
        thread, since it is proportional to the entries, while this task applies nothing
        and so nothing changes them) and make the snapshot from it in the background."""
        snap = self.snapshotting
        assert snap is not None and self._nursery is not None
        self._snapshot_wanted = False
        self._making = True
        at = self.applied
        shared = list(snap.namespaces())
        captured = await trio.to_thread.run_sync(lambda: [capture(kind, ns) for kind, ns in shared])
        self._since_snapshot = 0
        self._nursery.start_soon(self._make_snapshot, snap, at, captured)

    async def _make_snapshot(self, snap: Snapshotting, at: bytes, captured: list[CapturedNamespace]) -> None:
        snaps = snap.snapshots

        def work() -> tuple[int, int] | None:
            if not snaps.lease(self.origin):
                return None  # another node is making one
            try:
                info = snaps.info()
                if info.at and id_tuple(info.at) >= id_tuple(at):
                    return None
                before = snaps.read(info.stream) if info.stream else iter(())
                trees = tree_records(itertools.chain(before, snaps.read(snaps.log_key, info.at or b"-", at)))
                n = info.n + 1
                count = snaps.write(n, itertools.chain(
                    (f for ns in captured for f in namespace_records(ns)), trees))
                return (n, count) if snaps.install(n, at, self.origin, count, snap.node_timeout_s) else None
            finally:
                snaps.release(self.origin)

        try:
            made = await trio.to_thread.run_sync(work)
        except Exception as exc:  # tried again after as many records again
            log.warning("making a snapshot of the cluster's log: %s", exc,
                        exc_info=not isinstance(exc, DistorefsError))
            made = None
        finally:
            self._making = False
        if made is None:  # another node makes one, or this one failed: tried again after `every` records
            return
        self._snapshot_n, self._snapshot_records = made
        self.counters["snapshots_made"] += 1
        log.info("snapshot %d of the shared store made: %d records, up to %s", made[0], made[1], at.decode())

    def _changes(self, rec: Record) -> list[Change]:
        if rec.op in ("create", "drop", "configure"):
            return self._catalog(rec)
        ns = self._namespace(rec.kind, rec.name)
        if ns is None:
            raise NotFound(f"no {rec.kind}/{rec.name} here")
        ring: Ring = ns.ring
        if rec.op == "insert":
            return [ApplyInsert(ring, rec)]
        if rec.op == "delete":
            return [RemoveEntry(ring, bytes(rec.fields[b"key"]), int(rec.fields[b"seq"]), "deletes")]
        if rec.op == "priorities" and isinstance(ns, Buffer):
            pairs = [(m, v) for k, v in rec.priorities() if (m := ring.by_key.get(k)) is not None]
            return [SetPriorities(ns, [m for m, _ in pairs], [v for _, v in pairs])] if pairs else []
        if rec.op == "layout" and isinstance(ns, Buffer):
            d = json.loads(rec.fields[b"data"])
            return [FixLayout(ns, None if d is None else Layout.from_json(d))]
        log.warning("cluster log: record %s of unknown op %r left alone", rec.id.decode(), rec.op)
        return []

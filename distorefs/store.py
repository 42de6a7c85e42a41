"""The store: opens a store directory, wires its tiers, and holds its namespaces.

A store directory holds `meta/` (the LMDB environment: catalog and small values),
`segments/` (NVMe segment files, unless `nvme_dir` points elsewhere), `lock` (who has it
open; empty after a clean close) and `daemon.log`. Only one process opens a store at a
time (flock on `lock`, distorefs/lockfile.py). A store its last holder did not close
cleanly is recovered before it is opened (distorefs/recovery.py), or not opened.

Durability: a commit reaches the OS at once (a kill -9 loses nothing committed) and the
disk within `sync_interval` seconds; `sync()` (fsync) makes everything committed durable
now. Segment files are synced before the LMDB environment so a durable catalog never
points at non-durable data.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import uuid
import weakref
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, cast

import trio

from . import __version__
from .backends.errors import BackendError
from .backends.lmdbenv import LmdbEnv
from .backends.segments import SegmentDir
from .bank import Bank
from .buffer import Buffer
from .catalog import DB_ENTRIES, DB_META, DB_NS, DB_PRIO, DB_SAMPLED, FORMAT_VERSION, EntryMeta, pack_u32, unpack_u32
from .checkpoints import DB_CKPT, Checkpoints
from .checkpointslog import CheckpointsLog
from .backends.redisengine import ClusterEngine, ClusterValues
from .clientsession import ClientSession, DatasetSession, LocatedBlocks
from .clusterlog import SHARED_KINDS, ClusterSpec, Record, SharedLog, id_tuple
from .committer import Change, Committer, Overlay
from .config import BufferConfig, NvmeDir, RingConfig, StoreConfig, WeightsConfig
from .dataset import DB_DSNODES, Dataset
from .datasetslog import DatasetsLog
from .follower import LOADING_KEY, POSITION_KEY, Follower, Snapshotting
from .logsnapshot import LogSnapshots
from .errors import AlreadyExists, DistorefsError, InvalidConfig, NoSpace, NotEmpty, NotFound, ReadOnly, from_backend
from .lockfile import take_lock
from .memory import MemoryPlan
from .migrate import migrate, stored_format
from .names import check_namespace_name, parse_priorities
from .namespace import ConfigureNamespace, SetNamespaceOwner, ns_key
from .owner import Owner
from .prefetcher import PrefetchBudget, hit_rate
from .priojournal import DB_PRIOLOG, DB_PRIOSNAP
from .priowal import NoteApplied, PriorityWal, applied_number
from .waiting import Outcome
from .recovery import Recovery, recover
from .ring import RemoveEntry, Ring, RingNamespace
from .services import Services
from .tiering import TierMover
from .values import ValueLayer
from .weights import DB_WNODES, WeightsTree
from .weightslog import WeightsLog

log = logging.getLogger(__name__)

EntryListener = Callable[[Ring, EntryMeta, "EntryMeta | None"], None]
Namespace = Buffer | Bank | Dataset
KINDS: dict[str, type[Namespace]] = {"buffers": Buffer, "banks": Bank, "datasets": Dataset}
CATCH_UP_S = 120.0  # a node joining a shared store applies its log this long before serving
CATALOG_DBS = (DB_META, DB_NS, DB_ENTRIES, DB_PRIO, DB_SAMPLED, DB_PRIOLOG, DB_PRIOSNAP, DB_WNODES, DB_DSNODES,
               DB_CKPT)


class Store:
    def __init__(self, path: str | os.PathLike, *, nvme_dirs: list | None = None,
                 config: dict | None = None, read_only: bool = False, cluster: ClusterSpec | None = None) -> None:
        """Open (creating if missing) the store at `path`. `config` overrides stored settings.

        Raises StoreLocked if another process has it open, and RecoveryFailed if it was not
        closed cleanly and recovery left inconsistencies (see distorefs/recovery.py).

        `read_only`: open an existing store without changing anything in it, not even by
        recovery (a store that was not closed cleanly, or is damaged, serves what can be
        read; writes fail with EROFS, sampling keeps no times-sampled counts, nothing runs
        in the background), and leave its lock as it was found.

        `cluster`: join the shared store it names on a Redis Cluster: buffers/ and banks/ are
        the cluster's, followed through its log (distorefs/follower.py); weights/,
        sealed datasets and complete checkpoint steps are shared through it as file trees
        (distorefs/weightslog.py, datasetslog.py, checkpointslog.py); the rest stays on this node."""
        self.path = Path(path).resolve()
        if cluster is not None and read_only:
            raise InvalidConfig("a read-only mount cannot follow a cluster's log: mount it read-write")
        self.cluster = cluster
        self.read_only = read_only
        if read_only:
            if not (self.path / "meta" / "data.mdb").is_file():
                raise NotFound(f"{self.path} holds no store to open read-only")
        else:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)
        self._lock = take_lock(self.path, "read-only" if read_only else "")
        try:
            if read_only:
                self.recovery: Recovery = Recovery(previous_holder=self._lock.previous)
                if not self._lock.was_clean:
                    log.warning("store %s was not closed cleanly (%s): opened read-only without recovery, "
                                "serving what can be read", self.path, self._lock.previous)
            else:
                # Before our own LmdbEnv: recovery's check opens and closes one of its own.
                self.recovery = recover(self.path, self._lock)
            self._open(nvme_dirs, config)
        except BaseException:
            # Left as found: a store that needed recovery still does (nothing was opened,
            # or what _open wrote was whole transactions on a consistent store).
            self._lock.restore()
            raise

    def _open(self, nvme_dirs: list | None, overrides: dict | None) -> None:
        try:
            self.env = LmdbEnv(self.path / "meta", readonly=self.read_only)
            self.env.db(DB_META)
            if self.read_only:  # (before the other dbs: one a newer format added is not there yet)
                fmt = stored_format(self.env)
                if fmt is not None and fmt != FORMAT_VERSION:
                    raise ReadOnly(f"the store has format {fmt}: a read-write mount upgrades it to {FORMAT_VERSION} "
                                   f"before it can be served")
            for name in CATALOG_DBS:
                self.env.db(name)  # opening a db writes: do it once, before any transaction
        except BackendError as exc:  # a data file LMDB could not map safely: DamagedStore
            raise from_backend(exc) from None
        stored = self.env.read(lambda txn: _copy(txn.get(b"config", db=DB_META)))
        base = StoreConfig.from_json(stored) if stored else StoreConfig()
        overrides = dict(overrides or {})
        if nvme_dirs or "nvme_dirs" in overrides:
            given = StoreConfig.from_dict({"nvme_dirs": list(nvme_dirs or []) + list(overrides.pop("nvme_dirs", []))})
            overrides["nvme_dirs"] = self._merge_dirs(base.nvme_dirs, given.nvme_dirs)
        self.config = StoreConfig.from_dict(overrides, base) if overrides else base
        if not self.read_only:
            self.env.write(self._init_meta)
        # Every directory must exist, one the store has used as well as one named now: a drive
        # that is not mounted (or a typo in fstab) would otherwise be stood in for by a new,
        # empty directory on the root disk.
        gone = [d.path for d in self.config.nvme_dirs if not Path(d.path).is_dir()]
        if gone:
            raise InvalidConfig(f"NVMe director{'ies' if len(gone) > 1 else 'y'} {', '.join(gone)} "
                                f"{'do' if len(gone) > 1 else 'does'} not exist (a drive not mounted, or a typo?): "
                                f"create {'them' if len(gone) > 1 else 'it'} first")
        dirs = [SegmentDir(Path(d.path), d.capacity_bytes) for d in self.config.nvme_dirs] \
            or [SegmentDir(self.path / "segments")]
        self.nvme_path = dirs[0].path
        try:
            self.values = ValueLayer(self.env, self.config, dirs, create_dirs=not self.read_only)
        except BackendError as exc:
            raise from_backend(exc) from None
        if not self.read_only:
            migrate(self.env, self.values)  # a store of an older format, once
        self.prefetch_budget = PrefetchBudget(0)
        # per sealed dataset, the client's location tables, shared by its sessions (a
        # dataset dropped takes its entry with it)
        self._located: weakref.WeakKeyDictionary[Dataset, LocatedBlocks] = weakref.WeakKeyDictionary()
        self.committer = Committer(self.env.write)
        # priority writes the mount's front acknowledged (distorefs/priowal.py); replayed in running()
        self.priority_wal = None if self.read_only else PriorityWal(self.path, self.env.read(applied_number))
        self.follower = self._join(self.cluster) if self.cluster is not None else None
        self.namespaces: dict[str, dict[str, Namespace]] = {kind: {} for kind in KINDS}
        self.datasets: dict[str, Dataset] = self.namespaces["datasets"]  # type: ignore[assignment]
        self.datasets_log: DatasetsLog | None = None
        if self.follower is not None:  # a dataset is shared once sealed (distorefs/datasetslog.py)
            self.datasets_log = DatasetsLog(self.shared_log, self.committer, self.values, self.follower.origin,
                                            self.datasets, self._make_dataset)
            self.follower.trees["datasets"] = self.datasets_log.apply
        self.services = Services(values=self.values, committer=self.committer, env=self.env, config=self.config,
                                 prefetch_budget=self.prefetch_budget, spool_dir=self.path / "spool",
                                 spawn=self.spawn, sync=self.sync, collect=self.collect,
                                 entry_changed=self._entry_changed, hot_value_added=self._hot_value_added,
                                 memory_changed=cast(Callable[[], None], self.apply_memory_plan),  # plan unused there
                                 read_only=self.read_only,
                                 follower=self.follower,
                                 share_sealed=self.datasets_log.export if self.datasets_log is not None else None)
        if not self.read_only:
            self._clear_spool()
        self.mover = TierMover(self.values, self.committer, self.rings, lambda: self.memory.transfer)
        self.buffers: dict[str, Buffer] = self.namespaces["buffers"]  # type: ignore[assignment]
        self.banks: dict[str, Bank] = self.namespaces["banks"]  # type: ignore[assignment]
        self.listeners: list[EntryListener] = []
        self.counters = {"syncs": 0, "stale_readers_cleared": 0}
        self.started = time.time()
        self._nursery: trio.Nursery | None = None
        self._synced_groups = 0
        stored = self.env.read(lambda txn: _copy(txn.get(b"weights", db=DB_META)))
        self.weights = WeightsTree(self.services, WeightsConfig.from_json(stored) if stored else WeightsConfig())
        if self.follower is not None:  # weights/ is shared: changes announced, others' applied
            shared_tree = WeightsLog(self.weights, self.shared_log, self.committer, self.follower.origin)
            self.weights.announce = shared_tree.announce
            self.weights.attending = self.follower.attending
            self.follower.trees["weights"] = shared_tree.apply
        self.checkpoints = Checkpoints(self.services)
        self.checkpoints.after_crash = self.recovery.ran  # steps cut short go back to their restore points
        self.env.read(self._load_namespaces)
        if self.follower is not None:  # checkpoints/ is shared: complete steps exported, others' applied
            shared_steps = CheckpointsLog(self.checkpoints, self.shared_log, self.committer, self.values,
                                          self.follower.origin, self.spawn)
            self.env.read(shared_steps.load)
            self.checkpoints.sharing = shared_steps
            self.follower.trees["checkpoints"] = shared_steps.apply
        self.apply_memory_plan()

    def _join(self, spec: ClusterSpec) -> Follower:
        """Connect to the cluster, check this store may follow the shared store `spec` names
        (an empty store, or one that followed that same shared store before), and make the
        follower that applies its log from where this store left off."""
        try:
            engine = ClusterEngine(spec.url)
            shared = SharedLog(engine, spec.store)
            identity = shared.identity().decode()
        except BackendError as exc:
            raise from_backend(exc) from None
        self.values.attach_cluster(ClusterValues(engine, f"distorefs:{spec.store}"))

        def check(txn) -> tuple[bytes, str]:
            stored = _copy(txn.get(b"cluster", db=DB_META))
            if stored is not None:
                joined = json.loads(stored)
                if joined["id"] != identity:
                    raise InvalidConfig(f"this store followed shared store {joined['store']!r} (id {joined['id']}), "
                                        f"not {spec.store!r} (id {identity}) of {spec.url}: use another STORE "
                                        f"directory for it")
            else:
                local = [bytes(k).decode() for k, _ in txn.cursor(DB_NS)
                         if bytes(k).decode().partition("/")[0] in SHARED_KINDS]
                if local:
                    raise InvalidConfig(f"this store holds node-local {', '.join(local[:3])}: a node joins a "
                                        f"shared store with an empty STORE directory (or one that followed it)")
                txn.put(b"cluster", json.dumps({"store": spec.store, "id": identity, "url": spec.url,
                                                "node": uuid.uuid4().hex}).encode(), db=DB_META)
            if txn.get(LOADING_KEY, db=DB_META) is not None:
                raise InvalidConfig(f"this store stopped while it loaded a snapshot of shared store {spec.store!r}: "
                                    f"join it again with an empty STORE directory")
            node = json.loads(bytes(txn.get(b"cluster", db=DB_META)))["node"]
            return _copy(txn.get(POSITION_KEY, db=DB_META)) or b"0-0", node

        position, node = self.env.write(check)
        snapshots = LogSnapshots(shared)
        empty = position == b"0-0"  # nothing applied (a record applied moves it, in the same commit)
        try:  # registered in the cluster before anything is read, so no trim passes this node
            snapshot, _ = snapshots.register(node, None if empty else position)
        except BackendError as exc:
            raise from_backend(exc) from None
        if not empty and id_tuple(position) < id_tuple(snapshot.trimmed):
            raise InvalidConfig(f"this store applied shared store {spec.store!r}'s log up to {position.decode()}, "
                                f"but the log was trimmed up to {snapshot.trimmed.decode()} since (this node was "
                                f"away longer than the node timeout): join it again with an empty STORE directory")
        self.engine = engine
        self.shared_log = shared
        snapshotting = Snapshotting(snapshots, self._shared_namespaces, spec.snapshot_every, spec.node_timeout_s,
                                    load=snapshot if empty else None)
        return Follower(shared, self.committer, position, node, self._shared_namespace, self._catalog_changes,
                        snapshotting)

    def _make_dataset(self, ds_id: int, name: str, config, owner: Owner, ctime_ns: int, record: dict) -> Dataset:
        return Dataset(self.services, ds_id, name, config, owner, ctime_ns, record=record)

    def _shared_namespace(self, kind: str, name: str) -> Namespace | None:
        return self.namespaces[kind].get(name) if kind in SHARED_KINDS else None

    def _shared_namespaces(self) -> list[tuple[str, RingNamespace]]:
        return [(kind, ns) for kind in SHARED_KINDS for ns in self.namespaces[kind].values()]  # type: ignore[misc]

    def _catalog_changes(self, rec: Record) -> list[Change]:
        """The local changes of a namespace's create, drop or configure record."""
        if rec.kind not in SHARED_KINDS:
            return []
        cls = KINDS[rec.kind]
        if rec.op == "create":
            owner = Owner(int(rec.fields[b"mode"]), int(rec.fields[b"uid"]), int(rec.fields[b"gid"]))
            config = cls.config_type.from_dict(json.loads(rec.fields[b"config"]))
            return [CreateNamespace(self, rec.kind, rec.name, owner, config)]
        ns = self.namespaces[rec.kind].get(rec.name)
        if ns is None:
            raise NotFound(f"no {rec.kind}/{rec.name} here")
        if rec.op == "drop":
            return [DropNamespace(self, ns)]
        config = cls.config_type.from_dict(json.loads(rec.fields[b"config"]))
        assert not isinstance(ns, Dataset)  # a shared kind: buffers or banks
        changes: list[Change] = [ConfigureNamespace(ns, config)]
        return changes + [RemoveEntry(ns.ring, key, seq, "evictions") for seq, key in rec.evicted()]

    def _clear_spool(self) -> None:
        """Spool files are scratch of writers (drafts, a seal's index) that never finished:
        none is needed once the store is open again."""
        spool = self.services.spool_dir
        if spool.exists():
            for stale in spool.iterdir():
                stale.unlink(missing_ok=True)
        spool.mkdir(mode=0o700, exist_ok=True)

    def _merge_dirs(self, stored: list[NvmeDir], given: list[NvmeDir]) -> list[NvmeDir]:
        """The NVMe directories after a mount names some: the stored ones (a directory that
        holds segments cannot be dropped) with the given ones added or their capacity set."""
        dirs = {d.path: d for d in stored}
        default = self.path / "segments"
        if not dirs and default.is_dir() and any(default.glob("seg-*.dat")):
            dirs[str(default)] = NvmeDir(str(default))  # in use before any directory was named
        for d in given:
            path = str(Path(d.path).resolve())
            dirs[path] = NvmeDir(path, d.capacity_bytes)
        return list(dirs.values())

    def apply_memory_plan(self) -> MemoryPlan:
        """Share memory_bytes out (store config and checkpoints' writeback_bytes) and size
        the memory tier, the read-ahead budget and the write-back budget to it."""
        plan = MemoryPlan.of(self.config, self.checkpoints.config.writeback_bytes)
        self.memory = plan
        self.values.cache.resize(plan.cache)
        self.prefetch_budget.capacity = plan.prefetch
        self.checkpoints.budget.resize(plan.writeback)
        return plan

    def client_session(self, buffer: Buffer, owner: Owner, abandoned=None) -> ClientSession:
        """A session of the client beside the mount with `buffer` (distorefs/clientsession.py)."""
        return ClientSession(buffer, self.values, self.env.path, owner, abandoned=abandoned,
                             read_only=self.read_only)

    def dataset_session(self, dataset: Dataset, lineage: frozenset[int] = frozenset()) -> DatasetSession:
        """A session of the client beside the mount with a sealed dataset (MountedDataset),
        opened by the last process of `lineage` (it and its ancestors)."""
        located = self._located.get(dataset)
        if located is None:
            located = self._located[dataset] = LocatedBlocks()
        return DatasetSession(dataset, self.values, self.env.path, lineage, read_only=self.read_only, located=located)

    def rings(self) -> list[Ring]:
        return [ns.ring for kind in (self.buffers, self.banks) for ns in kind.values()]

    def _entry_changed(self, ring: Ring, old: EntryMeta, new: EntryMeta | None) -> None:
        for listener in self.listeners:
            try:
                listener(ring, old, new)
            except Exception:
                log.exception("entry listener failed")

    def _hot_value_added(self) -> None:
        self.mover.value_added()

    def _init_meta(self, txn) -> None:
        txn.put(b"config", self.config.to_json(), db=DB_META)
        if txn.get(b"format", db=DB_META) is None:
            txn.put(b"format", pack_u32(FORMAT_VERSION), db=DB_META)
            txn.put(b"next_ns", pack_u32(1), db=DB_META)

    def _load_namespaces(self, txn) -> None:
        self.weights.load(txn)
        self.checkpoints.load(txn)
        for k, v in txn.cursor(DB_NS):
            kind, _, name = bytes(k).decode().partition("/")
            record = json.loads(bytes(v))
            cls = KINDS.get(kind)
            if cls is None:
                log.error("namespace %s/%s of unknown kind: left alone", kind, name)
                continue
            config: Any = cls.config_type.from_dict(record["config"])  # of the kind's own type, as cls takes
            args = (self.services, record["id"], name, config,
                    Owner(record["mode"], record["uid"], record["gid"]), record["ctime_ns"])
            ns: Namespace
            if issubclass(cls, Dataset):
                ns = Dataset(*args, record=record)
                ns.load(txn)
            else:
                ns = cls(*args)
                ns.ring.load(txn)
            self.namespaces[kind][name] = ns

    # ----- running -------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator["Store"]:
        """Run the store's background tasks (committer, periodic sync, pre-sampling)."""
        if self.read_only:
            async with self._running_read_only():
                yield self
            return
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.committer.run)
            if self.follower is not None:
                await nursery.start(self.follower.run)
                if not await self.follower.catch_up(CATCH_UP_S):
                    log.warning("the cluster's log is not applied up to its head after %.0f s: serving, and "
                                "catching up meanwhile", CATCH_UP_S)
                if self.datasets_log is not None:
                    for ds in self.datasets_log.unshared():
                        nursery.start_soon(self._share_dataset, ds)
            await self._replay_priority_wal()
            nursery.start_soon(self._sync_loop)
            await nursery.start(self.checkpoints.run)
            await nursery.start(self.mover.run)
            for buf in self.buffers.values():
                buf.remove_spent(buf.spent_at_load())
            self.weights.collect_detached()
            try:
                yield self
            finally:
                with trio.CancelScope(shield=True):
                    await self.checkpoints.drain()  # what checkpoint writers handed over
                    for buf in self.buffers.values():
                        buf.flush_sampled()  # times-sampled counts written behind
                    await self.committer.drain()
                    await self.sync()
                nursery.cancel_scope.cancel()
                self._nursery = None

    @asynccontextmanager
    async def _running_read_only(self) -> AsyncIterator[None]:
        """Read-only: no background work (no tier moves, persisting, syncs or removals); the
        committer runs so that a change anyone asks for fails with EROFS at once."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.committer.run)
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()
                self._nursery = None

    def commit_priority_record(self, ns_id: int, number: int, text: bytes) -> Outcome:
        """Queue the commit of record `number` of the priority write-ahead file
        (distorefs/priowal.py): its lines into buffer ns_id's journal. A buffer dropped since,
        or lines that do not parse (the front checked them), note the number alone."""
        pending = None
        buf = next((b for b in self.buffers.values() if b.ns_id == ns_id), None)
        if buf is not None and buf.ring.shared is None:
            try:
                pending, _ = buf.queue_priorities(parse_priorities(text), wal_number=number)
            except DistorefsError as exc:
                log.warning("priorities write %d of buffers/%s: %s (not applied)", number, buf.name, exc)
        if pending is None:
            pending = self.committer.enqueue(NoteApplied(number))
        pending.then(functools.partial(self._priority_record_committed, number))
        return pending

    def _priority_record_committed(self, number: int, err: int) -> None:
        # (the committer's thread, in commit order)
        wal = self.priority_wal
        if wal is not None and not err:
            wal.committed(number)
            if wal.on_committed is not None:
                wal.on_committed(number)

    async def _replay_priority_wal(self) -> None:
        """Commit the priority writes a daemon acknowledged and did not commit (killed, or
        power lost, before it did; or an unmount that left some to the next mount)."""
        wal = self.priority_wal
        if wal is None or not wal.pending:
            return
        outcomes = [self.commit_priority_record(r.ns_id, r.number, r.text) for r in wal.pending]
        failed = 0
        for outcome in outcomes:
            try:
                await outcome.wait()
            except DistorefsError:
                failed += 1
        wal.replayed = len(outcomes) - failed
        log.warning("committed %d priorities write(s) acknowledged by the last daemon and not committed by it%s",
                    wal.replayed, f" ({failed} failed, kept for the next mount)" if failed else "")
        if not failed:
            wal.trim()

    def spawn(self, fn, *args) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _sync_loop(self) -> None:
        """A sync and collection `sync_interval` after a commit not synced yet (an idle store
        waits for the commit, not for a timer)."""
        while True:
            await self.committer.committed_after(self._synced_groups)
            await trio.sleep(self.config.sync_interval)
            try:
                await self.collect()
            except NoSpace as exc:  # freeing needs a transaction too: try again next round
                log.warning("segment collection postponed: %s", exc)

    async def collect(self) -> dict[str, int]:
        """Sync, then unlink segment files whose every value was evicted or deleted (the sync
        loop does this each `sync_interval` after commits; `distorefs gc` asks for it now)."""
        await self.sync()
        freed = await trio.to_thread.run_sync(self.values.collect)
        return {"segment_bytes_freed": freed,
                "nvme_used_bytes": (await trio.to_thread.run_sync(self.values.nvme.usage)).used_bytes}

    async def sync(self) -> None:
        """Make everything committed so far durable (fsync)."""
        if self.read_only:
            return
        await self.committer.drain()
        groups = self.committer.groups
        await trio.to_thread.run_sync(self.sync_blocking)
        self._synced_groups = groups

    def sync_blocking(self) -> None:
        if self.priority_wal is not None:
            self.priority_wal.sync()
        self.values.sync()
        self.counters["syncs"] += 1
        # Reader slots of client processes (distorefs.client) killed inside a read: freed
        # here, or LMDB could never reuse the pages they pinned.
        self.counters["stale_readers_cleared"] += self.env.clear_stale_readers()

    def close(self) -> None:
        """Close after `running()` has exited (or if it never ran). Only a close whose sync
        succeeded marks the store clean; after a failure it is recovered at the next open.
        Read-only, the lock is left as it was found (an unclean store is still recovered by
        the next read-write open)."""
        if self.read_only:
            try:
                self.values.close()
                self.env.close()
            finally:
                self._lock.restore()
            return
        try:
            self.sync_blocking()
            if self.priority_wal is not None:
                self.priority_wal.close()
            self.values.close()
            self.env.close()
        except BaseException:
            self._lock.keep_unclean(f"pid {os.getpid()}: close failed")
            raise
        self._lock.release()

    async def _share_dataset(self, ds: Dataset) -> None:
        """Export a sealed dataset the cluster has not had yet (in the background)."""
        assert self.datasets_log is not None
        try:
            await self.datasets_log.export(ds)
        except DistorefsError as exc:
            log.error("datasets/%s is not shared with the other nodes: %s (tried again at the next start)",
                      ds.name, exc)

    # ----- namespaces ----------------------------------------------------------------

    async def create(self, kind: str, name: str, owner: Owner, config=None) -> Namespace:
        """Create namespace `kind`/`name` (buffers or banks) with `config` or the defaults."""
        check_namespace_name(name)
        cls = KINDS[kind]
        if config is None:
            config = self.config.default_buffer if kind == "buffers" else cls.config_type()
        if self.follower is not None and kind in SHARED_KINDS:
            if config.evict != "fifo":
                raise InvalidConfig(f"a shared {kind[:-1]} evicts in global FIFO order: evict must be fifo")
            await self.follower.publish(self.follower.log.create, kind, name, config.to_dict(), owner,
                                        time.time_ns())
            return self.namespace(kind, name)
        await self.committer.submit(CreateNamespace(self, kind, name, owner, config))
        return self.namespaces[kind][name]

    async def drop(self, kind: str, name: str) -> None:
        """Remove an empty namespace (NotEmpty while it has entries)."""
        if self.follower is not None and kind in SHARED_KINDS:
            self.namespace(kind, name)
            await self.follower.publish(self.follower.log.drop, kind, name)
            return
        await self.committer.submit(DropNamespace(self, self.namespace(kind, name)))

    def namespace(self, kind: str, name: str) -> Namespace:
        ns = self.namespaces[kind].get(name)
        if ns is None:
            raise NotFound(f"no {kind}/{name}")
        return ns

    async def configure(self, kind: str, name: str, text: bytes):
        """Merge a JSON config into the namespace's; an invalid one raises InvalidConfig, old kept."""
        ns = self.namespace(kind, name)
        config = ns.config_type.from_json(text, cast(Any, ns.config))  # ns.config is of ns.config_type
        if self.follower is not None and kind in SHARED_KINDS:
            assert isinstance(config, RingConfig)  # buffers or banks
            if config.evict != "fifo":
                raise InvalidConfig(f"a shared {kind[:-1]} evicts in global FIFO order: evict must be fifo")
            check = getattr(ns, "check_reconfigure", None)
            if check is not None:
                check(config)
            await self.follower.publish(self.follower.log.configure, kind, name, config.to_dict())
            return config
        await self.committer.submit(ConfigureNamespace(ns, config))
        return config

    async def configure_weights(self, text: bytes) -> WeightsConfig:
        config = WeightsConfig.from_json(text, self.weights.config)
        await self.committer.submit(ConfigureWeights(self, config))
        return config

    async def set_owner(self, kind: str, name: str, mode: int | None = None, uid: int | None = None,
                        gid: int | None = None) -> Owner:
        """chmod/chown of a namespace directory (permission bits of `mode`), persisted."""
        ns = self.namespace(kind, name)
        o = ns.owner
        owner = Owner(o.mode if mode is None else (o.mode & ~0o7777) | (mode & 0o7777),
                      o.uid if uid is None else uid, o.gid if gid is None else gid)
        await self.committer.submit(SetNamespaceOwner(ns, owner))
        return owner

    # Shorthands for the replay buffers most callers deal with.
    async def create_buffer(self, name: str, owner: Owner, config: BufferConfig | None = None) -> Buffer:
        return await self.create("buffers", name, owner, config)  # type: ignore[return-value]

    async def drop_buffer(self, name: str) -> None:
        await self.drop("buffers", name)

    def buffer(self, name: str) -> Buffer:
        return self.namespace("buffers", name)  # type: ignore[return-value]

    async def configure_buffer(self, name: str, text: bytes) -> BufferConfig:
        return await self.configure("buffers", name, text)

    # ----- reporting -----------------------------------------------------------------

    def statfs(self) -> dict[str, int]:
        """For df: bytes the store's files take, and the room left for data: in the NVMe
        directories (within their capacities), plus what the hot tier may still take of
        `lmdb_bytes` when it is on another file system than they are."""
        nvme = self.values.nvme.usage()
        lmdb = self.values.lmdb.usage()
        room = nvme.capacity_bytes - nvme.used_bytes
        if os.stat(self.path).st_dev not in self.values.nvme.shared_devices():
            st = os.statvfs(self.path)
            room += min(st.f_bavail * st.f_frsize, max(0, self.config.lmdb_bytes - lmdb.live_bytes))
        used = nvme.used_bytes + lmdb.used_bytes
        return {"total": used + room, "free": room, "used": used,
                "files": sum(len(ns.ring) for kind in (self.buffers, self.banks) for ns in kind.values())
                + sum(ds.counters.items for ds in self.datasets.values())}

    def memory_held(self) -> int:
        """Bytes held against memory_bytes now (the mount adds what waits for the page cache)."""
        wb = self.checkpoints.budget.used + self.checkpoints.pool.free_bytes
        cache = self.values.cache
        return cache.used_bytes + cache.reserved_bytes + self.prefetch_budget.used + wb

    def stats(self) -> dict[str, Any]:
        tiers = self.values.tier_stats()
        on_disk = sum(t["used_bytes"] for t in tiers.values())
        live = sum(t["live_bytes"] for t in tiers.values())
        reads = ("read_batches", "inline_reads", "inline_backoffs")
        counters = {k: v for k, v in self.values.counters.items() if k not in reads}
        buffers = {name: b.stats() for name, b in sorted(self.buffers.items())}
        totals = {k: sum(b.get(k, 0) for b in buffers.values())
                  for k in ("entries", "bytes", "stored_bytes", "inserts", "rewrites", "deletes", "evictions",
                            "reads", "read_bytes", "batches", "sampled_entries", "priority_updates")}
        return {
            "version": __version__,
            "store": str(self.path),
            "uptime_s": round(time.time() - self.started, 1),
            "read_only": self.read_only,
            "ops": totals,
            "tiers": tiers,
            "space": {"on_disk_bytes": on_disk, "live_bytes": live,
                      "overhead": round(on_disk / live, 3) if live else None,
                      "max_overhead": self.config.max_space_overhead},
            "tiering": self.mover.stats(),
            "memory": {**self.memory.as_dict(), "held_bytes": self.memory_held(), "cache": self.values.cache.stats()},
            "commits": {"groups": self.committer.groups, "changes": self.committer.changes,
                        "failures": self.committer.failures, "rejected": self.committer.rejected},
            # batches: hand-offs to worker threads; inline: small values in memory read on the
            # loop; inline_backoffs: times reads on the loop stopped a while (one found the disk)
            "reads": {"batches": self.values.counters["read_batches"], "inline": self.values.counters["inline_reads"],
                      "inline_backoffs": self.values.counters["inline_backoffs"]},
            **counters,
            **self.counters,
            "buffers": buffers,
            "banks": {name: b.stats() for name, b in sorted(self.banks.items())},
            "weights": self.weights.stats(),
            "checkpoints": self.checkpoints.stats(),
            "datasets": {name: d.stats() for name, d in sorted(self.datasets.items())},
            "recovery": self.recovery.as_dict(),
            **({"priority_wal": {"applied": self.priority_wal.applied, "replayed": self.priority_wal.replayed}}
               if self.priority_wal is not None else {}),
            **({"cluster": {"store": self.cluster.store, "url": self.cluster.url,
                            "applied": self.follower.applied.decode(), **self.follower.counters,
                            **self.engine.counters, "wait_replicas": self.engine.wait_replicas,
                            "datasets": self.datasets_log.counters if self.datasets_log is not None else {}}}
               if self.follower is not None and self.cluster is not None else {}),
            "prefetch": {"budget_bytes": self.prefetch_budget.capacity, "held_bytes": self.prefetch_budget.used,
                         **_sum_prefetch([p for kind in self.namespaces.values()
                                          for ns in kind.values() if (p := getattr(ns, "prefetcher", None))])},
        }


def _sum_prefetch(prefetchers) -> dict:
    totals = {k: sum(p.counters[k] for p in prefetchers)
              for k in ("hits", "late", "misses", "page_cache", "skipped", "pushed")}
    totals["hit_rate"] = hit_rate(totals)
    return totals


def _copy(value) -> bytes | None:
    return None if value is None else bytes(value)


class CreateNamespace(Change):
    def __init__(self, store: Store, kind: str, name: str, owner: Owner, config) -> None:
        self.store = store
        self.kind = kind
        self.name = name
        self.owner = owner
        self.config = config
        self.conflict_key = ("ns", kind, name)

    def plan(self, overlay: Overlay) -> None:
        if self.name in self.store.namespaces[self.kind]:
            raise AlreadyExists(f"{self.kind}/{self.name} exists")
        self.ctime_ns = time.time_ns()

    def txn(self, txn) -> None:
        self.ns_id = unpack_u32(bytes(txn.get(b"next_ns", db=DB_META)))
        txn.put(b"next_ns", pack_u32(self.ns_id + 1), db=DB_META)
        record = {"id": self.ns_id, "kind": self.kind, "config": self.config.to_dict(),
                  "mode": self.owner.mode, "uid": self.owner.uid, "gid": self.owner.gid,
                  "ctime_ns": self.ctime_ns}
        txn.put(ns_key(self.kind, self.name), json.dumps(record).encode(), db=DB_NS)

    def apply(self) -> None:
        cls = KINDS[self.kind]
        self.store.namespaces[self.kind][self.name] = cls(self.store.services, self.ns_id, self.name, self.config,
                                                          self.owner, self.ctime_ns)


class DropNamespace(Change):
    def __init__(self, store: Store, ns: Namespace) -> None:
        self.store = store
        self.ns = ns
        self.conflict_key = ("ns", ns.kind, ns.name)

    def plan(self, overlay: Overlay) -> None:
        ns = self.ns
        if self.store.namespaces[ns.kind].get(ns.name) is not ns:
            raise NotFound(f"no {ns.kind}/{ns.name}")
        if isinstance(ns, Dataset):
            if ns.sealed or ns.counters.items or ns.children(1, 0, 1):
                raise NotEmpty(f"datasets/{ns.name} is not empty")
        elif len(ns.ring) + overlay.ring(ns.ns_id).count > 0:
            raise NotEmpty(f"{ns.kind}/{ns.name} still has {len(ns.ring)} entries")

    def txn(self, txn) -> None:
        txn.delete(ns_key(self.ns.kind, self.ns.name), db=DB_NS)
        if isinstance(self.ns, (Dataset, Buffer)):
            self.ns.drop_txn(txn)

    def apply(self) -> None:
        del self.store.namespaces[self.ns.kind][self.ns.name]
        if isinstance(self.ns, Buffer):
            self.ns.dropped()
        if not isinstance(self.ns, Dataset):
            self.store.values.nvme.end_stream(self.ns.ns_id)  # its last segment may go too


class ConfigureWeights(Change):
    def __init__(self, store: Store, config: WeightsConfig) -> None:
        self.store = store
        self.config = config
        self.conflict_key = ("weights",)

    def txn(self, txn) -> None:
        txn.put(b"weights", self.config.to_json(), db=DB_META)

    def apply(self) -> None:
        self.store.weights.config = self.config

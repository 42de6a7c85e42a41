"""The store: opens a store directory, wires its tiers, and holds its namespaces.

A store directory holds `meta/` (the LMDB environment: catalog and small values),
`segments/` (NVMe segment files, unless `nvme_dir` points elsewhere), `lock` (who has it
open) and `daemon.log`. Only one process opens a store at a time (flock on `lock`).

Durability: a commit reaches the OS at once (a kill -9 loses nothing committed) and the
disk within `sync_interval` seconds; `sync()` (fsync) makes everything committed durable
now. Segment files are synced before the LMDB environment so a durable catalog never
points at non-durable data.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import trio

from . import __version__, codec
from distorefs.backends.base import ValueBackend
from distorefs.backends.lmdbenv import LmdbEnv
from distorefs.backends.lmdbvalues import LmdbValues
from distorefs.backends.segments import SegmentValues
from .buffer import Buffer
from .cache import ValueCache
from .catalog import DB_ENTRIES, DB_META, DB_NS, DB_PRIO, DB_SAMPLED, FORMAT_VERSION, TIER_LMDB, TIER_NAMES, TIER_NVME, EntryMeta, pack_u32, unpack_u32
from .committer import Change, Committer, Overlay
from .config import BufferConfig, StoreConfig
from .errors import AlreadyExists, CorruptValue, DistorefsError, NotEmpty, NotFound, StoreLocked
from .names import check_name
from .ring import Owner, Ring

log = logging.getLogger(__name__)

EntryListener = Callable[[Ring, EntryMeta, "EntryMeta | None"], None]


class Store:
    def __init__(self, path: str | os.PathLike, *, nvme_dir: str | None = None,
                 config: dict | None = None) -> None:
        """Open (creating if missing) the store at `path`. `config` overrides stored settings."""
        self.path = Path(path).resolve()
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        self._lock_fd = self._lock()
        try:
            self._open(nvme_dir, config)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _lock(self) -> int:
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreLocked(f"store {self.path} is already in use ({holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        return fd

    def _open(self, nvme_dir: str | None, overrides: dict | None) -> None:
        self.env = LmdbEnv(self.path / "meta")
        for name in (DB_META, DB_NS, DB_ENTRIES, DB_PRIO, DB_SAMPLED):
            self.env.db(name)  # opening a db writes: do it once, before any transaction
        stored = self.env.read(lambda txn: _copy(txn.get(b"config", db=self.env.db(DB_META))))
        base = StoreConfig.from_json(stored) if stored else StoreConfig()
        if nvme_dir:
            overrides = {**(overrides or {}), "nvme_dir": str(Path(nvme_dir).resolve())}
        self.config = StoreConfig.from_dict(overrides, base) if overrides else base
        self.env.write(self._init_meta)
        self.nvme_path = Path(self.config.nvme_dir) if self.config.nvme_dir else self.path / "segments"
        self.backends: dict[int, ValueBackend] = {
            TIER_LMDB: LmdbValues(self.env),
            TIER_NVME: SegmentValues(self.env, self.nvme_path, self.config.segment_bytes),
        }
        self.cache = ValueCache(self.config.cache_bytes)
        self.committer = Committer(self.env.write)
        self.buffers: dict[str, Buffer] = {}
        self.listeners: list[EntryListener] = []
        self.counters = {"corrupt_reads": 0, "disk_reads": 0, "disk_read_bytes": 0, "syncs": 0,
                         "segment_bytes_freed": 0}
        self.started = time.time()
        self._gen = 0
        self._nursery: trio.Nursery | None = None
        self._synced_groups = 0
        self.env.read(self._load_namespaces)

    def _init_meta(self, txn) -> None:
        db = self.env.db(DB_META)
        txn.put(b"config", self.config.to_json(), db=db)
        if txn.get(b"format", db=db) is None:
            txn.put(b"format", pack_u32(FORMAT_VERSION), db=db)
            txn.put(b"next_ns", pack_u32(1), db=db)

    def _load_namespaces(self, txn) -> None:
        cursor = txn.cursor(db=self.env.db(DB_NS))
        for k, v in cursor:
            kind, _, name = bytes(k).decode().partition("/")
            record = json.loads(bytes(v))
            if kind == "buffers":
                buf = Buffer(self, record["id"], name, BufferConfig.from_dict(record["config"]),
                             Owner(record["mode"], record["uid"], record["gid"]), record["ctime_ns"])
                buf.ring.load(txn)
                self.buffers[name] = buf

    # ----- running -------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator["Store"]:
        """Run the store's background tasks (committer, periodic sync, pre-sampling)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.committer.run)
            nursery.start_soon(self._sync_loop)
            for buf in self.buffers.values():
                for meta in buf.spent_at_load():
                    self.committer.submit_nowait(_spent_removal(buf, meta))
            try:
                yield self
            finally:
                with trio.CancelScope(shield=True):
                    await self.committer.drain()
                    await self.sync()
                nursery.cancel_scope.cancel()
                self._nursery = None

    def spawn(self, fn, *args) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _sync_loop(self) -> None:
        while True:
            await trio.sleep(self.config.sync_interval)
            if self.committer.groups != self._synced_groups:
                await self.sync()
                # Segments whose every value was evicted or deleted give their space back.
                freed = await trio.to_thread.run_sync(self.backends[TIER_NVME].collect)
                self.counters["segment_bytes_freed"] += freed

    async def sync(self) -> None:
        """Make everything committed so far durable (fsync)."""
        await self.committer.drain()
        groups = self.committer.groups
        await trio.to_thread.run_sync(self.sync_blocking)
        self._synced_groups = groups

    def sync_blocking(self) -> None:
        self.backends[TIER_NVME].sync()
        self.env.sync()
        self.counters["syncs"] += 1

    def close(self) -> None:
        """Close after `running()` has exited (or if it never ran)."""
        self.sync_blocking()
        for backend in self.backends.values():
            backend.close()
        self.env.close()
        os.close(self._lock_fd)

    # ----- values --------------------------------------------------------------------

    def backend(self, tier: int) -> ValueBackend:
        return self.backends[tier]

    def next_gen(self) -> int:
        self._gen += 1
        return self._gen

    def load_value(self, meta: EntryMeta, what: str) -> bytes:
        """Read and verify one value from its disk tier (worker thread).

        Raises NotFound when the value is not there and CorruptValue when its bytes do not
        verify. Either can be a race (the entry was evicted or rewritten after `meta` was
        taken) rather than damage: the caller, who knows what is current, decides.
        """
        try:
            stored = self.backends[meta.tier].get(meta.loc)
            if len(stored) != meta.stored_size:
                raise CorruptValue(f"stored size {len(stored)}, expected {meta.stored_size}")
            value = codec.decode(stored, meta.codec, meta.size, meta.checksum, what)
        except (CorruptValue, NotFound) as exc:
            # Backend errors name only a location: say which entry it is.
            message = str(exc) if str(exc).startswith(what) else f"{what}: {exc}"
            raise type(exc)(message) from None
        self.counters["disk_reads"] += 1
        self.counters["disk_read_bytes"] += meta.stored_size
        return value

    def report_corrupt(self, exc: DistorefsError) -> CorruptValue:
        """Count and log a value that failed to verify; the read fails with EIO."""
        self.counters["corrupt_reads"] += 1
        log.error("corrupt value: %s", exc)
        return CorruptValue(str(exc))

    def load_values(self, items: list[tuple[EntryMeta, str]]) -> list[bytes | None]:
        """Values of many entries in one worker-thread call; None where a read failed."""
        out: list[bytes | None] = []
        for meta, what in items:
            try:
                out.append(self.load_value(meta, what))
            except DistorefsError:
                out.append(None)
        return out

    def entry_changed(self, ring: Ring, old: EntryMeta, new: EntryMeta | None) -> None:
        for listener in self.listeners:
            try:
                listener(ring, old, new)
            except Exception:
                log.exception("entry listener failed")

    # ----- namespaces ----------------------------------------------------------------

    async def create_buffer(self, name: str, owner: Owner, config: BufferConfig | None = None) -> Buffer:
        check_name(name.encode("utf-8", "surrogateescape"))
        change = CreateBuffer(self, name, owner, config or self.config.default_buffer)
        await self.committer.submit(change)
        return self.buffers[name]

    async def drop_buffer(self, name: str) -> None:
        await self.committer.submit(DropBuffer(self, name))

    def buffer(self, name: str) -> Buffer:
        buf = self.buffers.get(name)
        if buf is None:
            raise NotFound(f"no buffer {name!r}")
        return buf

    async def configure_buffer(self, name: str, text: bytes) -> BufferConfig:
        """Merge a JSON config into the buffer's; an invalid one raises InvalidConfig, old kept."""
        buf = self.buffer(name)
        config = BufferConfig.from_json(text, buf.config)
        await self.committer.submit(ConfigureBuffer(self, buf, config))
        return config

    # ----- reporting -----------------------------------------------------------------

    def statfs(self) -> dict[str, int]:
        st = os.statvfs(self.path)
        used = sum(b.usage().used_bytes for b in self.backends.values())
        return {"total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize, "used": used,
                "files": sum(len(b.ring) for b in self.buffers.values())}

    def stats(self) -> dict[str, Any]:
        tiers = {}
        for tier, backend in self.backends.items():
            u = backend.usage()
            tiers[TIER_NAMES[tier]] = {"used_bytes": u.used_bytes, "live_bytes": u.live_bytes,
                                       "capacity_bytes": u.capacity_bytes}
        buffers = {name: b.stats() for name, b in sorted(self.buffers.items())}
        totals = {k: sum(b[k] for b in buffers.values())
                  for k in ("entries", "bytes", "stored_bytes", "inserts", "rewrites", "deletes", "evictions",
                            "reads", "read_bytes", "batches", "sampled_entries", "priority_updates")}
        return {
            "version": __version__,
            "store": str(self.path),
            "uptime_s": round(time.time() - self.started, 1),
            "ops": totals,
            "tiers": tiers,
            "memory": {"cache": self.cache.stats()},
            "commits": {"groups": self.committer.groups, "changes": self.committer.changes,
                        "failures": self.committer.failures},
            **self.counters,
            "buffers": buffers,
        }


def _copy(value) -> bytes | None:
    return None if value is None else bytes(value)


def _spent_removal(buf: Buffer, meta: EntryMeta) -> Change:
    from .ring import RemoveEntry
    return RemoveEntry(buf.ring, meta.key, meta.seq, "exhausted")


class CreateBuffer(Change):
    def __init__(self, store: Store, name: str, owner: Owner, config: BufferConfig) -> None:
        self.store = store
        self.name = name
        self.owner = owner
        self.config = config
        self.conflict_key = ("ns", name)

    def plan(self, overlay: Overlay) -> None:
        if self.name in self.store.buffers:
            raise AlreadyExists(f"buffer {self.name!r} exists")
        self.ctime_ns = time.time_ns()

    def txn(self, txn) -> None:
        meta_db = self.store.env.db(DB_META)
        self.ns_id = unpack_u32(bytes(txn.get(b"next_ns", db=meta_db)))
        txn.put(b"next_ns", pack_u32(self.ns_id + 1), db=meta_db)
        record = {"id": self.ns_id, "kind": "buffers", "config": self.config.to_dict(),
                  "mode": self.owner.mode, "uid": self.owner.uid, "gid": self.owner.gid,
                  "ctime_ns": self.ctime_ns}
        txn.put(f"buffers/{self.name}".encode(), json.dumps(record).encode(), db=self.store.env.db(DB_NS))

    def apply(self) -> None:
        self.store.buffers[self.name] = Buffer(self.store, self.ns_id, self.name, self.config, self.owner,
                                               self.ctime_ns)


class DropBuffer(Change):
    def __init__(self, store: Store, name: str) -> None:
        self.store = store
        self.name = name
        self.conflict_key = ("ns", name)

    def plan(self, overlay: Overlay) -> None:
        buf = self.store.buffer(self.name)
        if len(buf.ring) + overlay.ring(buf.ns_id).count > 0:
            raise NotEmpty(f"buffer {self.name!r} still has {len(buf.ring)} entries")

    def txn(self, txn) -> None:
        txn.delete(f"buffers/{self.name}".encode(), db=self.store.env.db(DB_NS))

    def apply(self) -> None:
        del self.store.buffers[self.name]


class ConfigureBuffer(Change):
    """A new configuration; shrinking capacity or max_bytes evicts the oldest at once."""

    def __init__(self, store: Store, buf: Buffer, config: BufferConfig) -> None:
        self.store = store
        self.buf = buf
        self.config = config
        self.conflict_key = ("ns", buf.name)

    def plan(self, overlay: Overlay) -> None:
        self.victims = self.buf.ring.plan_evictions(overlay.ring(self.buf.ns_id), config=self.config)

    def txn(self, txn) -> None:
        for victim in self.victims:
            self.buf.ring.txn_remove(txn, victim)
        key = f"buffers/{self.buf.name}".encode()
        db = self.store.env.db(DB_NS)
        record = json.loads(bytes(txn.get(key, db=db)))
        record["config"] = self.config.to_dict()
        txn.put(key, json.dumps(record).encode(), db=db)

    def apply(self) -> None:
        for victim in self.victims:
            self.buf.ring.apply_remove(victim, "evictions")
        self.buf.reconfigure(self.config)

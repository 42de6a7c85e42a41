"""Checkpoints (checkpoints/RUN/STEP/...): two-phase (CheckFreq-style) checkpointing.

A trainer writes `RUN/STEP/...` with any writer (torch.save, numpy.save, cp). The
**snapshot** phase is the writes themselves: their bytes are kept in memory, chunk by
chunk, against one store-wide budget (`writeback_bytes`); close() returns at once. The
**persist** phase runs behind it: one task takes chunks and file commits from a FIFO
queue, in the order they were handed over, and stores each through the group committer
(compression and checksums in a worker thread, values in the tier placement picks), then
syncs (fsync) and frees the memory. A writer whose bytes do not fit waits until the
persister has freed enough (backpressure): memory never grows past the budget.

Tree (LMDB db `cknodes`, keys big-endian):
  n + id                node record (JSON): kind root/run/step/dir/file, parent, name, owner,
                        mtime; steps: complete, pinned (origin, sid, nonce: written on another
                        node of a shared store); files: size, chunk_bytes
  c + file id + index   one stored chunk of a file (a `StoredValue`, CRC-32 of its content)
  g                     counter making every stored chunk's value key unique
  x, y                  a shared store's export records (distorefs/checkpointslog.py)
  meta/b"checkpoints"   the configuration (CheckpointsConfig)

A step's life: **writing** (files being written) -> **persisting** once the writer has
closed it -> **durable** (complete) once every file in it is stored and synced; then
`RUN/latest` may name it. A step is closed ("sealed") when none of its files is open for
writing and one of: a newer step is created in the same run (a save loop moved on), its
directory is fsynced, or nothing was written below it for `seal_after` seconds. A write
below a sealed step opens it again (a complete one stops being complete first). A step
with no files never completes.
`latest` is the complete step created last; the newest `keep_last` complete steps and
pinned steps are kept, older complete steps (and steps interrupted by a crash, once a
newer step is complete) are removed in the background.

Durability: a chunk or a file commit is one LMDB transaction (the chunk's value written
to its tier in the same transaction); `Store.sync` makes it durable, segments before the
catalog. A file is durable once its last commit is covered by a sync; a step becomes
complete in a transaction after the sync that made its files durable.

Shared store (`sharing`, distorefs/checkpointslog.py): a step that completes here is copied
to the cluster and announced in the background; another node's complete step appears here
complete, with its origin. Such a step is read-only (ReadOnly names its origin); removing
it here removes this node's records only: the tree never frees a value in the cluster
(`drop_value`), the node that wrote the step owns those.

Crash model (kill -9 or power loss at any point): the catalog holds whole transactions
only. A step is complete in the catalog only if all its files were durable before that
transaction was written, and a step is made incomplete (in its own transaction) before
any of its content is changed again; so a complete step is whole. A step found
incomplete at open was interrupted: it is read-only (state `incomplete`), never becomes
complete, and goes once a newer step of its run is complete (unless pinned). Chunk
values written by transactions that never committed are unreferenced garbage.

Concurrency (what may change across an await): the tree changes only in a committed
change's `apply` (event loop, one at a time: every change here shares one conflict key,
so they commit in submission order), except that a new file appears in its directory at
create (its record goes in with its first transaction: creating files never waits for the
persister); the in-memory chunks change only on the event loop.
A chunk being persisted is marked busy: writes to it wait, reads keep using it. A write
takes its budget before it changes a chunk and checks the chunk is still the one it
took it for, or gives the bytes back and tries again.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import mmap
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Protocol, TypedDict

import trio

from . import codec
from .catalog import DB_META
from .codec import crc32_combine, zeros_crc32
from .committer import Change, Overlay
from .config import CheckpointsConfig
from .memory import MemoryPlan
from .errors import (AlreadyExists, Busy, CorruptValue, CrossDevice, DistorefsError, InvalidArgument, IsADirectory,
                     NotADirectory, NotEmpty, NotFound, NotPermitted, ReadOnly, Stale, TooLarge)
from .fileattrs import AttrChange, apply_setattr, changed, modified, now_ns, times_from
from .later import Later
from .names import check_name
from .owner import Owner
from .treerules import check_rename
from .placement import TIER_CLUSTER, TIER_NAMES
from .restorepoints import Pins, RestorePoint
from .services import Services
from .values import StoredValue

log = logging.getLogger(__name__)

DB_CKPT = b"cknodes"
ROOT_ID = 1
ROOT, RUN, STEP, DIR, FILE, LINK = "root", "run", "step", "dir", "file", "link"
WRITING, PERSISTING, DURABLE, INCOMPLETE = "writing", "persisting", "durable", "incomplete"
LATEST = b"latest"
CONTROL = (b"config.json", b"stats.json")
_ID = struct.Struct(">Q")
_IDX = struct.Struct(">I")
_GEN_KEY = b"g"
SEAL_TICK = 0.05
# Chunks the persister works on at once: one joined and encoded in a worker thread while
# another is written in the committer's transaction, so neither waits for the other.
PERSIST_AHEAD = 3


# ----- CRC-32 of a file from its chunks' CRCs ----------------------------------------------

def checksum_of(size: int, step: int, stored: dict) -> int | None:
    """CRC-32 of a file of `size` bytes whose chunk i (of `step` bytes) is `stored[i]` (its
    own CRC and size); what no chunk covers reads as zeros. None if a chunk is longer than
    the file says (a crash mid-rewrite)."""
    crc, pos = 0, 0
    for i in sorted(stored):
        start = i * step
        if start >= size:
            continue
        chunk = stored[i]
        if chunk.size > min(step, size - start):
            return None
        if start > pos:  # a hole (or the tail of a short chunk) before it
            crc = crc32_combine(crc, zeros_crc32(start - pos), start - pos)
            pos = start
        if chunk.size:
            crc = crc32_combine(crc, chunk.checksum, chunk.size)
            pos += chunk.size
    if size > pos:
        crc = crc32_combine(crc, zeros_crc32(size - pos), size - pos)
    return crc


# ----- memory: the write-back budget and the chunks it pays for ----------------------------

class WritebackBudget:
    """Bytes of checkpoint data held in memory, against `capacity` (writeback_bytes).

    A writer takes bytes before it keeps them and waits while the budget is full; the
    persister gives them back once they are stored. A take that finds the budget empty
    always succeeds (one write larger than the whole budget must not wait forever)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.waiting = 0
        self.waits = 0
        self.wait_s = 0.0
        self._freed = trio.Event()

    def fits(self, n: int) -> bool:
        return self.used + n <= self.capacity or self.used == 0

    async def take(self, n: int, full: Callable[[], None]) -> None:
        if not self.fits(n):
            self.waits += 1
            self.waiting += 1
            t0 = time.monotonic()
            try:
                while not self.fits(n):
                    full()
                    await self._freed.wait()
            finally:
                self.waiting -= 1
                self.wait_s += time.monotonic() - t0
        self.used += n
        self.peak = max(self.peak, self.used)

    def take_now(self, n: int) -> bool:
        """Take n bytes if they fit now and no writer waits before them (no wait, no
        exception for an empty budget)."""
        if self.waiting or self.used + n > self.capacity:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n
        self._freed.set()
        self._freed = trio.Event()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self.give(0)


# A chunk's memory: an exact-size bytearray while small, else an anonymous mapping of the pool.
Memory = bytearray | mmap.mmap


class BufferPool:
    """Chunk buffers reused from one checkpoint to the next.

    Memory touched for the first time costs page faults (about 0.5 s per GiB on a VM,
    ten times the copy into it), so a persisted chunk's buffer goes back here for the
    next writes instead of to the allocator. A new buffer is an anonymous mapping nobody
    has touched (a bytearray is zeroed where it is made, the event loop): its pages fault
    in where it is first written, in the library's front for the chunks lent to it. Free
    buffers count against the budget too (held + free <= writeback_bytes) and are let go
    after `idle_s` without use."""

    def __init__(self, budget: WritebackBudget, idle_s: float = 30.0) -> None:
        self.budget = budget
        self.idle_s = idle_s
        self.free: dict[int, list[Memory]] = {}
        self.free_bytes = 0
        self.last_used = 0.0

    def get(self, size: int) -> Memory:
        self.last_used = time.monotonic()
        buf = self.take_free(size)
        return buf if buf is not None else mmap.mmap(-1, size)

    def take_free(self, size: int) -> Memory | None:
        """A free buffer of `size` bytes, None if there is none (no new memory)."""
        stack = self.free.get(size)
        if not stack:
            return None
        self.last_used = time.monotonic()
        self.free_bytes -= size
        return stack.pop()

    def put(self, buf: Memory) -> None:
        size = len(buf)
        if self.budget.used + self.free_bytes + size <= self.budget.capacity:
            self.free.setdefault(size, []).append(buf)
            self.free_bytes += size
            self.last_used = time.monotonic()

    def shrink(self, excess: int) -> None:
        """Let go of free buffers until `excess` bytes are released (or none is left)."""
        for size in sorted(self.free, reverse=True):
            stack = self.free[size]
            while stack and excess > 0:
                stack.pop()
                self.free_bytes -= size
                excess -= size
        self.free = {k: v for k, v in self.free.items() if v}

    def trim(self) -> None:
        if self.free and time.monotonic() - self.last_used > self.idle_s:
            self.shrink(self.free_bytes)


MIN_POOLED = 1 << 20  # below this a chunk is an exact-size bytearray of its own


MAX_PIECES = 256  # a chunk of more pieces (many small writes) is copied into one buffer


class Buf:
    """One chunk of a file held in memory: `data[:length]` (zeros past `length`).

    `data` is an exact-size bytearray while the chunk is small, else a pooled buffer of a
    power-of-two size (a file's first chunk grows 1, 2, 4... MiB) or of the whole chunk.

    A chunk written in big writes that do not overlap (torch.save, np.save: 1 MiB WRITE
    requests, several in flight at once and so arriving in any order) is kept as the
    requests' own bytes objects (`pieces`: (offset, bytes)), not copied: the copy into one
    buffer happens in the persister's worker thread, off the request path, without the GIL
    (`join_pieces`). Any other write turns it into a buffer first (`_materialize`)."""

    __slots__ = ("data", "length", "queued", "busy", "pieces", "covered")

    def __init__(self, data: Memory, length: int = 0) -> None:
        self.data = data
        self.length = length
        self.queued = False  # in the persist queue
        self.busy: trio.Event | None = None  # set while being persisted: writers wait for it
        self.pieces: list | None = None  # (offset, bytes) of big writes, kept as they came (see above)
        self.covered = 0  # bytes the pieces hold

    @property
    def pooled(self) -> bool:
        return self.pieces is None and len(self.data) >= MIN_POOLED

    @property
    def held(self) -> int:
        """Bytes of the write-back budget it holds."""
        return self.covered if self.pieces is not None else len(self.data)

    def read(self, lo: int, hi: int) -> bytes:
        """Bytes [lo, hi) of the chunk; zeros past what was written."""
        if self.pieces is not None:
            out = bytearray(hi - lo)
            for off, p in self.pieces:
                a, b = max(lo, off), min(hi, off + len(p))
                if a < b:
                    out[a - lo:b - lo] = memoryview(p)[a - off:b - off]
            return bytes(out)
        got = bytes(memoryview(self.data)[lo:min(hi, self.length)]) if lo < self.length else b""
        return got if len(got) == hi - lo else got + bytes(hi - lo - len(got))

    def takes(self, lo: int, n: int) -> bool:
        """Whether a write of n bytes at lo lands on no piece (it can be kept as a piece)."""
        return (self.pieces is not None and len(self.pieces) < MAX_PIECES
                and all(lo + n <= off or lo >= off + len(p) for off, p in self.pieces))

    def add(self, lo: int, piece) -> None:
        self.pieces.append((lo, piece))  # type: ignore[union-attr]
        self.covered += len(piece)
        self.length = max(self.length, lo + len(piece))

    def trim(self, n: int) -> int:
        """Keep the first n bytes of a chunk of pieces; the bytes let go."""
        assert self.pieces is not None
        kept = [(off, p if off + len(p) <= n else memoryview(p)[:n - off]) for off, p in self.pieces if off < n]
        covered = sum(len(p) for _, p in kept)
        freed, self.pieces, self.covered, self.length = self.covered - covered, kept, covered, min(n, self.length)
        return freed


_memmove = ctypes.memmove  # a foreign call: it runs without the GIL


def join_pieces(pieces: list, length: int, out: Memory) -> memoryview:
    """The pieces at their offsets in `out`, zeros between them (worker thread); a view of
    the chunk's `length` bytes."""
    base = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
    pos = 0
    for off, p in sorted(pieces, key=lambda x: x[0]):
        if off > pos:
            ctypes.memset(base + pos, 0, off - pos)
        n = len(p)
        src = ctypes.c_char_p(p) if isinstance(p, bytes) else (ctypes.c_char * n).from_buffer_copy(p)
        _memmove(base + off, src, n)
        pos = max(pos, off + n)
    if length > pos:
        ctypes.memset(base + pos, 0, length - pos)
    return memoryview(out)[:length]


# ----- the tree ----------------------------------------------------------------------------

class _Times(TypedDict):
    """A node's atime_ns and ctime_ns, passed to its constructor as keywords (`**times`)."""

    atime_ns: int
    ctime_ns: int


@dataclass(eq=False)
class CNode:
    id: int
    kind: str
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    attached: bool = field(default=True, repr=False)  # False once removed (memory only)
    atime_ns: int = field(default=0, kw_only=True)
    ctime_ns: int = field(default=0, kw_only=True)
    unlinked: bool = field(default=False, kw_only=True)  # removed while open: goes at its last close

    @property
    def is_dir(self) -> bool:
        return isinstance(self, CDir)

    def record(self) -> dict:
        return {"kind": self.kind, "parent": self.parent, "name": self.name.hex(), "mode": self.mode,
                "uid": self.uid, "gid": self.gid, "mtime_ns": self.mtime_ns, "atime_ns": self.atime_ns,
                "ctime_ns": self.ctime_ns, **({"unlinked": True} if self.unlinked else {})}


@dataclass(eq=False)
class CDir(CNode):
    children: dict[bytes, int] = field(default_factory=dict)  # memory only


@dataclass(eq=False)
class CStep(CDir):
    complete: bool = False
    pinned: bool = False
    reopened: bool = False  # complete once, written again since: a crash restores it (restorepoints.py)
    # A shared store: the step was written on node `origin` (its id there `sid`, its export
    # `nonce`) and applied here (distorefs/checkpointslog.py): read-only. "" for this node's.
    origin: str = ""
    sid: int = 0
    nonce: str = ""
    # memory only:
    epoch: int = 0  # bumped each time it is written again: an export of an older epoch is stale
    interrupted: bool = False  # found incomplete at open (a crash): read-only, never complete
    sealed: bool = False  # closed by its writer: completes once everything in it is durable
    writers: int = 0  # handles open for writing below it
    handles: int = 0  # handles of any kind open below it (retention leaves it alone)
    active: float = 0.0  # monotonic time of the last change below it
    # A removal of it whole is planned (retention, or another node's word): its files' data
    # go in that change's transaction, while their names still open them until it is
    # applied, so no open takes one from then on.
    going: bool = False

    def record(self) -> dict:
        return {**super().record(), "complete": self.complete, "pinned": self.pinned,
                **({"reopened": True} if self.reopened else {}),
                **({"origin": self.origin, "sid": self.sid, "nonce": self.nonce} if self.origin else {})}


@dataclass(eq=False)
class CFile(CNode):
    size: int = 0
    chunk_bytes: int = 8 << 20
    # memory only:
    stored: dict[int, StoredValue] = field(default_factory=dict)  # chunk index -> stored chunk
    mem: dict[int, Buf] = field(default_factory=dict)  # chunk index -> newer content in memory
    garbage: list[tuple[int, StoredValue]] = field(default_factory=list)  # truncated away; freed at the next commit
    writers: int = 0
    handles: int = 0
    dirty: bool = False  # changed since its last commit was queued
    pending: int = 0  # items of it in the persist queue
    ticket: int = 0  # its last queued commit; durable once the durable ticket reaches it
    error: DistorefsError | None = None  # a persist of it failed
    recorded: bool = True  # its record is in the catalog (a new file's goes in with its first commit)
    unlinked_at: float = 0.0  # monotonic time it lost its name (0: before this run)
    dropping: bool = False  # its removal with its data is planned: no open takes it any more

    def record(self) -> dict:
        return {**super().record(), "size": self.size, "chunk_bytes": self.chunk_bytes}


@dataclass(eq=False)
class CLink(CNode):
    """A symlink in a step (a step's files may link to each other, as any tree's)."""

    target: bytes = b""

    def record(self) -> dict:
        return {**super().record(), "target": self.target.hex()}


def _from_record(node_id: int, data: bytes) -> CNode:
    d = json.loads(data)
    atime, mtime, ctime = times_from(d, d["mtime_ns"])
    args = (node_id, d["kind"], d["parent"], bytes.fromhex(d["name"]), d["mode"], d["uid"], d["gid"], mtime)
    times: _Times = {"atime_ns": atime, "ctime_ns": ctime}
    if d["kind"] == STEP:
        return CStep(*args, complete=d["complete"], pinned=d["pinned"], reopened=d.get("reopened", False),
                     origin=d.get("origin", ""), sid=d.get("sid", 0), nonce=d.get("nonce", ""), **times)
    if d["kind"] == FILE:
        return CFile(*args, size=d["size"], chunk_bytes=d["chunk_bytes"], unlinked=d.get("unlinked", False), **times)
    if d["kind"] == LINK:
        return CLink(*args, target=bytes.fromhex(d["target"]), **times)
    return CDir(*args, **times)


def _nkey(node_id: int) -> bytes:
    return b"n" + _ID.pack(node_id)


def _ckey(file_id: int, index: int) -> bytes:
    return b"c" + _ID.pack(file_id) + _IDX.pack(index)


# what may live below what: runs in the root, steps in a run, directories and files in a step
_CHILD_KIND = {ROOT: RUN, RUN: STEP, STEP: DIR, DIR: DIR}


def _may_hold(parent_kind: str, kind: str) -> bool:
    return kind == _CHILD_KIND.get(parent_kind) or (kind in (FILE, LINK) and parent_kind in (STEP, DIR))


class StepSharing(Protocol):
    """A shared store's side of the tree (distorefs/checkpointslog.py): a step that completes
    here is exported to the other nodes, and an exported step removed here is removed there."""

    def started(self) -> None:
        """The tree runs: finish what a stop cut short, export complete steps not yet shared."""

    def completed(self, step: "CStep") -> None:
        """`step` completed here (its completion is durable): export it in the background."""

    def removing(self, txn, steps: list["CStep"]) -> None:
        """In the transaction that removes `steps`: record what their exports leave to undo."""

    def removed(self, steps: list["CStep"]) -> None:
        """`steps` are removed (applied): tell the other nodes, free the copies (background)."""


class Checkpoints:
    kind = "checkpoints"

    def __init__(self, services: Services) -> None:
        self.values = services.values
        self.committer = services.committer
        self.store_config = services.config
        self._store_sync = services.sync
        self._spawn = services.spawn
        self._memory_changed = services.memory_changed
        self.config = CheckpointsConfig()
        now = time.time_ns()
        self.nodes: dict[int, CNode] = {ROOT_ID: CDir(ROOT_ID, ROOT, 0, b"", 0o40755, 0, 0, now, atime_ns=now,
                                                      ctime_ns=now)}
        self.unlinked_at_load: list[CFile] = []  # removed while open when the daemon last stopped
        self._later = Later(services.spawn)  # drops waiting out the grace
        self.restore: dict[int, RestorePoint] = {}  # file id -> what a crash gives back (restorepoints.py)
        self.pins = Pins()
        self._restore_at_start: list[CStep] = []
        self.after_crash = False  # the store was not closed cleanly (set by the store before `run`)
        self.next_id = ROOT_ID + 1
        self.budget = WritebackBudget(0)  # sized by the store's memory plan
        self.pool = BufferPool(self.budget)
        self.listeners: list[Callable[[CNode], None]] = []  # told of nodes the tree removes by itself
        # told of directories whose attributes (times, link count) the tree changes by itself
        # with no node removed: another node's step applied (the kernel caches directories'
        # attributes; a removal's listeners drop the parent's with the name)
        self.dir_listeners: list[Callable[[CDir], None]] = []
        # called when a writer waits for the write-back budget: whoever holds buffers lent
        # (`lend`) gives them back, filled or not
        self.reclaimers: list[Callable[[], None]] = []
        # A shared store: steps complete here are shared with the other nodes, and theirs
        # applied here (set by the store). None on a node-local store.
        self.sharing: StepSharing | None = None
        self._queue: deque[tuple[str, CFile, int]] = deque()
        self._wake = trio.Event()
        self._durable_event = trio.Event()
        self._tickets = 0  # last ticket handed to a queued file commit
        self.committed = 0  # last file commit processed
        self.durable = 0  # every commit up to this ticket is on disk
        self._wanted: dict[int, int] = {}  # ticket -> fsync callers waiting for it to be durable
        self._working = False  # the persister is on a file commit, a sync or a recheck
        self._persisting: dict[CFile, int] = {}  # files with chunks being persisted: how many
        self._landed = trio.Event()  # set (and replaced) each time one of them is done
        self._recheck = False  # a step was sealed: see whether it is complete
        self._unsealed: set[CStep] = set()
        self._sealed: set[CStep] = set()
        self._sealer_wake = trio.Event()  # set when a step is unsealed: the sealer's ticks start
        self._held: dict[CFile, None] = {}  # files with chunks in memory
        self._removing: set[int] = set()
        self.counters = {"bytes_written": 0, "bytes_persisted": 0, "chunks_persisted": 0, "file_commits": 0,
                         "chunks_filled_outside": 0, "syncs": 0, "steps_completed": 0, "steps_removed": 0,
                         "steps_reopened": 0, "chunk_reloads": 0, "evictions": 0, "persist_failures": 0, "steps_exported": 0,
                         "exports_abandoned": 0, "steps_applied": 0, "applied_steps_removed": 0}

    # ----- loading -------------------------------------------------------------------

    def load(self, txn) -> None:
        """Rebuild the tree at store open. Steps not complete were interrupted by a crash."""
        raw = txn.get(b"checkpoints", db=DB_META)
        if raw is not None:
            self.config = CheckpointsConfig.from_json(bytes(raw))
        chunks = []
        for k, v in txn.cursor(DB_CKPT):
            key = bytes(k)
            if key[:1] == b"n":
                node = _from_record(_ID.unpack_from(key, 1)[0], bytes(v))
                self.nodes[node.id] = node
                self.next_id = max(self.next_id, node.id + 1)
            elif key[:1] == b"c":
                chunks.append((_ID.unpack_from(key, 1)[0], _IDX.unpack_from(key, 9)[0],
                               StoredValue.unpack_from(bytes(v), 0)[0]))
            elif key[:1] == b"r":
                rp = RestorePoint.unpack(_ID.unpack_from(key, 1)[0], bytes(v))
                self.restore[rp.file_id] = rp
                self.pins.add(rp)
        for file_id, index, chunk in chunks:
            f = self.nodes.get(file_id)
            if isinstance(f, CFile):
                f.stored[index] = chunk
        for node in sorted(self.nodes.values(), key=lambda n: n.id):
            if node.id == ROOT_ID:
                continue
            parent = self.nodes.get(node.parent)
            if not isinstance(parent, CDir) or not parent.attached or not _may_hold(parent.kind, node.kind):
                log.error("checkpoint node %d (%s) has no valid parent %d: left out", node.id, node.kind, node.parent)
                node.attached = False
                continue
            if node.unlinked:
                self.unlinked_at_load.append(node)  # type: ignore[arg-type]
                continue
            parent.children[node.name] = node.id
            if isinstance(node, CStep) and not node.complete:
                node.interrupted = node.sealed = True
        self.nodes = {i: n for i, n in self.nodes.items() if n.attached}
        # steps a crash cut short after a restore point was taken: put back at start (`run`)
        marked = {rp.step_id for rp in self.restore.values()}
        self._restore_at_start = [n for n in self.nodes.values() if isinstance(n, CStep) and not n.complete
                                  and (n.reopened or n.id in marked)]

    # ----- running -------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The persister and the sealer (in the store's nursery)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._persister)
            nursery.start_soon(self._sealer)
            for node in list(self.nodes.values()):
                if node.kind == RUN:
                    self._collect(node)
            for step in self._restore_at_start:
                if self.after_crash:
                    await self.committer.submit(Restore(self, step))
                elif step.reopened:  # a clean stop: what the step holds is what was left in it
                    await self.committer.submit(Forget(self, step))
            self._restore_at_start = []
            for f in self.unlinked_at_load:  # removed while open: its last close was the stop
                if self.nodes.get(f.id) is f:  # (not put back by a Restore above: a new record, same id)
                    self.committer.submit_nowait(RemoveTree(self, f, background=False))
            self.unlinked_at_load = []
            if self.sharing is not None:
                self.sharing.started()
            task_status.started()

    async def drain(self, patience: float = 600.0) -> None:
        """At shutdown: close every step nobody writes and persist everything held (giving
        up, logged, if nothing moves for `patience` seconds: a disk that keeps failing)."""
        for step in list(self._unsealed):
            if step.writers == 0:
                self._seal(step)
        last, since = None, time.monotonic()
        while self._queue or self._working or self._inflight or self._recheck or self.committed > self.durable:
            now = (len(self._queue), self.committed, self.durable)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > patience:
                log.error("checkpoints: %d items not persisted at shutdown (no progress for %.0f s)",
                          len(self._queue), patience)
                return
            self._kick()
            await trio.sleep(0.02)

    def _full(self) -> None:
        """A writer waits for the budget: the persister looks for chunks to free, and the
        buffers lent out come back."""
        self._kick()
        for reclaim in self.reclaimers:
            reclaim()

    def _kick(self) -> None:
        self._wake.set()

    async def _persister(self) -> None:
        """Takes the queue in order, up to PERSIST_AHEAD chunks at once; a file's commit
        waits for its chunks. Syncs once what an fsync waits for is committed, when a closed
        step only waits for a sync, or when the queue runs dry."""
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    dry = not self._queue and not self._inflight
                    if self.committed > self.durable and (dry or self._sync_helps()
                                                          or min(self._wanted, default=self.committed + 1)
                                                          <= self.committed):
                        await self._sync()
                    elif self._recheck:
                        await self._complete_steps()
                    elif self._queue and (self._queue[0][0] != "chunk" or self._inflight < PERSIST_AHEAD):
                        kind, file, arg = self._queue.popleft()
                        file.pending -= 1
                        if kind == "chunk":
                            self._persisting[file] = self._persisting.get(file, 0) + 1
                            nursery.start_soon(self._persist_chunk, file, arg)
                        else:
                            self._working = True
                            try:
                                while self._persisting.get(file):
                                    await self._landed.wait()
                                await self._commit_file(file, arg)
                            finally:
                                self._working = False
                    elif not (self.budget.waiting and not self._queue and self._evict()):
                        await self._wake.wait()  # (queued chunks free the budget once taken)
                        self._wake = trio.Event()
                except Exception:  # never lose the daemon to a bug here
                    log.exception("checkpoint persister")
                    await trio.sleep(0.1)

    @property
    def _inflight(self) -> int:
        """Chunks being persisted (at most PERSIST_AHEAD)."""
        return sum(self._persisting.values())

    def _sync_helps(self) -> bool:
        """A closed step has every file committed and waits only for a sync."""
        for step in self._sealed:
            files = list(self.files_below(step))
            if files and all(not (f.writers or f.dirty or f.mem or f.pending) for f in files) \
                    and any(f.ticket > self.durable for f in files):
                return True
        return False

    async def _sealer(self) -> None:
        """Every SEAL_TICK while a step is unsealed: the steps nobody wrote for `seal_after`
        are sealed, and the pool lets go of buffers unused for its `idle_s`. With no step
        unsealed it ticks only when the pool's buffers are due (a mount that writes no
        checkpoint, or is between two, spends no wake-ups on it: each costs the event loop a
        turn, 20 a second before)."""
        while True:
            if not self._unsealed:
                due = self.pool.last_used + self.pool.idle_s - time.monotonic() if self.pool.free else math.inf
                with trio.move_on_after(max(due, SEAL_TICK)):
                    await self._sealer_wake.wait()
                self._sealer_wake = trio.Event()
            else:
                await trio.sleep(SEAL_TICK)
            self.pool.trim()
            after = self.config.seal_after
            if after <= 0:
                continue
            now = time.monotonic()
            for step in list(self._unsealed):
                if step.writers == 0 and now - step.active >= after:
                    self._seal(step)

    def _unseal(self, step: CStep) -> None:
        """`step` is written (again): the sealer closes it once nobody writes it for `seal_after`."""
        self._unsealed.add(step)
        self._sealer_wake.set()

    def _seal(self, step: CStep) -> None:
        if step in self._unsealed:
            self._unsealed.discard(step)
            step.sealed = True
            self._sealed.add(step)
            self._recheck = True
            self._kick()

    def dir_changed(self, d: CDir) -> None:
        """The tree changed directory `d`'s attributes by itself (no request did): tell
        `dir_listeners`."""
        for listener in self.dir_listeners:
            try:
                listener(d)
            except Exception:
                log.exception("checkpoint directory listener failed")

    # ----- queries -------------------------------------------------------------------

    def node(self, node_id: int) -> CNode:
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"checkpoint node {node_id} is gone")
        return node

    def dir(self, node_id: int) -> CDir:
        node = self.node(node_id)
        if not isinstance(node, CDir):
            raise NotADirectory(f"{self.path_of(node)} is not a directory")
        return node

    def child(self, parent_id: int, name: bytes) -> CNode:
        check_name(name)
        child_id = self.dir(parent_id).children.get(name)
        if child_id is None:
            raise NotFound(f"no {name!r}")
        return self.nodes[child_id]

    def resolve(self, path: str) -> CNode:
        """A node by its path below checkpoints/."""
        node = self.nodes[ROOT_ID]
        for part in [p for p in path.split("/") if p]:
            node = self.child(node.id, part.encode("utf-8", "surrogateescape"))
        return node

    def path_of(self, node: CNode) -> str:
        parts = []
        while node.id != ROOT_ID and node.attached:
            parts.append(node.name.decode("utf-8", "surrogateescape"))
            node = self.nodes.get(node.parent) or self.nodes[ROOT_ID]
        return "checkpoints/" + "/".join(reversed(parts))

    def step_of(self, node: CNode) -> CStep | None:
        while node.kind not in (STEP, RUN, ROOT):
            parent = self.nodes.get(node.parent)
            if parent is None:
                return None
            node = parent
        return node if isinstance(node, CStep) else None

    def files_below(self, node: CNode) -> Iterator[CFile]:
        if isinstance(node, CFile):
            yield node
        elif isinstance(node, CDir):
            for child_id in list(node.children.values()):
                yield from self.files_below(self.nodes[child_id])

    def latest(self, run: CNode) -> CStep | None:
        """The complete step of `run` created last."""
        best = None
        if isinstance(run, CDir) and run.kind == RUN:
            for child_id in run.children.values():
                s = self.nodes[child_id]
                if isinstance(s, CStep) and s.complete and (best is None or s.id > best.id):
                    best = s
        return best

    def _settled(self, step: CStep) -> bool | None:
        """Whether every file below `step` is closed and durable; None if one never will be."""
        files = list(self.files_below(step))
        if any(f.error is not None for f in files):
            return None
        return bool(files) and all(self._file_durable(f) for f in files)

    def _synced(self, f: CFile) -> bool:
        """Everything written to `f` so far is durable (its writers may still be open)."""
        return not f.dirty and not f.mem and not f.pending and f.ticket <= self.durable

    def _file_durable(self, f: CFile) -> bool:
        return not f.writers and not f.dirty and not f.mem and not f.pending and f.ticket <= self.durable

    def state(self, node: CNode) -> str:
        """writing | persisting | durable | incomplete, of a step or a file."""
        if isinstance(node, CStep):
            if node.complete:
                return DURABLE
            if node.interrupted:
                return INCOMPLETE
            settled = self._settled(node)
            if settled is None:
                return INCOMPLETE
            return PERSISTING if node.sealed and any(True for _ in self.files_below(node)) else WRITING
        if isinstance(node, CFile):
            if node.error is not None:
                return INCOMPLETE
            if node.writers:
                return WRITING
            return DURABLE if self._file_durable(node) else PERSISTING
        raise InvalidArgument("only steps and files have a state")

    def stored_size(self, f: CFile) -> int:
        return sum(c.stored_size for c in f.stored.values())

    def tiers(self, f: CFile) -> list[str]:
        return sorted({TIER_NAMES[c.tier] for c in f.stored.values()} | ({"memory"} if f.mem else set())) or ["none"]

    def checksum(self, f: CFile) -> int | None:
        """CRC-32 of the whole content, from the chunks' own CRCs; None while any is in memory.
        Work grows with the chunks stored, not with the size (holes cost one step each), but
        it is still work per chunk: the mount runs it in a worker thread on a snapshot
        (`checksum_parts`, `checksum_of`)."""
        parts = self.checksum_parts(f)
        return None if parts is None else checksum_of(*parts)

    def checksum_parts(self, f: CFile) -> tuple[int, int, dict] | None:
        """What `checksum_of` needs, copied (event loop); None while any chunk is in memory."""
        if f.mem:
            return None
        return f.size, f.chunk_bytes, dict(f.stored)

    def stats(self) -> dict:
        steps = [n for n in self.nodes.values() if isinstance(n, CStep)]
        files = [n for n in self.nodes.values() if isinstance(n, CFile)]
        states: dict[str, int] = {}
        for s in steps:
            st = self.state(s)
            states[st] = states.get(st, 0) + 1
        return {
            "runs": sum(1 for n in self.nodes.values() if n.kind == RUN),
            "steps": len(steps),
            "steps_by_state": states,
            "pinned": sum(1 for s in steps if s.pinned),
            "files": len(files),
            "bytes": sum(f.size for f in files),
            "stored_bytes": sum(self.stored_size(f) for f in files),
            "writeback": {"budget_bytes": self.budget.capacity, "held_bytes": self.budget.used,
                          "peak_bytes": self.budget.peak, "writers_waiting": self.budget.waiting,
                          "waits": self.budget.waits, "wait_s": round(self.budget.wait_s, 3)},
            "queue": {"items": len(self._queue), "tickets": self._tickets, "committed": self.committed,
                      "durable": self.durable},
            "config": self.config.to_dict(),
            **self.counters,
        }

    # ----- tree changes --------------------------------------------------------------

    async def mkdir(self, parent_id: int, name: bytes, owner: Owner) -> CDir:
        parent = self.dir(parent_id)
        check_name(name)
        kind = _CHILD_KIND[parent.kind]
        if kind == DIR:
            await self._reopen(self.step_of(parent))
        change = MakeNode(self, parent_id, name, kind, owner)
        await self.committer.submit(change)
        return change.node  # type: ignore[return-value]

    async def symlink(self, parent_id: int, name: bytes, target: bytes, owner: Owner) -> CLink:
        parent = self.dir(parent_id)
        check_name(name)
        if parent.kind not in (STEP, DIR):
            raise NotPermitted("symlinks go in a step directory: checkpoints/RUN/STEP/...")
        if not target or b"\0" in target or len(target) > 4095:
            raise InvalidArgument("invalid symlink target")
        await self._reopen(self.step_of(parent))
        change = MakeNode(self, parent_id, name, LINK, owner, target)
        await self.committer.submit(change)
        return change.node  # type: ignore[return-value]

    async def create(self, parent_id: int, name: bytes, owner: Owner) -> CFile:
        """A new empty file, open for writing (call `released` when its handle closes).

        It exists in memory at once; its record goes into the catalog with its first
        chunk or commit, so a create never waits behind the persister's transactions
        (a crash before leaves no trace of it, and its step is incomplete anyway)."""
        parent = self.dir(parent_id)
        check_name(name)
        if parent.kind not in (STEP, DIR):
            raise NotPermitted("checkpoint files go in a step directory: checkpoints/RUN/STEP/...")
        await self._reopen(self.step_of(parent))
        if not parent.attached:
            raise NotFound(f"{self.path_of(parent)} was removed")
        if name in parent.children:
            raise AlreadyExists(f"{name!r} exists")
        now = now_ns()
        f = CFile(self.next_id, FILE, parent_id, name, owner.mode, owner.uid, owner.gid, now,
                  chunk_bytes=self.config.chunk_bytes, recorded=False, atime_ns=now, ctime_ns=now)
        modified(parent, now)
        self.next_id += 1
        self.nodes[f.id] = f
        parent.children[name] = f.id
        self._attach(f, write=True)
        return f

    async def open_write(self, f: CFile, truncate: bool) -> None:
        """An existing file opened for writing (its step is opened again if it was closed)."""
        await self._reopen(self.step_of(f))
        if not f.attached:
            raise NotFound(f"{self.path_of(f)} was removed")
        self._attach(f, write=True)
        if truncate and f.size:
            try:
                await self.truncate(f, 0)
            except BaseException:
                self.released(f, write=True)
                raise

    def open_read(self, f: CFile) -> None:
        if f.error is not None:
            raise CorruptValue(f"{self.path_of(f)}: lost when it was persisted ({f.error})")
        self._attach(f, write=False)

    def _attach(self, f: CFile, write: bool) -> None:
        if not f.attached or f.dropping:
            # Removed or replaced, and gone or going with its data: reached through a lookup made
            # before that (a rename's open race). The kernel looks the name up again.
            raise Stale(f"{self.path_of(f)} was removed or replaced since it was looked up")
        step = self.step_of(f)
        if step is not None and step.going:
            raise NotFound(f"{self.path_of(f)}: its step is being removed")
        f.handles += 1
        if step is not None:
            step.handles += 1
        if write:
            f.writers += 1
            f.dirty = True
            if step is not None:
                step.writers += 1
                step.active = time.monotonic()

    def flushed(self, f: CFile) -> None:
        """close() of a write handle (a process exiting closes its files the same way: the
        two cannot be told apart reliably): what it wrote is held; persist it in the
        background."""
        self._queue_file(f)
        step = self.step_of(f)
        if step is not None:
            step.active = time.monotonic()

    def released(self, f: CFile, write: bool) -> None:
        """A handle on `f` is gone (after its last close)."""
        step = self.step_of(f)
        f.handles -= 1
        if step is not None:
            step.handles -= 1
        if write:
            f.writers -= 1
            if step is not None:
                step.writers -= 1
                step.active = time.monotonic()
            self._queue_file(f)
        self.drop_if_unopened(f)
        if step is not None and step.handles == 0 and (step.complete or step.interrupted):
            self._collect(self.nodes.get(step.parent))

    # A file removed or replaced this recently keeps its data though nobody has it open: a
    # reader that looked its name up just before (the lookup and the open are two requests,
    # and the kernel retries a Stale open only once) still opens what it looked up.
    RETIRE_GRACE_S = 1.0

    def drop_if_unopened(self, f: CFile) -> None:
        """A file without a name (removed or replaced while it could still be opened) goes,
        with its data, once no handle has it open and the grace has passed."""
        if not f.unlinked or f.handles or f.dropping:
            return
        wait = f.unlinked_at + self.RETIRE_GRACE_S - time.monotonic()
        if wait <= 0:
            self.committer.submit_nowait(RemoveTree(self, f, background=False))
        else:
            self._later.call(f.id, wait, self.drop_if_unopened, f)

    async def _reopen(self, step: CStep | None) -> None:
        """About to change something below `step`: it is being written again."""
        if step is None:
            return
        self._check_not_applied(step)
        if step.interrupted:
            raise ReadOnly(f"{self.path_of(step)} was interrupted by a crash and is read-only (remove it)")
        step.active = time.monotonic()
        if step.sealed:
            step.sealed = False
            self._sealed.discard(step)
            self._unseal(step)
        if step.complete:
            await self.committer.submit(Reopen(self, step))
            self.counters["steps_reopened"] += 1
            log.info("%s is written again: no longer complete", self.path_of(step))

    def _check_not_applied(self, step: CStep | None) -> None:
        """A step another node wrote is that node's: here it is read, or removed whole."""
        if step is not None and step.origin:
            raise ReadOnly(f"{self.path_of(step)} was written on node {step.origin} and is read-only here "
                           f"(rm -r it to drop this node's copy)")

    async def mark_incomplete(self, step: CStep) -> None:
        """A step another node wrote is no longer whole here (something below it is removed
        here, or its writer removed it while it is open here): it stops being complete, so
        `latest` moves off it and retention takes it once nothing has it open."""
        if step.complete:
            await self.committer.submit(SetStepFlags(self, step, complete=False))
        step.interrupted = step.sealed = True

    async def remove(self, parent_id: int, name: bytes, want_dir: bool) -> CNode:
        node = self.child(parent_id, name)
        if want_dir and not isinstance(node, CDir):
            raise NotADirectory(f"{self.path_of(node)} is not a directory")
        if not want_dir and isinstance(node, CDir):
            raise IsADirectory(f"{self.path_of(node)} is a directory")
        step = self.step_of(self.node(parent_id))
        if step is not None and step.origin:
            await self.mark_incomplete(step)
        elif step is not None and not step.interrupted:
            await self._reopen(step)
        await self.committer.submit(RemoveTree(self, node, background=False))
        return node

    async def rename(self, old_parent: int, old: bytes, new_parent: int, new: bytes, noreplace: bool) -> CNode:
        node = self.child(old_parent, old)
        src, dst = self.dir(old_parent), self.dir(new_parent)
        check_name(new)
        for d in (src, dst):  # a step another node wrote: nothing moves into or out of it here
            self._check_not_applied(self.step_of(d) if d.kind not in (ROOT, RUN) else None)
        if src.kind in (ROOT, RUN):
            if dst is not src:
                raise CrossDevice(f"{node.kind}s are renamed within their {src.kind}")
        elif self.step_of(src) is not self.step_of(dst) or dst.kind not in (STEP, DIR):
            raise CrossDevice("files move only within their step")
        if (src.kind == ROOT and new in CONTROL) or (src.kind == RUN and new == LATEST):
            raise AlreadyExists(f"{new!r} is reserved")
        step = self.step_of(src) if src.kind not in (ROOT, RUN) else None
        await self._reopen(step)
        change = Rename(self, node, new_parent, new, noreplace)
        await self.committer.submit(change)
        return node

    async def set_attrs(self, node: CNode, change: AttrChange) -> None:
        """chmod, chown, utimes (a size in `change` is the caller's to apply: `truncate`)."""
        if node.id == ROOT_ID or change.empty():
            return
        self._check_not_applied(self.step_of(node))
        await self.committer.submit(SetAttrs(self, node, change))

    async def set_pinned(self, step: CStep, pinned: bool) -> None:
        await self.committer.submit(SetStepFlags(self, step, pinned=pinned))
        if not pinned:
            self._collect(self.nodes.get(step.parent))

    async def configure(self, text: bytes) -> CheckpointsConfig:
        config = CheckpointsConfig.from_json(text, self.config)
        MemoryPlan.of(self.store_config, config.writeback_bytes)  # fits in memory_bytes, or InvalidConfig
        await self.committer.submit(Configure(self, config))
        for node in list(self.nodes.values()):
            if node.kind == RUN:
                self._collect(node)
        return config

    # ----- data ----------------------------------------------------------------------

    async def write(self, f: CFile, off: int, data: bytes) -> int:
        if not f.attached:
            raise NotFound(f"{self.path_of(f)} was removed")
        if f.error is not None:
            raise type(f.error)(f"{self.path_of(f)}: an earlier persist failed ({f.error})")
        n = len(data)
        if off + n > self.config.max_file_bytes:
            raise TooLarge(f"{self.path_of(f)}: a write up to byte {off + n} passes max_file_bytes "
                           f"{self.config.max_file_bytes}")
        step, view, pos, end = f.chunk_bytes, memoryview(data), off, off + n
        while pos < end:
            index, lo = divmod(pos, step)
            k = min(step - lo, end - pos)
            await self._put(f, index, lo, data if k == n else view[pos - off:pos - off + k])
            pos += k
            f.size = max(f.size, pos)
        f.dirty = True
        modified(f)
        self.counters["bytes_written"] += n
        return n

    async def _put(self, f: CFile, index: int, lo: int, piece) -> None:
        if await self._append(f, index, lo, piece):
            return
        end = lo + len(piece)
        while True:
            buf = await self._writable(f, index)
            if buf.pieces is not None:
                await self._materialize(f, index, buf)
                continue
            size = len(buf.data)
            want = size if end <= size else self._capacity(f, index, end)
            if want > size:
                await self._take(want - size)
                if f.mem.get(index) is not buf or buf.busy is not None or len(buf.data) != size:
                    self.budget.give(want - size)  # persisted or changed while we waited: again
                    continue
                self._resize(buf, want)
            if lo > buf.length:
                buf.data[buf.length:lo] = bytes(lo - buf.length)  # a hole; pooled buffers hold old bytes
            buf.data[lo:end] = piece
            buf.length = max(buf.length, end)
            f.dirty = True
            if buf.length >= f.chunk_bytes and not buf.queued:
                self._queue_chunk(f, index, buf)  # a full chunk is persisted at once
            return

    async def _append(self, f: CFile, index: int, lo: int, piece) -> bool:
        """Keep a big write that starts a new chunk, or extends a chunk of pieces, as it came
        (no copy on the request path); False when it does neither (the caller copies it)."""
        n = len(piece)

        def fits() -> Buf | None | Literal[False]:
            buf = f.mem.get(index)
            if buf is None:
                return None if index not in f.stored and f.attached else False
            return buf if buf.busy is None and buf.takes(lo, n) else False

        if fits() is False:
            return False
        await self._take(n)
        buf = fits()
        if buf is False:
            self.budget.give(n)  # changed while we waited
            return False
        if buf is None:
            buf = f.mem[index] = Buf(bytearray())
            buf.pieces = []
            self._held[f] = None
        buf.add(lo, piece)
        f.dirty = True
        if buf.covered >= f.chunk_bytes and not buf.queued:  # every byte of it here (pieces come in any order)
            self._queue_chunk(f, index, buf)
        return True

    async def _materialize(self, f: CFile, index: int, buf: Buf) -> None:
        """A chunk of pieces as one buffer (before a write that does not append to it)."""
        size = self._capacity(f, index, max(buf.length, 1))
        extra = size - buf.covered
        await self._take(extra)
        if f.mem.get(index) is not buf or buf.pieces is None or buf.busy is not None:
            self.budget.give(extra)
            return
        data = self.pool.get(size) if size >= MIN_POOLED else bytearray(size)
        data[:buf.length] = buf.read(0, buf.length)
        buf.data, buf.pieces, buf.covered = data, None, 0

    def _capacity(self, f: CFile, index: int, end: int) -> int:
        """Buffer size for chunk `index` holding `end` bytes: exact while small; a file past
        its first chunk gets whole chunks at once."""
        if index > 0 or end > f.chunk_bytes // 2:
            return f.chunk_bytes
        if end < MIN_POOLED:
            return end
        return 1 << (end - 1).bit_length()

    def _resize(self, buf: Buf, size: int) -> None:
        if size < MIN_POOLED:
            assert isinstance(buf.data, bytearray)  # (small: never the pool's)
            buf.data.extend(bytes(size - len(buf.data)))
            return
        new = self.pool.get(size)
        new[:buf.length] = memoryview(buf.data)[:buf.length]
        old, buf.data = buf.data, new
        if len(old) >= MIN_POOLED:
            self.pool.put(old)

    async def _take(self, n: int) -> None:
        """Budget for `n` more bytes held (waits while full); free pooled buffers make room."""
        self.pool.shrink(self.budget.used + self.pool.free_bytes + n - self.budget.capacity)
        await self.budget.take(n, self._full)
        self.pool.shrink(self.budget.used + self.pool.free_bytes - self.budget.capacity)

    # Chunks filled outside the tree: a writer appending to a file has chunk buffers lent to
    # whoever copies its writes (the library's front, mount/interpose.py chunks_arm), which
    # hands each back filled, whole or in part, before anything else of the file happens.

    def fillable_from(self, f: CFile) -> int | None:
        """Where an appending writer's chunks may be filled outside the tree (`lend`,
        `filled`): the file's end, when that is a chunk boundary with nothing of the file
        held or stored from there on; None otherwise."""
        if not f.attached or f.error is not None or f.size % f.chunk_bytes:
            return None
        first = f.size // f.chunk_bytes
        if any(i >= first for i in f.mem) or any(i >= first for i in f.stored):
            return None
        return f.size

    def lend(self, f: CFile) -> Memory | None:
        """A buffer of `f`'s chunk size, its bytes taken from the write-back budget, for a
        chunk to be filled from its start; None when the budget has no room now (the writes
        then come to `write`, which waits for it)."""
        n = f.chunk_bytes
        if not f.attached or f.error is not None:
            return None
        self.pool.shrink(self.budget.used + self.pool.free_bytes + n - self.budget.capacity)
        if not self.budget.take_now(n):
            return None
        return self.pool.get(n) if n >= MIN_POOLED else bytearray(n)

    def give_back(self, data: Memory) -> None:
        """A lent buffer that holds nothing of the file: its budget back, the buffer to the pool."""
        self.budget.give(len(data))
        if len(data) >= MIN_POOLED:
            self.pool.put(data)

    def filled(self, f: CFile, index: int, data: Memory, length: int) -> None:
        """Lent buffer `data` comes back as chunk `index` of `f`, `length` bytes written
        from its start: held as writes of them would have left it (persisted at once when
        whole). Given back instead when the file is gone or failed meanwhile, as a write then
        would have been refused."""
        if length == 0 or not f.attached or f.error is not None or index in f.mem or index in f.stored:
            self.give_back(data)
            return
        buf = f.mem[index] = Buf(data, length)
        self._held[f] = None
        f.size = max(f.size, index * f.chunk_bytes + length)
        f.dirty = True
        modified(f)
        self.counters["bytes_written"] += length
        self.counters["chunks_filled_outside"] += 1
        if length >= f.chunk_bytes:
            self._queue_chunk(f, index, buf)

    async def _writable(self, f: CFile, index: int) -> Buf:
        """Chunk `index` of `f` in memory and not being persisted (loaded back if stored)."""
        while True:
            if not f.attached:
                raise NotFound(f"{self.path_of(f)} was removed")
            buf = f.mem.get(index)
            if buf is not None:
                if buf.busy is not None:
                    await buf.busy.wait()
                    continue
                return buf
            chunk = f.stored.get(index)
            if chunk is None:
                buf = f.mem[index] = Buf(bytearray())
                self._held[f] = None
                return buf
            data = await self.values.fetch_one(None, chunk, self._what(f, index))
            size = self._capacity(f, index, max(len(data), 1))
            await self._take(size)
            if f.mem.get(index) is not None or f.stored.get(index) is not chunk or not f.attached:
                self.budget.give(size)
                continue
            self.counters["chunk_reloads"] += 1
            buf = f.mem[index] = Buf(self.pool.get(size) if size >= MIN_POOLED else bytearray(size), len(data))
            buf.data[:len(data)] = data
            self._held[f] = None
            return buf

    async def truncate(self, f: CFile, size: int) -> None:
        if size < 0:
            raise InvalidArgument(f"negative size {size}")
        if size > self.config.max_file_bytes:
            raise TooLarge(f"{self.path_of(f)}: size {size} passes max_file_bytes {self.config.max_file_bytes}")
        await self._reopen(self.step_of(f))
        step = f.chunk_bytes
        keep = -(-size // step)  # chunks 0..keep-1 stay
        if size < f.size:
            while True:
                busy = [b for i, b in f.mem.items() if i >= keep and b.busy is not None]
                if not busy:
                    break
                await busy[0].busy.wait()  # type: ignore[union-attr]
            for i in [i for i in f.mem if i >= keep]:
                self._drop(f, i)
            for i in [i for i in f.stored if i >= keep]:
                f.garbage.append((i, f.stored.pop(i)))
            last = size - (keep - 1) * step
            if keep and last < step and (keep - 1 in f.mem or keep - 1 in f.stored):
                buf = await self._writable(f, keep - 1)
                if buf.pieces is not None:
                    self.budget.give(buf.trim(last))
                buf.length = min(buf.length, last)
                if buf.pieces is None and not buf.pooled and len(buf.data) > buf.length:
                    freed = len(buf.data) - buf.length
                    del buf.data[buf.length:]
                    self.budget.give(freed)
        f.size = size
        f.dirty = True
        modified(f)

    def _drop(self, f: CFile, index: int, reusable: bool = True) -> None:
        buf = f.mem.pop(index)
        self.budget.give(buf.held)
        if buf.pooled and reusable:
            self.pool.put(buf.data)
        if not f.mem:
            self._held.pop(f, None)

    def free(self, txn, value: StoredValue) -> None:
        """Free a chunk value the live tree no longer names, unless a restore point pins it."""
        if value not in self.pins:
            self.drop_value(txn, value)

    def drop_value(self, txn, value: StoredValue) -> None:
        """Free a chunk value of this tree. A value in the cluster is a chunk of a step another
        node wrote: that node's copy, which it frees when it removes the step (a removal here
        drops this node's records only)."""
        if value.tier != TIER_CLUSTER:
            self.values.delete(txn, value)

    def restore_point(self, f: CFile, step: CStep) -> RestorePoint:
        return RestorePoint(f.id, step.id, f.parent, f.name, f.mode, f.uid, f.gid, f.atime_ns, f.mtime_ns,
                            f.ctime_ns, f.size, f.chunk_bytes, dict(f.stored))

    def _what(self, f: CFile, index: int) -> str:
        return f"{self.path_of(f)} chunk {index}"

    async def fsync(self, f: CFile) -> None:
        """Wait until what was written to `f` so far is durable."""
        self._queue_file(f)
        await self._wait_durable(f.ticket)
        if f.error is not None:
            raise type(f.error)(f"{self.path_of(f)}: {f.error}")
        await self._acknowledge([f])

    async def _acknowledge(self, files: list[CFile]) -> None:
        """An fsync returned: a crash gives these files back as they are now (restorepoints.py),
        unless their step completes first (it is then itself what a crash keeps)."""
        files = [f for f in files if f.attached and not f.unlinked and self._synced(f)
                 and (step := self.step_of(f)) is not None and not step.complete and not step.origin]
        if files:
            await self.committer.submit(Acknowledge(self, files))
            await self._store_sync()

    async def sync_dir(self, node: CNode) -> None:
        """fsync of a directory: everything written before it is made durable; a step
        directory nobody has open for writing is closed first, and so completes."""
        if isinstance(node, CStep) and node.writers == 0:
            self._seal(node)
        for f in [n for n in self.nodes.values() if isinstance(n, CFile) and n.dirty]:
            self._queue_file(f)
        await self._wait_durable(self._tickets)
        while isinstance(node, CStep) and node in self._sealed and self._settled(node):
            self._recheck = True  # its completion is being written: wait for it
            self._kick()
            await self._durable_event.wait()
        if isinstance(node, CDir) and node.kind in (STEP, DIR):
            await self._acknowledge(list(self.files_below(node)))

    async def _wait_durable(self, ticket: int) -> None:
        self._wanted[ticket] = self._wanted.get(ticket, 0) + 1
        try:
            while self.durable < ticket:
                self._kick()
                await self._durable_event.wait()
        finally:
            self._wanted[ticket] -= 1
            if not self._wanted[ticket]:
                del self._wanted[ticket]

    # ----- the persist queue ---------------------------------------------------------

    def _queue_chunk(self, f: CFile, index: int, buf: Buf) -> None:
        buf.queued = True
        self._queue.append(("chunk", f, index))
        f.pending += 1
        self._kick()

    def _queue_file(self, f: CFile) -> None:
        """Queue `f`'s chunks still in memory, then a commit of the file: once that commit
        is processed and synced, everything written to `f` before now is durable."""
        if not f.dirty or not f.attached:
            return
        for index in sorted(f.mem):
            buf = f.mem[index]
            if not buf.queued and buf.busy is None:  # (a busy one is being persisted as it is: no write waits)
                self._queue_chunk(f, index, buf)
        self._tickets += 1
        f.ticket = self._tickets
        f.dirty = False
        self._queue.append(("commit", f, f.ticket))
        f.pending += 1
        self._kick()

    def _evict(self) -> bool:
        """Writers wait and nothing is queued: persist chunks still being filled (the
        largest first) so memory frees up; a later write to one loads it back."""
        victims = sorted(((buf.held, f, i) for f in self._held for i, buf in f.mem.items()
                          if not buf.queued and buf.busy is None), key=lambda t: -t[0])
        freed = 0
        for length, f, i in victims:
            if freed >= max(self.budget.capacity // 4, 1):
                break
            self._queue_chunk(f, i, f.mem[i])
            freed += length
            self.counters["evictions"] += 1
        return bool(freed or victims)

    async def _persist_chunk(self, f: CFile, index: int) -> None:
        """A task of the persister's: one chunk into its tier; then the persister may take
        the next."""
        try:
            await self._persist_one(f, index)
        except Exception:  # never lose the persister to a bug here
            log.exception("persisting chunk %d of %s", index, self.path_of(f))
        finally:
            left = self._persisting.pop(f) - 1
            if left:
                self._persisting[f] = left
            self._landed.set()
            self._landed = trio.Event()
            self._kick()

    async def _persist_one(self, f: CFile, index: int) -> None:
        buf = f.mem.get(index)
        if buf is None or not buf.queued or not f.attached:
            return
        buf.queued = False
        buf.busy = done = trio.Event()
        target = None
        if buf.pieces is not None:  # joined in the worker thread, into a buffer of the pool
            target = self.pool.get(f.chunk_bytes) if buf.length >= MIN_POOLED else bytearray(buf.length)
            change = PersistChunk(self, f, index, None, (list(buf.pieces), buf.length, target))
        else:
            change = PersistChunk(self, f, index, memoryview(buf.data)[:buf.length])
        try:
            # joined and encoded here, so that the committer's transaction (the write) of the
            # chunk before runs meanwhile
            try:
                await trio.to_thread.run_sync(change.encode)
            except DistorefsError:
                raise
            except Exception as exc:
                raise DistorefsError(f"encoding failed: {exc}") from exc
            await self.committer.submit(change)
            self.counters["chunks_persisted"] += 1
            self.counters["bytes_persisted"] += buf.length
        except DistorefsError as exc:
            if f.attached:
                self._failed(f, exc)
        finally:
            reusable = change.release()  # a buffer still viewed elsewhere is not reused
            if target is not None and reusable and len(target) >= MIN_POOLED:
                self.pool.put(target)
            buf.busy = None
            done.set()
        if f.mem.get(index) is buf:
            self._drop(f, index, reusable)

    async def _commit_file(self, f: CFile, ticket: int) -> None:
        try:
            if f.attached:
                await self.committer.submit(CommitFile(self, f))
                self.counters["file_commits"] += 1
        except DistorefsError as exc:
            if f.attached:
                self._failed(f, exc)
        finally:
            self.committed = max(self.committed, ticket)

    def _failed(self, f: CFile, exc: DistorefsError) -> None:
        f.error = exc
        self.counters["persist_failures"] += 1
        log.error("persisting %s failed: %s (its step will not complete)", self.path_of(f), exc)

    async def _sync(self) -> None:
        upto = self.committed
        try:
            await self._store_sync()
        except Exception:
            log.exception("checkpoint sync failed")
            await trio.sleep(0.5)
            return
        self.durable = max(self.durable, upto)
        self.counters["syncs"] += 1
        await self._complete_steps()

    async def _complete_steps(self) -> None:
        """Closed steps whose files are all durable become complete (`latest` and retention
        move); then waiters are woken, once the completions are on disk too."""
        self._recheck = False
        completed = []
        for step in sorted(self._sealed, key=lambda s: s.id):
            verdict = self._settled(step)
            if verdict is None:
                self._sealed.discard(step)
                log.warning("%s cannot complete (a file of it was cut short or failed)", self.path_of(step))
            elif verdict:
                self._sealed.discard(step)
                try:
                    await self.committer.submit(SetStepFlags(self, step, complete=True))
                except DistorefsError as exc:
                    log.debug("completing %s: %s", self.path_of(step), exc)
                    continue
                completed.append(step)
        try:
            if completed:
                await self._store_sync()
        except Exception:
            log.exception("checkpoint sync failed")
        for step in completed:
            self.counters["steps_completed"] += 1
            self._collect(self.nodes.get(step.parent))
            if self.sharing is not None and step.attached and step.complete:
                self.sharing.completed(step)  # copied to the cluster in the background, then announced
        self._durable_event.set()
        self._durable_event = trio.Event()

    # ----- retention -----------------------------------------------------------------

    def _victims(self, run: CDir, removing: bool = True) -> list[CStep]:
        """Steps of `run` retention removes (`removing`: leave out those being removed)."""
        steps = [s for s in (self.nodes[i] for i in run.children.values()) if isinstance(s, CStep)]
        complete = sorted((s for s in steps if s.complete), key=lambda s: s.id)
        kept = set(complete[-self.config.keep_last:])
        newest = complete[-1].id if complete else 0
        acknowledged = {rp.step_id for rp in self.restore.values()}
        return [s for s in steps if not s.pinned and s.handles == 0 and not (removing and s.id in self._removing)
                and ((s.complete and s not in kept) or (s.interrupted and s.id < newest and s.id not in acknowledged))]

    def retention(self, run: CNode | None) -> None:
        """Apply retention to `run` now (a step of it completed, or was applied)."""
        self._collect(run)

    def _collect(self, run: CNode | None) -> None:
        """Remove, in the background, steps no longer kept (see the module docstring)."""
        if not isinstance(run, CDir) or run.kind != RUN or not run.attached:
            return
        for step in self._victims(run):
            self._removing.add(step.id)
            self.committer.submit_nowait(RemoveTree(self, step, background=True))


class FileReader:
    """One open read handle of a checkpoint file: content still in memory is served from
    there, stored chunks are loaded (and verified) in worker threads, `AHEAD` of them
    beyond the one being read at once, so a sequential read streams from disk.

    A chunk is loaded into a free buffer of the pool when there is one (given back when
    the reader moves past it), not into new bytes: after a checkpoint the pool holds its
    chunks' buffers, and new memory, long free, is slow to touch on a VM (README)."""

    AHEAD = 2

    def __init__(self, tree: "Checkpoints", f: CFile) -> None:
        self.tree, self.f = tree, f
        # chunk index: (its value, its bytes, the pool's buffer they are in or None)
        self.cache: dict[int, tuple[StoredValue, bytes | memoryview, Memory | None]] = {}
        self.loading: dict[int, trio.Event] = {}
        self.closed = False  # (a load that lands after the close gives its buffer back)

    async def read(self, off: int, size: int) -> bytes | memoryview:
        f = self.f
        if not f.attached:
            raise NotFound(f"{self.tree.path_of(f)} was removed")
        if f.error is not None:
            raise CorruptValue(f"{self.tree.path_of(f)}: lost when it was persisted ({f.error})")
        end = min(off + size, f.size)
        if off >= end:
            return b""
        step = f.chunk_bytes
        parts: list = []
        first, last = off // step, (end - 1) // step
        for i in range(first, last + 1):
            lo, hi = max(off - i * step, 0), min(end - i * step, step)
            buf = f.mem.get(i)
            if buf is not None:
                parts.append(buf.read(lo, hi))
                continue
            chunk = f.stored.get(i)
            if chunk is None:
                parts.append(bytes(hi - lo))
                continue
            if i == first:
                self._ahead(i)
            data = await self._chunk(i, chunk)
            piece: bytes | memoryview = memoryview(data)[lo:hi]
            if len(piece) < hi - lo or first < last:  # (a view kept across the next await: its buffer may go back)
                piece = bytes(piece) + bytes(hi - lo - len(piece))
            parts.append(piece)
        # pyfuse3 replies from any buffer, before any other task runs: a view of a pooled
        # buffer is not given back meanwhile
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _chunk(self, i: int, chunk: StoredValue) -> bytes | memoryview:
        while True:
            held = self.cache.get(i)
            if held is not None and held[0] is chunk:
                return held[1]
            await self._fetch(i, chunk)

    async def _fetch(self, i: int, chunk: StoredValue) -> None:
        """Load chunk i into the cache, or wait for the load already under way."""
        event = self.loading.get(i)
        if event is not None:
            await event.wait()
            return
        event = self.loading[i] = trio.Event()
        try:
            data, buf = await self._load(i, chunk)
        finally:
            del self.loading[i]
            event.set()
        self._forget(i)
        self.cache[i] = (chunk, data, buf)
        if self.closed:
            self._forget(i)

    async def _load(self, i: int, chunk: StoredValue) -> tuple[bytes | memoryview, Memory | None]:
        what, values, pool = self.tree._what(self.f, i), self.tree.values, self.tree.pool
        buf = pool.take_free(self.f.chunk_bytes)
        if buf is not None:
            try:
                view = await trio.to_thread.run_sync(values.read_into, chunk, what, buf)
            except (CorruptValue, NotFound) as exc:
                pool.put(buf)
                raise values.report_corrupt(exc) from None
            except BaseException:
                pool.put(buf)
                raise
            if view is not None:
                return view, buf
            pool.put(buf)
        return await values.fetch_one(None, chunk, what), None

    def _forget(self, i: int) -> None:
        held = self.cache.pop(i, None)
        if held is not None and held[2] is not None:
            self.tree.pool.put(held[2])

    def _ahead(self, i: int) -> None:
        """Reading chunk i: forget those behind it, start loading the next ones."""
        for old in [k for k in self.cache if k < i - 1 or k > i + self.AHEAD]:
            self._forget(old)
        for j in range(i + 1, i + 1 + self.AHEAD):
            chunk = self.f.stored.get(j)
            if chunk is None or j in self.f.mem or j in self.cache or j in self.loading:
                continue

            async def load(j=j, chunk=chunk) -> None:
                try:
                    await self._fetch(j, chunk)
                except Exception as exc:  # the read itself will report it
                    log.debug("read-ahead of %s: %s", self.tree._what(self.f, j), exc)

            self.tree._spawn(load)

    def close(self) -> None:
        self.closed = True
        for i in list(self.cache):
            self._forget(i)


# ----- changes -------------------------------------------------------------------------------

class _CkptChange(Change):
    def __init__(self, tree: Checkpoints) -> None:
        self.tree = tree
        self.conflict_key = ("checkpoints",)  # one at a time, in submission order

    db = DB_CKPT
    dropped: list[RestorePoint]  # restore points a removal's transaction deleted (_remove_txn)

    def _put(self, txn, node: CNode, **changes) -> None:
        record = {**node.record(), **changes}
        if "name" in changes:
            record["name"] = changes["name"].hex()
        txn.put(_nkey(node.id), json.dumps(record).encode(), db=self.db)


class MakeNode(_CkptChange):
    """mkdir (a run, a step or a directory in a step) and symlink (files are made by `create`)."""

    def __init__(self, tree, parent_id: int, name: bytes, kind: str, owner: Owner, target: bytes = b"") -> None:
        super().__init__(tree)
        self.parent_id, self.name, self.kind, self.owner, self.target = parent_id, name, kind, owner, target

    def plan(self, overlay: Overlay) -> None:
        tree = self.tree
        parent = tree.dir(self.parent_id)
        if self.name in parent.children:
            raise AlreadyExists(f"{self.name!r} exists")
        if (parent.kind == ROOT and self.name in CONTROL) or (parent.kind == RUN and self.name == LATEST):
            raise AlreadyExists(f"{self.name!r} is reserved")
        o = self.owner
        self.now = now = now_ns()
        args = (tree.next_id, self.kind, self.parent_id, self.name, o.mode, o.uid, o.gid, now)
        times: _Times = {"atime_ns": now, "ctime_ns": now}
        self.node: CNode
        if self.kind == STEP:
            self.node = CStep(*args, active=time.monotonic(), **times)
        elif self.kind == LINK:
            self.node = CLink(*args, target=self.target, **times)
        else:
            self.node = CDir(*args, **times)
        tree.next_id += 1

    def txn(self, txn) -> None:
        self._put(txn, self.node)
        parent = self.tree.nodes[self.parent_id]
        if parent.id != ROOT_ID:
            self._put(txn, parent, mtime_ns=self.now, ctime_ns=self.now)

    def apply(self) -> None:
        tree, node = self.tree, self.node
        tree.nodes[node.id] = node
        parent = tree.nodes[self.parent_id]
        modified(parent, self.now)
        parent.children[node.name] = node.id  # type: ignore[attr-defined]
        if isinstance(node, CStep):
            # a newer step: the save loop has moved on, so the older ones are closed
            for sibling_id in parent.children.values():  # type: ignore[attr-defined]
                sibling = tree.nodes[sibling_id]
                if isinstance(sibling, CStep) and sibling is not node and sibling.writers == 0:
                    tree._seal(sibling)
            tree._unseal(node)


class PersistChunk(_CkptChange):
    """One chunk of a file from memory into its tier (the value and its record together).
    The chunk's buffer is read in place (it is busy: no write changes it meanwhile)."""

    def __init__(self, tree, f: CFile, index: int, view: memoryview | None, join=None) -> None:
        super().__init__(tree)
        self.f, self.index, self.view, self.join = f, index, view, join
        self.enc: codec.Encoded | None = None

    def plan(self, overlay: Overlay) -> None:
        if not self.f.attached:
            raise NotFound(f"{self.tree.path_of(self.f)} was removed")
        self.old = self.f.stored.get(self.index)
        self.record = None if self.f.recorded else self.f.record()  # a new file: its record too

    def encode(self) -> None:
        """Join and encode the chunk (worker thread, before the change is submitted). The
        buffer stays unchanged until `release`, so a chunk stored raw is written from it."""
        if self.join is not None:  # a chunk of pieces: one buffer first, without the GIL
            pieces, length, target = self.join
            self.view = join_pieces(pieces, length, target)
            self.join = None
        view, config = self.view, self.tree.config
        assert view is not None  # given, or joined above
        if config.compression == "none":
            self.enc = codec.Encoded(view, codec.RAW, len(view), codec.checksum(view))
        else:
            self.enc = codec.encode(view, config.compression, copy=False)

    def txn(self, txn) -> None:
        values = self.tree.values
        raw = txn.get(_GEN_KEY, db=self.db)
        gen = (_ID.unpack(bytes(raw))[0] if raw is not None else 0) + 1
        txn.put(_GEN_KEY, _ID.pack(gen), db=self.db)
        # every stored chunk has its own value key: the LMDB tier's location *is* the key
        vkey = b"k" + _ID.pack(self.f.id) + _IDX.pack(self.index) + _ID.pack(gen)
        # a checkpoint is read back at a resume, if ever: its bytes skip the page cache
        assert self.enc is not None  # encoded before the change is submitted
        self.chunk = values.put(txn, vkey, self.enc, direct=True)
        txn.put(_ckey(self.f.id, self.index), self.chunk.pack(), db=self.db)
        if self.old is not None:
            self.tree.free(txn, self.old)
        if self.record is not None:
            txn.put(_nkey(self.f.id), json.dumps(self.record).encode(), db=self.db)

    def apply(self) -> None:
        self.f.stored[self.index] = self.chunk
        self.f.recorded = True

    def release(self) -> bool:
        """Drop every view of the chunk's buffer; False if one is still held elsewhere."""
        self.enc = None
        if self.view is None:
            return True
        try:
            self.view.release()
        except BufferError:
            return False
        return True


class CommitFile(_CkptChange):
    """A file's record (size, times) as of now; chunks truncated away are freed."""

    def __init__(self, tree, f: CFile) -> None:
        super().__init__(tree)
        self.f = f

    def plan(self, overlay: Overlay) -> None:
        if not self.f.attached:
            raise NotFound(f"{self.tree.path_of(self.f)} was removed")
        self.record = self.f.record()
        self.garbage = list(self.f.garbage)
        self.reused = {i for i, _ in self.garbage if i in self.f.stored}  # stored again since: keep the record

    def txn(self, txn) -> None:
        txn.put(_nkey(self.f.id), json.dumps(self.record).encode(), db=self.db)
        for index, chunk in self.garbage:
            if index not in self.reused:
                txn.delete(_ckey(self.f.id, index), db=self.db)
            self.tree.free(txn, chunk)

    def apply(self) -> None:
        done = {id(c) for _, c in self.garbage}
        self.f.garbage = [(i, c) for i, c in self.f.garbage if id(c) not in done]
        self.f.recorded = True


class SetStepFlags(_CkptChange):
    def __init__(self, tree, step: CStep, complete: bool | None = None, pinned: bool | None = None) -> None:
        super().__init__(tree)
        self.step, self.complete, self.pinned = step, complete, pinned

    def plan(self, overlay: Overlay) -> None:
        step = self.step
        if not step.attached:
            raise NotFound(f"{self.tree.path_of(step)} was removed")
        if self.complete and (step.sealed is False or step.interrupted or self.tree._settled(step) is not True):
            raise NotFound(f"{self.tree.path_of(step)} changed before it completed")
        self.values = {k: v for k, v in (("complete", self.complete), ("pinned", self.pinned)) if v is not None}
        self.dropped: list[RestorePoint] = []
        if self.complete:  # complete: the step itself is what a crash keeps now
            self.values["reopened"] = False
            self.dropped = [rp for rp in self.tree.restore.values() if rp.step_id == step.id]
            self.live = {(c.tier, c.loc) for f in self.tree.files_below(step) for c in f.stored.values()}

    def txn(self, txn) -> None:
        self._put(txn, self.step, **self.values)
        if self.dropped:
            _drop_restore_txn(self, txn, self.dropped, self.live, set())

    def apply(self) -> None:
        for k, v in self.values.items():
            setattr(self.step, k, v)
        _forget_restore(self.tree, self.dropped)


class SetAttrs(_CkptChange):
    def __init__(self, tree, node: CNode, change: AttrChange) -> None:
        super().__init__(tree)
        self.node = node
        self.change = change

    def plan(self, overlay: Overlay) -> None:
        n = self.node
        self.updated = CNode(n.id, n.kind, n.parent, n.name, n.mode, n.uid, n.gid, n.mtime_ns, atime_ns=n.atime_ns,
                             ctime_ns=n.ctime_ns)
        apply_setattr(self.updated, self.change)
        u = self.updated
        self.values = {"mode": u.mode, "uid": u.uid, "gid": u.gid, "atime_ns": u.atime_ns, "mtime_ns": u.mtime_ns,
                       "ctime_ns": u.ctime_ns}

    def txn(self, txn) -> None:
        if self.node.attached:
            self._put(txn, self.node, **self.values)

    def apply(self) -> None:
        for k, v in self.values.items():
            setattr(self.node, k, v)
        if isinstance(self.node, CFile):
            self.node.recorded = True


class Configure(_CkptChange):
    def __init__(self, tree, config: CheckpointsConfig) -> None:
        super().__init__(tree)
        self.config = config

    def txn(self, txn) -> None:
        txn.put(b"checkpoints", self.config.to_json(), db=DB_META)

    def apply(self) -> None:
        self.tree.config = self.config
        self.tree._memory_changed()


def _subtree(tree: Checkpoints, node: CNode) -> list[CNode]:
    out = [node]
    if isinstance(node, CDir):
        for child_id in list(node.children.values()):
            out.extend(_subtree(tree, tree.nodes[child_id]))
    return out


def _rkey(file_id: int) -> bytes:
    return b"r" + _ID.pack(file_id)


def _dropped_restore_points(tree: "Checkpoints", nodes: list[CNode]) -> list[RestorePoint]:
    """The restore points a removal of `nodes` ends: those of a step removed whole, and of a
    file removed from a step that was never complete (its user removed what was acknowledged;
    in a reopened step the file comes back if a crash cuts the step short)."""
    steps = {n.id for n in nodes if isinstance(n, CStep)}
    files = {n.id for n in nodes if isinstance(n, CFile)}
    out = []
    for rp in tree.restore.values():
        step = tree.nodes.get(rp.step_id)
        if rp.step_id in steps or (rp.file_id in files and not (isinstance(step, CStep) and step.reopened)):
            out.append(rp)
    return out


def _drop_restore_txn(change: _CkptChange, txn, rps: list[RestorePoint], live: set, freed: set) -> None:
    """Delete restore points; free the values they alone pinned that nothing live names."""
    tree = change.tree
    gone: Counter = Counter()
    for rp in rps:
        gone.update(rp.values())
        txn.delete(_rkey(rp.file_id), db=change.db)
    for rp in rps:
        for chunk in rp.chunks.values():
            key = (chunk.tier, chunk.loc)
            if key in freed or key in live or tree.pins.count.get(key, 0) - gone[key] > 0:
                continue
            freed.add(key)
            tree.drop_value(txn, chunk)


def _remove_txn(change: _CkptChange, txn, nodes: list[CNode]) -> None:
    tree = change.tree
    dropped = _dropped_restore_points(tree, nodes)
    gone: Counter = Counter()
    for rp in dropped:
        gone.update(rp.values())
    freed: set = set()
    for n in nodes:
        txn.delete(_nkey(n.id), db=change.db)
        if isinstance(n, CFile):
            for index, chunk in list(n.stored.items()) + n.garbage:
                txn.delete(_ckey(n.id, index), db=change.db)
                key = (chunk.tier, chunk.loc)
                if tree.pins.count.get(key, 0) - gone[key] > 0 or key in freed:
                    continue  # a restore point still names it
                freed.add(key)
                tree.drop_value(txn, chunk)
    _drop_restore_txn(change, txn, dropped, set(), freed)
    change.dropped = dropped
    steps = [n for n in nodes if isinstance(n, CStep)]
    if steps and tree.sharing is not None:
        tree.sharing.removing(txn, steps)


def _forget_restore(tree: "Checkpoints", rps: list[RestorePoint]) -> None:
    for rp in rps:
        if tree.restore.get(rp.file_id) is rp:
            del tree.restore[rp.file_id]
            tree.pins.remove(rp)


def _remove_apply(tree: Checkpoints, nodes: list[CNode], dropped: Iterable[RestorePoint] = ()) -> None:
    _forget_restore(tree, list(dropped))
    top = nodes[0]
    parent = tree.nodes.get(top.parent)
    if isinstance(parent, CDir) and parent.children.get(top.name) == top.id:
        del parent.children[top.name]
    for n in nodes:
        n.attached = False
        tree.nodes.pop(n.id, None)
        tree._removing.discard(n.id)
        if isinstance(n, CStep):
            tree._sealed.discard(n)
            tree._unsealed.discard(n)
        elif isinstance(n, CFile):
            for index in [i for i, b in n.mem.items() if b.busy is None]:
                tree._drop(n, index)  # busy ones are dropped by the persister when it is done
    steps = [n for n in nodes if isinstance(n, CStep)]
    if steps and tree.sharing is not None:
        tree.sharing.removed(steps)


class RemoveTree(_CkptChange):
    """rm / rmdir (background=False), or retention removing a whole step (background=True);
    `whole`: a step with what it holds, at the word of the node that wrote it (checkpointslog.py)."""

    def __init__(self, tree, node: CNode, background: bool, whole: bool = False) -> None:
        super().__init__(tree)
        self.node, self.background, self.whole = node, background, whole

    def plan(self, overlay: Overlay) -> None:
        node, tree = self.node, self.tree
        if not node.attached:
            raise NotFound(f"{tree.path_of(node)} is gone")
        if self.background:
            parent = tree.nodes.get(node.parent)
            if not isinstance(node, CStep) or not isinstance(parent, CDir) or node not in tree._victims(parent, removing=False):
                tree._removing.discard(node.id)
                raise NotFound(f"{tree.path_of(node)} is kept after all")
        elif isinstance(node, CDir) and node.children and not self.whole:
            raise NotEmpty(f"{tree.path_of(node)} is not empty")
        # a file without a name, going with its data
        self.drop = node if isinstance(node, CFile) and node.unlinked else None
        if self.drop is not None:
            if self.drop.handles:  # opened again in its grace: its last close drops it
                raise NotFound(f"{tree.path_of(node)} is open again")
            self.drop.dropping = True
        # A file loses its name now and its data at its last close, or right after this change
        # if nobody has it open then: until the change is applied the name still opens it,
        # and an open can come while its transaction runs (in a worker thread).
        self.keep_open = isinstance(node, CFile) and not node.unlinked and not (self.background or self.whole)
        self.nodes = _subtree(tree, node)
        self.now = now_ns()
        self.going = [n for n in self.nodes if isinstance(n, CStep)] if self.background or self.whole else []
        if self.whole and any(step.handles for step in self.going):
            # opened here since the follower looked: its data stay until it is closed (the
            # follower marks it incomplete instead, and retention takes it then)
            raise Busy(f"{tree.path_of(node)} is open here")
        for step in self.going:
            step.going = True

    def failed(self) -> None:
        for step in self.going:
            step.going = False
        if self.drop is not None:
            self.drop.dropping = False

    def txn(self, txn) -> None:
        if self.keep_open:
            self._put(txn, self.node, unlinked=True)
        else:
            _remove_txn(self, txn, self.nodes)

    def apply(self) -> None:
        parent = self.tree.nodes.get(self.node.parent)
        if isinstance(parent, CDir) and parent.children.get(self.node.name) == self.node.id:
            modified(parent, self.now)
        if self.keep_open:
            del parent.children[self.node.name]  # type: ignore[union-attr]
            self.node.unlinked = True
            if isinstance(self.node, CFile):  # (keep_open: always)
                self.node.unlinked_at = time.monotonic()
            changed(self.node, self.now)
            self.tree.drop_if_unopened(self.node)  # type: ignore[arg-type]
            return
        _remove_apply(self.tree, self.nodes, self.dropped)
        if self.background or self.whole:
            self.tree.counters["steps_removed" if self.background else "applied_steps_removed"] += 1
            for listener in self.tree.listeners:
                try:
                    listener(self.node)
                except Exception:
                    log.exception("checkpoint listener failed")


class Rename(_CkptChange):
    def __init__(self, tree, node: CNode, new_parent: int, new_name: bytes, noreplace: bool) -> None:
        super().__init__(tree)
        self.node, self.new_parent, self.new_name, self.noreplace = node, new_parent, new_name, noreplace

    def plan(self, overlay: Overlay) -> None:
        tree, node = self.tree, self.node
        if not node.attached:
            raise NotFound(f"{tree.path_of(node)} is gone")
        dst = tree.dir(self.new_parent)
        p: CNode | None
        ancestors, p = [], dst
        while p is not None:
            ancestors.append(p.id)
            p = tree.nodes.get(p.parent) if p.id != ROOT_ID else None
        target_id = dst.children.get(self.new_name)
        target = tree.nodes[target_id] if target_id is not None else None
        check_rename(node, node.name, target, self.new_name, ancestors, noreplace=self.noreplace, exchange=False,
                     target_empty=lambda: not target.children)  # type: ignore[union-attr]
        if target is node:
            target = None
        if isinstance(target, CStep) and target.handles:
            raise NotPermitted(f"{tree.path_of(target)} is open")
        self.target = target
        # a replaced file loses its name now and its data at its last close, or right after
        # this change if nobody has it open then (an open can come until it is applied)
        self.held: CFile | None = target if isinstance(target, CFile) else None
        self.victims: list[CNode] = _subtree(tree, target) if target is not None and self.held is None else []

    def txn(self, txn) -> None:
        self._put(txn, self.node, parent=self.new_parent, name=self.new_name)
        if self.held is not None:
            self._put(txn, self.held, unlinked=True)
        _remove_txn(self, txn, self.victims)

    def apply(self) -> None:
        tree, node = self.tree, self.node
        if self.held is not None:
            self.held.unlinked = True
            self.held.unlinked_at = time.monotonic()
            changed(self.held)
            tree.drop_if_unopened(self.held)
        if self.victims:
            _remove_apply(tree, self.victims, getattr(self, "dropped", []))
        old_parent = tree.nodes[node.parent]
        if old_parent.children.get(node.name) == node.id:  # type: ignore[attr-defined]
            del old_parent.children[node.name]  # type: ignore[attr-defined]
        tree.nodes[self.new_parent].children[self.new_name] = node.id  # type: ignore[attr-defined]
        node.parent, node.name = self.new_parent, self.new_name
        now = now_ns()
        changed(node, now)
        modified(old_parent, now)
        modified(tree.nodes[self.new_parent], now)
        if isinstance(node, CFile):
            node.recorded = True


class Reopen(_CkptChange):
    """A complete step is written again: it stops being complete, and each of its files gets
    a restore point (its content now), so a crash before the step completes again gives
    the step back as it was (restorepoints.py)."""

    def __init__(self, tree, step: CStep) -> None:
        super().__init__(tree)
        self.step = step

    def plan(self, overlay: Overlay) -> None:
        if not self.step.attached:
            raise NotFound(f"{self.tree.path_of(self.step)} was removed")
        tree = self.tree
        self.points = [tree.restore_point(f, self.step) for f in tree.files_below(self.step)
                       if f.id not in tree.restore]

    def txn(self, txn) -> None:
        self._put(txn, self.step, complete=False, reopened=True)
        for rp in self.points:
            txn.put(_rkey(rp.file_id), rp.pack(), db=self.db)

    def apply(self) -> None:
        self.step.complete, self.step.reopened = False, True
        self.step.epoch += 1
        for rp in self.points:
            self.tree.restore[rp.file_id] = rp
            self.tree.pins.add(rp)


class Forget(_CkptChange):
    """At a clean start, a reopened step's restore points are no longer needed (no crash)."""

    def __init__(self, tree, step: CStep) -> None:
        super().__init__(tree)
        self.step = step

    def plan(self, overlay: Overlay) -> None:
        tree = self.tree
        self.points = [rp for rp in tree.restore.values() if rp.step_id == self.step.id]
        self.live = {(c.tier, c.loc) for f in tree.files_below(self.step) for c in f.stored.values()}

    def txn(self, txn) -> None:
        self._put(txn, self.step, reopened=False)
        _drop_restore_txn(self, txn, self.points, self.live, set())

    def apply(self) -> None:
        self.step.reopened = False
        _forget_restore(self.tree, self.points)


class Acknowledge(_CkptChange):
    """An fsync returned: each file's restore point becomes what it holds now (durable)."""

    def __init__(self, tree, files: list[CFile]) -> None:
        super().__init__(tree)
        self.files = files

    def plan(self, overlay: Overlay) -> None:
        tree = self.tree
        self.points = []
        for f in self.files:
            step = tree.step_of(f)
            if f.attached and not f.unlinked and step is not None and tree._synced(f):
                self.points.append((tree.restore.get(f.id), tree.restore_point(f, step)))

    def txn(self, txn) -> None:
        for old, new in self.points:
            txn.put(_rkey(new.file_id), new.pack(), db=self.db)
            if old is not None:  # what only the old point named, and the file no longer does, goes
                keep = new.values()
                for chunk in old.chunks.values():
                    key = (chunk.tier, chunk.loc)
                    if key not in keep and self.tree.pins.count.get(key, 0) <= 1:
                        self.tree.drop_value(txn, chunk)

    def apply(self) -> None:
        for old, new in self.points:
            if old is not None:
                self.tree.pins.remove(old)
            self.tree.restore[new.file_id] = new
            self.tree.pins.add(new)


class Restore(_CkptChange):
    """At start, a step a crash cut short after restore points were taken: each file with a
    restore point is put back to it (recreated if it was removed); in a step that was
    complete before, files without one (new since) go, and the step is complete again."""

    def __init__(self, tree, step: CStep) -> None:
        super().__init__(tree)
        self.step = step

    def plan(self, overlay: Overlay) -> None:
        tree, step = self.tree, self.step
        self.points = [rp for rp in tree.restore.values() if rp.step_id == step.id]
        pointed = {rp.file_id for rp in self.points}
        self.extra = [f for f in tree.files_below(step) if f.id not in pointed] if step.reopened else []
        below = {n.id for n in _subtree(tree, step)}
        self.places = {}
        for rp in self.points:
            parent = rp.parent if rp.parent in below and isinstance(tree.nodes.get(rp.parent), CDir) else step.id
            self.places[rp.file_id] = parent
        self.complete = step.reopened

    def txn(self, txn) -> None:
        tree = self.tree
        pinned = {k for rp in self.points for k in rp.values()}
        extra_ids = {f.id for f in self.extra}
        for f in self.extra:
            txn.delete(_nkey(f.id), db=self.db)
            for index, chunk in list(f.stored.items()) + f.garbage:
                txn.delete(_ckey(f.id, index), db=self.db)
                if (chunk.tier, chunk.loc) not in pinned:
                    tree.drop_value(txn, chunk)
        for rp in self.points:
            node = tree.nodes.get(rp.file_id)
            if isinstance(node, CFile):
                for index, chunk in list(node.stored.items()) + node.garbage:
                    if rp.chunks.get(index) is not chunk:
                        txn.delete(_ckey(node.id, index), db=self.db)
                        if (chunk.tier, chunk.loc) not in pinned and node.id not in extra_ids:
                            tree.drop_value(txn, chunk)
            record = {"kind": FILE, "parent": self.places[rp.file_id], "name": rp.name.hex(), "mode": rp.mode,
                      "uid": rp.uid, "gid": rp.gid, "mtime_ns": rp.mtime_ns, "atime_ns": rp.atime_ns,
                      "ctime_ns": rp.ctime_ns, "size": rp.size, "chunk_bytes": rp.chunk_bytes}
            txn.put(_nkey(rp.file_id), json.dumps(record).encode(), db=self.db)
            for index, chunk in rp.chunks.items():
                txn.put(_ckey(rp.file_id, index), chunk.pack(), db=self.db)
            if self.complete:
                txn.delete(_rkey(rp.file_id), db=self.db)
        if self.complete:
            self._put(txn, self.step, complete=True, reopened=False)

    def apply(self) -> None:
        tree, step = self.tree, self.step
        for f in self.extra:
            parent = tree.nodes.get(f.parent)
            if isinstance(parent, CDir) and parent.children.get(f.name) == f.id:
                del parent.children[f.name]
            f.attached = False
            tree.nodes.pop(f.id, None)
        for rp in self.points:
            old = tree.nodes.get(rp.file_id)
            if isinstance(old, CFile):
                parent = tree.nodes.get(old.parent)
                if isinstance(parent, CDir) and parent.children.get(old.name) == old.id:
                    del parent.children[old.name]
            f = CFile(rp.file_id, FILE, self.places[rp.file_id], rp.name, rp.mode, rp.uid, rp.gid, rp.mtime_ns,
                      size=rp.size, chunk_bytes=rp.chunk_bytes, atime_ns=rp.atime_ns, ctime_ns=rp.ctime_ns)
            f.stored = dict(rp.chunks)
            tree.nodes[f.id] = f
            clash = tree.nodes[f.parent].children.get(f.name)  # type: ignore[attr-defined]
            if clash is not None and clash != f.id:
                log.warning("%s: restored over %s", tree.path_of(f), clash)
            tree.nodes[f.parent].children[f.name] = f.id  # type: ignore[attr-defined]
        if self.complete:
            step.complete, step.reopened, step.interrupted, step.sealed = True, False, False, False
            _forget_restore(tree, self.points)
        log.warning("%s was cut short by a crash: put back to its restore points (%d files%s)", tree.path_of(step),
                    len(self.points), ", complete again" if self.complete else "")


__all__ = ["Checkpoints", "CNode", "CDir", "CStep", "CFile", "CLink", "LINK", "DB_CKPT", "ROOT_ID", "RUN", "STEP", "DIR", "FILE",
           "FileReader", "LATEST", "CONTROL", "WRITING", "PERSISTING", "DURABLE", "INCOMPLETE", "WritebackBudget"]

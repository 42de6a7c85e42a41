"""Snapshots of a shared store's log: what a node joining late starts from, and what lets
the log be trimmed.

Without them the log (distorefs/clusterlog.py) grows for ever: every insert, priority
write and tree change stays in Redis memory (about 200 B a record) and a node joining late
replays all of it. A snapshot is a second Redis Stream, `{distorefs:STORE}:snap:N`, of
records in the log's own vocabulary which, applied to an empty store, give what the log
gives up to its id `at`:

- buffers/ and banks/: from the state of the node that makes it, taken at `at` exactly
  (its follower takes it between two batches, and nothing else changes a shared
  namespace): a `create` per namespace with its config now (the layout its first entry
  fixed is in it), and an `insert` per live entry in FIFO order with its priority now;
- weights/, datasets/ and checkpoints/: from their records (those of the snapshot before
  and the log's since): weights/ as the tree they leave, a directory and each file's
  newest version (distorefs/weightsreplay.py); datasets/ as they are (never removed);
  checkpoints/ less each step removed since (its `cstep` and its `cremove` both go).

One node makes a snapshot at a time (a lease), once its follower applied at least
`snapshot_every` records, and at least as many as the snapshot before held, since the
last one: so the log never holds many more records than the state does, and the work of
snapshots is at most about one record written per record appended. A snapshot is
installed atomically in `{...}:snap`; the one before it is kept for nodes still loading
it, the one before that is deleted.

Trimming: every node reports the id it has applied (`{...}:nodes`, every REPORT_S), and
the log is trimmed up to the oldest of `at` and the positions of the nodes heard from in
the last `node_timeout` seconds. A node that comes back after the log was trimmed past its
position is refused at mount (it would miss records). A node that joins with an empty
store registers at the snapshot's `at` in the same script that tells it which snapshot
to load, so no trim passes it while it loads.

Everything here that talks to Redis blocks: call it from a worker thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from .backends.errors import BackendError
from .clusterlog import Record, SharedLog, create_fields, insert_fields
from .errors import from_backend
from .owner import Owner
from .weightsreplay import compact as compact_weights

log = logging.getLogger(__name__)

TREE_KINDS = ("weights", "datasets", "checkpoints")
REPORT_S = 5.0  # how often a node tells the cluster how far it has applied the log
LEASE_MS = 600_000  # a node making a snapshot holds the lease this long at most
WRITE_CHUNK = 512  # records per pipeline when a snapshot is written
READ_CHUNK = 1024  # records per XRANGE when one is read

_IDS = r"""
local function idn(id)
  local d = string.find(id, '-', 1, true)
  if not d then return tonumber(id), 0 end
  return tonumber(string.sub(id, 1, d - 1)), tonumber(string.sub(id, d + 1))
end
local function less(a, b)
  local am, as = idn(a)
  local bm, bs = idn(b)
  return am < bm or (am == bm and as < bs)
end
-- Trim the log up to the oldest of the snapshot's `at` and the live nodes' positions; nodes
-- not heard from within `timeout` ms are forgotten. Returns the id trimmed up to.
local function trim(logkey, nodes, snap, now, timeout)
  local at = redis.call('HGET', snap, 'at')
  local trimmed = redis.call('HGET', snap, 'trimmed') or '0-0'
  if not at then return trimmed end
  local low = at
  local all = redis.call('HGETALL', nodes)
  for i = 1, #all, 2 do
    local v = all[i + 1]
    local sp = string.find(v, ' ', 1, true)
    if tonumber(string.sub(v, sp + 1)) >= now - timeout then
      local pos = string.sub(v, 1, sp - 1)
      if less(pos, low) then low = pos end
    else
      redis.call('HDEL', nodes, all[i])
    end
  end
  if less(trimmed, low) then
    local m, s = idn(low)
    redis.call('XTRIM', logkey, 'MINID', string.format('%d-%d', m, s + 1))
    redis.call('HSET', snap, 'trimmed', low)
    return low
  end
  return trimmed
end
"""

# KEYS log, nodes, snap; ARGV node, position ('' for a node with an empty store: the
# snapshot's `at`), now_ms. A position the log was trimmed past is not registered.
_REGISTER = _IDS + r"""
local at = redis.call('HGET', KEYS[3], 'at')
local trimmed = redis.call('HGET', KEYS[3], 'trimmed') or '0-0'
local pos = ARGV[2]
if pos == '' then pos = at or '0-0' end
if not less(pos, trimmed) then redis.call('HSET', KEYS[2], ARGV[1], pos .. ' ' .. ARGV[3]) end
return {at or '', redis.call('HGET', KEYS[3], 'stream') or '', redis.call('HGET', KEYS[3], 'n') or '0', trimmed,
        pos}
"""

# KEYS log, nodes, snap; ARGV node, applied, now_ms, timeout_ms
_REPORT = _IDS + r"""
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
local trimmed = trim(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[3]), tonumber(ARGV[4]))
return {trimmed, redis.call('HGET', KEYS[3], 'n') or '0', redis.call('HGET', KEYS[3], 'records') or '0',
        redis.call('XLEN', KEYS[1])}
"""

# KEYS log, nodes, snap, the new stream, the stream two before it; ARGV n, at, by, now_ms,
# timeout_ms, records. Refused (-1, the new stream deleted) unless the snapshot before is n-1.
_INSTALL = _IDS + r"""
local cur = tonumber(redis.call('HGET', KEYS[3], 'n') or '0')
if cur ~= tonumber(ARGV[1]) - 1 then
  redis.call('DEL', KEYS[4])
  return -1
end
redis.call('HSET', KEYS[3], 'n', ARGV[1], 'at', ARGV[2], 'stream', KEYS[4], 'by', ARGV[3], 'records', ARGV[6])
if KEYS[5] ~= KEYS[4] then redis.call('DEL', KEYS[5]) end
trim(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[4]), tonumber(ARGV[5]))
return tonumber(ARGV[1])
"""

_RELEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class SnapshotInfo:
    """The installed snapshot: number `n` (0: none yet), the log id it covers, its stream,
    and the id the log is trimmed up to."""

    n: int
    at: bytes
    stream: bytes
    trimmed: bytes


@dataclass(frozen=True)
class Report:
    trimmed: bytes
    n: int  # the installed snapshot's number
    records: int  # how many records it holds
    length: int  # records in the log now


@dataclass
class CapturedNamespace:
    """A shared buffer or bank as it stood at the snapshot's `at`: what its records need."""

    kind: str
    name: str
    config: dict
    owner: Owner
    ctime_ns: int
    # (seq, key, value, places, mode, uid, gid, mtime_ns), oldest first, and the priorities
    # (None for a bank)
    entries: list[tuple]
    priorities: np.ndarray | None


class LogSnapshots:
    """The snapshots and the trimming of shared store `shared.store`'s log (see above)."""

    def __init__(self, shared: SharedLog) -> None:
        self.shared = shared
        self.engine = shared.engine
        tag = shared.tag
        self.log_key = shared.key
        self.nodes_key = f"{tag}:nodes".encode()
        self.snap_key = f"{tag}:snap".encode()
        self.lock_key = f"{tag}:snaplock".encode()
        self.tag = tag

    def stream_key(self, n: int) -> bytes:
        return f"{self.tag}:snap:{n}".encode()

    def _eval(self, script: str, keys: list[bytes], args: list, durable: bool = False):
        try:
            return self.engine.eval(script, keys, args, durable=durable)
        except BackendError as exc:
            raise from_backend(exc) from None

    def register(self, node: str, position: bytes | None) -> tuple[SnapshotInfo, bytes]:
        """A node starting: `position` is what its store applied (None: an empty store, which
        starts from the snapshot). The snapshot there is now, and the position registered."""
        at, stream, n, trimmed, pos = self._eval(
            _REGISTER, [self.log_key, self.nodes_key, self.snap_key],
            [node, position or b"", _now_ms()], durable=True)
        return SnapshotInfo(int(n), at, stream, trimmed), pos

    def report(self, node: str, applied: bytes, timeout_s: float) -> Report:
        """How far this node has applied the log; trims what no live node needs any more."""
        trimmed, n, records, length = self._eval(
            _REPORT, [self.log_key, self.nodes_key, self.snap_key],
            [node, applied, _now_ms(), int(timeout_s * 1000)])
        return Report(trimmed, int(n), int(records), int(length))

    def info(self) -> SnapshotInfo:
        try:
            got = self.engine.on_master(self.snap_key, lambda p: p.hgetall(self.snap_key), durable=False)[0]
        except BackendError as exc:
            raise from_backend(exc) from None
        return SnapshotInfo(int(got.get(b"n", 0)), got.get(b"at", b""), got.get(b"stream", b""),
                            got.get(b"trimmed", b"0-0"))

    def lease(self, node: str) -> bool:
        try:
            return bool(self.engine.on_master(
                self.lock_key, lambda p: p.set(self.lock_key, node, nx=True, px=LEASE_MS), durable=False)[0])
        except BackendError as exc:
            raise from_backend(exc) from None

    def release(self, node: str) -> None:
        self._eval(_RELEASE, [self.lock_key], [node])

    def read(self, stream: bytes, after: bytes = b"-", upto: bytes = b"+",
             count: int = READ_CHUNK) -> Iterator[Record]:
        """The records of `stream` after id `after` (exclusive) up to `upto` (inclusive), in
        chunks of `count`."""
        start = after if after == b"-" else b"(" + after
        while True:
            try:
                got = self.engine.on_master(stream, lambda p: p.xrange(stream, start, upto, count=count),
                                            durable=False)[0]
            except BackendError as exc:
                raise from_backend(exc) from None
            for rid, fields in got:
                yield Record.of(rid, fields)
            if len(got) < count:
                return
            start = b"(" + got[-1][0]

    def exists(self, stream: bytes) -> bool:
        try:
            return bool(self.engine.on_master(stream, lambda p: p.exists(stream), durable=False)[0])
        except BackendError as exc:
            raise from_backend(exc) from None

    def write(self, n: int, records: Iterable[dict]) -> int:
        """Snapshot `n`'s records (a stream left by a try cut short replaced); how many. Not
        durable by itself: `install` WAITs for the replica after them, and a master's
        replication is one ordered stream."""
        key = self.stream_key(n)
        total = 0
        chunk: list[dict] = []
        first = True

        def flush() -> None:
            def add(p) -> None:
                if first:
                    p.delete(key)
                for fields in chunk:
                    p.xadd(key, fields)
            try:
                self.engine.on_master(key, add, durable=False)
            except BackendError as exc:
                raise from_backend(exc) from None

        for fields in records:
            chunk.append(fields)
            total += 1
            if len(chunk) >= WRITE_CHUNK:
                flush()
                chunk, first = [], False
        flush()
        return total

    def install(self, n: int, at: bytes, by: str, records: int, timeout_s: float) -> bool:
        old = self.stream_key(n - 2) if n > 2 else self.stream_key(n)
        done = self._eval(_INSTALL, [self.log_key, self.nodes_key, self.snap_key, self.stream_key(n), old],
                          [n, at, by, _now_ms(), int(timeout_s * 1000), records], durable=True)
        return int(done) == n


def _now_ms() -> int:
    return int(time.time() * 1000)


# ----- what a snapshot holds -------------------------------------------------------------------


def namespace_records(ns: CapturedNamespace) -> Iterator[dict]:
    """A shared buffer's or bank's records: its create, then its entries oldest first."""
    yield create_fields(ns.kind, ns.name, ns.config, ns.owner, ns.ctime_ns)
    for i, (seq, key, value, places, mode, uid, gid, mtime_ns) in enumerate(ns.entries):
        prio = None if ns.priorities is None else float(ns.priorities[i])
        yield insert_fields(ns.kind, ns.name, key, seq, value.pack(), places, Owner(mode, uid, gid), mtime_ns, prio)


def tree_records(records: Iterable[Record]) -> list[dict]:
    """The file trees' records of the snapshot before and of the log since, as few as give
    the same trees: weights/ as the tree they leave (distorefs/weightsreplay.py); datasets/
    as they are (a few parts per dataset, never removed); checkpoints/ less each step
    removed since (its `cstep` and the `cremove` of its export)."""
    kept = [r for r in records if r.kind in TREE_KINDS]
    weights = compact_weights((r.op, r.name, r.fields) for r in kept if r.kind == "weights")
    removed = {(r.fields.get(b"origin"), r.fields.get(b"nonce")) for r in kept if r.op == "cremove"}
    return weights + [r.fields for r in kept
                      if r.kind != "weights" and r.op != "cremove"
                      and not (r.op == "cstep" and (r.fields.get(b"origin"), r.fields.get(b"nonce")) in removed)]

"""The log of a shared store: what the nodes mounting one store on a Redis Cluster agree on.

Every change to a shared namespace (buffers/ and banks/: create, drop, configure, an
entry inserted, rewritten, deleted or evicted, priorities) is one record of one Redis
Stream, `{distorefs:STORE}:log`. Records are appended by Lua scripts that also keep, under
the same hash tag (so in one slot, atomically), each namespace's global state: its next
sequence number, entry count and bytes, and the FIFO of its entries. That is where global
FIFO eviction is decided: an insert that takes a namespace past `capacity` or `max_bytes`
names in its own record the oldest entries it evicts.

Every node applies the whole log, in order, to its local store (distorefs/follower.py), so
each node's rings, samplers and priorities are the same function of the same records, and
a learner on any node samples over every entry of the cluster. Values themselves are not
in the log: they are written to the cluster first (backends/redisengine.py ClusterValues),
and a record carries the value's `StoredValue`.

Everything here blocks on the network: call it from a worker thread.
"""

from __future__ import annotations

import json
import struct
import uuid
from dataclasses import dataclass
from typing import Sequence, cast

from .backends.redisengine import ClusterEngine, Refused
from .backends.errors import BackendError
from .errors import AlreadyExists, InvalidArgument, NotEmpty, NotFound, from_backend
from .owner import Owner

SHARED_KINDS = ("buffers", "banks")


@dataclass(frozen=True)
class ClusterSpec:
    """Which shared store a node joins: `url` names any node of the Redis Cluster (redis://
    HOST:PORT), `store` the shared store in it. `snapshot_every`: records applied between
    two snapshots of the log at least (distorefs/logsnapshot.py); `node_timeout_s`: how
    long a node not heard from holds the log back from being trimmed."""

    url: str
    store: str = "main"
    snapshot_every: int = 100_000
    node_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://")):
            raise InvalidArgument(f"--cluster takes redis://HOST:PORT, got {self.url!r}")
        if not self.store or any(c in self.store for c in "{}/ \0"):
            raise InvalidArgument(f"a shared store's name has no braces, slashes or spaces: {self.store!r}")
        if self.snapshot_every < 1:
            raise InvalidArgument(f"--cluster-snapshot-every takes a number of records >= 1, got {self.snapshot_every}")
        if not self.node_timeout_s > 0:
            raise InvalidArgument(f"--cluster-node-timeout takes seconds > 0, got {self.node_timeout_s}")

# Evict the oldest live entries while the namespace is over its bounds, never the entry
# just inserted (`keep`). FIFO items are "seq\0key"; an item whose key now maps to another
# seq (rewritten) or to none (deleted) is a leftover and is dropped on the way. An evicted
# entry's global times-sampled count (`times`, by seq) goes with it.
_EVICT = r"""
local function evict(st, idx, fifo, times, keep)
  local count = tonumber(redis.call('HGET', st, 'count'))
  local bytes = tonumber(redis.call('HGET', st, 'bytes'))
  local cap = tonumber(redis.call('HGET', st, 'capacity'))
  local maxb = tonumber(redis.call('HGET', st, 'max_bytes'))
  local out = {}
  while count > cap or (maxb > 0 and bytes > maxb) do
    local item = redis.call('LPOP', fifo)
    if not item then break end
    local z = string.find(item, '\0', 1, true)
    local seq = string.sub(item, 1, z - 1)
    local key = string.sub(item, z + 1)
    if seq == keep then
      redis.call('LPUSH', fifo, item)
      break
    end
    local cur = redis.call('HGET', idx, key)
    if cur then
      local sp = string.find(cur, ' ', 1, true)
      if string.sub(cur, 1, sp - 1) == seq then
        redis.call('HDEL', idx, key)
        redis.call('HDEL', times, seq)
        count = count - 1
        bytes = bytes - tonumber(string.sub(cur, sp + 1))
        out[#out + 1] = item
      end
    end
  end
  redis.call('HSET', st, 'count', count, 'bytes', bytes)
  return table.concat(out, '\0')
end
"""

_CREATE = r"""
if redis.call('EXISTS', KEYS[2]) == 1 then return redis.error_reply('EEXIST ' .. ARGV[1] .. ' exists') end
redis.call('HSET', KEYS[2], 'capacity', ARGV[7], 'max_bytes', ARGV[8], 'seq', 0, 'count', 0, 'bytes', 0)
return redis.call('XADD', KEYS[1], '*', 'op', 'create', 'ns', ARGV[1], 'config', ARGV[2], 'mode', ARGV[3],
                  'uid', ARGV[4], 'gid', ARGV[5], 'ctime', ARGV[6])
"""

_DROP = r"""
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('ENOENT no ' .. ARGV[1]) end
local count = tonumber(redis.call('HGET', KEYS[2], 'count'))
if count > 0 then return redis.error_reply('ENOTEMPTY ' .. ARGV[1] .. ' still has ' .. count .. ' entries') end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return redis.call('XADD', KEYS[1], '*', 'op', 'drop', 'ns', ARGV[1])
"""

_CONFIGURE = _EVICT + r"""
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('ENOENT no ' .. ARGV[1]) end
redis.call('HSET', KEYS[2], 'capacity', ARGV[3], 'max_bytes', ARGV[4])
local evicted = evict(KEYS[2], KEYS[3], KEYS[4], KEYS[5], '')
return redis.call('XADD', KEYS[1], '*', 'op', 'configure', 'ns', ARGV[1], 'config', ARGV[2], 'evicted', evicted)
"""

_INSERT = _EVICT + r"""
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('ENOENT no ' .. ARGV[1]) end
local ids = {}
for i = 0, tonumber(ARGV[2]) - 1 do
  local a = 3 + i * 6
  local key = ARGV[a]
  local size = tonumber(ARGV[a + 1])
  local cur = redis.call('HGET', KEYS[3], key)
  local seq
  if cur then
    local sp = string.find(cur, ' ', 1, true)
    seq = string.sub(cur, 1, sp - 1)
    redis.call('HINCRBY', KEYS[2], 'bytes', size - tonumber(string.sub(cur, sp + 1)))
  else
    seq = tostring(redis.call('HINCRBY', KEYS[2], 'seq', 1))
    redis.call('HINCRBY', KEYS[2], 'count', 1)
    redis.call('HINCRBY', KEYS[2], 'bytes', size)
    redis.call('RPUSH', KEYS[4], seq .. '\0' .. key)
  end
  redis.call('HSET', KEYS[3], key, seq .. ' ' .. size)
  local evicted = evict(KEYS[2], KEYS[3], KEYS[4], KEYS[5], seq)
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'op', 'insert', 'ns', ARGV[1], 'key', key, 'seq', seq,
                             'value', ARGV[a + 2], 'places', ARGV[a + 3], 'owner', ARGV[a + 4], 'prio', ARGV[a + 5],
                             'evicted', evicted)
end
return ids
"""

# ARGV[3], when not empty, is the seq the caller saw: an entry put under the key since (a
# spent entry deleted, then a new one inserted under its name) is not the one meant.
_DELETE = r"""
local cur = redis.call('HGET', KEYS[3], ARGV[2])
if not cur then return redis.error_reply('ENOENT no entry ' .. ARGV[2] .. ' in ' .. ARGV[1]) end
local sp = string.find(cur, ' ', 1, true)
local seq = string.sub(cur, 1, sp - 1)
if ARGV[3] ~= '' and ARGV[3] ~= seq then
  return redis.error_reply('ENOENT entry ' .. ARGV[2] .. ' in ' .. ARGV[1] .. ' is seq ' .. seq .. ', not ' .. ARGV[3])
end
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[5], seq)
redis.call('HINCRBY', KEYS[2], 'count', -1)
redis.call('HINCRBY', KEYS[2], 'bytes', -tonumber(string.sub(cur, sp + 1)))
return redis.call('XADD', KEYS[1], '*', 'op', 'delete', 'ns', ARGV[1], 'key', ARGV[2], 'seq', seq)
"""

# A node's draw of a buffer with max_times_sampled (ARGV[2]), counted against the global
# counts: ARGV[3..] are (seq, key) pairs, an entry as often as the batch holds it. All or
# nothing: if an entry is gone (deleted or evicted in the log, maybe not applied on the
# drawing node yet) or the batch would take it past the limit (other nodes drew it), nothing
# is counted and the answer is {0, seq, count, ...} of those entries, each with its count
# before this batch (the limit for one that is gone); else {1, count, ...}, each pair's
# count once the batch is counted.
_CLAIM = r"""
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('ENOENT no ' .. ARGV[1]) end
local limit = tonumber(ARGV[2])
local n = (#ARGV - 2) / 2
local counts, before, after, refused, seen = {}, {}, {}, {}, {}
for i = 0, n - 1 do
  local seq = ARGV[3 + 2 * i]
  local cur = redis.call('HGET', KEYS[3], ARGV[4 + 2 * i])
  local live = false
  if cur then live = string.sub(cur, 1, string.find(cur, ' ', 1, true) - 1) == seq end
  if counts[seq] == nil then
    counts[seq] = tonumber(redis.call('HGET', KEYS[5], seq) or '0')
    before[seq] = counts[seq]
  end
  counts[seq] = counts[seq] + 1
  after[i + 1] = counts[seq]
  if (not live or counts[seq] > limit) and not seen[seq] then
    seen[seq] = true
    refused[#refused + 1] = seq
    if live then refused[#refused + 1] = before[seq] else refused[#refused + 1] = limit end
  end
end
if #refused > 0 then
  table.insert(refused, 1, 0)
  return refused
end
for seq, c in pairs(counts) do redis.call('HSET', KEYS[5], seq, c) end
table.insert(after, 1, 1)
return after
"""

_APPEND = r"""
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.error_reply('ENOENT no ' .. ARGV[1]) end
return redis.call('XADD', KEYS[1], '*', 'op', ARGV[2], 'ns', ARGV[1], 'data', ARGV[3])
"""

_OWNER = struct.Struct("<IIIq")  # mode, uid, gid, mtime_ns


def create_fields(kind: str, name: str, config: dict, owner: Owner, ctime_ns: int) -> dict:
    """The fields of a namespace's `create` record, as _CREATE appends them."""
    return {b"op": b"create", b"ns": f"{kind}/{name}".encode(), b"config": json.dumps(config).encode(),
            b"mode": str(owner.mode).encode(), b"uid": str(owner.uid).encode(), b"gid": str(owner.gid).encode(),
            b"ctime": str(ctime_ns).encode()}


def insert_fields(kind: str, name: str, key: bytes, seq: int, value: bytes, places: bytes, owner: Owner,
                  mtime_ns: int, priority: float | None) -> dict:
    """The fields of an `insert` record that evicts nothing, as _INSERT appends them."""
    return {b"op": b"insert", b"ns": f"{kind}/{name}".encode(), b"key": key, b"seq": str(seq).encode(),
            b"value": value, b"places": places, b"owner": _OWNER.pack(owner.mode, owner.uid, owner.gid, mtime_ns),
            b"prio": b"" if priority is None else repr(priority).encode(), b"evicted": b""}
_PAIR = struct.Struct("<d")


@dataclass(frozen=True, slots=True)
class Insert:
    """One entry for `SharedLog.insert`: its value is in the cluster already (`value`: the
    packed StoredValue)."""

    key: bytes
    size: int
    value: bytes
    places: bytes
    owner: Owner
    mtime_ns: int
    priority: float | None


@dataclass(frozen=True, slots=True)
class Record:
    """One record of the log: `op` on namespace `kind`/`name`, with its fields (bytes)."""

    id: bytes
    op: str
    kind: str
    name: str
    fields: dict

    @classmethod
    def of(cls, rid: bytes, fields: dict) -> "Record":
        kind, _, name = fields.get(b"ns", b"/").decode().partition("/")
        return cls(rid, fields[b"op"].decode(), kind, name, fields)

    def evicted(self) -> list[tuple[int, bytes]]:
        """(seq, key) of the entries this record evicted, oldest first."""
        raw = self.fields.get(b"evicted", b"")
        if not raw:
            return []
        parts = raw.split(b"\0")
        return [(int(parts[i]), parts[i + 1]) for i in range(0, len(parts), 2)]

    def owner(self) -> tuple[Owner, int]:
        mode, uid, gid, mtime = _OWNER.unpack(self.fields[b"owner"])
        return Owner(mode, uid, gid), mtime

    def priorities(self) -> list[tuple[bytes, float]]:
        data = self.fields[b"data"]
        out, off = [], 0
        while off < len(data):
            (n,) = struct.unpack_from("<H", data, off)
            key = data[off + 2:off + 2 + n]
            (value,) = _PAIR.unpack_from(data, off + 2 + n)
            out.append((bytes(key), value))
            off += 2 + n + _PAIR.size
        return out


def id_tuple(rid: bytes) -> tuple[int, int]:
    ms, _, seq = rid.partition(b"-")
    return int(ms), int(seq or 0)


def _mapped(exc: BackendError) -> BaseException:
    if isinstance(exc, Refused):
        cls = {"ENOENT": NotFound, "EEXIST": AlreadyExists, "ENOTEMPTY": NotEmpty}.get(exc.code, InvalidArgument)
        return cls(str(exc))
    return from_backend(exc)


class SharedLog:
    """Appending to and reading the log of store `store` on `engine`."""

    def __init__(self, engine: ClusterEngine, store: str) -> None:
        self.engine = engine
        self.store = store
        self.tag = "{distorefs:%s}" % store
        self.key = f"{self.tag}:log".encode()

    def _keys(self, kind: str, name: str) -> list[bytes]:
        ns = f"{kind}/{name}"
        return [self.key] + [f"{self.tag}:{part}:{ns}".encode() for part in ("ns", "idx", "fifo", "times")]

    def _eval(self, script: str, kind: str, name: str, *args) -> bytes:
        try:
            return self.engine.eval(script, self._keys(kind, name), [f"{kind}/{name}".encode(), *args])
        except BackendError as exc:
            raise _mapped(exc) from None

    # ----- appending (each returns the record's id once durable) ----------------------------

    def create(self, kind: str, name: str, config: dict, owner: Owner, ctime_ns: int) -> bytes:
        return self._eval(_CREATE, kind, name, json.dumps(config), owner.mode, owner.uid, owner.gid, ctime_ns,
                          config["capacity"], config["max_bytes"])

    def drop(self, kind: str, name: str) -> bytes:
        return self._eval(_DROP, kind, name)

    def configure(self, kind: str, name: str, config: dict) -> bytes:
        return self._eval(_CONFIGURE, kind, name, json.dumps(config), config["capacity"], config["max_bytes"])

    def insert(self, kind: str, name: str, items: Sequence["Insert"]) -> list[bytes]:
        """Inserts (or rewrites) in order, each a record (ids in order); one script, one
        round trip for them all."""
        args: list = [len(items)]
        for it in items:
            args += [it.key, it.size, it.value, it.places,
                     _OWNER.pack(it.owner.mode, it.owner.uid, it.owner.gid, it.mtime_ns),
                     b"" if it.priority is None else repr(it.priority).encode()]
        return cast("list[bytes]", self._eval(_INSERT, kind, name, *args))  # (its script replies with a list)

    def delete(self, kind: str, name: str, key: bytes, seq: int | None = None) -> bytes:
        """Delete the entry `key` (only if it is still seq `seq`, when given)."""
        return self._eval(_DELETE, kind, name, key, b"" if seq is None else str(seq).encode())

    def claim_draws(self, kind: str, name: str, limit: int,
                    drawn: Sequence[tuple[int, bytes]]) -> tuple[bool, list[int]]:
        """Count a batch's draws (seq, key; an entry once per time drawn) against the
        buffer's global times-sampled counts and `limit` (max_times_sampled): (True, each
        draw's count after the batch), or (False, [seq, count, ...] of the entries this
        batch may not draw as often as it did: each one's count on the nodes together before
        it, `limit` for one that is gone) with nothing counted."""
        args: list = [limit]
        for seq, key in drawn:
            args += [str(seq).encode(), key]
        reply = self._eval(_CLAIM, kind, name, *args)
        return bool(int(reply[0])), [int(x) for x in reply[1:]]

    def set_layout(self, kind: str, name: str, layout: dict | None) -> bytes:
        """The layout the first entry of a buffer without a schema fixes (None: raw mode);
        applied only by a node whose buffer has none yet, so the first in the log wins."""
        return self._eval(_APPEND, kind, name, b"layout", json.dumps(layout).encode())

    def priorities(self, kind: str, name: str, pairs: Sequence[tuple[bytes, float]]) -> bytes:
        data = b"".join(struct.pack("<H", len(k)) + k + _PAIR.pack(v) for k, v in pairs)
        return self._eval(_APPEND, kind, name, b"priorities", data)

    def tree_change(self, origin: str, op: str, path: str, **fields: bytes | str | int) -> bytes:
        """A change of a file tree (weights/, datasets/, checkpoints/) done at node `origin`,
        which applied it already; `path` starts with the tree's name. Other nodes apply it
        by path: `op` and its fields are the tree's (distorefs/weightslog.py, ...)."""
        key = self.key
        body = {"op": op, "ns": path, "origin": origin, **fields}
        try:
            return self.engine.on_master(key, lambda p: p.xadd(key, body))[0]
        except BackendError as exc:
            raise _mapped(exc) from None

    # ----- reading -----------------------------------------------------------------------

    def read(self, after: bytes, count: int = 512, block_ms: int = 500) -> list[Record]:
        try:
            raw = self.engine.read_stream(self.key, after, count, block_ms)
        except BackendError as exc:
            raise _mapped(exc) from None
        return [Record.of(rid, fields) for rid, fields in raw]

    def identity(self) -> bytes:
        """The shared store's id, made by the first node that joins it: a node whose local
        store followed another (the cluster was wiped and set up again) must not follow this."""
        key = f"{self.tag}:id".encode()
        mine = uuid.uuid4().hex.encode()
        try:
            self.engine.on_master(key, lambda p: p.set(key, mine, nx=True))
            found = self.engine.get(key)
        except BackendError as exc:
            raise _mapped(exc) from None
        assert found is not None
        return found

    def head(self) -> bytes:
        """The id of the newest record (b"0-0" for an empty log)."""
        try:
            return self.engine.last_id(self.key)
        except BackendError as exc:
            raise _mapped(exc) from None

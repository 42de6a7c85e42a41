"""The shared engine: a Redis Cluster that holds the values and the log of a store several
nodes mount (README, Several nodes).

`ClusterEngine` is the connection: writes run on the master of their key's slot and are
followed, on the same connection, by `WAIT` for the replicas the durability promise
needs, so a write it returns survives the loss of that master (its replica is promoted).
Failover, a moved slot or a master restarting are retried until `deadline` seconds have
passed; then `Unavailable`. A script that refuses (a Lua `error_reply` of the form
"CODE message") raises `Refused` carrying the code, for the core to map.

`ClusterValues` is the value tier on it: one key per value, spread over the shards by key
hash. Nothing here knows the core's records or the log's meaning.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Sequence

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (AskError, BusyLoadingError, ClusterDownError, MasterDownError, MovedError,
                              ReadOnlyError, RedisClusterException, RedisError, ResponseError, TryAgainError)

from .base import TierUsage, Txn, ValueBackend
from .errors import BackendError, Missing, NotReplicated, Unavailable

log = logging.getLogger(__name__)

WAIT_MS = 5000  # how long a write waits for its replica before it fails
DEADLINE_S = 10.0
RECHECK_S = 5.0  # how often a master without a replica is looked at again  # how long an operation is retried across a failover
_RETRY = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "LOADING", "READONLY", "MASTERDOWN", "NOREPLICAS")


ONCE_S = 120  # how long a durable script's result is kept for a retry (see eval)


@functools.lru_cache(maxsize=64)
def _once(script: str) -> str:
    """`script` made to run once per key KEYS[#KEYS] (see ClusterEngine.eval); the script
    itself must not count KEYS."""
    return ("local done = redis.call('GET', KEYS[#KEYS])\n"
            "if done then return cmsgpack.unpack(done) end\n"
            "local result = (function()\n" + script + "\nend)()\n"
            "if type(result) ~= 'table' or not result.err then\n"
            f"  redis.call('SET', KEYS[#KEYS], cmsgpack.pack(result), 'EX', {ONCE_S})\n"
            "end\n"
            "return result\n")


def _hash_tag(key: bytes) -> bytes:
    """The `{tag}` that puts keys in `key`'s slot (the key itself in braces if it has none)."""
    start = key.find(b"{")
    end = key.find(b"}", start + 1) if start >= 0 else -1
    return key[start:end + 1] if end > start + 1 else b"{" + key + b"}"


class Refused(BackendError):
    """A script refused the operation; `code` is the errno name it gave (ENOENT, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClusterEngine:
    def __init__(self, url: str, *, wait_replicas: int | None = None, deadline: float = DEADLINE_S) -> None:
        """Connect to the cluster of which `url` (redis://HOST:PORT) names any node.
        `wait_replicas`: replicas each write waits for; by default 1 when every master has
        a replica, else 0 (then an acknowledged write survives a daemon's loss, not a
        master's)."""
        self.url = url
        self.deadline = deadline
        try:
            self.rc = RedisCluster.from_url(url, decode_responses=False, socket_timeout=WAIT_MS / 1000 + 5,
                                            socket_connect_timeout=5)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise Unavailable(f"cannot reach the Redis Cluster at {url}: {exc}") from None
        self.wait_replicas = self.replicas_per_master() if wait_replicas is None else wait_replicas
        # Masters without a live replica (after a failover), written to without WAIT: when
        # each was last checked.
        self.degraded: dict[str, float] = {}
        self.counters = {"round_trips": 0, "bytes_out": 0, "bytes_in": 0, "retries": 0}

    def _degraded(self, master: str) -> bool:
        checked = self.degraded.get(master)
        if checked is None:
            return False
        if time.monotonic() - checked > RECHECK_S:
            if self.live_replicas(master) > 0:
                del self.degraded[master]
                log.info("Redis master %s has a replica again: its writes wait for it", master)
                return False
            self.degraded[master] = time.monotonic()
        return True

    def live_replicas(self, master: str) -> int:
        """How many replicas not marked failed the cluster lists for master `master` (host:port)."""
        nodes: dict[str, dict[str, Any]] = self.rc.cluster_nodes()  # (its stub: each field any field's type)
        ids = {info["node_id"] for addr, info in nodes.items() if addr == master}
        return sum(1 for info in nodes.values() if "slave" in info["flags"] and "fail" not in info["flags"]
                   and info["master_id"] in ids)

    def replicas_per_master(self) -> int:
        """1 if every master has at least one replica, else 0."""
        nodes = self._retry(lambda: self.rc.cluster_nodes())
        masters = {info["node_id"] for info in nodes.values() if "master" in info["flags"]
                   and "fail" not in info["flags"]}
        served = {info["master_id"] for info in nodes.values() if "slave" in info["flags"]
                  and "fail" not in info["flags"]}
        return 1 if masters and masters <= served else 0

    # ----- running commands -------------------------------------------------------------

    def _retry(self, fn: Callable[[], Any]) -> Any:
        end = time.monotonic() + self.deadline
        delay = 0.05
        while True:
            try:
                return fn()
            except NotReplicated:
                raise  # made already: running it again would make it twice
            except (ClusterDownError, TryAgainError, MovedError, AskError, MasterDownError, ReadOnlyError,
                    BusyLoadingError) as exc:
                error: Exception = exc
            except ResponseError as exc:
                text = str(exc)
                if "Command # " in text and " of pipeline caused error: " in text:
                    text = text.split(" of pipeline caused error: ", 1)[1]
                if not text.startswith(_RETRY):
                    code, _, message = text.partition(" ")
                    if code.isupper() and code.startswith("E"):
                        raise Refused(code, message) from None
                    raise BackendError(f"the Redis Cluster refused: {text}") from None
                error = exc
            except (RedisError, RedisClusterException, OSError, Unavailable) as exc:
                error = exc
            if time.monotonic() + delay > end:
                raise Unavailable(f"the Redis Cluster did not answer within {self.deadline:.0f} s: {error}")
            self.counters["retries"] += 1
            log.warning("Redis Cluster: %s; retrying", error)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            try:
                self.rc.nodes_manager.initialize()  # who serves which slot now
            except (RedisError, RedisClusterException, OSError):
                pass

    def on_master(self, key: bytes, add: Callable[[Any], None], *, durable: bool = True) -> list:
        """Run the commands `add(pipe)` queues on the master of `key`'s slot, on one
        connection, then (`durable`) WAIT for `wait_replicas`; their results."""
        def run() -> list:
            node = self.rc.get_node_from_key(key)
            if node is None:
                raise Unavailable(f"no master serves the slot of {key!r}")
            conn: redis.Redis = self.rc.get_redis_connection(node)
            pipe = conn.pipeline(transaction=False)
            add(pipe)
            waited = durable and self.wait_replicas > 0 and not self._degraded(node.name)
            if waited:
                pipe.execute_command("WAIT", self.wait_replicas, WAIT_MS)
            out = pipe.execute(raise_on_error=True)
            self.counters["round_trips"] += 1
            if waited:
                acked = out.pop()
                if acked < self.wait_replicas and self.live_replicas(node.name) > 0:
                    acked = self._wait_again(conn, node.name, acked)
                if acked < self.wait_replicas:
                    # After a failover the promoted master has no replica until one is added:
                    # its writes go on, surviving a daemon's loss but not this master's.
                    self.degraded[node.name] = time.monotonic()
                    log.warning("Redis master %s has no live replica: its writes are not replicated until one "
                                "is added (CLUSTER REPLICATE)", node.name)
            return out
        return self._retry(run)

    def _wait_again(self, conn: "redis.Redis", master: str, acked: int) -> int:
        """The write ran on `master` but too few replicas have it yet: WAIT again, never run
        it again (a script is not idempotent: a batch's draws would be counted twice). Past
        the deadline NotReplicated, which `_retry` passes on as it is."""
        end = time.monotonic() + self.deadline
        while acked < self.wait_replicas:
            if time.monotonic() > end:
                raise NotReplicated(f"a write to {master} reached {acked} of {self.wait_replicas} replicas within "
                                    f"{self.deadline:.0f} s (it was made; it is lost if {master} is lost now)")
            try:
                acked = int(conn.execute_command("WAIT", self.wait_replicas, WAIT_MS))
            except (RedisError, OSError) as exc:
                raise NotReplicated(f"a write to {master} was made, then waiting for its replicas failed: {exc}")
            self.counters["round_trips"] += 1
        return acked

    def eval(self, script: str, keys: Sequence[bytes], args: Sequence[Any], *, durable: bool = True) -> Any:
        """A Lua script on the master of `keys` (one slot: give them one hash tag).

        A durable (writing) script runs once however often it is sent: a reply lost to a
        dropped connection or a timeout is retried, and the retry must not run it again (a
        batch's draws counted twice). It is sent with a key of its own, in its slot, that
        the script's first run sets to its result (kept ONCE_S seconds, longer than any
        retry); a run that finds the key returns that result and does nothing."""
        self.counters["bytes_out"] += sum(len(a) for a in args if isinstance(a, (bytes, str)))
        if durable:
            keys = [*keys, _hash_tag(keys[0]) + b":once:" + uuid.uuid4().hex.encode()]
            script = _once(script)
        return self.on_master(keys[0], lambda p: p.eval(script, len(keys), *keys, *args), durable=durable)[0]

    def set_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        """SET each, one pipeline (and one WAIT) per master holding some of them."""
        groups: dict[str, list[tuple[bytes, bytes | memoryview]]] = {}
        for key, data in items:
            node = self._retry(lambda: self.rc.get_node_from_key(key))
            groups.setdefault(node.name if node is not None else "", []).append((key, data))
            self.counters["bytes_out"] += len(data)
        for group in groups.values():
            def add(p: Any, g: list[tuple[bytes, bytes | memoryview]] = group) -> None:
                for k, d in g:
                    p.set(k, bytes(d))
            self.on_master(group[0][0], add)

    def get(self, key: bytes) -> bytes | None:
        data = self._retry(lambda: self.rc.get(key))
        self.counters["round_trips"] += 1
        if data is not None:
            self.counters["bytes_in"] += len(data)
        return data

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """One pipeline per master over the keys' slots."""
        def run() -> list:
            pipe = self.rc.pipeline()
            for k in keys:
                pipe.get(k)
            return pipe.execute()
        out = self._retry(run)
        self.counters["round_trips"] += 1
        self.counters["bytes_in"] += sum(len(d) for d in out if d is not None)
        return out

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            def run() -> None:
                pipe = self.rc.pipeline()
                for k in keys:
                    pipe.delete(k)
                pipe.execute()
            self._retry(run)

    def expire(self, key: bytes, seconds: float) -> None:
        self._retry(lambda: self.rc.pexpire(key, max(1, int(seconds * 1000))))

    def read_stream(self, stream: bytes, after: bytes, count: int, block_ms: int) -> list[tuple[bytes, dict]]:
        """Up to `count` records of `stream` after id `after`, waiting up to `block_ms` for one
        (0: not at all)."""
        block = block_ms if block_ms > 0 else None  # (BLOCK 0 would wait for ever)
        # On the stream's master's connection (on_master counts the round trip): through the
        # cluster client, XREAD (a command whose keys move) costs a COMMAND GETKEYS round
        # trip first, every time.
        out = self.on_master(stream, lambda p: p.xread({stream: after}, count=count, block=block),
                             durable=False)[0]
        if not out:
            return []
        records = out[0][1] if isinstance(out, list) else next(iter(out.values()))[0]
        return [(rid, fields) for rid, fields in records]

    def last_id(self, stream: bytes) -> bytes:
        """The id of `stream`'s newest record, b"0-0" when it has none."""
        try:
            info = self._retry(lambda: self.rc.xinfo_stream(stream))
        except BackendError as exc:
            if "no such key" in str(exc):
                return b"0-0"
            raise
        return info["last-generated-id"]

    def close(self) -> None:
        self.rc.close()


DELETE_BATCH = 512  # keys a background delete takes at a time (a pipeline per master)
DELETE_BACKLOG = 100_000  # keys waiting to be deleted past which `delete` deletes at once
CLOSE_WAIT_S = 30.0  # at most this long for the queued deletes at shutdown


class ClusterValues(ValueBackend):
    """Values in the cluster, one key each (`PREFIX:v:<random>`, spread over the shards).
    Writes are durable (WAIT) before `put` returns; `delete` need not be, since the log
    that drops a value's last reference is (every node deletes it again when applying).
    So a delete is queued and done by a thread of its own, in batches: not a round trip
    inside the node's write transaction per value a record evicts."""

    name = "cluster"

    def __init__(self, engine: ClusterEngine, prefix: str) -> None:
        self.engine = engine
        self.prefix = prefix.encode()
        self._doomed: list[bytes] = []
        self._cv = threading.Condition()
        self._deleter: threading.Thread | None = None
        self._closing = False

    def put(self, txn: Txn | None, vkey: bytes, data: bytes | memoryview, stream: int = 0,
            direct: bool = False) -> bytes:
        return self.put_many([data])[0]

    def put_many(self, datas: Sequence[bytes | memoryview]) -> list[bytes]:
        """`put` of each, a round trip per master rather than per value."""
        locs = [self.prefix + b":v:" + uuid.uuid4().hex.encode() for _ in datas]
        self.engine.set_many(list(zip(locs, datas)))
        return locs

    def get(self, loc: bytes) -> bytes:
        data = self.engine.get(loc)
        if data is None:
            raise Missing(f"no value at {loc.decode(errors='replace')} in the cluster")
        return data

    batched = True  # a round trip per master

    def get_many(self, locs: Sequence[bytes]) -> list[bytes | None]:
        return self.engine.get_many(locs)

    def delete(self, txn: Txn | None, loc: bytes) -> None:
        with self._cv:
            if len(self._doomed) < DELETE_BACKLOG and not self._closing:
                self._doomed.append(loc)
                if self._deleter is None:
                    self._deleter = threading.Thread(target=self._delete_queued, name="cluster-deletes",
                                                     daemon=True)
                    self._deleter.start()
                self._cv.notify()
                return
        self.engine.delete([loc])  # the thread is behind (or gone): this one now

    def _delete_queued(self) -> None:
        while True:
            with self._cv:
                while not self._doomed and not self._closing:
                    self._cv.wait()
                if not self._doomed:
                    return
                batch, self._doomed = self._doomed[:DELETE_BATCH], self._doomed[DELETE_BATCH:]
            try:
                self.engine.delete(batch)
            except BackendError as exc:  # left in the cluster as garbage; the daemon goes on
                with self._cv:
                    if self._closing:  # the cluster is not answering: no more tries at shutdown
                        batch += self._doomed
                        self._doomed = []
                log.warning("%d values not deleted from the cluster (left there): %s", len(batch), exc)

    def delete_later(self, loc: bytes, seconds: float) -> None:
        """Drop the value in `seconds` (readers elsewhere may still hold it)."""
        self.engine.expire(loc, seconds)

    def sync(self) -> None:
        pass  # each write was waited for (WAIT, and appendfsync on the servers)

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, 0)  # the cluster's memory is the cluster's to report (INFO memory)

    def locations(self) -> Iterator[tuple[bytes, int]]:
        return iter(())  # verify and gc look at the node's own tiers only

    def close(self) -> None:
        """Delete what is queued (bounded by the engine's retries), then stop."""
        with self._cv:
            self._closing = True
            self._cv.notify()
            deleter = self._deleter
        if deleter is not None:
            deleter.join(CLOSE_WAIT_S)

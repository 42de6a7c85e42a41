"""What a namespace is built with: the store's services, never the store itself.

The store opens the engine, builds the value layer and the committer, and hands each
namespace (rings, weights, datasets, checkpoints) this bundle when it makes it. It holds
services only: no namespace can reach another namespace, or the store, through it, so
data flows one way (namespace -> value layer -> backend) and the core has no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from .backends.lmdbenv import LmdbEnv
from .committer import Committer
from .config import StoreConfig
from .prefetcher import PrefetchBudget
from .values import ValueLayer

if TYPE_CHECKING:
    from .catalog import EntryMeta


class SharedLogFollower(Protocol):
    """What rings of a shared store use of its follower (distorefs/follower.py)."""

    log: Any  # the store's SharedLog (distorefs/clusterlog.py): its appends, run in worker threads

    async def publish(self, append: Callable[..., bytes], *args: Any) -> bytes: ...

    def publish_soon(self, append: Callable[..., bytes], *args: Any) -> Any: ...

    async def until(self, rid: bytes) -> None: ...

    async def catch_up(self, timeout: float) -> bool: ...


def _nothing(*_args: Any) -> None:
    pass


async def _no_wait() -> Any:
    return {}


@dataclass(frozen=True)
class Services:
    values: ValueLayer
    committer: Committer
    env: LmdbEnv  # metadata reads outside a commit (env.read)
    config: StoreConfig
    prefetch_budget: PrefetchBudget
    spool_dir: Path  # scratch files of writers (removed at open)
    # Start a background task in the store's nursery (a no-op when the store is not running).
    spawn: Callable[..., None] = _nothing
    # Everything committed so far made durable (fsync).
    sync: Callable[[], Awaitable[Any]] = _no_wait
    # A sync, then dead segment files unlinked (a full disk makes room this way).
    collect: Callable[[], Awaitable[Any]] = _no_wait
    # An entry of a ring was rewritten, renamed (new) or removed (new None): the mount
    # invalidates what the kernel caches of it.
    entry_changed: Callable[[Any, "EntryMeta", "EntryMeta | None"], None] = _nothing
    # A commit put a value in the hot tier (the tier mover may have work).
    hot_value_added: Callable[[], None] = _nothing
    # The checkpoints' write-back budget changed: share memory_bytes out again.
    memory_changed: Callable[[], None] = _nothing
    # A read-only open: reads keep no state in the store (times sampled, spent entries).
    read_only: bool = False
    # A store shared on a Redis Cluster: rings publish their changes through its log and
    # see them once applied (distorefs/follower.py). None for a node-local store.
    follower: SharedLogFollower | None = None
    # A shared store: shares a dataset just sealed with every node (distorefs/datasetslog.py)
    # before its seal returns. None for a node-local store.
    share_sealed: Callable[[Any], Awaitable[None]] | None = None

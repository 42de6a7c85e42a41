"""The engine interfaces: a transaction over named key spaces, and the value tier.

`Txn` is what the metadata engine hands to everything that writes in one atomic step
(the core's commit groups): named key spaces ("databases") of byte keys. The LMDB engine
implements it (backends/lmdbenv.py); a shared engine can implement it later. Nothing
above the backends holds an engine's own transaction object.

A value tier stores opaque value bytes and hands back an opaque location. Metadata
changes a tier makes (accounting, indexes) happen in the caller's transaction, so they
commit or roll back together with the references to the location. Reading never needs a
transaction.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

from .errors import Missing


class Txn(Protocol):
    """One transaction of the metadata engine. Values read are views valid until the next
    write in the transaction (or its end): copy what is kept. A write transaction may be
    run again from the start (map growth), so what runs in it must be safe to rerun."""

    def get(self, key: bytes, db: bytes) -> Any: ...

    def put(self, key: bytes, value: Any, db: bytes, overwrite: bool = True) -> bool: ...

    def put_many(self, items: Sequence[tuple[bytes, Any]], db: bytes) -> None:
        """`put` of each (key, value), overwriting, in one call (keys in order cost least)."""

    def replace(self, key: bytes, value: Any, db: bytes) -> Any: ...

    def delete(self, key: bytes, db: bytes) -> bool: ...

    def cursor(self, db: bytes) -> Any:
        """An ordered cursor over `db` (set_range, first, next, key, value, delete, iteration)."""


@dataclass(frozen=True)
class TierUsage:
    used_bytes: int  # bytes the tier occupies on disk
    live_bytes: int  # bytes of values still referenced
    capacity_bytes: int  # free space available to the tier + used (os.statvfs of its directory)


def capacity_of(directory: str | os.PathLike[str], used_bytes: int) -> int:
    """Free space an unprivileged writer may use in ``directory``, plus ``used_bytes``."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize + used_bytes


class ValueBackend(ABC):
    """A value tier. ``put``/``delete`` run inside the engine's write transaction
    (a ``Txn``); it may be retried, so both must be safe to rerun."""

    name: str  # "lmdb" or "nvme"

    @abstractmethod
    def put(self, txn: Txn, vkey: bytes, data: bytes | memoryview, stream: int = 0,
            direct: bool = False) -> bytes:
        """Store ``data``; return an opaque location (bytes). ``stream`` groups values that
        age together (a ring's); a tier may keep each stream's values apart. ``direct``: the
        bytes are read back rarely (a checkpoint's), so a tier may write them past the page
        cache."""

    @abstractmethod
    def get(self, loc: bytes) -> bytes:
        """The value at ``loc``; raises ``Missing`` if absent, ``Damaged`` if it does not verify."""

    def get_many(self, locs: Sequence[bytes]) -> list[bytes | None]:
        """The values at ``locs`` (None where absent) at once, where the tier can do that
        cheaper than one by one (one read transaction, one round trip). ``batched`` says so."""
        out: list[bytes | None] = []
        for loc in locs:
            try:
                out.append(self.get(loc))
            except Missing:
                out.append(None)
        return out

    batched = False  # get_many costs less than a get per value

    def get_in(self, txn: Txn, loc: bytes) -> bytes:
        """The value at ``loc`` as of ``txn`` (a read transaction of the engine, where the
        caller read the record naming ``loc``): a tier whose locations are rewritten in
        place (LMDB keys) reads them in that snapshot. Here: a tier whose bytes at a
        location never change until it is freed."""
        return self.get(loc)

    resident_reads = False  # get_resident can say without reading whether a value is in memory

    def get_resident(self, loc: bytes) -> bytes | None:
        """The value at ``loc`` if reading it cannot wait for the disk (every page of it in
        memory already), else None (not in memory, or the tier cannot tell: see
        ``resident_reads``); raises ``Missing`` if absent. For a caller that must not block
        (an event loop)."""
        return None

    def get_checked(self, loc: bytes) -> tuple[bytes, int | None]:
        """The value at ``loc`` and the CRC-32 the tier verified it against (None if the
        tier keeps no checksum of its own): a caller holding the same checksum need not
        compute it again."""
        return self.get(loc), None

    def get_into(self, loc: bytes, out: Any) -> tuple[memoryview, int] | None:
        """``get_checked`` into the writable buffer ``out`` (at least the value's size):
        a view of the value's bytes there and the CRC-32 the tier verified them against.
        None when this tier cannot read that value into a caller's buffer (the caller uses
        ``get_checked``): the default."""
        return None

    @abstractmethod
    def delete(self, txn: Txn, loc: bytes) -> None:
        """Drop the value at ``loc``; a missing location is a no-op."""

    @abstractmethod
    def sync(self) -> None:
        """Make everything put so far durable (fsync)."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Space accounting of the tier."""

    @abstractmethod
    def locations(self) -> Iterator[tuple[bytes, int]]:
        """Every location the tier holds, with its length (for verify/gc)."""

    @abstractmethod
    def close(self) -> None:
        """Release files and handles (does not close the shared LmdbEnv)."""

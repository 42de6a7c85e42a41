"""The one small interface every value tier implements (LMDB values, NVMe segments).

A tier stores opaque value bytes and hands back an opaque location. Metadata
changes a tier makes (accounting, indexes) happen in the caller's LMDB write
transaction, so they commit or roll back together with the references to the
location. Reading never needs a transaction.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import lmdb


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
    """A value tier. ``put``/``delete`` run inside ``LmdbEnv.write()``; the
    transaction may be retried, so both must be safe to rerun."""

    name: str  # "lmdb" or "nvme"

    @abstractmethod
    def put(self, txn: lmdb.Transaction, vkey: bytes, data: bytes | memoryview, stream: int = 0) -> bytes:
        """Store ``data``; return an opaque location (bytes). ``stream`` groups values that
        age together (a ring's); a tier may keep each stream's values apart."""

    @abstractmethod
    def get(self, loc: bytes) -> bytes:
        """The value at ``loc``; raises ``NotFound`` if absent."""

    def get_checked(self, loc: bytes) -> tuple[bytes, int | None]:
        """The value at ``loc`` and the CRC-32 the tier verified it against (None if the
        tier keeps no checksum of its own): a caller holding the same checksum need not
        compute it again."""
        return self.get(loc), None

    @abstractmethod
    def delete(self, txn: lmdb.Transaction, loc: bytes) -> None:
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

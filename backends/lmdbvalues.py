"""The LMDB value tier: values live in the ``values`` database of the shared
LmdbEnv, keyed by their vkey (the location *is* the vkey).

Live bytes are counted exactly in the ``tiermeta`` database, updated in the
same transaction as every put/delete, so the number survives restarts and can
never drift from the data.
"""

from __future__ import annotations

import struct
from typing import Iterator, Sequence

from .base import TierUsage, Txn, ValueBackend, capacity_of
from .errors import BadRequest, Missing
from .lmdbenv import LmdbEnv
from .resident import in_memory

DB_VALUES = b"values"
DB_TIERMETA = b"tiermeta"
_LIVE_KEY = b"lmdb.live_bytes"
_U64 = struct.Struct("<Q")
_MAX_KEY = 511  # LMDB's default maximum key size
_SCAN_BATCH = 4096  # keys per read transaction in locations()


class LmdbValues(ValueBackend):
    name = "lmdb"

    def __init__(self, env: LmdbEnv) -> None:
        self.env = env
        # Open the databases now: opening one inside a caller's write txn is not allowed.
        env.db(DB_VALUES)
        env.db(DB_TIERMETA)
        self.recent_live = 0

    def put(self, txn: Txn, vkey: bytes, data: bytes | memoryview, stream: int = 0,
            direct: bool = False) -> bytes:
        if not 0 < len(vkey) <= _MAX_KEY:
            raise BadRequest(f"vkey must be 1..{_MAX_KEY} bytes, got {len(vkey)}")
        size = memoryview(data).nbytes
        if txn.put(vkey, data, db=DB_VALUES, overwrite=False):
            delta = size
        else:
            # Rare (same vkey stored twice): replace and count only the difference.
            old = txn.replace(vkey, data, db=DB_VALUES)
            delta = size - len(old)
        self._add_live(txn, delta)
        return bytes(vkey)

    def get(self, loc: bytes) -> bytes:
        if not 0 < len(loc) <= _MAX_KEY:
            raise Missing(f"no value at location {loc!r}")
        value = self.get_many([loc])[0]
        if value is None:
            raise Missing(f"no value at location {loc.hex()}")
        return value

    batched = True  # one read transaction for them all

    def get_many(self, locs: Sequence[bytes]) -> list[bytes | None]:
        def fn(txn: Txn) -> list[bytes | None]:
            out: list[bytes | None] = []
            for loc in locs:
                view = txn.get(loc, db=DB_VALUES) if 0 < len(loc) <= _MAX_KEY else None
                out.append(None if view is None else bytes(view))  # copies out of the map
            return out
        return self.env.read(fn)

    resident_reads = True

    def get_resident(self, loc: bytes) -> bytes | None:
        # The lookup's own pages (the values database's branch and leaf pages) are not
        # asked about: every lookup touches them, as the catalog's lookups on the loop do.
        def fn(txn: Txn) -> bytes | None:
            view = txn.get(loc, db=DB_VALUES) if 0 < len(loc) <= _MAX_KEY else None
            if view is None:
                raise Missing(f"no value at location {loc.hex()}")
            return bytes(view) if in_memory(view) else None
        return self.env.read(fn)

    def get_in(self, txn: Txn, loc: bytes) -> bytes:
        view = txn.get(loc, db=DB_VALUES) if 0 < len(loc) <= _MAX_KEY else None
        if view is None:
            raise Missing(f"no value at location {loc.hex()}")
        return bytes(view)  # copies out of the map

    def delete(self, txn: Txn, loc: bytes) -> None:
        if not 0 < len(loc) <= _MAX_KEY:
            return
        # Write transactions use buffers=True: the view gives the length without a copy.
        old = txn.get(loc, db=DB_VALUES)
        if old is not None:
            size = len(old)
            txn.delete(loc, db=DB_VALUES)
            self._add_live(txn, -size)

    def _add_live(self, txn: Txn, delta: int) -> None:
        raw = txn.get(_LIVE_KEY, db=DB_TIERMETA)
        live = max(0, (_U64.unpack(raw)[0] if raw is not None else 0) + delta)
        txn.put(_LIVE_KEY, _U64.pack(live), db=DB_TIERMETA)
        self.recent_live = live  # as of the last write (its txn may still abort): for triggers only

    def live_bytes_in(self, txn: Txn) -> int:
        raw = txn.get(_LIVE_KEY, db=DB_TIERMETA)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def live_bytes(self) -> int:
        return self.env.read(self.live_bytes_in)

    def sync(self) -> None:
        self.env.sync()

    def usage(self) -> TierUsage:
        # The tier shares the environment file with the metadata; its on-disk
        # footprint is the whole environment's pages in use.
        used, _map_size = self.env.usage()
        return TierUsage(used_bytes=used, live_bytes=self.live_bytes(), capacity_bytes=capacity_of(self.env.path, used))

    def locations(self) -> Iterator[tuple[bytes, int]]:
        # Scan in batches, one short read txn each, so no transaction (and no
        # shared lock) is held while the caller runs between yields.
        after: bytes | None = None
        while True:

            def batch(txn: Txn) -> list[tuple[bytes, int]]:
                out: list[tuple[bytes, int]] = []
                cur = txn.cursor(DB_VALUES)
                found = cur.set_range(after) if after is not None else cur.first()
                if found and after is not None and bytes(cur.key()) == after:
                    found = cur.next()
                while found and len(out) < _SCAN_BATCH:
                    out.append((bytes(cur.key()), len(cur.value())))
                    found = cur.next()
                return out

            items = self.env.read(batch)
            yield from items
            if len(items) < _SCAN_BATCH:
                return
            after = items[-1][0]

    def close(self) -> None:
        # The LmdbEnv is shared with the metadata and closed by its owner.
        pass

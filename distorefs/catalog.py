"""The LMDB layout of the store's metadata: database names, key packing, entry records.

Databases (all in one LMDB environment, see `distorefs.backends.lmdbenv`):
  meta      store-wide keys: b"config" (StoreConfig JSON), b"next_ns" (u32), b"format"
  ns        b"KIND/NAME" -> namespace record (JSON: id, kind, config)
  entries   ns_id u32 BE + seq u64 BE -> entry record (EntryMeta.pack; format 2 adds the
            places of a buffer entry's arrays: where each field's bytes start, and their CRC-32)
  prio      ns_id + seq -> raw priority, f64, as inserted (later updates: priolog and
            priosnap, see distorefs/priojournal.py)
  sampled   ns_id + seq -> times sampled, u32
  values    value bytes of the LMDB tier (owned by LmdbValues)
Big-endian keys make a cursor walk one namespace in sequence (FIFO) order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .values import StoredValue

DB_META = b"meta"
DB_NS = b"ns"
DB_ENTRIES = b"entries"
DB_PRIO = b"prio"
DB_SAMPLED = b"sampled"

# 2: entry records carry their arrays' places (format-1 stores are migrated when opened).
# 3: priority updates are journaled (distorefs/priojournal.py: priolog, priosnap).
FORMAT_VERSION = 3

_KEY = struct.Struct(">IQ")
_NS = struct.Struct(">I")
_REC1 = struct.Struct("<QQIBBIIIqH")  # format 1: ... loc length; then loc, key (to the end)
_REC = struct.Struct("<QQIBBIIIqHHH")  # format 2: ... loc, key and places lengths; then each
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")


def entry_key(ns_id: int, seq: int) -> bytes:
    return _KEY.pack(ns_id, seq)


_KEY_ARRAY = np.dtype([("ns", ">u4"), ("seq", ">u8")])  # entry_key's bytes, as an array's record


def entry_keys(ns_id: int, seqs: np.ndarray) -> list[bytes]:
    """`entry_key` of each of `seqs` (one array's bytes cut up, not a pack per key)."""
    keys = np.empty(len(seqs), dtype=_KEY_ARRAY)
    keys["ns"], keys["seq"] = ns_id, seqs
    return _cut(keys.tobytes(), _KEY.size)


def pack_u32s(values: np.ndarray) -> list[bytes]:
    """`pack_u32` of each of `values`."""
    return _cut(np.asarray(values, dtype="<u4").tobytes(), _U32.size)


def _cut(data: bytes, width: int) -> list[bytes]:
    return [data[i:i + width] for i in range(0, len(data), width)]


def split_entry_key(key: bytes) -> tuple[int, int]:
    return _KEY.unpack(key)


def ns_prefix(ns_id: int) -> bytes:
    return _NS.pack(ns_id)


def pack_f64(value: float) -> bytes:
    return _F64.pack(value)


def unpack_f64(data: bytes) -> float:
    return _F64.unpack(data)[0]


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def unpack_u32(data: bytes) -> int:
    return _U32.unpack(data)[0]


@dataclass(slots=True)
class EntryMeta:
    """Everything known about one committed entry, as persisted in the `entries` db.

    `places`: where each array of a buffer entry starts in its content, and its CRC-32
    (distorefs/layout.py packs them; empty for banks and raw-mode buffers). `slot` (the
    entry's leaf in the samplers' trees) and `gen` (bumped on every rewrite, so caches
    never serve a previous version) live only in memory.
    """

    seq: int
    key: bytes
    value: StoredValue
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    places: bytes = b""
    slot: int = -1
    gen: int = 0

    @property
    def size(self) -> int:
        return self.value.size

    @property
    def stored_size(self) -> int:
        return self.value.stored_size

    @property
    def checksum(self) -> int:
        return self.value.checksum

    @property
    def tier(self) -> int:
        return self.value.tier

    def same_content(self, other: "EntryMeta | None") -> bool:
        """Whether `other` is this entry with the same content (moved between tiers,
        renamed, or given new attributes since), not a rewrite of it."""
        return other is not None and other.seq == self.seq and other.value.checksum == self.value.checksum \
            and other.value.size == self.value.size

    def pack(self) -> bytes:
        v = self.value
        return _REC.pack(v.size, v.stored_size, v.checksum, v.codec, v.tier, self.mode, self.uid, self.gid,
                         self.mtime_ns, len(v.loc), len(self.key), len(self.places)) + v.loc + self.key + self.places

    @classmethod
    def unpack(cls, seq: int, data: bytes | memoryview) -> "EntryMeta":
        (size, stored, crc, codec, tier, mode, uid, gid, mtime, loc_len, key_len, places_len) = _REC.unpack_from(data)
        a = _REC.size
        b = a + loc_len
        c = b + key_len
        return cls(seq, bytes(data[b:c]), StoredValue(size, stored, crc, codec, tier, bytes(data[a:b])), mode, uid,
                   gid, mtime, bytes(data[c:c + places_len]))

    @classmethod
    def unpack_v1(cls, seq: int, data: bytes | memoryview) -> "EntryMeta":
        """A record of a format-1 store (no places), read once when the store is migrated."""
        (size, stored, crc, codec, tier, mode, uid, gid, mtime, loc_len) = _REC1.unpack_from(data)
        start = _REC1.size
        loc = bytes(data[start:start + loc_len])
        key = bytes(data[start + loc_len:])
        return cls(seq, key, StoredValue(size, stored, crc, codec, tier, loc), mode, uid, gid, mtime)

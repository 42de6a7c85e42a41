"""Chunked values: a file-sized value stored as a list of chunks, each its own checksummed value.

Weights versions, dataset items and dataset indexes are files of any size; storing them
in chunks of a bounded size keeps memory bounded on both sides (a writer encodes one
chunk at a time, a reader decodes only the chunks its range touches) and lets each chunk
land in the tier placement chooses for its size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import codec
from .errors import CorruptValue, NotFound
from .placement import choose_tier

if TYPE_CHECKING:
    from .store import Store

_CHUNK = struct.Struct("<QQIBBH")


@dataclass
class Chunk:
    size: int
    stored_size: int
    checksum: int
    codec: int
    tier: int
    loc: bytes

    def pack(self) -> bytes:
        return _CHUNK.pack(self.size, self.stored_size, self.checksum, self.codec, self.tier,
                           len(self.loc)) + self.loc

    @classmethod
    def unpack_from(cls, data, off: int) -> tuple["Chunk", int]:
        size, stored, crc, cdc, tier, loc_len = _CHUNK.unpack_from(data, off)
        off += _CHUNK.size
        return cls(size, stored, crc, cdc, tier, bytes(data[off:off + loc_len])), off + loc_len


def put_encoded(store: "Store", txn, vkey: bytes, enc: codec.Encoded) -> Chunk:
    """Store one encoded chunk in the tier placement picks (inside the caller's write txn)."""
    tier = choose_tier(store, txn, len(enc.stored))
    loc = store.backend(tier).put(txn, vkey, enc.stored)
    return Chunk(enc.size, len(enc.stored), enc.checksum, enc.codec, tier, loc)


def put_chunk(store: "Store", txn, vkey: bytes, raw, compression: str, level: int = 1) -> Chunk:
    return put_encoded(store, txn, vkey, codec.encode(raw, compression, level))


def load_chunk(store: "Store", chunk: Chunk, what: str) -> bytes:
    """Read and verify one chunk (worker thread); a failure is logged, counted and EIO."""
    try:
        return store.read_stored(chunk, what)
    except (CorruptValue, NotFound) as exc:
        raise store.report_corrupt(CorruptValue(f"{what}: {exc}")) from None


def delete_chunks(store: "Store", txn, chunks: list[Chunk]) -> None:
    for chunk in chunks:
        store.backend(chunk.tier).delete(txn, chunk.loc)

"""A buffer's priority updates, as written to the catalog: a journal and its snapshot.

A `priorities` write of 64 lines used to put 64 rows of `prio` (one per entry), and each
row sits on a page of its own in a large buffer: the learner's commit copied and wrote
some 60 pages of LMDB a step, holding the learner's close() behind them. Now a write is
one journal record, and the journal is folded from time to time into a snapshot of the
buffer's priorities, taken from memory:

  priolog   ns_id u32 BE + record number u64 BE -> the write's (seq, priority) pairs
  priosnap  ns_id u32 BE + chunk u32 BE -> (seq, priority) pairs of every entry the
            buffer held when its snapshot was taken (SNAPSHOT_CHUNK pairs a row)

Pairs are packed little-endian as u64 seq and f64 raw priority (`PAIR`). An entry's
priority at load is, latest first: its last journal record, the snapshot, its `prio` row
(written with the entry at its insert). A snapshot written with records below `upto`
applied deletes those records in its transaction, so what a load reads is never older
than what it replaces. Pairs of entries removed since are ignored at load and dropped by
the next snapshot. The buffer keeps the record numbers (distorefs/buffer.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .backends.base import Txn
from .catalog import ns_prefix

DB_PRIOLOG = b"priolog"
DB_PRIOSNAP = b"priosnap"

PAIR = np.dtype([("seq", "<u8"), ("priority", "<f8")])
SNAPSHOT_CHUNK = 65536  # pairs per snapshot row (1 MiB)

_RECORD = struct.Struct(">IQ")
_CHUNK = struct.Struct(">II")


@dataclass
class Journal:
    """What a buffer's journal and snapshot hold, read at load."""

    seqs: np.ndarray  # u64: the snapshot's pairs, then every record's, in the order they were written
    priorities: np.ndarray  # f64, beside `seqs`: where a seq repeats, the last one holds
    next_record: int  # the number the next record gets
    updates: int  # pairs in the journal records (written since the snapshot)


def pack(seqs: np.ndarray, priorities: np.ndarray) -> bytes:
    pairs = np.empty(len(seqs), dtype=PAIR)
    pairs["seq"] = seqs
    pairs["priority"] = priorities
    return pairs.tobytes()


def unpack(data: bytes | memoryview) -> np.ndarray:
    """The pairs of a row (ValueError if its length is not a whole number of pairs)."""
    if len(data) % PAIR.itemsize:
        raise ValueError(f"{len(data)} bytes are not whole (seq, priority) pairs")
    return np.frombuffer(bytes(data), dtype=PAIR)


def put_record(txn: Txn, ns_id: int, number: int, seqs: np.ndarray, priorities: np.ndarray) -> None:
    txn.put(_RECORD.pack(ns_id, number), pack(seqs, priorities), db=DB_PRIOLOG)


def put_snapshot(txn: Txn, ns_id: int, upto: int, seqs: np.ndarray, priorities: np.ndarray) -> None:
    """Replace the buffer's snapshot with these pairs, and drop the records below `upto`
    (those whose updates the pairs hold)."""
    _delete_rows(txn, DB_PRIOSNAP, ns_id)
    _delete_rows(txn, DB_PRIOLOG, ns_id, below=_RECORD.pack(ns_id, upto))
    for chunk, start in enumerate(range(0, len(seqs), SNAPSHOT_CHUNK)):
        end = start + SNAPSHOT_CHUNK
        txn.put(_CHUNK.pack(ns_id, chunk), pack(seqs[start:end], priorities[start:end]), db=DB_PRIOSNAP)


def drop(txn: Txn, ns_id: int) -> None:
    """Every row of a buffer that is dropped."""
    _delete_rows(txn, DB_PRIOSNAP, ns_id)
    _delete_rows(txn, DB_PRIOLOG, ns_id)


def read(txn: Txn, ns_id: int) -> Journal:
    snapshot = [unpack(v) for _, v in _rows(txn, DB_PRIOSNAP, ns_id)]
    records = []
    next_record = 0
    for key, value in _rows(txn, DB_PRIOLOG, ns_id):
        records.append(unpack(value))
        next_record = _RECORD.unpack(key)[1] + 1
    updates = sum(len(r) for r in records)
    pairs = np.concatenate(snapshot + records) if snapshot or records else np.empty(0, dtype=PAIR)
    return Journal(pairs["seq"].astype(np.int64), pairs["priority"].copy(), next_record, updates)


def namespace_of(key: bytes) -> int:
    """The namespace id a row of either db belongs to."""
    return struct.unpack_from(">I", key)[0]


def _rows(txn: Txn, db: bytes, ns_id: int, below: bytes | None = None) -> list[tuple[bytes, memoryview]]:
    prefix = ns_prefix(ns_id)
    out = []
    cursor = txn.cursor(db)
    if cursor.set_range(prefix):
        for k, v in cursor:
            key = bytes(k)
            if key[:4] != prefix or (below is not None and key >= below):
                break
            out.append((key, v))
    return out


def _delete_rows(txn: Txn, db: bytes, ns_id: int, below: bytes | None = None) -> None:
    for key, _ in _rows(txn, db, ns_id, below):
        txn.delete(key, db=db)

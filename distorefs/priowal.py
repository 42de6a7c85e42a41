"""Priority writes acknowledged before Python saw them: the store's STORE/priorities.wal.

A learner's `priorities` write of whole, well-formed lines is checked and answered by the
mount's front in C (mount/_interpose.c), which appends it to this file first. Its close()
then returns once the kernel holds the record (a kill -9 of the daemon loses nothing it
acknowledged) instead of waiting for the trio loop, the commit queue and an LMDB
transaction. Python takes the writes a moment later and commits them into the buffer's
priority journal (distorefs/priojournal.py), each with its record's number: the
transaction also sets APPLIED_KEY (DB_META) to it. At the next open the records past that
number are committed again (`Store` replays `PriorityWal.pending`), and the file is
emptied whenever every record in it is committed (the front's `priority_log_trim`). The
store's sync (every `sync_interval`, and every fsync) syncs it with the catalog.

Record, little-endian: magic u32, ns_id u32, number u64, length u32, crc u32 (CRC-32, as
zlib's, of the 20 bytes before it and then the text), then `length` bytes: the write's
"KEY PRIORITY" lines. Numbers only grow, across trims and mounts. The file is only ever
appended to, so only its last record can be cut short (a power loss before the sync); a
record cut short or failing its CRC ends what is read.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .catalog import DB_META
from .committer import Change

HEADER = struct.Struct("<IIQII")
_HEAD = struct.Struct("<IIQI")  # what the CRC covers before the text
_CRC = struct.Struct("<I")
MAGIC = 0x4C525044  # "DPRL"
APPLIED_KEY = b"priowal_applied"
_U64 = struct.Struct("<Q")
FILE_NAME = "priorities.wal"


@dataclass(frozen=True)
class Record:
    ns_id: int
    number: int
    text: bytes


def pack(ns_id: int, number: int, text: bytes) -> bytes:
    """One record, as the front writes it."""
    head = _HEAD.pack(MAGIC, ns_id, number, len(text))
    return head + _CRC.pack(zlib.crc32(text, zlib.crc32(head))) + text


def read_records(data: bytes) -> list[Record]:
    """The whole, intact records at the start of `data`, in order."""
    out: list[Record] = []
    at = 0
    while at + HEADER.size <= len(data):
        magic, ns_id, number, length, crc = HEADER.unpack_from(data, at)
        end = at + HEADER.size + length
        if magic != MAGIC or end > len(data):
            break
        text = data[at + HEADER.size:end]
        if zlib.crc32(text, zlib.crc32(data[at:at + _HEAD.size])) != crc:
            break
        out.append(Record(ns_id, number, text))
        at = end
    return out


def applied_number(txn) -> int:
    """The number of the last record committed into a priority journal (0: none)."""
    raw = txn.get(APPLIED_KEY, db=DB_META)
    return _U64.unpack(bytes(raw))[0] if raw is not None else 0


def put_applied(txn, number: int) -> None:
    txn.put(APPLIED_KEY, _U64.pack(number), db=DB_META)


class PriorityWal:
    """The open file: what it holds past the applied number, the number the next record
    gets, and the descriptor the front appends through."""

    def __init__(self, directory: Path, applied: int) -> None:
        self.path = Path(directory) / FILE_NAME
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with open(self.path, "rb") as f:
            records = read_records(f.read())
        self.pending = [r for r in records if r.number > applied]
        self.next_number = max([applied] + [r.number for r in records]) + 1
        self.applied = applied
        self.replayed = 0  # records committed again at open
        # told of each record committed (the committer's thread): the mount's front, which
        # empties the file when nothing past it was appended (mount/interpose.py)
        self.on_committed: Callable[[int], object] | None = None

    def committed(self, number: int) -> None:
        """Record `number` is in its journal (the committer's thread, in commit order)."""
        if number > self.applied:
            self.applied = number

    def trim(self) -> None:
        """Empty the file if every record in it is committed (only while nothing appends)."""
        if self.applied >= self.next_number - 1:
            os.ftruncate(self.fd, 0)
            self.pending = []

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class NoteApplied(Change):
    """Record `number` is done with and committed nowhere else (its buffer is gone, or its
    lines did not parse): the number alone, so that it is never replayed."""

    def __init__(self, number: int) -> None:
        self.number = number

    def txn(self, txn) -> None:
        put_applied(txn, self.number)

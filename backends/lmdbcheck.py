"""Checks of an LMDB data file that must come before LMDB maps it.

LMDB maps `data.mdb` and trusts its meta pages: a file shorter than the pages its newest
meta page says are in use is mapped anyway, and the first touch of a missing page kills
the process with SIGBUS (no traceback, an empty log). `check_data_file` reads the two meta
pages with ordinary reads and refuses such a file, saying what is wrong. The layout read
here is LMDB's (mdb.c, 64-bit): a 16-byte page header, then MDB_meta: magic, version,
address, map size, two MDB_db records (the first one's pad field holds the page size),
the last page number in use and the transaction id.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from .errors import Unreadable

MAGIC = 0xBEEFC0DE
_HEAD = struct.Struct("<II")  # magic, version at offset 16
_PSIZE = 40  # mm_dbs[0].md_pad: the page size
_LAST = struct.Struct("<QQ")  # mm_last_pg, mm_txnid at offset 136
_META_END = 152


def _meta(raw: bytes) -> tuple[int, int, int] | None:
    """(page size, last page, txnid) of one meta page, or None if it is not one."""
    if len(raw) < _META_END:
        return None
    magic, _version = _HEAD.unpack_from(raw, 16)
    if magic != MAGIC:
        return None
    psize = struct.unpack_from("<I", raw, _PSIZE)[0]
    last, txnid = _LAST.unpack_from(raw, 136)
    return psize, last, txnid


def check_data_file(env_dir: str | os.PathLike) -> None:
    """Unreadable if `env_dir`/data.mdb exists and LMDB could not map it safely."""
    path = Path(env_dir) / "data.mdb"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return  # a new store
    if size == 0:
        return  # created, never written: LMDB initialises it
    with open(path, "rb") as f:
        first = _meta(f.read(_META_END))
        if first is None:
            raise Unreadable(f"{path} is not an LMDB data file (no meta page at its start): damaged")
        psize = first[0]
        if psize < 512 or psize & (psize - 1) or size < 2 * psize:
            raise Unreadable(f"{path} is damaged: {size} bytes, page size {psize}: its meta pages are cut off")
        f.seek(psize)
        second = _meta(f.read(_META_END))
    metas = [m for m in (first, second) if m is not None]
    psize, last, txnid = max(metas, key=lambda m: m[2])
    need = (last + 1) * psize
    if size < need:
        raise Unreadable(
            f"{path} is truncated: {size} bytes, but its newest meta page (transaction {txnid}) uses pages "
            f"up to {last}, {need} bytes: mapping it would crash (SIGBUS); restore the file from a copy")


__all__ = ["check_data_file"]

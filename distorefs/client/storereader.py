"""Reading stored values straight from a store's files, in the caller's process.

The daemon says where a value is (a StoredValue: tier, location, sizes, checksum, codec);
this module reads it: the LMDB environment opened read-only (LMDB is built for many
reader processes: each read transaction is a consistent snapshot, registered in the lock
file so the writer never reuses its pages), segment files by the paths the daemon gave.
Every value is checked by its tier (a segment record's CRC) and by its own checksum after
decoding; what does not verify is reported, never returned - the caller asks the daemon
where the value is now.

Imports neither trio nor pyfuse3.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, NamedTuple

import lmdb

from .. import codec
from ..backends.crc import crc32
from ..backends.errors import Damaged, Missing
from ..backends.segments import HEADER, LOCATION, MAGIC, read_record
from ..errors import CorruptValue
from ..placement import TIER_LMDB, TIER_NVME

DB_VALUES = b"values"  # backends/lmdbvalues.py
MAX_OPEN_SEGMENTS = 128


class Wanted(NamedTuple):
    """One value to read: where it is and how to check it, and what to call it in errors
    (a tuple: made for every value of every batch)."""

    tier: int
    loc: bytes
    size: int
    stored_size: int
    checksum: int
    codec: int
    what: str


class Unreadable(OSError):
    """The caller may not read the store's files (another user's store, say)."""


_open: dict[tuple[int, str], "StoreReader"] = {}
_open_lock = threading.Lock()


def store_reader(lmdb_path: str | os.PathLike) -> "StoreReader":
    """This process's reader of the store at `lmdb_path`: one per process and store (LMDB
    refuses a second open of an environment in one process), shared by its sessions; each
    call takes a reference that `close()` gives back."""
    key = (os.getpid(), os.path.realpath(lmdb_path))
    with _open_lock:
        reader = _open.get(key)
        if reader is None:
            reader = _open[key] = StoreReader(lmdb_path)
        reader.refs += 1
        return reader


class StoreReader:
    def __init__(self, lmdb_path: str | os.PathLike) -> None:
        """Open the store whose LMDB environment is `lmdb_path`, read-only. Unreadable if
        this process may not (permissions: a store of another user)."""
        path = Path(lmdb_path)
        for name in ("data.mdb", "lock.mdb"):
            if not os.access(path / name, os.R_OK | (os.W_OK if name == "lock.mdb" else 0)):
                raise Unreadable(f"{path / name}: not readable by this process")
        try:
            # lock=True: this process's readers are registered in lock.mdb (which needs write
            # access to it), so the daemon never reuses a page a read here still sees.
            # readahead=True: the kernel reads around a page that faults (it stops by itself
            # on a mapping whose read-around pages go unused). Without it (MADV_RANDOM) a cold
            # 10 KB value is three 4 KB reads one after another: a cold shuffled epoch of 100k
            # such items with 4 readers ran at 7,200 items/s, with it at 20,000 (warm: the same).
            self.env = lmdb.open(str(path), readonly=True, lock=True, subdir=True, max_dbs=32,
                                 max_readers=256, readahead=True, map_size=0)
            self.values = self.env.open_db(DB_VALUES, create=False)
        except lmdb.Error as exc:
            raise Unreadable(f"{path}: {exc}") from exc
        self.path = path
        self.segment_paths: dict[int, str | None] = {}
        self._fds: OrderedDict[int, int] = OrderedDict()
        # Segment files mapped for the reads of a snapshot (views, not copies). A map is
        # only ever dropped, never closed: views handed out keep it alive until released.
        self._maps: OrderedDict[int, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()
        self.pid = os.getpid()
        self.refs = 0

    def learn_segments(self, paths: dict) -> None:
        """Paths of segments, as the daemon gives them (segment id -> path, None: missing)."""
        for seg, path in paths.items():
            self.segment_paths[int(seg)] = path

    # ----- reads ------------------------------------------------------------------------------

    def read(self, wanted: list[Wanted]) -> list[bytes | Exception]:
        """Each value's decoded, verified content, or the error of its read: Missing (not at
        its location: moved or removed), Damaged or CorruptValue (did not verify)."""
        out: list[bytes | Exception] = [b""] * len(wanted)
        lmdb_items = [i for i, w in enumerate(wanted) if w.tier == TIER_LMDB]
        if lmdb_items:
            self._read_lmdb(wanted, lmdb_items, out)
        for i, w in enumerate(wanted):
            if w.tier == TIER_LMDB:
                continue
            try:
                out[i] = self._read_segment(w)
            except (Missing, Damaged, CorruptValue, OSError) as exc:
                out[i] = exc
        return out

    def _read_lmdb(self, wanted: list[Wanted], items: list[int], out: list) -> None:
        for _attempt in range(3):
            try:
                with self.env.begin(db=self.values, buffers=True) as txn:
                    for i in items:
                        w = wanted[i]
                        view = txn.get(w.loc)
                        if view is None:
                            out[i] = Missing(f"{w.what}: not in LMDB any more")
                            continue
                        try:  # decoded (copied) inside the transaction
                            out[i] = _decode(view, w, None)
                        except CorruptValue as exc:  # rewritten since (same vkey), or damaged
                            out[i] = exc
                return
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)  # the daemon grew the map: adopt its size
        for i in items:
            out[i] = Damaged(f"{wanted[i].what}: LMDB map keeps growing")

    @contextlib.contextmanager
    def snapshot(self) -> Iterator["Snapshot"]:
        """One LMDB read transaction held while values read in it are used: uncompressed
        values come back as views into the map (verified, not copied), valid until the end
        of the `with` block. Locations handed out after it began are read with `read`."""
        for _attempt in range(3):
            try:
                txn = self.env.begin(db=self.values, buffers=True)
                break
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)
        else:
            raise Damaged(f"{self.path}: LMDB map keeps growing")
        try:
            yield Snapshot(self, txn)
        finally:
            txn.abort()

    def _read_segment(self, w: Wanted) -> bytes:
        if w.tier != TIER_NVME:  # a shared store's value in the cluster: the mount reads it
            raise Missing(f"{w.what}: in the cluster of a shared store, not in this node's files")
        seg, off, size = LOCATION.unpack(w.loc)
        fd = self._fd(seg, w.what)
        try:
            stored, crc = read_record(fd, seg, off, size)
        except Damaged as exc:
            raise Damaged(f"{w.what}: {exc}") from None
        return _decode(stored, w, crc)

    def _fd(self, seg: int, what: str) -> int:
        with self._lock:
            fd = self._fds.get(seg)
            if fd is not None:
                self._fds.move_to_end(seg)
                return fd
            path = self.segment_paths.get(seg)
            if path is None:
                raise Missing(f"{what}: segment {seg} is not known")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise Missing(f"{what}: segment {seg} is gone") from None
            self._fds[seg] = fd
            while len(self._fds) > MAX_OPEN_SEGMENTS:
                os.close(self._fds.popitem(last=False)[1])
            return fd

    def segment_view(self, w: Wanted, verify: bool = True) -> tuple[memoryview, int]:
        """(a view of the stored bytes of segment value `w`, their CRC-32 as its record's
        header gives it), verified against that header (only its magic and length unless
        `verify`: the caller then checks what it uses); Damaged (or Missing) otherwise. The segment file is mapped (and
        mapped again once it grew past its map): segments are only appended to, and a record
        handed out is never cut from its file."""
        seg, off, size = LOCATION.unpack(w.loc)
        if off < HEADER.size:
            raise Damaged(f"{w.what}: segment {seg} location {off} points inside a header")
        with self._lock:
            m = self._maps.get(seg)
        if m is None or len(m) < off + size:
            fd = self._fd(seg, w.what)
            length = os.fstat(fd).st_size
            if length < off + size:
                raise Damaged(f"{w.what}: segment {seg} ends at {length}, before its record's end {off + size}")
            m = mmap.mmap(fd, length, access=mmap.ACCESS_READ)
            with self._lock:
                self._maps[seg] = m
                while len(self._maps) > MAX_OPEN_SEGMENTS:
                    self._maps.popitem(last=False)
        magic, _klen, dlen, crc = HEADER.unpack_from(m, off - HEADER.size)
        if magic != MAGIC or dlen != size:
            raise Damaged(f"{w.what}: segment {seg} offset {off}: bad record header")
        view = memoryview(m)[off:off + size]
        if verify and crc32(view) != crc:
            view.release()
            raise Damaged(f"{w.what}: segment {seg} offset {off}: checksum mismatch")
        return view, crc

    def forget_segment(self, seg: int) -> None:
        """Drop the open file of `seg`: a read at a location handed out again opens the path anew."""
        with self._lock:
            self._maps.pop(seg, None)
            fd = self._fds.pop(seg, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Give back a reference (store_reader); the last one closes the files."""
        with _open_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            _open.pop((self.pid, os.path.realpath(self.path)), None)
        if os.getpid() != self.pid:
            return  # inherited across fork: the parent's files and environment are not ours to close
        with self._lock:
            fds, self._fds = list(self._fds.values()), OrderedDict()
            self._maps.clear()
        for fd in fds:
            os.close(fd)
        self.env.close()


class Snapshot:
    """Reads in one held LMDB transaction (StoreReader.snapshot); segment values as views of
    their mapped files."""

    def __init__(self, reader: StoreReader, txn) -> None:
        self.reader = reader
        self.txn = txn

    def read(self, wanted: list[Wanted], verify: bool = True) -> list[bytes | memoryview | Exception]:
        """As StoreReader.read; an uncompressed LMDB value is a verified view into the map,
        and so is an uncompressed segment value. `verify` False: an uncompressed value is
        not checked here (a segment record's header is): the caller checks the bytes it
        copies out of it (the arrays of a batch, against their CRC-32s) as it copies them,
        so that they are read from memory once."""
        out: list[bytes | memoryview | Exception] = []
        get = self.txn.get
        for w in wanted:
            try:
                if w.tier == TIER_NVME:  # a view into the mapped segment
                    plain = w.codec == codec.RAW and w.size == w.stored_size
                    stored, crc = self.reader.segment_view(w, verify=verify or not plain)
                    if plain and crc == w.checksum and len(stored) == w.size:
                        out.append(stored)
                    else:
                        out.append(_decode(stored, w, crc))
                    continue
                if w.tier != TIER_LMDB:
                    out.append(self.reader._read_segment(w))
                    continue
                view = get(w.loc)
                if view is None:
                    out.append(Missing(f"{w.what}: not in LMDB any more"))
                elif w.codec == codec.RAW and len(view) == w.stored_size == w.size and (
                        not verify or codec.checksum(view) == w.checksum):
                    out.append(view)
                else:
                    out.append(_decode(view, w, None))
            except (Missing, Damaged, CorruptValue, OSError) as exc:
                out.append(exc)
        return out


def _decode(stored, w: Wanted, tier_crc: int | None) -> bytes:
    if len(stored) != w.stored_size:
        raise CorruptValue(f"{w.what}: stored size {len(stored)}, expected {w.stored_size}")
    return codec.decode(stored, w.codec, w.size, w.checksum, w.what, stored_crc=tier_crc)


def segment_of(loc: bytes) -> int:
    return LOCATION.unpack(loc)[0]

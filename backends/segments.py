"""The NVMe value tier: values appended to segment files ``seg-00000001.dat`` …

Owns the segment directory and the ``segments`` database of the shared LmdbEnv
(per-segment live/total accounting, written in the caller's transaction).

On-disk record::

    header  = magic b"DSEG" | vkey length u16 | data length u64 | crc32(data) u32   (little-endian, 18 bytes)
    record  = header + data + vkey

The header sits directly before the data so that ``get`` reads header and data
with one ``pread`` at ``offset - 18`` and checks magic, length and crc. The
vkey trails the data; it is only there so a scan (``locations``) or a repair
tool can name what a record holds. A location is ``(segment id u32, offset of
the data u64, length u64)``.

Accounting: the ``segments`` db maps segment id -> (live bytes, total bytes,
live records), updated in the caller's transaction. ``collect()`` unlinks a
non-current segment once its live *records* reach 0 (counting records, not
bytes, keeps a segment holding only empty values alive). ``delete`` cannot
tell whether a location was already deleted: callers delete each location
exactly once (the store's reference counts guarantee it). Segment files that
have no record at open time hold only uncommitted puts; ``collect()`` removes
them too.

Crash model: bytes are written with ``pwrite`` and made durable only by
``sync()``; the caller must sync this tier before it makes durable any
metadata that references the new locations. Bytes of a put whose transaction
aborted (or never committed) are dead space. Each process start appends to a
fresh segment, so a torn tail from a crash is always at the end of a file and
a scan stops there cleanly.

Thread rules: ``put``/``delete`` run inside ``LmdbEnv.write()``; ``get`` may
run from any number of threads at once; ``collect()`` and ``sync()`` run
outside transactions (``collect`` opens its own write transaction).
"""

from __future__ import annotations

import errno
import os
import re
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, Sequence

import lmdb

from .base import TierUsage, ValueBackend, capacity_of
from .lmdbenv import LmdbEnv
from distorefs.errors import CorruptValue, InvalidArgument, NoSpace, NotFound

MAGIC = b"DSEG"
HEADER = struct.Struct("<4sHQI")  # magic, vkey length, data length, crc32 of data
LOCATION = struct.Struct("<IQQ")  # segment id, offset of the data, data length
_SEG_KEY = struct.Struct(">I")  # big-endian so the db iterates in segment order
_SEG_VAL = struct.Struct("<QQQ")  # live bytes, total bytes, live records
_NAME = re.compile(r"^seg-(\d+)\.dat$")
_MAX_VKEY = 0xFFFF


def _segment_name(seg: int) -> str:
    return f"seg-{seg:08d}.dat"


def _pwrite_all(fd: int, parts: Sequence[bytes | memoryview], offset: int) -> None:
    """pwritev until every byte is written (regular files may write short)."""
    bufs = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while bufs:
        n = os.pwritev(fd, bufs, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    """pread up to ``size`` bytes; short only at end of file (Linux caps one call near 2 GiB)."""
    data = os.pread(fd, size, offset)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class _Reader:
    """A cached read fd, reference-counted so that collect() never closes an fd
    another thread is about to pread (the number could be reused)."""

    __slots__ = ("fd", "refs", "retired")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 0
        self.retired = False


class SegmentValues(ValueBackend):
    name = "nvme"

    def __init__(
        self,
        env: LmdbEnv,
        directory: str | os.PathLike[str],
        segment_bytes: int = 256 << 20,
        max_open_readers: int = 256,
    ) -> None:
        if segment_bytes <= 0:
            raise InvalidArgument("segment_bytes must be positive")
        self.env = env
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self._segdb = env.db(b"segments")
        self._max_readers = max_open_readers

        # Lock order: env write lock -> _sync_lock -> _lock; _readers_lock is a leaf.
        self._lock = threading.Lock()  # append state, dirty set, retired fds
        self._sync_lock = threading.Lock()  # only holders of it close write fds
        self._readers_lock = threading.Lock()
        self._readers: OrderedDict[int, _Reader] = OrderedDict()

        recorded = set(env.read(lambda txn: [_SEG_KEY.unpack(bytes(k))[0] for k in txn.cursor(db=self._segdb).iternext(values=False)]))
        on_disk = set(self._segment_files())
        # Always start a fresh segment: a torn tail from a crash stays at the end
        # of the old file. The file itself is created on the first put.
        self._cur = max(on_disk | recorded, default=0) + 1
        self._fd: int | None = None
        self._offset = 0
        self._dirty: set[int] = set()  # segments written since the last sync
        self._retired: dict[int, int] = {}  # rolled-over write fds, closed after their fsync
        self._dir_dirty = False
        # Files with no accounting record hold only uncommitted puts. If the db
        # has no records at all, refuse to judge (it may be the wrong env).
        self._orphans = on_disk - recorded if recorded else set()
        self._closed = False

    # -- paths ---------------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.directory / _segment_name(seg)

    def _segment_files(self) -> list[int]:
        ids = []
        for entry in os.scandir(self.directory):
            m = _NAME.match(entry.name)
            if m:
                ids.append(int(m.group(1)))
        return sorted(ids)

    # -- writes --------------------------------------------------------------

    def put(self, txn: lmdb.Transaction, vkey: bytes, data: bytes | memoryview) -> bytes:
        if len(vkey) > _MAX_VKEY:
            raise InvalidArgument(f"vkey longer than {_MAX_VKEY} bytes")
        view = memoryview(data).cast("B")
        size = view.nbytes
        header = HEADER.pack(MAGIC, len(vkey), size, zlib.crc32(view))
        record = HEADER.size + size + len(vkey)
        with self._lock:
            if self._closed:
                raise RuntimeError("SegmentValues is closed")
            if self._offset > 0 and self._offset + record > self.segment_bytes:
                self._roll()
            seg, start = self._cur, self._offset
            try:
                if self._fd is None:
                    self._fd = os.open(self._path(seg), os.O_WRONLY | os.O_CREAT, 0o600)
                    self._dir_dirty = True
                    start = self._offset = os.fstat(self._fd).st_size
                _pwrite_all(self._fd, (header, view, vkey), start)
            except OSError as exc:
                # Drop the torn record so the file stays walkable; the offset
                # is not advanced, so the next put overwrites whatever remains.
                if self._fd is not None:
                    try:
                        os.ftruncate(self._fd, start)
                    except OSError:
                        pass
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise NoSpace(f"{self.directory}: no space for a {size}-byte value") from exc
                raise
            self._offset = start + record
            self._dirty.add(seg)
        # Accounting goes into the caller's txn: it commits or aborts together
        # with the reference to the location.
        self._account(txn, seg, size, 1, grow_total=True)
        return LOCATION.pack(seg, start + HEADER.size, size)

    def _roll(self) -> None:
        """Start the next segment (caller holds _lock). The old fd is not closed
        here: a concurrent sync() may be fsyncing it; sync closes it afterwards."""
        if self._fd is not None:
            self._retired[self._cur] = self._fd
        self._cur += 1
        self._fd = None
        self._offset = 0

    def delete(self, txn: lmdb.Transaction, loc: bytes) -> None:
        try:
            seg, _off, size = LOCATION.unpack(loc)
        except struct.error:
            return
        self._account(txn, seg, -size, -1, grow_total=False)

    def _account(self, txn: lmdb.Transaction, seg: int, dbytes: int, drecords: int, grow_total: bool) -> None:
        key = _SEG_KEY.pack(seg)
        raw = txn.get(key, db=self._segdb)
        if raw is None:
            if not grow_total:
                return  # delete of an unknown (already collected) segment: no-op
            live = total = records = 0
        else:
            live, total, records = _SEG_VAL.unpack(raw)
        total += dbytes if grow_total else 0
        txn.put(key, _SEG_VAL.pack(max(0, live + dbytes), total, max(0, records + drecords)), db=self._segdb)

    # -- reads ---------------------------------------------------------------

    def get(self, loc: bytes) -> bytes:
        try:
            seg, off, size = LOCATION.unpack(loc)
        except struct.error:
            raise CorruptValue(f"malformed segment location {loc.hex()}") from None
        if off < HEADER.size:
            raise CorruptValue(f"segment location {loc.hex()} points inside a header")
        reader = self._acquire(seg)
        try:
            buf = _pread_all(reader.fd, HEADER.size + size, off - HEADER.size)
        finally:
            self._release(reader)
        if len(buf) != HEADER.size + size:
            raise CorruptValue(f"segment {seg} offset {off}: short read ({len(buf)} of {HEADER.size + size})")
        magic, _klen, dlen, crc = HEADER.unpack_from(buf)
        if magic != MAGIC or dlen != size:
            raise CorruptValue(f"segment {seg} offset {off}: bad record header")
        data = buf[HEADER.size :]
        if zlib.crc32(data) != crc:
            raise CorruptValue(f"segment {seg} offset {off}: checksum mismatch")
        return data

    def _acquire(self, seg: int) -> _Reader:
        with self._readers_lock:
            reader = self._readers.get(seg)
            if reader is None:
                try:
                    fd = os.open(self._path(seg), os.O_RDONLY)
                except FileNotFoundError:
                    raise NotFound(f"segment {seg} does not exist") from None
                reader = self._readers[seg] = _Reader(fd)
            else:
                self._readers.move_to_end(seg)
            reader.refs += 1  # before evicting, so the new entry is never chosen
            self._evict_readers()
            return reader

    def _release(self, reader: _Reader) -> None:
        with self._readers_lock:
            reader.refs -= 1
            if reader.retired and reader.refs == 0:
                os.close(reader.fd)

    def _retire_reader(self, seg: int) -> None:
        with self._readers_lock:
            reader = self._readers.pop(seg, None)
            if reader is not None:
                reader.retired = True
                if reader.refs == 0:
                    os.close(reader.fd)

    def _evict_readers(self) -> None:
        """Keep at most max_open_readers cached fds (caller holds _readers_lock)."""
        excess = len(self._readers) - self._max_readers
        for seg in [s for s, r in self._readers.items() if r.refs == 0][: max(0, excess)]:
            os.close(self._readers.pop(seg).fd)

    # -- maintenance ---------------------------------------------------------

    def sync(self) -> None:
        with self._sync_lock:
            with self._lock:
                if self._closed:
                    return
                dirty, self._dirty = self._dirty, set()
                dir_dirty, self._dir_dirty = self._dir_dirty, False
                fds = [self._fd if seg == self._cur else self._retired.get(seg) for seg in dirty]
            try:
                for fd in fds:
                    if fd is not None:
                        os.fsync(fd)
                if dir_dirty:
                    dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)
            except BaseException:
                with self._lock:  # not durable: try again next time
                    self._dirty |= dirty
                    self._dir_dirty |= dir_dirty
                raise
            with self._lock:
                for seg in [s for s in self._retired if s not in self._dirty]:
                    os.close(self._retired.pop(seg))

    def collect(self) -> int:
        """Unlink every non-current segment with no live record; return bytes freed.

        Runs its own write transaction (never call it inside one): holding the
        writer lock means no uncommitted put can be pointing into a segment we
        judge dead. Unlinking is idempotent, so a rerun or a crash before the
        commit only leaves records that the next collect() removes.
        """
        freed = 0

        def fn(txn: lmdb.Transaction) -> list[int]:
            nonlocal freed
            with self._lock:
                current = self._cur
            dead = set(self._orphans)
            for key, value in txn.cursor(db=self._segdb):
                seg = _SEG_KEY.unpack(key)[0]
                if seg != current and _SEG_VAL.unpack(value)[2] == 0:
                    dead.add(seg)
            dead.discard(current)
            for seg in sorted(dead):
                freed += self._unlink(seg)
                txn.delete(_SEG_KEY.pack(seg), db=self._segdb)
            return sorted(dead)

        removed = self.env.write(fn)
        self._orphans.difference_update(removed)
        return freed

    def _unlink(self, seg: int) -> int:
        path = self._path(seg)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            size = 0
        # Close fds only after the unlink: a get racing with us either opened
        # the file before (its cached fd is retired here) or gets NotFound.
        self._retire_reader(seg)
        with self._sync_lock, self._lock:
            fd = self._retired.pop(seg, None)
            self._dirty.discard(seg)
            if fd is not None:
                os.close(fd)
        return size

    def usage(self) -> TierUsage:
        used = 0
        for seg in self._segment_files():
            try:
                used += self._path(seg).stat().st_size
            except FileNotFoundError:
                pass

        def live(txn: lmdb.Transaction) -> int:
            return sum(_SEG_VAL.unpack(v)[0] for v in txn.cursor(db=self._segdb).iternext(keys=False))

        return TierUsage(used_bytes=used, live_bytes=self.env.read(live), capacity_bytes=capacity_of(self.directory, used))

    def locations(self) -> Iterator[tuple[bytes, int]]:
        """Walk every segment file by its headers. This lists records physically
        present, including dead ones (aborted or deleted puts): verify/gc compare
        it against the metadata. A walk stops at the first torn or foreign header."""
        for seg in self._segment_files():
            try:
                fd = os.open(self._path(seg), os.O_RDONLY)
            except FileNotFoundError:
                continue  # collected meanwhile
            try:
                end_of_file = os.fstat(fd).st_size
                pos = 0
                while pos + HEADER.size <= end_of_file:
                    raw = os.pread(fd, HEADER.size, pos)
                    if len(raw) < HEADER.size:
                        break
                    magic, klen, dlen, _crc = HEADER.unpack(raw)
                    end = pos + HEADER.size + dlen + klen
                    if magic != MAGIC or end > end_of_file:
                        break
                    yield LOCATION.pack(seg, pos + HEADER.size, dlen), dlen
                    pos = end
            finally:
                os.close(fd)

    def close(self) -> None:
        """Close every fd. Does not fsync (call sync() first) nor close the LmdbEnv."""
        with self._sync_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            fds = list(self._retired.values()) + ([self._fd] if self._fd is not None else [])
            self._retired.clear()
            self._fd = None
            for fd in fds:
                os.close(fd)
        with self._readers_lock:
            for reader in self._readers.values():
                reader.retired = True
                if reader.refs == 0:
                    os.close(reader.fd)
            self._readers.clear()

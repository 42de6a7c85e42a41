"""The NVMe value tier: values appended to segment files ``seg-00000001.dat`` …

Owns the segment directories (one or several, each with an optional capacity) and the
``segments`` database of the shared LmdbEnv (per-segment live/total accounting, written
in the caller's transaction).

On-disk record::

    header  = magic b"DSEG" | vkey length u16 | data length u64 | crc32(data) u32   (little-endian, 18 bytes)
    record  = header + data + vkey

The header sits directly before the data so that ``get`` reads header and data
with one ``pread`` at ``offset - 18`` and checks magic, length and crc. The
vkey trails the data; it names what a record holds, for a scan (``locations``,
``records``: compaction and repair tools). A location is ``(segment id u32, offset
of the data u64, length u64)``; segment ids are unique across all directories, so a
location does not name its directory.

Streams: every put names a stream (a replay buffer's namespace id, or 0 for everything
else), and each stream appends to a segment of its own. A ring's values then lie in
its segments in FIFO order, so evicting its oldest entries empties its oldest segments
whole; holes left by deletes and rewrites are what compaction (in the core) removes.

Directories: a new segment goes to the directory with the most room (its capacity,
or the free space of its file system, less what it holds), so segments stripe across
directories in proportion to their room. A directory can be added to a store at any
time; the store's own list only grows (see `Store`).

Accounting: the ``segments`` db maps segment id -> (live bytes, total bytes,
live records, stream), updated in the caller's transaction. ``collect()`` unlinks a
segment no stream appends to once its live *records* reach 0 (counting records, not
bytes, keeps a segment holding only empty values alive). ``delete`` cannot
tell whether a location was already deleted: callers delete each location
exactly once (the store's reference counts guarantee it). Segment files that
have no record at open time hold only uncommitted puts; ``collect()`` removes
them too.

Crash model: bytes are written with ``pwrite`` and made durable only by
``sync()``; the caller must sync this tier before it makes durable any
metadata that references the new locations. Bytes of a put whose transaction
aborted (or never committed) are dead space. Each process start appends to
fresh segments, so a torn tail from a crash is always at the end of a file and
a scan stops there cleanly.

Direct writes: a put marked `direct` (bytes read back rarely, a checkpoint's) of at least
``DIRECT_MIN`` bytes is written with O_DIRECT, past the page cache: it fills no cache, is on
the device when put returns (its write cache aside: ``sync()`` still flushes), and costs the
writer no page allocation (on a VM whose fresh memory is slow to touch, buffered writes of
new bytes ran at 0.35 GB/s, direct ones at 2 GB/s). Such a record starts on a
``DIRECT_ALIGN`` boundary and its end is padded to the next one; each gap is filled with a
pad record (an empty name and zero data: nothing refers to it, so it is dead space a scan
walks over like an aborted put's). A record of that size that starts on the boundary is
read back the same way, through one of a few aligned buffers (a buffered record that lies
so by chance is read right too). A file system that refuses O_DIRECT (tmpfs before 6.6)
gets buffered writes, logged once, and buffered reads.

Spools: a client beside the mount may append records itself, to a segment of its own
(``open_spool``), in the record format above (``record_header``). Its records become values
only when the daemon adopts them (``adopt``, in the caller's transaction: the header is
checked and the record accounted as if ``put`` had written it); a record never adopted is
dead space like an aborted put's. The tier keeps an fd of every spool, so ``sync()`` makes
the client's bytes durable before the metadata that points at them. The bytes themselves
are the client's word: a record it damages or rewrites after adoption fails its CRC when
read (Damaged), never passes for another value.

Thread rules: ``put``/``delete``/``adopt`` run inside ``LmdbEnv.write()``; ``get`` may
run from any number of threads at once; ``collect()`` and ``sync()`` run
outside transactions (``collect`` opens its own write transaction).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from .base import TierUsage, Txn, ValueBackend
from .crc import crc32
from .errors import BadRequest, Damaged, Full, Missing
from .lmdbenv import LmdbEnv

DB_SEGMENTS = b"segments"
MAGIC = b"DSEG"
HEADER = struct.Struct("<4sHQI")  # magic, vkey length, data length, crc32 of data
LOCATION = struct.Struct("<IQQ")  # segment id, offset of the data, data length
_SEG_KEY = struct.Struct(">I")  # big-endian so the db iterates in segment order
_SEG_VAL = struct.Struct("<QQQI")  # live bytes, total bytes, live records, stream
_NAME = re.compile(r"^seg-(\d+)\.dat$")
_MAX_VKEY = 0xFFFF
DIRECT_ALIGN = 4096  # the file offset, length and memory alignment O_DIRECT asks of a write
DIRECT_MIN = 1 << 20  # smaller values go through the page cache: a copy costs them little
_STAGE_BYTES = 8 << 20  # the aligned buffer direct writes go through
_READ_STAGES = 4  # aligned buffers direct reads go through (more readers at once read buffered)
_READ_STAGE_MAX = 64 << 20  # a bigger record is read buffered

log = logging.getLogger(__name__)


def _segment_name(seg: int) -> str:
    return f"seg-{seg:08d}.dat"


def _device(path: Path) -> int:
    try:
        return os.stat(path).st_dev
    except OSError:
        return -1


def unpack_row(raw: bytes) -> tuple[int, int, int, int]:
    """(live bytes, total bytes, live records, stream) of an accounting row."""
    return _SEG_VAL.unpack(raw)


@dataclass(frozen=True)
class SegmentDir:
    """One directory of the tier; `capacity_bytes` 0 means the room its file system has."""

    path: Path
    capacity_bytes: int = 0


@dataclass(frozen=True)
class SegmentInfo:
    """A segment as the accounting sees it (for compaction and stats)."""

    seg: int
    live_bytes: int
    total_bytes: int
    live_records: int
    stream: int


class _Stream:
    """The segment one stream appends to (`dfd`: its O_DIRECT fd, -1 until a direct put)."""

    __slots__ = ("seg", "fd", "offset", "dfd")

    def __init__(self, seg: int, fd: int, offset: int) -> None:
        self.seg = seg
        self.fd = fd
        self.offset = offset
        self.dfd = -1

    def close_direct(self) -> None:
        # Nothing waits in the page cache for this fd: an fsync of `fd` covers its bytes.
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1


def record_header(vkey: bytes, data: bytes | memoryview, crc: int | None = None) -> bytes:
    """The header of a record holding `data` named `vkey` (`crc`: the CRC-32 of `data`,
    when known already). The daemon's puts and a client's spool both write records so."""
    view = memoryview(data).cast("B")
    return HEADER.pack(MAGIC, len(vkey), view.nbytes, crc32(view) if crc is None else crc)


def write_record(fd: int, offset: int, vkey: bytes, data: bytes | memoryview, crc: int | None = None) -> int:
    """Write the record of `data` named `vkey` at `offset` of `fd` (`crc` as for
    `record_header`); its length. OSError as the write gave it (the caller decides what a
    torn record means for its file)."""
    header = record_header(vkey, data, crc)
    _pwrite_all(fd, (header, data, vkey), offset)
    return len(header) + memoryview(data).nbytes + len(vkey)


class _Spool:
    """A segment a client appends to: the daemon's fd of it (for fsync), the stream it
    belongs to, and the end of the furthest record adopted."""

    __slots__ = ("fd", "stream", "end")

    def __init__(self, fd: int, stream: int) -> None:
        self.fd = fd
        self.stream = stream
        self.end = 0


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


def _pad_length(offset: int) -> int:
    """The length of the pad record from `offset` to an aligned one (0: aligned already; a
    gap too short for a header takes the next boundary)."""
    gap = -offset % DIRECT_ALIGN
    return gap + DIRECT_ALIGN if 0 < gap < HEADER.size else gap


def _pad(length: int) -> tuple[bytes, bytes]:
    """A pad record `length` bytes long: its header and its zero data (it has no name)."""
    zeros = bytes(length - HEADER.size)
    return record_header(b"", zeros), zeros


def _write_pad(fd: int, offset: int) -> int:
    """Fill from `offset` to the next aligned offset with a pad record; its length."""
    length = _pad_length(offset)
    _pwrite_all(fd, _pad(length), offset)
    return length


def _stage_write(fd: int, stage: memoryview, parts: Sequence[bytes | memoryview], offset: int) -> None:
    """Write `parts` (their total a multiple of DIRECT_ALIGN) at the aligned `offset` of the
    O_DIRECT `fd`, copied through the page-aligned `stage` a buffer at a time."""
    fill = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            n = min(view.nbytes, stage.nbytes - fill)
            stage[fill:fill + n] = view[:n]
            fill += n
            view = view[n:]
            if fill == stage.nbytes:
                _pwrite_all(fd, (stage,), offset)
                offset += fill
                fill = 0
    if fill:
        _pwrite_all(fd, (stage[:fill],), offset)


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


def read_record(fd: int, seg: int, off: int, size: int) -> tuple[bytes, int]:
    """(data, CRC-32) of the record whose data is `size` bytes at `off` of segment `seg`,
    open as `fd`: header and data checked (Damaged otherwise). Any process that may read the
    file can call it (the daemon's tier, and the client beside the mount)."""
    if off < HEADER.size:
        raise Damaged(f"segment {seg} location {off} points inside a header")
    # Header and data in two reads: slicing one buffer would copy the whole value.
    head = os.pread(fd, HEADER.size, off - HEADER.size)
    data = _pread_all(fd, size, off)
    if len(head) != HEADER.size or len(data) != size:
        raise Damaged(f"segment {seg} offset {off}: short read ({len(head) + len(data)} of "
                      f"{HEADER.size + size})")
    return data, _checked(seg, off, size, head, data)


def _checked(seg: int, off: int, size: int, head: bytes | memoryview, data: bytes | memoryview) -> int:
    """The CRC-32 of a record read whole (`head`: its header, `data`: its `size` bytes at
    `off`) once both are checked; Damaged otherwise."""
    magic, _klen, dlen, crc = HEADER.unpack(head)
    if magic != MAGIC or dlen != size:
        raise Damaged(f"segment {seg} offset {off}: bad record header")
    if crc32(data) != crc:
        raise Damaged(f"segment {seg} offset {off}: checksum mismatch")
    return crc


def read_direct(fd: int, seg: int, off: int, size: int, stage: mmap.mmap,
                out: Any = None) -> tuple[bytes | memoryview, int]:
    """`read_record` of a record written direct (it starts on a DIRECT_ALIGN boundary),
    through the O_DIRECT `fd` into the page-aligned `stage` (as large as the padded record):
    no page cache filled on the way, as none was on the way in. `out`: a writable buffer
    the data is copied into (a view of it is returned), not new bytes."""
    start = off - HEADER.size
    span = -(-(HEADER.size + size) // DIRECT_ALIGN) * DIRECT_ALIGN
    view = memoryview(stage)
    try:
        got = os.preadv(fd, [view[:span]], start)
        if got < HEADER.size + size:
            raise Damaged(f"segment {seg} offset {off}: short read ({got} of {HEADER.size + size})")
        head = bytes(view[:HEADER.size])
        if out is None:
            data: bytes | memoryview = bytes(view[HEADER.size:HEADER.size + size])
        else:
            data = memoryview(out)[:size]
            data[:] = view[HEADER.size:HEADER.size + size]
    finally:
        view.release()
    return data, _checked(seg, off, size, head, data)


class _Reader:
    """A cached read fd, reference-counted so that collect() never closes an fd
    another thread is about to pread (the number could be reused); `dfd`: its O_DIRECT
    twin, for records written direct (-1 until one is read)."""

    __slots__ = ("fd", "refs", "retired", "dfd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 0
        self.retired = False
        self.dfd = -1

    def close(self) -> None:
        os.close(self.fd)
        if self.dfd >= 0:
            os.close(self.dfd)


class SegmentValues(ValueBackend):
    name = "nvme"

    def __init__(
        self,
        env: LmdbEnv,
        directories: "str | os.PathLike[str] | Sequence[SegmentDir]",
        segment_bytes: int = 256 << 20,
        max_open_readers: int = 256,
        create: bool = True,
    ) -> None:
        """`create`: make directories that do not exist (a checker opening a store passes
        False, so that it never stands in an empty directory for a drive not mounted)."""
        if segment_bytes <= 0:
            raise BadRequest("segment_bytes must be positive")
        if isinstance(directories, (str, os.PathLike)):
            directories = [SegmentDir(Path(directories))]
        if not directories:
            raise BadRequest("the NVMe tier needs at least one directory")
        self.env = env
        self.dirs = [SegmentDir(Path(d.path), d.capacity_bytes) for d in directories]
        if create:
            for d in self.dirs:
                d.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = self.dirs[0].path
        self.segment_bytes = segment_bytes
        env.db(DB_SEGMENTS)
        self._max_readers = max_open_readers

        # Lock order: env write lock -> _sync_lock -> _lock; _readers_lock is a leaf.
        self._lock = threading.Lock()  # append state, dirty set, retired fds, directory use
        self._sync_lock = threading.Lock()  # only holders of it close write fds
        self._readers_lock = threading.Lock()
        self._readers: OrderedDict[int, _Reader] = OrderedDict()

        rows = env.read(lambda txn: {_SEG_KEY.unpack(bytes(k))[0]: _SEG_VAL.unpack(bytes(v))
                                     for k, v in txn.cursor(DB_SEGMENTS)})
        self._dir_of: dict[int, int] = {}  # segment -> index in self.dirs
        self._dir_used = [0] * len(self.dirs)  # bytes of segment files in each directory
        for i, d in enumerate(self.dirs):
            for seg, size in self._scan_dir(d.path):
                if seg in self._dir_of:
                    raise BadRequest(f"segment {seg} is in both {self.dirs[self._dir_of[seg]].path} "
                                          f"and {d.path}")
                self._dir_of[seg] = i
                self._dir_used[i] += size
        # Segments that hold values but whose file is in no directory: lost (a disk cache lost
        # in a power failure), or in a directory left out. Their values' reads fail with EIO.
        self.missing = sorted(seg for seg, row in rows.items() if row[2] > 0 and seg not in self._dir_of)
        if self.missing:
            log.warning("%d segments holding values (e.g. %s) are in none of the NVMe directories %s: their "
                        "values cannot be read (a lost file, or a directory left out?)", len(self.missing),
                        _segment_name(self.missing[0]), ", ".join(str(d.path) for d in self.dirs))
        # Always start fresh segments: a torn tail from a crash stays at the end of an old
        # file. A stream's file is created on its first put.
        self._next_seg = max(set(self._dir_of) | set(rows), default=0) + 1
        self._streams: dict[int, _Stream] = {}
        self._spools: dict[int, _Spool] = {}  # segment -> a client's spool (see the module docstring)
        self._dirty: set[int] = set()  # segments written since the last sync
        self._retired: dict[int, int] = {}  # rolled-over write fds, closed after their fsync
        self._dirs_dirty: set[int] = set()  # directories with new files since the last sync
        # Files with no accounting record hold only uncommitted puts. If the db
        # has no records at all, refuse to judge (it may be the wrong env).
        self._orphans = set(self._dir_of) - set(rows) if rows else set()
        self._closed = False
        self._direct = True  # False once the file system refused O_DIRECT
        self._stage: mmap.mmap | None = None  # page-aligned; used under _lock
        self._read_stages: list[mmap.mmap] = []  # free ones (under _readers_lock)
        self._read_staged = 0  # how many exist

    # -- paths ---------------------------------------------------------------

    @staticmethod
    def _scan_dir(directory: Path) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        if not directory.is_dir():
            return out
        for entry in os.scandir(directory):
            m = _NAME.match(entry.name)
            if m:
                try:
                    out.append((int(m.group(1)), entry.stat().st_size))
                except FileNotFoundError:
                    pass
        return out

    def _path(self, seg: int) -> Path:
        i = self._dir_of.get(seg)
        return (self.dirs[i].path if i is not None else self.directory) / _segment_name(seg)

    def path_of(self, seg: int) -> Path | None:
        """The file of segment `seg`, or None if there is none."""
        return self._path(seg) if seg in self._dir_of else None

    def segment_files(self) -> dict[int, Path]:
        """Every segment file, in every directory (a fresh scan)."""
        return {seg: d.path / _segment_name(seg) for d in self.dirs for seg, _ in self._scan_dir(d.path)}

    def _room(self, i: int) -> int:
        """Bytes directory i may still take (caller holds _lock): up to its capacity, or, with
        none set, all but 1% of its file system (left for the metadata, which may share it)."""
        d = self.dirs[i]
        try:
            st = os.statvfs(d.path)
        except OSError:
            return 0
        free = st.f_bavail * st.f_frsize
        if d.capacity_bytes:
            free = min(free, d.capacity_bytes - self._dir_used[i])
        else:
            free -= st.f_blocks * st.f_frsize // 100
        return max(0, free)

    # -- writes --------------------------------------------------------------

    def put(self, txn: Txn, vkey: bytes, data: bytes | memoryview, stream: int = 0,
            direct: bool = False) -> bytes:
        if len(vkey) > _MAX_VKEY:
            raise BadRequest(f"vkey longer than {_MAX_VKEY} bytes")
        view = memoryview(data).cast("B")
        size = view.nbytes
        direct = direct and size >= DIRECT_MIN and self._direct
        record = HEADER.size + size + len(vkey)
        room = record + (2 * (DIRECT_ALIGN + HEADER.size) if direct else 0)  # the pads around it
        with self._lock:
            if self._closed:
                raise RuntimeError("SegmentValues is closed")
            st = self._streams.get(stream)
            if st is None or (st.offset > 0 and st.offset + room > self.segment_bytes) \
                    or self._room(self._dir_of[st.seg]) < room:
                st = self._roll(stream, room)
            seg, start = st.seg, st.offset
            try:
                if direct:
                    start, end = self._write_direct(st, vkey, view)
                else:
                    end = start + write_record(st.fd, start, vkey, view)
            except OSError as exc:
                # Drop the torn record so the file stays walkable; the offset
                # is not advanced, so the next put overwrites whatever remains.
                try:
                    os.ftruncate(st.fd, st.offset)
                except OSError:
                    pass
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise Full(f"{self._path(seg).parent}: no space for a {size}-byte value") from exc
                raise
            self._dir_used[self._dir_of[seg]] += end - st.offset
            st.offset = end
            self._dirty.add(seg)
        # Accounting goes into the caller's txn: it commits or aborts together
        # with the reference to the location.
        self._account(txn, seg, size, 1, grow_total=True, stream=stream)
        return LOCATION.pack(seg, start + HEADER.size, size)

    def _write_direct(self, st: _Stream, vkey: bytes, view: memoryview) -> tuple[int, int]:
        """Write the record of `view` past the page cache at the stream's next aligned offset,
        with pad records before and after it (caller holds _lock): (its start, its padded
        end). Buffered instead if the file system refuses O_DIRECT."""
        off = st.offset
        if off % DIRECT_ALIGN:
            off += _write_pad(st.fd, off)
        if st.dfd < 0:
            try:
                st.dfd = os.open(self._path(st.seg), os.O_WRONLY | os.O_DIRECT)
            except OSError as exc:
                return off, off + self._refuse_direct(st, off, vkey, view, exc)
        end = off + HEADER.size + view.nbytes + len(vkey)
        tail = _pad_length(end)
        parts: list[bytes | memoryview] = [record_header(vkey, view), view, vkey]
        if tail:
            parts += _pad(tail)
        if self._stage is None:
            self._stage = mmap.mmap(-1, _STAGE_BYTES)
        try:
            _stage_write(st.dfd, memoryview(self._stage), parts, off)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return off, off + self._refuse_direct(st, off, vkey, view, exc)
        return off, end + tail

    def _refuse_direct(self, st: _Stream, off: int, vkey: bytes, view: memoryview, exc: OSError) -> int:
        """The file system refused O_DIRECT: this record and every later one go buffered."""
        log.warning("%s: direct writes refused (%s); values are written through the page cache",
                    self._path(st.seg).parent, exc)
        self._direct = False
        st.close_direct()
        return write_record(st.fd, off, vkey, view)

    def _roll(self, stream: int, record: int) -> _Stream:
        """Start the stream's next segment in the directory with the most room (caller holds
        _lock). The old fd is not closed here: a concurrent sync() may be fsyncing it; sync
        closes it afterwards."""
        rooms = [(self._room(i), i) for i in range(len(self.dirs))]
        room, i = max(rooms)
        if room < record:
            raise Full(f"NVMe tier full: no directory has room for a {record}-byte record "
                          f"({', '.join(f'{self.dirs[j].path}: {r} bytes' for r, j in rooms)})")
        old = self._streams.pop(stream, None)
        if old is not None:
            old.close_direct()
            self._retired[old.seg] = old.fd
        seg = self._next_seg
        self._next_seg += 1
        fd = os.open(self.dirs[i].path / _segment_name(seg), os.O_WRONLY | os.O_CREAT, 0o600)
        self._dir_of[seg] = i
        self._dirs_dirty.add(i)
        st = self._streams[stream] = _Stream(seg, fd, os.fstat(fd).st_size)
        return st

    # -- spools --------------------------------------------------------------

    def open_spool(self, stream: int, owner: tuple[int, int] | None = None) -> tuple[int, Path]:
        """A new segment of `stream` for a client to append records to, in the directory with
        the most room; `owner`: the (uid, gid) to give the file (a root daemon serving
        another user). (segment, path)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("SegmentValues is closed")
            room, i = max((self._room(j), j) for j in range(len(self.dirs)))
            if room <= HEADER.size:
                raise Full("NVMe tier full: no directory has room for a spool")
            seg = self._next_seg
            self._next_seg += 1
            path = self.dirs[i].path / _segment_name(seg)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if owner is not None:
                    os.fchown(fd, *owner)
            except OSError:
                os.close(fd)
                path.unlink()
                raise
            self._dir_of[seg] = i
            self._dirs_dirty.add(i)
            self._spools[seg] = _Spool(fd, stream)
        return seg, path

    def adopt(self, txn: Txn, seg: int, offset: int, size: int, vkey_len: int) -> bytes:
        """The record of `size` data bytes and a `vkey_len`-byte name that a client wrote at
        `offset` of its spool `seg`, made a value in the caller's transaction: its location.
        BadRequest when no such record is there (a spool not open, a header that does not
        say so); Full past the directory's capacity."""
        with self._lock:
            spool = self._spools.get(seg)
            if spool is None:
                raise BadRequest(f"segment {seg} is not an open spool")
            if offset < 0 or size < 0:
                raise BadRequest(f"spool {seg}: a record at {offset} of {size} bytes")
            record = HEADER.size + size + vkey_len
            end = offset + record
            head = os.pread(spool.fd, HEADER.size, offset)
            if len(head) != HEADER.size:
                raise BadRequest(f"spool {seg}: no record at {offset} (the file ends before it)")
            magic, klen, dlen, _crc = HEADER.unpack(head)
            if magic != MAGIC or klen != vkey_len or dlen != size:
                raise BadRequest(f"spool {seg}: the record at {offset} is not one of {size} bytes")
            if os.fstat(spool.fd).st_size < end:
                raise BadRequest(f"spool {seg}: the record at {offset} is cut short")
            if end > spool.end and self._room(self._dir_of[seg]) < end - spool.end:
                raise Full(f"{self._path(seg).parent}: no space for a {size}-byte value")
            if end > spool.end:
                self._dir_used[self._dir_of[seg]] += end - spool.end
                spool.end = end
            self._dirty.add(seg)
            stream = spool.stream
        self._account(txn, seg, size, 1, grow_total=True, stream=stream)
        return LOCATION.pack(seg, offset + HEADER.size, size)

    def close_spool(self, seg: int) -> None:
        """Its client is gone: no more records come; the segment ages as any other (its fd
        is closed after the sync that makes it durable)."""
        with self._lock:
            spool = self._spools.pop(seg, None)
            if spool is not None and not self._closed:
                self._retired[seg] = spool.fd

    def delete(self, txn: Txn, loc: bytes) -> None:
        try:
            seg, _off, size = LOCATION.unpack(loc)
        except struct.error:
            return
        self._account(txn, seg, -size, -1, grow_total=False)

    def _account(self, txn: Txn, seg: int, dbytes: int, drecords: int, grow_total: bool,
                 stream: int = 0) -> None:
        key = _SEG_KEY.pack(seg)
        raw = txn.get(key, db=DB_SEGMENTS)
        if raw is None:
            if not grow_total:
                return  # delete of an unknown (already collected) segment: no-op
            live = total = records = 0
        else:
            live, total, records, stream = _SEG_VAL.unpack(raw)
        total += dbytes if grow_total else 0
        txn.put(key, _SEG_VAL.pack(max(0, live + dbytes), total, max(0, records + drecords), stream),
                db=DB_SEGMENTS)

    # -- reads ---------------------------------------------------------------

    def get(self, loc: bytes) -> bytes:
        return self.get_checked(loc)[0]

    def get_checked(self, loc: bytes) -> tuple[bytes, int | None]:
        got = self._get(loc, None)
        assert isinstance(got[0], bytes)
        return got[0], got[1]

    def get_into(self, loc: bytes, out: Any) -> tuple[memoryview, int] | None:
        """A record written direct, copied from the stage into `out`: no new memory for a
        large value read again and again (a checkpoint's chunks into the pool's buffers)."""
        try:
            _seg, _off, size = LOCATION.unpack(loc)
        except struct.error:
            raise Damaged(f"malformed segment location {loc.hex()}") from None
        if size > len(out):
            return None
        data, crc = self._get(loc, out)
        if isinstance(data, bytes):  # read buffered
            view = memoryview(out)[:size]
            view[:] = data
            return view, crc
        return data, crc

    def _get(self, loc: bytes, out: Any) -> tuple[bytes | memoryview, int]:
        try:
            seg, off, size = LOCATION.unpack(loc)
        except struct.error:
            raise Damaged(f"malformed segment location {loc.hex()}") from None
        if off < HEADER.size:
            raise Damaged(f"segment location {loc.hex()} points inside a header")
        reader = self._acquire(seg)
        try:
            if size >= DIRECT_MIN and self._direct and (off - HEADER.size) % DIRECT_ALIGN == 0:
                stage = self._take_stage(HEADER.size + size)
                if stage is not None:
                    try:
                        if reader.dfd < 0:
                            reader.dfd = os.open(self._path(seg), os.O_RDONLY | os.O_DIRECT)
                        return read_direct(reader.dfd, seg, off, size, stage, out)
                    except OSError:
                        pass  # refused (or failing): the buffered read below says what is wrong
                    finally:
                        self._give_stage(stage)
            return read_record(reader.fd, seg, off, size)
        finally:
            self._release(reader)

    def _take_stage(self, need: int) -> mmap.mmap | None:
        """An aligned buffer of at least `need` bytes for a direct read (None: read buffered)."""
        if need > _READ_STAGE_MAX:
            return None
        with self._readers_lock:
            for i, stage in enumerate(self._read_stages):
                if len(stage) >= need:
                    return self._read_stages.pop(i)
            if self._read_staged < _READ_STAGES:
                self._read_staged += 1
            elif self._read_stages:
                self._read_stages.pop(0).close()  # too small: replaced by one that fits
            else:
                return None
        return mmap.mmap(-1, -(-need // _STAGE_BYTES) * _STAGE_BYTES)

    def _give_stage(self, stage: mmap.mmap) -> None:
        with self._readers_lock:
            self._read_stages.append(stage)

    def _acquire(self, seg: int) -> _Reader:
        with self._readers_lock:
            reader = self._readers.get(seg)
            if reader is None:
                if seg not in self._dir_of:
                    raise Missing(f"segment {seg} does not exist")
                try:
                    fd = os.open(self._path(seg), os.O_RDONLY)
                except FileNotFoundError:
                    raise Missing(f"segment {seg} does not exist") from None
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
                reader.close()

    def _retire_reader(self, seg: int) -> None:
        with self._readers_lock:
            reader = self._readers.pop(seg, None)
            if reader is not None:
                reader.retired = True
                if reader.refs == 0:
                    reader.close()

    def _evict_readers(self) -> None:
        """Keep at most max_open_readers cached fds (caller holds _readers_lock)."""
        excess = len(self._readers) - self._max_readers
        for seg in [s for s, r in self._readers.items() if r.refs == 0][: max(0, excess)]:
            self._readers.pop(seg).close()

    def records(self, seg: int) -> list[tuple[bytes, bytes]]:
        """(vkey, location) of every record physically in segment `seg`, live or dead, in file
        order (blocking I/O). Stops at the first torn or foreign header."""
        path = self.path_of(seg)
        if path is None:
            return []
        out = []
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return []
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
                vkey = os.pread(fd, klen, pos + HEADER.size + dlen) if klen else b""
                out.append((vkey, LOCATION.pack(seg, pos + HEADER.size, dlen)))
                pos = end
        finally:
            os.close(fd)
        return out

    # -- maintenance ---------------------------------------------------------

    def sync(self) -> None:
        with self._sync_lock:
            with self._lock:
                if self._closed:
                    return
                dirty, self._dirty = self._dirty, set()
                dirs_dirty, self._dirs_dirty = self._dirs_dirty, set()
                current = {st.seg: st.fd for st in self._streams.values()}
                current.update((seg, sp.fd) for seg, sp in self._spools.items())
                fds = [current.get(seg, self._retired.get(seg)) for seg in dirty]
            try:
                for fd in fds:
                    if fd is not None:
                        os.fsync(fd)
                for i in dirs_dirty:
                    dfd = os.open(self.dirs[i].path, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)
            except BaseException:
                with self._lock:  # not durable: try again next time
                    self._dirty |= dirty
                    self._dirs_dirty |= dirs_dirty
                raise
            with self._lock:
                for seg in [s for s in self._retired if s not in self._dirty]:
                    os.close(self._retired.pop(seg))

    def end_stream(self, stream: int) -> None:
        """No more puts to `stream` (its ring was dropped): its segment stops being current,
        so the collector can unlink it once it holds nothing live."""
        with self._lock:
            st = self._streams.pop(stream, None)
            if st is not None:
                st.close_direct()
                self._retired[st.seg] = st.fd

    def segment_of(self, loc: bytes) -> int | None:
        """The segment a location of this tier is in (None: not one of ours)."""
        try:
            return LOCATION.unpack(loc)[0]
        except struct.error:
            return None

    def current_segments(self) -> set[int]:
        with self._lock:
            return {st.seg for st in self._streams.values()} | set(self._spools)

    def collect(self) -> int:
        """Unlink every segment no stream appends to that has no live record; return bytes freed.

        Runs its own write transaction (never call it inside one): holding the
        writer lock means no uncommitted put can be pointing into a segment we
        judge dead. Unlinking is idempotent, so a rerun or a crash before the
        commit only leaves records that the next collect() removes.
        """
        freed = 0

        def fn(txn: Txn) -> list[int]:
            nonlocal freed
            current = self.current_segments()
            dead = set(self._orphans)
            for key, value in txn.cursor(DB_SEGMENTS):
                seg = _SEG_KEY.unpack(key)[0]
                if _SEG_VAL.unpack(value)[2] == 0:
                    dead.add(seg)
            dead -= current
            for seg in sorted(dead):
                freed += self._unlink(seg)
                txn.delete(_SEG_KEY.pack(seg), db=DB_SEGMENTS)
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
            i = self._dir_of.pop(seg, None)
            if i is not None:
                self._dir_used[i] = max(0, self._dir_used[i] - size)
        return size

    def segments(self) -> list[SegmentInfo]:
        """Every accounted segment (one read transaction)."""
        def fn(txn: Txn) -> list[SegmentInfo]:
            return [SegmentInfo(_SEG_KEY.unpack(bytes(k))[0], *_SEG_VAL.unpack(bytes(v)))
                    for k, v in txn.cursor(DB_SEGMENTS)]
        return self.env.read(fn)

    def usage(self) -> TierUsage:
        with self._lock:
            used = sum(self._dir_used)
            rooms = [self._room(i) for i in range(len(self.dirs))]

        def live(txn: Txn) -> int:
            return sum(_SEG_VAL.unpack(v)[0] for v in txn.cursor(DB_SEGMENTS).iternext(keys=False))

        # Directories sharing an uncapped file system share its free space: count it once.
        seen: set[int] = set()
        room = 0
        for d, r in zip(self.dirs, rooms):
            if not d.capacity_bytes:
                dev = _device(d.path)
                if dev in seen:
                    continue
                seen.add(dev)
            room += r
        return TierUsage(used_bytes=used, live_bytes=self.env.read(live), capacity_bytes=used + room)

    def shared_devices(self) -> set[int]:
        """File systems (st_dev) of the directories with no capacity: their free space is
        the tier's room."""
        return {_device(d.path) for d in self.dirs if not d.capacity_bytes}

    def dir_usage(self) -> list[dict]:
        """Per directory: path, capacity (0: its file system), bytes held, room left, segments."""
        with self._lock:
            counts = [0] * len(self.dirs)
            for i in self._dir_of.values():
                counts[i] += 1
            return [{"path": str(d.path), "capacity_bytes": d.capacity_bytes, "used_bytes": self._dir_used[i],
                     "room_bytes": self._room(i), "segments": counts[i]} for i, d in enumerate(self.dirs)]

    def locations(self) -> Iterator[tuple[bytes, int]]:
        """Walk every segment file by its headers. This lists records physically
        present, including dead ones (aborted or deleted puts): verify/gc compare
        it against the metadata. A walk stops at the first torn or foreign header."""
        for seg in sorted(self.segment_files()):
            for _vkey, loc in self.records(seg):
                yield loc, LOCATION.unpack(loc)[2]

    def close(self) -> None:
        """Close every fd. Does not fsync (call sync() first) nor close the LmdbEnv."""
        with self._sync_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            for st in self._streams.values():
                st.close_direct()
            fds = (list(self._retired.values()) + [st.fd for st in self._streams.values()]
                   + [sp.fd for sp in self._spools.values()])
            self._retired.clear()
            self._streams.clear()
            self._spools.clear()
            for fd in fds:
                os.close(fd)
        with self._readers_lock:
            for reader in self._readers.values():
                reader.retired = True
                if reader.refs == 0:
                    reader.close()
            self._readers.clear()

"""Value tiers: the shared conformance suite for both backends, plus the
behaviour only one tier has (segment rolling/collection/corruption, LMDB map
growth limits, LmdbEnv locking rules)."""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
import time
from pathlib import Path

import lmdb
import pytest

from distorefs.backends import segments as segments_mod
from distorefs.backends.lmdbenv import LmdbEnv
from distorefs.backends.lmdbvalues import LmdbValues
from distorefs.backends.segments import HEADER, LOCATION, SegmentValues
from distorefs.backends.errors import Damaged, Full, Missing, ReadOnly, Unreadable

try:
    from .backend_conformance import BackendConformance
except ImportError:  # tests/unit is not a package: pytest put it on sys.path
    from backend_conformance import BackendConformance

SEGMENT_BYTES = 1 << 20


def _open_env(tmp_path: Path, map_size: int | None) -> LmdbEnv:
    return LmdbEnv(tmp_path / "meta", **({"map_size": map_size} if map_size else {}))


# ---------------------------------------------------------------------------
# LMDB tier
# ---------------------------------------------------------------------------


class TestLmdbValues(BackendConformance):
    def make_backend(self, tmp_path, map_size=None):
        return LmdbValues(_open_env(tmp_path, map_size))

    def raw_read(self, backend, loc):
        # Raw lmdb on the environment, bypassing LmdbValues.
        raw_env = backend.env._env
        db = raw_env.open_db(b"values", create=False)
        with raw_env.begin(db=db) as txn:
            return txn.get(loc)

    def missing_location(self):
        return b"no-such-vkey"

    def test_aborted_put_is_not_readable(self, backend):
        def fn(txn):
            backend.put(txn, b"doomed", b"d" * 100)
            raise RuntimeError("abort")

        with pytest.raises(RuntimeError):
            backend.env.write(fn)
        with pytest.raises(Missing):
            backend.get(b"doomed")
        assert self.raw_read(backend, b"doomed") is None

    def test_location_is_vkey_and_replace_counts_once(self, backend):
        assert self.put(backend, b"same", b"x" * 100) == b"same"
        assert self.put(backend, b"same", b"y" * 40) == b"same"
        assert backend.get(b"same") == b"y" * 40
        assert backend.usage().live_bytes == 40
        self.delete(backend, b"same")
        self.delete(backend, b"same")
        assert backend.usage().live_bytes == 0

    def test_map_full_growth_with_one_big_txn(self, opener):
        backend = opener(map_size=64 << 10)
        data = os.urandom(6 << 20)
        loc = self.put(backend, b"big", data)
        assert backend.get(loc) == data
        used, map_size = backend.env.usage()
        assert map_size >= used >= len(data)

    def test_no_space_when_map_cannot_grow(self, opener, monkeypatch):
        backend = opener(map_size=64 << 10)
        real = os.statvfs

        def full_disk(path):
            st = real(path)
            return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, st.f_files, st.f_ffree, st.f_favail, st.f_flag, st.f_namemax))

        monkeypatch.setattr(os, "statvfs", full_disk)
        with pytest.raises(Full):
            self.put(backend, b"big", os.urandom(1 << 20))
        monkeypatch.undo()
        assert backend.usage().live_bytes == 0
        assert self.put(backend, b"small", b"s") == b"small"


class TestLmdbEnv:
    def test_a_read_only_open_reads_and_never_writes(self, tmp_path):
        with pytest.raises(Unreadable):
            LmdbEnv(tmp_path / "none", readonly=True)  # nothing there: refused, nothing made
        assert not (tmp_path / "none").exists()
        env = LmdbEnv(tmp_path / "e")
        db = env.db(b"x")
        env.write(lambda txn: txn.put(b"k", b"v", db=db))
        env.sync()
        env.close()
        before = (tmp_path / "e" / "data.mdb").read_bytes()
        ro = LmdbEnv(tmp_path / "e", readonly=True)
        try:
            assert ro.db(b"x") == b"x"
            assert ro.read(lambda txn: bytes(txn.get(b"k", db=b"x"))) == b"v"
            with pytest.raises(ReadOnly):
                ro.write(lambda txn: txn.put(b"k", b"w", db=b"x"))
            with pytest.raises(Unreadable):
                ro.db(b"never-made")
            ro.sync()
        finally:
            ro.close()
        assert (tmp_path / "e" / "data.mdb").read_bytes() == before

    def test_nested_write_is_refused(self, tmp_path):
        env = LmdbEnv(tmp_path / "e")
        try:
            with pytest.raises(RuntimeError):
                env.write(lambda txn: env.write(lambda t: None))
            with pytest.raises(RuntimeError):
                env.read(lambda txn: env.write(lambda t: None))
            # a read nested in a write is fine
            db = env.db(b"x")
            env.write(lambda txn: txn.put(b"k", b"v", db=db))
            assert env.write(lambda txn: env.read(lambda r: bytes(r.get(b"k", db=db)))) == b"v"
        finally:
            env.close()

    def test_write_returns_result_and_reruns_on_map_full(self, tmp_path):
        env = LmdbEnv(tmp_path / "e", map_size=64 << 10)
        try:
            db = env.db(b"x")
            calls = []

            def fn(txn):
                calls.append(1)
                for i in range(64):
                    txn.put(b"%d" % i, b"v" * 8192, db=db)
                return "done"

            assert env.write(fn) == "done"
            assert len(calls) > 1
            assert env.read(lambda txn: sum(1 for _ in txn.cursor(db))) == 64
        finally:
            env.close()

    def test_reads_run_safely_during_map_growth(self, tmp_path):
        env = LmdbEnv(tmp_path / "e", map_size=64 << 10)
        db = env.db(b"x")
        env.write(lambda txn: txn.put(b"anchor", b"a" * 100, db=db))
        stop = threading.Event()
        errors: list[BaseException] = []

        def reader():
            try:
                while not stop.is_set():
                    assert env.read(lambda txn: bytes(txn.get(b"anchor", db=db))) == b"a" * 100
                    # Tight loops of GIL-releasing calls starve the writer's
                    # GIL re-acquisition (CPython convoy), not our lock: pace them.
                    time.sleep(0.0002)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            for i in range(40):
                env.write(lambda txn, i=i: txn.put(b"k%d" % i, os.urandom(100 << 10), db=db))
        finally:
            stop.set()
            for t in threads:
                t.join()
            _, map_size = env.usage()
            env.close()
        assert not errors, errors
        assert map_size >= 4 << 20

    def test_directory_mode_and_sync(self, tmp_path):
        env = LmdbEnv(tmp_path / "e")
        try:
            assert (tmp_path / "e").stat().st_mode & 0o777 == 0o700
            env.sync()
            used, map_size = env.usage()
            assert 0 < used <= map_size == 1 << 30
        finally:
            env.close()


# ---------------------------------------------------------------------------
# Segment (NVMe) tier
# ---------------------------------------------------------------------------


def _segment_path(directory: Path, seg: int) -> Path:
    return directory / f"seg-{seg:08d}.dat"


def _flip_byte(backend, loc: bytes, where) -> None:
    """Invert the byte at where(offset of the value's data) in its segment file, on disk (a
    direct read goes past the page cache)."""
    seg, off, _ = LOCATION.unpack(loc)
    with open(_segment_path(backend.directory, seg), "r+b") as f:
        f.seek(where(off))
        byte = f.read(1)
        f.seek(where(off))
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


class TestSegmentValues(BackendConformance):
    def make_backend(self, tmp_path, map_size=None, segment_bytes=SEGMENT_BYTES):
        return SegmentValues(_open_env(tmp_path, map_size), tmp_path / "nvme", segment_bytes=segment_bytes)

    def raw_read(self, backend, loc):
        # Read the file bytes at the location's offset, bypassing SegmentValues.
        seg, off, size = struct.unpack("<IQQ", loc)
        try:
            with open(_segment_path(backend.directory, seg), "rb") as f:
                f.seek(off)
                return f.read(size)
        except FileNotFoundError:
            return None

    def make_unreachable(self, backend, loc):
        # Roll past the deleted value's segment, then collect it.
        self.put(backend, b"filler", b"f" * backend.segment_bytes)
        assert backend.collect() > 0

    def missing_location(self):
        return LOCATION.pack(99999, HEADER.size, 10)

    def _segs(self, backend):
        return sorted(int(p.name[4:12]) for p in backend.directory.glob("seg-*.dat"))

    def test_rolls_and_collects_dead_segments(self, tmp_path):
        backend = self.make_backend(tmp_path, segment_bytes=64 << 10)
        try:
            locs = [self.put(backend, b"r%d" % i, os.urandom(20 << 10)) for i in range(10)]
            segs = self._segs(backend)
            assert len(segs) >= 3
            assert all(p.stat().st_size <= 64 << 10 for p in backend.directory.glob("seg-*.dat"))
            first = LOCATION.unpack(locs[0])[0]
            in_first = [l for l in locs if LOCATION.unpack(l)[0] == first]
            rest = [l for l in locs if LOCATION.unpack(l)[0] != first]
            backend.get(in_first[0])  # caches a read fd that collect must close

            self.delete(backend, in_first[0])
            assert backend.collect() == 0  # still one live record in it
            for loc in in_first[1:]:
                self.delete(backend, loc)
            size = _segment_path(backend.directory, first).stat().st_size
            assert backend.collect() == size
            assert not _segment_path(backend.directory, first).exists()
            with pytest.raises(Missing):
                backend.get(in_first[0])
            for loc in rest:
                assert len(backend.get(loc)) == 20 << 10
            # the current segment is never collected, even when dead
            for loc in rest:
                self.delete(backend, loc)
            backend.collect()
            assert len(self._segs(backend)) == 1
            assert backend.usage().live_bytes == 0
            backend.sync()
        finally:
            self.close(backend)

    def test_big_value_larger_than_segment(self, tmp_path):
        backend = self.make_backend(tmp_path, segment_bytes=4096)
        try:
            a = self.put(backend, b"a", b"a" * 100)
            big = self.put(backend, b"big", b"B" * 10000)
            assert LOCATION.unpack(big)[0] == LOCATION.unpack(a)[0] + 1
            assert backend.get(big) == b"B" * 10000
        finally:
            self.close(backend)

    @pytest.mark.parametrize(
        "where",
        [
            pytest.param(lambda off: off - HEADER.size, id="magic"),
            pytest.param(lambda off: off - HEADER.size + 6, id="length"),
            pytest.param(lambda off: off - 4, id="crc"),
            pytest.param(lambda off: off + 3, id="data"),
        ],
    )
    def test_corrupt_record_raises_corrupt_value(self, backend, where):
        loc = self.put(backend, b"c", b"payload" * 100)
        _flip_byte(backend, loc, where)
        with pytest.raises(Damaged):
            backend.get(loc)

    def test_truncated_file_raises_corrupt_value(self, backend):
        loc = self.put(backend, b"t", b"t" * 1000)
        seg, off, _ = LOCATION.unpack(loc)
        os.truncate(_segment_path(backend.directory, seg), off + 10)
        with pytest.raises(Damaged):
            backend.get(loc)

    def test_no_space_leaves_nothing_referenced(self, backend, monkeypatch):
        keep = self.put(backend, b"keep", b"k" * 100)
        seg = LOCATION.unpack(keep)[0]
        size_before = _segment_path(backend.directory, seg).stat().st_size
        live_before = backend.usage().live_bytes
        real = os.pwritev

        def enospc(fd, bufs, offset):
            real(fd, [bytes(memoryview(bufs[0])[:7])], offset)  # a torn partial write
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(segments_mod.os, "pwritev", enospc)
        with pytest.raises(Full):
            self.put(backend, b"nospace", b"n" * 5000)
        monkeypatch.undo()
        assert backend.usage().live_bytes == live_before
        assert _segment_path(backend.directory, seg).stat().st_size == size_before
        loc = self.put(backend, b"after", b"a" * 10)
        assert backend.get(loc) == b"a" * 10
        assert dict(backend.locations()).keys() == {keep, loc}

    def test_reopen_starts_fresh_segment_and_collects_orphans(self, tmp_path):
        backend = self.make_backend(tmp_path)
        kept = self.put(backend, b"kept", b"k" * 100)
        self.close(backend)
        # A segment holding only an uncommitted put, as after a crash.
        orphan = _segment_path(tmp_path / "nvme", 2)
        orphan.write_bytes(b"garbage")
        # A torn tail on the committed segment.
        with open(_segment_path(tmp_path / "nvme", 1), "ab") as f:
            f.write(b"DSEG\x00")

        backend = self.make_backend(tmp_path)
        try:
            loc = self.put(backend, b"new", b"n" * 10)
            assert LOCATION.unpack(loc)[0] == 3
            assert backend.get(kept) == b"k" * 100
            assert set(dict(backend.locations())) == {kept, loc}
            assert backend.collect() == len(b"garbage")
            assert not orphan.exists()
            assert backend.get(kept) == b"k" * 100
        finally:
            self.close(backend)

    def test_rerun_after_map_full_counts_once(self, backend):
        calls = []

        def fn(txn):
            loc = backend.put(txn, b"rerun", b"r" * 1000)
            calls.append(loc)
            if len(calls) == 1:
                raise lmdb.MapFullError("forced for the test")
            return loc

        loc = backend.env.write(fn)
        assert len(calls) == 2 and calls[0] != loc
        assert backend.get(loc) == b"r" * 1000
        assert backend.usage().live_bytes == 1000

    def test_concurrent_gets_while_collecting(self, tmp_path):
        backend = self.make_backend(tmp_path, segment_bytes=32 << 10)
        try:
            live = [self.put(backend, b"live%d" % i, bytes([i]) * 8000) for i in range(8)]
            errors: list[BaseException] = []
            stop = threading.Event()

            def reader():
                try:
                    while not stop.is_set():
                        for i, loc in enumerate(live):
                            assert backend.get(loc) == bytes([i]) * 8000
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=reader) for _ in range(4)]
            for t in threads:
                t.start()
            try:
                for round_ in range(30):
                    dead = [self.put(backend, b"d%d" % j, os.urandom(8000)) for j in range(8)]
                    backend.env.write(lambda txn: [backend.delete(txn, l) for l in dead])
                    backend.collect()
                    backend.sync()
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert not errors, errors
            assert backend.usage().live_bytes == 8 * 8000
        finally:
            self.close(backend)

    def test_reader_fd_cache_is_bounded(self, tmp_path):
        backend = SegmentValues(_open_env(tmp_path, None), tmp_path / "nvme", segment_bytes=4096, max_open_readers=2)
        try:
            locs = [self.put(backend, b"f%d" % i, bytes([i]) * 3000) for i in range(8)]
            assert len({LOCATION.unpack(l)[0] for l in locs}) == 8
            for _ in range(3):
                for i, loc in enumerate(locs):
                    assert backend.get(loc) == bytes([i]) * 3000
            assert len(backend._readers) <= 2
        finally:
            self.close(backend)

    def test_directory_mode(self, backend):
        assert backend.directory.stat().st_mode & 0o777 == 0o700

    # -- direct writes (past the page cache) ---------------------------------

    @staticmethod
    def _put_direct(backend, vkey: bytes, data: bytes) -> bytes:
        return backend.env.write(lambda txn: backend.put(txn, vkey, data, direct=True))

    def test_direct_puts_between_buffered_ones_read_back_and_survive_a_reopen(self, tmp_path):
        backend = self.make_backend(tmp_path, segment_bytes=64 << 20)
        sizes = [("s1", 1000, False), ("d1", (3 << 20) + 5, True), ("s2", 777, False),
                 ("d2", segments_mod.DIRECT_MIN, True), ("d3", (1 << 20) + 4096 - 18 - 2 - 5, True),
                 ("small-direct", 5000, True), ("s3", 10, False)]
        values = {name.encode(): os.urandom(size) for name, size, _ in sizes}
        locs = {}
        try:
            for name, _, direct in sizes:
                key = name.encode()
                locs[key] = (self._put_direct if direct else self.put)(backend, key, values[key])
            for key, loc in locs.items():
                assert backend.get(loc) == values[key]
                assert self.raw_read(backend, loc) == values[key]
            for name, size, direct in sizes:
                off = LOCATION.unpack(locs[name.encode()])[1] - HEADER.size
                if direct and size >= segments_mod.DIRECT_MIN:
                    assert off % segments_mod.DIRECT_ALIGN == 0, name
            # the walk sees every record, the gaps as pad records with no name
            seg = LOCATION.unpack(locs[b"s1"])[0]
            walked = backend.records(seg)
            named = [(vkey, loc) for vkey, loc in walked if vkey]
            assert named == [(name.encode(), locs[name.encode()]) for name, _, _ in sizes]
            pads = [loc for vkey, loc in walked if not vkey]
            assert pads and all(set(self.raw_read(backend, loc)) <= {0} for loc in pads)
            end = LOCATION.unpack(walked[-1][1])
            assert end[1] + end[2] + len(walked[-1][0]) == _segment_path(backend.directory, seg).stat().st_size
            assert backend.usage().live_bytes == sum(len(v) for v in values.values())
            backend.sync()
        finally:
            self.close(backend)
        backend = self.make_backend(tmp_path, segment_bytes=64 << 20)
        try:
            for key, loc in locs.items():
                assert backend.get(loc) == values[key]
        finally:
            self.close(backend)

    def test_a_direct_put_and_its_reads_leave_nothing_in_the_page_cache(self, tmp_path):
        if _fs_type(tmp_path) == "tmpfs":
            pytest.skip("tmpfs is the page cache: direct writes land there too")
        backend = self.make_backend(tmp_path, segment_bytes=64 << 20)
        try:
            data = os.urandom(4 << 20)
            direct = self._put_direct(backend, b"direct", data)
            buffered = self.put(backend, b"buffered", data)
            assert backend.get(direct) == data
            assert backend.get(buffered) == data
            assert _resident_pages(backend, direct) == 0
            assert _resident_pages(backend, buffered) > 0  # the check can see cached pages
        finally:
            self.close(backend)

    @pytest.mark.parametrize("where", [pytest.param(lambda off: off - HEADER.size, id="magic"),
                                       pytest.param(lambda off: off + (1 << 20), id="data")])
    def test_a_damaged_direct_record_raises_corrupt_value(self, tmp_path, where):
        backend = self.make_backend(tmp_path, segment_bytes=64 << 20)
        try:
            loc = self._put_direct(backend, b"d", os.urandom(2 << 20))
            _flip_byte(backend, loc, where)
            with pytest.raises(Damaged):
                backend.get(loc)
        finally:
            self.close(backend)

    def test_a_direct_record_read_into_a_callers_buffer_lands_there_and_is_checked(self, tmp_path):
        """get_into: the value's bytes in the caller's buffer (no new ones), its CRC as
        get_checked gives it; a buffer too small gets None; a damaged record raises."""
        backend = self.make_backend(tmp_path, segment_bytes=64 << 20)
        try:
            data = os.urandom(2 << 20)
            loc = self._put_direct(backend, b"d", data)
            out = mmap.mmap(-1, 3 << 20)
            view, crc = backend.get_into(loc, out)
            assert view.obj is out and bytes(view) == data and out[:len(data)] == data
            assert crc == backend.get_checked(loc)[1]
            assert backend.get_into(loc, bytearray(1 << 20)) is None
            _flip_byte(backend, loc, lambda off: off + (1 << 20))
            with pytest.raises(Damaged):
                backend.get_into(loc, out)
        finally:
            self.close(backend)

    def test_a_file_system_refusing_direct_writes_gets_buffered_ones(self, tmp_path, monkeypatch):
        backend = self.make_backend(tmp_path, segment_bytes=64 << 20)
        real_open = os.open

        def no_direct(path, flags, *args, **kwargs):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(segments_mod.os, "open", no_direct)
        try:
            first = self.put(backend, b"a", b"a" * 100)
            data = os.urandom(2 << 20)
            loc = self._put_direct(backend, b"big", data)
            again = self._put_direct(backend, b"big2", data)
            assert backend.get(loc) == data and backend.get(again) == data
            assert backend.get(first) == b"a" * 100
            assert not backend._direct
            seg = LOCATION.unpack(loc)[0]
            assert [v for v, _ in backend.records(seg) if v] == [b"a", b"big", b"big2"]
        finally:
            self.close(backend)


def _fs_type(path: Path) -> str:
    """The type of the file system `path` is on (the longest mount point above it)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def _resident_pages(backend: SegmentValues, loc: bytes) -> int:
    """Pages of the value at `loc` in the page cache (mincore of a private map of its file)."""
    import ctypes
    import mmap

    seg, off, size = LOCATION.unpack(loc)
    page = mmap.PAGESIZE
    path = _segment_path(backend.directory, seg)
    first, last = off // page * page, min(-(-(off + size) // page) * page, path.stat().st_size)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), last - first, access=mmap.ACCESS_COPY, offset=first)
    try:
        vec = (ctypes.c_ubyte * -(-(last - first) // page))()
        buf = ctypes.c_char.from_buffer(mm)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(ctypes.addressof(buf), last - first, vec) == 0, ctypes.get_errno()
        del buf
        return sum(v & 1 for v in vec)
    finally:
        mm.close()

"""Shared conformance tests every ValueBackend must pass.

A concrete test class inherits `BackendConformance` and provides:

* ``make_backend(tmp_path, map_size=None)`` — open (or reopen) the backend and
  its LmdbEnv rooted at ``tmp_path``;
* ``raw_read(backend, loc)`` — the bytes stored at ``loc`` read *without* the
  backend under test (ground truth), or None when nothing is there;
* ``make_unreachable(backend, loc)`` — after ``loc`` was deleted, do whatever
  the tier needs so that reading it must fail (e.g. collect its segment).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from distorefs.backends.base import TierUsage, ValueBackend
from distorefs.backends.errors import Missing

SIZES = [0, 1, 100, 4096, 5 << 20]


class _Boom(Exception):
    pass


class BackendConformance:
    # -- hooks the concrete classes implement --------------------------------

    def make_backend(self, tmp_path: Path, map_size: int | None = None) -> ValueBackend:
        raise NotImplementedError

    def raw_read(self, backend: ValueBackend, loc: bytes) -> bytes | None:
        raise NotImplementedError

    def make_unreachable(self, backend: ValueBackend, loc: bytes) -> None:
        pass

    def missing_location(self) -> bytes:
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------

    @pytest.fixture
    def opener(self, tmp_path):
        opened: list[ValueBackend] = []

        def open_(map_size: int | None = None) -> ValueBackend:
            backend = self.make_backend(tmp_path, map_size=map_size)
            opened.append(backend)
            return backend

        yield open_
        for backend in opened:
            self.close(backend)

    @pytest.fixture
    def backend(self, opener):
        return opener()

    @staticmethod
    def close(backend: ValueBackend) -> None:
        backend.close()
        backend.close()  # idempotent
        backend.env.close()

    @staticmethod
    def put(backend: ValueBackend, vkey: bytes, data: bytes) -> bytes:
        return backend.env.write(lambda txn: backend.put(txn, vkey, data))

    @staticmethod
    def delete(backend: ValueBackend, loc: bytes) -> None:
        backend.env.write(lambda txn: backend.delete(txn, loc))

    # -- tests ---------------------------------------------------------------

    @pytest.mark.parametrize("size", SIZES)
    def test_round_trip(self, backend, size):
        data = os.urandom(size)
        loc = self.put(backend, b"k%d" % size, data)
        assert isinstance(loc, bytes)
        got = backend.get(loc)
        assert type(got) is bytes
        assert got == data
        assert self.raw_read(backend, loc) == data

    def test_put_accepts_memoryview(self, backend):
        data = bytearray(os.urandom(1000))
        loc = self.put(backend, b"mv", memoryview(data)[10:900])
        assert backend.get(loc) == bytes(data[10:900])

    def test_get_many_reads_what_get_reads_and_none_where_nothing_is(self, backend):
        datas = [os.urandom(n) for n in (1, 3000, 70_000)]
        locs = [self.put(backend, b"many%d" % i, d) for i, d in enumerate(datas)]
        got = backend.get_many([locs[2], self.missing_location(), locs[0], locs[1]])
        assert got == [datas[2], None, datas[0], datas[1]]
        assert all(type(g) is bytes for g in got if g is not None)
        assert backend.get_many([]) == []

    def test_get_missing_raises_not_found(self, backend):
        with pytest.raises(Missing):
            backend.get(self.missing_location())

    def test_get_deleted_raises_not_found(self, backend):
        loc = self.put(backend, b"gone", b"x" * 1000)
        self.delete(backend, loc)
        self.make_unreachable(backend, loc)
        with pytest.raises(Missing):
            backend.get(loc)
        assert self.raw_read(backend, loc) is None

    def test_delete_drops_live_bytes(self, backend):
        base = backend.usage().live_bytes
        loc_a = self.put(backend, b"a", b"a" * 3000)
        loc_b = self.put(backend, b"b", b"b" * 5000)
        assert backend.usage().live_bytes == base + 8000
        self.delete(backend, loc_a)
        assert backend.usage().live_bytes == base + 5000
        assert backend.get(loc_b) == b"b" * 5000

    def test_delete_missing_is_noop(self, backend):
        loc = self.put(backend, b"keep", b"k" * 100)
        before = backend.usage().live_bytes
        self.delete(backend, self.missing_location())
        assert backend.usage().live_bytes == before
        assert backend.get(loc) == b"k" * 100

    def test_persistence_after_reopen(self, opener):
        backend = opener()
        values = {b"v%d" % i: os.urandom(i * 997) for i in range(20)}
        locs = {k: self.put(backend, k, v) for k, v in values.items()}
        backend.sync()
        live = backend.usage().live_bytes
        self.close(backend)

        again = opener()
        for k, loc in locs.items():
            assert again.get(loc) == values[k]
        assert again.usage().live_bytes == live
        # and it keeps working after the reopen
        loc = self.put(again, b"after", b"z" * 10)
        assert again.get(loc) == b"z" * 10

    def test_aborted_txn_leaves_nothing_referenced(self, backend):
        keep = self.put(backend, b"keep", b"k" * 10)
        before = backend.usage().live_bytes
        seen: list[bytes] = []

        def fn(txn):
            seen.append(backend.put(txn, b"doomed", b"d" * 4000))
            raise _Boom

        with pytest.raises(_Boom):
            backend.env.write(fn)
        assert len(seen) == 1
        assert backend.usage().live_bytes == before
        assert backend.get(keep) == b"k" * 10

    def test_many_puts_in_one_txn(self, backend):
        values = [os.urandom(i % 300) for i in range(2000)]

        def fn(txn):
            return [backend.put(txn, b"m%05d" % i, v) for i, v in enumerate(values)]

        locs = backend.env.write(fn)
        assert len(set(locs)) == len(values)
        for loc, v in zip(locs, values):
            assert backend.get(loc) == v
        assert backend.usage().live_bytes == sum(map(len, values))

    def test_locations_lists_what_was_put(self, backend):
        locs = {self.put(backend, b"l%d" % i, os.urandom(i * 10)): i * 10 for i in range(50)}
        listed = dict(backend.locations())
        for loc, size in locs.items():
            assert listed[loc] == size

    def test_concurrent_gets(self, backend):
        values = [os.urandom(1000 + i * 37) for i in range(64)]
        locs = backend.env.write(lambda txn: [backend.put(txn, b"c%d" % i, v) for i, v in enumerate(values)])
        errors: list[BaseException] = []

        def reader(seed: int) -> None:
            try:
                for n in range(500):
                    i = (seed * 7 + n) % len(values)
                    assert backend.get(locs[i]) == values[i]
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

    def test_puts_survive_map_growth(self, opener):
        # A tiny map forces MapFullError; the txn (and the tier's put) is rerun.
        backend = opener(map_size=64 << 10)
        values = [os.urandom(256 << 10) for _ in range(12)]
        locs = [self.put(backend, b"g%d" % i, v) for i, v in enumerate(values)]
        many = backend.env.write(lambda txn: [backend.put(txn, b"h%d" % i, v) for i, v in enumerate(values)])
        for loc, v in zip(locs + many, values + values):
            assert backend.get(loc) == v
        # a rerun put must not be counted twice
        assert backend.usage().live_bytes == 2 * sum(map(len, values))

    def test_usage_is_sane(self, backend):
        empty = backend.usage()
        assert isinstance(empty, TierUsage)
        assert empty.live_bytes == 0
        self.put(backend, b"u1", os.urandom(1 << 20))
        self.put(backend, b"u2", os.urandom(12345))
        u = backend.usage()
        assert u.live_bytes == (1 << 20) + 12345
        assert u.used_bytes >= u.live_bytes
        assert u.capacity_bytes >= u.used_bytes
        backend.sync()

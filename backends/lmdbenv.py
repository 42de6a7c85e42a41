"""One LMDB environment: named databases, serialised write transactions with
automatic map growth, and read transactions that are safe against that growth.

Durability: the environment is opened with ``sync=False, metasync=False``, so a
commit does *not* reach the disk by itself. Durability comes only from an
explicit :meth:`LmdbEnv.sync`; callers that promise durability (fsync of a
file, a checkpoint) must call it. A crash may lose the most recent commits but
never leaves a torn database (LMDB's copy-on-write pages keep it consistent).

Thread rules (all calls come from worker threads, never an event loop):

* write transactions are serialised by a process-local lock;
* ``env.set_mapsize`` must run with no transaction open in this process, so
  reads hold a shared lock and a resize holds it exclusively;
* ``fn`` passed to :meth:`read` must not call :meth:`write` (it would wait for
  its own shared lock during a resize); ``fn`` passed to :meth:`write` must not
  call :meth:`write` again. Both mistakes raise ``RuntimeError`` at once.

``fn`` receives an :class:`LmdbTxn`: the engine-neutral ``Txn`` of backends/base.py,
whose key spaces are named (``db=b"entries"``) rather than LMDB handles.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import lmdb

from .errors import Damaged, Full, ReadOnly, Unreadable
from .lmdbcheck import check_data_file

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 30


def _is_disk_full(exc: lmdb.Error, path: Path | None = None) -> bool:
    # py-lmdb maps ENOSPC to DiskError; other errno values arrive as .code.
    if isinstance(exc, lmdb.DiskError) or getattr(exc, "code", 0) in (errno.ENOSPC, errno.EDQUOT):
        return True
    # LMDB reports a short page write as EIO (mdb_page_flush): on a disk with no room left
    # that is a full disk, not damage.
    if path is not None and getattr(exc, "code", 0) == errno.EIO:
        try:
            st = os.statvfs(path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < _FULL_BELOW
    return False


_FULL_BELOW = 1 << 20  # free bytes under which a failed write is taken for a full disk


class _SharedExclusiveLock:
    """Readers/writer lock guarding transactions against ``set_mapsize``.

    Shared acquisition is re-entrant per thread (a read nested in a read, or
    in a write, must not queue behind a waiting resize and deadlock). A
    waiting exclusive holder blocks new readers so a resize cannot starve.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._exclusive = False
        self._waiting = 0
        self._local = threading.local()

    def held_shared(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._exclusive or self._waiting:
                    self._cond.wait()
                self._readers += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._readers -= 1
                    if self._readers == 0:
                        self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class LmdbTxn:
    """An LMDB transaction as a `Txn`: key spaces by name, resolved to the environment's
    database handles (opened beforehand with `LmdbEnv.db`)."""

    __slots__ = ("_txn", "_dbs")

    def __init__(self, txn: lmdb.Transaction, dbs: dict[bytes, "lmdb._Database"]) -> None:
        self._txn = txn
        self._dbs = dbs

    def _db(self, name: bytes) -> "lmdb._Database":
        handle = self._dbs.get(name)
        if handle is None:
            raise RuntimeError(f"database {name!r} was not opened before the transaction")
        return handle

    def get(self, key: bytes, db: bytes):
        return self._txn.get(key, db=self._db(db))

    def put(self, key: bytes, value, db: bytes, overwrite: bool = True) -> bool:
        return self._txn.put(key, value, db=self._db(db), overwrite=overwrite)

    def put_many(self, items, db: bytes) -> None:
        self._txn.cursor(db=self._db(db)).putmulti(items)

    def replace(self, key: bytes, value, db: bytes):
        return self._txn.replace(key, value, db=self._db(db))

    def delete(self, key: bytes, db: bytes) -> bool:
        return self._txn.delete(key, db=self._db(db))

    def cursor(self, db: bytes) -> lmdb.Cursor:
        return self._txn.cursor(db=self._db(db))


class LmdbEnv:
    """Owns one ``lmdb.Environment`` in directory ``path`` (created 0700)."""

    def __init__(self, path: str | os.PathLike[str], map_size: int = DEFAULT_MAP_SIZE, *,
                 readonly: bool = False, readahead: bool = True) -> None:
        """`readonly`: open an existing environment for reading only (write() raises
        ReadOnly, sync() does nothing): nothing of the file is changed. `readahead` False:
        a page that faults is read alone (MADV_RANDOM; see below why the store does not)."""
        self.path = Path(path)
        self.readonly = readonly
        if readonly:
            if not (self.path / "data.mdb").is_file():
                raise Unreadable(f"{self.path}: no LMDB environment to open read-only")
        else:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_data_file(self.path)  # a truncated file would be mapped and kill us with SIGBUS
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=map_size,
                subdir=True,
                max_dbs=32,
                sync=False,  # durability only via sync(); see module docstring
                metasync=False,
                # The kernel reads around a page that faults, and stops by itself on a
                # mapping whose read-around goes unused (random samples of a ring). Without
                # it (MADV_RANDOM) a cold 10 KB value was three reads one after another: a
                # cold shuffled epoch read through the mount, 4 readers, went from 1,657 to
                # 2,219 items/s with it (2,390-2,410 warm, either way).
                readahead=readahead,
                max_readers=256,
                lock=True,
                mode=0o600,
                readonly=readonly,
            )
        except lmdb.Error as exc:
            if not readonly:
                raise
            raise Unreadable(f"{self.path}: {exc}") from exc
        self._dbs: dict[bytes, lmdb._Database] = {}
        self._dbs_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._rw = _SharedExclusiveLock()
        self._local = threading.local()
        self._page = os.sysconf("SC_PAGE_SIZE")

    # -- databases -----------------------------------------------------------

    def db(self, name: bytes) -> bytes:
        """Open the named database (created on first use) and return its name, by which
        transactions address it.

        Open every database before using it in write(): creating one needs its own write
        transaction, so a first call inside ``fn`` raises RuntimeError.
        """
        if name in self._dbs:
            return name
        with self._dbs_lock:
            if name not in self._dbs:
                # open_db with create=True runs its own write txn: take the
                # writer lock so it cannot interleave with write().
                self._check_not_nested()
                with self._write_lock:
                    try:
                        self._dbs[name] = self._env.open_db(name, create=not self.readonly)
                    except lmdb.Error as exc:
                        if not self.readonly:
                            raise
                        # never made (a store that never used it), or its record is damaged
                        raise Unreadable(f"{self.path}: database {name.decode(errors='replace')}: {exc}") from exc
            return name

    def db_names(self) -> list[bytes]:
        """Names of the named databases in the environment (keys of LMDB's main db)."""
        with self._rw.shared():
            with self._env.begin(write=False) as txn:
                return [bytes(k) for k in txn.cursor().iternext(values=False)]

    # -- transactions --------------------------------------------------------

    def write(self, fn: Callable[[LmdbTxn], T]) -> T:
        """Run ``fn(txn)`` in one write transaction, commit, return its result.

        On ``MapFullError`` the transaction is aborted, the map doubled and
        ``fn`` run again from scratch, so ``fn`` must be safe to rerun. Values
        read inside are views valid until the next write in the transaction:
        ``fn`` copies what it keeps or returns. Any
        other exception aborts the transaction and propagates.
        Raises ``Full`` when the disk cannot hold a larger map.
        """
        self._check_not_nested()
        if self.readonly:
            raise ReadOnly(f"{self.path} is open read-only")
        with self._write_lock:
            self._local.writing = True
            try:
                while True:
                    # buffers=True: reads inside return views, not copies (a delete can
                    # learn a value's length without copying it); fn copies what it keeps.
                    txn = self._env.begin(write=True, buffers=True)
                    try:
                        result = fn(LmdbTxn(txn, self._dbs))
                        txn.commit()
                        return result
                    except lmdb.MapFullError:
                        txn.abort()  # no-op if commit already released it
                    except lmdb.Error as exc:
                        txn.abort()
                        if _is_disk_full(exc, self.path):
                            raise Full(f"{self.path}: disk full") from exc
                        raise
                    except BaseException:
                        txn.abort()
                        raise
                    self._grow()
            finally:
                self._local.writing = False

    def read(self, fn: Callable[[LmdbTxn], T]) -> T:
        """Run ``fn(txn)`` in a read-only ``buffers=True`` transaction.

        Values read inside are memoryviews into the map and die with the
        transaction: ``fn`` must copy out whatever it returns.
        """
        with self._rw.shared():
            try:
                with self._env.begin(write=False, buffers=True) as txn:
                    return fn(LmdbTxn(txn, self._dbs))
            except lmdb.Error as exc:  # damaged pages, a corrupted environment
                raise Damaged(f"{self.path}: {exc}") from exc

    def _check_not_nested(self) -> None:
        if getattr(self._local, "writing", False):
            raise RuntimeError("LmdbEnv.write() called inside a write transaction")
        if self._rw.held_shared():
            raise RuntimeError("LmdbEnv.write() called inside a read transaction")

    def _grow(self) -> None:
        """Double the map (capped by free disk), with no transaction open."""
        current = self._env.info()["map_size"]
        data_file = self.path / "data.mdb"
        st = os.statvfs(self.path)
        # LMDB never preallocates on Linux, so the map can usefully grow only
        # as far as the file's current size plus the disk's free space.
        cap = data_file.stat().st_size + st.f_bavail * st.f_frsize
        new = min(current * 2, cap) // self._page * self._page
        if new <= current:
            raise Full(f"{self.path}: LMDB map full ({current} bytes) and the disk has no room to grow")
        with self._rw.exclusive():
            try:
                self._env.set_mapsize(new)
            except lmdb.Error as exc:
                if _is_disk_full(exc):
                    raise Full(f"{self.path}: cannot grow LMDB map") from exc
                raise

    # -- maintenance ---------------------------------------------------------

    def sync(self) -> None:
        """Force every committed transaction to disk (fsync)."""
        if self.readonly:
            return
        with self._rw.shared():
            self._env.sync(True)

    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died inside a read transaction (clients
        beside the mount read this environment too): a stale slot would keep the pages it
        saw from ever being reused. How many were freed."""
        with self._rw.shared():
            return self._env.reader_check()

    def usage(self) -> tuple[int, int]:
        """(bytes in use by the B-trees, current map size)."""
        with self._rw.shared():
            info = self._env.info()
            psize = self._env.stat()["psize"]
        return (info["last_pgno"] + 1) * psize, info["map_size"]

    def close(self) -> None:
        """Close the environment; call only once no other thread uses it."""
        with self._write_lock, self._rw.exclusive():
            self._env.close()
            self._dbs.clear()

    def __enter__(self) -> "LmdbEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

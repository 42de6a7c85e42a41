"""The libfuse calls distorefs takes over from pyfuse3 (mount/_interpose.c).

- Opens answered without a FLUSH at close (FOPEN_NOFLUSH). pyfuse3 3.5 cannot ask the
  kernel to skip FLUSH for an open, so every close of a file cost a FLUSH request even
  where the handle has nothing to do at flush (a read-only open: an entry, a drawn batch,
  a dataset item). `noflush(fh)` marks a handle number; the library's `fuse_reply_open`
  strips the mark and sets the flag as it replies.
- GETXATTR of names that are not distorefs' own (the kernel asks for security.capability
  before every write and at every open with O_TRUNC) is answered ENODATA by the library,
  without Python; the session is made with pyfuse3's handler table but that entry.
- IOCTL (pyfuse3 has no handler: every open by Python's open() asks isatty) is answered
  ENOSYS as libfuse would, and counted (`ioctl_replies`).
- The front: a native thread of the library reads every request and answers those two
  kinds itself, without the GIL or the trio loop; pyfuse3 waits on an eventfd and takes
  the rest from its queue (`front()`). It also answers GETATTR of an inode whose
  attributes Python holds there (`hold_attributes`: they change only by an act of Python's,
  which forgets them first; `give_attributes`: ones Python made at an OPEN and sends in
  no reply, for the GETATTR that follows; `keep_attributes`: a sealed dataset's items,
  which the kernel may hold from before the seal) and FLUSH of a handle with nothing to do
  at close (`flush_free`), and RELEASE of a handle whose release is bookkeeping only
  (`release_free`, `take_released`). It answers the OPEN of an inode Python marks (`answer_opens`: a
  write-only open of `priorities`; the next open of a sealed item already in the page
  cache, noted for `take_opened`), Python making the handle only when a request of it
  comes (`adopt_opened`); and it parks the FLUSH of a handle whose commits are still under
  way until the committer's thread says they are done (`flush_pending`,
  `flush_committed`). And it takes a `priorities` WRITE of whole, well-formed lines
  itself, appending it to the store's priority write-ahead file first (`priority_log`,
  `take_writes`; distorefs/priowal.py), so that its close waits for nothing. And it
  keeps the bytes a new entry's writer writes (`collect_writes`), answering each WRITE,
  until Python's first request of that handle takes them (`take_collected`): an insert's
  WRITEs never reach Python, its close's FLUSH commits what the front kept (and a later
  close of the same open file, np.save's second, is the front's: `flush_free`).
  And it answers a LOOKUP ENOENT in a directory whose names Python gave it
  (`absent_names`, kept by `name_counted`) when the name is not among them: the LOOKUP
  the kernel sends before every create of a new entry. And in such a directory, when
  Python lets it (`answer_creates`), it answers a write-only CREATE of a name it lacks
  itself, with an inode number Python reserved (`create_inodes`) and a handle whose WRITEs
  it collects; Python makes the inode and the writer from the record (`take_created`)
  before it handles any request.
  And a request the front has queued already is taken by pyfuse3's loop without waiting
  for its fd again (`take_queued_without_waiting`; DISTOREFS_QUEUED_WAIT=0 leaves it off).
  The front's thread (`distorefs-front`) runs at nice -10 where the daemon may
  (DISTOREFS_FRONT_NICE sets another value). DISTOREFS_FRONT=0 in the daemon's environment
  leaves the reading to pyfuse3, as before (for comparisons).
- FUSE passthrough (`passthrough`, `backing_open`, `passthrough_fh`): where the kernel
  offers it, an open can hand the kernel a file of the daemon's to read for the handle
  itself (a large batch file, written into a memfd). DISTOREFS_PASSTHROUGH=0 leaves it off.

The library defines those libfuse functions and forwards to libfuse's own; loaded into the
global symbol scope before pyfuse3, its definitions are the ones pyfuse3's calls bind to.
Without it (a build without a C compiler or libfuse's headers) or when pyfuse3 was
imported first, `noflush` returns the handle unchanged and closes send FLUSH, as before.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # (never imported here at run time: this module must load before pyfuse3)
    import pyfuse3

    from distorefs.checkpoints import Memory

log = logging.getLogger(__name__)


def _load():
    if "pyfuse3" in sys.modules:
        # pyfuse3's calls may be bound already, to libfuse itself
        return None, "pyfuse3 was imported before mount/interpose.py"
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        from distorefs.mount import _interpose  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"mount/_interpose.c not built ({exc})"
    finally:
        sys.setdlopenflags(flags)
    if not _interpose.interposed():
        return None, "other definitions of libfuse's functions come first in the global scope"
    return _interpose, ""


_library, why_not = _load()
active: bool = _library is not None
if _library is not None and os.environ.get("DISTOREFS_FRONT", "1") == "0":
    _library.use_front(False)
if _library is not None and os.environ.get("DISTOREFS_PASSTHROUGH", "1") == "0":
    _library.use_passthrough(False)
_MARK = _library.NOFLUSH_FH if _library is not None else 0
_collect = os.environ.get("DISTOREFS_COLLECT", "1") != "0"
_chunks = os.environ.get("DISTOREFS_CHUNKS", "1") != "0"
_absent = os.environ.get("DISTOREFS_ABSENT", "1") != "0"
_creates = os.environ.get("DISTOREFS_CREATES", "1") != "0"


def noflush(fh: int) -> int:
    """The handle number to return from open() so that its close sends no FLUSH."""
    return fh | _MARK


def replies() -> int:
    """Opens answered with FOPEN_NOFLUSH so far."""
    return _library.noflush_replies() if _library is not None else 0


def foreign_xattr_replies() -> int:
    """GETXATTR requests of names not distorefs' own answered by the library so far."""
    return _library.foreign_xattr_replies() if _library is not None else 0


def ioctl_replies() -> int:
    """IOCTL requests answered (ENOSYS) so far."""
    return _library.ioctl_replies() if _library is not None else 0


def front() -> tuple[bool, int]:
    """Whether the front reads the session's requests, and how many it handed to pyfuse3."""
    if _library is None:
        return False, 0
    on, passed = _library.front()
    return bool(on), int(passed)


def hold_attributes(ino: int) -> None:
    """From the next attribute reply for `ino` on, the front answers its GETATTRs with it,
    until `forget_attributes(ino)`. For attributes that change only by an act of ours."""
    if _library is not None:
        _library.hold_attributes(ino, True)


def _attribute_args(a: "pyfuse3.EntryAttributes") -> tuple:
    return (a.st_ino, a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_size, a.st_blocks, a.st_blksize,
            a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns, a.attr_timeout)


def give_attributes(attrs: "pyfuse3.EntryAttributes", once: bool) -> bool:
    """The front answers the next GETATTR of `attrs.st_ino` with `attrs`, which Python made
    but sends in no reply (the size of a batch just opened). `once`: that GETATTR only, if it
    comes within a second (the kernel may hold attributes still and ask nothing); otherwise
    as `hold_attributes`, until forgotten. False: no front, or its table is full."""
    return _library is not None and bool(_library.give_attributes(*_attribute_args(attrs), once))


def keep_attributes(attrs: "pyfuse3.EntryAttributes") -> bool:
    """The front answers every GETATTR of `attrs.st_ino` with `attrs` (and with Python's
    later replies for it), until `forget_attributes`: for inodes whose attributes change
    only by an act Python answers (a sealed dataset's items, which the kernel may hold with
    attributes it was told not to cache). False: no front, or no room (8,192 at most)."""
    return _library is not None and bool(_library.keep_attributes(*_attribute_args(attrs)))


def forget_attributes(ino: int) -> None:
    """GETATTR of `ino` reaches Python again (before its attributes change), and so do its
    opens (`answer_opens`)."""
    if _library is not None:
        _library.hold_attributes(ino, False)


def forget_inode(ino: int) -> None:
    """`ino` left the inode table: what the front keeps for it goes (`forget_attributes`,
    `absent_names`)."""
    forget_attributes(ino)
    if _library is not None:
        _library.absent_names_end(ino)


def absent_names(ino: int, names: Iterable[bytes]) -> bool:
    """The front answers a LOOKUP in directory `ino` of a name it does not hold ENOENT
    itself; it holds `names`, and each name as often as `name_counted` says since (a name
    held is never answered there: Python answers it). DISTOREFS_ABSENT=0 in the daemon's
    environment leaves every LOOKUP to Python (for comparisons). False: it does not (no
    front, or no room), until `forget_inode(ino)` or the next call."""
    return _library is not None and _absent and bool(_library.absent_names(ino, names))


def name_counted(ino: int, name: bytes, present: bool) -> None:
    """Directory `ino` (see `absent_names`) holds `name` once more (`present`) or once less."""
    if _library is not None:
        _library.name_counted(ino, name, present)


def answer_creates(ino: int, on: bool, limit: int, timeout: float) -> bool:
    """The front answers write-only CREATEs of names directory `ino` lacks (it must hold the
    directory's names: `absent_names`), or no longer (`on` False): each writer's WRITEs
    collected up to `limit` bytes, the entry's name and attributes cached `timeout` seconds
    by the kernel. DISTOREFS_CREATES=0 in the daemon's environment leaves every CREATE to
    Python (for comparisons). Whether it does."""
    if _library is None:
        return False
    return bool(_library.answer_creates(ino, on and _creates, limit, timeout))


def create_inodes(numbers: list[int]) -> int:
    """Inode numbers (never used for anything else) the front may give the entries it
    creates; how many it took (it holds 256 at most)."""
    return int(_library.create_inodes(numbers)) if _library is not None else 0


def take_created() -> tuple[tuple[int, bytes, int, int, int, int, int, int, int], ...]:
    """(directory, name, inode, handle, open flags, mode, uid, gid, pid) of each CREATE the
    front answered since the last call, in order."""
    return _library.take_created() if _library is not None else ()


def create_state() -> tuple[int, int, int]:
    """(CREATEs the front answered so far, inode numbers in its pool, directories it answers
    them in)."""
    return _library.create_state() if _library is not None else (0, 0, 0)


def absent_state() -> tuple[int, int, int]:
    """(LOOKUPs the front answered ENOENT so far, directories it answers them in, names they
    hold)."""
    return _library.absent_state() if _library is not None else (0, 0, 0)


def flush_free(fh: int, free: bool) -> None:
    """Whether handle `fh` has nothing to do at close: its FLUSH is then answered by the
    front. Set false before anything that gives it work, and at its release."""
    if _library is not None:
        _library.flush_free(fh, free)


def answer_opens(ino: int, accmode: int, *, keep_cache: bool = False, noflush: bool = False,
                 once: bool = False, adopted: bool = False, pid: int = 0, priorities_of: int = 0) -> bool:
    """The front answers opens of `ino` with access mode `accmode` (os.O_WRONLY, say) itself,
    with a handle number of its own, until `forget_attributes(ino)`. For a file whose open
    is nothing but making its handle, with the kernel checking permissions
    (default_permissions): the handle is made at its first request that reaches Python
    (`adopt_opened`). Its FLUSH is answered by the front until a write gives it work
    (`flush_free`), its RELEASE too (handed to `take_released` once adopted).
    `keep_cache` and `noflush` go into the open's reply; `once`: only the next open, whose
    inode and handle number are then noted for `take_opened`; `adopted` (with `once`): the
    handle is Python's from that open on (made at `take_opened`), its RELEASE handed to
    `take_released`; `pid`: only opens by that thread; `priorities_of`: the file is the
    `priorities` of the buffer of that ns_id, whose WRITEs the front takes while it has a
    write-ahead file (`priority_log`). False: not answered (no library, no room)."""
    if _library is None:
        return False
    flags = (1 if keep_cache else 0) | (2 if noflush else 0) | (4 if once else 0) | (8 if adopted else 0) | \
        (16 if priorities_of else 0)
    return bool(_library.answer_opens(ino, accmode, flags, pid, priorities_of))


def notes_fd() -> int:
    """An eventfd that becomes readable when the front answered the OPEN or the RELEASE of
    an `adopted` mark's handle: Python takes them at once (take_opened, take_released), not
    at its next request. -1: none (no library)."""
    return int(_library.notes_fd()) if _library is not None else -1


def take_opened() -> tuple[tuple[int, int], ...]:
    """(inode, handle number) of each open the front answered for a `once` mark since the
    last call."""
    return _library.take_opened() if _library is not None else ()


def adopt_opened(fh: int) -> tuple[int, int] | None:
    """(inode, open flags) of handle `fh` if the front opened it and Python had not yet."""
    if _library is None:
        return None
    opened = _library.adopt_opened(fh)
    return None if opened is None else (int(opened[0]), int(opened[1]))


def flush_pending(fh: int) -> bool:
    """One more commit for handle `fh`: a FLUSH the front answers is parked until
    `flush_committed` was called for each. False (no front, no room): nothing was counted,
    the caller waits for its commit itself."""
    return _library is not None and bool(_library.flush_pending(fh))


def flush_committed(fh: int, errno: int) -> None:
    """One of `fh`'s pending commits is done (errno 0) or failed; the last one answers the
    FLUSHes parked meanwhile, with the first error. Any thread."""
    if _library is not None:
        _library.flush_committed(fh, errno)


def priority_log(fd: int, next_number: int, priority_max: float) -> bool:
    """The front takes `priorities` WRITEs of whole, well-formed lines itself, appending each
    to the write-ahead file open at `fd` (distorefs/priowal.py) as record `next_number`, the
    next as the one after, and so on (fd -1: it takes none from now on). False: no library."""
    if _library is None:
        return False
    _library.priority_log(fd, next_number, priority_max)
    return True


def take_writes() -> tuple[tuple[int, int, bytes], ...]:
    """(ns_id, record number, text) of each `priorities` WRITE the front took since the last
    call, in order: Python commits them."""
    return _library.take_writes() if _library is not None else ()


def priority_log_trim(number: int) -> bool:
    """Record `number` is committed: the front empties the file if nothing was appended
    after it and it is past 1 MiB. Any thread."""
    return _library is not None and bool(_library.priority_log_trim(number))


def priority_log_state() -> tuple[int, int, int]:
    """(WRITEs the front took, times it emptied the file, the number its next record gets)."""
    return _library.priority_log_state() if _library is not None else (0, 0, 0)


def collect_writes(fh: int, limit: int, ino: int, mode: int, uid: int, gid: int, timeout: float) -> bool:
    """The front takes handle `fh`'s WRITEs itself, keeping their bytes (up to `limit`: a
    longer file's WRITEs go to Python, with what was kept), until `take_collected(fh)`. For
    a writer with nothing written yet that commits at its close. Meanwhile it answers the
    GETATTRs of inode `ino` (its only writer's) with `mode`, `uid`, `gid`, the size written
    so far and the time now, to be cached `timeout` seconds. DISTOREFS_COLLECT=0 in the
    daemon's environment leaves every WRITE to Python (for comparisons). False: not."""
    return _library is not None and _collect and bool(_library.collect_writes(fh, limit, ino, mode, uid, gid,
                                                                              timeout))


def take_collected(fh: int) -> bytes | None:
    """What the front kept of handle `fh`'s WRITEs (b"" if none came), which it collects no
    more: Python's before it handles any request of that handle. None: not collecting."""
    return _library.take_collected(fh) if _library is not None else None


def collected_size(fh: int) -> int | None:
    """How many bytes the front kept of handle `fh`'s WRITEs so far (it keeps on); None: not
    collecting."""
    return _library.collected_size(fh) if _library is not None else None


def collect_state() -> tuple[int, int, int]:
    """(WRITEs the front collected so far, handles collecting now, bytes they hold)."""
    return _library.collect_state() if _library is not None else (0, 0, 0)


def chunks_arm(fh: int, pos: int, chunk_bytes: int, limit: int) -> bool:
    """The front copies handle `fh`'s WRITEs into chunk buffers lent to it (`chunks_lend`),
    answering each, while they land one after the other from `pos` (a multiple of
    `chunk_bytes`) and within `limit`; anything else goes to Python, which must stop the
    handle (`chunks_stop`) before it handles any request of its file. A checkpoint file's
    writer (distorefs/checkpoints.py lend). While such a writer streams, the front reads
    each request with its payload landing in the writer's next chunk (one copy per byte:
    `mount.writes_landed`; DISTOREFS_LANDING=0 leaves it off). DISTOREFS_CHUNKS=0 in the
    daemon's environment leaves every such WRITE to Python (for comparisons). False: not
    armed."""
    return _library is not None and _chunks and bool(_library.chunks_arm(fh, pos, chunk_bytes, limit))


def chunks_lend(fh: int, index: int, buffer: Memory) -> bool:
    """Lend `buffer` (chunk_bytes long) for chunk `index` of armed handle `fh`; the front
    writes into it until it is given back (`chunks_full`, `chunks_stop`). False: not taken."""
    return _library is not None and bool(_library.chunks_lend(fh, index, buffer))


def chunks_full() -> list[tuple[int, tuple[int, Memory, int]]]:
    """The chunks the front filled whole since the last call: [(fh, (index, buffer, filled))]."""
    return _library.chunks_full() if _library is not None else []


def chunks_stop(fh: int) -> tuple[int, list[tuple[int, Memory, int]]] | None:
    """Disarm handle `fh`: (where its next WRITE would have landed, every chunk lent to it as
    (index, buffer, bytes filled from its start), filled or not). None: it was not armed."""
    return _library.chunks_stop(fh) if _library is not None else None


def chunks_pos(fh: int) -> int | None:
    """Where armed handle `fh`'s next WRITE would land (the front goes on); None: not armed."""
    return _library.chunks_pos(fh) if _library is not None else None


def chunks_state() -> tuple[int, int, int, int]:
    """(WRITEs the front took into chunks so far, chunks it filled, handles armed now, of
    those WRITEs the ones read straight into their chunks)."""
    return _library.chunks_state() if _library is not None else (0, 0, 0, 0)


def release_free(fh: int, wake: bool = False) -> None:
    """Handle `fh` has nothing to do at release but Python's bookkeeping: the front answers
    its RELEASE and keeps the number for `take_released`. `wake`: and wakes Python for it
    at once (notes_fd), which has work to do then (Node.release_wakes)."""
    if _library is not None:
        _library.release_free(fh, wake)


_passthrough_refused = False


def passthrough() -> bool:
    """Whether opens may be answered FOPEN_PASSTHROUGH: the kernel was asked for FUSE
    passthrough at INIT (it offered it) and no backing file was refused since."""
    return _library is not None and not _passthrough_refused and bool(_library.passthrough()[0])


def stop_passthrough() -> None:
    """A backing file was refused (the daemon lacks CAP_SYS_ADMIN, say): not tried again."""
    global _passthrough_refused
    _passthrough_refused = True


def passthrough_replies() -> int:
    """Opens answered FOPEN_PASSTHROUGH so far."""
    return int(_library.passthrough()[1]) if _library is not None else 0


def backing_open(fd: int) -> int:
    """Register the open file `fd` as a backing file on the session; its id (OSError:
    no passthrough, or the daemon lacks CAP_SYS_ADMIN)."""
    if _library is None:
        raise OSError(errno.EOPNOTSUPP, "no libfuse library of distorefs' own")
    return int(_library.backing_open(fd))


def backing_close(backing_id: int) -> None:
    """Unregister a backing file: opens that use it keep it until they close."""
    if _library is not None:
        _library.backing_close(backing_id)


def passthrough_fh(fh: int, backing_id: int) -> int:
    """The handle number to return from open() for the kernel to read the handle from
    backing file `backing_id` itself (FOPEN_PASSTHROUGH); `fh` unchanged when that cannot
    be asked (no library, no room: the open is a plain one)."""
    return int(_library.passthrough_fh(fh, backing_id)) if _library is not None else fh


def take_released() -> tuple[int, ...]:
    """The handles whose RELEASE the front answered since the last call."""
    return _library.take_released() if _library is not None else ()


def front_answers() -> tuple[int, int, int, int]:
    """(GETATTRs, FLUSHes, OPENs, RELEASEs of handles Python never saw) the front answered
    itself so far (the RELEASEs of Python's handles are counted as Python takes them)."""
    if _library is None:
        return 0, 0, 0, 0
    getattrs, flushes, opens, releases = _library.front_answers()
    return int(getattrs), int(flushes), int(opens), int(releases)


def parallel_dirops() -> bool:
    """Whether the kernel was told it may send LOOKUPs and READDIRs of one directory side by
    side (FUSE_PARALLEL_DIROPS, which libfuse 3.14 leaves out of its INIT reply: the library
    adds it). Without it the kernel holds a directory's mutex around each."""
    return _library is not None and bool(_library.parallel_dirops())


_taken_queued = [0]  # requests pyfuse3's loop took without waiting (take_queued_without_waiting)


def taken_without_waiting() -> int:
    """How many requests pyfuse3's loop took from the front's queue without a wait."""
    return _taken_queued[0]


def take_queued_without_waiting() -> bool:
    """pyfuse3's loop waits for its fd (the front's eventfd) to be readable before it takes
    each request: a turn of its read lock, an epoll registration and a pass of trio's
    scheduler that polls for it. When the front has requests queued already (writers and
    readers busy together), the wait is a checkpoint only: other tasks get their turn and
    the request is taken. pyfuse3 looks the wait up by name in its module at each request,
    so this replaces it there; a receive that finds the queue empty after all (another task
    took the request) makes the loop wait again, the old way. False: not done (no front
    library, or a pyfuse3 without that wait). DISTOREFS_QUEUED_WAIT=0 in the daemon's
    environment leaves it off (for comparisons)."""
    import pyfuse3
    import trio

    original = getattr(pyfuse3, "_wait_fuse_readable", None)
    if _library is None or original is None or os.environ.get("DISTOREFS_QUEUED_WAIT") == "0":
        return False
    queued = _library.front_queued
    checkpoint = trio.lowlevel.cancel_shielded_checkpoint
    taken_queued = _taken_queued

    async def wait_fuse_readable() -> bool:
        if queued():
            taken_queued[0] += 1
            await checkpoint()
            return True
        return await original()

    setattr(pyfuse3, "_wait_fuse_readable", wait_fuse_readable)
    return True


def front_tables() -> dict[str, int]:
    """How many numbers each of the front's tables holds now (stats.json mount.front_tables)."""
    return dict(_library.front_tables()) if _library is not None else {}


def count_only() -> None:
    """Sessions made from now on leave GETXATTR to pyfuse3 and their reading to pyfuse3's
    loop (the floor filesystem of the benchmarks: its requests counted, its answers and its
    loop pyfuse3's own)."""
    if _library is not None:
        _library.answer_foreign_xattrs(False)
        _library.use_front(False)


def log_state() -> None:
    if not active:
        log.info("closes of read-only files send FLUSH, security.* GETXATTRs reach Python: %s", why_not)

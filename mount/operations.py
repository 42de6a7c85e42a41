"""The pyfuse3 Operations: resolve the inode or handle, make one call, map errors to errno.

Every handler goes through `_translate`, so no exception other than FUSEError ever
reaches pyfuse3's main loop (which would end the mount): the core's typed errors carry
their errno, OSError keeps its own, and anything unexpected is logged and becomes EIO.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import sys
import time
from collections import Counter
from typing import NoReturn

import pyfuse3
import trio

from distorefs.config import MAX_PRIORITY
from distorefs.errors import DistorefsError, NotFound, OperationNotPermitted, Stale
from distorefs.owner import Owner

from . import backing, interpose
from .badinput import BAD_INPUT, bad_input_log
from distorefs.ring import Ring
from distorefs.catalog import EntryMeta
from distorefs.store import Store

from .cycles import CollectorPauses
from .handles import EntryWriter, Handle
from .inodes import InodeTable
from .namewarmer import NameWarmer
from .nodes import BETWEEN_REQUESTS, XATTR_PREFIX, EntriesDir, EntryNode, Node, build_tree
from .notify import Invalidator, PageCachePusher

log = logging.getLogger(__name__)
WARM_XATTR = XATTR_PREFIX + b"warm"


def _translate(fn):
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, *args):
        self.requests[name] += 1
        try:
            await self.release_taken()  # closed since the last request
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except DistorefsError as exc:
            if isinstance(exc, BAD_INPUT):
                bad_input_log.note(fn.__name__, exc)
            else:
                log.debug("%s%r: %s", fn.__name__, args[:2], exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            log.warning("%s%r: %s", fn.__name__, args[:2], exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s%r failed", fn.__name__, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class Filesystem(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False
    REDIRECT_S = 2.0  # how long a writer's redirect holds (the kernel's retry follows the ESTALE at once)
    REDIRECTS_HELD = 1024  # expired redirects are dropped when this many are held

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.inodes = InodeTable(on_drop=interpose.forget_inode)
        self.handles: dict[int, Handle] = {}
        # per checkpoint file id: the writer whose WRITEs the library's front copies into chunks
        # lent to it (mount/checkpoint_nodes.py CheckpointWriter.arm); one per file at most
        self.chunk_writers: dict[int, Handle] = {}
        self._listed: dict[int, list[Node]] = {}  # per listed directory: the nodes its last reply listed, to tell
        self.requests: Counter[str] = Counter()  # FUSE requests answered, by type (bench ops)
        self.notes_wakes = 0  # times the front woke take_front_notes (stats.json mount.notes_wakes)
        self._notes_wait = 0.1  # take_front_notes' timer: seconds until its next tick
        self.collector: CollectorPauses | None = None  # the cycle collector's pauses (the daemon sets it)
        self.priority_log_on = False  # the front takes `priorities` WRITEs (start_priority_log)
        self._fh = itertools.count(1)
        self._create_inodes = False  # the front holds inode numbers for the creates it answers
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.started_ns = time.time_ns()
        self.invalidator: Invalidator | None = None
        self.pusher: PageCachePusher | None = None
        self.names: NameWarmer | None = None
        self.pending_items: dict = {}  # (dataset id, dir id, name) -> node of a created, uncommitted item
        self.writer_redirects: dict = {}  # (file key, pid) -> monotonic deadline: its lookups get another inode (entries: a private one; weights: the writers' one)
        self.root = build_tree(self)
        store.listeners.append(self._entry_changed)

    def start_notifications(self, mountpoint: str | None = None) -> None:
        """Kernel invalidations need a live session: start them once the mount is up.
        `mountpoint`: where the daemon lists names ahead of declared orders (none: it does not)."""
        self.invalidator = Invalidator()
        self.pusher = PageCachePusher(self.store.memory.transfer)
        if mountpoint is not None:
            self.names = NameWarmer(mountpoint)

    def start_priority_log(self) -> None:
        """The library's front takes `priorities` WRITEs from now on, appending each to the
        store's write-ahead file (distorefs/priowal.py) before it answers; Python commits
        them as it takes them (`_take_writes`). Not on a read-only store, or with
        DISTOREFS_PRIORITY_WAL=0 in the daemon's environment (for comparisons)."""
        wal = self.store.priority_wal
        if wal is None or os.environ.get("DISTOREFS_PRIORITY_WAL", "1") == "0":
            return
        if interpose.priority_log(wal.fd, wal.next_number, MAX_PRIORITY):
            wal.on_committed = interpose.priority_log_trim
            self.priority_log_on = True

    def stop_priority_log(self) -> None:
        """The front takes no more (the store closes the file next); what it took is
        committed here, the rest of the file at the next mount."""
        if self.priority_log_on:
            interpose.priority_log(-1, 0, MAX_PRIORITY)
            self.priority_log_on = False
            self._take_writes()

    def _take_writes(self) -> bool:
        """Queue the commit of the `priorities` WRITEs the front took (before any request
        that could read or change what they name: every request passes here). True: there
        were some."""
        writes = interpose.take_writes()
        for ns_id, number, text in writes:
            self.store.commit_priority_record(ns_id, number, text)
        return bool(writes)

    def stop_listing(self) -> None:
        """Blocking (a worker thread): end the daemon's own listings of the mount while it
        still serves them, so that neither they nor their open directories outlive it."""
        if self.names is not None:
            self.names.stop()

    def stop_notifications(self) -> None:
        if self.names is not None:
            self.names.stop(timeout=1.0)  # unmounted: what was in flight ends with ENOTCONN
        if self.invalidator is not None:
            self.invalidator.stop()
            self.invalidator = None
        if self.pusher is not None:
            self.pusher.stop()
            self.pusher = None

    def stats(self) -> dict:
        s = self.store.stats()
        requests = self.requests.copy()
        foreign = interpose.foreign_xattr_replies()
        if foreign:
            requests["getxattr"] += foreign  # answered by the library (mount/interpose.py), not here
        front, passed = interpose.front()  # requests the library's thread handed to pyfuse3
        getattrs, flushes, opens, releases = interpose.front_answers()
        if getattrs:
            requests["getattr"] += getattrs  # answered by the library's thread, likewise
        if flushes:
            requests["flush"] += flushes
        if opens:
            requests["open"] += opens
        if releases:
            requests["release"] += releases
        creates, create_pool, create_dirs = interpose.create_state()
        if creates:
            requests["create"] += creates  # answered by the library's thread
        absent, absent_dirs, absent_names = interpose.absent_state()
        if absent:
            requests["lookup"] += absent  # answered ENOENT by the library's thread
        ioctls = interpose.ioctl_replies()
        if ioctls:
            requests["ioctl"] = ioctls  # likewise: isatty() at every open
        writes_taken, log_trims, _ = interpose.priority_log_state()
        if writes_taken:
            requests["write"] += writes_taken  # `priorities` WRITEs the library took
        writes_collected, collecting, collected_bytes = interpose.collect_state()
        if writes_collected:
            requests["write"] += writes_collected  # entry WRITEs the library kept
        writes_chunked, chunks_filled, writers_chunked, writes_landed = interpose.chunks_state()
        if writes_chunked:
            requests["write"] += writes_chunked  # checkpoint WRITEs the library copied into chunks
        s["mount"] = {"inodes": len(self.inodes), "open_handles": len(self.handles),
                      "invalidations": self.invalidator.sent if self.invalidator else 0,
                      "requests": dict(requests), "opens_without_flush": interpose.replies(),
                      "foreign_xattrs_answered": foreign, "front": front, "front_passed": passed,
                      "front_getattrs": getattrs,
                      "taken_without_waiting": interpose.taken_without_waiting(),
                      "front_tables": interpose.front_tables(), "parallel_dirops": interpose.parallel_dirops(),
                      "passthrough": interpose.passthrough(), "passthrough_opens": interpose.passthrough_replies(),
                      "memfds_made": backing.made,
                      "priority_log": self.priority_log_on, "priority_writes_taken": writes_taken,
                      "priority_log_trims": log_trims,
                      "writes_collected": writes_collected, "writers_collecting": collecting,
                      "collected_bytes": collected_bytes, "writes_chunked": writes_chunked,
                      "chunks_filled": chunks_filled, "writers_chunked": writers_chunked,
                      "writes_landed": writes_landed,
                      "lookups_answered_absent": absent, "absent_dirs": absent_dirs,
                      "absent_names_held": absent_names,
                      "front_creates": creates, "create_dirs": create_dirs, "create_inodes_held": create_pool,
                      "names_listed": self.names.listed if self.names else 0,
                      "notes_wakes": self.notes_wakes,
                      "gc": self.collector.stats() if self.collector is not None else None}
        if self.pusher is not None:
            s["memory"]["transfer_held_bytes"] = self.pusher.queued_bytes
            s["memory"]["held_bytes"] += self.pusher.queued_bytes
        return s

    # ----- writers of shared, cached inodes -----------------------------------------

    def redirect_writer(self, key, pid: int) -> NoReturn:
        """An open for writing reached an inode whose pages readers share (a published
        version): refuse it with ESTALE so the kernel looks the name up again, and answer
        that lookup of process `pid` with another inode (an entry's private one, a weights
        file's writers' one) until `take_redirect`. The kernel's atomic O_TRUNC would
        otherwise zero the size every reader of the shared inode sees. (An entry's reader
        that reached a version rewritten since, its value gone, is sent the same way: its
        retry's private inode holds the version the name has then.)

        The redirect holds through every lookup of the retry (it may send two, and the name
        may be gone at the first and back at the second: a second ESTALE would reach the
        program) until the retry's open or create takes it, or REDIRECT_S pass: a retry
        that ended in ENOENT (no O_CREAT) sends neither, and this process's later lookups
        of the name must resolve as everyone's do."""
        now = time.monotonic()
        if len(self.writer_redirects) >= self.REDIRECTS_HELD:
            self.writer_redirects = {k: t for k, t in self.writer_redirects.items() if t > now}
        self.writer_redirects[(key, pid)] = now + self.REDIRECT_S
        raise Stale("redirecting a writer to a private inode")

    def redirected(self, key, pid: int) -> bool:
        """Whether the lookup of `key` by `pid` is the retry of a redirected writer."""
        deadline = self.writer_redirects.get((key, pid))
        return deadline is not None and deadline > time.monotonic()

    def take_redirect(self, key, pid: int) -> bool:
        """The redirected writer's open arrived (True if it had been redirected)."""
        deadline = self.writer_redirects.pop((key, pid), None)
        return deadline is not None and deadline > time.monotonic()

    # ----- the core tells us an entry changed or went away ---------------------------

    def _entry_changed(self, ring: Ring, old: EntryMeta, new: EntryMeta | None) -> None:
        """An entry was removed, renamed, given new attributes or rewritten. Its inode is
        one committed version (mount/nodes.py, EntryNode): a new content is a new inode,
        so the old one only loses its name; readers that have it keep reading it."""
        key = ("entry", ring.ns_id, old.key)
        ino = self.inodes.ino_of(key)
        if ino is None:
            return
        node = self.inodes.get(ino)
        if node.version is None:
            return  # a created entry not committed yet: not the version that changed
        parent = self.inodes.ino_of(("entries", ring.ns_id))
        if new is None or not old.same_content(new):  # removed, or rewritten: the name leaves this version
            self.inodes.unname(key)
            if self.invalidator and parent is not None:
                self.invalidator.entry(parent, old.key, ino if new is None else 0)
            return
        node.version = new
        if new.key != old.key:
            self.inodes.rekey(key, ("entry", ring.ns_id, new.key))
            node.name = new.key
        if self.invalidator and (new.mode != old.mode or new.uid != old.uid or new.gid != old.gid
                                 or new.mtime_ns != old.mtime_ns):
            self.invalidator.attributes(ino)

    # ----- helpers -------------------------------------------------------------------

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        attrs = node.attributes()
        self.inodes.looked_up(node.ino)
        return attrs

    def _open_handle(self, node: Node, handle: Handle, *, noflush: bool = False) -> pyfuse3.FileInfo:
        fh = next(self._fh)
        self._adopt(fh, node, handle)
        if noflush or handle.release_deferred:  # the library answers its RELEASE; we release it later
            interpose.release_free(fh, node.release_wakes)
        number = interpose.noflush(fh) if noflush else fh
        if handle.backing_id:  # the kernel reads its file itself (FUSE passthrough)
            number = interpose.passthrough_fh(number, handle.backing_id)
        handle.opened()  # (an entry's or a checkpoint's writer: the library's front takes its WRITEs)
        return pyfuse3.FileInfo(fh=number, direct_io=handle.direct_io,
                                keep_cache=handle.keep_cache, nonseekable=handle.nonseekable)

    def _adopt(self, fh: int, node: Node, handle: Handle) -> None:
        handle.fh = fh
        handle.node = handle.node or node
        self.handles[fh] = handle
        node.open_handles += 1
        node.opens += 1

    async def _handle(self, fh: int) -> Handle:
        handle = self.handles.get(fh)
        if handle is not None:
            return handle
        # An open the library's front answered (interpose.answer_opens) is opened here at
        # its first request that reaches Python.
        opened = interpose.adopt_opened(fh)
        if opened is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        ino, flags = opened
        node = self.inodes.get(ino)
        handle = await node.adopt(flags)
        self._adopt(fh, node, handle)
        return handle

    # ----- metadata ------------------------------------------------------------------

    @_translate
    async def lookup(self, parent_inode, name, ctx=None):
        # Handles the front released first: a batch file's process that closed one and
        # looks the name up again gets its own inode back, not a spare (DrawDir).
        await self.release_taken()
        parent = self.inodes.get(parent_inode)
        if name == b".":
            return self._entry(parent)
        node = await parent.lookup(name, ctx)
        attrs = self._entry(node)
        timeout = parent.name_timeout(node)  # at/I names another entry as the ring moves, say
        if timeout is not None:
            attrs.entry_timeout = timeout
        if getattr(node, "private", False):  # a writer's private inode: not what other processes find
            attrs.entry_timeout = 0
        return attrs

    async def forget(self, inode_list):
        self.requests["forget"] += 1
        self._take_created()  # (a created inode is counted looked up before it is forgotten)
        for ino, n in inode_list:
            try:
                self.inodes.forget(ino, n)
            except Exception:
                log.exception("forget %d failed", ino)

    @_translate
    async def getattr(self, inode, ctx=None):
        return self.inodes.get(inode).attributes(ctx)

    @_translate
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self.inodes.get(inode)
        handle = self.handles.get(fh) if fh is not None else None
        await node.setattr(attr, fields, handle, ctx)
        return node.attributes(ctx)

    @_translate
    async def statfs(self, ctx):
        s = self.store.statfs()
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        st.f_blocks = (s["used"] + s["free"]) // 4096
        st.f_bfree = st.f_bavail = s["free"] // 4096
        st.f_files = s["files"] + (1 << 20)
        st.f_ffree = st.f_favail = 1 << 20
        st.f_namemax = 255
        return st

    # ----- directories ---------------------------------------------------------------

    @_translate
    async def opendir(self, inode, ctx):
        node = self.inodes.get(inode)
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_translate
    async def readdir(self, fh, start_id, token):
        node = self.inodes.get(fh)
        self._listed_known(fh)
        listed = []
        for name, child, next_id in node.children(start_id):
            attrs = child.attributes()
            if not pyfuse3.readdir_reply(token, name, attrs, next_id):
                break
            self.inodes.looked_up(child.ino)
            if type(child).listed is not Node.listed:
                listed.append(child)
        if listed:  # (only directories whose nodes want to know: a dataset's items)
            self._listed[fh] = listed

    async def releasedir(self, fh):
        self.requests["releasedir"] += 1
        self._listed_known(fh)

    def _listed_known(self, fh: int) -> None:
        """Tell the nodes the last READDIRPLUS reply of directory `fh` listed that the kernel
        holds their inodes: it made them as the lister read the reply, before the lister's
        next request of the directory (or its close), which calls this."""
        for child in self._listed.pop(fh, ()):
            child.listed()

    @_translate
    async def fsyncdir(self, fh, datasync):
        await self.inodes.get(fh).fsyncdir()
        await self.store.sync()

    @_translate
    async def mkdir(self, parent_inode, name, mode, ctx):
        node = await self.inodes.get(parent_inode).mkdir(name, mode, ctx)
        return self._entry(node)

    @_translate
    async def rmdir(self, parent_inode, name, ctx):
        await self.inodes.get(parent_inode).rmdir(name)

    @_translate
    async def unlink(self, parent_inode, name, ctx):
        await self.inodes.get(parent_inode).unlink(name)

    @_translate
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        old_parent = self.inodes.get(parent_inode_old)
        new_parent = self.inodes.get(parent_inode_new)
        await old_parent.rename(name_old, new_parent, name_new, flags)

    @_translate
    async def symlink(self, parent_inode, name, target, ctx):
        node = await self.inodes.get(parent_inode).symlink(name, target, ctx)
        return self._entry(node)

    @_translate
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        raise OperationNotPermitted("special files (FIFOs, sockets, devices) are not supported")

    @_translate
    async def link(self, inode, new_parent_inode, new_name, ctx):
        raise OperationNotPermitted("hard links are not supported")

    @_translate
    async def readlink(self, inode, ctx):
        return self.inodes.get(inode).readlink()

    # ----- files ---------------------------------------------------------------------

    @_translate
    async def create(self, parent_inode, name, mode, flags, ctx):
        node, handle = await self.inodes.get(parent_inode).create(name, mode, flags, ctx)
        info = self._open_handle(node, handle)
        return info, self._entry(node)

    @_translate
    async def open(self, inode, flags, ctx):
        await self.release_taken()  # (likewise: DrawFile.open refuses an inode with a batch open)
        node = self.inodes.get(inode)
        handle = await node.open(flags, ctx)
        # A read-only open whose handle does nothing at flush needs no FLUSH request at
        # close (create() replies through another call, and a writer's flush commits).
        quiet = (flags & os.O_ACCMODE) == os.O_RDONLY and type(handle).flush is Handle.flush
        return self._open_handle(node, handle, noflush=quiet)

    @_translate
    async def read(self, fh, off, size):
        return await (await self._handle(fh)).read(off, size)

    @_translate
    async def write(self, fh, off, buf):
        handle = await self._handle(fh)
        if not handle.flush_tracked:
            return await handle.write(off, buf)
        interpose.flush_free(fh, False)
        n = await handle.write(off, buf)
        if handle.nothing_at_flush():
            interpose.flush_free(fh, True)  # its close's FLUSH is answered by the library
        return n

    @_translate
    async def flush(self, fh):
        handle = await self._handle(fh)
        await handle.flush()
        if handle.flush_tracked and handle.nothing_at_flush():
            interpose.flush_free(fh, True)  # the next close's FLUSH is answered by the library

    @_translate
    async def fsync(self, fh, datasync):
        handle = await self._handle(fh)
        await handle.flush()
        await self.store.sync()
        await handle.fsync()

    async def release(self, fh):
        await self.release_taken()
        await self._release(fh)

    async def release_taken(self) -> bool:
        """Release the handles whose RELEASE the library's front answered since the last
        call (mount/interpose.py release_free), and tell the nodes it opened itself. And
        commit the `priorities` writes it took. True: there was something of these."""
        took = self._take_created()
        took |= self._take_writes()
        took |= self._take_opened()
        took |= self._take_full_chunks()
        released = interpose.take_released()
        for fh in released:
            if fh not in self.handles:
                self._take_opened()  # opened (and closed) after the look above
            await self._release(fh)
        return took or bool(released)

    # Inode numbers the front holds for the creates it answers: topped up as it uses them, so
    # that a burst of creates between two requests of Python's finds numbers (past them, the
    # creates are Python's).
    CREATE_INODES = 128

    def fill_create_inodes(self) -> None:
        """Give the front inode numbers for its creates (the first directory whose creates it
        answers asks; then `_take_created` replaces those used)."""
        if not self._create_inodes:
            self._create_inodes = True
            interpose.create_inodes(self.inodes.reserve(self.CREATE_INODES))

    def _take_created(self) -> bool:
        """Make the inodes and writers of the entry creates the front answered (mount/
        interpose.py answer_creates), before any request that could name them."""
        created = interpose.take_created()
        if not created:
            return False
        interpose.create_inodes(self.inodes.reserve(len(created)))
        for parent_ino, name, ino, fh, flags, mode, uid, gid, pid in created:
            parent = self.inodes.get_or_none(parent_ino)
            if not isinstance(parent, EntriesDir):  # its buffer went meanwhile: the close fails (EBADF)
                interpose.take_collected(fh)
                log.warning("a create of %r answered in a directory that is gone", name)
                continue
            try:
                node, handle = parent.front_created(name, ino, flags, Owner(mode, uid, gid), pid)
            except Exception:  # a bug must fail that file, never the daemon
                interpose.take_collected(fh)
                log.exception("taking the create of %r failed", name)
                continue
            self._adopt(fh, node, handle)
            self.inodes.looked_up(node.ino)
        return True

    def _take_full_chunks(self) -> bool:
        """Chunks of checkpoint writers the library's front filled whole: the writers' to hold
        and persist, and to lend the front the next ones (mount/checkpoint_nodes.py)."""
        full = interpose.chunks_full()
        for fh, (index, data, filled) in full:
            handle = self.handles.get(fh)
            if handle is None or not handle.chunk_filled(index, data, filled):
                self.store.checkpoints.give_back(data)  # (its handle was stopped first: not reached)
        return bool(full)

    def _take_opened(self) -> bool:
        opened = interpose.take_opened()
        for ino, fh in opened:
            node = self.inodes.get_or_none(ino)
            if node is not None:
                handle = node.opened_by_front()
                if handle is not None:  # an `adopted` mark: the handle is ours from its open on
                    self._adopt(fh, node, handle)
        return bool(opened)

    # What the timer of take_front_notes adds to the notes' eventfd (the front adds 1 a note):
    # a read tells the two apart.
    NOTES_TICK = 1 << 32

    async def take_front_notes(self, every: float, idle: float) -> None:
        """`release_taken` every `every` seconds too: reads the front answers alone (a
        dataset's items, pushed ahead) send Python no request to take them with. And at
        once when the front says so (interpose.notes_fd): a learner's batch the front closed
        (its draw, opened by the front, is counted and the next one goes into the page cache
        while the learner trains).

        A look that finds nothing doubles the wait before the next, up to `idle` seconds: an
        idle mount's event loop woke ten times a second for this, each turn of it costing a
        few hundred microseconds of CPU on a busy machine's cold caches. Any request that
        reaches Python takes the notes first anyway, and the front's tables hold more than
        `idle` seconds of a reader's notes (past them its requests go to Python, which takes
        them).

        The timer is a task of its own that writes NOTES_TICK into the eventfd, so that the
        front's wake-ups (one a batch of a learner's loop) cost a wait for the fd alone, not
        a cancel scope and a deadline each."""
        BETWEEN_REQUESTS.set(True)  # (this task's own)
        fd = interpose.notes_fd()
        if fd < 0:
            wait = every
            while True:
                await trio.sleep(wait)
                took = await self.release_taken()
                wait = every if took else min(wait * 2, idle)
        self._notes_wait = every
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._tick_notes, fd)
            while True:
                await trio.lowlevel.wait_readable(fd)
                try:
                    count = int.from_bytes(os.read(fd, 8), sys.byteorder)
                except BlockingIOError:
                    continue
                woken = count % self.NOTES_TICK != 0  # (and the timer's ticks: count // NOTES_TICK)
                if woken:
                    self.notes_wakes += 1
                took = await self.release_taken()
                self._notes_wait = every if took or woken else min(self._notes_wait * 2, idle)

    async def _tick_notes(self, fd: int) -> None:
        """take_front_notes' timer: a tick into the notes' eventfd after each wait it sets
        (`_notes_wait`: back to its shortest after a look that found something, doubled
        after one that found nothing)."""
        while True:
            await trio.sleep(self._notes_wait)
            try:
                os.write(fd, self.NOTES_TICK.to_bytes(8, sys.byteorder))
            except BlockingIOError:  # (the count is full: the fd is readable anyway)
                pass

    async def _release(self, fh: int) -> None:
        self.requests["release"] += 1
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        if handle.flush_tracked:
            interpose.flush_free(fh, False)  # the number goes to the next open
        node = handle.node
        try:
            await handle.release()
        except DistorefsError as exc:
            log.warning("commit at release of %r failed: %s", getattr(node, "name", node), exc)
        except Exception:
            log.exception("release failed")
        if isinstance(node, EntryNode) and isinstance(handle, EntryWriter):
            node.writer_closed(handle)
        if node is not None:
            node.open_handles -= 1
            node.released(handle)
            self.inodes.released(node)

    # ----- extended attributes -------------------------------------------------------

    @_translate
    async def getxattr(self, inode, name, ctx):
        if not name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(errno.ENODATA)
        if name == WARM_XATTR:  # not listed: reading it loads the file's values (distorefs warmup)
            value = await self.inodes.get(inode).warm()
        else:
            value = (await self.inodes.get(inode).read_xattrs()).get(name[len(XATTR_PREFIX):])
        if value is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value

    @_translate
    async def listxattr(self, inode, ctx):
        return [XATTR_PREFIX + k for k in await self.inodes.get(inode).read_xattrs()]

    @_translate
    async def setxattr(self, inode, name, value, ctx):
        if not name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        await self.inodes.get(inode).setxattr(name[len(XATTR_PREFIX):], value, ctx)

    @_translate
    async def removexattr(self, inode, name, ctx):
        if not name.startswith(XATTR_PREFIX):
            raise pyfuse3.FUSEError(errno.ENODATA)
        raise pyfuse3.FUSEError(errno.EACCES)


__all__ = ["Filesystem", "NotFound"]

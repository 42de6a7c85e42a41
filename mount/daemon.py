"""The mount daemon: opens a store, mounts it with pyfuse3 and serves until unmounted.

Shutdown (fusermount3 -u, SIGTERM, SIGINT): pyfuse3's loop ends, the store drains its
commit queue and syncs, and the store lock is released. The parent that spawned a
background daemon learns readiness (or the error) through a pipe.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable

import pyfuse3
import trio

from distorefs.clusterlog import ClusterSpec
from distorefs.store import Store

from . import cycles, interpose
from .metrics_http import serve_metrics
from .operations import Filesystem

log = logging.getLogger(__name__)
# How often the front's notes (handles it released, items it opened) are taken when no request
# reaches Python to take them with: a reader's prefetch hits are counted that late at most, or
# FRONT_NOTES_IDLE_S late after a quiet spell (the wait grows to it while nothing is found).
FRONT_NOTES_S = 0.1
FRONT_NOTES_IDLE_S = 0.5
# The daemon trims its heap every TRIM_S while it serves, every TRIM_S * TRIM_IDLE_TICKS idle.
TRIM_S = 2.0
TRIM_IDLE_TICKS = 8


class _Glibc:
    """Keeps the daemon's resident memory to what it holds. glibc's mmap threshold rises
    with every large block freed (up to 32 MiB), after which values of a few hundred KB
    come from the heap arenas of our worker threads; values that come and go there leave
    freed pages resident, and resident memory would grow past memory_bytes with what was
    merely read. So: fixed thresholds, few arenas, and the freed pages of every arena given
    back each few seconds (malloc_trim). Elsewhere than glibc this does nothing.

    The mmap threshold is above a request's largest buffer (a 1 MiB WRITE's bytes, a 1 MiB
    READ's reply), and the heap keeps up to TRIM_THRESHOLD free at its top between those
    trims: a request's megabyte is then the one the request before freed, where a mapping
    of its own (or a heap trimmed at every free) was memory touched for the first time,
    256 page faults, which cost a 2 GiB checkpoint's writes 1.2 s of the event loop."""

    MMAP_THRESHOLD = 4 << 20
    TRIM_THRESHOLD = 16 << 20

    def __init__(self) -> None:
        import ctypes
        import ctypes.util
        try:
            self.libc: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            self.libc.mallopt(-3, self.MMAP_THRESHOLD)  # M_MMAP_THRESHOLD: fixed, not dynamic
            self.libc.mallopt(-1, self.TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
            self.libc.mallopt(-8, 4)  # M_ARENA_MAX
            self.libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            log.debug("not glibc: resident memory may hold freed blocks")
            self.libc = None

    async def trim_every(self, seconds: float, activity: Callable[[], int]) -> None:
        """Trim each `seconds` while `activity()` (requests served, groups committed) moves,
        and each TRIM_IDLE_TICKS ticks while it does not: a trim walks every arena and gives
        back each free page again (madvise), in a worker thread, which an idle daemon paid
        every two seconds for nothing. The idle trims give back what a task freed later
        than a request (a checkpoint pool's buffers, a prefetch dropped)."""
        trimmed_at, idle = None, 0
        while self.libc is not None:
            await trio.sleep(seconds)
            seen = activity()
            idle += 1
            if seen != trimmed_at or idle >= TRIM_IDLE_TICKS:
                trimmed_at, idle = seen, 0
                await trio.to_thread.run_sync(self.libc.malloc_trim, 0)


async def _read_ahead_after_init(mountpoint: str, kb: int) -> None:
    """The kernel sets the mount's read-ahead from the INIT reply (libfuse asks for
    128 KiB), which the serving loop sends first: set ours once that is done."""
    await trio.sleep(0.5)
    await trio.to_thread.run_sync(_set_read_ahead, mountpoint, kb)


def _set_read_ahead(mountpoint: str, kb: int) -> None:
    """Set the kernel's read-ahead for this mount (its bdi, root only). At 128 KiB every
    sequential read of a file arrives as 128 KiB READ requests; with a few MiB they are
    1 MiB each (the kernel's largest), an eighth of the requests per byte. The device
    number comes from mountinfo: a stat of the mount point would ask us."""
    path = os.path.abspath(mountpoint)  # realpath would stat the mount point itself: us
    target = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if parts[4].replace("\\040", " ") == target:
                    dev = parts[2]
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(f"{kb}\n")
    except (OSError, UnboundLocalError, IndexError) as exc:
        log.info("read-ahead of %s left at the kernel's default: %s", mountpoint, exc)


def serve(store_path: str, mountpoint: str, *, nvme_dirs: list | None = None, allow_other: bool = False,
          config: dict | None = None, ready_fd: int | None = None, debug_fuse: bool = False,
          read_only: bool = False, metrics_addr: tuple[str, int] | None = None,
          cluster: ClusterSpec | None = None) -> None:
    """Mount `store_path` at `mountpoint` and serve until unmounted (blocking). `read_only`:
    the store is opened read-only (distorefs/store.py) and mounted `ro` (the kernel refuses
    every change with EROFS before it reaches us). `metrics_addr`: (host, port) to serve
    GET /metrics on (mount/metrics_http.py). `cluster`: the shared store on a Redis Cluster
    this node joins (distorefs/clusterlog.py)."""
    glibc = _Glibc()
    try:
        store = Store(store_path, nvme_dirs=nvme_dirs, config=config, read_only=read_only, cluster=cluster)
    except Exception as exc:
        log.error("cannot open the store: %s", exc)
        _report(ready_fd, f"error: {exc}")
        raise
    fs = Filesystem(store)
    fs.collector = cycles.tune()  # what exists now lives as long as the daemon
    interpose.log_state()
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    options |= {f"fsname={store.path}", "subtype=distorefs"}
    if allow_other:
        options.add("allow_other")
    if read_only:
        options.add("ro")
    if debug_fuse:
        options.add("debug")
    try:
        pyfuse3.init(fs, mountpoint, options)
    except Exception as exc:
        store.close()
        _report(ready_fd, f"error: cannot mount {mountpoint}: {exc}")
        raise
    log.info("mounted %s at %s (pid %d)", store.path, mountpoint, os.getpid())
    unmounted = False
    try:
        # By signal, pyfuse3 stops serving but the kernel mount is still there.
        unmounted = not trio.run(_run, store, fs, ready_fd, mountpoint, glibc, metrics_addr)
    finally:
        pyfuse3.close(unmount=not unmounted)
        store.close()
        log.info("unmounted %s", mountpoint)


async def _run(store: Store, fs: Filesystem, ready_fd: int | None, mountpoint: str, glibc: _Glibc,
               metrics_addr: tuple[str, int] | None = None) -> bool:
    """Serve until the mount ends; True if it ended by a signal rather than an unmount."""
    signalled: list[int] = []
    _unnamed_worker_threads()  # before the store's tasks hand anything to a thread
    async with store.running():
        fs.start_notifications(mountpoint)
        fs.start_priority_log()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signal, signalled, fs)
                nursery.start_soon(_read_ahead_after_init, mountpoint, store.config.read_ahead_kb)
                nursery.start_soon(glibc.trim_every, TRIM_S, lambda: fs.requests.total() + store.committer.groups)
                nursery.start_soon(fs.take_front_notes, FRONT_NOTES_S, FRONT_NOTES_IDLE_S)
                if metrics_addr is not None:
                    try:
                        await nursery.start(serve_metrics, fs, *metrics_addr)
                    except OSError as exc:
                        log.error("cannot serve metrics at %s:%d: %s", *metrics_addr, exc)
                        _report(ready_fd, f"error: cannot serve metrics at {metrics_addr[0]}:{metrics_addr[1]}: {exc}")
                        raise
                _report(ready_fd, "ready")
                interpose.take_queued_without_waiting()
                await pyfuse3.main(min_tasks=4, max_tasks=64)
                fs.stop_priority_log()
                await fs.release_taken()  # RELEASEs the front answered last (a commit at release)
                nursery.cancel_scope.cancel()
        finally:
            fs.stop_notifications()
    return bool(signalled)


def _unnamed_worker_threads() -> None:
    """trio names a worker thread after the task of each call it runs, and back after it:
    pthread_setname_np through ctypes, which lets go of the GIL around each call, so every
    hand-off to a thread (a directory listing, a lookup, a prefetched batch of a cold epoch)
    waited for the GIL twice more. The daemon's worker threads go unnamed instead (their
    `threading` names still say the task). A cold epoch with 4 readers, in turns: 10,275 /
    10,318 items/s against 9,500 / 7,605, 86 µs of daemon CPU an item against 94-116."""
    try:
        from trio._core import _thread_cache
    except ImportError:  # another trio: its threads as it makes them
        return
    if hasattr(_thread_cache, "set_os_thread_name"):
        setattr(_thread_cache, "set_os_thread_name", None)


async def _stop_on_signal(signalled: list[int], fs: Filesystem) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            signalled.append(signum)
            # the daemon's own listings of the mount end first, answered by this loop:
            # their open directories would keep the unmount below from happening
            await trio.to_thread.run_sync(fs.stop_listing)
            pyfuse3.terminate()
            return


def _report(fd: int | None, message: str) -> None:
    if fd is None:
        return
    try:
        os.write(fd, message.encode() + b"\n")
        os.close(fd)
    except OSError:
        pass

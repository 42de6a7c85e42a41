"""Threads of their own for work handed over from the event loop: the committer's
transactions (one lane of one thread: one call at a time, in order) and value reads (a lane
of a few threads: that many calls at once).

`await lane.run(fn)` runs `fn()` in one of the lane's threads and returns its result (or
raises its error) in the caller's task. A hand-off is a queue put, one wake-up each way and a
reschedule: trio.to_thread.run_sync also names the OS thread twice per call (ctypes),
copies the context and takes a capacity limiter, which is twice the CPU of the round trip
itself here (63 against 29 µs, `to_thread.run_sync` of nothing against this). The
committer hands one transaction over per group, and a learner's `priorities` write or an
actor's insert each waits for one.

Like `trio.to_thread.run_sync` without `abandon_on_cancel`, the wait cannot be cancelled:
the work is under way and its result is awaited. The thread ends after IDLE_S without work
and starts again at the next call, so a store that is closed leaves no thread behind for
long.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, TypeVar

import outcome
import trio

T = TypeVar("T")

IDLE_S = 10.0


class Lane:
    def __init__(self, name: str, threads: int = 1) -> None:
        """`threads`: how many calls may run at once (1: one after another, in order)."""
        if threads < 1:
            raise ValueError(f"a lane needs at least one thread, not {threads}")
        self.name = name
        self.threads = threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._alive = 0  # threads that take jobs (or are about to look once more)
        self._idle = 0  # of them, waiting for a job

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` in a thread of the lane, once the calls handed over before it started."""
        job = (fn, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task())
        # Put and counted without the lock: the event loop never waits for a lane thread the
        # OS preempted inside its bookkeeping (on a busy machine, for a whole time slice,
        # with every request the loop serves). A thread that ends looks at the queue again
        # once it counted itself out, so a job put as it ends is never left behind.
        self._jobs.put(job)
        if self._alive < self.threads and self._jobs.qsize() > self._idle:
            self._start()  # a thread more only when the waiting jobs outnumber the idle threads
        return await trio.lowlevel.wait_task_rescheduled(_uncancellable)

    def _start(self) -> None:
        with self._lock:
            if self._alive < self.threads and self._jobs.qsize() > self._idle:
                self._alive += 1
                threading.Thread(target=self._serve, name=self.name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                fn, token, task = self._jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    self._alive -= 1
                # Counted out, then a last look: a caller that put a job before this saw
                # the thread alive and started none, so it is taken here (unless a thread
                # started since, which takes it).
                if self._jobs.empty():
                    return
                with self._lock:
                    if self._alive >= self.threads:
                        return
                    self._alive += 1
                continue
            with self._lock:
                self._idle -= 1
            result: Any = outcome.capture(fn)
            del fn
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the run ended meanwhile: nobody waits any more
                pass


def _uncancellable(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


__all__ = ["Lane", "IDLE_S"]

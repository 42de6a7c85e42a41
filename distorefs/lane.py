"""A thread of its own for work that runs one call at a time (the committer's transactions).

`await lane.run(fn)` runs `fn()` in the lane's thread and returns its result (or raises its
error) in the caller's task. A hand-off is a queue put, one wake-up each way and a
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
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._alive = False  # a thread takes jobs (or is about to look once more)

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` in the lane's thread, after the calls handed over before it."""
        job = (fn, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task())
        with self._lock:
            self._jobs.put(job)
            if not self._alive:
                self._alive = True
                threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        return await trio.lowlevel.wait_task_rescheduled(_uncancellable)

    def _serve(self) -> None:
        while True:
            try:
                fn, token, task = self._jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:  # a job put after the timeout is taken, not left behind
                    if self._jobs.empty():
                        self._alive = False
                        return
                continue
            result: Any = outcome.capture(fn)
            del fn
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # the run ended meanwhile: nobody waits any more
                pass


def _uncancellable(raise_cancel: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


__all__ = ["Lane", "IDLE_S"]

"""Bounded waits: no wait a request makes in the daemon is unbounded.

pyfuse3 delivers no FUSE interrupts, and once a request has reached the daemon the kernel
waits for its answer even through SIGKILL (the caller sits in D state). So a request that
waits (for `min_size_to_sample` entries, for a weights version) wakes every `TICK` seconds
and asks `abandoned()` whether its caller still wants the answer; when it does not (the
process is gone or exiting, or has a signal pending that it can take: SIGKILL, or a
handled signal such as Python's SIGINT) the wait ends with Interrupted (EINTR), so the
kernel lets the signal be delivered. A live caller with no signal pending keeps waiting:
it never sees a spurious EINTR. The core knows nothing of processes: the FUSE layer
passes `abandoned` (distorefs/mount/callers.py).
"""

from __future__ import annotations

import errno
from typing import Callable

import trio

from .errors import Interrupted

TICK = 0.5  # seconds between two looks at the caller

Abandoned = Callable[[], bool]


class Outcome:
    """Work going on elsewhere (a commit, a publish): `wait()` returns once it is done,
    or raises its error.

    `then(fn)` asks to be told as soon as it is known: fn(0), or fn(errno) of its error.
    Whoever does the work may tell before `done` is set, from its own thread (`tell`):
    the committer tells from its thread once the transaction committed, before the change
    is applied on the event loop. A closing writer that waits in the libfuse library's
    thread (mount/interpose.py flush_pending) is answered one thread hand-off sooner."""

    __slots__ = ("done", "error", "_told")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None
        self._told: Callable[[int], None] | None = None

    async def wait(self) -> None:
        await self.done.wait()
        if self.error is not None:
            raise self.error

    def then(self, fn: Callable[[int], None]) -> None:
        """fn(errno or 0) once the outcome is known (now, if it is), exactly once. Ask on the
        event loop before the work can have started (as the work is queued): a worker's
        `tell` running meanwhile could miss it."""
        if self.done.is_set():
            fn(_errno_of(self.error))
        else:
            self._told = fn

    def tell(self, error: BaseException | None = None) -> None:
        """The outcome is known (the worker's thread may call this once, before `finish`)."""
        fn, self._told = self._told, None
        if fn is not None:
            fn(_errno_of(error))

    def finish(self, error: BaseException | None = None) -> None:
        """(event loop) Done: waiters wake; whoever asked `then` is told, unless told already."""
        self.error = error
        self.done.set()
        self.tell(error)


def _errno_of(error: BaseException | None) -> int:
    if error is None:
        return 0
    return getattr(error, "errno", None) or errno.EIO


async def wait_event(event: trio.Event, abandoned: Abandoned | None, what: str) -> None:
    """Wait for `event`, or for at most TICK seconds (the caller re-checks its condition
    and waits again); Interrupted if the caller gave up meanwhile."""
    with trio.move_on_after(TICK):
        await event.wait()
        return
    if abandoned is not None and abandoned():
        raise Interrupted(f"{what}: the caller was interrupted while waiting")


__all__ = ["TICK", "Abandoned", "wait_event"]

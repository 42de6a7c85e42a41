"""The sample-to-insert rate limiter of one replay buffer (Reverb's SampleToInsertRatio).

Owns the limiter's arithmetic, its counters, the bounded waits of both sides and what
`stats.json` shows of it. It knows nothing of files or of the ring: the buffer
(distorefs/buffer.py) asks it before an insert and before a draw, and tells it of inserts
committed, of its size changing and of a new configuration.

With samples_per_insert r, error_buffer e and min_size_to_sample m the limiter keeps the
error `inserts * r - samples` within [m*r - e, m*r + e]: an operation that would take it
out waits (or, nonblocking, fails with WouldBlock). While the buffer holds fewer than m
entries inserts never wait (and samples wait for m entries anyway), so a buffer filled
from empty reaches m entries with the error at m*r, the middle of the range.

What counts:
- an insert is a new entry committed (a rewrite of an entry is none). An insert is
  admitted before its data is taken - the FUSE layer at the create of `entries/KEY`
  (O_NONBLOCK) or at the writer's first write() or close(), the client session when an
  insert arrives - because a commit at close() or behind a pipelined write cannot
  usefully say "not now", and data written must never be lost.
  An admitted insert holds an InsertTicket until it commits or fails; tickets count
  against the insert side, so that actors creating entries together cannot overshoot.
- a sample is an entry handed out: a batch of N counts N (as Reverb counts items). A
  batch larger than the room in the range takes that room and waits for the rest
  (Reverb's flexible batches do the same), so no batch size can block both sides for
  good; what a draw does not hand out (interrupted, fewer entries drawn, drawn again)
  is given back.

Counting starts when the limiter is configured and again at each daemon start or change of
r, e or m: the entries already held then count as min(size, m) inserts and no samples, so
the limiter starts in the middle of its range (Reverb likewise starts over with a new
table; its counts are not kept across restarts here). Waits are those of
distorefs/waiting.py: a caller that is killed or interrupted ends its wait within a tick.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import trio

from .errors import WouldBlock
from .waiting import Abandoned, wait_event

EPSILON = 1e-9  # r is a float: 10 inserts at r = 0.1 make 1.0000000000000002 samples of room


@dataclass(frozen=True)
class Ratio:
    """The limiter's settings; its range is `min_error`..`max_error`."""

    samples_per_insert: float
    error_buffer: float
    min_size: int

    @property
    def min_error(self) -> float:
        return self.min_size * self.samples_per_insert - self.error_buffer

    @property
    def max_error(self) -> float:
        return self.min_size * self.samples_per_insert + self.error_buffer

    @classmethod
    def of(cls, samples_per_insert: float | None, error_buffer: float | None, min_size: int) -> "Ratio | None":
        """The settings of a buffer's configuration; None when it has no limiter (the
        configuration is validated: error_buffer is set whenever samples_per_insert is)."""
        if not samples_per_insert:
            return None
        return cls(float(samples_per_insert), float(error_buffer or 0.0), int(min_size))


class InsertTicket:
    """An admitted insert not committed yet; `release` once it committed or failed (again
    is harmless)."""

    __slots__ = ("_limiter",)

    def __init__(self, limiter: "RateLimiter") -> None:
        self._limiter: RateLimiter | None = limiter

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._release_insert()


class SampleClaim:
    """Samples a draw counted; `give_back(k)` for k of them it did not hand out."""

    __slots__ = ("_limiter", "_epoch", "count")

    def __init__(self, limiter: "RateLimiter | None", epoch: int, count: int) -> None:
        self._limiter = limiter
        self._epoch = epoch
        self.count = count

    def give_back(self, k: int | None = None) -> None:
        """Uncount `k` samples (all that are left when None)."""
        k = self.count if k is None else min(k, self.count)
        if k <= 0:
            return
        self.count -= k
        limiter = self._limiter
        if limiter is not None and limiter._epoch == self._epoch:  # counting started over since: nothing to undo
            limiter._return_samples(k)


NO_CLAIM = SampleClaim(None, 0, 0)


class RateLimiter:
    def __init__(self, name: str, size: Callable[[], int], ratio: Ratio | None = None) -> None:
        """The limiter of buffer `name`; `size()` is how many entries the buffer holds."""
        self.name = name
        self.size = size
        self.ratio: Ratio | None = None
        self.inserts = 0
        self.samples = 0
        self.admitted = 0  # inserts admitted and not committed yet (tickets held)
        self._epoch = 0
        self._changed = trio.Event()
        self._waiting = {"insert": 0, "sample": 0}
        # per side, over the daemon's life: calls that waited, seconds waited, WouldBlock
        self.totals = {side: {"waits": 0, "wait_seconds": 0.0, "eagain": 0} for side in ("insert", "sample")}
        self.configure(ratio)

    @property
    def enabled(self) -> bool:
        return self.ratio is not None

    # ----- what the buffer tells it ----------------------------------------------------------

    def configure(self, ratio: Ratio | None) -> None:
        """New settings: counting starts over (see the module docstring) if they changed;
        waiters look again either way."""
        if ratio != self.ratio:
            self.ratio = ratio
            self.restart()
        self.wake()

    def restart(self) -> None:
        """Count from now, the entries held counting as min(size, min_size) inserts: the
        middle of the range (at a daemon start, a reconfiguration)."""
        self._epoch += 1
        self.samples = 0
        self.inserts = min(self.size(), self.ratio.min_size) if self.ratio is not None else 0
        self.wake()

    def inserted(self) -> None:
        """A new entry was committed."""
        if self.ratio is not None:
            self.inserts += 1
            self.wake()

    def wake(self) -> None:
        """Something a waiter depends on changed (the buffer's size, the counts)."""
        if self._waiting["insert"] or self._waiting["sample"]:  # a fresh Event per insert would cost at load
            self._changed.set()
            self._changed = trio.Event()

    # ----- the two sides ---------------------------------------------------------------------

    def error(self) -> float:
        """inserts * samples_per_insert - samples (0 without a limiter)."""
        return self.inserts * self.ratio.samples_per_insert - self.samples if self.ratio is not None else 0.0

    def insert_allowed(self) -> bool:
        ratio = self.ratio
        if ratio is None:
            return True
        if self.size() + self.admitted < ratio.min_size:
            return True  # below min_size_to_sample inserts never wait
        after = (self.inserts + self.admitted + 1) * ratio.samples_per_insert - self.samples
        return after <= ratio.max_error + EPSILON

    def sample_room(self) -> int:
        """How many samples may be taken now."""
        ratio = self.ratio
        if ratio is None:
            return 1 << 62
        if self.size() < ratio.min_size:
            return 0
        return max(0, math.floor(self.error() - ratio.min_error + EPSILON))

    async def admit_insert(self, nonblocking: bool = False, abandoned: Abandoned | None = None
                           ) -> InsertTicket | None:
        """Wait until one more insert is allowed and admit it (a ticket to release once it
        committed or failed); None without a limiter. WouldBlock if `nonblocking` and it
        would wait; Interrupted if `abandoned()` says the caller gave up."""
        if self.ratio is None:
            return None
        if not self.insert_allowed():
            if nonblocking:
                self.totals["insert"]["eagain"] += 1
                raise WouldBlock(f"buffers/{self.name}: the rate limiter holds inserts back: "
                                 f"{self._state()}, one more insert would pass {self.ratio.max_error:g}")
            await self._wait("insert", self.insert_allowed, abandoned)
        self.admitted += 1
        return InsertTicket(self)

    async def admit_sample(self, n: int, nonblocking: bool = False, abandoned: Abandoned | None = None
                           ) -> SampleClaim:
        """Count n samples once the limiter allows them: what the range has room for is
        taken at once and the rest waited for. Nonblocking, all n or WouldBlock. What is
        counted is given back if the wait ends otherwise (WouldBlock, Interrupted)."""
        if self.ratio is None:
            return NO_CLAIM
        room = self.sample_room()
        if room >= n:
            return self._claim(n)
        if nonblocking:
            self.totals["sample"]["eagain"] += 1
            raise WouldBlock(f"buffers/{self.name}: the rate limiter holds samples back: "
                             f"{self._state()}, a batch of {n} would pass {self.ratio.min_error:g}")
        claims: list[SampleClaim] = []

        def taken() -> int:
            return sum(c.count for c in claims if c._epoch == self._epoch)  # a restart forgets what was counted

        def ready() -> bool:  # takes what room there is each time it is asked
            if self.ratio is None:
                return True  # the limiter was switched off: the rest are not counted
            take = min(n - taken(), self.sample_room())
            if take > 0:
                claims.append(self._claim(take))
            return taken() >= n

        try:
            await self._wait("sample", ready, abandoned)
        except BaseException:
            for claim in claims:
                claim.give_back()
            raise
        return SampleClaim(self, self._epoch, taken())

    def _claim(self, k: int) -> SampleClaim:
        self.samples += k
        self.wake()  # inserts waiting for samples may go
        return SampleClaim(self, self._epoch, k)

    def _return_samples(self, k: int) -> None:
        self.samples -= k
        self.wake()

    def _release_insert(self) -> None:
        self.admitted -= 1
        self.wake()

    async def _wait(self, side: str, ready: Callable[[], bool], abandoned: Abandoned | None) -> None:
        """Wait until `ready()`, one tick at a time (distorefs/waiting.py), timing it."""
        totals = self.totals[side]
        totals["waits"] += 1
        self._waiting[side] += 1
        try:
            while not ready():
                started = trio.current_time()
                try:
                    await wait_event(self._changed, abandoned, f"buffers/{self.name}: rate limiter ({side})")
                finally:
                    totals["wait_seconds"] += trio.current_time() - started
        finally:
            self._waiting[side] -= 1

    def _state(self) -> str:
        return f"{self.inserts} inserts (+{self.admitted} admitted), {self.samples} samples, error {self.error():g}"

    # ----- reporting -------------------------------------------------------------------------

    def stats(self) -> dict | None:
        """The limiter in stats.json (None without one): settings, counts since counting
        started, the observed samples per insert, and per side the calls that waited, the
        seconds they waited, the calls refused with EAGAIN and those waiting now."""
        ratio = self.ratio
        if ratio is None:
            return None
        return {
            "samples_per_insert": ratio.samples_per_insert,
            "error_buffer": ratio.error_buffer,
            "inserts": self.inserts,
            "samples": self.samples,
            "ratio": round(self.samples / self.inserts, 4) if self.inserts else None,
            "error": round(self.error(), 6),
            "min_error": ratio.min_error,
            "max_error": ratio.max_error,
            "admitted_inserts": self.admitted,
            **{side: {**{k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()},
                      "waiting": self._waiting[side]} for side, t in self.totals.items()},
        }


__all__ = ["Ratio", "RateLimiter", "InsertTicket", "SampleClaim", "NO_CLAIM"]

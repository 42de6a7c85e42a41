"""Automatic recovery at open: a store its last holder did not close cleanly is checked and
repaired before it is used, or not opened at all.

`Store` takes the store's lock (distorefs/lockfile.py); a lock file found non-empty
means the previous daemon or verify was killed (or failed, or lost power) with the store
open. Then, before the Store opens LMDB itself, `recover` runs verify's passes with
repair on the locked store: every pass but `values`, which re-reads every stored value
(each value is checked against its checksum whenever it is read anyway, and a bad one
fails only its own reads with EIO). Repairs are verify's safe ones (dangling index rows
deleted, counters and segment accounting rewritten from the references, unreferenced
space freed). If an inconsistency is left that the mount cannot live with
(`Report.blocking`), the open fails with RecoveryFailed and the lock stays marked, so the
next attempt recovers again; `distorefs verify --repair STORE` shows the details.

What recovery did is kept as a `Recovery` and shown under "recovery" in the store's stats.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import RecoveryFailed
from .lockfile import StoreLock
from .verify import SPACE, Report, run_passes

log = logging.getLogger(__name__)

# Passes recovery leaves out: `values` reads every stored value back (minutes on a large
# store) and finds nothing a read would not (every read checks its value's checksum).
SKIPPED_PASSES = ("values",)
SHOWN_FINDINGS = 10  # findings listed in the stats (all are counted)


@dataclass
class Recovery:
    """What recovery at open did (`ran` False: the store had been closed cleanly)."""

    ran: bool = False
    previous_holder: str = ""  # what the lock file said: who did not close the store
    passes: list[str] = field(default_factory=list)
    problems: int = 0  # errors and leaks found
    repaired: int = 0
    unrepaired: int = 0
    blocking: int = 0  # unrepaired inconsistencies (the open then fails)
    reclaimed_bytes: int = 0  # dead space (segment files of lost transactions) freed
    seconds: float = 0.0
    findings: list[str] = field(default_factory=list)  # the first SHOWN_FINDINGS, one line each

    def as_dict(self) -> dict:
        return asdict(self)


def recover(path: Path, lock: StoreLock) -> Recovery:
    """Check and repair the locked store at `path` if its last holder did not close it cleanly.

    Raises RecoveryFailed if inconsistencies remain; the caller must not open the store then.
    """
    if lock.was_clean:
        return Recovery()
    if not (path / "meta" / "data.mdb").is_file():
        return Recovery(previous_holder=lock.previous)  # nothing was stored yet: nothing to check
    t0 = time.monotonic()
    report = run_passes(path, repair=True, skip=SKIPPED_PASSES)
    result = _summary(report, lock.previous, time.monotonic() - t0)
    if report.damaged:
        raise RecoveryFailed(
            f"store {path} was not closed cleanly ({lock.previous}) and its LMDB file is damaged "
            f"({report.damaged}): nothing was changed; `distorefs verify {path}` lists what is readable, "
            f"and `distorefs mount --read-only` serves it")
    if report.blocking:
        first = report.blocking[0]
        raise RecoveryFailed(
            f"store {path} was not closed cleanly ({lock.previous}); recovery found {result.problems} problems "
            f"and could not repair {result.blocking} (e.g. {first.check}: {first.message}), so it is not "
            f"opened: run `distorefs verify --repair {path}` for details (`distorefs mount --read-only` serves "
            f"what can be read without changing it)")
    left = f"{result.unrepaired} left (leaks or unreadable values)" if result.unrepaired else "none left"
    log.warning("store %s was not closed cleanly (%s): recovered in %.2f s: %d passes, %d problems found, "
                "%d repaired, %s%s", path, lock.previous, result.seconds, len(result.passes), result.problems,
                result.repaired, left,
                f", {result.reclaimed_bytes} bytes of dead space freed" if result.reclaimed_bytes else "")
    for line in result.findings:
        log.warning("recovery: %s", line)
    return result


def _summary(report: Report, previous: str, seconds: float) -> Recovery:
    shown = [f"{f.check}: {f.kind}: {f.message}" + (f" [repaired: {f.repair}]" if f.repair else "")
             for f in report.problems[:SHOWN_FINDINGS]]
    return Recovery(
        ran=True, previous_holder=previous, passes=list(report.passes),
        problems=len(report.problems), repaired=len(report.problems) - len(report.unrepaired),
        unrepaired=len(report.unrepaired), blocking=len(report.blocking),
        reclaimed_bytes=sum(f.bytes for f in report.findings if f.kind == SPACE and f.repair),
        seconds=round(seconds, 3), findings=shown)


__all__ = ["Recovery", "recover", "SKIPPED_PASSES"]

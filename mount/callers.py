"""The processes behind FUSE requests: whether a caller still wants the answer it waits for.

A FUSE request carries the pid of the calling thread. The kernel never interrupts a request
the daemon holds (pyfuse3 ignores FUSE_INTERRUPT), so a waiting request asks `abandoned`
(distorefs/waiting.py) now and then; it reads the caller's /proc status: gone, a zombie or
dead, SIGKILL pending, or any pending signal it neither blocks nor ignores (a handler
that cannot run while the request holds the thread, such as Python's KeyboardInterrupt).
"""

from __future__ import annotations

import signal
from typing import Callable

_SIGKILL = 1 << (signal.SIGKILL - 1)


def caller_abandoned(pid: int) -> bool:
    """Whether the process (thread) `pid` no longer waits for its request's answer."""
    if pid <= 0:
        return False  # unknown caller (a test calling the core): never cut short
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        if fields.get("State", "").strip()[:1] in ("Z", "X"):
            return True
        pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
        blocked, ignored = int(fields["SigBlk"], 16), int(fields["SigIgn"], 16)
    except (KeyError, ValueError):
        return False
    return bool(pending & _SIGKILL) or bool(pending & ~blocked & ~ignored)


def process_of(tid: int) -> int:
    """The process (thread group) of the thread a FUSE request names."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def lineage(pid: int) -> frozenset[int]:
    """Process `pid` and its ancestors below init: the processes that may have declared an
    order on behalf of a reader (a DataLoader worker's parent, say)."""
    out = set()
    for _ in range(64):  # (a deeper tree is not a loader's)
        if pid <= 1 or pid in out:
            break
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return frozenset(out)


def process_gone(pid: int) -> bool:
    """Whether process `pid` has exited (or is exiting: a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def abandoned_by(pid: int) -> Callable[[], bool]:
    return lambda: caller_abandoned(pid)


__all__ = ["caller_abandoned", "abandoned_by", "lineage", "process_of", "process_gone"]

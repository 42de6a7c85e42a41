"""One log line per refused request: bad input gets its errno and a reason in daemon.log.

Requests refused for what they asked (an invalid name, config, priority, argument; an
entry too large) are logged at INFO with the handler and the reason, at most
`PER_SECOND` lines a second (a hostile client must not fill the disk with the log);
what was held back is counted in the next line.
"""

from __future__ import annotations

import logging
import time

from distorefs.errors import InvalidArgument, InvalidConfig, InvalidName, Interrupted, TooLarge

log = logging.getLogger("distorefs.badinput")

BAD_INPUT = (InvalidArgument, InvalidConfig, InvalidName, TooLarge, Interrupted)
PER_SECOND = 20


class _BadInputLog:
    def __init__(self) -> None:
        self.second = 0
        self.lines = 0
        self.held = 0

    def note(self, request: str, exc: Exception) -> None:
        now = int(time.monotonic())
        if now != self.second:
            self.second, self.lines = now, 0
        if self.lines >= PER_SECOND:
            self.held += 1
            return
        self.lines += 1
        more = f" ({self.held} more not logged)" if self.held else ""
        self.held = 0
        log.info("refused %s: %s%s", request, exc, more)


bad_input_log = _BadInputLog()

__all__ = ["BAD_INPUT", "bad_input_log"]

"""What `distorefs stage` writes to a dataset's `.stage` file, and how the daemon cuts it
into requests (Dataset.stage says what a request holds).

A request is a JSON object on one line. A request for a file the stager read itself
carries "data": N, and the file's N bytes follow that line's newline. The requests of one
write() are taken together, as one batch: the kernel cuts a write bigger than its largest
WRITE request into several, so the requests read are handed on only when a WRITE ends
exactly where a request ends (one that ends inside a line or inside a file's bytes leaves
them for the next). What one handle holds is bounded by HELD_MAX.
"""

from __future__ import annotations

import json

from .errors import InvalidArgument

# Files up to this size the stager reads itself, with the daemon's own rules
# (distorefs/sources.py), and sends with their request: the daemon takes one batch at a
# time, and for a small file the open and the read cost more than the bytes. The daemon
# reads bigger ones (ahead, or streamed in the commit for the biggest).
INLINE_MAX = 256 << 10
HELD_MAX = 80 << 20  # one batch of the stager's (64 MiB of files at most) and its lines


def encode(request: dict, data: bytes | None = None) -> bytes:
    """One request as written to `.stage`; `data`: the file's bytes, sent with it."""
    if data is None:
        return (json.dumps(request) + "\n").encode()
    return (json.dumps({**request, "data": len(data)}) + "\n").encode() + data


class StageStream:
    """The requests in the bytes written to one `.stage` handle."""

    def __init__(self) -> None:
        self._held = bytearray()  # not cut into requests yet: a line or a file's bytes still coming
        self._ready: list = []  # cut, waiting for the write they belong to to end
        self._ready_bytes = 0

    def feed(self, buf: bytes | memoryview) -> list:
        """Add one WRITE's bytes; the requests of the batch if these end one (a request with
        "data" then holds its bytes), else []. InvalidArgument on a malformed request or
        past HELD_MAX, and what was held is dropped."""
        if len(self._held) + self._ready_bytes + len(buf) > HELD_MAX:
            self._reset()
            raise InvalidArgument(f"stage: more than {HELD_MAX} bytes written without the end of a request")
        self._held += buf
        pos = 0
        held = self._held
        try:
            while True:
                nl = held.find(b"\n", pos)
                if nl < 0:
                    break
                line = bytes(held[pos:nl])
                if not line.strip():
                    pos = nl + 1
                    continue
                request = _parse_line(line)
                size = request.get("data") if isinstance(request, dict) else None  # (not an object: Dataset.stage says so)
                if size is None:
                    pos = nl + 1
                else:
                    if type(size) is not int or not 0 <= size <= INLINE_MAX:
                        raise InvalidArgument(f"stage: a file sent with its request holds 0 to {INLINE_MAX} bytes,"
                                              f" not {str(size)[:40]}")
                    if len(held) - (nl + 1) < size:
                        break  # its bytes are still coming
                    request["data"] = bytes(held[nl + 1:nl + 1 + size])
                    self._ready_bytes += size
                    pos = nl + 1 + size
                self._ready.append(request)
        except InvalidArgument:
            self._reset()
            raise
        del held[:pos]
        if held:
            return []
        ready, self._ready, self._ready_bytes = self._ready, [], 0
        return ready

    def _reset(self) -> None:
        self._held = bytearray()
        self._ready, self._ready_bytes = [], 0


def _parse_line(line: bytes):
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise InvalidArgument(f"stage: not a JSON line: {line[:200]!r}") from None

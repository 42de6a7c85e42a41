"""What `distorefs stage` writes to a dataset's `.stage` file, and how the daemon cuts it
into requests (Dataset.stage says what a request holds).

A request is a JSON object on one line. A request for a file the stager read itself
carries "data": N, and N bytes follow that line's newline: the file's, or with "codec"
the file encoded as the dataset stores it. The requests of one
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
    """The requests in the bytes written to one `.stage` handle. A file's bytes are taken
    as a view of the WRITE's buffer where they lie whole in it (no copy); only a request
    cut by the end of a WRITE is carried over, copied."""

    def __init__(self) -> None:
        self._head = b""  # the start of a request cut by the end of a WRITE (its line or part of it, bytes)
        self._ready: list = []  # requests complete, waiting for the end of the write they belong to
        self._ready_bytes = 0

    def feed(self, buf: bytes | memoryview) -> list:
        """Add one WRITE's bytes; the requests of the batch if these end one (a request with
        "data" then holds its bytes, as bytes or a memoryview), else []. InvalidArgument on
        a malformed request or past HELD_MAX, and what was held is dropped."""
        if len(self._head) + self._ready_bytes + len(buf) > HELD_MAX:
            self._reset()
            raise InvalidArgument(f"stage: more than {HELD_MAX} bytes written without the end of a request")
        data = buf if isinstance(buf, bytes) else bytes(buf)
        try:
            pos = 0
            if self._head:
                need = self._completes_head(data)
                if need is None:
                    self._head += data
                    return []
                joined = self._head + data[:need]
                self._head = b""
                self._cut(joined, 0)
                pos = need
            end = self._cut(data, pos)
        except InvalidArgument:
            self._reset()
            raise
        if end < len(data):
            self._head = data[end:]
            return []
        ready, self._ready, self._ready_bytes = self._ready, [], 0
        return ready

    def _completes_head(self, data: bytes) -> int | None:
        """How many bytes of `data` the request in `_head` still needs (None: more than all)."""
        nl = self._head.find(b"\n")
        if nl < 0:
            end = data.find(b"\n")
            if end < 0:
                return None
            need = end + 1 + (_sent_size(_parse_line(self._head + data[:end])) or 0)
        else:
            need = (_sent_size(_parse_line(self._head[:nl])) or 0) - (len(self._head) - nl - 1)
        return need if need <= len(data) else None

    def _cut(self, data: bytes, pos: int) -> int:
        """Take the whole requests in `data` from `pos`; where the first one not whole starts."""
        view = memoryview(data)
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                return pos
            line = data[pos:nl]
            if not line.strip():
                pos = nl + 1
                continue
            request = _parse_line(line)
            size = _sent_size(request)
            if size is None:
                pos = nl + 1
            else:
                if len(data) - (nl + 1) < size:
                    return pos  # its bytes are still coming
                request["data"] = view[nl + 1:nl + 1 + size]
                self._ready_bytes += size
                pos = nl + 1 + size
            self._ready.append(request)

    def _reset(self) -> None:
        self._head = b""
        self._ready, self._ready_bytes = [], 0


def _sent_size(request) -> int | None:
    """The size of the file sent with `request` (None: none is; not an object: Dataset.stage
    says so)."""
    if not isinstance(request, dict) or "data" not in request:
        return None
    size = request["data"]
    if type(size) is not int or not 0 <= size <= INLINE_MAX:
        raise InvalidArgument(f"stage: a file sent with its request holds 0 to {INLINE_MAX} bytes, not {str(size)[:40]}")
    return size


def _parse_line(line: bytes):
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        raise InvalidArgument(f"stage: not a JSON line: {line[:200]!r}") from None

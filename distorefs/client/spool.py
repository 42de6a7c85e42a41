"""The client's spool: a segment of the store that this session appends its values to.

An insert through the channel carries the value's bytes to the daemon, which encodes,
checksums and writes them on its one core. With a spool (asked for with SPOOL, when the
caller may write the store's files) the client does that work in its own process: it
encodes the value with the buffer's codec settings, computes the value's CRC-32 and those
of the arrays of the buffer's layout, writes one segment record (distorefs/backends/
segments.py: header, stored bytes, a name saying which entry it holds) and sends the
daemon only a STORED request naming the record. The daemon keeps every decision (the
entry's sequence number, eviction, the rate limiter, refusing what does not fit the
layout) and adopts the value where it is when the insert commits.

Imports neither trio nor pyfuse3.
"""

from __future__ import annotations

import os
import threading

from .. import clientwire as wire
from .. import codec
from ..backends.segments import HEADER, write_record
from ..errors import DistorefsError
from ..layout import Layout, place


class Spool:
    """One spool segment, open for appending (thread-safe: each record gets its own place)."""

    def __init__(self, reply: dict) -> None:
        """From a SPOOL reply that named a path; OSError when the caller may not write it."""
        self.fd = os.open(reply["path"], os.O_WRONLY | os.O_CLOEXEC)
        self.segment = int(reply["segment"])
        self.ns = int(reply["ns"])
        self.compression = str(reply["compression"])
        self.level = int(reply["level"])
        self.layout = None if reply["raw"] else Layout.from_json(reply["schema"])
        self.limit = int(reply["segment_bytes"])
        self.offset = os.fstat(self.fd).st_size
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        return self.offset >= self.limit

    def store(self, key: bytes, raw: bytes) -> bytes | None:
        """Encode `raw`, append its record; the STORED request that names it. None when it
        does not fit the layout: then it goes through the channel, and the daemon's refusal
        (or acceptance, should the layout have changed) is what the caller gets."""
        offsets: tuple[int, ...] = ()
        crcs: list[int] = []
        crc = None
        if self.layout is not None:
            try:
                offsets = tuple(place(self.layout, raw))
            except DistorefsError:
                return None
            crc, crcs = codec.checksums(raw, [(off, f.nbytes) for off, f in zip(offsets, self.layout.fields)])
        enc = codec.encode(raw, self.compression, self.level, crc=crc)
        vkey = wire.spool_vkey(self.ns, key)
        length = HEADER.size + len(enc.stored) + len(vkey)
        with self._lock:  # a place of its own in the file
            offset = self.offset
            self.offset += length
        # Stored bytes that are the value itself have its CRC already: not computed twice.
        written = write_record(self.fd, offset, vkey, enc.stored, enc.checksum if enc.codec == codec.RAW else None)
        assert written == length
        return wire.stored_request(key, self.segment, offset, enc.size, len(enc.stored), enc.checksum, enc.codec,
                                   offsets, crcs)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

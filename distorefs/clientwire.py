"""The wire format of `buffers/NAME/client`: requests a client writes, replies it reads.

The daemon (distorefs/clientsession.py) and the client beside the mount (distorefs/client)
both import this module; it imports neither trio nor pyfuse3.

A request is one write at offset 0 of an open `client` file: a frame

    u32 total length (this header included) | u8 op | payload

and a reply, when the op has one, is read back from offset 0 of the same handle until
the length its first four bytes give. A reply is a set of tables: a JSON header naming
arrays (dtype, shape, offset) and the arrays' bytes, 8-byte aligned, so the client takes
them with numpy views and no parsing per entry.

Entry tables (a draw's entries, the answer to LOCATE) carry per entry: seq, size, stored
size, checksum, codec, tier and location (the value layer's StoredValue), the key, and
for a draw the probabilities, weights and the places of each field of the buffer's layout
(`places`: offsets, `place_crcs`: each field's CRC-32).
"""

from __future__ import annotations

import functools
import json
import math
import struct
from typing import Any, NamedTuple, Sequence, cast

import numpy as np

PROTOCOL = 2  # 2: a draw may answer with the batch's rows

HELLO = 1  # reply: {"protocol", "lmdb", "buffer", "read_only"}
DRAW = 2  # payload: u32 n, u8 nonblocking[, u16 batches]; reply: entry tables + draw columns, or
# the batches' rows (a buffer that keeps rows, distorefs/rows.py; `sizes`: each batch's entries)
LOCATE = 3  # payload: int64 seqs; reply: entry tables of those still present (`present`)
PRIORITIES = 4  # payload: key table + float64 priorities; no reply (the write fails on bad input)
INSERT = 5  # payload: u16 key length, key, data; no reply (committed behind: see FLUSH)
FLUSH = 6  # payload: none, or u64 n (only the session's first n inserts); reply: {"committed", "errors":
# [[key, errno, message], ...]} of the inserts since the last
STATS = 7  # reply: the buffer's (dataset's) stats.json as JSON
ITEMS = 8  # datasets: payload int64 item numbers; reply: their chunks' tables (see item_tables)
GET = 9  # payload: key table; reply: entry tables of the keys present (`present`), and the layout
SPOOL = 10  # reply: {"path", "segment", "compression", "level", "schema", "raw", "segment_bytes"}, or
# {"path": null, "why"}: a segment of the store for this session to append its values to
STORED = 11  # payload: _STORED + key + offsets u64[arrays] + crcs u32[arrays]: an insert whose value the
# client wrote to its spool (a record of backends/segments.py, named by `spool_vkey`); committed behind
PRIORITIES_SEQS = 12  # payload: int64 seqs[n], then float64 priorities[n]: the entries named by sequence
# number (as a draw gave them: no key to encode or look up); no reply
OPS = {HELLO: "hello", DRAW: "draw", LOCATE: "locate", PRIORITIES: "priorities", INSERT: "insert",
       FLUSH: "flush", STATS: "stats", ITEMS: "items", GET: "get", SPOOL: "spool", STORED: "stored",
       PRIORITIES_SEQS: "priorities by seq"}

FRAME = struct.Struct("<IB")
_U32 = struct.Struct("<I")
_DRAW = struct.Struct("<IB")
_KEYLEN = struct.Struct("<H")
_U16 = struct.Struct("<H")
MAX_DRAW_BATCHES = 16
_U64 = struct.Struct("<Q")
# segment, record offset, decoded size, stored size, checksum, codec, arrays, key length
_STORED = struct.Struct("<IQQQIBHH")
_SPOOL_NS = struct.Struct(">I")
SPOOL_TAG = b"c"


class WireError(ValueError):
    """A frame that does not parse."""


# ----- frames ---------------------------------------------------------------------------------

def frame(op: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    return FRAME.pack(FRAME.size + len(payload), op) + bytes(payload)


def frame_length(head: bytes | bytearray | memoryview) -> int:
    """The total length a frame's first bytes announce (at least 4 of them)."""
    return _U32.unpack_from(head)[0]


def split_frame(data: bytes | bytearray | memoryview) -> tuple[int, memoryview]:
    """(op, payload) of one whole frame."""
    view = memoryview(data)
    if len(view) < FRAME.size:
        raise WireError(f"a frame is at least {FRAME.size} bytes, got {len(view)}")
    length, op = FRAME.unpack_from(view)
    if length != len(view):
        raise WireError(f"frame says {length} bytes, got {len(view)}")
    if op not in OPS:
        raise WireError(f"unknown op {op}")
    return op, view[FRAME.size:]


def draw_request(n: int, nonblocking: bool = False, batches: int = 1) -> bytes:
    """A draw of n; `batches` more than 1: as many draws of n, one after another, answered
    together when the buffer keeps rows (fewer when it does not: see ClientSession.draw)."""
    payload = _DRAW.pack(n, 1 if nonblocking else 0)
    return frame(DRAW, payload + _U16.pack(batches) if batches > 1 else payload)


def parse_draw(payload: memoryview) -> tuple[int, bool, int]:
    """(n, nonblocking, batches)."""
    if len(payload) not in (_DRAW.size, _DRAW.size + _U16.size):
        raise WireError("a draw request is a u32, a u8 and maybe a u16")
    n, flags = _DRAW.unpack_from(payload)
    batches = _U16.unpack_from(payload, _DRAW.size)[0] if len(payload) > _DRAW.size else 1
    if not 1 <= batches <= MAX_DRAW_BATCHES:
        raise WireError(f"a draw asks for 1..{MAX_DRAW_BATCHES} batches, not {batches}")
    return n, bool(flags & 1), batches


def insert_request(key: bytes, data: bytes | bytearray | memoryview) -> bytes:
    view = memoryview(data).cast("B")
    head = FRAME.pack(FRAME.size + _KEYLEN.size + len(key) + view.nbytes, INSERT) + _KEYLEN.pack(len(key)) + key
    return head + view.tobytes() if view.nbytes < 4096 else b"".join((head, view))


def parse_insert(payload: memoryview) -> tuple[bytes, memoryview]:
    if len(payload) < _KEYLEN.size:
        raise WireError("an insert starts with a u16 key length")
    (klen,) = _KEYLEN.unpack_from(payload)
    if len(payload) < _KEYLEN.size + klen:
        raise WireError("an insert's key runs past its frame")
    return bytes(payload[_KEYLEN.size:_KEYLEN.size + klen]), payload[_KEYLEN.size + klen:]


def spool_vkey(ns_id: int, key: bytes) -> bytes:
    """The name a client gives the record of an entry's value in its spool: what compaction
    finds the entry by (the daemon's own records are named by namespace and sequence number,
    which the client does not know when it writes)."""
    return SPOOL_TAG + _SPOOL_NS.pack(ns_id) + key


def split_spool_vkey(vkey: bytes) -> tuple[int, bytes] | None:
    """(namespace id, key) of a spooled record's name; None for any other name."""
    if len(vkey) <= 1 + _SPOOL_NS.size or vkey[:1] != SPOOL_TAG:
        return None
    return _SPOOL_NS.unpack_from(vkey, 1)[0], bytes(vkey[1 + _SPOOL_NS.size:])


class StoredInsert(NamedTuple):
    """A STORED request: the entry `key`, whose value is the record at `offset` of spool
    `segment` (its name `vkey_len` bytes long), and the arrays' offsets and CRC-32s."""

    key: bytes
    segment: int
    offset: int
    vkey_len: int
    size: int
    stored_size: int
    checksum: int
    codec: int
    offsets: tuple[int, ...]
    crcs: tuple[int, ...]


def stored_request(key: bytes, segment: int, offset: int, size: int, stored_size: int, checksum: int, codec: int,
                   offsets: Sequence[int] = (), crcs: Sequence[int] = ()) -> bytes:
    if len(offsets) != len(crcs):
        raise ValueError("one CRC per array")
    n = len(offsets)
    body = (_STORED.pack(segment, offset, size, stored_size, checksum, codec, n, len(key)) + key
            + struct.pack(f"<{n}Q{n}I", *offsets, *crcs))
    return frame(STORED, body)


def parse_stored(payload: memoryview) -> StoredInsert:
    if len(payload) < _STORED.size:
        raise WireError("a stored insert starts with its record's description")
    seg, off, size, stored, crc, codec, n, klen = _STORED.unpack_from(payload)
    pos = _STORED.size
    if len(payload) != pos + klen + 12 * n:
        raise WireError("a stored insert's key and arrays do not fill its frame")
    key = bytes(payload[pos:pos + klen])
    pos += klen
    offsets = struct.unpack_from(f"<{n}Q", payload, pos)  # (a few numbers: struct, not numpy, is quick)
    crcs = struct.unpack_from(f"<{n}I", payload, pos + 8 * n)
    return StoredInsert(key, seg, off, 1 + _SPOOL_NS.size + klen, size, stored, crc, codec, offsets, crcs)


def flush_request(upto: int | None = None) -> bytes:
    """FLUSH: wait for every insert sent, or (`upto`) for the session's first `upto`."""
    return frame(FLUSH, b"" if upto is None else _U64.pack(upto))


def parse_flush(payload: memoryview) -> int | None:
    if not len(payload):
        return None
    if len(payload) != _U64.size:
        raise WireError("a FLUSH carries nothing or a u64")
    return _U64.unpack(payload)[0]


def priorities_request(keys: Sequence[bytes], priorities: Sequence[float] | np.ndarray) -> bytes:
    values = np.ascontiguousarray(priorities, dtype=np.float64)
    if values.shape != (len(keys),):
        raise ValueError(f"{len(keys)} keys but {values.size} priorities")
    return frame(PRIORITIES, pack_tables({}, {**key_table(keys), "priorities": values}))


def priorities_seqs_request(seqs: np.ndarray, priorities: Sequence[float] | np.ndarray) -> bytes:
    values = np.ascontiguousarray(priorities, dtype="<f8")
    if values.shape != seqs.shape or seqs.ndim != 1:
        raise ValueError(f"{seqs.size} seqs but {values.size} priorities")
    return frame(PRIORITIES_SEQS, np.ascontiguousarray(seqs, dtype="<i8").tobytes() + values.tobytes())


def parse_priorities_seqs(payload: memoryview) -> tuple[np.ndarray, np.ndarray]:
    if len(payload) % 16:
        raise WireError("priorities by seq are int64 seqs and as many float64 priorities")
    n = len(payload) // 16
    return np.frombuffer(payload, dtype="<i8", count=n), np.frombuffer(payload, dtype="<f8", count=n, offset=8 * n)


def get_request(keys: Sequence[bytes]) -> bytes:
    return frame(GET, pack_tables({}, key_table(keys)))


def parse_get(payload: memoryview) -> list[bytes]:
    return keys_of(unpack_tables(payload)[1])


def parse_priorities(payload: memoryview) -> list[tuple[bytes, float]]:
    _meta, arrays = unpack_tables(payload)
    keys = keys_of(arrays)
    values = arrays["priorities"]
    if len(values) != len(keys):
        raise WireError("priorities and keys differ in number")
    return list(zip(keys, values.tolist()))


def items_request(items: Sequence[int] | np.ndarray) -> bytes:
    return frame(ITEMS, np.ascontiguousarray(items, dtype="<i8").tobytes())


def locate_request(seqs: Sequence[int] | np.ndarray) -> bytes:
    return frame(LOCATE, np.ascontiguousarray(seqs, dtype="<i8").tobytes())


def parse_numbers(payload: memoryview) -> np.ndarray:
    """The int64 numbers of a LOCATE (sequence numbers) or ITEMS (item numbers) request."""
    if len(payload) % 8:
        raise WireError("the request is int64 numbers")
    return np.frombuffer(payload, dtype="<i8")


# ----- tables ---------------------------------------------------------------------------------

def _align(n: int) -> int:
    return (n + 7) & ~7


def pack_tables(meta: dict | str, arrays: dict[str, np.ndarray]) -> bytes:
    """`meta` (JSON: a dict, or its text) and named arrays in one buffer (see the module
    docstring)."""
    specs = []
    offset = 0
    contiguous = {}
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        contiguous[name] = a
        specs.append((name, json.dumps(a.dtype.descr) if a.dtype.names else a.dtype.str, a.shape, offset))
        offset = _align(offset + a.nbytes)
    head = _pack_head(meta if isinstance(meta, str) else json.dumps(meta, separators=(",", ":")), tuple(specs))
    start = _align(4 + len(head))
    out = bytearray(start + offset)
    _U32.pack_into(out, 0, len(head))
    out[4:4 + len(head)] = head
    for (_name, _dtype, _shape, off), a in zip(specs, contiguous.values()):
        out[start + off:start + off + a.nbytes] = a.tobytes()
    return bytes(out)


@functools.lru_cache(maxsize=256)
def _pack_head(meta: str, specs: tuple) -> bytes:
    """A header's bytes (the replies to a learner's draws of one size all have the same)."""
    arrays = [[name, json.loads(dtype) if dtype.startswith("[") else dtype, list(shape), off]
              for name, dtype, shape, off in specs]
    return f'{{"meta":{meta},"arrays":{json.dumps(arrays, separators=(",", ":"))}}}'.encode()


def unpack_tables(data: bytes | bytearray | memoryview) -> tuple[dict, dict[str, np.ndarray]]:
    """`meta` (shared by replies with the same header: not to be changed) and the arrays,
    views of `data`."""
    view = memoryview(data)
    try:
        (hlen,) = _U32.unpack_from(view)
        meta, specs = _head(bytes(view[4:4 + hlen]))
        start = _align(4 + hlen)
        return meta, {name: np.frombuffer(view, dtype=dt, count=count, offset=start + off).reshape(shape)
                      for name, dt, count, shape, off in specs}
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise WireError(f"tables do not parse: {exc}") from None


@functools.lru_cache(maxsize=256)
def _head(raw: bytes) -> tuple[dict, tuple]:
    """A parsed header: a learner's draws of one size all have the same one."""
    head = json.loads(raw)
    specs = []
    for name, dtype, shape, off in head["arrays"]:
        dt = np.dtype(dtype if isinstance(dtype, str) else [tuple(f) for f in dtype])
        specs.append((name, dt, math.prod(shape), tuple(shape), off))
    return head["meta"], tuple(specs)


def key_table(keys: Sequence[bytes]) -> dict[str, np.ndarray]:
    lengths = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return {"key_offsets": offsets, "keys": np.frombuffer(b"".join(keys), dtype=np.uint8)}


def keys_of(arrays: dict[str, np.ndarray]) -> list[bytes]:
    blob = arrays["keys"].tobytes()
    offsets = arrays["key_offsets"].tolist()
    return [blob[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def value_tables(values: Sequence[Any]) -> dict[str, np.ndarray]:
    """The tables of stored values (StoredValue-like: size, stored_size, checksum, codec,
    tier, loc)."""
    n = len(values)
    locs = [v.loc for v in values]
    loc_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(loc) for loc in locs], out=loc_offsets[1:])
    return {
        "sizes": np.fromiter((v.size for v in values), dtype=np.int64, count=n),
        "stored_sizes": np.fromiter((v.stored_size for v in values), dtype=np.int64, count=n),
        "checksums": np.fromiter((v.checksum for v in values), dtype=np.uint32, count=n),
        "codecs": np.fromiter((v.codec for v in values), dtype=np.uint8, count=n),
        "tiers": np.fromiter((v.tier for v in values), dtype=np.uint8, count=n),
        "loc_offsets": loc_offsets,
        "locs": np.frombuffer(b"".join(locs), dtype=np.uint8),
    }


# One row per entry: what a draw, a LOCATE or a GET says of it (one array, built in one call).
ENTRY = np.dtype([("seqs", "<i8"), ("sizes", "<i8"), ("stored_sizes", "<i8"), ("checksums", "<u4"),
                  ("codecs", "u1"), ("tiers", "u1")])


def entry_tables(records: Sequence[Any]) -> dict[str, np.ndarray]:
    """The tables of entries given as EntryMeta-like records (seq, key, value: StoredValue):
    `entries` (ENTRY rows), their locations and keys; `entry_columns` splits them again."""
    values = [r.value for r in records]
    locs = [v.loc for v in values]
    loc_offsets = np.zeros(len(locs) + 1, dtype=np.int64)
    np.cumsum([len(loc) for loc in locs], out=loc_offsets[1:])
    rows = np.array([(r.seq, v.size, v.stored_size, v.checksum, v.codec, v.tier) for r, v in zip(records, values)],
                    dtype=ENTRY)
    return {"entries": rows, "loc_offsets": loc_offsets, "locs": np.frombuffer(b"".join(locs), dtype=np.uint8),
            **key_table([r.key for r in records])}


def entry_columns(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`arrays` with the columns of its `entries` rows as arrays of their own (seqs, sizes ...)."""
    rows = arrays.get("entries")
    if rows is None:
        return arrays
    return {**arrays, **{name: rows[name] for name in cast("tuple[str, ...]", ENTRY.names)}}  # (a record dtype)


def item_tables(items: Sequence[Any]) -> dict[str, np.ndarray]:
    """The tables of dataset items (Item-like: size, checksum, chunks) or None for a missing
    one: per item its size and checksum, and where its chunks are in the value tables."""
    present = [it for it in items if it is not None]
    first = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(it.chunks) if it is not None else 0 for it in items], out=first[1:])
    return {"present": np.array([it is not None for it in items], dtype=np.bool_),
            "item_sizes": np.array([it.size if it is not None else 0 for it in items], dtype=np.int64),
            "item_checksums": np.array([it.checksum if it is not None else 0 for it in items], dtype=np.uint32),
            "first_chunk": first, **value_tables([c for it in present for c in it.chunks])}


def reply_json(data: Any) -> bytes:
    return pack_tables(data, {})


def reply_frame(body: bytes) -> bytes:
    """A reply as the client reads it: u32 total length, then the body."""
    return _U32.pack(4 + len(body)) + body

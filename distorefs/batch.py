"""One sampled batch, and its `batch/N.npz` file assembled from byte slices.

The npz holds `keys` (str), `seqs` (int64), `probabilities` and `weights` (float64), and
the entries themselves, by the buffer's layout (distorefs/layout.py):
- `.npy` entries: one array `data` of shape (N, *shape);
- `.npz` entries: one array per field, stacked to (N, *shape) (a field named like one of
  the four above, or `offsets`, is stored as `entry_<name>`);
- raw mode: `data`, a uint8 array of the entries concatenated, and `offsets` (int64, N+1)
  so entry i is data[offsets[i]:offsets[i+1]].

Nothing is copied or parsed when a batch is drawn: each entry's arrays were found when it
was committed (their offsets and CRC-32s are in its record), so the file is a list of
parts - ZIP and .npy headers, and slices of the entries' values - and its members' CRCs
are combined from the entries' CRCs. A READ gathers the slices it covers (one copy, at
most the READ's size; none when it falls in one slice).

A batch of sequences (a buffer with `sequence_length` L, distorefs/sequences.py) holds N
sequences of L steps: each field stacked to (N, L, *shape), padding (steps past the end of
a sequence's real run) zero bytes; `keys` (N, L) ('' for padding), `seqs` (N, L) (-1 for
padding), `mask` (N, L) bool (the real steps), and `probabilities` and `weights` (N,), one
per sequence. In raw mode `data` and `offsets` hold the real steps, row after row.
"""

from __future__ import annotations

import bisect
import functools
import io
import struct
from dataclasses import dataclass, field
from typing import Protocol, Sequence, cast

import numpy as np

from .backends.crc import crc32
from .catalog import EntryMeta
from .codec import crc32_combine
from .layout import Layout, batch_name
from .names import escape_keys
from .rows import field_columns, row_spans

try:  # a small batch file of rows made in one call (distorefs/_batchfill.c); in Python without it
    from . import _batchfill  # type: ignore[attr-defined]
except ImportError:
    _batchfill = None

# A stacked member up to this size is joined once and checksummed whole: cheaper than one CRC
# combination per entry, and a READ of it is one slice. A whole file up to it is one buffer.
SMALL = 256 << 10


@dataclass
class Batch:
    metas: list[EntryMeta]
    probabilities: np.ndarray
    weights: np.ndarray
    spent: list[EntryMeta] = field(default_factory=list)
    # (offsets, CRCs) of each entry's arrays, (N, fields) each, taken when the batch was drawn
    places: tuple[np.ndarray, np.ndarray] | None = None
    # the entries' fields side by side, (N, row width), when the buffer keeps rows (distorefs/rows.py)
    rows: np.ndarray | None = None
    # its batch/N.npz, when it was built ahead of its open (distorefs/buffer.py, BuiltAhead)
    file: "BatchFile | None" = None
    # the ring slots of `metas` and their sequence numbers, in order, from the ring's slot
    # tables when drawn (empty arrays: not known). Read from `metas` instead, each entry's
    # number is one more object to fetch, cold in the CPU's caches in the daemon.
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    seqs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # the names of `metas`, in order, from the ring's name table (Ring.names_of; a bytes
    # array), None: read from `metas` (a name the table does not hold, or not drawn from one)
    names: np.ndarray | None = None

    def keys(self) -> list[bytes]:
        """The names of `metas`, in order."""
        if self.names is not None and len(self.names) == len(self.metas):
            return self.names.tolist()
        return [m.key for m in self.metas]

    def key_strings(self) -> np.ndarray:
        """The names of `metas` as a str array (keys.npy; bytes that are not UTF-8 as
        surrogates), as wide as the longest."""
        if self.names is not None and len(self.names) == len(self.metas) and len(self.names):
            return self.names.astype(f"U{max(1, int(np.char.str_len(self.names).max()))}")  # (ASCII)
        keys = [m.key.decode("utf-8", "surrogateescape") for m in self.metas]
        return np.array(keys) if keys else np.zeros(0, dtype="<U1")

    def entry_seqs(self) -> np.ndarray:
        """The sequence numbers of `metas`, in order (int64)."""
        if len(self.seqs) == len(self.metas):
            return self.seqs
        return np.array([m.seq for m in self.metas], dtype=np.int64)

    def manifest(self) -> bytes:
        """One line per entry: KEY SEQ PROBABILITY WEIGHT (KEY escaped: names.escape_key)."""
        return b"".join([b"%s %d %.9g %.9g\n" % line for line in zip(
            escape_keys(self.keys()), self.entry_seqs().tolist(), self.probabilities.tolist(),
            self.weights.tolist())])


@dataclass
class SequenceBatch(Batch):
    """N sequences of L steps. `metas` (and `places`) are the real steps, row by row (where
    `mask`, (N, L), is True); `probabilities` and `weights` are per sequence; `starts` are the
    sequences' first steps."""

    starts: list[EntryMeta] = field(default_factory=list)
    mask: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))

    def manifest(self) -> bytes:
        """One line per sequence: START_KEY SEQ PROBABILITY WEIGHT LENGTH (LENGTH: its real steps)."""
        starts = self.starts
        return b"".join([b"%s %d %.9g %.9g %d\n" % line for line in zip(
            escape_keys([m.key for m in starts]), [m.seq for m in starts], self.probabilities.tolist(),
            self.weights.tolist(), self.mask.sum(axis=1).tolist())])


# ----- parts of a file ------------------------------------------------------------------------

class Part(Protocol):
    size: int

    def gather(self, off: int, n: int, out: list) -> None:
        """Append buffers holding bytes [off, off+n) of the part."""


class Blob:
    __slots__ = ("data", "size")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def gather(self, off: int, n: int, out: list) -> None:
        out.append(memoryview(self.data)[off:off + n])


class Stacked:
    """Field `length` bytes long at `offsets[i]` of each value i, one after another."""

    __slots__ = ("values", "offsets", "length", "size")

    def __init__(self, values: Sequence[bytes], offsets: np.ndarray, length: int) -> None:
        self.values = values
        self.offsets = offsets.tolist()
        self.length = length
        self.size = length * len(values)

    def gather(self, off: int, n: int, out: list) -> None:
        length = self.length
        i, within = divmod(off, length)
        while n > 0:
            take = min(length - within, n)
            start = self.offsets[i] + within
            out.append(memoryview(self.values[i])[start:start + take])
            n -= take
            i += 1
            within = 0


class Concat:
    """The values whole, one after another."""

    __slots__ = ("values", "starts", "size")

    def __init__(self, values: Sequence[bytes]) -> None:
        self.values = values
        self.starts = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=self.starts[1:])
        self.size = int(self.starts[-1])

    def gather(self, off: int, n: int, out: list) -> None:
        i = int(np.searchsorted(self.starts, off, side="right")) - 1
        while n > 0:
            within = off - int(self.starts[i])
            take = min(len(self.values[i]) - within, n)
            if take > 0:
                out.append(memoryview(self.values[i])[within:within + take])
                n -= take
                off += take
            i += 1


class BatchFile:
    """A file made of parts, read by gathering."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = [p for p in parts if p.size]
        self.starts: list[int] = []
        pos = 0
        for p in self.parts:
            self.starts.append(pos)
            pos += p.size
        self.size = pos

    def read(self, off: int, size: int, scratch: bytearray | None = None) -> memoryview | bytes:
        """Bytes [off, off+size). Pieces of several values are joined into `scratch` when it
        is large enough (a buffer the caller reuses: a fresh 1 MiB allocation costs a page
        fault per 4 KiB, more than the copy), else into new bytes."""
        end = min(off + size, self.size)
        if off >= end:
            return b""
        out: list = []
        i = bisect.bisect_right(self.starts, off) - 1
        n = end - off
        while off < end:
            part, start = self.parts[i], self.starts[i]
            take = min(end - off, part.size - (off - start))
            part.gather(off - start, take, out)
            off += take
            i += 1
        if len(out) == 1:
            return out[0]
        if scratch is None or len(scratch) < n:
            return b"".join(out)
        view = memoryview(scratch)
        pos = 0
        for piece in out:
            view[pos:pos + len(piece)] = piece
            pos += len(piece)
        return view[:n]

    def __bytes__(self) -> bytes:
        return bytes(self.read(0, self.size))

    def gather_all(self, out: list) -> None:
        """The whole file as pieces (buffers into its parts, no copy), in order, onto `out`."""
        for part in self.parts:
            part.gather(0, part.size, out)


# ----- the npz container ------------------------------------------------------------------------

_U32 = struct.Struct("<I")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_LOCATOR = struct.Struct("<4sIQI")
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01: the file has no time of its own
_LIMIT = 0xFFFFFFFF


@dataclass
class Member:
    name: str
    head: bytes  # the .npy header
    body: Part
    crc: int | None  # of head + body (None: not computed yet; a Blob body's only)

    @property
    def size(self) -> int:
        return len(self.head) + self.body.size


def zip_parts(members: list[Member], force_zip64: bool = False) -> list[Part]:
    """The parts of a ZIP archive (stored members) holding `members`; ZIP64 records where a
    size or an offset needs them."""
    parts: list[Part] = []
    central: list[bytes] = []
    offset = 0
    for m in members:
        if m.crc is None:
            m.crc = crc32(cast(Blob, m.body).data, crc32(m.head))
        name = m.name.encode()
        size = m.size
        big = force_zip64 or size >= _LIMIT or offset >= _LIMIT
        version = 45 if big else 20
        extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        sz = _LIMIT if big else size
        local = _LOCAL.pack(b"PK\x03\x04", version, 0, 0, 0, _DOS_DATE, m.crc, sz, sz, len(name), len(extra))
        parts.append(Blob(local + name + extra + m.head))
        parts.append(m.body)
        cextra = struct.pack("<HHQQQ", 1, 24, size, size, offset) if big else b""
        central.append(_CENTRAL.pack(b"PK\x01\x02", version, version, 0, 0, 0, _DOS_DATE, m.crc, sz, sz, len(name),
                                     len(cextra), 0, 0, 0, 0, _LIMIT if big else offset) + name + cextra)
        offset += len(local) + len(name) + len(extra) + size
    directory = b"".join(central)
    count = len(members)
    tail = b""
    if force_zip64 or offset >= _LIMIT or len(directory) >= _LIMIT or count >= 0xFFFF:
        tail = (_EOCD64.pack(b"PK\x06\x06", _EOCD64.size - 12, 45, 45, 0, 0, count, count, len(directory), offset)
                + _LOCATOR.pack(b"PK\x06\x07", 0, offset + len(directory), 1))
        tail += _EOCD.pack(b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, _LIMIT, _LIMIT, 0)
    else:
        tail = _EOCD.pack(b"PK\x05\x06", 0, 0, count, count, len(directory), offset, 0)
    parts.append(Blob(directory + tail))
    return parts


@functools.lru_cache(maxsize=1024)
def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _array_member(name: str, array: np.ndarray) -> Member:
    array = np.ascontiguousarray(array)
    head = npy_header(array.dtype.str, array.shape)
    return Member(name, head, Blob(array.tobytes()), None)


class _Joined:
    """Small values joined once, so that each field of a small batch is one numpy gather
    (a learner's 64 transitions x 5 fields: not 320 slices)."""

    def __init__(self, values: Sequence[bytes]) -> None:
        self.bytes = np.frombuffer(b"".join(values), dtype=np.uint8)
        self.starts = np.zeros(len(values), dtype=np.int64)
        np.cumsum([len(v) for v in values[:-1]], out=self.starts[1:])

    def field(self, offsets: np.ndarray, length: int) -> bytes:
        index = (self.starts + offsets)[:, None] + np.arange(length, dtype=np.int64)
        return self.bytes[index].tobytes()


def _stacked_member(name: str, descr: str, shape: tuple[int, ...], length: int, values: Sequence[bytes],
                    offsets: np.ndarray, crcs: np.ndarray, joined: _Joined | None = None,
                    lead: tuple[int, ...] | None = None) -> Member:
    """Field `length` bytes long at offsets[i] of values[i], stacked to (*lead, *shape) (`lead`:
    (len(values),) unless given)."""
    head = npy_header(descr, (*(lead or (len(values),)), *shape))
    if length * len(values) <= SMALL:
        data = joined.field(offsets, length) if joined is not None else \
            b"".join([memoryview(v)[o:o + length] for v, o in zip(values, offsets.tolist())])
        return Member(name, head, Blob(data), None)
    crc = crc32(head)
    for c in crcs.tolist():
        crc = crc32_combine(crc, c, length)
    return Member(name, head, Stacked(values, offsets, length), crc)


def _raw_members(metas: list[EntryMeta], values: Sequence[bytes]) -> list[Member]:
    body = Concat(values)
    head = npy_header("|u1", (body.size,))
    crc = crc32(head)
    for m in metas:
        crc = crc32_combine(crc, m.checksum, m.size)  # the whole value's CRC-32, kept in its record
    return [Member("data.npy", head, body, crc), _array_member("offsets.npy", body.starts)]


def batch_file(batch: Batch, values: Sequence[bytes] | None, layout: Layout | None) -> BatchFile:
    """The `batch/N.npz` file of `batch`, whose entries' contents are `values`: stacked
    by `layout` when every entry has its places, else raw (sequences: see the module
    docstring). `values` None: the batch's rows hold the entries' fields (distorefs/rows.py)."""
    if isinstance(batch, SequenceBatch):
        return _file(_sequence_members(batch, values, layout) + _draw_members(batch))
    members: list[Member] = []
    if values is None:
        assert layout is not None and batch.rows is not None
        made = _rows_file(batch, layout)
        if made is not None:
            return made
        members.extend(_row_members(layout, batch.rows, False))
    elif layout is not None and batch.places is not None and values:
        offsets, crcs = batch.places
        total = sum(len(v) for v in values)
        joined = _Joined(values) if total <= SMALL else None
        for j, f in enumerate(layout.fields):
            members.append(_stacked_member(batch_name(f) + ".npy", f.dtype, f.shape, f.nbytes, values, offsets[:, j],
                                           crcs[:, j], joined))
    elif values:
        members.extend(_raw_members(batch.metas, values))
    members.append(_array_member("keys.npy", batch.key_strings()))
    members.append(_array_member("seqs.npy", batch.entry_seqs()))
    return _file(members + _draw_members(batch))


_TAIL_NAMES = ("keys.npy", "seqs.npy", "probabilities.npy", "weights.npy")  # batch_file's order


def _rows_file(batch: Batch, layout: Layout) -> "BatchFile | None":
    """The file batch_file makes of a batch whose fields are its rows (the same bytes), made
    in one call of distorefs/_batchfill.c: the fields gathered from the rows and every
    member's CRC set in a copy of the file's image. None: not made so (no module, no
    entries, a file past SMALL, an array not contiguous)."""
    rows = batch.rows
    if _batchfill is None or rows is None or not len(rows):
        return None
    n, names = len(rows), batch.names
    # keys.npy: from the ring's name table, its str cast made here (the cast, and the longest
    # name's length it needs, are three numpy calls); else as Batch.key_strings makes it
    keys = _batchfill.ascii_keys(names) if names is not None and len(names) == n and names.flags.c_contiguous \
        else None
    if keys is not None:
        width, key_bytes = keys
        key_spec: tuple[str, tuple[int, ...]] = (np.dtype(f"U{width}").str, (n,))
        key_body: bytes | np.ndarray = key_bytes
    else:
        key_body = batch.key_strings()
        key_spec = (key_body.dtype.str, key_body.shape)
    arrays = (batch.entry_seqs(), np.asarray(batch.probabilities, dtype=np.float64),
              np.asarray(batch.weights, dtype=np.float64))
    if not (rows.flags.c_contiguous and all(a.flags.c_contiguous for a in arrays)):
        return None  # (a batch's own arrays are: a gather's, a cast's, the sampler's)
    made = _rows_image(layout, n, (key_spec, *((a.dtype.str, a.shape) for a in arrays)))
    if made is None:
        return None
    template, spans = made
    return BatchFile([Blob(_batchfill.fill(template.image, template.places, rows, spans, (key_body, *arrays)))])


@functools.lru_cache(maxsize=256)
def _rows_image(layout: Layout, n: int, tail: tuple[tuple[str, tuple[int, ...]], ...]
                ) -> "tuple[_SmallZip, tuple[tuple[int, int], ...]] | None":
    """The image of a small file of n entries' rows of `layout` followed by arrays of the
    dtypes and shapes `tail` (keys, seqs, probabilities, weights), with each field's span in a
    row; None where the file is not small (batch_file then builds its parts)."""
    heads = tuple(npy_header(f.dtype, (n, *f.shape)) for f in layout.fields) + \
        tuple(npy_header(dtype, shape) for dtype, shape in tail)
    sizes = tuple(n * f.nbytes for f in layout.fields) + \
        tuple(np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)) for dtype, shape in tail)
    if sum(len(h) for h in heads) + sum(sizes) > SMALL:
        return None
    names = tuple(batch_name(f) + ".npy" for f in layout.fields) + _TAIL_NAMES
    return _SmallZip.of(names, heads, sizes), tuple(row_spans(layout))


def _row_members(layout: Layout, rows: np.ndarray, sequences: bool,
                 lead: tuple[int, ...] | None = None) -> list[Member]:
    """The stacked fields of entries given as rows (N, width), each field's bytes side by
    side in the layout's order; shaped (*lead, *shape) (`lead`: (N,) unless given)."""
    members = []
    for f, column in field_columns(layout, rows):
        head = npy_header(f.dtype, (*(lead or (len(rows),)), *f.shape))
        members.append(Member(batch_name(f, sequences) + ".npy", head, Blob(column.tobytes()), None))
    return members


def _draw_members(batch: Batch) -> list[Member]:
    return [_array_member("probabilities.npy", np.asarray(batch.probabilities, dtype=np.float64)),
            _array_member("weights.npy", np.asarray(batch.weights, dtype=np.float64))]


def _file(members: list[Member]) -> BatchFile:
    if all(type(m.body) is Blob and m.crc is None for m in members) and sum(m.size for m in members) <= SMALL:
        template = _SmallZip.of(tuple(m.name for m in members), tuple(m.head for m in members),
                                tuple(m.body.size for m in members))
        return BatchFile([Blob(template.fill([cast(Blob, m.body).data for m in members]))])
    f = BatchFile(zip_parts(members))
    return BatchFile([Blob(bytes(f))]) if f.size <= SMALL else f


class _SmallZip:
    """A small batch file of given members' names, .npy headers and sizes, all but their
    bytes and CRCs in place. A buffer's batches of one size are the same file but for those
    (its layout is fixed, and so are the draw's fields), so each is a copy of this image with
    the members' bytes written in and their CRCs set in the local and central headers:
    no ZIP records are built per batch."""

    __slots__ = ("image", "places")

    def __init__(self, names: tuple[str, ...], heads: tuple[bytes, ...], sizes: tuple[int, ...]) -> None:
        members = [Member(n, h, Blob(bytes(size)), 0) for n, h, size in zip(names, heads, sizes)]
        parts = zip_parts(members)
        self.image = bytes(BatchFile(parts))
        # Where each member's bytes and CRC fields are: its local header (the CRC 14 bytes
        # in) is the part before its body; the central directory is in the last part, one
        # record (46 bytes and the name: no ZIP64 in a file this small) per member.
        places = []
        at = 0
        central = len(self.image) - parts[-1].size
        for i, (m, head) in enumerate(zip(members, heads)):
            local, body = parts[2 * i], parts[2 * i + 1]
            places.append((at + local.size, body.size, at + 14, central + 16, crc32(head)))
            at += local.size + body.size
            central += _CENTRAL.size + len(m.name.encode())
        self.places = places

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(names: tuple[str, ...], heads: tuple[bytes, ...], sizes: tuple[int, ...]) -> "_SmallZip":
        return _SmallZip(names, heads, sizes)

    def fill(self, bodies: list[bytes]) -> bytes:
        out = bytearray(self.image)
        for (at, size, local_crc, central_crc, seed), body in zip(self.places, bodies):
            out[at:at + size] = body
            crc = crc32(body, seed)
            _U32.pack_into(out, local_crc, crc)
            _U32.pack_into(out, central_crc, crc)
        return bytes(out)


@functools.lru_cache(maxsize=64)
def _zeros(length: int) -> tuple[bytes, int]:
    """`length` zero bytes (a padding step's field) and their CRC-32."""
    data = bytes(length)
    return data, crc32(data)


def _sequence_members(batch: SequenceBatch, values: Sequence[bytes] | None, layout: Layout | None
                      ) -> list[Member]:
    """The members of a batch of sequences but probabilities and weights: the real steps'
    values (or rows) placed at their (N, L) positions, padding read from a zero buffer."""
    mask = batch.mask
    shape = mask.shape
    real = np.flatnonzero(mask.ravel())  # position of each of `values` in the N*L steps
    members: list[Member] = []
    if values is None:
        assert layout is not None and batch.rows is not None
        rows = np.zeros((mask.size, batch.rows.shape[1]), dtype=np.uint8)  # padding: zero bytes
        rows[real] = batch.rows
        members.extend(_row_members(layout, rows, True, lead=shape))
    elif layout is not None and batch.places is not None and values:
        offsets, crcs = batch.places
        widest = max(f.nbytes for f in layout.fields)
        pad = _zeros(widest)[0]
        steps: list[bytes] = [pad] * mask.size
        for at, value in zip(real.tolist(), values):
            steps[at] = value
        joined = _Joined(steps) if sum(len(v) for v in steps) <= SMALL else None
        for j, f in enumerate(layout.fields):
            field_at = np.zeros(mask.size, dtype=np.int64)  # padding: the field's bytes are the zeros at 0
            field_at[real] = offsets[:, j]
            crc = np.full(mask.size, _zeros(f.nbytes)[1], dtype=np.uint32)
            crc[real] = crcs[:, j]
            members.append(_stacked_member(batch_name(f, sequences=True) + ".npy", f.dtype, f.shape, f.nbytes,
                                           steps, field_at, crc, joined, lead=shape))
    elif values:
        members.extend(_raw_members(batch.metas, values))
    keys = [""] * mask.size
    seqs = np.full(mask.size, -1, dtype=np.int64)
    for at, m in zip(real.tolist(), batch.metas):
        keys[at] = m.key.decode("utf-8", "surrogateescape")
    seqs[real] = batch.entry_seqs()
    members.append(_array_member("keys.npy", np.array(keys).reshape(shape)))
    members.append(_array_member("seqs.npy", seqs.reshape(shape)))
    members.append(_array_member("mask.npy", mask))
    return members

"""Entry layouts: the arrays inside a `.npy` or `.npz` entry, found once, when it commits.

A buffer's batches stack its entries' arrays field by field, so every entry of a buffer has
one layout: `.npy` (one array, the field `data`) or `.npz` (named arrays), each field with a
dtype and a shape. `parse` finds an entry's layout and where each array's bytes start in
it; `place` does the same against a buffer's layout and says, in one line, why an entry
that does not fit is refused. Nothing here copies or decompresses array bytes: a `.npy`
header is parsed (each distinct header text once), an `.npz` is read through its ZIP
central directory and local headers, stored (uncompressed) members only.
"""

from __future__ import annotations

import ast
import struct
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from .errors import InvalidArgument, InvalidConfig

NPY_MAGIC = b"\x93NUMPY"
MAX_FIELDS = 256  # members of an .npz entry that can be stacked

_EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory
_EOCD64_LOCATOR = struct.Struct("<4sIQI")
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_CDIR = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


class NotStackable(InvalidArgument):
    """An entry whose arrays cannot be stacked with its buffer's (EINVAL at close)."""


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str  # numpy's dtype string: '<f4', '|u1', '<U10'
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    def describe(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Layout:
    kind: str  # "npy" or "npz"
    fields: tuple[Field, ...]

    def to_json(self) -> dict:
        if self.kind == "npy":
            return {"format": "npy", **self.fields[0].to_json()}
        return {"format": "npz", "fields": {f.name: f.to_json() for f in self.fields}}

    @classmethod
    def from_json(cls, d: Any) -> "Layout":
        """A schema as config.json gives it; InvalidConfig saying what is wrong."""
        if not isinstance(d, dict) or d.get("format") not in ("npy", "npz"):
            raise InvalidConfig('schema must be {"format": "npy", "dtype": ..., "shape": [...]} or '
                                '{"format": "npz", "fields": {NAME: {"dtype": ..., "shape": [...]}, ...}}')
        if d["format"] == "npy":
            if set(d) - {"format", "dtype", "shape"}:
                raise InvalidConfig(f"schema: unknown keys {sorted(set(d) - {'format', 'dtype', 'shape'})}")
            return cls("npy", (_field("data", {k: v for k, v in d.items() if k != "format"}),))
        fields = d.get("fields")
        if set(d) - {"format", "fields"} or not isinstance(fields, dict) or not fields:
            raise InvalidConfig('schema: an npz schema is {"format": "npz", "fields": {NAME: {...}, ...}}')
        if len(fields) > MAX_FIELDS:
            raise InvalidConfig(f"schema: at most {MAX_FIELDS} fields")
        return cls("npz", tuple(_field(name, spec) for name, spec in fields.items()))

    def describe(self) -> str:
        return f"{self.kind} ({', '.join(f.describe() for f in self.fields)})"


def _field(name: Any, spec: Any) -> Field:
    if not isinstance(name, str) or not name or "/" in name:
        raise InvalidConfig(f"schema: bad field name {name!r}")
    if not isinstance(spec, dict) or set(spec) - {"dtype", "shape"} or "dtype" not in spec:
        raise InvalidConfig(f"schema: field {name!r} needs a dtype and a shape")
    try:
        dtype = np.dtype(spec["dtype"])
    except (TypeError, ValueError) as exc:
        raise InvalidConfig(f"schema: field {name!r}: bad dtype {spec['dtype']!r} ({exc})") from None
    if dtype.hasobject or dtype.names is not None or dtype.itemsize == 0:
        raise InvalidConfig(f"schema: field {name!r}: dtype {dtype} cannot be stacked from bytes")
    shape = spec.get("shape", [])
    if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                              for x in shape):
        raise InvalidConfig(f"schema: field {name!r}: shape must be a list of integers >= 0")
    return Field(name, dtype.str, tuple(shape))


# ----- parsing entries ------------------------------------------------------------------------

_HEADERS: dict[bytes, "tuple[str, tuple[int, ...]] | str"] = {}


def _npy(buf: memoryview, start: int, end: int, name: str) -> tuple[Field, int]:
    """The field an .npy file at buf[start:end] holds, and where its array bytes start."""
    if end - start < 10 or buf[start:start + 6] != NPY_MAGIC:
        raise NotStackable(f"{name}: not an .npy array")
    major = buf[start + 6]
    if major == 1:
        hlen, hstart = _U16.unpack_from(buf, start + 8)[0], start + 10
    elif major in (2, 3) and end - start >= 12:
        hlen, hstart = _U32.unpack_from(buf, start + 8)[0], start + 12
    else:
        raise NotStackable(f"{name}: unknown .npy version {major}")
    if hstart + hlen > end:
        raise NotStackable(f"{name}: truncated .npy header")
    raw = bytes(buf[hstart:hstart + hlen])
    parsed = _HEADERS.get(raw)
    if parsed is None:
        parsed = _parse_header(raw)
        if len(_HEADERS) < 4096:  # a buffer's entries share a handful of header texts
            _HEADERS[raw] = parsed
    if isinstance(parsed, str):
        raise NotStackable(f"{name}: {parsed}")
    descr, shape = parsed
    field = Field(name, descr, shape)
    data = hstart + hlen
    if end - data != field.nbytes:
        raise NotStackable(f"{name}: {end - data} bytes of array data, its header says {field.nbytes}")
    return field, data


def _parse_header(raw: bytes) -> "tuple[str, tuple[int, ...]] | str":
    """(dtype string, shape), or why the array cannot be stacked."""
    try:
        header = ast.literal_eval(raw.decode("latin1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
        dtype = np.dtype(descr)
    except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError, MemoryError, RecursionError):
        return "unreadable .npy header"
    if fortran and len([d for d in shape if d != 1]) > 1:
        return "a Fortran-ordered array (save it C-ordered, or use raw mode)"
    if dtype.hasobject:
        return "an array of Python objects (pickled; use raw mode)"
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        return "bad shape in .npy header"
    return dtype.str, shape


def _zip_members(buf: memoryview, unread: list[tuple[int, int]] | None = None
                 ) -> list[tuple[str, int, int, int]]:
    """(name, method, data start, data size) of each member of a ZIP archive, from its
    central directory (ZIP64 included). `unread`: appended with the spans of the headers
    that nothing here reads (each member's time, date and CRC-32, in its local and its
    central header), and (-1, -1) if a member has a data descriptor after its bytes."""
    n = len(buf)
    eocd = n - _EOCD.size
    if eocd < 0 or buf[eocd:eocd + 4] != b"PK\x05\x06":  # no archive comment: the usual case
        tail = bytes(buf[max(0, n - (1 << 16) - _EOCD.size):])  # else look for it before a comment
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _EOCD.size > len(tail):
            raise NotStackable("not a ZIP archive (no end of central directory)")
        eocd = n - len(tail) + at
    _, _, _, _, count, cd_size, cd_off, _ = _EOCD.unpack_from(buf, eocd)
    if cd_off == 0xFFFFFFFF or count == 0xFFFF:
        loc = eocd - _EOCD64_LOCATOR.size
        if loc < 0 or bytes(buf[loc:loc + 4]) != b"PK\x06\x07":
            raise NotStackable("ZIP64 archive without its locator")
        z64 = _EOCD64_LOCATOR.unpack_from(buf, loc)[2]
        if z64 + _EOCD64.size > n or bytes(buf[z64:z64 + 4]) != b"PK\x06\x06":
            raise NotStackable("bad ZIP64 end of central directory")
        _, _, _, _, _, _, _, count, cd_size, cd_off = _EOCD64.unpack_from(buf, z64)
    if count > MAX_FIELDS:
        raise NotStackable(f"{count} members (at most {MAX_FIELDS} can be stacked)")
    out = []
    pos = cd_off
    for _ in range(count):
        if pos + _CDIR.size > n or buf[pos:pos + 4] != b"PK\x01\x02":
            raise NotStackable("bad ZIP central directory")
        (_, _, _, flags, method, _, _, _, csize, usize, nlen, elen, clen, _, _, _, lho) = _CDIR.unpack_from(buf, pos)
        name = bytes(buf[pos + _CDIR.size:pos + _CDIR.size + nlen]).decode("utf-8", "replace")
        extra = bytes(buf[pos + _CDIR.size + nlen:pos + _CDIR.size + nlen + elen])
        if 0xFFFFFFFF in (csize, usize, lho):
            usize, csize, lho = _zip64_extra(extra, usize, csize, lho)
        pos += _CDIR.size + nlen + elen + clen
        if flags & 1:
            raise NotStackable(f"{name}: encrypted")
        if unread is not None:
            record = pos - (_CDIR.size + nlen + elen + clen)  # (this member's, read above)
            unread.append((record + 12, record + 20))
            unread.append((lho + 10, lho + 18))
            if flags & 8:
                unread.append((-1, -1))
        if lho + _LOCAL.size > n or buf[lho:lho + 4] != b"PK\x03\x04":
            raise NotStackable(f"{name}: bad local header")
        lname, lextra = _LOCAL.unpack_from(buf, lho)[9:11]
        start = lho + _LOCAL.size + lname + lextra
        if start + csize > n:
            raise NotStackable(f"{name}: member runs past the end of the archive")
        out.append((name, method, start, csize if method else usize))
    return out


def _zip64_extra(extra: bytes, usize: int, csize: int, lho: int) -> tuple[int, int, int]:
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            values = list(struct.unpack_from(f"<{size // 8}Q", extra, i + 4))
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if lho == 0xFFFFFFFF and values:
                lho = values.pop(0)
            return usize, csize, lho
        i += 4 + size
    raise NotStackable("ZIP64 sizes without their extra field")


def parse(data: bytes | memoryview, unread: list[tuple[int, int]] | None = None
          ) -> tuple[Layout, tuple[int, ...]]:
    """The layout of an entry and the offset of each field's array bytes in it (in the
    layout's field order). NotStackable, with the reason, for anything else. `unread`:
    see _zip_members."""
    buf = memoryview(data).cast("B")
    if buf[:6] == NPY_MAGIC:
        field, off = _npy(buf, 0, len(buf), "data")
        return Layout("npy", (field,)), (off,)
    if buf[:2] != b"PK":
        raise NotStackable("neither an .npy nor an .npz file (use raw mode for other data)")
    fields, offsets = [], []
    for name, method, start, size in _zip_members(buf, unread):
        if method != 0:
            raise NotStackable(f"{name}: a compressed member (np.savez_compressed); save with np.savez, "
                               f"distorefs compresses with zstd itself")
        key = name[:-4] if name.endswith(".npy") else name
        field, off = _npy(buf, start, start + size, key)
        fields.append(field)
        offsets.append(off)
    if not fields:
        raise NotStackable("an .npz with no arrays")
    if len({f.name for f in fields}) != len(fields):
        raise NotStackable("an .npz with two members of one name")
    return Layout("npz", tuple(fields)), tuple(offsets)


class _Skeleton:
    """What `parse` read of an .npz entry that fits a layout: every byte of it but the
    arrays' and the spans it does not read (each member's time, date and CRC-32, which
    np.savez writes anew for every entry). An entry of the same size with the same bytes
    there parses to the same layout and offsets, so a buffer's next entries are checked
    with a few slice comparisons instead of a walk through their ZIP and .npy headers (39
    us of the daemon's CPU for a 1 KB transition of four arrays)."""

    __slots__ = ("size", "spans", "expected", "offsets")

    def __init__(self, buf: memoryview, skipped: list[tuple[int, int]], offsets: tuple[int, ...]) -> None:
        self.size = len(buf)
        self.offsets = offsets
        self.spans: list[tuple[int, int]] = []
        at = 0
        for start, end in sorted(skipped):
            if start > at:
                self.spans.append((at, start))
            at = max(at, end)
        if at < self.size:
            self.spans.append((at, self.size))
        self.expected = [bytes(buf[a:b]) for a, b in self.spans]

    @classmethod
    def of(cls, layout: Layout, data: bytes | memoryview, offsets: tuple[int, ...],
           unread: list[tuple[int, int]]) -> "_Skeleton | None":
        if layout.kind != "npz" or (-1, -1) in unread:  # (a data descriptor's CRC: not worth it)
            return None
        skipped = unread + [(off, off + f.nbytes) for off, f in zip(offsets, layout.fields)]
        return cls(memoryview(data).cast("B"), skipped, offsets)

    def fits(self, data: bytes | memoryview) -> bool:
        return len(data) == self.size and all(data[a:b] == e for (a, b), e in zip(self.spans, self.expected))


_SKELETONS: dict[Layout, _Skeleton] = {}  # the last entry placed of each layout
_SKELETONS_MAX = 256


def place(layout: Layout, data: bytes | memoryview) -> tuple[int, ...]:
    """The offset of each field of `layout` in an entry that has that layout; NotStackable
    saying how the entry differs."""
    skeleton = _SKELETONS.get(layout)
    if skeleton is not None and skeleton.fits(data):
        return skeleton.offsets
    unread: list[tuple[int, int]] = []
    offsets = _place(layout, data, unread)
    skeleton = _Skeleton.of(layout, data, offsets, unread)
    if skeleton is not None:
        if len(_SKELETONS) >= _SKELETONS_MAX and layout not in _SKELETONS:
            _SKELETONS.clear()
        _SKELETONS[layout] = skeleton
    return offsets


def _place(layout: Layout, data: bytes | memoryview, unread: list[tuple[int, int]]) -> tuple[int, ...]:
    try:
        got, offsets = parse(data, unread)
    except NotStackable as exc:
        raise NotStackable(f"entry layout: {exc}; the buffer's is {layout.describe()} (set raw mode for mixed "
                           f"entries)") from None
    if got == layout:
        return offsets
    if got.kind != layout.kind:
        raise NotStackable(f"an .{got.kind} entry in a buffer of .{layout.kind} entries ({layout.describe()})")
    mine = {f.name: (f, off) for f, off in zip(got.fields, offsets)}
    out = []
    for f in layout.fields:
        have = mine.get(f.name)
        if have is None or have[0] != f:
            break
        out.append(have[1])
    if len(out) == len(layout.fields) == len(got.fields):
        return tuple(out)  # the same arrays in another member order
    raise NotStackable(f"entry layout {got.describe()} differs from the buffer's {layout.describe()} "
                       f"(set a schema, or raw mode for mixed entries)")


# ----- the arrays of a batch -----------------------------------------------------------------

# Names a batch gives its own arrays; a field named like one is stacked as `entry_<name>`.
RESERVED = ("keys", "seqs", "probabilities", "weights", "offsets")
SEQUENCE_RESERVED = RESERVED + ("mask",)  # a batch of sequences has a `mask` too


def batch_name(field: Field, sequences: bool = False) -> str:
    """The name of a field's stacked array in a batch (`batch/N.npz`, the client's `sample`);
    `sequences`: in a batch of sequences."""
    return f"entry_{field.name}" if field.name in (SEQUENCE_RESERVED if sequences else RESERVED) else field.name


# ----- where each entry's arrays are ----------------------------------------------------------

def pack_places(offsets: tuple[int, ...] | list[int], crcs: list[int]) -> bytes:
    """An entry's places as stored in its record: each field's offset (u64), then CRC (u32)."""
    n = len(offsets)
    return struct.pack(f"<{n}Q{n}I", *offsets, *crcs)


def unpack_places(data: bytes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = len(data) // 12
    values = struct.unpack(f"<{n}Q{n}I", data)
    return values[:n], values[n:]


class SlotPlaces:
    """The places of every entry of a buffer, by ring slot: numpy arrays, so a batch takes
    the offsets and CRCs of its N entries in one gather."""

    def __init__(self, fields: int) -> None:
        self.fields = fields
        self.offsets = np.zeros((0, fields), dtype=np.int64)
        self.crcs = np.zeros((0, fields), dtype=np.uint32)
        self.known = np.zeros(0, dtype=bool)

    def grow(self, capacity: int) -> None:
        pad = capacity - len(self.known)
        if pad > 0:
            self.offsets = np.concatenate([self.offsets, np.zeros((pad, self.fields), dtype=np.int64)])
            self.crcs = np.concatenate([self.crcs, np.zeros((pad, self.fields), dtype=np.uint32)])
            self.known = np.concatenate([self.known, np.zeros(pad, dtype=bool)])

    def set(self, slot: int, places: bytes) -> None:
        if len(places) != 12 * self.fields or not self.fields:
            self.known[slot] = False
            return
        offsets, crcs = unpack_places(places)
        self.offsets[slot] = offsets
        self.crcs[slot] = crcs
        self.known[slot] = True

    def clear(self, slot: int) -> None:
        self.known[slot] = False

    def take(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(offsets, CRCs) of the entries in `slots`, each (N, fields); None if one of them
        has no places (an entry of another layout)."""
        if not self.fields or not self.known[slots].all():
            return None
        return self.offsets[slots], self.crcs[slots]

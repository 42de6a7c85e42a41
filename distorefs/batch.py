"""One sampled batch, and its `batch/N.npz` rendering.

The npz holds `keys` (str), `seqs` (int64), `probabilities` and `weights` (float64), and
the entries themselves:
- every entry a `.npy` file with the same dtype and shape: one array `data` of shape
  (N, *shape);
- every entry an `.npz` with the same fields, dtypes and shapes: one array per field,
  stacked to (N, *shape) (a field named like one of the four above is stored as
  `entry_<name>`);
- anything else (raw bytes, mixed shapes): `data` as one uint8 array of all entries
  concatenated and `offsets` (int64, N+1) so entry i is data[offsets[i]:offsets[i+1]].
The file is assembled from slices of the cached values and copied once, at the end.
"""

from __future__ import annotations

import ast
import io
import struct
import zipfile
from dataclasses import dataclass, field

import numpy as np

from .catalog import EntryMeta
from .names import escape_key

RESERVED = ("keys", "seqs", "probabilities", "weights", "offsets")
NPY_MAGIC = b"\x93NUMPY"


@dataclass
class Batch:
    metas: list[EntryMeta]
    probabilities: np.ndarray
    weights: np.ndarray
    spent: list[EntryMeta] = field(default_factory=list)

    def manifest(self) -> bytes:
        """One line per entry: KEY SEQ PROBABILITY WEIGHT (KEY escaped: names.escape_key)."""
        return b"".join(
            b"%s %d %.9g %.9g\n" % (escape_key(m.key), m.seq, p, w)
            for m, p, w in zip(self.metas, self.probabilities.tolist(), self.weights.tolist()))


_HEADERS: dict[bytes, tuple[str, bool, tuple] | None] = {}


def _npy_header(buf: bytes) -> tuple[str, bool, tuple, int] | None:
    """(descr, fortran_order, shape, data offset) of an .npy file, or None if not one.

    Entries of one buffer share a handful of distinct headers: each is parsed once.
    """
    if len(buf) < 10 or not buf.startswith(NPY_MAGIC):
        return None
    major = buf[6]
    if major == 1:
        hlen, start = struct.unpack_from("<H", buf, 8)[0], 10
    elif major in (2, 3) and len(buf) >= 12:
        hlen, start = struct.unpack_from("<I", buf, 8)[0], 12
    else:
        return None
    raw = bytes(buf[start:start + hlen])
    parsed = _HEADERS.get(raw, False)
    if parsed is False:
        parsed = _parse_header(raw)
        if len(_HEADERS) < 4096:
            _HEADERS[raw] = parsed
    if parsed is None:
        return None
    return (*parsed, start + hlen)


def _parse_header(raw: bytes) -> tuple[str, bool, tuple] | None:
    try:
        header = ast.literal_eval(raw.decode("latin1"))
        descr, fortran, shape = header["descr"], bool(header["fortran_order"]), tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError, MemoryError, RecursionError):
        return None
    if not isinstance(descr, str):
        return None  # structured dtypes with a list descr: keep them out of the fast path
    return descr, fortran, shape


Parts = list  # of bytes / memoryview pieces, joined once at the end


def _stacked_npy(parts: list[bytes]) -> Parts | None:
    """The pieces of one .npy holding the N arrays stacked, or None when they differ."""
    headers = [_npy_header(p) for p in parts]
    first = headers[0]
    if first is None or first[1]:
        return None
    descr, _, shape, _ = first
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(descr).itemsize
    for h, p in zip(headers, parts):
        if h is None or h[0] != descr or h[1] or h[2] != shape or len(p) - h[3] != nbytes:
            return None
    return [_header_bytes(descr, (len(parts), *shape))] + [memoryview(p)[h[3]:] for h, p in zip(headers, parts)]


def _header_bytes(descr: str, shape: tuple) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _npz_members(buf: bytes) -> dict[str, bytes] | None:
    if not buf.startswith(b"PK"):
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(buf)) as zf:
            return {name[:-4] if name.endswith(".npy") else name: zf.read(name) for name in zf.namelist()}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None


def _array_npy(array: np.ndarray) -> Parts:
    out = io.BytesIO()
    np.lib.format.write_array(out, np.ascontiguousarray(array), allow_pickle=False)
    return [out.getvalue()]


def _stack_entries(values: list[bytes]) -> dict[str, Parts]:
    """Members (name -> .npy pieces) holding the entries' content."""
    if values and values[0].startswith(NPY_MAGIC):
        stacked = _stacked_npy(values)
        if stacked is not None:
            return {"data": stacked}
    elif values and values[0].startswith(b"PK"):
        members = [_npz_members(v) for v in values]
        if all(m is not None for m in members) and all(m.keys() == members[0].keys() for m in members):
            out = {}
            for name in members[0]:
                stacked = _stacked_npy([m[name] for m in members])  # type: ignore[index]
                if stacked is None:
                    break
                out[f"entry_{name}" if name in RESERVED else name] = stacked
            else:
                return out
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    return {"data": [_header_bytes("|u1", (int(offsets[-1]),)), *values], "offsets": _array_npy(offsets)}


class _Sink:
    """A write-only file for zipfile that keeps the pieces instead of copying them."""

    def __init__(self) -> None:
        self.parts: list = []
        self.size = 0

    def write(self, data) -> int:
        self.parts.append(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass


def build_npz(batch: Batch, values: list[bytes]) -> bytes:
    """The `batch/N.npz` file for `batch` whose entries' contents are `values`."""
    members = _stack_entries(values) if values else {}
    members["keys"] = _array_npy(np.array([m.key.decode("utf-8", "surrogateescape") for m in batch.metas]))
    members["seqs"] = _array_npy(np.array([m.seq for m in batch.metas], dtype=np.int64))
    members["probabilities"] = _array_npy(batch.probabilities.astype(np.float64))
    members["weights"] = _array_npy(batch.weights.astype(np.float64))
    sink = _Sink()
    big = sum(len(p) for parts in members.values() for p in parts) > (1 << 31)
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:  # type: ignore[arg-type]
        for name, parts in members.items():
            with zf.open(name + ".npy", "w", force_zip64=big) as f:
                for part in parts:
                    f.write(part)
    return b"".join(sink.parts)

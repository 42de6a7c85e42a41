"""Value encoding: optional zstd compression and a checksum on every stored value.

The checksum (CRC-32 of the raw content) is computed at encode time and verified after
every decode from disk, so corruption anywhere between the writer's bytes and the
reader's — on disk, in a segment, or in decompression — surfaces as `CorruptValue`.
zstd frames also carry their own checksum of the content (XXH64), which decompression
verifies at memory speed; such values skip the separate CRC pass on read.
Compression is skipped when it does not save at least `MIN_SAVING` of the size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from dataclasses import dataclass

import zstandard

from .backends.crc import crc32
from .errors import CorruptValue

RAW = 0
ZSTD = 1
CODEC_NAMES = {RAW: "none", ZSTD: "zstd"}

MIN_SAVING = 0.10
# Below this size the frame overhead and call cost outweigh any saving.
MIN_COMPRESS_BYTES = 256
# A probe of this many leading bytes decides whether larger values are worth compressing,
# so incompressible data (already-compressed images, random floats) costs little.
PROBE_BYTES = 16 << 10

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstandard contexts are not thread-safe: one per thread and level.
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    comp = cache.get(level)
    if comp is None:
        comp = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                                        write_checksum=True)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "decompressor", None)
    if dec is None:
        dec = _local.decompressor = zstandard.ZstdDecompressor()
    return dec


class Compressibility:
    """What the last value of one stream (a ring's entries) did under compression. A
    stream whose values compress skips the probe (a second compressor call, on the commit's
    critical path, for each value): a value that then does not compress costs one full
    attempt, and the probe is back for the next. Read and written from several threads
    without a lock: a stale answer costs one probe more or less, nothing else."""

    __slots__ = ("compresses",)

    def __init__(self) -> None:
        self.compresses = False


@dataclass(frozen=True)
class Encoded:
    """A value as stored: its stored bytes, the codec used, raw size and checksum."""

    stored: bytes | memoryview  # a view only from encode(copy=False)
    codec: int
    size: int
    checksum: int


def checksum(data: bytes | bytearray | memoryview) -> int:
    return crc32(data) & 0xFFFFFFFF


# ----- CRC-32 of a concatenation from the CRCs of its parts ------------------------------
# A file's checksum from its chunks' checksums, and a batch member's from its entries':
# no byte is read again. zlib has crc32_combine but Python's zlib module does not export
# it: it is called through ctypes (0.6 us), with a pure-Python fallback.

def _gf2_times(mat, vec: int) -> int:
    total, i = 0, 0
    while vec:
        if vec & 1:
            total ^= mat[i]
        vec >>= 1
        i += 1
    return total


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix that carries a CRC-32 register over `nbytes` zero bytes."""
    op = [0xEDB88320] + [1 << n for n in range(31)]  # over one zero bit
    for _ in range(3):
        op = _gf2_square(op)  # one zero byte
    result: list[int] | None = None
    while nbytes:
        if nbytes & 1:
            result = op if result is None else [_gf2_times(op, column) for column in result]
        nbytes >>= 1
        if nbytes:
            op = _gf2_square(op)
    return tuple(result or ())


def _crc32_combine_python(crc1: int, crc2: int, len2: int) -> int:
    if len2 <= 0:
        return crc1
    return (_gf2_times(_zeros_operator(len2), crc1) ^ crc2) & 0xFFFFFFFF


def zeros_crc32(n: int) -> int:
    """crc32(bytes(n)) without the bytes: the register carried over n zero bytes."""
    if n <= 0:
        return 0
    return _gf2_times(_zeros_operator(n), 0xFFFFFFFF) ^ 0xFFFFFFFF


def _zlib_combine():
    try:
        # PyDLL: the call keeps the GIL. It takes about a microsecond; letting go of the GIL
        # and taking it back around each (CDLL) made a large batch's 256 combinations take
        # 1,258 µs instead of 307 beside one busy Python thread.
        lib = ctypes.PyDLL(ctypes.util.find_library("z") or "libz.so.1")
        fn = lib.crc32_combine64
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ulong
    fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64]
    return fn


_combine = _zlib_combine()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B)."""
    if len2 <= 0:
        return crc1
    if _combine is not None:
        return _combine(crc1, crc2, len2) & 0xFFFFFFFF
    return _crc32_combine_python(crc1, crc2, len2)


# Up to this size a value's regions and the whole are checksummed each in turn: reading its
# bytes twice costs less than the CRC combinations (a call into zlib each, 2 or 3 a region)
# that reading them once needs.
READ_TWICE_BYTES = 64 << 10


def checksums(data: bytes | memoryview, regions: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """(CRC-32 of `data`, CRC-32 of each (offset, length) region in it), reading each byte
    once past READ_TWICE_BYTES: the regions' CRCs and those of the gaps between them are
    combined into the whole. Regions must not overlap; their CRCs come back in the order given."""
    view = memoryview(data).cast("B")
    if len(view) <= READ_TWICE_BYTES:  # a small value: read again, cheaper than combining
        return crc32(view), [crc32(view[off:off + length]) for off, length in regions]
    whole, pos = 0, 0
    out = [0] * len(regions)
    for i in sorted(range(len(regions)), key=lambda k: regions[k][0]):
        off, length = regions[i]
        if off > pos:
            whole = crc32_combine(whole, crc32(view[pos:off]), off - pos)
        crc = crc32(view[off:off + length])
        out[i] = crc
        whole = crc32_combine(whole, crc, length)
        pos = off + length
    if pos < len(view):
        whole = crc32_combine(whole, crc32(view[pos:]), len(view) - pos)
    return whole & 0xFFFFFFFF, out


def encode(raw: bytes | bytearray | memoryview, compression: str = "zstd", level: int = 1,
           crc: int | None = None, copy: bool = True, stream: Compressibility | None = None) -> Encoded:
    """Encode `raw` for storage (`crc`: its CRC-32, when known already). Runs in a worker
    thread for large values. `copy=False`: the caller keeps `raw` unchanged while the result
    is used, so a value stored raw is not copied into bytes first (its `stored` is then a
    view of `raw`). `stream`: what the values before it in its stream did (a large value
    of a stream that compresses is compressed whole, without a probe first), updated."""
    plain: bytes | memoryview
    if isinstance(raw, bytes):
        plain = raw
    else:
        plain = bytes(raw) if copy else memoryview(raw)
    view = memoryview(plain)
    crc = checksum(view) if crc is None else crc
    size = len(view)
    if compression == "zstd" and size >= MIN_COMPRESS_BYTES:
        comp = _compressor(level)
        if size > 4 * PROBE_BYTES and (stream is None or not stream.compresses):
            probe = comp.compress(view[:PROBE_BYTES])
            if len(probe) > PROBE_BYTES * (1 - MIN_SAVING):
                return Encoded(plain, RAW, size, crc)
        packed = comp.compress(view)
        compresses = len(packed) <= size * (1 - MIN_SAVING)
        if stream is not None:
            stream.compresses = compresses
        if compresses:
            return Encoded(packed, ZSTD, size, crc)
    return Encoded(plain, RAW, size, crc)


def decode(stored: bytes | memoryview, codec: int, size: int, expected_crc: int, what: str = "value",
           stored_crc: int | None = None) -> bytes:
    """Decode a stored value and verify its checksum; raise CorruptValue on any mismatch.
    `stored_crc`: the CRC-32 of `stored` as its tier verified it, if it did (for a raw
    value that is the content's checksum, so it is not computed twice)."""
    if codec == RAW:
        raw = bytes(stored)
        check_content(raw, size, expected_crc, what, stored_crc)
        return raw
    if codec == ZSTD:
        try:
            frame = zstandard.get_frame_parameters(stored)
            # A frame that records its content size is decoded to that size, whatever
            # max_output_size says: one of another size than the value's is refused
            # before it is decoded (a small frame can claim gigabytes).
            if frame.content_size not in (size, zstandard.CONTENTSIZE_UNKNOWN):
                raise CorruptValue(f"{what}: zstd frame holds {frame.content_size} bytes, expected {size}")
            verified = frame.has_checksum
            raw = _decompressor().decompress(stored, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CorruptValue(f"{what}: zstd frame is corrupt ({exc})") from None
        # (a frame with a content checksum had it checked by decompress)
        check_content(raw, size, expected_crc, what, expected_crc if verified else None)
        return raw
    raise CorruptValue(f"{what}: unknown codec {codec}")


def check_content(data: bytes | memoryview, size: int, expected_crc: int, what: str = "value",
                  known_crc: int | None = None) -> None:
    """Raise CorruptValue unless `data` is a value's `size` bytes with CRC-32
    `expected_crc`. `known_crc`: the CRC-32 of `data` as something verified it already (a
    tier's record checksum), if it did: not computed twice."""
    if len(data) != size:
        raise CorruptValue(f"{what}: decoded {len(data)} bytes, expected {size}")
    if known_crc is not None and known_crc == expected_crc:
        return
    crc = checksum(data)
    if crc != expected_crc:
        raise CorruptValue(f"{what}: checksum mismatch (stored {expected_crc:08x}, read {crc:08x})")

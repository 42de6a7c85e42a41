"""Codec (compression + checksums) and config validation, without FUSE."""

import json
import os

import numpy as np
import pytest

from distorefs import codec
from distorefs.config import BufferConfig, StoreConfig
from distorefs.errors import CorruptValue, InvalidConfig
from distorefs.names import check_name
from distorefs.errors import InvalidName


def frames(n: int = 110 * 1024) -> bytes:
    rng = np.random.default_rng(1)
    base = np.repeat(rng.integers(0, 255, (n // 64,), dtype=np.uint8), 64)
    return base.tobytes()


def test_roundtrip_compressible_uses_zstd():
    raw = frames()
    enc = codec.encode(raw, "zstd", 1)
    assert enc.codec == codec.ZSTD
    assert len(enc.stored) < len(raw) // 4
    assert codec.decode(enc.stored, enc.codec, enc.size, enc.checksum) == raw


def test_incompressible_is_stored_raw():
    raw = os.urandom(200_000)
    enc = codec.encode(raw, "zstd", 1)
    assert enc.codec == codec.RAW
    assert enc.stored == raw


def test_a_stream_whose_values_compress_skips_the_probe(monkeypatch):
    """A ring's values that compress are compressed whole at once (one compressor call, not
    a probe first); one that does not is stored raw all the same, and brings the probe back
    for the next. The stored forms are those encode gives without the stream."""
    calls = []
    real = codec._compressor

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def compress(self, data):
            calls.append(len(data))
            return self.inner.compress(data)

    monkeypatch.setattr(codec, "_compressor", lambda level: Counting(real(level)))
    compressible = (np.arange(40_000) % 251).astype(np.uint8).tobytes() * 4
    noise = os.urandom(len(compressible))
    stream = codec.Compressibility()

    def encode(data, stream):
        calls.clear()
        return codec.encode(data, stream=stream), len(calls)

    assert encode(compressible, stream)[1] == 2 and stream.compresses  # probed: nothing known yet
    enc, n = encode(compressible, stream)
    assert n == 1 and enc == encode(compressible, None)[0] and enc.codec == codec.ZSTD
    enc, n = encode(noise, stream)
    assert n == 1 and enc.codec == codec.RAW and enc == encode(noise, None)[0] and not stream.compresses
    assert encode(noise, stream)[1] == 1  # the probe alone, again
    assert encode(compressible, stream)[1] == 2 and stream.compresses


def test_compression_off_and_small_values():
    assert codec.encode(frames(), "none").codec == codec.RAW
    enc = codec.encode(b"x" * 10, "zstd")
    assert enc.codec == codec.RAW and enc.stored == b"x" * 10
    assert codec.decode(b"", codec.RAW, 0, codec.encode(b"").checksum) == b""


@pytest.mark.parametrize("flip", [0, 100, -1])
def test_corruption_detected(flip):
    raw = frames()
    for compression in ("zstd", "none"):
        enc = codec.encode(raw, compression)
        bad = bytearray(enc.stored)
        bad[flip] ^= 0x40
        with pytest.raises(CorruptValue):
            codec.decode(bytes(bad), enc.codec, enc.size, enc.checksum)



def test_a_frame_that_says_it_holds_more_than_the_value_is_refused_before_it_is_decoded():
    """A zstd frame records its content size, and zstandard then sizes its output from the
    frame, not from max_output_size: a 16 KB frame of a client's (a stager's sent file, a
    spooled value) could make the daemon allocate 512 MiB or more. Such a frame is corrupt
    for a value of another size, and refused before anything is decoded."""
    bomb = codec.encode(b"\0" * (64 << 20), "zstd", 1)
    assert bomb.codec == codec.ZSTD and len(bomb.stored) < 8 << 10
    with pytest.raises(CorruptValue, match="frame"):
        codec.decode(bomb.stored, codec.ZSTD, 10_000, bomb.checksum)
    assert codec.decode(bomb.stored, codec.ZSTD, bomb.size, bomb.checksum) == b"\0" * (64 << 20)

@pytest.mark.parametrize("level", [-100, -5, -1, 1, 3, 22])
def test_zstd_levels_fast_and_normal(level):
    """zstd's fast (negative) levels are accepted and round-trip; a faster level stores more."""
    cfg = BufferConfig.from_json(json.dumps({"compression_level": level}).encode(), BufferConfig())
    assert cfg.compression_level == level
    raw = frames()
    enc = codec.encode(raw, "zstd", level)
    assert enc.codec == codec.ZSTD
    assert codec.decode(enc.stored, enc.codec, enc.size, enc.checksum) == raw


def test_fast_level_trades_ratio():
    rng = np.random.default_rng(2)
    raw = (rng.normal(128, 20, 200_000).clip(0, 255).astype(np.uint8) // 4 * 4).tobytes()
    assert len(codec.encode(raw, "zstd", -10).stored) > len(codec.encode(raw, "zstd", 3).stored)


def test_buffer_config_defaults_and_merge():
    base = BufferConfig()
    merged = BufferConfig.from_json(b'{"capacity": 10, "sampler": "prioritized"}', base)
    assert merged.capacity == 10 and merged.sampler == "prioritized"
    assert merged.alpha == base.alpha
    assert json.loads(merged.to_json())["capacity"] == 10


@pytest.mark.parametrize("text, word", [
    (b'{"capacity": 0}', "capacity"),
    (b'{"capacity": 1.5}', "capacity"),
    (b'{"sampler": "random"}', "sampler"),
    (b'{"alpha": "x"}', "alpha"),
    (b'{"beta": 2}', "beta"),
    (b'{"bogus": 1}', "bogus"),
    (b'{"compression": "lz4"}', "compression"),
    (b'[1, 2]', "object"),
    (b'{not json', "JSON"),
    (b'{"max_times_sampled": -1}', "max_times_sampled"),
    (b'{"alpha": NaN}', "alpha"),
    (b'{"compression_level": 0}', "compression_level"),
    (b'{"compression_level": 23}', "compression_level"),
    (b'{"compression_level": -101}', "compression_level"),
])
def test_invalid_buffer_config_names_the_problem(text, word):
    with pytest.raises(InvalidConfig, match=word):
        BufferConfig.from_json(text, BufferConfig())


def test_store_config_nested_default_buffer():
    config = StoreConfig.from_dict({"cache_bytes": 1 << 20, "default_buffer": {"capacity": 7}})
    assert config.cache_bytes == 1 << 20
    assert isinstance(config.default_buffer, BufferConfig)
    assert config.default_buffer.capacity == 7
    again = StoreConfig.from_json(config.to_json())
    assert again == config
    with pytest.raises(InvalidConfig):
        StoreConfig.from_dict({"segment_bytes": 10})


@pytest.mark.parametrize("name", [b"", b".", b"..", b"a/b", b"a\0b", b"x" * 256])
def test_invalid_names(name):
    with pytest.raises(InvalidName):
        check_name(name)


def test_valid_names():
    for name in (b"a", b"step-1.npy", b"x" * 255, "ünï".encode(), b"with space"):
        assert check_name(name) == name


@pytest.mark.parametrize("size", [0, 1, 300, 64 << 10, (64 << 10) + 1, 300_000])
def test_checksums_of_a_value_and_its_regions_are_zlibs_whichever_way_they_are_computed(size, monkeypatch):
    """codec.checksums reads a small value twice (the whole, then each region) and combines
    a large one's CRCs from one read: both ways give zlib's CRC-32 of the whole and of each
    region, regions given out of order and with gaps between them."""
    import random
    import zlib

    data = random.Random(size).randbytes(size)
    cuts = sorted({0, size, *random.Random(size + 1).sample(range(size + 1), min(size, 6))})
    regions = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2])][::-1]  # every other span, backwards
    expected = (zlib.crc32(data), [zlib.crc32(data[o:o + n]) for o, n in regions])
    assert codec.checksums(data, regions) == expected
    monkeypatch.setattr(codec, "READ_TWICE_BYTES", -1)  # every value the combining way
    assert codec.checksums(data, regions) == expected


def test_zlibs_crc_combination_is_called_keeping_the_gil():
    """codec.crc32_combine calls zlib without letting go of the GIL (ctypes.PyDLL): a call
    takes about a microsecond, and a large batch makes hundreds, each of which would
    otherwise wait to take the GIL back from any busy thread."""
    import ctypes

    if codec._combine is None:
        pytest.skip("no zlib with crc32_combine64 on this machine: the pure-Python combination is used")
    assert codec._combine._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    assert codec.crc32_combine(0x12345678, 0x9ABCDEF0, 1000) == codec._crc32_combine_python(0x12345678, 0x9ABCDEF0, 1000)

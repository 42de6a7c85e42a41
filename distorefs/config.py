"""Configuration dataclasses for the store and for each namespace, validated on load.

A config is parsed from JSON with `from_json`, which rejects unknown keys and bad
values with `InvalidConfig` naming the offending key and value; `to_dict` gives back
the JSON form shown in `config.json` files. Nothing here touches disk.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import InvalidArgument, InvalidConfig

SAMPLERS = ("uniform", "prioritized", "fifo", "lifo")
RING_REMOVERS: tuple[str, ...] = ("fifo", "lifo", "uniform")  # distorefs/removers.py
BUFFER_REMOVERS = RING_REMOVERS + ("lowest_priority",)  # buffers have priorities
SEQUENCE_PRIORITIES = ("max", "mean")
MAX_SEQUENCE_LENGTH = 65536
MIN_LEVEL = -100  # zstd's fast (negative) levels trade ratio for speed; below this they barely compress
COMPRESSIONS = ("zstd", "none")

T = TypeVar("T", bound="_Config")


class _Config:
    """Shared JSON parsing and validation for the config dataclasses."""

    def validate(self) -> None:  # pragma: no cover - overridden
        pass

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> bytes:
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_dict(cls: type[T], data: Any, base: T | None = None) -> T:
        """Build a config from `data`; keys missing from it come from `base` (or defaults)."""
        if not isinstance(data, dict):
            raise InvalidConfig(f"config must be a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise InvalidConfig(f"unknown config key(s): {', '.join(unknown)}")
        # A shallow copy keeps nested config objects as objects (asdict would flatten them).
        values = {f: getattr(base, f) for f in fields} if base is not None else {}
        for name, value in data.items():
            values[name] = _coerce(name, value, fields[name].type)
        try:
            config = cls(**values)
        except TypeError as exc:  # a required field is missing
            raise InvalidConfig(str(exc)) from None
        config.validate()
        return config

    @classmethod
    def from_json(cls: type[T], text: bytes | str, base: T | None = None) -> T:
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidConfig(f"config is not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidConfig("config is nested too deeply to be a configuration") from None
        return cls.from_dict(data, base)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    kind = str(annotation)
    if kind.endswith(" | None"):  # optional: null means "derived" (see the field's docs)
        if value is None:
            return None
        kind = kind[:-len(" | None")]
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise InvalidConfig(f"{name} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidConfig(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise InvalidConfig(f"{name} must be finite, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise InvalidConfig(f"{name} must be a string, got {value!r}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise InvalidConfig(f"{name} must be true or false, got {value!r}")
        return value
    if kind == "dict":
        if not isinstance(value, dict):
            raise InvalidConfig(f"{name} must be a JSON object, got {value!r}")
        return value
    return value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidConfig(message)


@dataclass
class RingConfig(_Config):
    """Settings shared by every FIFO ring namespace (replay buffers and memory banks)."""

    capacity: int = 100_000
    max_bytes: int = 0
    max_entry_bytes: int = 64 << 20
    compression: str = "zstd"
    compression_level: int = 1
    # False: a value that lands in the LMDB (hot) tier is stored as written and compressed
    # when it is demoted to NVMe (what is evicted first is never compressed); True: at insert
    compress_hot: bool = False
    evict_when_full: bool = True  # a full NVMe tier evicts the oldest entries instead of ENOSPC
    evict: str = "fifo"  # which entries leave past capacity or max_bytes (distorefs/removers.py)

    removers = RING_REMOVERS

    def validate(self) -> None:
        _require(self.evict in self.removers,
                 f"evict must be one of {', '.join(self.removers)}, got {self.evict!r}")
        _require(self.capacity >= 1, f"capacity must be >= 1, got {self.capacity}")
        _require(self.capacity <= 1 << 32, f"capacity must be <= 2**32, got {self.capacity}")
        _require(self.max_bytes >= 0, f"max_bytes must be >= 0 (0 = no limit), got {self.max_bytes}")
        _require(self.max_entry_bytes >= 1, f"max_entry_bytes must be >= 1, got {self.max_entry_bytes}")
        _require(self.compression in COMPRESSIONS,
                 f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        _require(MIN_LEVEL <= self.compression_level <= 22 and self.compression_level != 0,
                 f"compression_level must be in {MIN_LEVEL}..-1 (zstd's fast levels) or 1..22, "
                 f"got {self.compression_level}")


@dataclass
class BankConfig(RingConfig):
    """A memory bank (banks/NAME/config.json): a ring with nothing more."""


# Priorities are summed (as p**alpha, alpha <= 10) over up to 2**32 entries: above this bound
# the sum could overflow to inf and every draw would fail. Refused (EINVAL), not clamped.
MAX_PRIORITY = 1e15
# Bounds of the rate limiter's settings: its counts times samples_per_insert stay exact in
# a float far beyond any buffer's life.
MAX_SAMPLES_PER_INSERT = 1e6
MAX_ERROR_BUFFER = 1e12


def check_priority(key: bytes, value: float) -> None:
    """InvalidArgument unless `value` is a usable priority: finite, >= 0, <= MAX_PRIORITY."""
    if not (math.isfinite(value) and 0 <= value <= MAX_PRIORITY):
        raise InvalidArgument(f"priority of {key!r} must be a number in [0, {MAX_PRIORITY:g}], got {value}")


def priority_text(value: float) -> bytes:
    """A priority as `priorities` and the `priority` attribute show it: the shortest text
    that reads back as the same float (so an export and import restore it exactly), and a
    whole number without ".0" (7, not 7.0)."""
    text = repr(float(value))
    return (text[:-2] if text.endswith(".0") else text).encode()


@dataclass
class BufferConfig(RingConfig):
    """A replay buffer: a ring plus a sampler (DESIGN.md §2, buffers/NAME/config.json)."""

    removers = BUFFER_REMOVERS

    sampler: str = "uniform"
    alpha: float = 0.6
    beta: float = 0.4
    initial_priority: float = 0.0
    max_times_sampled: int = 0
    min_size_to_sample: int = 1
    presample_batches: int = 2
    seed: int = 0
    # The layout of every entry (distorefs/layout.py: an .npy or an .npz of named arrays):
    # null until the first entry fixes it; `raw`: entries are any bytes, batches concatenate.
    schema: dict | None = None
    raw: bool = False
    # Sequence sampling (distorefs/sequences.py): keys EPISODE<sequence_separator>STEP[.ext] group
    # the entries into episodes, and a draw is of sequence_length consecutive steps (0: of entries).
    sequence_length: int = 0
    sequence_stride: int = 1  # a step whose number is a multiple of it may start a sequence
    sequence_priority: str = "max"  # a sequence's priority: the max or the mean of its steps'
    sequence_separator: str = "."
    # The sample-to-insert rate limiter (distorefs/ratelimit.py): 0 or null, none.
    samples_per_insert: float | None = None
    error_buffer: float | None = None

    def validate(self) -> None:
        super().validate()
        if self.raw:
            self.schema = None  # raw mode: entries of any layout; batches concatenate them
        elif self.schema is not None:
            from .layout import Layout  # layout needs numpy; config stays importable without it
            self.schema = Layout.from_json(self.schema).to_json()  # normalised: dtype strings like '<f4'

        _require(self.sampler in SAMPLERS,
                 f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        _require(0.0 <= self.alpha <= 10.0, f"alpha must be in [0, 10], got {self.alpha}")
        _require(0.0 <= self.beta <= 1.0, f"beta must be in [0, 1], got {self.beta}")
        _require(0.0 <= self.initial_priority <= MAX_PRIORITY,
                 f"initial_priority must be in [0, {MAX_PRIORITY:g}] (0 = the max priority seen so far), "
                 f"got {self.initial_priority}")
        _require(self.max_times_sampled >= 0,
                 f"max_times_sampled must be >= 0 (0 = no limit), got {self.max_times_sampled}")
        _require(self.min_size_to_sample >= 1,
                 f"min_size_to_sample must be >= 1, got {self.min_size_to_sample}")
        _require(self.min_size_to_sample <= self.capacity,  # else every sample/N would wait forever
                 f"min_size_to_sample ({self.min_size_to_sample}) must not exceed capacity ({self.capacity})")
        _require(0 <= self.presample_batches <= 64,
                 f"presample_batches must be in 0..64, got {self.presample_batches}")
        self._validate_sequences()
        self._validate_rate_limiter()

    def _validate_sequences(self) -> None:
        _require(0 <= self.sequence_length <= MAX_SEQUENCE_LENGTH,
                 f"sequence_length must be in 0..{MAX_SEQUENCE_LENGTH} (0: no sequences), got {self.sequence_length}")
        _require(1 <= self.sequence_stride <= MAX_SEQUENCE_LENGTH,
                 f"sequence_stride must be in 1..{MAX_SEQUENCE_LENGTH}, got {self.sequence_stride}")
        _require(self.sequence_priority in SEQUENCE_PRIORITIES,
                 f"sequence_priority must be one of {', '.join(SEQUENCE_PRIORITIES)}, got {self.sequence_priority!r}")
        sep = self.sequence_separator
        # a digit would make the step ambiguous; '/' and NUL cannot be in a file name
        _require(1 <= len(sep) <= 8 and not any(c.isdigit() or c in "/\0" for c in sep),
                 f"sequence_separator must be 1..8 characters, no digit, '/' or NUL, got {sep!r}")
        if self.sequence_length:
            # sequences are drawn with replacement from a distribution: not queues, and an entry
            # spent by one sequence would cut every other sequence through it
            _require(self.sampler in ("uniform", "prioritized"),
                     f"sequence_length needs sampler uniform or prioritized, got {self.sampler!r}")
            _require(self.max_times_sampled == 0,
                     f"sequence_length and max_times_sampled cannot be combined, got max_times_sampled "
                     f"{self.max_times_sampled}")

    def _validate_rate_limiter(self) -> None:
        spi, error = self.samples_per_insert, self.error_buffer
        _require(spi is None or 0 <= spi <= MAX_SAMPLES_PER_INSERT,
                 f"samples_per_insert must be in [0, {MAX_SAMPLES_PER_INSERT:g}] (0 or null: no rate limiter), "
                 f"got {spi}")
        _require(error is None or 0 <= error <= MAX_ERROR_BUFFER,
                 f"error_buffer must be in [0, {MAX_ERROR_BUFFER:g}], got {error}")
        if spi:
            # Reverb's rule: a smaller range could hold both sides back for good (an insert
            # moves the error by samples_per_insert, a sample by 1)
            need = max(1.0, spi)
            _require(error is not None and error >= need,
                     f"error_buffer must be >= max(1, samples_per_insert) = {need:g} with samples_per_insert "
                     f"{spi:g}, or inserts and samples could both wait for good; got {error}")


@dataclass
class DatasetConfig(_Config):
    """A dataset (datasets/NAME/config.json)."""

    compression: str = "zstd"
    compression_level: int = 1
    chunk_bytes: int = 4 << 20
    max_item_bytes: int = 256 << 20  # the largest file written through the mount (EFBIG past it)

    def validate(self) -> None:
        _require(self.compression in COMPRESSIONS,
                 f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        _require(MIN_LEVEL <= self.compression_level <= 22 and self.compression_level != 0,
                 f"compression_level must be in {MIN_LEVEL}..-1 (zstd's fast levels) or 1..22, "
                 f"got {self.compression_level}")
        _require(64 << 10 <= self.chunk_bytes <= 256 << 20,
                 f"chunk_bytes must be in 64 KiB..256 MiB, got {self.chunk_bytes}")
        _require(self.max_item_bytes >= 1, f"max_item_bytes must be >= 1, got {self.max_item_bytes}")


# The configuration of each kind of namespace that has a config.json of its own.
NAMESPACE_CONFIGS: dict[str, type[_Config]] = {"buffers": BufferConfig, "banks": BankConfig,
                                               "datasets": DatasetConfig}


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def default_memory_bytes() -> int:
    """A quarter of the machine's memory, between 1 GiB and 32 GiB."""
    return max(1 << 30, min(32 << 30, physical_memory() // 4))


@dataclass
class WeightsConfig(_Config):
    """The parameter server (weights/config.json)."""

    keep_versions: int = 2
    chunk_bytes: int = 4 << 20
    compression: str = "none"
    max_file_bytes: int = 64 << 30  # a write or truncate past it fails with EFBIG

    def validate(self) -> None:
        _require(1 <= self.keep_versions <= 1000, f"keep_versions must be in 1..1000, got {self.keep_versions}")
        _require(1 <= self.max_file_bytes <= 1 << 50, f"max_file_bytes must be in 1..2^50, got {self.max_file_bytes}")
        _require(64 << 10 <= self.chunk_bytes <= 256 << 20,
                 f"chunk_bytes must be in 64 KiB..256 MiB, got {self.chunk_bytes}")
        _require(self.compression in COMPRESSIONS,
                 f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")


@dataclass
class CheckpointsConfig(_Config):
    """Checkpoints (checkpoints/config.json): write-back budget, retention, step closing."""

    writeback_bytes: int | None = None  # None: the store's write-back share of memory_bytes
    keep_last: int = 3
    seal_after: float = 5.0  # seconds without writes after which a step nobody writes is closed
    chunk_bytes: int = 8 << 20
    compression: str = "none"
    max_file_bytes: int = 16 << 40  # a write or truncate past it fails with EFBIG (sparse files stay sparse)

    def validate(self) -> None:
        _require(64 << 10 <= self.chunk_bytes <= 256 << 20,
                 f"chunk_bytes must be in 64 KiB..256 MiB, got {self.chunk_bytes}")
        _require(1 <= self.max_file_bytes <= 1 << 50, f"max_file_bytes must be in 1..2^50, got {self.max_file_bytes}")
        _require(self.writeback_bytes is None or self.writeback_bytes >= 4 * self.chunk_bytes,
                 f"writeback_bytes must be at least 4 chunks ({4 * self.chunk_bytes}), got {self.writeback_bytes}")
        _require(1 <= self.keep_last <= 100000, f"keep_last must be in 1..100000, got {self.keep_last}")
        _require(0 <= self.seal_after <= 86400,
                 f"seal_after must be in 0..86400 seconds (0: only a newer step or an fsync of the step "
                 f"directory closes it), got {self.seal_after}")
        _require(self.compression in COMPRESSIONS,
                 f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")


@dataclass
class NvmeDir(_Config):
    """One directory of the NVMe segment tier; capacity_bytes 0: what its file system has."""

    path: str = ""
    capacity_bytes: int = 0

    def validate(self) -> None:
        _require(bool(self.path) and self.path.startswith("/"),
                 f"an NVMe directory needs an absolute path, got {self.path!r}")
        _require(self.capacity_bytes >= 0, f"capacity_bytes of {self.path} must be >= 0, got {self.capacity_bytes}")


@dataclass
class StoreConfig(_Config):
    """Store-wide settings, kept in the store and shown in .distorefs/config.json.

    Memory: `memory_bytes` bounds everything the daemon caches or buffers. It is shared
    by the memory tier (`cache_bytes`), read-ahead (`prefetch_bytes`: dataset prefetch
    and pre-sampled batches), checkpoint write-back (checkpoints/config.json
    `writeback_bytes`) and values on their way into the kernel page cache; a share left
    null is derived (see `distorefs.memory`), one set explicitly is taken as is.
    Disk: `lmdb_bytes` bounds the values the LMDB (hot) tier holds; `nvme_dirs` lists the
    segment directories, each with an optional capacity (none: STORE/segments)."""

    segment_threshold: int = 512 << 10
    segment_bytes: int = 256 << 20
    nvme_dirs: list = field(default_factory=list)
    memory_bytes: int = field(default_factory=default_memory_bytes)
    cache_bytes: int | None = None
    prefetch_bytes: int | None = None
    lmdb_bytes: int = 4 << 30
    max_space_overhead: float = 1.5
    sync_interval: float = 1.0
    entry_timeout: float = 300.0
    read_ahead_kb: int = 4096  # the mount's kernel read-ahead (root only; the kernel's default is 128)
    max_batch_entries: int = 65536
    max_batch_bytes: int = 1 << 30
    default_buffer: BufferConfig = field(default_factory=BufferConfig)

    def validate(self) -> None:
        _require(self.segment_threshold >= 0, f"segment_threshold must be >= 0, got {self.segment_threshold}")
        _require(self.segment_bytes >= 1 << 20, f"segment_bytes must be >= 1 MiB, got {self.segment_bytes}")
        _require(self.memory_bytes >= 16 << 20, f"memory_bytes must be >= 16 MiB, got {self.memory_bytes}")
        for name in ("cache_bytes", "prefetch_bytes"):
            value = getattr(self, name)
            _require(value is None or value >= 0, f"{name} must be >= 0 (or null: a share of memory_bytes), "
                                                  f"got {value}")
        explicit = sum(v for v in (self.cache_bytes, self.prefetch_bytes) if v)
        _require(explicit <= self.memory_bytes,
                 f"cache_bytes + prefetch_bytes ({explicit}) exceed memory_bytes ({self.memory_bytes})")
        _require(self.lmdb_bytes >= 0, f"lmdb_bytes must be >= 0 (0: every value on NVMe), got {self.lmdb_bytes}")
        _require(1.05 <= self.max_space_overhead <= 100,
                 f"max_space_overhead must be in 1.05..100 (on-disk bytes / live bytes), got {self.max_space_overhead}")
        _require(self.sync_interval > 0, f"sync_interval must be > 0 seconds, got {self.sync_interval}")
        _require(self.entry_timeout >= 0, f"entry_timeout must be >= 0 seconds, got {self.entry_timeout}")
        _require(0 < self.read_ahead_kb <= 1 << 20, f"read_ahead_kb must be in 1..1048576, got {self.read_ahead_kb}")
        _require(self.max_batch_entries >= 1, f"max_batch_entries must be >= 1, got {self.max_batch_entries}")
        _require(self.max_batch_bytes >= 1 << 20, f"max_batch_bytes must be >= 1 MiB, got {self.max_batch_bytes}")
        paths = [d.path for d in self.nvme_dirs]
        _require(len(set(paths)) == len(paths), f"nvme_dirs lists a directory twice: {paths}")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["nvme_dirs"] = [d.to_dict() for d in self.nvme_dirs]
        return out

    @classmethod
    def from_dict(cls, data: Any, base: "StoreConfig | None" = None) -> "StoreConfig":
        if not isinstance(data, dict):
            raise InvalidConfig(f"config must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        buffer_base = base.default_buffer if base else None
        data["default_buffer"] = BufferConfig.from_dict(data.get("default_buffer", {}), buffer_base)
        if "nvme_dir" in data:  # the one-directory form of earlier versions
            legacy = data.pop("nvme_dir")
            data.setdefault("nvme_dirs", [{"path": legacy}] if legacy else [])
        if "nvme_dirs" in data:
            dirs = data["nvme_dirs"]
            if not isinstance(dirs, list):
                raise InvalidConfig(f"nvme_dirs must be a list of {{path, capacity_bytes}}, got {dirs!r}")
            data["nvme_dirs"] = [d if isinstance(d, NvmeDir) else NvmeDir.from_dict(
                {"path": d} if isinstance(d, str) else d) for d in dirs]
        config = super().from_dict(data, base)
        return config

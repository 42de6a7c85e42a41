"""Prometheus text exposition (format 0.0.4) of the store's stats.

`prometheus_text(stats)` turns the dict `.distorefs/stats.json` shows into metric
families: per-namespace fields become one family each with `kind` and `name` labels
(`distorefs_namespace_entries{kind="buffers",name="replay"}`), per-tier fields get a
`tier` label, everything else is flattened by its path (`distorefs_memory_cache_hits`).
Monotonic counts are typed `counter` and end in `_total`; the rest are gauges. Served at
`MNT/.distorefs/metrics` and by `distorefs stats --prometheus`; no FUSE here.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterator

PREFIX = "distorefs"
NAMESPACE_SECTIONS = ("buffers", "banks", "datasets")

# Fields that only ever grow while the daemon runs (Prometheus counters).
COUNTERS = frozenset({
    "inserts", "rewrites", "deletes", "evictions", "reads", "read_bytes", "inserted_bytes", "batches",
    "sampled_entries", "presampled_used", "priority_updates", "priority_unknown_keys", "exhausted",
    "corrupt_reads", "disk_reads", "disk_read_bytes", "syncs", "segment_bytes_freed", "groups", "changes",
    "failures", "hits", "misses", "late", "skipped", "pushed", "publishes", "versions_collected",
    "bytes_published", "renames", "invalidations", "staged", "staged_bytes", "staged_sent", "stage_errors", "verify_failures",
    "orders", "evicted", "puts", "bytes_written", "bytes_persisted", "chunks_persisted", "file_commits",
    "steps_completed", "steps_removed", "steps_reopened", "chunk_reloads", "abandoned_files", "persist_failures",
    "stale_readers_cleared", "spooled_inserts", "elsewhere",
})

_HELP = {
    "uptime_s": "Seconds since the store was opened.",
    "namespace_entries": "Entries in the namespace.",
    "namespace_bytes": "Raw bytes of the namespace's entries.",
    "namespace_stored_bytes": "Stored (compressed) bytes of the namespace's entries.",
    "tier_used_bytes": "Bytes the tier occupies on disk.",
    "tier_live_bytes": "Bytes of values still referenced in the tier.",
    "corrupt_reads_total": "Values that failed their checksum when read (EIO).",
}

_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(*parts: str) -> str:
    name = "_".join(p for p in parts if p)
    name = _NAME_OK.sub("_", name)
    return name if not name[:1].isdigit() else "_" + name


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return None


def _format(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else repr(value)


def _leaves(data: dict, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, path + (str(key),))
        else:
            number = _number(value)
            if number is not None:
                yield path + (str(key),), number


class _Families:
    def __init__(self) -> None:
        self.families: dict[str, tuple[str, list[tuple[dict[str, str], float]]]] = {}

    def add(self, path: tuple[str, ...], value: float, labels: dict[str, str]) -> None:
        counter = path[-1] in COUNTERS
        name = _metric_name(PREFIX, *path) + ("_total" if counter and not path[-1].endswith("_total") else "")
        kind, samples = self.families.setdefault(name, ("counter" if counter else "gauge", []))
        samples.append((labels, value))

    def render(self) -> str:
        lines = []
        for name in sorted(self.families):
            kind, samples = self.families[name]
            short = name[len(PREFIX) + 1:]
            lines.append(f"# HELP {name} {_HELP.get(short, short.replace('_', ' ') + '.')}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                text = ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items())
                lines.append(f"{name}{{{text}}} {_format(value)}" if text else f"{name} {_format(value)}")
        return "\n".join(lines) + "\n"


def prometheus_text(stats: dict) -> str:
    """The Prometheus text exposition of a stats dict (see the module docstring)."""
    families = _Families()
    info = {k: str(stats[k]) for k in ("version", "store") if k in stats}
    if info:
        families.add(("info",), 1.0, info)
    for key, value in stats.items():
        if key in NAMESPACE_SECTIONS and isinstance(value, dict):
            for name, ns in value.items():
                if isinstance(ns, dict):
                    for path, number in _leaves({k: v for k, v in ns.items() if k != "tiers"}):
                        families.add(("namespace",) + path, number, {"kind": key, "name": str(name)})
                    for tier, fields in (ns.get("tiers") or {}).items():
                        for path, number in _leaves(fields if isinstance(fields, dict) else {}):
                            families.add(("namespace_tier",) + path, number,
                                         {"kind": key, "name": str(name), "tier": str(tier)})
        elif key == "tiers" and isinstance(value, dict):
            for tier, fields in value.items():
                for path, number in _leaves(fields if isinstance(fields, dict) else {}):
                    families.add(("tier",) + path, number, {"tier": str(tier)})
        elif key == "ops":
            continue  # the sum of the per-namespace counters: Prometheus sums them itself
        elif isinstance(value, dict):
            for path, number in _leaves(value):
                families.add((key,) + path, number, {})
        else:
            scalar = _number(value)
            if scalar is not None:
                families.add((key,), scalar, {})
    return families.render()


__all__ = ["prometheus_text", "COUNTERS"]

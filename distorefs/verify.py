"""Offline check of a whole store (`distorefs verify STORE [--repair]`), as small named passes.

The check takes the store's lock (so a mounted store, or a second verify, is refused),
opens the LMDB environment and the segment directory directly (no `Store`: opening one
would start a new segment and run load-time fixes), and runs its passes in order:

  catalog       the store's format version and its LMDB databases are known
  namespaces    every namespace record parses; ids unique and below next_ns
  ring-entries  buffer and bank entries belong to a namespace, parse, have valid unique keys
  ring-indexes  every priority and times-sampled row has its entry; priorities finite and >= 0
  weights-tree  every weights node parses and is reachable from the root
  datasets      dataset records belong to a dataset; items and index chunks parse
  checkpoints   checkpoint nodes parse; every stored chunk belongs to a file node
  values        every referenced value reads back whole and matches its checksum
  lmdb-space    every value in LMDB is referenced; the live-bytes counter is right
  segments      every referenced segment exists; per-segment accounting matches; dead space

A `Store` opening a store that was not closed cleanly runs the same passes, less `values`,
with repair (distorefs/recovery.py), through `run_passes` on the store it has locked.

The passes up to `checkpoints` read the metadata and register every value a record points
at (`Check.ref`); the last three compare those references with what the tiers hold.
A finding is an *error* (inconsistent or corrupt), a *leak* (space nothing will ever
free) or *space* (dead space the daemon's own collector frees; not a failure).

Repairs (`--repair`) only ever do what is safe: delete rows that point at nothing
(priorities of a deleted entry, entries of a dropped namespace), re-attach unreachable
weights nodes under `weights/lost+found-ID`, rewrite counters and accounting from the
references, free values and segment files nothing references. Corrupt or missing values
are never "repaired": the entry stays, reads fail with EIO, `rm` through the mount drops
it. Freeing unreferenced space needs every reference to be known, so it is skipped
(and said) when a database no pass knows is present or a record did not parse.

Crash windows (developer note), and the pass that covers each:
- kill -9 in a group commit: LMDB has the whole transaction or none; bytes appended to a
  segment for a lost transaction are dead records (segments: dead bytes; a file with no
  live record is reclaimable space, the daemon's collector unlinks it at its next sync).
- kill -9 between an LMDB sync and a segment write of a later group: impossible by the
  sync order (segments first), so values never point past a segment's end; if they do
  (lost disk cache), `values` reports each one.
- kill -9 while a replaced or unlinked weights version is still open: its chunks were
  kept for the reader and no record references them after the crash (lmdb-space and
  segments report a leak; --repair frees it).

Adding a namespace kind: write a pass that reads its records, calls
`check.ref(...)` for every value it points at and `check.claim(DB)` for its databases,
and register it with `@verify_pass("name", before="values")`.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from . import codec, priojournal
from .backends.crc import crc32
from .backends.errors import BackendError
from .backends.lmdbenv import LmdbEnv
from .backends.lmdbvalues import DB_TIERMETA, DB_VALUES
from .backends.segments import DB_SEGMENTS, SegmentDir
from .catalog import (DB_ENTRIES, DB_META, DB_NS, DB_PRIO, DB_SAMPLED, FORMAT_VERSION, EntryMeta, pack_u32,
                      split_entry_key, unpack_u32)
from .config import NAMESPACE_CONFIGS, StoreConfig
from .errors import CorruptValue, DamagedStore, DistorefsError, InvalidName, NotFound, from_backend
from .lockfile import take_lock
from .names import check_name
from .priojournal import DB_PRIOLOG, DB_PRIOSNAP
from .placement import TIER_CLUSTER, TIER_LMDB, TIER_NAMES, TIER_NVME
from .values import StoredValue, ValueLayer

# What a pass may meet in damaged metadata; it is reported and the check goes on.
PASS_FAILURES = (BackendError, struct.error, ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError,
                 OverflowError)
RING_KINDS = ("buffers", "banks")

ERROR, LEAK, SPACE, NOTE = "error", "leak", "space", "note"

# Exit codes, as fsck(8): 0 clean, 1 problems found and all repaired, 4 problems left,
# 8 the check could not run (store in use, not a store).
EXIT_CLEAN, EXIT_REPAIRED, EXIT_PROBLEMS, EXIT_FAILED = 0, 1, 4, 8


@dataclass
class Finding:
    check: str  # the pass
    kind: str  # error | leak | space | note
    message: str
    repair: str = ""  # what --repair did (empty: nothing)
    bytes: int = 0  # space involved (leaks and dead space)
    # The damage is confined to stored values whose reads fail with EIO (missing or corrupt
    # data): the store stays usable and `rm` through the mount drops them, so such an
    # error does not keep a store from being mounted (see Report.blocking).
    eio: bool = False

    def as_dict(self) -> dict:
        return {"pass": self.check, "kind": self.kind, "message": self.message, "repair": self.repair,
                "bytes": self.bytes, "eio": self.eio}


@dataclass
class Whole:
    """A file stored as chunks (a weights version, a dataset item): checked whole too."""

    what: str
    size: int
    checksum: int | None
    crc: int = 0
    seen: int = 0
    bad: bool = False


@dataclass(slots=True)
class Ref:
    """One stored value a record points at."""

    what: str
    value: StoredValue
    whole: Whole | None = None

    @property
    def tier(self) -> int:
        return self.value.tier

    @property
    def loc(self) -> bytes:
        return self.value.loc

    @property
    def stored_size(self) -> int:
        return self.value.stored_size


@dataclass
class Report:
    store: str
    repair: bool
    findings: list[Finding] = field(default_factory=list)
    passes: dict[str, str] = field(default_factory=dict)  # pass -> one-line summary
    counts: dict[str, int] = field(default_factory=dict)
    damaged: str = ""  # the LMDB file cannot be read whole: what failed (nothing was repaired)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.kind in (ERROR, LEAK)]

    @property
    def unrepaired(self) -> list[Finding]:
        return [f for f in self.problems if not f.repair]

    @property
    def blocking(self) -> list[Finding]:
        """Unrepaired inconsistencies of the metadata: a store with any is not mounted (a leak
        only wastes space; an EIO finding only fails reads of its values)."""
        return [f for f in self.unrepaired if f.kind == ERROR and not f.eio]

    @property
    def exit_code(self) -> int:
        if not self.problems:
            return EXIT_CLEAN
        return EXIT_PROBLEMS if self.unrepaired else EXIT_REPAIRED

    def as_dict(self) -> dict:
        return {"store": self.store, "repair": self.repair, "exit_code": self.exit_code, "damaged": self.damaged,
                "passes": self.passes, "counts": self.counts,
                "problems": len(self.problems), "unrepaired": len(self.unrepaired),
                "blocking": len(self.blocking),
                "findings": [f.as_dict() for f in self.findings]}


# ----- the pass registry ----------------------------------------------------------------

@dataclass(frozen=True)
class VerifyPass:
    name: str
    fn: Callable[["Check"], str | None]
    doc: str


PASSES: list[VerifyPass] = []


def verify_pass(name: str, before: str | None = None):
    """Register a pass (a function of the Check, returning a one-line summary)."""
    def register(fn):
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        entry = VerifyPass(name, fn, doc)
        names = [p.name for p in PASSES]
        PASSES.insert(names.index(before) if before in names else len(PASSES), entry)
        return fn
    return register


# ----- the check ------------------------------------------------------------------------

class Check:
    """State shared by the passes of one run: the open store, references, findings."""

    def __init__(self, path: Path, repair: bool, progress: bool, report: Report) -> None:
        self.path = path
        self.repair = repair
        self.progress = progress
        self.report = report
        self.current = ""
        try:
            self.env = LmdbEnv(path / "meta")
        except BackendError as exc:  # a data file LMDB could not map safely: DamagedStore
            raise from_backend(exc) from None
        names = set(self.env.db_names())
        self.db_names = names
        # Open what exists (plus the tiers' own dbs, which a store always has) and no more.
        for name in names:
            self.env.db(name)
        raw = self.env.read(lambda txn: _copy(txn.get(b"config", db=DB_META))) if DB_META in names else None
        self.config = StoreConfig.from_json(raw) if raw else StoreConfig()
        dirs = [SegmentDir(Path(d.path), d.capacity_bytes) for d in self.config.nvme_dirs] \
            or [SegmentDir(path / "segments")]
        # Values are read through the value layer (codec, checksums) but no directory is
        # made: a drive not mounted must not be stood in for by an empty directory.
        self.values = ValueLayer(self.env, self.config, dirs, create_dirs=False)
        self.lmdb = self.values.lmdb
        self.segments = self.values.nvme
        self.tiers = self.values.tiers
        self.claimed: set[bytes] = {DB_VALUES, DB_TIERMETA, DB_SEGMENTS}
        self.refs: list[Ref] = []
        self.ref_at: dict[tuple[int, bytes], str] = {}
        self.complete = True  # every reference is known: unreferenced space may be freed
        self.incomplete_why: list[str] = []
        # filled by the namespace pass, used by later ones: id -> (kind, name, record)
        self.ns_by_id: dict[int, tuple[str, str, dict]] = {}
        self.entry_keys: dict[bytes, str] = {}  # entries-db key -> kind of its namespace
        self.format = FORMAT_VERSION  # the store's, read by the catalog pass (records differ by format)

    # -- helpers for passes ----------------------------------------------------------

    def db(self, name: bytes) -> bytes | None:
        """The named database (its name, for `Txn` calls), or None if the store has none."""
        self.claimed.add(name)
        return name if name in self.db_names else None

    def claim(self, name: bytes) -> None:
        self.claimed.add(name)

    def read(self, fn):
        return self.env.read(fn)

    def scan(self, db, batch: int = 4096):
        """Every (key, value) of `db` in key order, copied out; one read transaction per
        batch of rows, so memory stays flat on big stores."""
        after = b""
        while True:
            def rows_after(txn, after=after):
                cur = txn.cursor(db=db)
                out = []
                if not cur.set_range(after):
                    return out
                for k, v in cur:
                    k = bytes(k)
                    if k == after:
                        continue
                    out.append((k, bytes(v)))
                    if len(out) >= batch:
                        break
                return out
            rows = self.read(rows_after)
            if not rows:
                return
            yield from rows
            after = rows[-1][0]

    def write(self, fn) -> None:
        self.env.write(fn)

    def find(self, kind: str, message: str, repair: str = "", nbytes: int = 0) -> Finding:
        finding = Finding(self.current, kind, message, repair, nbytes)
        self.report.findings.append(finding)
        return finding

    def error(self, message: str, fix: Callable | None = None, did: str = "", *, eio: bool = False) -> Finding:
        """An inconsistency; `fix(txn)` repairs it (run now in --repair mode), `did` says how;
        `eio`: it only makes reads of some values fail (Finding.eio)."""
        finding = self.find(ERROR, message)
        finding.eio = eio
        if fix is not None and self.repair:
            self.write(fix)
            finding.repair = did or "repaired"
        return finding

    def incomplete(self, why: str) -> None:
        """Some references could not be read: freeing 'unreferenced' space is unsafe."""
        self.complete = False
        self.incomplete_why.append(why)

    def ref(self, what: str, value: StoredValue, whole: Whole | None = None) -> None:
        tier, loc = value.tier, value.loc
        if tier == TIER_CLUSTER:  # a shared store's value: its cluster keeps it, not this node
            self.report.counts["cluster_values"] = self.report.counts.get("cluster_values", 0) + 1
            return
        if tier not in self.tiers:
            self.error(f"{what}: unknown tier {tier}")
            self.incomplete(f"{what} names an unknown tier")
            return
        other = self.ref_at.get((tier, loc))
        if other is not None:
            self.error(f"{what} and {other} point at the same stored value ({TIER_NAMES[tier]} {loc.hex()}): "
                       f"removing one frees the other's data")
            return
        self.ref_at[(tier, loc)] = what
        self.refs.append(Ref(what, value, whole))

    def ref_chunks(self, what: str, chunks: list[StoredValue], whole: Whole | None) -> None:
        for i, c in enumerate(chunks):
            self.ref(f"{what} chunk {i}", c, whole)

    def bar(self, total: int, unit: str = "B"):
        from tqdm import tqdm
        return tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=1024 if unit == "B" else 1000,
                    desc=f"  {self.current}", disable=not self.progress, leave=False, dynamic_ncols=True)

    def close(self) -> None:
        self.values.close()
        self.env.close()

    def unreadable(self) -> str:
        """What fails when every database is read through ("" if nothing): every key and
        metadata value, and the keys of the values database (a value's own bytes are
        checked by its checksum whenever it is read)."""
        for name in sorted(self.db_names):
            db = self.env.db(name)
            keys_only = name == DB_VALUES

            def walk(txn, db=db, keys_only=keys_only) -> int:
                n = 0
                for _ in txn.cursor(db=db).iternext(keys=True, values=not keys_only):
                    n += 1
                return n
            try:
                self.read(walk)
            except BackendError as exc:  # LMDB's own error, as the engine reports it
                return f"database {name.decode(errors='replace')!r}: {exc}"
        return ""


def _copy(value) -> bytes | None:
    return None if value is None else bytes(value)


def verify_store(path: str | os.PathLike, *, repair: bool = False, progress: bool = False,
                 on_pass: Callable[[str, str, list[Finding]], None] | None = None,
                 only: Iterable[str] | None = None) -> Report:
    """Check the store at `path` (not mounted); with `repair`, fix what is safe to fix.

    Raises StoreLocked if the store is in use and NotFound if `path` is not a store.
    `on_pass(name, summary, findings)` is called after each pass.

    The lock's clean mark (distorefs/lockfile.py): a repairing run of every pass that
    leaves no blocking problem marks the store clean (it recovered the store); one that
    leaves some marks it unclean, so the next mount recovers (or refuses) first. A check
    without repair changes nothing, that mark included.
    """
    store = Path(path).resolve()
    if not (store / "meta" / "data.mdb").is_file():
        raise NotFound(f"{store} is not a distorefs store (no meta/data.mdb)")
    lock = take_lock(store, "verify --repair" if repair else "verify")
    note = f"pid {os.getpid()} verify --repair: problems left"
    try:
        report = run_passes(store, repair=repair, progress=progress, on_pass=on_pass, only=only)
    except DamagedStore:
        lock.restore()  # refused before anything was read or written
        raise
    except BaseException:
        if repair:  # some repairs may have run: recover again at the next open
            lock.keep_unclean(note)
        else:
            lock.restore()
        raise
    if not repair or report.damaged:
        lock.restore()  # nothing was written: the store is left exactly as it was found
    elif not report.blocking and (lock.was_clean or set(report.passes) >= {p.name for p in PASSES}):
        lock.release()
    else:
        lock.keep_unclean(note)
    return report


def run_passes(store: Path, *, repair: bool, progress: bool = False,
               on_pass: Callable[[str, str, list[Finding]], None] | None = None,
               only: Iterable[str] | None = None, skip: Iterable[str] = ()) -> Report:
    """Run the passes (those in `only`, or all; none in `skip`) on the store directory
    `store`, whose lock the caller holds: `verify_store`, or a `Store` recovering a store
    left by a crash before it opens LMDB itself (the Check opens and closes its own
    environment, and LMDB must not be open twice in one process)."""
    report = Report(str(store), repair)
    check = Check(store, repair, progress, report)
    try:
        wanted = set(only) if only else None
        skipped = set(skip)
        damage = check.unreadable()
        if damage:
            # A write into a damaged B-tree can lose what is still readable: report only.
            report.damaged = damage
            check.repair = False
            check.current = "lmdb"
            check.error(f"the LMDB file is damaged ({damage}): nothing was repaired; what is readable is still "
                        f"served by a mount, and reads of what is not fail with EIO")
            check.incomplete("the LMDB file is damaged")
        for p in PASSES:
            if (wanted is not None and p.name not in wanted) or p.name in skipped:
                continue
            check.current = p.name
            before = len(report.findings)
            try:
                summary = p.fn(check) or "ok"
            except PASS_FAILURES as exc:  # damage the pass cannot read past: say so and go on
                check.error(f"the pass stopped at unreadable data: {type(exc).__name__}: {exc}")
                check.incomplete(f"pass {p.name} stopped")
                summary = "stopped: unreadable data"
            report.passes[p.name] = summary
            if on_pass is not None:
                on_pass(p.name, summary, report.findings[before:])
    finally:
        check.close()
    return report


# ----- passes -----------------------------------------------------------------------------

@verify_pass("catalog")
def check_catalog(check: Check) -> str:
    """The store's format version and its LMDB databases are known."""
    meta = check.db(DB_META)
    if meta is None:
        check.error("no meta database")
        check.incomplete("no meta database")
        return "no meta database"
    fmt = check.read(lambda txn: _copy(txn.get(b"format", db=meta)))
    check.format = unpack_u32(fmt) if fmt and len(fmt) == 4 else FORMAT_VERSION
    if fmt is None or len(fmt) != 4:
        check.error("no format version in meta")
    elif not 1 <= unpack_u32(fmt) <= FORMAT_VERSION:
        check.error(f"format version {unpack_u32(fmt)}, this verify knows 1..{FORMAT_VERSION}")
        check.incomplete("unknown format version")
    # Every pass claims the databases it reads; one no pass claims may reference values.
    for p in PASSES:
        claims = getattr(p.fn, "claims", ())
        for name in claims:
            check.claim(name)
    unknown = sorted(check.db_names - check.claimed)
    for name in unknown:
        check.find(NOTE, f"database {name.decode(errors='replace')!r} is not known to verify: not checked")
        check.incomplete(f"database {name.decode(errors='replace')!r} is not known to verify")
    return f"format {unpack_u32(fmt) if fmt and len(fmt) == 4 else '?'}, {len(check.db_names)} databases"


def _deleting(db: bytes, keys: list[bytes]) -> Callable:
    """A repair: delete `keys` from `db`."""
    def fix(txn) -> None:
        for k in keys:
            txn.delete(k, db=db)
    return fix


def _claims(*names: bytes):
    def mark(fn):
        fn.claims = names
        return fn
    return mark


@verify_pass("namespaces")
@_claims(DB_NS)
def check_namespaces(check: Check) -> str:
    """Every namespace record parses; ids are unique and below next_ns."""
    ns_db, meta = check.db(DB_NS), check.db(DB_META)
    if ns_db is None:
        return "none"
    rows = check.read(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=ns_db)])
    counts: dict[str, int] = {}
    for key, value in rows:
        label = key.decode(errors="replace")
        kind, _, name = label.partition("/")
        try:
            record = json.loads(value)
            ns_id = int(record["id"])
            for k in ("mode", "uid", "gid", "ctime_ns"):
                int(record[k])
        except (ValueError, KeyError, TypeError) as exc:
            check.error(f"namespace {label}: record does not parse ({exc})")
            check.incomplete(f"namespace {label} does not parse")
            continue
        config_type = NAMESPACE_CONFIGS.get(kind)
        if config_type is None:
            check.error(f"namespace {label}: unknown kind {kind!r} (the daemon leaves it alone)")
            check.incomplete(f"namespace {label} is of unknown kind")
        else:
            try:
                check_name(name.encode("utf-8", "surrogateescape"))
                config_type.from_dict(record.get("config"))
            except DistorefsError as exc:
                check.error(f"namespace {label}: {exc}")
        if ns_id in check.ns_by_id:
            other = check.ns_by_id[ns_id]
            check.error(f"namespaces {other[0]}/{other[1]} and {label} share id {ns_id}")
            check.incomplete("two namespaces share an id")
            continue
        check.ns_by_id[ns_id] = (kind, name, record)
        counts[kind] = counts.get(kind, 0) + 1
    if meta is not None:
        raw = check.read(lambda txn: _copy(txn.get(b"next_ns", db=meta)))
        top = max(check.ns_by_id, default=0)
        next_ns = unpack_u32(raw) if raw and len(raw) == 4 else 0
        if next_ns <= top:
            def fix(txn, value=top + 1):
                txn.put(b"next_ns", pack_u32(value), db=meta)
            check.error(f"next_ns is {next_ns} but namespace id {top} exists (a new namespace would share it)",
                        fix, f"set next_ns to {top + 1}")
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"


@verify_pass("ring-entries")
@_claims(DB_ENTRIES)
def check_ring_entries(check: Check) -> str:
    """Buffer and bank entries belong to a namespace, parse, and have valid unique keys."""
    db = check.db(DB_ENTRIES)
    if db is None:
        return "none"
    rings = {i: (k, n) for i, (k, n, _) in check.ns_by_id.items() if k in RING_KINDS}
    seen_keys: dict[tuple[int, bytes], int] = {}
    dangling: dict[int, list[bytes]] = {}
    n = 0
    for key, value in check.scan(db):
        n += 1
        if len(key) != 12:
            check.error(f"entries row with a malformed key {key.hex()}")
            check.incomplete("malformed entries row")
            continue
        ns_id, seq = split_entry_key(key)
        try:
            meta = (EntryMeta.unpack if check.format >= 2 else EntryMeta.unpack_v1)(seq, value)
        except struct.error:
            check.error(f"entries row ns {ns_id} seq {seq} does not parse")
            check.incomplete("an entries row does not parse")
            continue
        ring = rings.get(ns_id)
        where = f"{ring[0]}/{ring[1]}" if ring else f"namespace {ns_id}"
        what = f"{where}/entries/{meta.key.decode('utf-8', 'replace')} (seq {seq})"
        if ring is None:
            dangling.setdefault(ns_id, []).append(key)
            if check.repair:
                continue  # the row goes below; its value is then unreferenced and freed
        else:
            check.entry_keys[key] = ring[0]
        try:
            check_name(meta.key)
        except InvalidName as exc:
            check.error(f"{what}: invalid key ({exc})")
        dup = seen_keys.get((ns_id, meta.key))
        if dup is not None:
            check.error(f"{what}: key also used by seq {dup} (only one is visible)")
        seen_keys[(ns_id, meta.key)] = seq
        if meta.value.codec not in codec.CODEC_NAMES:
            check.error(f"{what}: unknown codec {meta.value.codec}")
            continue
        check.ref(what, meta.value)
    for ns_id, keys in sorted(dangling.items()):
        def fix(txn, keys=keys):
            for k in keys:
                for name in (DB_ENTRIES, DB_PRIO, DB_SAMPLED):
                    handle = check.db(name)
                    if handle is not None:
                        txn.delete(k, db=handle)
        check.error(f"{len(keys)} entries belong to namespace id {ns_id}, which does not exist",
                    fix, f"deleted {len(keys)} rows (their values are freed below)")
    check.report.counts["entries"] = n
    return f"{n} entries in {len(rings)} rings"


@verify_pass("ring-indexes")
@_claims(DB_PRIO, DB_SAMPLED)
def check_ring_indexes(check: Check) -> str:
    """Every priority and times-sampled row has its entry; priorities are finite and >= 0."""
    out = []
    for name, size, label in ((DB_PRIO, 8, "priority"), (DB_SAMPLED, 4, "times-sampled")):
        db = check.db(name)
        if db is None:
            continue
        dangling, bad = [], []
        n = 0
        for key, value in check.scan(db):  # a row per entry: scanned in batches, not held
            n += 1
            kind = check.entry_keys.get(key)
            if kind != "buffers":
                dangling.append(key)
            elif len(value) != size:
                bad.append(key)
            elif name == DB_PRIO:
                p = struct.unpack("<d", value)[0]
                if not (math.isfinite(p) and p >= 0):
                    bad.append(key)

        if dangling:
            check.error(f"{len(dangling)} {label} rows have no buffer entry (e.g. "
                        f"ns {split_entry_key(dangling[0])[0]} seq {split_entry_key(dangling[0])[1]})"
                        if len(dangling[0]) == 12 else f"{len(dangling)} {label} rows have no buffer entry",
                        _deleting(db, dangling), f"deleted {len(dangling)} rows")
        if bad:
            what = "a negative, infinite or NaN priority" if name == DB_PRIO else "a malformed count"
            check.error(f"{len(bad)} {label} rows hold {what}", _deleting(db, bad),
                        f"deleted {len(bad)} rows (the entries get the default at the next mount)")
        out.append(f"{n} {label} rows")
    return ", ".join(out) or "none"


@verify_pass("priority-journal")
@_claims(DB_PRIOLOG, DB_PRIOSNAP)
def check_priority_journal(check: Check) -> str:
    """Journal records and snapshot rows belong to a buffer, hold whole (seq, priority)
    pairs, and every priority is finite and >= 0 (distorefs/priojournal.py)."""
    out = []
    for name, label in ((DB_PRIOLOG, "priority journal"), (DB_PRIOSNAP, "priority snapshot")):
        db = check.db(name)
        if db is None:
            continue
        dangling, bad = [], []
        n = 0
        for key, value in check.scan(db):
            n += 1
            if len(key) < 4 or check.ns_by_id.get(priojournal.namespace_of(key), ("",))[0] != "buffers":
                dangling.append(key)
                continue
            try:
                pairs = priojournal.unpack(value)
            except ValueError:
                bad.append(key)
                continue
            p = pairs["priority"]
            if not (np.isfinite(p).all() and (p >= 0).all()):
                bad.append(key)

        if dangling:
            check.error(f"{len(dangling)} {label} rows belong to no buffer", _deleting(db, dangling),
                        f"deleted {len(dangling)} rows")
        if bad:
            check.error(f"{len(bad)} {label} rows are malformed or hold a negative, infinite or NaN priority",
                        _deleting(db, bad), f"deleted {len(bad)} rows (their entries keep an older priority)")
        out.append(f"{n} {label} rows")
    return ", ".join(out) or "none"


@verify_pass("weights-tree")
@_claims(b"wnodes")
def check_weights(check: Check) -> str:
    """Every weights node parses and is reachable from the root; version chunks add up."""
    from .weights import DIR, FILE, LINK, ROOT_ID, WNode, _key

    db = check.db(b"wnodes")
    if db is None:
        return "none"
    nodes: dict[int, WNode] = {}
    for key, value in check.scan(db):
        try:
            node_id = struct.unpack(">Q", key)[0]
            nodes[node_id] = WNode.from_record(node_id, value)
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            check.error(f"weights node {key.hex()}: record does not parse ({exc})")
            check.incomplete("a weights node does not parse")
    detached = {i: n for i, n in nodes.items() if not n.attached}  # unlinked while read: freed at start
    for i in detached:
        del nodes[i]
    tree = _WeightsNames(nodes, ROOT_ID)
    versions = 0
    for node in detached.values():
        _ref_versions(check, node, f"weights node {node.id} (unlinked)")
    for node in nodes.values():
        path = tree.path(node)
        if node.kind not in (DIR, FILE, LINK):
            check.error(f"{path}: unknown kind {node.kind!r}")
            continue
        if node.kind == LINK and not node.target:
            check.error(f"{path}: symlink without a target")
        if node.kind != FILE and node.versions:
            check.error(f"{path}: a {node.kind} with versions")
        numbers = [v.number for v in node.versions]
        if numbers != sorted(set(numbers)):
            check.error(f"{path}: version numbers out of order {numbers}")
        versions += len(node.versions)
        _ref_versions(check, node, path)
    # Names: unique per directory (the daemon shows one of two), parents that exist.
    names: dict[tuple[int, bytes], int] = {}
    for node in sorted(nodes.values(), key=lambda n: n.id):
        if node.id == ROOT_ID:
            continue
        other = names.get((node.parent, node.name))
        if other is not None:
            check.error(f"{tree.path(node)}: two nodes ({other} and {node.id}) have this name; one is hidden")
        names[(node.parent, node.name)] = node.id
    lost = tree.unreachable()
    for node_id in lost:
        node = nodes[node_id]
        new_name = b"lost+found-%d" % node_id

        def fix(txn, node=node, new_name=new_name):
            node.parent, node.name = ROOT_ID, new_name
            txn.put(_key(node.id), node.record(), db=db)
        check.error(f"weights node {node_id} ({node.kind} {node.name.decode('utf-8', 'replace')!r}) is not "
                    f"reachable from weights/ (parent {node.parent} missing or a cycle)",
                    fix, f"moved to weights/{new_name.decode()}")
    check.report.counts["weights_nodes"] = len(nodes)
    check.report.counts["weights_versions"] = versions
    return f"{len(nodes)} nodes, {versions} versions" + (f", {len(detached)} unlinked while read (freed at "
                                                         f"the next mount)" if detached else "")


def _ref_versions(check: Check, node, path: str) -> None:
    """The chunks of a weights file's versions. A rewrite keeps the chunks it did not change,
    so versions of one file may share chunks (each is referenced once), and a hole is no
    chunk at all (None, or past the last chunk); a version checked whole is one with neither."""
    seen: set = set()
    for v in node.versions:
        what = f"{path} version {v.number}"
        step = v.step(1 << 62)
        stored = [c for c in v.chunks if c is not None]
        for i, c in enumerate(v.chunks):
            if c is not None and c.size > max(0, min(step, v.size - i * step)):
                check.error(f"{what}: chunk {i} holds {c.size} bytes, more than its place in the file")
        if v.chunk_bytes == 0 and sum(c.size for c in stored) != v.size:  # written before holes were kept
            check.error(f"{what}: chunks hold {sum(c.size for c in stored)} bytes, the version {v.size}")
        plain = (len(stored) == len(v.chunks) and sum(c.size for c in stored) == v.size
                 and not any((c.tier, c.loc) in seen for c in stored))
        whole = Whole(what, v.size, v.checksum if v.checksum or not v.size else None) if plain else None
        for i, c in enumerate(v.chunks):
            if c is not None and (c.tier, c.loc) not in seen:
                seen.add((c.tier, c.loc))
                check.ref(f"{what} chunk {i}", c, whole)


class _WeightsNames:
    """Paths and reachability of weights nodes from their parent pointers."""

    def __init__(self, nodes: dict, root: int) -> None:
        self.nodes = nodes
        self.root = root

    def path(self, node) -> str:
        parts, seen = [], set()
        while node is not None and node.id != self.root and node.id not in seen:
            seen.add(node.id)
            parts.append(node.name.decode("utf-8", "replace"))
            node = self.nodes.get(node.parent)
        prefix = "weights/" if node is not None and node.id == self.root else "weights/?/"
        return prefix + "/".join(reversed(parts))

    def unreachable(self) -> list[int]:
        """Nodes whose parent chain never reaches the root, reduced to the tops of those
        chains (re-attaching a top brings its subtree back)."""
        from .weights import DIR
        state: dict[int, bool] = {self.root: True}

        def reach(node_id: int) -> bool:
            chain = []
            while node_id not in state:
                node = self.nodes.get(node_id)
                if node is None or node_id in chain:
                    break
                chain.append(node_id)
                parent = self.nodes.get(node.parent)
                if node.parent != self.root and (parent is None or parent.kind != DIR):
                    break
                node_id = node.parent
            ok = state.get(node_id, False)
            for c in chain:
                state[c] = ok
            return ok

        bad = [i for i in self.nodes if i != self.root and not reach(i)]
        tops = []
        bad_set = set(bad)
        for i in sorted(bad):
            node = self.nodes[i]
            parent = self.nodes.get(node.parent)
            if parent is None or parent.kind != DIR or node.parent not in bad_set:
                tops.append(i)
        if not tops and bad:  # a pure cycle: cut it at its smallest id
            tops.append(min(bad))
        return tops


@verify_pass("datasets")
@_claims(b"dsnodes")
def check_datasets(check: Check) -> str:
    """Dataset records belong to a dataset; items and index chunks parse and count up."""
    from .dataset import SEALED, STAGING, Counters, Item
    from .datasetslog import PENDING

    datasets = {i: n for i, (k, n, _) in check.ns_by_id.items() if k == "datasets"}
    for ds_id, name in datasets.items():
        record = check.ns_by_id[ds_id][2]
        try:
            chunks = [StoredValue.from_json(c) for c in record.get("index", [])]
        except (TypeError, ValueError) as exc:
            check.error(f"datasets/{name}: index chunks do not parse ({exc})")
            check.incomplete("a dataset index does not parse")
            continue
        if chunks:
            what = f"datasets/{name}/index.npy"
            check.ref_chunks(what, chunks, Whole(what, int(record.get("index_size", 0)), None))
    db = check.db(b"dsnodes")
    if db is None:
        return f"{len(datasets)} datasets"
    items = 0
    found: dict[int, dict] = {}
    dangling: dict[int, list[bytes]] = {}
    for key, value in check.scan(db):
        if len(key) < 5:
            check.error(f"dsnodes row with a malformed key {key.hex()}")
            continue
        ds_id = struct.unpack(">I", key[:4])[0]
        tag = key[4:5]
        if key[:4] == PENDING:  # a shared dataset's records, arriving (distorefs/datasetslog.py)
            continue
        if ds_id not in datasets:
            dangling.setdefault(ds_id, []).append(key)
            if check.repair:
                continue
        name = datasets.get(ds_id, f"id {ds_id}")
        info = found.setdefault(ds_id, {"counters": None, STAGING: [0, 0], SEALED: [0, 0]})
        if tag == b"c" and len(key) == 5:
            try:
                info["counters"] = Counters.unpack(value)
            except struct.error:
                check.error(f"datasets/{name}: counters do not parse")
        elif tag in (STAGING, SEALED) and len(key) == 13:
            item_id = struct.unpack(">Q", key[5:])[0]
            try:
                item = Item.unpack(item_id, value, tag)
            except (struct.error, ValueError) as exc:
                check.error(f"datasets/{name}: item {item_id} does not parse ({exc})")
                check.incomplete("a dataset item does not parse")
                continue
            items += 1
            info[tag][0] += 1
            info[tag][1] += item.size
            what = f"datasets/{name}/items/{item.name.decode('utf-8', 'replace')} (item {item_id})"
            if sum(c.size for c in item.chunks) != item.size:
                check.error(f"{what}: chunks hold {sum(c.size for c in item.chunks)} bytes, the item {item.size}")
            check.ref_chunks(what, item.chunks, Whole(what, item.size, item.checksum))
    for ds_id, info in found.items():
        c = info["counters"]
        if c is None or ds_id not in datasets:
            continue
        tag = SEALED if c.sealed else STAGING
        count, size = info[tag]
        if (count, size) != (c.items, c.bytes):
            check.error(f"datasets/{datasets[ds_id]}: counters say {c.items} items of {c.bytes} bytes, "
                        f"{count} items of {size} bytes found")
        if c.sealed and info[STAGING][0]:
            check.error(f"datasets/{datasets[ds_id]}: sealed, but {info[STAGING][0]} unsealed items remain")
    for ds_id, keys in sorted(dangling.items()):
        check.error(f"{len(keys)} dataset records belong to dataset id {ds_id}, which does not exist",
                    _deleting(db, keys), f"deleted {len(keys)} records (their values are freed below)")
    check.report.counts["dataset_items"] = items
    return f"{len(datasets)} datasets, {items} items"


@verify_pass("checkpoints")
@_claims(b"cknodes")
def check_checkpoints(check: Check) -> str:
    """Checkpoint nodes parse; every stored chunk belongs to a file node."""
    db = check.db(b"cknodes")
    if db is None:
        return "none"
    nodes: dict[int, dict] = {}
    chunks: list[tuple[bytes, int, int, StoredValue]] = []
    restore: list = []  # restore points: what a crash gives back (distorefs/restorepoints.py)
    for key, value in check.scan(db):
        tag = key[:1]
        try:
            if tag == b"n" and len(key) == 9:
                nodes[struct.unpack(">Q", key[1:])[0]] = json.loads(value)
            elif tag == b"c" and len(key) == 13:
                file_id, index = struct.unpack(">QI", key[1:])
                chunks.append((key, file_id, index, StoredValue.unpack_from(value, 0)[0]))
            elif tag == b"r" and len(key) == 9:
                from .restorepoints import RestorePoint
                restore.append(RestorePoint.unpack(struct.unpack(">Q", key[1:])[0], value))
        except (ValueError, struct.error) as exc:
            check.error(f"checkpoint record {key[:16].hex()} does not parse ({exc})")
            check.incomplete("a checkpoint record does not parse")

    def path(node_id: int) -> str:
        parts, seen = [], set()
        while node_id in nodes and node_id not in seen and nodes[node_id].get("kind") != "root":
            seen.add(node_id)
            parts.append(bytes.fromhex(nodes[node_id].get("name", "")).decode("utf-8", "replace"))
            node_id = nodes[node_id].get("parent", 0)
        return "checkpoints/" + "/".join(reversed(parts))

    dangling = []
    for key, file_id, index, chunk in chunks:
        node = nodes.get(file_id)
        if node is None or node.get("kind") != "file":
            dangling.append(key)
            if check.repair:
                continue  # the row goes below; its value is then unreferenced and freed
        check.ref(f"{path(file_id)} chunk {index}", chunk)
    if dangling:
        check.error(f"{len(dangling)} checkpoint chunks belong to no file", _deleting(db, dangling),
                    f"deleted {len(dangling)} rows (their values are freed below)")
    live = {(c.tier, c.loc) for _, _, _, c in chunks}
    for rp in restore:  # values a restore point keeps for a crash (the live file may name them too)
        for index, chunk in sorted(rp.chunks.items()):
            if (chunk.tier, chunk.loc) not in live:
                live.add((chunk.tier, chunk.loc))
                check.ref(f"{path(rp.step_id)} restore point of file {rp.file_id} chunk {index}", chunk)
    check.report.counts["checkpoint_chunks"] = len(chunks)
    check.report.counts["checkpoint_restore_points"] = len(restore)
    return f"{len(nodes)} nodes, {len(chunks)} chunks"


@verify_pass("values")
def check_values(check: Check) -> str:
    """Every referenced value reads back whole and matches its checksum (zstd + CRC-32)."""
    total = sum(r.stored_size for r in check.refs)
    bad = 0
    with check.bar(total) as bar:
        for r in check.refs:
            try:
                raw = check.values.read(r.value, r.what)
            except NotFound as exc:
                bad += 1
                check.error(f"{r.what}: value missing ({exc}); reads fail with EIO, rm it through the mount",
                            eio=True)
                if r.whole is not None:
                    r.whole.bad = True
            except CorruptValue as exc:
                bad += 1
                message = str(exc) if str(exc).startswith(r.what) else f"{r.what}: {exc}"
                check.error(f"{message}; reads fail with EIO, rm it through the mount", eio=True)
                if r.whole is not None:
                    r.whole.bad = True
            else:
                if r.whole is not None:
                    r.whole.crc = crc32(raw, r.whole.crc)
                    r.whole.seen += len(raw)
            bar.update(r.stored_size)
    wholes = {id(r.whole): r.whole for r in check.refs if r.whole is not None}
    for w in wholes.values():
        if w.bad:
            continue
        if w.seen != w.size:
            check.error(f"{w.what}: chunks hold {w.seen} bytes, expected {w.size}", eio=True)
        elif w.checksum is not None and (w.crc & 0xFFFFFFFF) != w.checksum:
            check.error(f"{w.what}: whole-file checksum mismatch (stored {w.checksum:08x}, "
                        f"read {w.crc & 0xFFFFFFFF:08x})", eio=True)
    check.report.counts["values"] = len(check.refs)
    check.report.counts["value_bytes"] = total
    check.report.counts["bad_values"] = bad
    return f"{len(check.refs)} values, {_size(total)} checked" + (f", {bad} bad" if bad else "")


def _free_note(check: Check) -> str:
    return "not freed: " + "; ".join(check.incomplete_why[:3])


@verify_pass("lmdb-space")
def check_lmdb_space(check: Check) -> str:
    """Every value in LMDB is referenced by a record; the live-bytes counter is right."""
    referenced = {r.loc for r in check.refs if r.tier == TIER_LMDB}
    leaked: list[tuple[bytes, int]] = []
    total = 0
    for loc, size in check.lmdb.locations():
        total += size
        if loc not in referenced:
            leaked.append((loc, size))
    leaked_bytes = sum(s for _, s in leaked)
    if leaked:
        finding = check.find(LEAK, f"{len(leaked)} LMDB values ({_size(leaked_bytes)}) are referenced by "
                                   f"nothing (e.g. {_vkey_name(leaked[0][0])})", nbytes=leaked_bytes)
        if check.repair:
            if check.complete:
                def fix(txn):
                    for loc, _ in leaked:
                        check.lmdb.delete(txn, loc)
                check.write(fix)
                finding.repair = f"freed {len(leaked)} values"
                total -= leaked_bytes
            else:
                check.find(NOTE, _free_note(check))
    counted = check.lmdb.live_bytes()
    if counted != total:
        meta = DB_TIERMETA

        def fix_counter(txn, value=total):
            txn.put(b"lmdb.live_bytes", struct.pack("<Q", value), db=meta)
        check.error(f"LMDB live-bytes counter says {counted}, the values hold {total}", fix_counter,
                    f"set to {total}")
    check.report.counts["lmdb_leaked_bytes"] = leaked_bytes
    return f"{_size(total)} live" + (f", {_size(leaked_bytes)} leaked" if leaked else "")


def _vkey_name(vkey: bytes) -> str:
    if len(vkey) == 12:
        ns_id, seq = split_entry_key(vkey)
        return f"entry value ns {ns_id} seq {seq}"
    if vkey[:1] == b"w" and len(vkey) == 21:
        node, number, index = struct.unpack(">QQI", vkey[1:])
        return f"weights node {node} version {number} chunk {index}"
    return f"value {vkey[:32].hex()}"


_SEG_NAME = re.compile(r"^seg-(\d+)\.dat$")


@verify_pass("segments")
def check_segments(check: Check) -> str:
    """Every referenced segment file exists; per-segment accounting matches; dead space."""
    from distorefs.backends.segments import HEADER, LOCATION, MAGIC, _SEG_KEY, _SEG_VAL

    segdb = DB_SEGMENTS
    rows = check.read(lambda txn: {_SEG_KEY.unpack(bytes(k))[0]: _SEG_VAL.unpack(bytes(v))
                                   for k, v in txn.cursor(db=segdb)})
    paths = check.segments.segment_files()
    files: dict[int, int] = {}
    for seg, p in paths.items():
        try:
            files[seg] = p.stat().st_size
        except FileNotFoundError:
            pass
    refs: dict[int, list[Ref]] = {}
    for r in check.refs:
        if r.tier == TIER_NVME:
            try:
                seg, _, _ = LOCATION.unpack(r.loc)
            except struct.error:
                check.error(f"{r.what}: malformed segment location {r.loc.hex()}")
                continue
            refs.setdefault(seg, []).append(r)
    dead_live = dead_files = dead_files_bytes = 0
    for seg in sorted(set(rows) | set(files) | set(refs)):
        seg_refs = refs.get(seg, [])
        live = sum(LOCATION.unpack(r.loc)[2] for r in seg_refs)
        row = rows.get(seg)
        size = files.get(seg)
        name = f"segment {seg}"
        if seg_refs and size is None:
            check.error(f"{name} is missing: {len(seg_refs)} values lost (e.g. {seg_refs[0].what})", eio=True)
        if seg_refs and (row is None or row[0] != live or row[2] != len(seg_refs)):
            def fix(txn, seg=seg, live=live, n=len(seg_refs), total=max(live, row[1] if row else 0),
                    stream=row[3] if row else 0):
                txn.put(_SEG_KEY.pack(seg), _SEG_VAL.pack(live, total, n, stream), db=segdb)
            said = f"{row[2]} live records of {row[0]} bytes" if row else "nothing"
            # Rewritten only when every reference is known: too low a count lets the
            # collector unlink a segment some unknown record still points into.
            check.error(f"{name}: accounting says {said}, {len(seg_refs)} records of {live} bytes are referenced"
                        + ("" if row else " (the collector could unlink it)"),
                        fix if check.complete else None, "accounting rewritten")
            if check.repair and check.complete:
                row = (live, max(live, row[1] if row else 0), len(seg_refs), row[3] if row else 0)
        if not seg_refs:
            if row is not None and row[2] > 0:
                if check.complete:
                    def fix_unreferenced(txn, seg=seg, total=row[1], stream=row[3]):
                        txn.put(_SEG_KEY.pack(seg), _SEG_VAL.pack(0, total, 0, stream), db=segdb)
                    check.error(f"{name}: accounting says {row[2]} live records, none is referenced "
                                f"(the space is never freed)", fix_unreferenced, "accounting set to 0 records")
                    if check.repair:
                        row = (0, row[1], 0, row[3])
                else:
                    check.find(NOTE, f"{name}: accounting says {row[2]} live records, none known to verify; "
                               + _free_note(check), nbytes=size or 0)
            if size is not None:
                dead_files += 1
                dead_files_bytes += size
                if row is None or row[2] == 0:
                    finding = check.find(SPACE, f"{name}: no live value ({_size(size)}); the daemon's collector "
                                                f"removes it", nbytes=size)
                    if check.repair and check.complete:
                        def fix_dead(txn, seg=seg):
                            txn.delete(_SEG_KEY.pack(seg), db=segdb)
                        check.write(fix_dead)
                        paths[seg].unlink(missing_ok=True)
                        finding.repair = "removed"
            elif row is not None:
                finding = check.find(NOTE, f"{name}: accounting row for a file that is gone")
                if check.repair:
                    check.write(lambda txn, seg=seg: txn.delete(_SEG_KEY.pack(seg), db=segdb))
                    finding.repair = "row deleted"
            continue
        if size is None:
            continue
        # Dead bytes inside a live segment: records of lost transactions, deleted values,
        # a torn tail; compaction (ring segments) or the end of the segment frees them.
        offsets = {LOCATION.unpack(r.loc)[1] for r in seg_refs}
        used = _referenced_record_bytes(paths[seg], offsets, HEADER, MAGIC)
        dead_live += max(0, size - used)
    if dead_live:
        check.find(NOTE, f"{_size(dead_live)} of dead records inside live segments (freed with their segment)",
                   nbytes=dead_live)
    check.report.counts["segments"] = len(files)
    check.report.counts["segment_dead_bytes"] = dead_live
    check.report.counts["segment_reclaimable_bytes"] = dead_files_bytes
    return (f"{len(files)} files, {len(refs)} referenced" + (f", {_size(dead_live)} dead in live segments"
                                                            if dead_live else "")
            + (f", {dead_files} unreferenced ({_size(dead_files_bytes)})" if dead_files else ""))


def _referenced_record_bytes(path: Path, offsets: set[int], header, magic: bytes) -> int:
    """Bytes of the records whose data starts at `offsets` (headers and trailing keys included)."""
    used = 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        for off in offsets:
            raw = os.pread(fd, header.size, off - header.size)
            if len(raw) < header.size:
                continue
            m, klen, dlen, _ = header.unpack(raw)
            if m == magic:
                used += header.size + dlen + klen
    finally:
        os.close(fd)
    return used


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


__all__ = ["verify_store", "run_passes", "verify_pass", "Check", "Report", "Finding", "PASSES", "EXIT_CLEAN", "EXIT_REPAIRED",
           "EXIT_PROBLEMS", "EXIT_FAILED"]

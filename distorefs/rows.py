"""A buffer's rows: the bytes of each small entry's fields, side by side, kept by ring slot.

A draw of small entries (a DQN transition is a few hundred bytes) cost, per entry, a read
of its value, a checksum, a decompression and a slice per field: for 64 entries that is
more than the learner's own training step. A buffer whose layout is narrow (ROW_MAX_BYTES
at most) keeps instead, for every entry, its fields' decoded bytes in one row of a numpy
table, so a batch's fields are one gather of N rows (the client beside the mount gets the
rows in the draw's reply; `batch/N.npz` stacks its members from them).

A row is filled when its entry commits (the daemon has its bytes then), or later from a
verified read of its value (entries loaded at mount, spooled by a client, applied from a
cluster's log): until then a draw of it takes the values' path, as before. The table's
bytes are reserved from the memory tier's budget (distorefs/cache.py) as the ring's slots
grow; a buffer whose table would not fit keeps none. The rows are copies of bytes whose
checksums were verified (or computed) when they were taken, like the memory tier's values.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .cache import ValueCache
from .layout import Field, Layout, SlotPlaces

try:  # a drawn batch's rows taken in one call (distorefs/_batchfill.c); in numpy without it
    from . import _batchfill  # type: ignore[attr-defined]
except ImportError:  # no C compiler at install
    _batchfill = None

if TYPE_CHECKING:
    from .catalog import EntryMeta
    from .ring import Ring

log = logging.getLogger(__name__)

ROW_MAX_BYTES = 4096  # wider entries are read value by value (their bytes dominate, not the work per entry)
READ_BATCH = 1024  # entries whose rows are read from their values in one worker-thread call


def row_spans(layout: Layout) -> list[tuple[int, int]]:
    """(start in the row, length) of each field of `layout`, in its order."""
    spans, at = [], 0
    for f in layout.fields:
        spans.append((at, f.nbytes))
        at += f.nbytes
    return spans


def field_columns(layout: Layout, rows: np.ndarray) -> list[tuple[Field, np.ndarray]]:
    """Each field of `layout` with its bytes in `rows` (N, width): (N, its bytes), contiguous."""
    return [(f, np.ascontiguousarray(rows[:, at:at + n])) for f, (at, n) in zip(layout.fields, row_spans(layout))]


class SlotRows:
    """The rows of one buffer's entries (see the module docstring)."""

    def __init__(self, layout: Layout, cache: ValueCache) -> None:
        self.spans = row_spans(layout)
        self.width = sum(n for _, n in self.spans)
        self.cache = cache
        self.reserved = 0
        self.table = np.zeros((0, self.width), dtype=np.uint8)
        self.filled = np.zeros(0, dtype=bool)

    @staticmethod
    def fits(layout: Layout | None) -> bool:
        return layout is not None and 0 < sum(f.nbytes for f in layout.fields) <= ROW_MAX_BYTES

    def grow(self, capacity: int) -> bool:
        """Room for `capacity` slots; False (nothing changed) when the memory tier's budget
        has no room for them."""
        pad = capacity - len(self.filled)
        if pad <= 0:
            return True
        if not self.cache.reserve(pad * self.width):
            return False
        self.reserved += pad * self.width
        self.table = np.concatenate([self.table, np.zeros((pad, self.width), dtype=np.uint8)])
        self.filled = np.concatenate([self.filled, np.zeros(pad, dtype=bool)])
        return True

    def close(self) -> None:
        """Give the table's bytes back to the memory tier."""
        self.cache.release(self.reserved)
        self.reserved = 0
        self.table = np.zeros((0, self.width), dtype=np.uint8)
        self.filled = np.zeros(0, dtype=bool)

    def fill(self, slot: int, value: bytes | memoryview, offsets: np.ndarray) -> None:
        """Slot `slot` holds an entry whose decoded value is `value`, its fields at `offsets`."""
        if slot >= len(self.filled):
            return
        src = np.frombuffer(value, dtype=np.uint8)
        row = self.table[slot]
        for (at, n), off in zip(self.spans, offsets.tolist()):
            if off + n > len(src):
                self.filled[slot] = False
                return
            row[at:at + n] = src[off:off + n]
        self.filled[slot] = True

    def clear(self, slot: int) -> None:
        if slot < len(self.filled):
            self.filled[slot] = False

    def take(self, slots: np.ndarray) -> np.ndarray | None:
        """The rows of `slots` ((N, width), a copy); None if one of them is not filled."""
        if len(slots) == 0:
            return None
        if _batchfill is not None and slots.dtype == np.int64 and slots.flags.c_contiguous:
            out = np.empty((len(slots), self.width), dtype=np.uint8)
            return out if _batchfill.take_rows(self.table, self.filled, slots, out) else None
        if not self.filled[slots].all():
            return None
        return self.table[slots]

    def unfilled(self, slots: np.ndarray) -> np.ndarray:
        return slots[~self.filled[slots]]

    def stats(self) -> dict:
        return {"width": self.width, "slots": len(self.filled), "filled": int(self.filled.sum()),
                "reserved_bytes": self.reserved}


class BufferRows:
    """A buffer's rows over its life: the table made on first use (the memory tier's budget
    is set by then) and dropped when the layout changes or the buffer goes; rows filled from
    committed values, and read back, behind, for drawn entries that have none."""

    def __init__(self, name: str, ring: "Ring", cache: ValueCache, spawn: Callable[..., None],
                 read_only: bool) -> None:
        self.name = name
        self.ring = ring
        self.cache = cache
        self.spawn = spawn
        self.read_only = read_only
        self.layout: Layout | None = None
        self.places = SlotPlaces(0)
        self.table: SlotRows | None = None
        self._refused = True  # no table to make: no layout yet, one too wide, or no room for it
        self._swept = False  # every entry without its row was asked for once
        self._wanted: set[int] = set()  # slots whose rows are to be read from their values
        self._reading = False

    def configure(self, layout: Layout | None, places: SlotPlaces) -> None:
        """The buffer's layout (and the places of its entries' arrays) changed."""
        self.close()
        self.layout, self.places = layout, places
        self._refused = not SlotRows.fits(layout)  # (a wide layout: never a table)

    def close(self) -> None:
        """No table (its bytes back to the memory tier), nothing wanted."""
        if self.table is not None:
            self.table.close()
            self.table = None
        self._wanted.clear()
        self._swept = False

    def _made(self) -> SlotRows | None:
        if self.table is None and not self._refused:
            table = SlotRows(self.layout, self.cache)  # type: ignore[arg-type]
            if table.grow(len(self.ring.slot_meta)):
                self.table = table
            else:
                self._refuse(len(self.ring.slot_meta), table.width)
        return self.table

    def _refuse(self, slots: int, width: int) -> None:
        log.info("buffers/%s: no rows table (%d slots of %d bytes: over the memory tier's room for tables)",
                 self.name, slots, width)
        self.close()
        self._refused = True

    def grown(self, capacity: int) -> None:
        if self.table is not None and not self.table.grow(capacity):
            self._refuse(capacity, self.table.width)

    def clear(self, slot: int) -> None:
        """Slot `slot` holds another entry, or none."""
        if self.table is not None:
            self.table.clear(slot)

    def value(self, meta: "EntryMeta", value: bytes) -> None:
        """The decoded value of an entry just committed."""
        table = self._made()
        if table is not None and self.places.known[meta.slot]:
            table.fill(meta.slot, value, self.places.offsets[meta.slot])

    def of(self, slots: np.ndarray) -> np.ndarray | None:
        """The rows of drawn `slots` if every one has its row; else None, and those missing
        are read behind (the first time, every entry's without one: a buffer loaded at mount)."""
        table = self._made()
        if table is None or not len(slots):
            return None
        rows = table.take(slots)
        if rows is None and not self.read_only:
            if not self._swept:
                self._swept = True
                slots = np.flatnonzero(self.ring.slot_seq[:len(table.filled)] >= 0)
            self._wanted.update(table.unfilled(slots).tolist())
            if self._wanted and not self._reading:
                self._reading = True
                self.spawn(self._read)
        return rows

    def unfilled(self, slots: np.ndarray) -> np.ndarray:
        return slots if self.table is None else self.table.unfilled(slots)

    async def _read(self) -> None:
        ring = self.ring
        try:
            while self._wanted and self.table is not None:
                chunk = [self._wanted.pop() for _ in range(min(READ_BATCH, len(self._wanted)))]
                metas = [m for m in (ring.slot_meta[s] for s in chunk) if m is not None]
                self.fill(metas, await ring.values.fetch([ring.fetch_item(m) for m in metas], cache=False))
        finally:
            self._reading = False

    def fill(self, metas: "list[EntryMeta]", values: list[Any]) -> None:
        """Rows from values just read, verified (an exception for one that was not): of the
        entries still there (not evicted or rewritten meanwhile) that have no row yet."""
        table, slot_meta, places = self.table, self.ring.slot_meta, self.places
        if table is None:
            return
        for m, value in zip(metas, values):
            if isinstance(value, bytes) and slot_meta[m.slot] is m and places.known[m.slot] \
                    and not table.filled[m.slot]:
                table.fill(m.slot, value, places.offsets[m.slot])

    def stats(self) -> dict | None:
        return self.table.stats() if self.table is not None else None

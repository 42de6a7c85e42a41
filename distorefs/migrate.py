"""Upgrades of a store's format, run once when a store of an older format is opened.

Format 2 -> 3: buffers' priority updates go to a journal (distorefs/priojournal.py); an
older distorefs would not read it, so it must not open the store.

Format 1 -> 2: entry records gain the places of their arrays (distorefs/layout.py). Each
buffer's values are read and parsed once: the first entry fixes the buffer's schema when
it has none; a buffer whose entries do not all share one layout is set to raw mode
(logged), since its batches could never have been stacked. Bank entries need no places.
Records are rewritten in transactions of a few hundred; the format key changes last, so a
crash in the middle leaves a format-1 store whose migration runs again (rewriting a
record twice is harmless).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import cast

from .backends.lmdbenv import LmdbEnv
from .catalog import DB_ENTRIES, DB_META, DB_NS, FORMAT_VERSION, EntryMeta, ns_prefix, pack_u32, unpack_u32
from .codec import checksums
from .config import BufferConfig
from .errors import DistorefsError, InvalidConfig
from .layout import Layout, NotStackable, pack_places, parse, place
from .values import ValueLayer

log = logging.getLogger(__name__)

BATCH = 256


def stored_format(env: LmdbEnv) -> int | None:
    raw = env.read(lambda txn: txn.get(b"format", db=DB_META))
    return None if raw is None else unpack_u32(bytes(raw))


def migrate(env: LmdbEnv, values: ValueLayer) -> None:
    """Bring the store in `env` to FORMAT_VERSION (nothing for a new or current store);
    InvalidConfig for a store newer than this distorefs."""
    fmt = stored_format(env)
    if fmt is None or fmt == FORMAT_VERSION:
        return
    if fmt > FORMAT_VERSION:
        raise InvalidConfig(f"the store has format {fmt}; this distorefs knows formats up to {FORMAT_VERSION}")
    log.warning("store format %d: upgrading to %d", fmt, FORMAT_VERSION)
    if fmt < 2:  # entry records gain their arrays' places
        namespaces = env.read(lambda txn: [(bytes(k).decode(), json.loads(bytes(v))) for k, v in txn.cursor(DB_NS)])
        for key, record in namespaces:
            kind, _, name = key.partition("/")
            if kind in ("buffers", "banks"):
                _migrate_ring(env, values, kind, name, record)
    # 2 -> 3: nothing to rewrite (the priority journal's databases start empty); the number
    # keeps a distorefs that knows no journal from opening the store and missing its updates.
    env.write(lambda txn: txn.put(b"format", pack_u32(FORMAT_VERSION), db=DB_META))


def _migrate_ring(env: LmdbEnv, values: ValueLayer, kind: str, name: str, record: dict) -> None:
    prefix = ns_prefix(record["id"])
    config = BufferConfig.from_dict(record["config"]) if kind == "buffers" else None
    parsed = config is not None and not config.raw
    layout = Layout.from_json(config.schema) if parsed and config is not None and config.schema else None
    mixed = False
    after = prefix
    count = 0
    while True:
        def rows(txn, after=after):
            out = []
            cur = txn.cursor(DB_ENTRIES)
            if cur.set_range(after):
                for k, v in cur:
                    k = bytes(k)
                    if not k.startswith(prefix) or len(out) >= BATCH:
                        break
                    if k != after:  # `after` itself was done in the batch before
                        out.append((k, bytes(v)))
            return out
        batch = env.read(rows)
        if not batch:
            break
        metas = []
        for k, v in batch:
            meta = EntryMeta.unpack_v1(int.from_bytes(k[4:], "big"), v)
            if parsed and not mixed:
                what = f"{kind}/{name}/entries/{meta.key.decode(errors='replace')}"
                try:
                    data = values.read(meta.value, what)
                    if layout is None:
                        layout = parse(data)[0]
                    offsets = place(layout, data)
                    regions = [(off, f.nbytes) for off, f in zip(offsets, layout.fields)]
                    meta = dataclasses.replace(meta, places=pack_places(offsets, checksums(data, regions)[1]))
                except NotStackable as exc:
                    mixed = True
                    log.warning("%s/%s: %s: the buffer is set to raw mode", kind, name, exc)
                except DistorefsError as exc:  # a damaged value: it stays unparsed (reads fail anyway)
                    log.error("%s: %s", what, exc)
            metas.append((k, meta))

        def write(txn, metas=metas):
            for k, meta in metas:
                txn.put(k, meta.pack(), db=DB_ENTRIES)
        env.write(write)
        count += len(metas)
        after = batch[-1][0]
    if config is not None and (mixed or (layout is not None and config.schema is None)):
        new = dataclasses.replace(config, raw=True, schema=None) if mixed else \
            dataclasses.replace(config, schema=cast(Layout, layout).to_json())  # (not mixed: there is one)

        def save(txn):
            key = f"{kind}/{name}".encode()
            rec = json.loads(bytes(txn.get(key, db=DB_NS)))
            rec["config"] = new.to_dict()
            txn.put(key, json.dumps(rec).encode(), db=DB_NS)
        env.write(save)
    log.info("%s/%s: %d entry records upgraded", kind, name, count)

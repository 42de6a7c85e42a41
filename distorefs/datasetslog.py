"""datasets/ of a shared store: a dataset staged on one node, once sealed, on every node.

Before it is sealed a dataset is the tree of the node staging it. Sealing it on a node
that follows a shared store exports it before the seal returns (`export`): its values
(item chunks, index.npy) are copied into the cluster as stored, and its records
(directories, names, sealed items pointing at the copies, counters) are appended to the
log in parts (`dpart`, at most PART_RECORDS records each, so memory stays bounded
whatever the dataset's size), then one `dseal` record carries its catalog record.

Every other node writes the parts aside as they come (`ApplyPart`: under PENDING, a
dataset id no dataset has, so a part applied twice is the same write) and at `dseal`
makes the dataset from them in one commit (`AdoptDataset`): a reader there sees no
dataset, then the whole sealed one. Reads there fetch the copies from the cluster, and
each node's prefetcher reads ahead along the order declared on that node.

The export's id (origin node, dataset id, seal time) is the same when a node dies during
its export and exports again at its next start (`unshared`), so the parts converge. A node
with a dataset of that name of its own keeps it, and says so. Sealed datasets are never
removed (rmdir of a sealed dataset is ENOTEMPTY), so no record removes one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from typing import Callable

import trio

from .catalog import DB_META, DB_NS, pack_u32, unpack_u32
from .clusterlog import Record, SharedLog
from .committer import Change, Committer, Overlay
from .config import DatasetConfig
from .dataset import DB_DSNODES, LINKS, SEALED, STAGING, Counters, Dataset, Item
from .errors import AlreadyExists
from .namespace import ns_key, update_record
from .owner import Owner
from .values import StoredValue, ValueLayer

log = logging.getLogger(__name__)

PART_RECORDS = 2048  # dataset records per `dpart` record of the log
PENDING = struct.pack(">I", 0xFFFFFFFF)  # the dataset id of parts waiting for their `dseal`
_PAIR = struct.Struct("<HI")
_ITEM_TAGS = (SEALED, STAGING, LINKS)


def pending_prefix(export: str) -> bytes:
    """Where a node keeps the parts of `export` until its `dseal` (in the dataset db)."""
    return PENDING + hashlib.blake2b(export.encode(), digest_size=8).digest()


def pack_pairs(pairs: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(_PAIR.pack(len(k), len(v)) + k + v for k, v in pairs)


def unpack_pairs(data: bytes) -> list[tuple[bytes, bytes]]:
    out, off = [], 0
    while off < len(data):
        klen, vlen = _PAIR.unpack_from(data, off)
        off += _PAIR.size
        out.append((data[off:off + klen], data[off + klen:off + klen + vlen]))
        off += klen + vlen
    return out


class DatasetsLog:
    def __init__(self, shared: SharedLog, committer: Committer, values: ValueLayer, origin: str,
                 datasets: dict, make: Callable[..., Dataset]) -> None:
        """`datasets`: the store's datasets by name (an adopted one is added to it);
        `make(ds_id, name, config, owner, ctime_ns, record)` builds a Dataset."""
        self.log = shared
        self.committer = committer
        self.values = values
        self.origin = origin
        self.datasets = datasets
        self.make = make
        self.counters = {"exported": 0, "adopted": 0, "export_records": 0}

    # ----- this node's datasets ---------------------------------------------------------------

    def unshared(self) -> list[Dataset]:
        """Sealed datasets of this node not exported yet (sealed before the store joined, or
        a crash cut the export short)."""
        return [ds for ds in self.datasets.values() if ds.sealed and ds.shared is None]

    async def export(self, ds: Dataset) -> None:
        """Share sealed dataset `ds` with every node (durable in the cluster when it returns)."""
        export = f"{self.origin}/{ds.ds_id}/{ds.sealed_ns}"
        path = f"datasets/{ds.name}"
        after, part = b"", 0
        while True:
            pairs, after = await trio.to_thread.run_sync(self._page, ds, after)
            if not pairs:
                break
            await trio.to_thread.run_sync(lambda: self.log.tree_change(
                self.origin, "dpart", path, export=export, part=part, data=pack_pairs(pairs)))
            part += 1
            self.counters["export_records"] += len(pairs)
        record = await trio.to_thread.run_sync(self._catalog_record, ds)
        shared = {"export": export, "origin": self.origin}
        await trio.to_thread.run_sync(lambda: self.log.tree_change(
            self.origin, "dseal", path, export=export, parts=part, record=json.dumps({**record, "shared": shared})))
        await self.committer.submit(MarkShared(ds, shared))
        self.counters["exported"] += 1
        log.info("%s shared: %d items in %d parts of the log", path, ds.counters.items, part)

    def _page(self, ds: Dataset, after: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The next PART_RECORDS records of `ds` after key suffix `after`, with their values
        copied into the cluster (worker thread). Keys lose the dataset's id (each node has
        its own)."""
        prefix = ds._prefix

        def read(txn) -> list[tuple[bytes, bytes]]:
            out: list[tuple[bytes, bytes]] = []
            cursor = txn.cursor(db=DB_DSNODES)
            if not cursor.set_range(prefix + after):
                return out
            for k, v in cursor:
                key = bytes(k)
                if not key.startswith(prefix) or len(out) >= PART_RECORDS:
                    break
                if not (after and key[len(prefix):] == after):  # sent with the page before
                    out.append((key[len(prefix):], bytes(v)))
            return out

        raw = ds.env.read(read)
        if not raw:
            return [], after
        items: list[tuple[int, Item]] = []
        for i, (suffix, value) in enumerate(raw):
            tag = suffix[:1]
            if tag in _ITEM_TAGS and len(suffix) == 9:
                items.append((i, Item.unpack(0, value, tag)))
        copies = iter(self.values.copy_to_cluster([c for _, item in items for c in item.chunks]))
        for i, item in items:
            item.chunks = [next(copies) for _ in item.chunks]
            raw[i] = (raw[i][0], item.pack())
        return raw, raw[-1][0]

    def _catalog_record(self, ds: Dataset) -> dict:
        """The dataset's catalog record for the other nodes: index chunks copied (worker thread)."""
        record = ds.env.read(lambda txn: json.loads(bytes(txn.get(ns_key("datasets", ds.name), db=DB_NS))))
        index = self.values.copy_to_cluster([StoredValue.from_json(c) for c in record.get("index", [])])
        record["index"] = [c.to_json() for c in index]
        record.pop("id", None)
        return record

    # ----- another node's records -------------------------------------------------------------

    async def apply(self, rec: Record) -> None:
        export = rec.fields[b"export"].decode()
        if rec.op == "dpart":
            await self.committer.submit(ApplyPart(pending_prefix(export), unpack_pairs(bytes(rec.fields[b"data"]))))
        elif rec.op == "dseal":
            record = json.loads(rec.fields[b"record"])
            mine = self.datasets.get(rec.name)
            if mine is not None:
                if (mine.shared or {}).get("export") != export:
                    log.warning("cluster log: datasets/%s of another node not taken here: this node has a "
                                "dataset of that name", rec.name)
                await self.committer.submit(DropPart(pending_prefix(export)))
                return
            await self.committer.submit(AdoptDataset(self, rec.name, record, pending_prefix(export)))
            self.counters["adopted"] += 1
        else:
            log.warning("cluster log: datasets record %s of unknown op %r left alone", rec.id.decode(), rec.op)


class ApplyPart(Change):
    """Records of a dataset another node exports, kept aside until its `dseal`."""

    def __init__(self, prefix: bytes, pairs: list[tuple[bytes, bytes]]) -> None:
        self.prefix, self.pairs = prefix, pairs

    def txn(self, txn) -> None:
        for suffix, value in self.pairs:
            txn.put(self.prefix + suffix, value, db=DB_DSNODES)


class DropPart(Change):
    """Parts kept aside that no dataset will take (their name is taken here)."""

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix

    def txn(self, txn) -> None:
        _move(txn, self.prefix, None)


class AdoptDataset(Change):
    """A sealed dataset of another node, made here from its parts in one commit."""

    def __init__(self, shared: DatasetsLog, name: str, record: dict, pending: bytes) -> None:
        self.shared, self.name, self.record, self.pending = shared, name, record, pending
        self.conflict_key = ("ns", "datasets", name)

    def plan(self, overlay: Overlay) -> None:
        if self.name in self.shared.datasets:
            raise AlreadyExists(f"datasets/{self.name} exists")

    def txn(self, txn) -> None:
        self.ns_id = unpack_u32(bytes(txn.get(b"next_ns", db=DB_META)))
        txn.put(b"next_ns", pack_u32(self.ns_id + 1), db=DB_META)
        target = struct.pack(">I", self.ns_id)
        _move(txn, self.pending, target)
        raw = txn.get(target + b"c", db=DB_DSNODES)
        self.counters = Counters.unpack(raw) if raw is not None else Counters()
        txn.put(ns_key("datasets", self.name), json.dumps({**self.record, "id": self.ns_id}).encode(), db=DB_NS)

    def apply(self) -> None:
        r = self.record
        ds = self.shared.make(self.ns_id, self.name, DatasetConfig.from_dict(r["config"]),
                              Owner(r["mode"], r["uid"], r["gid"]), r["ctime_ns"], {**r, "id": self.ns_id})
        ds.counters = self.counters
        self.shared.datasets[self.name] = ds


class MarkShared(Change):
    """This node's dataset is exported: its catalog record says so (no second export)."""

    def __init__(self, ds: Dataset, shared: dict) -> None:
        self.ds, self.shared = ds, shared
        self.conflict_key = ("ns", "datasets", ds.name)

    def txn(self, txn) -> None:
        update_record(txn, "datasets", self.ds.name, shared=self.shared)

    def apply(self) -> None:
        self.ds.shared = self.shared


def _move(txn, prefix: bytes, target: bytes | None) -> None:
    """Every dataset record under `prefix` moved under `target` (None: deleted)."""
    cursor = txn.cursor(db=DB_DSNODES)
    while cursor.set_range(prefix):
        key = bytes(cursor.key())
        if not key.startswith(prefix):
            break
        if target is not None:
            txn.put(target + key[len(prefix):], bytes(cursor.value()), db=DB_DSNODES)
        cursor.delete()

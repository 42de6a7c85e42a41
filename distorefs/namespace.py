"""A namespace's record in the `ns` database (its config and owner), and the changes to it.

Every namespace (buffers/NAME, banks/NAME, datasets/NAME) has one JSON record under
`KIND/NAME`: id, kind, config, mode, uid, gid, ctime (datasets add their seal). A change
of configuration or owner rewrites it in the commit that changes the namespace in memory.
"""

from __future__ import annotations

import json
from typing import Any

from .catalog import DB_NS
from .committer import Change, Overlay
from .errors import NotFound
from .owner import Owner


def ns_key(kind: str, name: str) -> bytes:
    return f"{kind}/{name}".encode("utf-8", "surrogateescape")


def update_record(txn, kind: str, name: str, **fields: Any) -> None:
    """Set `fields` of a namespace's record (inside a commit's transaction)."""
    key = ns_key(kind, name)
    raw = txn.get(key, db=DB_NS)
    if raw is None:
        raise NotFound(f"no {kind}/{name}")
    record = json.loads(bytes(raw))
    record.update(fields)
    txn.put(key, json.dumps(record).encode(), db=DB_NS)


class ConfigureNamespace(Change):
    """A new configuration; shrinking capacity or max_bytes evicts the oldest at once. The
    namespace may refuse it for what it holds (`check_reconfigure`: InvalidConfig)."""

    def __init__(self, ns, config) -> None:
        self.ns = ns
        self.config = config
        self.conflict_key = ("ns", ns.kind, ns.name)

    def plan(self, overlay: Overlay) -> None:
        check = getattr(self.ns, "check_reconfigure", None)
        if check is not None:
            check(self.config)
        ring = getattr(self.ns, "ring", None)
        self.victims = ring.plan_evictions(overlay.ring(self.ns.ns_id), config=self.config) if ring else []

    def txn(self, txn) -> None:
        for victim in self.victims:
            self.ns.ring.txn_remove(txn, victim)
        update_record(txn, self.ns.kind, self.ns.name, config=self.config.to_dict())

    def apply(self) -> None:
        for victim in self.victims:
            self.ns.ring.apply_remove(victim, "evictions")
        self.ns.reconfigure(self.config)


class SetNamespaceOwner(Change):
    def __init__(self, ns, owner: Owner) -> None:
        self.ns = ns
        self.owner = owner
        self.conflict_key = ("ns", ns.kind, ns.name)

    def txn(self, txn) -> None:
        update_record(txn, self.ns.kind, self.ns.name, mode=self.owner.mode, uid=self.owner.uid, gid=self.owner.gid)

    def apply(self) -> None:
        self.ns.owner = self.owner

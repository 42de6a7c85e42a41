"""Memory banks (banks/NAME): a FIFO ring of variable-size entries, read by key or by
position (`at(i)`, 0 = oldest, O(log n)); no sampling. The ring is the one buffers use."""

from __future__ import annotations

from .catalog import EntryMeta
from .config import BankConfig
from .ring import Owner, Ring


class Bank:
    kind = "banks"
    config_type = BankConfig

    def __init__(self, store, ns_id: int, name: str, config: BankConfig, owner: Owner, ctime_ns: int) -> None:
        self.store = store
        self.name = name
        self.owner = owner
        self.ctime_ns = ctime_ns
        self.ring = Ring(store, ns_id, self.kind, name, config)

    @property
    def config(self) -> BankConfig:
        return self.ring.config  # type: ignore[return-value]

    @property
    def ns_id(self) -> int:
        return self.ring.ns_id

    async def insert(self, key: bytes, data: bytes, owner: Owner) -> EntryMeta:
        return await self.ring.insert(key, data, owner)

    def at(self, index: int) -> EntryMeta:
        return self.ring.at(index)

    def reconfigure(self, config: BankConfig) -> None:
        self.ring.config = config

    def stats(self) -> dict:
        return {"name": self.name, **self.ring.stats()}

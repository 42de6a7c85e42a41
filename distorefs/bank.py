"""Memory banks (banks/NAME): a FIFO ring of variable-size entries, read by key or by
position (`at(i)`, 0 = oldest, O(log n)); no sampling. The ring is the one buffers use."""

from __future__ import annotations

from .catalog import EntryMeta
from .config import BankConfig
from .owner import Owner
from .ring import RingNamespace


class Bank(RingNamespace):
    kind = "banks"
    config_type = BankConfig

    async def insert(self, key: bytes, data: bytes, owner: Owner) -> EntryMeta:
        return await self.ring.insert(key, data, owner)

    def at(self, index: int) -> EntryMeta:
        return self.ring.at(index)

    def reconfigure(self, config: BankConfig) -> None:
        self.ring.configure(config)

    def stats(self) -> dict:
        return {"name": self.name, **self.ring.stats()}

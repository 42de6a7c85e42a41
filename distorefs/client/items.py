"""A sealed dataset's items read in the caller's process (MountedDataset's direct way).

Where each item's chunks are comes from the daemon (`datasets/NAME/client`, ITEMS) a block
of item numbers at a time, kept here (sealed items never change); the chunks are read from
the store's files, each verified by its checksum, and joined. An item whose chunks do not
read or verify here is left to the caller, who reads its file through the mount (where
the daemon reports damage).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import cast

import numpy as np

from .. import clientwire as wire
from ..codec import checksum
from .channel import Channel
from .storereader import Wanted, store_reader

BLOCK = 4096  # item numbers located in one request
BLOCKS_KEPT = 256  # blocks of locations kept (a million items)


class DatasetItems:
    def __init__(self, root: str | os.PathLike) -> None:
        """The sealed dataset at `root` (MNT/datasets/NAME); OSError when this process cannot
        read its store's files or the dataset has no client file (not sealed)."""
        self.root = os.fspath(root)
        self.name = os.path.basename(self.root.rstrip("/"))
        self.channel = Channel(os.path.join(self.root, "client"))
        try:
            meta, _ = self.channel.call(wire.frame(wire.HELLO))
            if meta.get("protocol") != wire.PROTOCOL:
                raise OSError(f"{root}: the daemon speaks client protocol {meta.get('protocol')}")
            self.reader = store_reader(meta["lmdb"])
        except BaseException:
            self.channel.close()
            raise
        self.items = int(meta["items"])
        self.pid = os.getpid()
        self._blocks: OrderedDict[int, tuple[dict, list[Wanted]]] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = {"direct": 0, "through_mount": 0}

    def _block(self, b: int) -> tuple[dict, list]:
        with self._lock:
            found = self._blocks.get(b)
            if found is not None:
                self._blocks.move_to_end(b)
                return found
            numbers = np.arange(b * BLOCK, min((b + 1) * BLOCK, self.items), dtype=np.int64)
            meta, t = self.channel.call(wire.items_request(numbers))
            self.reader.learn_segments(meta["segments"])
            chunks = []
            for j in range(len(t["sizes"])):
                lo, hi = t["loc_offsets"][j], t["loc_offsets"][j + 1]
                chunks.append(Wanted(int(t["tiers"][j]), t["locs"][lo:hi].tobytes(), int(t["sizes"][j]),
                                     int(t["stored_sizes"][j]), int(t["checksums"][j]), int(t["codecs"][j]),
                                     ""))
            found = ({k: t[k].copy() for k in ("present", "item_sizes", "item_checksums", "first_chunk")}, chunks)
            self._blocks[b] = found
            while len(self._blocks) > BLOCKS_KEPT:
                self._blocks.popitem(last=False)
            return found

    def read(self, i: int) -> bytes | None:
        """Item i's content, verified; None when it must be read through the mount."""
        if not 0 <= i < self.items:
            return None
        table, chunks = self._block(i // BLOCK)
        j = i % BLOCK
        if not table["present"][j]:
            return None
        first, last = int(table["first_chunk"][j]), int(table["first_chunk"][j + 1])
        what = f"datasets/{self.name} item {i}"
        wanted = [Wanted(c.tier, c.loc, c.size, c.stored_size, c.checksum, c.codec, f"{what} chunk {k}")
                  for k, c in enumerate(chunks[first:last])]
        parts = self.reader.read(wanted)
        if any(isinstance(p, Exception) for p in parts):
            self.counters["through_mount"] += 1
            return None
        done = cast("list[bytes]", parts)  # no Exception among them (above)
        data = done[0] if len(done) == 1 else b"".join(done)
        if len(data) != table["item_sizes"][j] or (len(parts) > 1 and checksum(data) != table["item_checksums"][j]):
            self.counters["through_mount"] += 1
            return None
        self.counters["direct"] += 1
        return data if data else b""

    def close(self) -> None:
        if self.pid == os.getpid():
            self.channel.close()
        self.reader.close()

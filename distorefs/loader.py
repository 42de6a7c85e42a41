"""A map-style dataset and an epoch sampler over a mounted, sealed dataset (no torch import).

    ds = MountedDataset("/mnt/rl/datasets/imagenet", transform=decode)
    loader = torch.utils.data.DataLoader(ds, batch_size=256, sampler=EpochSampler(ds), num_workers=8)
    for epoch in range(90):
        loader.sampler.set_epoch(epoch)
        for batch in loader: ...

`EpochSampler` shuffles the item numbers of each epoch and writes them to the dataset's
`order` file before yielding the first one, so the daemon reads ahead along exactly the
order the workers will ask for (each rank of a DDP job declares its own part: every
rank's part is read ahead). `MountedDataset[i]` reads item i's bytes from the store's files
in the caller's process when it may read them (distorefs/client/items.py: the daemon says
where the chunks are, this process reads and verifies them), else `items/<path of item i>`
with a plain open(). torch accepts both because they follow its protocols (`__len__` and
`__getitem__`; `__iter__` and `__len__`), not because they import it.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np


class MountedDataset:
    def __init__(self, root: str | os.PathLike, transform: Callable[[bytes], Any] | None = None, *,
                 direct: bool | None = None) -> None:
        """`root` is MNT/datasets/NAME (sealed). Items are returned as bytes, or as
        `transform(bytes)` when a transform is given. `direct` None: read items from the
        store's files when this process may, else (said once, as a warning) through the
        mount; False: always through the mount; True: the store's files or an error."""
        self.root = Path(root)
        self.index = np.load(self.root / "index.npy")
        self.items = os.fsencode(self.root / "items") + b"/"
        self.transform = transform
        self.direct = direct
        self._reader: Any = None
        self._reader_pid = -1

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_reader"], state["_reader_pid"] = None, -1  # a worker process opens its own
        return state

    def _direct_reader(self):
        """This process's reader of the store's files (a DataLoader worker opens its own), or None."""
        if self.direct is False:
            return None
        if self._reader_pid != os.getpid():
            self._reader_pid = os.getpid()
            self._reader = None
            from .client.items import DatasetItems
            try:
                self._reader = DatasetItems(self.root)
            except OSError as exc:
                if self.direct:
                    raise
                _warn_once(str(self.root), exc)
        return self._reader

    def close(self) -> None:
        """Close this process's reader of the store's files (it holds the dataset's client
        file open: a mount is busy while it is)."""
        if self._reader is not None and self._reader_pid == os.getpid():
            self._reader.close()
        self._reader, self._reader_pid = None, -1

    def __enter__(self) -> "MountedDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.index)

    def path(self, i: int) -> bytes:
        return self.items + bytes(self.index["path"][i])

    def __getitem__(self, i: int) -> Any:
        reader = self._direct_reader()
        data = reader.read(int(i)) if reader is not None else None
        if data is None:
            with open(self.path(int(i)), "rb") as f:
                data = f.read()
        return self.transform(data) if self.transform is not None else data

    def declare(self, order: Sequence[int] | np.ndarray) -> None:
        """Tell the daemon the order of the next reads (replacing the previous one)."""
        with open(self.root / "order", "wb") as f:
            np.save(f, np.asarray(order, dtype=np.int64))


_warned: set[str] = set()


def _warn_once(root: str, exc: Exception) -> None:
    if root not in _warned:
        _warned.add(root)
        warnings.warn(f"distorefs: {root}: cannot read the store directly ({exc}); reading items through the "
                      f"mount (same bytes, more daemon round trips)", stacklevel=3)


class EpochSampler:
    """Item numbers of one epoch, shuffled by (seed, epoch), declared before they are read.

    With `world_size` > 1 each rank takes every world_size-th item of the shared
    permutation (like torch's DistributedSampler) and declares only its own part.
    """

    def __init__(self, dataset: MountedDataset, *, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> np.ndarray:
        n = len(self.dataset)
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(n)
        else:
            order = np.arange(n)
        return order[self.rank::self.world_size].astype(np.int64)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.world_size))

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        self.dataset.declare(order)
        return iter(order.tolist())

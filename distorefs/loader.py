"""A map-style dataset and an epoch sampler over a mounted, sealed dataset (no torch import).

    ds = MountedDataset("/mnt/rl/datasets/imagenet", transform=decode)
    loader = torch.utils.data.DataLoader(ds, batch_size=256, sampler=EpochSampler(ds), num_workers=8)
    for epoch in range(90):
        loader.sampler.set_epoch(epoch)
        for batch in loader: ...

`EpochSampler` shuffles the item numbers of each epoch and writes them to the dataset's
`order` file before yielding the first one, so the daemon reads ahead along exactly the
order the workers will ask for; `MountedDataset[i]` reads `items/<path of item i>` with a
plain open(). torch accepts both because they follow its protocols (`__len__` and
`__getitem__`; `__iter__` and `__len__`), not because they import it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np


class MountedDataset:
    def __init__(self, root: str | os.PathLike, transform: Callable[[bytes], Any] | None = None) -> None:
        """`root` is MNT/datasets/NAME (sealed). Items are returned as bytes, or as
        `transform(bytes)` when a transform is given."""
        self.root = Path(root)
        self.index = np.load(self.root / "index.npy")
        self.items = os.fsencode(self.root / "items") + b"/"
        self.transform = transform

    def __len__(self) -> int:
        return len(self.index)

    def path(self, i: int) -> bytes:
        return self.items + bytes(self.index["path"][i])

    def __getitem__(self, i: int) -> Any:
        with open(self.path(int(i)), "rb") as f:
            data = f.read()
        return self.transform(data) if self.transform is not None else data

    def declare(self, order: Sequence[int] | np.ndarray) -> None:
        """Tell the daemon the order of the next reads (replacing the previous one)."""
        with open(self.root / "order", "wb") as f:
            np.save(f, np.asarray(order, dtype=np.int64))


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

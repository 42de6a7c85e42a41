"""A torch IterableDataset of batches drawn from a distorefs buffer (torch is imported here
only: `distorefs.client` itself never needs it).

    from distorefs.client.torchdata import SampledBatches
    loader = torch.utils.data.DataLoader(SampledBatches("/mnt/rl/buffers/replay", 256),
                                         batch_size=None, num_workers=2)
    for batch in loader:   # dict of tensors (+ "keys": a list of str)
        ...

Each worker process opens its own session; every batch is a fresh draw by the daemon
(sampler, priorities and times-sampled stay there), read in the worker's own process.
"""

from __future__ import annotations

import itertools
import os
from typing import Iterator

import numpy as np
import torch

from . import open_buffer


def to_tensors(batch: dict[str, np.ndarray]) -> dict:
    """A sampled batch as torch tensors; `keys` (strings) as a list of str."""
    out: dict = {}
    for name, array in batch.items():
        out[name] = array.tolist() if array.dtype.kind in "US" else torch.from_numpy(np.ascontiguousarray(array))
    return out


class SampledBatches(torch.utils.data.IterableDataset):
    def __init__(self, path: str | os.PathLike, batch_size: int, *, steps: int | None = None,
                 read_ahead: bool = True) -> None:
        """Batches of `batch_size` drawn from buffers/NAME at `path`: `steps` of them per
        iteration (per worker), or without end."""
        super().__init__()
        self.path = os.fspath(path)
        self.batch_size = batch_size
        self.steps = steps
        self.read_ahead = read_ahead

    def __iter__(self) -> Iterator[dict]:
        buf = open_buffer(self.path, read_ahead=self.read_ahead)
        try:
            for _ in (range(self.steps) if self.steps is not None else itertools.count()):
                yield to_tensors(buf.sample(self.batch_size))
        finally:
            buf.close()

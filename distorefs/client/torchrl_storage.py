"""A TorchRL storage whose data lives in a distorefs buffer (torch, tensordict and torchrl are
imported here only).

    from distorefs.client.torchrl_storage import replay_buffer
    rb = replay_buffer("/mnt/rl/buffers/replay", max_size=100_000, batch_size=256)
    rb.extend(tensordict_of_transitions)
    batch = rb.sample()

(`replay_buffer` is `ReplayBuffer(storage=DistorefsStorage(path, max_size), collate_fn=
as_is, ...)`: `get` returns a stacked TensorDict already.)

Item i of the storage is the entry `entries/<i as 12 digits>`: a TensorDict row stored as
the `.npz` the file path stores (nested keys joined by "."), inserted through the client
and committed before `set` returns; `get` reads rows back by key, stacked, in this process.
TorchRL's sampler and writer pick the indices (a RoundRobinWriter overwrites the oldest
index once the storage is full, as it does with its own storages). Other processes see the
same data through the mount (`ls entries/`, `batch/N.npz`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import Storage

from ..layout import RESERVED
from . import open_buffer

_EXTRA = ("keys", "seqs", "probabilities", "weights")


def _key(index: int) -> str:
    return f"{index:012d}"


def _indices(index: Any) -> tuple[list[int], bool]:
    """(the indices, whether one was given as a scalar)."""
    if isinstance(index, (int, np.integer)):
        return [int(index)], True
    if isinstance(index, torch.Tensor):
        return [int(i) for i in index.reshape(-1).tolist()], index.ndim == 0
    if isinstance(index, slice):
        raise TypeError("slices are not supported by DistorefsStorage; give indices")
    if isinstance(index, np.ndarray):
        return [int(i) for i in index.reshape(-1).tolist()], index.ndim == 0
    return [int(i) for i in index], False


class DistorefsStorage(Storage):
    def __init__(self, path: str | os.PathLike, max_size: int | None = None) -> None:
        """buffers/NAME at `path` holds the data; `max_size` defaults to its capacity."""
        self.path = os.fspath(path)
        if max_size is None:
            with open(os.path.join(self.path, "config.json"), "rb") as f:
                max_size = int(json.loads(f.read())["capacity"])
        super().__init__(max_size)
        self.buffer = open_buffer(self.path)
        self._len = 0

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        indices, scalar = _indices(cursor)
        if not isinstance(data, TensorDictBase):
            raise TypeError(f"DistorefsStorage stores TensorDicts, not {type(data).__name__}")
        if set_cursor:
            self._set_last_cursor(cursor)
        flat = data.flatten_keys(".")
        arrays = {k: v.detach().cpu().numpy() for k, v in flat.items()}
        if scalar:
            arrays = {k: v[None] for k, v in arrays.items()}
        for row, index in enumerate(indices):
            if not 0 <= index < self.max_size:
                raise IndexError(f"index {index} out of 0..{self.max_size - 1}")
            self.buffer.insert(_key(index), {k: v[row] for k, v in arrays.items()})
        self.buffer.flush()
        self._len = max(self._len, max(indices) + 1)
        self._bump_mutation_revision()

    def get(self, index: Any) -> TensorDict:
        indices, scalar = _indices(index)
        batch = self.buffer.get([_key(i) for i in indices])
        fields = {}
        for name, array in batch.items():
            if name in _EXTRA:
                continue
            if name.startswith("entry_") and name[6:] in RESERVED:
                name = name[6:]
            fields[name] = torch.from_numpy(np.ascontiguousarray(array))
        td = TensorDict(fields, batch_size=[len(indices)]).unflatten_keys(".")
        return td[0] if scalar else td

    def __len__(self) -> int:
        return self._len

    def state_dict(self) -> dict[str, Any]:
        return {"len": self._len, "path": self.path}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._len = int(state_dict["len"])

    def _empty(self) -> None:
        self._len = 0

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("buffer", None)  # a process that unpickles it opens its own session
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.buffer = open_buffer(self.path)


def as_is(batch: Any) -> Any:
    """The collate function of a DistorefsStorage: its `get` stacks the rows already."""
    return batch


def replay_buffer(path: str | os.PathLike, max_size: int | None = None, **kwargs: Any):
    """A TorchRL ReplayBuffer whose storage is buffers/NAME at `path` (other arguments, such
    as sampler, writer, batch_size, are TorchRL's)."""
    from torchrl.data import ReplayBuffer
    return ReplayBuffer(storage=DistorefsStorage(path, max_size), collate_fn=as_is, **kwargs)

"""The memory of a client's big batches, used again once the caller has let go of it.

A learner holds its batch while it draws the next one, so every batch of 113 KB frames
(29 MB for 256) was fresh memory: the kernel faulted and zeroed each page (or 2 MB huge
page) of it on the first copy, about 3 ms a batch here, as much as the copy itself. A
block whose arrays nobody holds any more is handed out again instead. Whether anybody holds
it is its reference count: every array, view or memoryview made from it (a torch tensor of
it included) refers to it, so a block is reused only when the list here is its last holder.

Imports neither trio nor pyfuse3.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

MIN_BYTES = 1 << 20  # smaller arrays come as cheaply from malloc's own free lists
KEEP_BLOCKS = 3  # at most this many blocks kept: memory held is bounded by 3 of the biggest batch


class BatchMemory:
    """Blocks of bytes for the arrays of batches; `empty` is np.empty, of recycled memory
    when it can be (thread-safe)."""

    def __init__(self, keep: int = KEEP_BLOCKS) -> None:
        self.keep = keep
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < MIN_BYTES or dtype.hasobject:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            block = self._take(nbytes)
        return block.view(dtype).reshape(shape)

    def _take(self, nbytes: int) -> np.ndarray:
        free = [i for i in range(len(self._blocks))
                if sys.getrefcount(self._blocks[i]) == 2]  # (the list's reference and getrefcount's argument)
        for i in free:
            if self._blocks[i].nbytes == nbytes:
                self.reused += 1
                return self._blocks[i]
        block = np.empty(nbytes, dtype=np.uint8)
        if len(self._blocks) < self.keep:
            self._blocks.append(block)
        else:  # replace a free block of another size, else the oldest (its holder keeps it alive)
            self._blocks.pop(free[0] if free else 0)
            self._blocks.append(block)
        return block

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

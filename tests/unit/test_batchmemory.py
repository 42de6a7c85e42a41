"""BatchMemory: memory of big batches is used again only once nothing made from it is held."""

from __future__ import annotations

import numpy as np
import pytest

from distorefs.client.batchmemory import MIN_BYTES, BatchMemory

SHAPE = (16, MIN_BYTES // 8)  # 2 MiB of uint8


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_memory_let_go_of_is_used_again():
    memory = BatchMemory()
    first = memory.empty(SHAPE, np.uint8)
    at = _address(first)
    del first
    again = memory.empty(SHAPE, np.uint8)
    assert _address(again) == at and memory.reused == 1


@pytest.mark.parametrize("hold", ["array", "view", "memoryview", "bytes view of a field"])
def test_memory_still_held_in_any_form_is_never_handed_out(hold):
    memory = BatchMemory()
    first = memory.empty(SHAPE, np.uint8)
    first[:] = 7
    held = {"array": lambda a: a, "view": lambda a: a[3:5, 10:],
            "memoryview": memoryview, "bytes view of a field": lambda a: a.view(np.uint16)[0]}[hold](first)
    del first
    for _ in range(2 * memory.keep):
        fresh = memory.empty(SHAPE, np.uint8)
        fresh[:] = 1
    assert np.all(np.asarray(held) == (7 if hold != "bytes view of a field" else 0x0707))


def test_a_torch_tensor_of_a_batch_keeps_its_memory():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    memory = BatchMemory()
    first = memory.empty(SHAPE, np.uint8)
    first[:] = 9
    tensor = torch.from_numpy(first)
    del first
    for _ in range(2 * memory.keep):
        memory.empty(SHAPE, np.uint8)[:] = 1
    assert int(tensor.min()) == 9 == int(tensor.max())


def test_blocks_kept_are_bounded_and_small_arrays_are_plain():
    memory = BatchMemory(keep=2)
    held = [memory.empty(SHAPE, np.float32) for _ in range(5)]
    assert len(memory._blocks) == 2
    small = memory.empty((10,), np.float64)
    assert small.base is None and len(memory._blocks) == 2
    assert all(a.dtype == np.float32 and a.shape == SHAPE for a in held)

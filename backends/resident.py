"""Whether pages of a mapping are in memory (mincore(2)): a read of them then costs a copy,
never a wait for the disk, so a caller on an event loop may make it there."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

PAGE = mmap.PAGESIZE
_mincore = ctypes.CDLL(None, use_errno=True).mincore
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_mincore.restype = ctypes.c_int
MAX_PAGES = 64  # longer ranges are not asked about by in_memory (their copy is not cheap anyway)


def page_flags(addr: int, length: int) -> bytes | None:
    """mincore's answer for the `length` bytes mapped at `addr` (a page boundary): a byte
    per page, bit 0 set where the page is in memory; None if mincore failed."""
    vec = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
    return vec.raw if _mincore(addr, length, vec) == 0 else None


def in_memory(view: memoryview) -> bool:
    """Whether every page `view` (a buffer into a file mapping) covers is in the page
    cache. False when that cannot be said (more than MAX_PAGES pages, mincore failed)."""
    n = view.nbytes
    if n == 0:
        return True
    start = np.frombuffer(view, dtype=np.uint8).ctypes.data
    first = start - start % PAGE
    pages = (start + n - first + PAGE - 1) // PAGE
    if pages > MAX_PAGES:
        return False
    flags = page_flags(first, pages * PAGE)
    return flags is not None and all(b & 1 for b in flags)

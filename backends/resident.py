"""Whether a range of a mapping is in memory (mincore(2)): a read of it then costs a copy,
never a wait for the disk, so a caller on an event loop may make it there."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

_PAGE = mmap.PAGESIZE
_mincore = ctypes.CDLL(None, use_errno=True).mincore
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_mincore.restype = ctypes.c_int
MAX_PAGES = 64  # longer ranges are not asked about (their copy is not cheap anyway)


def in_memory(view: memoryview) -> bool:
    """Whether every page `view` (a buffer into a file mapping) covers is in the page
    cache. False when that cannot be said (more than MAX_PAGES pages, mincore failed)."""
    n = view.nbytes
    if n == 0:
        return True
    start = np.frombuffer(view, dtype=np.uint8).ctypes.data
    first = start - start % _PAGE
    pages = (start + n - first + _PAGE - 1) // _PAGE
    if pages > MAX_PAGES:
        return False
    vec = ctypes.create_string_buffer(pages)
    if _mincore(first, pages * _PAGE, vec) != 0:
        return False
    return all(b & 1 for b in vec.raw)

"""No work in proportion to a file's size on the daemon's event loop (issue 15): the
attributes of a sparse 1 TB checkpoint file are answered at once, and the mount keeps
answering everyone else meanwhile."""

from __future__ import annotations

import os
import threading
import time
import zlib

from distorefs.codec import crc32_combine

SIZE = 1 << 40


def zeros_crc(n: int) -> int:
    """zlib.crc32(bytes(n)) for any n, by doubling from one zero byte."""
    crc, block_crc, block = 0, zlib.crc32(b"\0"), 1
    while n:
        if n & 1:
            crc = crc32_combine(crc, block_crc, block)
        block_crc, block = crc32_combine(block_crc, block_crc, block), block * 2
        n >>= 1
    return crc


def test_xattrs_of_a_sparse_terabyte_checkpoint_do_not_freeze_the_mount(fresh_mount):
    m = fresh_mount()
    step = m.mnt / "checkpoints" / "run" / "step-1"
    step.mkdir(parents=True)
    big = step / "sparse.bin"
    with open(big, "wb") as f:
        f.write(b"head")
        f.truncate(SIZE)  # all but 4 bytes a hole
        f.flush()
        os.fsync(f.fileno())  # every chunk stored: the checksum is known
    answers: dict = {}

    def ask():
        answers["checksum"] = os.getxattr(big, "user.distorefs.checksum").decode()
        answers["names"] = os.listxattr(big)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()  # the rest of the mount answers while the attribute is computed
    (m.mnt / ".distorefs" / "version").read_bytes()
    os.stat(m.mnt / "buffers")
    assert time.monotonic() - t0 < 5, "the mount froze while one file's checksum was computed"
    t.join(60)
    assert not t.is_alive(), "getxattr of a sparse file took over a minute"
    want = crc32_combine(zlib.crc32(b"head"), zeros_crc(SIZE - 4), SIZE - 4)
    assert answers["checksum"] == f"crc32:{want:08x}", answers
    assert "user.distorefs.checksum" in answers["names"]
    assert m.alive()

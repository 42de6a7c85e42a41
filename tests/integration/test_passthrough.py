"""Large batch files read by the kernel from memfds (FUSE passthrough, mount/backing.py):
every batch its own draw with its own rows, no READ request, the next batch written ahead
and counted only when an open takes it, and nothing stale after a rewrite or a read cut
short."""

from __future__ import annotations

import io
import json
import os
import time

import numpy as np
import pytest

from distorefs_it import get_stats, mount_stats

ROW = 256 << 10  # bytes an entry: a batch of 8 is 2 MiB, over mount/nodes.py PASSTHROUGH_MIN


def reads_during(fs, fn) -> int:
    """READ requests the daemon answered while `fn` ran, less what reading the count costs."""
    def count(fn) -> int:
        before = mount_stats(fs)["requests"].get("read", 0)
        fn()
        return mount_stats(fs)["requests"].get("read", 0) - before
    return count(fn) - count(lambda: None)


def passthrough_or_skip(fs) -> None:
    if not mount_stats(fs)["passthrough"]:
        pytest.skip("the kernel offers no FUSE passthrough here (Linux >= 6.9, CONFIG_FUSE_PASSTHROUGH, root)")


def fill(buf, n: int, value=lambda i: i) -> None:
    for i in range(n):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(ROW, value(i) % 256, dtype=np.uint8))


def load(buf, n: int, values: dict[str, int] | None = None) -> list[str]:
    """np.load of batch/N.npz; each row checked whole against its key's value."""
    with np.load(buf / "batch" / f"{n}.npz") as z:
        keys, data = z["keys"].tolist(), z["data"]
    assert data.shape == (n, ROW)
    for key, row in zip(keys, data):
        want = values[key] if values is not None else int(key[1:4]) % 256
        assert (row == want).all(), (key, int(row[0]), want)
    return keys


def test_large_batches_are_read_from_memfds_each_a_new_draw(fs, buf):
    passthrough_or_skip(fs)
    fill(buf, 40)
    load(buf, 8)
    time.sleep(0.2)  # the next one is written ahead
    batches = get_stats(buf)["batches"]
    drawn: list[tuple] = []
    opens = mount_stats(fs)["passthrough_opens"]
    assert reads_during(fs, lambda: drawn.extend(tuple(load(buf, 8)) for _ in range(12))) == 0  # the kernel's
    assert mount_stats(fs)["passthrough_opens"] - opens == 12
    assert len(set(drawn)) == 12  # new draws, not one batch served again
    assert get_stats(buf)["batches"] - batches == 12  # the one written ahead now is not counted


def test_a_large_batch_sends_python_its_open_alone(fs, buf):
    """The kernel asks for a passed-through file's attributes after its reads (they mark
    its atime stale), and np.load's fstat waits for them: the library's front answers them
    (and the IOCTL, the RELEASE); Python sees the OPEN of each batch only."""
    passthrough_or_skip(fs)
    fill(buf, 30)
    load(buf, 8)
    time.sleep(0.2)

    def passed(fn) -> int:
        before = mount_stats(fs)["front_passed"]
        fn()
        return mount_stats(fs)["front_passed"] - before
    assert passed(lambda: [load(buf, 8) for _ in range(10)]) - passed(lambda: None) <= 12


def test_a_rewrite_after_the_next_batch_was_written_ahead_is_seen(fs, buf):
    """The batch written ahead holds an entry rewritten since: it is not handed out, and the
    open draws again, with the new contents."""
    passthrough_or_skip(fs)
    fill(buf, 3)
    values = {f"k{i:03d}.npy": i for i in range(3)}
    load(buf, 8, values)
    time.sleep(0.2)  # 8 draws of 3 entries: the one written ahead holds each of them
    np.save(buf / "entries" / "k001.npy", np.full(ROW, 99, dtype=np.uint8))
    values["k001.npy"] = 99
    for _ in range(3):
        load(buf, 8, values)


def test_a_batch_read_in_part_leaves_nothing_stale_for_the_next(fs, buf):
    passthrough_or_skip(fs)
    fill(buf, 30)
    for _ in range(5):
        with open(buf / "batch" / "8.npz", "rb") as f:
            f.read(100_000)  # closed before its end
        load(buf, 8)


def test_two_large_batches_open_at_once_in_one_process(fs, buf):
    passthrough_or_skip(fs)
    fill(buf, 30)
    with open(buf / "batch" / "8.npz", "rb") as a, open(buf / "batch" / "8.npz", "rb") as b:
        raws = [a.read(), b.read()]
    for raw in raws:
        with np.load(io.BytesIO(raw)) as z:
            for key, row in zip(z["keys"].tolist(), z["data"]):
                assert (row == int(key[1:4])).all()


def test_over_the_memory_share_batches_are_read_as_before(fresh_mount):
    """memory_bytes so small that a batch file is over its transfer share: no memfd, the
    batch is read through the FUSE inode, whole and right."""
    m = fresh_mount("memory_bytes=16777216")
    passthrough_or_skip(m)
    buf = m.buffer("small")
    fill(buf, 20)
    with open(buf / "config.json", "w") as f:
        f.write(json.dumps({"sampler": "uniform"}))
    before = mount_stats(m)["passthrough_opens"]
    for _ in range(3):
        load(buf, 8)  # 2 MiB: over 10 % of 16 MiB
    assert mount_stats(m)["passthrough_opens"] == before
    assert os.path.exists(buf / "batch")

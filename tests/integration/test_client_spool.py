"""The client's spool through a real mount: values a client process encodes and writes to
a segment of its own are the entries the file path reads and the batches it stacks,
acknowledged by flush() and kept through a kill -9 of the daemon; `distorefs verify`
finds the store clean afterwards."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np

from distorefs.client import open_buffer
from distorefs_it import get_stats, set_config


def _transition(i: int) -> dict:
    """A transition of two 120 x 120 frames: 29 KB, over the size from which values are spooled."""
    rng = np.random.default_rng(i)
    return {"obs": rng.integers(0, 255, (120, 120), dtype=np.uint8), "action": np.int64(i % 4),
            "reward": np.float32(i / 3), "next_obs": rng.integers(0, 255, (120, 120), dtype=np.uint8)}


def _same(entry: bytes, want: dict) -> bool:
    with np.load(io.BytesIO(entry)) as z:
        return sorted(z.files) == sorted(want) and all(np.array_equal(z[k], v) for k, v in want.items())


def test_small_values_go_through_the_channel(fresh_mount):
    m = fresh_mount()
    buf = m.buffer("small", {"capacity": 100})
    with open_buffer(buf, direct=True) as client:
        for i in range(40):
            client.insert(f"s{i}", {"obs": np.full(8, i, np.float32)})
            client.flush()
    stats = get_stats(buf)
    assert stats["spooled_inserts"] == 0 and stats["entries"] == 40


def test_spooled_inserts_are_the_entries_and_batches_and_survive_kill_9(fresh_mount):
    m = fresh_mount()
    buf = m.buffer("dqn", {"capacity": 1000, "presample_batches": 0})
    want = {f"t{i:04d}": _transition(i) for i in range(300)}
    with open_buffer(buf, direct=True) as client:
        for i, (key, value) in enumerate(want.items()):
            client.insert(key, value)
            if i % 32 == 31:
                client.flush()
        client.flush()
    stats = get_stats(buf)
    # Until the first flush the buffer had no layout (its first entry fixes it): those 32
    # went through the channel; every insert after it came from the client's spool.
    assert stats["spooled_inserts"] == 300 - 32, stats
    assert stats["tiers"]["nvme"]["entries"] >= 300 - 32
    for key in ("t0000", "t0150", "t0299"):
        assert _same((buf / "entries" / key).read_bytes(), want[key])
    set_config(buf, {"seed": 3})
    with np.load(buf / "batch" / "32.npz") as z:
        for key, obs, action in zip(z["keys"].tolist(), z["obs"], z["action"]):
            assert np.array_equal(obs, want[key]["obs"]) and action == want[key]["action"]

    # Acknowledged by flush(), then the daemon is killed: nothing is lost.
    code = ("import sys, numpy as np\n"
            "from distorefs.client import open_buffer\n"
            "with open_buffer(sys.argv[1], direct=True) as c:\n"
            "    for i in range(300, 400):\n"
            "        rng = np.random.default_rng(i)\n"
            "        c.insert(f't{i:04d}', {'obs': rng.integers(0, 255, (120, 120), dtype=np.uint8),"
            " 'action': np.int64(i % 4), 'reward': np.float32(i / 3),"
            " 'next_obs': rng.integers(0, 255, (120, 120), dtype=np.uint8)})\n"
            "    c.flush()\n"
            "    print('flushed', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code, str(buf)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "flushed", out.stderr
    m.kill9()
    m.lazy_umount()
    m.mount()
    names = set(os.listdir(buf / "entries"))
    assert {f"t{i:04d}" for i in range(400)} <= names
    for i in (300, 350, 399):
        assert _same((buf / "entries" / f"t{i:04d}").read_bytes(), _transition(i))
    m.umount()
    check = subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "verify", str(m.store)],
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "clean" in check.stdout, check.stdout + check.stderr


def test_damage_in_a_spooled_array_is_named_by_a_big_batch(fresh_mount):
    """A batch over 256 KB checks each array as it copies it (against the array's CRC-32),
    not each whole value before: a damaged byte is still found, and named."""
    import glob

    import pytest

    from distorefs.errors import CorruptValue
    m = fresh_mount()
    buf = m.buffer("big", {"capacity": 100, "presample_batches": 0, "sampler": "fifo"})
    frames = [np.random.default_rng(i).integers(0, 256, 40_000, dtype=np.uint8) for i in range(10)]  # incompressible
    with open_buffer(buf, direct=True) as client:
        for i, frame in enumerate(frames):
            client.insert(f"f{i}", frame)
            client.flush()  # (the first fixes the layout; the others go to the spool)
        assert get_stats(buf)["spooled_inserts"] == 9
        assert np.array_equal(client.sample(10)["data"], np.stack(frames))  # oldest first, all well
    pattern = frames[5][1000:5096].tobytes()  # inside f5's array
    for path in glob.glob(str(m.store / "segments" / "seg-*.dat")):
        with open(path, "r+b") as f:
            data = f.read()
            at = data.find(pattern)
            if at >= 0:
                f.seek(at + 100)
                f.write(bytes([data[at + 100] ^ 0xFF]))
                break
    else:
        raise AssertionError("f5's array was not found in any segment file")
    with open_buffer(buf, direct=True) as client:
        with pytest.raises(CorruptValue) as info:
            client.sample(10)
        assert "buffers/big/entries/f5" in str(info.value)


def test_a_held_big_batch_keeps_its_arrays_while_later_batches_reuse_memory_let_go_of(fresh_mount):
    """Big batches are made in memory of earlier batches the caller let go of (BatchMemory):
    a batch the learner still holds (or a view of it) is never written over by the next draws."""
    m = fresh_mount()
    buf = m.buffer("held", {"capacity": 100, "presample_batches": 0, "sampler": "uniform"})
    frames = {f"f{i}": np.random.default_rng(i).integers(0, 256, 40_000, dtype=np.uint8) for i in range(40)}
    with open_buffer(buf, direct=True) as client:
        for key, frame in frames.items():
            client.insert(key, frame)
        client.flush()

        def check(batch):
            for row, key in zip(batch["data"], batch["keys"].tolist()):
                assert np.array_equal(row, frames[key]), key

        held = client.sample(32)  # 1.3 MB of data: made by BatchMemory
        view = client.sample(32)["data"][5:9]  # a view of a batch let go of: keeps it too
        view_then = view.copy()
        for _ in range(10):
            batch = client.sample(32)
            check(batch)
            check(held)
        del batch
        assert client._memory.reused > 0  # the let-go batches' memory was used again
        check(client.sample(32))
        check(held)
        assert np.array_equal(view, view_then)

"""Sampling through sample/N and batch/N.npz; priorities; times sampled; min_size_to_sample."""

from __future__ import annotations

import collections
import errno
import io
import math
import os
import threading
import time

import numpy as np
import pytest

from distorefs_it import (assert_errno, entry_names, get_stats, read_entry, set_config, write_entry,
                          xattr)


def parse_manifest(text: bytes) -> list[tuple[str, int, float, float]]:
    out = []
    for line in text.decode().splitlines():
        key, seq, p, w = line.rsplit(None, 3)
        out.append((key, int(seq), float(p), float(w)))
    return out


def sample(buf, n: int) -> list[tuple[str, int, float, float]]:
    with open(buf / "sample" / str(n), "rb") as f:
        return parse_manifest(f.read())


def load_batch(buf, n: int) -> dict[str, np.ndarray]:
    with open(buf / "batch" / f"{n}.npz", "rb") as f:
        raw = f.read()
    with np.load(io.BytesIO(raw)) as z:
        return {k: z[k] for k in z.files}


def fill(buf, keys, size: int = 64) -> None:
    for k in keys:
        write_entry(buf, k, (k.encode() * size)[:size])


def seqs_of(buf, keys) -> dict[str, int]:
    return {k: int(xattr(buf / "entries" / k, "seq")) for k in keys}


def test_uniform_manifest(buf):
    keys = [f"u{i}" for i in range(10)]
    set_config(buf, {"sampler": "uniform", "seed": 7})
    fill(buf, keys)
    seqs = seqs_of(buf, keys)
    seen = collections.Counter()
    for _ in range(20):
        lines = sample(buf, 5)
        assert len(lines) == 5
        for key, seq, p, w in lines:
            assert key in seqs and seq == seqs[key]
            assert p == pytest.approx(0.1)
            assert w == pytest.approx(1.0)
            seen[key] += 1
    assert set(seen) == set(keys)  # 100 draws over 10 keys: every key shows up
    assert max(seen.values()) < 40
    assert get_stats(buf)["batches"] >= 20


def test_fifo_and_lifo(buf):
    keys = [f"f{i}" for i in range(6)]
    fill(buf, keys)
    seqs = seqs_of(buf, keys)
    set_config(buf, {"sampler": "fifo"})
    for _ in range(2):  # deterministic
        lines = sample(buf, 3)
        assert [l[0] for l in lines] == keys[:3]
        assert [l[1] for l in lines] == [seqs[k] for k in keys[:3]]
    set_config(buf, {"sampler": "lifo"})
    lines = sample(buf, 4)
    assert [l[0] for l in lines] == keys[::-1][:4]
    # a new entry is at the head for lifo, at the tail for fifo
    write_entry(buf, "newest", b"n")
    assert [l[0] for l in sample(buf, 2)] == ["newest", keys[-1]]
    set_config(buf, {"sampler": "fifo"})
    assert [l[0] for l in sample(buf, 2)] == keys[:2]
    # a deleted entry drops out of the queue
    os.unlink(buf / "entries" / keys[0])
    assert [l[0] for l in sample(buf, 2)] == keys[1:3]


def test_prioritized_follows_priorities(buf):
    keys = [f"p{i}" for i in range(10)]
    set_config(buf, {"sampler": "prioritized", "alpha": 1.0, "beta": 0.4, "seed": 3})
    fill(buf, keys)
    with open(buf / "priorities", "w") as f:
        f.write("p0 100\n" + "".join(f"{k} 1\n" for k in keys[1:]))
    counts = collections.Counter()
    rows = []
    for _ in range(4):
        lines = sample(buf, 100)
        assert len(lines) == 100
        rows += lines
        counts.update(l[0] for l in lines)
    total = sum(counts.values())
    assert counts["p0"] / total > 0.8, counts  # expected 100/109 = 0.917
    assert counts["p0"] / total < 0.99, counts
    p_hi, p_lo = 100 / 109, 1 / 109
    weights = []
    for key, seq, p, w in rows:
        if key == "p0":
            assert p == pytest.approx(p_hi, rel=1e-6)
            assert w == pytest.approx((p_hi / p_lo) ** -0.4, rel=1e-6)
        else:
            assert p == pytest.approx(p_lo, rel=1e-6)
            assert w == pytest.approx(1.0)
        weights.append(w)
    assert all(0 < w <= 1.0 for w in weights)
    assert max(weights) == pytest.approx(1.0)

    # a priority of 0 is never drawn; raising another key moves the mass there
    with open(buf / "priorities", "w") as f:
        f.write("p0 0\np5 1000\n")
    counts = collections.Counter(l[0] for l in sample(buf, 200))
    assert counts["p0"] == 0
    assert counts["p5"] > 150, counts


def test_prioritized_weights_with_alpha_beta(buf):
    set_config(buf, {"sampler": "prioritized", "alpha": 0.5, "beta": 1.0, "seed": 11})
    prios = {"a": 1.0, "b": 4.0, "c": 16.0, "d": 64.0}
    fill(buf, prios)
    with open(buf / "priorities", "w") as f:
        f.write("".join(f"{k} {v}\n" for k, v in prios.items()))
    scaled = {k: v ** 0.5 for k, v in prios.items()}
    z = sum(scaled.values())
    for key, seq, p, w in sample(buf, 300):
        assert p == pytest.approx(scaled[key] / z, rel=1e-6)
        assert w == pytest.approx((scaled[key] / scaled["a"]) ** -1.0, rel=1e-6)
        assert 0 < w <= 1


def test_sample_handle_is_fixed(buf):
    keys = [f"s{i}" for i in range(10)]
    fill(buf, keys)
    # (draws are stratified: a batch size that is a multiple of the entry count would give
    # every entry the same number of draws, so use one that is not)
    with open(buf / "sample" / "17", "rb") as f:
        first = f.read()
        f.seek(0)
        second = f.read()
        f.seek(7)
        part = f.read(11)
    assert first == second
    assert part == first[7:18]
    assert len(parse_manifest(first)) == 17
    others = {sample_bytes(buf, 17) for _ in range(5)}
    assert others != {first}  # fresh opens draw fresh batches

    with open(buf / "batch" / "12.npz", "rb") as f:
        a = f.read()
        f.seek(0)
        b = f.read()
    assert a == b
    z = np.load(io.BytesIO(a))
    assert len(z["keys"]) == 12


def sample_bytes(buf, n: int) -> bytes:
    with open(buf / "sample" / str(n), "rb") as f:
        return f.read()


def test_batch_npy_entries_stacked(buf):
    arrays = {}
    for i in range(5):
        a = (np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * i)
        arrays[f"obs{i}.npy"] = a
        np.save(buf / "entries" / f"obs{i}.npy", a)
    seqs = seqs_of(buf, arrays)
    for name, a in arrays.items():  # np.save wrote real .npy files
        assert np.array_equal(np.load(io.BytesIO(read_entry(buf, name))), a)
    z = load_batch(buf, 8)
    assert z["data"].shape == (8, 4, 3)
    assert z["data"].dtype == np.float32
    assert z["keys"].shape == (8,) and z["seqs"].shape == (8,)
    assert z["probabilities"].shape == (8,) and z["weights"].shape == (8,)
    assert z["seqs"].dtype == np.int64
    for i, key in enumerate(z["keys"].tolist()):
        assert np.array_equal(z["data"][i], arrays[key])
        assert z["seqs"][i] == seqs[key]
    assert np.allclose(z["probabilities"], 0.2)
    assert np.allclose(z["weights"], 1.0)


def test_batch_npz_entries_stacked_per_field(buf):
    entries = {}
    for i in range(4):
        obs = np.full(3, i, dtype=np.float32)
        act = np.int64(10 + i)
        reward = np.array([0.5 * i, -i], dtype=np.float64)
        entries[f"t{i}.npz"] = (obs, act, reward)
        bio = io.BytesIO()
        np.savez(bio, obs=obs, act=act, reward=reward)
        write_entry(buf, f"t{i}.npz", bio.getvalue())
    z = load_batch(buf, 6)
    assert {"obs", "act", "reward", "keys", "seqs", "probabilities", "weights"} <= set(z)
    assert z["obs"].shape == (6, 3) and z["obs"].dtype == np.float32
    assert z["act"].shape == (6,) and z["act"].dtype == np.int64
    assert z["reward"].shape == (6, 2)
    for i, key in enumerate(z["keys"].tolist()):
        obs, act, reward = entries[key]
        assert np.array_equal(z["obs"][i], obs)
        assert z["act"][i] == act
        assert np.array_equal(z["reward"][i], reward)


def test_batch_raw_entries_data_offsets(buf):
    values = {f"raw{i}": os.urandom(1 + 37 * i) for i in range(6)}
    for k, v in values.items():
        write_entry(buf, k, v)
    z = load_batch(buf, 9)
    data, offsets = z["data"], z["offsets"]
    assert data.dtype == np.uint8 and offsets.shape == (10,)
    assert offsets[0] == 0 and offsets[-1] == len(data)
    for i, key in enumerate(z["keys"].tolist()):
        assert data[offsets[i]:offsets[i + 1]].tobytes() == values[key]
    # mixed shapes of .npy fall back to the raw layout too
    np.save(buf / "entries" / "odd.npy", np.zeros(7, dtype=np.int16))
    set_config(buf, {"sampler": "lifo"})
    z = load_batch(buf, 2)
    assert z["keys"].tolist() == ["odd.npy", "raw5"]
    assert "offsets" in z
    raw0 = z["data"][z["offsets"][0]:z["offsets"][1]].tobytes()
    assert np.array_equal(np.load(io.BytesIO(raw0)), np.zeros(7, dtype=np.int16))


# ----- priorities, xattrs, times sampled --------------------------------------------

def read_priorities(buf) -> list[tuple[str, float]]:
    out = []
    for line in (buf / "priorities").read_text().splitlines():
        key, value = line.rsplit(None, 1)
        out.append((key, float(value)))
    return out


def test_priorities_file_and_xattr(buf):
    keys = [f"k{i:03d}" for i in range(50)]
    fill(buf, keys, size=16)
    initial = read_priorities(buf)
    assert [k for k, _ in initial] == keys
    assert all(v == initial[0][1] for _, v in initial)
    text = "".join(f"{k} {i * 0.5}\n" for i, k in enumerate(keys)).encode()
    fd = os.open(buf / "priorities", os.O_WRONLY)
    try:
        assert os.write(fd, text) == len(text)  # all lines in one write
        # a line split across two writes is applied once complete
        os.write(fd, b"k001 12")
        os.write(fd, b".75\nk002 3\n")
    finally:
        os.close(fd)
    expected = {k: i * 0.5 for i, k in enumerate(keys)}
    expected["k001"] = 12.75
    expected["k002"] = 3.0
    assert read_priorities(buf) == [(k, expected[k]) for k in keys]
    assert float(xattr(buf / "entries" / "k010", "priority")) == 5.0

    # unknown keys are skipped and counted; the known lines of the write apply
    before = get_stats(buf)["priority_unknown_keys"]
    with open(buf / "priorities", "w") as f:
        f.write("ghost 4\nk000 9\nghost2 1\n")
    assert get_stats(buf)["priority_unknown_keys"] == before + 2
    assert float(xattr(buf / "entries" / "k000", "priority")) == 9.0

    # the xattr sets it too
    os.setxattr(buf / "entries" / "k003", "user.distorefs.priority", b"7.25")
    assert xattr(buf / "entries" / "k003", "priority") == "7.25"
    assert dict(read_priorities(buf))["k003"] == 7.25
    assert get_stats(buf)["priority_updates"] >= 50


def test_initial_priority(buf):
    set_config(buf, {"sampler": "prioritized"})
    write_entry(buf, "first", b"1")
    os.setxattr(buf / "entries" / "first", "user.distorefs.priority", b"42")
    write_entry(buf, "second", b"2")  # initial_priority 0: the max seen so far
    assert float(xattr(buf / "entries" / "second", "priority")) == 42.0
    set_config(buf, {"initial_priority": 3.5})
    write_entry(buf, "third", b"3")
    assert float(xattr(buf / "entries" / "third", "priority")) == 3.5
    # a rewrite keeps the priority
    os.setxattr(buf / "entries" / "third", "user.distorefs.priority", b"8")
    write_entry(buf, "third", b"3 again")
    assert float(xattr(buf / "entries" / "third", "priority")) == 8.0


def test_times_sampled_grows(buf):
    keys = [f"t{i}" for i in range(5)]
    fill(buf, keys)
    set_config(buf, {"sampler": "fifo"})
    assert all(int(xattr(buf / "entries" / k, "times_sampled")) == 0 for k in keys)
    for _ in range(3):
        sample(buf, 2)
    load_batch(buf, 3)
    times = [int(xattr(buf / "entries" / k, "times_sampled")) for k in keys]
    assert times == [4, 4, 1, 0, 0]
    set_config(buf, {"sampler": "uniform"})
    drawn = collections.Counter(l[0] for l in sample(buf, 30))
    for i, k in enumerate(keys):
        assert int(xattr(buf / "entries" / k, "times_sampled")) == times[i] + drawn[k]
    assert get_stats(buf)["sampled_entries"] >= 6 + 3 + 30


def _wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_max_times_sampled_sample(buf):
    keys = [f"m{i}" for i in range(4)]
    set_config(buf, {"max_times_sampled": 1, "seed": 5})
    fill(buf, keys)
    f = open(buf / "sample" / "4", "rb")
    try:
        lines = parse_manifest(f.read())
        assert sorted(l[0] for l in lines) == keys  # each at most once: all four, once each
        # spent but not yet released: still there, but nothing left to draw
        assert entry_names(buf) == keys
        assert_errno(errno.EAGAIN, os.open, buf / "sample" / "1", os.O_RDONLY | os.O_NONBLOCK)
        f.seek(0)
        assert parse_manifest(f.read()) == lines
    finally:
        f.close()
    assert _wait_for(lambda: entry_names(buf) == []), entry_names(buf)
    assert get_stats(buf)["entries"] == 0
    assert get_stats(buf)["exhausted"] >= 4
    for k in keys:
        assert_errno(errno.ENOENT, read_entry, buf, k)


def test_max_times_sampled_batch(buf):
    keys = [f"b{i}" for i in range(3)]
    set_config(buf, {"max_times_sampled": 2, "seed": 9})
    fill(buf, keys)
    write_entry(buf, "spare", b"kept")
    with open(buf / "batch" / "2.npz", "rb") as f:
        first = np.load(io.BytesIO(f.read()))["keys"].tolist()
    with open(buf / "sample" / "4", "rb") as f:
        second = [l[0] for l in parse_manifest(f.read())]
    uses = collections.Counter(first + second)
    assert all(v <= 2 for v in uses.values()), uses
    spent = {k for k, v in uses.items() if v == 2}
    assert _wait_for(lambda: not (spent & set(entry_names(buf))))
    for k in keys + ["spare"]:
        if k in spent:
            assert_errno(errno.ENOENT, read_entry, buf, k)
        else:
            assert int(xattr(buf / "entries" / k, "times_sampled")) == uses[k]
    # draw until everything is spent: a 2-entry batch per open, each at most twice in total
    for _ in range(10):
        if not entry_names(buf):
            break
        try:
            fd = os.open(buf / "batch" / "2.npz", os.O_RDONLY | os.O_NONBLOCK)
        except BlockingIOError:
            break
        os.close(fd)
        _wait_for(lambda: True, 0.05)
    assert _wait_for(lambda: entry_names(buf) == [])


def test_min_size_to_sample(buf):
    set_config(buf, {"min_size_to_sample": 5})
    fill(buf, ["a", "b"])
    assert_errno(errno.EAGAIN, os.open, buf / "sample" / "1", os.O_RDONLY | os.O_NONBLOCK)
    assert_errno(errno.EAGAIN, os.open, buf / "batch" / "1.npz", os.O_RDONLY | os.O_NONBLOCK)
    result: dict = {}

    def blocked_open():
        try:
            t0 = time.monotonic()
            with open(buf / "sample" / "2", "rb") as f:
                result["lines"] = parse_manifest(f.read())
            result["waited"] = time.monotonic() - t0
        except BaseException as exc:  # reported below
            result["error"] = exc

    t = threading.Thread(target=blocked_open, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive(), result  # still waiting for entries
    assert "lines" not in result
    fill(buf, ["c", "d"])
    time.sleep(0.2)
    assert t.is_alive(), result  # 4 < 5: still waiting
    fill(buf, ["e"])
    t.join(timeout=10)
    if t.is_alive():  # unblock it whatever happens, then fail
        set_config(buf, {"min_size_to_sample": 1})
        t.join(timeout=10)
        pytest.fail("the blocked open of sample/2 did not return after 5 entries arrived")
    assert "error" not in result, result
    assert len(result["lines"]) == 2
    assert {l[0] for l in result["lines"]} <= {"a", "b", "c", "d", "e"}
    assert result["waited"] >= 0.3
    # enough entries now: non-blocking opens succeed
    fd = os.open(buf / "sample" / "3", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert len(os.read(fd, 1 << 16).splitlines()) == 3
    finally:
        os.close(fd)


def test_min_size_to_sample_lowered_wakes_waiter(buf):
    set_config(buf, {"min_size_to_sample": 3})
    fill(buf, ["x"])
    result: dict = {}

    def blocked_open():
        try:
            with open(buf / "batch" / "1.npz", "rb") as f:
                result["keys"] = np.load(io.BytesIO(f.read()))["keys"].tolist()
        except BaseException as exc:
            result["error"] = exc

    t = threading.Thread(target=blocked_open, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    set_config(buf, {"min_size_to_sample": 1})
    t.join(timeout=10)
    if t.is_alive():
        fill(buf, ["y", "z"])
        t.join(timeout=10)
        pytest.fail("lowering min_size_to_sample did not wake the waiting open")
    assert result.get("keys") == ["x"], result


def test_bad_batch_sizes(buf):
    fill(buf, ["a"])
    for name in ("0", "-1", "abc", "01", "1.5"):
        assert_errno((errno.ENOENT, errno.EINVAL), open, buf / "sample" / name, "rb")
    for name in ("0.npz", "3", "3.npy", "x.npz"):
        assert_errno((errno.ENOENT, errno.EINVAL), open, buf / "batch" / name, "rb")
    assert_errno((errno.EINVAL, errno.ENOENT), open, buf / "sample" / str(10 ** 7), "rb")
    assert_errno((errno.EACCES, errno.EROFS, errno.EPERM), open, buf / "sample" / "1", "wb")
    assert len(sample(buf, 1)) == 1
    assert math.isfinite(sample(buf, 1)[0][2])


def test_np_load_batch_by_path(buf):
    """np.load(path) seeks to the end of batch/N.npz: its size must be the opened batch's."""
    for i in range(4):
        np.save(buf / "entries" / f"k{i}.npy", np.full((2, 3), i, dtype=np.float32))
    with np.load(buf / "batch" / "3.npz") as z:
        assert z["data"].shape == (3, 2, 3)
        for key, row in zip(z["keys"], z["data"]):
            assert row[0, 0] == int(key[1:-4])
    with open(buf / "batch" / "5.npz", "rb") as f:
        size = os.fstat(f.fileno()).st_size
        assert size == len(f.read()) > 0


def _loads_built_ahead(buf, n: int, times: int) -> list:
    """np.load of batch/n.npz `times` times: (keys, data) of each."""
    out = []
    for _ in range(times):
        with np.load(buf / "batch" / f"{n}.npz") as z:
            out.append((z["keys"].tolist(), z["data"].copy(), z["probabilities"].copy()))
    return out


def test_batches_built_ahead_are_handed_out_and_never_stale(buf):
    """A learner's next batches are drawn ahead with their npz built (pre-sampling), and
    an open only hands one out; one whose entries were rewritten or removed since is drawn
    again at its open, so a batch never holds an old version."""
    set_config(buf, {"capacity": 1000, "sampler": "prioritized", "presample_batches": 2})
    for i in range(40):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))
    before = get_stats(buf)["built_ahead_used"]
    for keys, data, probs in _loads_built_ahead(buf, 8, 6):
        assert [int(k[1:4]) for k in keys] == data[:, 0].tolist()
        assert (probs > 0).all()
    assert get_stats(buf)["built_ahead_used"] - before >= 4  # all but the first opens
    for i in range(40):  # every entry rewritten: the batches built ahead hold old versions
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, 1000 + i, dtype=np.int32))
    used = get_stats(buf)["built_ahead_used"]
    for keys, data, _ in _loads_built_ahead(buf, 8, 2):
        assert [1000 + int(k[1:4]) for k in keys] == data[:, 0].tolist()
    assert get_stats(buf)["built_ahead_used"] == used  # both were stale: drawn again
    for i in range(20):
        os.unlink(buf / "entries" / f"k{i:03d}.npy")
    for keys, data, _ in _loads_built_ahead(buf, 8, 3):
        assert all(int(k[1:4]) >= 20 for k in keys)
        assert [1000 + int(k[1:4]) for k in keys] == data[:, 0].tolist()


def test_manifest_draws_build_no_batch_file_ahead(buf):
    """sample/N opens draw ahead without building a batch/N.npz nobody reads; the first
    batch/N.npz after them is built at its open, the ones after it ahead."""
    set_config(buf, {"capacity": 1000, "sampler": "uniform", "presample_batches": 2})
    for i in range(40):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))
    for _ in range(4):
        (buf / "sample" / "8").read_bytes()
    used = get_stats(buf)["built_ahead_used"]
    _loads_built_ahead(buf, 8, 1)
    assert get_stats(buf)["built_ahead_used"] == used
    _loads_built_ahead(buf, 8, 4)
    assert get_stats(buf)["built_ahead_used"] > used

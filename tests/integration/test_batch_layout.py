"""A buffer's batch layout through a real mount: a declared schema, the layout the first
entry fixes, entries of another layout refused at close (EINVAL), raw mode; batch/N.npz
checked byte for byte against np.stack of the entries read back through entries/."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from distorefs_it import assert_errno, entry_names, get_config, npy, npz, set_config, write_entry




def transition(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"obs": rng.standard_normal(8).astype(np.float32), "action": np.int64(i % 4),
            "reward": np.float32(i), "done": np.bool_(i % 7 == 0)}


def batch_by_path(buf, n: int) -> dict:
    with np.load(buf / "batch" / f"{n}.npz") as z:  # by path, as a learner does
        return {k: z[k] for k in z.files}


def test_batch_is_np_stack_of_the_entries_byte_for_byte(buf):
    set_config(buf, {"sampler": "prioritized"})
    for i in range(40):
        write_entry(buf, f"t{i:03d}.npz", npz(**transition(i)))
    for _ in range(5):
        z = batch_by_path(buf, 16)
        entries = []
        for key in z["keys"]:
            with np.load(buf / "entries" / key) as e:
                entries.append({k: e[k] for k in e.files})
        for field in ("obs", "action", "reward", "done"):
            expected = np.stack([e[field] for e in entries])
            assert z[field].dtype == expected.dtype and z[field].shape == expected.shape
            assert z[field].tobytes() == expected.tobytes()
        assert z["weights"].shape == z["probabilities"].shape == (16,)


def test_the_first_entry_fixes_the_layout_and_others_are_refused(fs, buf):
    write_entry(buf, "a.npz", npz(**transition(0)))
    schema = get_config(buf)["schema"]
    assert schema["format"] == "npz" and schema["fields"]["obs"] == {"dtype": "<f4", "shape": [8]}
    bad = transition(1)
    bad["obs"] = bad["obs"].astype(np.float64)
    for name, data in (("b.npz", npz(**bad)), ("c.npy", npy(np.zeros(8))), ("d.bin", b"plain bytes")):
        assert_errno(errno.EINVAL, write_entry, buf, name, data)  # refused at close
    assert entry_names(buf) == ["a.npz"]  # nothing of the refused entries is there
    assert "differs from the buffer's npz" in fs.log()  # one line says why
    write_entry(buf, "e.npz", npz(**transition(2)))  # the same layout: fine
    z = batch_by_path(buf, 4)
    assert set(z) >= {"obs", "action", "reward", "done", "keys"} and z["obs"].shape == (4, 8)



def test_np_save_of_a_refused_entry_raises(buf):
    """np.save writes the array through a duplicate of the descriptor and closes that first
    (numpy's tofile), ignoring what its close says; the refusal must reach the close the
    caller sees too, or the entry is lost without a word."""
    np.save(buf / "entries" / "a.npy", np.zeros((2, 3), np.uint8))
    with pytest.raises(OSError) as exc:
        np.save(buf / "entries" / "b.npy", np.zeros(5, np.float32))
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(OSError) as exc:
        with open(buf / "entries" / "c.npy", "wb") as f:
            np.save(f, np.zeros(5, np.float32))
    assert exc.value.errno == errno.EINVAL
    assert entry_names(buf) == ["a.npy"]
    # a descriptor written again after the refusal commits what it holds then
    fd = os.open(buf / "entries" / "d.npy", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, npy(np.zeros(5, np.float32)))
        dup = os.dup(fd)
        assert_errno(errno.EINVAL, os.close, dup)
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, npy(np.ones((2, 3), np.uint8)))
    finally:
        os.close(fd)
    assert sorted(entry_names(buf)) == ["a.npy", "d.npy"]
    with open(buf / "entries" / "d.npy", "rb") as f:
        assert np.load(f).tolist() == np.ones((2, 3), np.uint8).tolist()

def test_a_declared_schema(buf):
    set_config(buf, {"schema": {"format": "npy", "dtype": "uint8", "shape": [2, 3]}})
    assert get_config(buf)["schema"] == {"format": "npy", "dtype": "|u1", "shape": [2, 3]}
    assert_errno(errno.EINVAL, write_entry, buf, "wrong.npy", npy(np.zeros((3, 2), np.uint8)))
    frames = [np.full((2, 3), i, np.uint8) for i in range(5)]
    for i, a in enumerate(frames):
        write_entry(buf, f"f{i}.npy", npy(a))
    set_config(buf, {"sampler": "fifo"})
    z = batch_by_path(buf, 5)
    assert z["data"].tobytes() == np.stack(frames).tobytes()
    # the layout changes only while the buffer is empty
    assert_errno(errno.EINVAL, set_config, buf, {"schema": {"format": "npy", "dtype": "<f4", "shape": [1]}})
    assert get_config(buf)["schema"]["dtype"] == "|u1"


def test_raw_mode_takes_entries_of_any_layout(buf):
    set_config(buf, {"raw": True, "sampler": "fifo"})
    entries = {"a.npy": npy(np.arange(3)), "b.npz": npz(**transition(1)), "c": b"\x80\x04 a pickle, say"}
    for key, data in entries.items():
        write_entry(buf, key, data)
    z = batch_by_path(buf, 3)
    off = z["offsets"]
    assert {k: bytes(z["data"][off[i]:off[i + 1]]) for i, k in enumerate(z["keys"])} == entries


def test_plain_bytes_first_make_a_raw_buffer(buf):
    write_entry(buf, "blob", b"not an array")
    config = get_config(buf)
    assert config["raw"] is True and config["schema"] is None
    write_entry(buf, "x.npy", npy(np.arange(4)))  # raw: anything goes
    assert sorted(json.dumps(k) for k in ("blob", "x.npy"))

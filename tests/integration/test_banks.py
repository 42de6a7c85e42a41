"""Memory banks through a real mount: FIFO of variable-size entries, at/I by position."""

import errno
import os

import pytest

from distorefs_it import (assert_errno, entry_names, get_config, get_stats, make_payload, read_entry,
                          set_config, verify_payload, write_entry, xattr)


@pytest.fixture
def bank(fs, request):
    path = fs.mnt / "banks" / request.node.name[:60]
    path.mkdir()
    return path


def at(bank, i: int) -> bytes:
    with open(bank / "at" / str(i), "rb") as f:
        return f.read()


def test_bank_tree_and_config(fs, bank):
    assert sorted(os.listdir(bank)) == ["at", "config.json", "entries", "stats.json"]
    assert bank.name in os.listdir(fs.mnt / "banks")
    config = get_config(bank)
    assert "sampler" not in config and config["capacity"] > 0
    f = open(bank / "config.json", "wb", buffering=0)
    assert_errno(errno.EINVAL, f.write, b'{"sampler": "uniform"}')  # banks do not sample
    assert_errno(errno.EINVAL, f.close)
    assert get_config(bank) == config
    assert not (bank / "sample").exists() and not (bank / "priorities").exists()


def test_fifo_variable_sizes_and_positions(bank):
    set_config(bank, {"capacity": 4})
    sizes = [100, 70_000, 300, 1_000_000, 120, 20_000]  # 100 B .. 1 MB, the nvme tier too
    for i, size in enumerate(sizes):
        write_entry(bank, f"m{i}", make_payload(f"m{i}", size))
    assert entry_names(bank) == ["m2", "m3", "m4", "m5"]  # the two oldest were evicted
    for i in range(4):
        data = at(bank, i)
        assert verify_payload(data, f"m{i + 2}") and len(data) == sizes[i + 2]
    assert_errno(errno.ENOENT, at, bank, 4)
    assert xattr(bank / "at" / "1", "tier") == "nvme"
    assert xattr(bank / "entries" / "m3", "seq") == xattr(bank / "at" / "1", "seq")
    with pytest.raises(OSError):
        xattr(bank / "entries" / "m3", "priority")  # no sampler, no priority
    # positions move as the ring moves: at/0 names the new oldest, never a cached one
    write_entry(bank, "m6", b"new")
    assert verify_payload(at(bank, 0), "m3")
    os.unlink(bank / "entries" / "m3")
    assert verify_payload(at(bank, 0), "m4")
    assert at(bank, 2) == b"new"


def test_rewrite_through_at_keeps_position(bank):
    for i in range(3):
        write_entry(bank, f"k{i}", b"v%d" % i)
    with open(bank / "at" / "1", "wb") as f:
        f.write(b"rewritten")
    assert read_entry(bank, "k1") == b"rewritten"
    assert entry_names(bank) == ["k0", "k1", "k2"]
    assert at(bank, 1) == b"rewritten"
    stats = get_stats(bank)
    assert stats["entries"] == 3 and stats["rewrites"] == 1


def test_max_bytes_and_rmdir(fs, bank):
    set_config(bank, {"max_bytes": 3000})
    for i in range(5):
        write_entry(bank, f"b{i}", make_payload(f"b{i}", 1000))
    assert entry_names(bank) == ["b2", "b3", "b4"]
    assert_errno(errno.ENOTEMPTY, os.rmdir, bank)
    for name in entry_names(bank):
        os.unlink(bank / "entries" / name)
    os.rmdir(bank)
    assert bank.name not in os.listdir(fs.mnt / "banks")


def test_bank_persists_across_remount(fresh_mount):
    m = fresh_mount()
    bank = m.mnt / "banks" / "mem"
    bank.mkdir()
    set_config(bank, {"capacity": 50})
    payloads = {f"e{i}": make_payload(f"e{i}", 100 * (i + 1)) for i in range(8)}
    for key, data in payloads.items():
        write_entry(bank, key, data)
    m.remount()
    assert get_config(bank)["capacity"] == 50
    assert entry_names(bank) == list(payloads)
    for i, (key, data) in enumerate(payloads.items()):
        assert at(bank, i) == data

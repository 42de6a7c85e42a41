"""Removers through a mount: `evict` in config.json picks which entries leave a full ring."""

from __future__ import annotations

import errno
import os
import subprocess

from distorefs_it import assert_errno, entry_names, get_config, get_stats, set_config, write_entry, xattr


def fifo_keys(ns) -> list[str]:
    return sorted(entry_names(ns), key=lambda k: int(xattr(ns / "entries" / k, "seq")))


def test_lowest_priority_buffer(fresh_mount):
    m = fresh_mount()
    buf = m.buffer("lp", {"capacity": 3, "raw": True, "evict": "lowest_priority", "initial_priority": 1.0})
    for key in "abc":
        write_entry(buf, key, key.encode() * 100)
    os.setxattr(buf / "entries" / "a", "user.distorefs.priority", b"4")
    with open(buf / "priorities", "w") as f:
        f.write("b 0.25\nc 2\n")
    write_entry(buf, "d", b"d" * 100)  # priority 1: b (0.25) is the lowest
    assert fifo_keys(buf) == ["a", "c", "d"]
    # the shell sees it too
    out = subprocess.run(["ls", buf / "entries"], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(out) == ["a", "c", "d"]
    assert get_stats(buf)["evict"] == "lowest_priority" and get_config(buf)["evict"] == "lowest_priority"

    # the remover and the priorities it orders by survive a remount
    m.remount()
    write_entry(buf, "e", b"e" * 100)  # d (1, older than e) leaves
    assert fifo_keys(buf) == ["a", "c", "e"]

    # a bad value fails the write with EINVAL and keeps the old one
    assert_errno(errno.EINVAL, set_config, buf, {"evict": "highest_priority"})
    assert get_config(buf)["evict"] == "lowest_priority"
    assert "evict must be one of" in m.log()


def test_lifo_and_uniform_bank_and_buffer(fs):
    bank = fs.mnt / "banks" / "stack"
    bank.mkdir()
    set_config(bank, {"capacity": 2, "evict": "lifo"})
    for key in "xyz":
        write_entry(bank, key, key.encode())
    assert fifo_keys(bank) == ["x", "z"]
    assert_errno(errno.EINVAL, set_config, bank, {"evict": "lowest_priority"})  # banks have no priorities

    buf = fs.buffer("uniform-evict", {"capacity": 4, "raw": True, "evict": "uniform", "seed": 3})
    first = [f"k{i}" for i in range(4)]
    for key in first:
        write_entry(buf, key, b"v")
    for i in range(40):
        write_entry(buf, f"n{i}", b"v")
    left = fifo_keys(buf)
    assert len(left) == 4 and "n39" in left
    # fifo would keep exactly the 4 newest; uniform eviction keeps some older ones
    assert left != ["n36", "n37", "n38", "n39"]


def test_the_readme_example_runs_as_written(fs):
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("**Removers** (`evict`"):]
    (code,) = re.findall(r"```sh\n(.*?)```", section[:section.index("\n### ")], re.S)
    out = subprocess.run(["bash", "-euc", code.replace("MNT/", f"{fs.mnt}/")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["step-1", "step-3", "step-4"]  # what its comment says

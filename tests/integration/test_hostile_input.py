"""Hostile input beyond the bad-input table (issue 15): a config error reported by the
write() a shell sees, keys that would split or inject lines of `sample/N` and
`priorities`, priorities that would overflow the sampler's sums."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from distorefs_it import get_config, get_stats, set_config, write_entry, xattr


def unescape_key(text: bytes) -> bytes:
    """The documented line format: a backslash and three octal digits stand for a byte."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes((int(m.group(1), 8),)), text)


def escape_key(key: bytes) -> bytes:
    return b"".join(b"\\%03o" % c if c in b" \t\n\r\\" else bytes((c,)) for c in key)


def test_an_invalid_config_written_by_a_shell_fails_the_shell(fs, buf):
    before = get_config(buf)
    # The bad-input log holds back lines past PER_SECOND in a second (mount/badinput.py):
    # the refusals of a test just before, on the shared mount, may have used this second's.
    time.sleep(1.0)
    res = subprocess.run(["bash", "-c", f"echo '{{\"bogus\": 1}}' > '{buf}/config.json'"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode != 0 and "Invalid argument" in res.stderr, res
    assert get_config(buf) == before
    assert "bogus" in fs.log() and "refused write" in fs.log()  # one line saying why
    res = subprocess.run(["sh", "-c", f"echo '{{\"capacity\": 77}}' > '{buf}/config.json'"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and get_config(buf)["capacity"] == 77, res
    # written in pieces: judged once whole (here at close), as before
    with open(buf / "config.json", "wb", buffering=0) as f:
        f.write(b'{"capacity":')
        f.write(b' 78}')
    assert get_config(buf)["capacity"] == 78


def test_keys_cannot_split_or_inject_sample_and_priorities_lines(buf):
    set_config(buf, {"sampler": "prioritized"})
    evil = b"evil 1 0.5 1.0\nfake 2 0.5 1.0"
    odd = [evil, b"tab\there", b"back\\slash", b"plain"]
    for key in odd:
        with open(os.path.join(os.fsencode(buf / "entries"), key), "wb") as f:
            f.write(b"v")
    lines = (buf / "sample" / "64").read_bytes().splitlines()
    assert len(lines) == 64
    keys = set()
    for line in lines:
        fields = line.split(b" ")
        assert len(fields) == 4, line
        keys.add(unescape_key(fields[0]))
    assert keys <= set(odd) and b"fake" not in keys
    listing = (buf / "priorities").read_bytes().splitlines()
    assert len(listing) == len(odd)
    assert {unescape_key(line.rsplit(b" ", 1)[0]) for line in listing} == set(odd)
    # an escaped key written back reaches its entry
    with open(buf / "priorities", "wb") as f:
        f.write(escape_key(evil) + b" 7.5\n" + escape_key(b"tab\there") + b" 2\n")
    assert float(os.getxattr(os.path.join(os.fsencode(buf / "entries"), evil), "user.distorefs.priority")) == 7.5
    assert float(xattr(buf / "entries" / "tab\there", "priority")) == 2
    assert get_stats(buf)["priority_unknown_keys"] == 0


def test_huge_priorities_are_refused_and_sampling_keeps_working(buf):
    set_config(buf, {"sampler": "prioritized", "alpha": 1.0})
    for i in range(4):
        write_entry(buf, f"k{i}", b"x")
    with open(buf / "priorities", "wb") as f:
        f.write(b"k0 1e15\nk1 1e15\nk2 1\n")  # the largest allowed
    for n in (1, 16):
        assert len((buf / "sample" / str(n)).read_bytes().splitlines()) == n
    assert json.loads((buf / "stats.json").read_bytes())["priority_total"] < float("inf")

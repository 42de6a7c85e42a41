"""The daemon's cycle collector (mount/cycles.py): many objects made by a listing do not
set off full collections, whose pauses stop every request; stats.json shows the pauses."""

from __future__ import annotations

import json
import os
import subprocess

from distorefs_it import CLI


def collector(m) -> dict:
    return json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())["mount"]["gc"]


def test_a_listing_of_many_items_makes_no_full_collection(fresh_mount, tmp_path):
    m = fresh_mount()
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20_000):
        (src / f"i{i:06d}").write_bytes(i.to_bytes(4, "little"))
    ds = m.mnt / "datasets" / "many"
    subprocess.run(CLI + ["stage", "-q", str(src), str(ds)], check=True, capture_output=True, timeout=300)
    m.remount()  # a daemon that has made no node of them yet
    before = collector(m)
    assert len(before["runs"]) == 3 and before["frozen"] > 0, before
    assert sum(1 for _ in os.scandir(ds / "items")) == 20_000  # a node, a record, attributes each
    after = collector(m)
    assert after["runs"][2] == before["runs"][2], (before, after)  # at CPython's thresholds: 1 or more
    assert after["runs"][0] > before["runs"][0], (before, after)  # the young ones still run

"""Data far larger than memory, through a real mount with small budgets: a ~1 GB buffer
with memory_bytes 64 MiB and lmdb_bytes 128 MiB over two NVMe directories. Entries move
down the tiers (the oldest first), both directories take segments, every entry reads back
whole from whichever tier holds it, deletes leave holes that compaction reclaims while
sampling goes on, df shows the store's real numbers, and the daemon's memory stays
bounded whatever the data size."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import threading
import time
from pathlib import Path

import numpy as np

from distorefs_it import entry_names, make_payload, npy, read_entry, verify_payload, write_entry, xattr

MiB = 1 << 20
ENTRY = 250 << 10
ENTRIES = 4000  # ~1 GB
WRITERS = 4


def _writer(buf: str, part: int) -> None:
    for i in range(part, ENTRIES, WRITERS):
        key = f"e{i:05d}"
        write_entry(Path(buf), key, make_payload(key, ENTRY, seed=i))


def _daemon_memory(pid: int) -> dict[str, int]:
    """RssAnon (the daemon's own memory) and RssFile (mapped files: LMDB's map, libraries)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


class MemoryWatch(threading.Thread):
    """Samples the daemon's memory every 50 ms until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak: dict[str, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                for k, v in _daemon_memory(self.pid).items():
                    self.peak[k] = max(self.peak.get(k, 0), v)
            except OSError:
                return
            time.sleep(0.05)

    def stop(self) -> dict[str, int]:
        self._halt.set()
        self.join()
        return self.peak


def store_stats(m) -> dict:
    return json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())


def test_buffer_far_larger_than_memory(fresh_mount, tmp_path):
    dirs = [{"path": str(tmp_path / "nvme0"), "capacity_bytes": 700 * MiB},
            {"path": str(tmp_path / "nvme1"), "capacity_bytes": 700 * MiB}]
    for d in dirs:
        os.mkdir(d["path"])
    m = fresh_mount(f"memory_bytes={64 * MiB}", f"lmdb_bytes={128 * MiB}", f"segment_bytes={16 * MiB}",
                    "sync_interval=0.3", "nvme_dirs=" + json.dumps(dirs))
    idle = _daemon_memory(m.pid)
    watch = MemoryWatch(m.pid)
    watch.start()
    buf = m.buffer("big", {"compression": "none", "capacity": 1_000_000, "presample_batches": 4})

    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(str(buf), p)) for p in range(WRITERS)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=600)
        assert p.exitcode == 0
    keys = [f"e{i:05d}" for i in range(ENTRIES)]

    # the hot tier holds at most its budget; the oldest went down to NVMe, the newest stayed up
    deadline = time.monotonic() + 60
    while store_stats(m)["tiers"]["lmdb"]["live_bytes"] > 0.9 * 128 * MiB and time.monotonic() < deadline:
        time.sleep(0.2)
    s = store_stats(m)
    assert s["tiers"]["lmdb"]["live_bytes"] <= 128 * MiB
    assert s["tiering"]["demoted_entries"] > 0
    fifo = entry_names(buf)
    assert xattr(buf / "entries" / fifo[0], "tier") == "nvme"
    assert xattr(buf / "entries" / fifo[-1], "tier") == "lmdb"
    per_dir = s["tiers"]["nvme"]["directories"]
    assert all(d["segments"] > 0 and d["used_bytes"] <= d["capacity_bytes"] for d in per_dir), per_dir
    assert s["memory"]["budget_bytes"] == 64 * MiB and s["memory"]["held_bytes"] <= 64 * MiB

    # df: the store's real numbers (bytes on disk; room left within the directories' capacities)
    st = os.statvfs(m.mnt)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    on_disk = s["space"]["on_disk_bytes"]
    assert abs(used - on_disk) < 64 * MiB, (used, on_disk)
    room = 1400 * MiB - s["tiers"]["nvme"]["used_bytes"] + 128 * MiB - s["tiers"]["lmdb"]["live_bytes"]
    assert abs(st.f_bavail * st.f_frsize - room) < 64 * MiB, (st.f_bavail * st.f_frsize, room)

    # holes: delete 60% at random while sampling and reading goes on; compaction reclaims them
    rng = random.Random(7)
    gone = set(rng.sample(keys, int(0.6 * ENTRIES)))
    errors: list[str] = []
    stop = threading.Event()
    sampled = [0]

    def sampler() -> None:
        while not stop.is_set():
            with open(buf / "sample" / "16", "rb") as f:
                drawn = [line.split()[0].decode() for line in f.read().splitlines()]
            for key in drawn[:4]:
                try:
                    data = read_entry(buf, key)
                except FileNotFoundError:
                    continue  # deleted since it was drawn
                if not verify_payload(data, key):
                    errors.append(key)
            sampled[0] += 1

    threads = [threading.Thread(target=sampler) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for key in sorted(gone):
            os.unlink(buf / "entries" / key)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            nv = store_stats(m)["tiers"]["nvme"]
            if store_stats(m)["tiering"]["compacted_segments"] > 0 and nv["used_bytes"] <= 1.5 * nv["live_bytes"]:
                break
            time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    s = store_stats(m)
    nv = s["tiers"]["nvme"]
    assert s["tiering"]["compacted_segments"] > 0 and nv["used_bytes"] <= 1.5 * nv["live_bytes"], s["tiering"]
    assert not errors and sampled[0] > 0
    left = [k for k in keys if k not in gone]
    assert sorted(entry_names(buf)) == left

    # every entry reads back whole, from whichever tier holds it
    tiers = {"lmdb": 0, "nvme": 0}
    for key in left:
        assert verify_payload(read_entry(buf, key), key), key
        tiers[xattr(buf / "entries" / key, "tier")] += 1
    assert tiers["lmdb"] > 0 and tiers["nvme"] > 0

    peak = watch.stop()
    # Memory bounded by memory_bytes, not by the data: anonymous memory (the daemon's own)
    # grew by less than the budget plus requests in flight and the per-entry index.
    growth = peak["RssAnon"] - idle["RssAnon"]
    print(f"\ndaemon memory: idle RssAnon {idle['RssAnon'] >> 20} MiB, peak RssAnon {peak['RssAnon'] >> 20} MiB, "
          f"peak RssFile {peak['RssFile'] >> 20} MiB; {ENTRIES * ENTRY >> 20} MiB written, "
          f"tiers at the end {tiers}, overhead {nv['used_bytes'] / nv['live_bytes']:.2f}")
    assert growth <= 64 * MiB + 32 * MiB, (idle, peak)
    m.umount()


def _frame(i: int) -> bytes:
    """A compressible .npy frame (a game screen's few grey levels)."""
    rng = np.random.default_rng(i)
    return npy((rng.integers(0, 4, size=(16, 84, 84)) * 60).astype(np.uint8))


def test_hot_entries_are_stored_as_written_and_compressed_when_demoted(fresh_mount):
    m = fresh_mount(f"lmdb_bytes={2 * MiB}", "sync_interval=0.2")
    buf = m.buffer("frames", {"capacity": 1000})
    frames = {f"f{i:03d}.npy": _frame(i) for i in range(60)}  # 6.8 MB as written into a 2 MiB hot tier
    first = buf / "entries" / "f000.npy"
    write_entry(buf, "f000.npy", frames["f000.npy"])
    size = len(frames["f000.npy"])
    assert (xattr(first, "tier"), xattr(first, "compression"), xattr(first, "stored_size")) == ("lmdb", "none",
                                                                                                 str(size))
    for key, data in frames.items():
        write_entry(buf, key, data)
    deadline = time.monotonic() + 30
    while xattr(first, "tier") != "nvme" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (xattr(first, "tier"), xattr(first, "compression")) == ("nvme", "zstd")
    assert int(xattr(first, "stored_size")) < size // 2
    assert store_stats(m)["tiering"]["compressed_on_move"] > 0
    for key, data in frames.items():  # every entry whole, from either tier
        assert read_entry(buf, key) == data, key
    newest = buf / "entries" / "f059.npy"
    assert (xattr(newest, "tier"), xattr(newest, "compression")) == ("lmdb", "none")

    hot = m.buffer("hot", {"capacity": 1000, "compress_hot": True})  # compressed at insert, as before
    write_entry(hot, "a.npy", frames["f001.npy"])
    assert (xattr(hot / "entries" / "a.npy", "tier"), xattr(hot / "entries" / "a.npy", "compression")) == ("lmdb",
                                                                                                          "zstd")
    assert read_entry(hot, "a.npy") == frames["f001.npy"]

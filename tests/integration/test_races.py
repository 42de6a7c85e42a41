"""Reads racing evictions and rewrites: ENOENT or the new version, never EIO or corruption."""

import errno
import json
import multiprocessing
import os
import time

from distorefs_it import write_entry


def _writer(entries: str, seconds: float, q) -> None:
    end = time.time() + seconds
    i, errs = 0, []
    while time.time() < end:
        with open(os.path.join(entries, f"w{os.getpid()}-{i}"), "wb") as f:
            f.write(os.urandom(20000))
        i += 1
        if i % 5 == 0:  # rewrites too (an LMDB value replaced under the same location), of an
            try:        # entry the ring evicts now and then while it is being written
                with open(os.path.join(entries, "hot"), "wb") as f:
                    f.write(os.urandom(20000))
            except OSError as e:
                errs.append(("rewrite", e.errno))
    q.put(("writer", errs, i))


def _reader(bufdir: str, seconds: float, q) -> None:
    end = time.time() + seconds
    errs, reads = [], 0
    while time.time() < end:
        try:
            with open(os.path.join(bufdir, "batch", "8.npz"), "rb") as f:
                f.read()
            reads += 1
        except OSError as e:
            errs.append(("batch", e.errno))
        for name in os.listdir(os.path.join(bufdir, "entries"))[:3] + ["hot"]:
            try:
                with open(os.path.join(bufdir, "entries", name), "rb") as f:
                    got = len(f.read())
                if got != 20000:  # a reader found a writer's inode (truncated, being written)
                    errs.append(("short read", got))
                reads += 1
            except OSError as e:
                errs.append(("entry", e.errno))
    q.put(("reader", errs, reads))


def test_no_eio_when_reads_race_evictions_and_rewrites(fresh_mount):
    m = fresh_mount("cache_bytes=0")
    b = m.buffer("race", {"capacity": 20, "compression": "none"})
    for i in range(20):
        write_entry(b, f"init{i}", os.urandom(20000))
    write_entry(b, "hot", os.urandom(20000))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(b / "entries"), 2.0, q)) for _ in range(2)]
    procs += [ctx.Process(target=_reader, args=(str(b), 2.0, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    readers = [r for r in results if r[0] == "reader"]
    assert sum(r[2] for r in readers) > 20  # the readers really read
    errs = [e for r in readers for e in r[1]]
    assert all(code == errno.ENOENT for _, code in errs), sorted(set(errs))
    # a writer's close stores its value even if the ring evicted the entry it was rewriting
    assert [e for r in results if r[0] == "writer" for e in r[1]] == []
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["corrupt_reads"] == 0

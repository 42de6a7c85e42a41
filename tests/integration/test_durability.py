"""Persistence across umount/mount, kill -9 of the daemon, and checksum failures (EIO)."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import subprocess
import time

import pytest

from distorefs_it import (CLI, assert_errno, entry_names, get_config, get_stats, is_mounted, make_payload,
                          pid_alive, read_entry, set_config, verify_payload, write_entry, xattr)


def snapshot(buf) -> dict:
    names = entry_names(buf)
    return {
        "names": names,
        "data": {n: read_entry(buf, n) for n in names},
        "xattrs": {n: {a: xattr(buf / "entries" / n, a)
                       for a in ("seq", "tier", "size", "stored_size", "compression", "checksum", "priority",
                                 "times_sampled")} for n in names},
        "priorities": (buf / "priorities").read_text(),
        "config": get_config(buf),
        "entries": get_stats(buf)["entries"],
    }


def test_persistence_across_remount(fresh_mount):
    m = fresh_mount()
    a = m.buffer("alpha", {"capacity": 50, "sampler": "prioritized", "alpha": 0.7, "beta": 0.5,
                           "max_times_sampled": 100, "seed": 4})
    b = m.buffer("beta", {"compression": "none", "sampler": "fifo"})
    gone = m.buffer("dropped")
    os.rmdir(gone)
    for i in range(60):  # 10 evicted by capacity
        write_entry(a, f"a{i:02d}", make_payload(f"a{i:02d}", 500 + 37 * i, seed=i))
    write_entry(a, "a59", make_payload("a59", 700 << 10, seed=1))  # rewrite, now on the nvme tier
    os.unlink(a / "entries" / "a20")
    os.rename(a / "entries" / "a30", a / "entries" / "renamed")
    with open(a / "priorities", "w") as f:
        f.write("".join(f"a{i:02d} {i * 1.5}\n" for i in range(10, 60) if i not in (20, 30)))
    os.setxattr(a / "entries" / "renamed", "user.distorefs.priority", b"77")
    for n in (3, 5, 8):
        with open(a / "sample" / str(n), "rb") as f:
            f.read()
    write_entry(b, "big", os.urandom(900 << 10))
    write_entry(b, "small", b"small")
    with open(b / "sample" / "1", "rb") as f:
        assert f.read().startswith(b"big ")
    before_a, before_b = snapshot(a), snapshot(b)
    assert before_a["names"][0] == "a10" and len(before_a["names"]) == 49
    assert before_a["xattrs"]["a59"]["tier"] == "nvme"
    assert sum(int(x["times_sampled"]) for x in before_a["xattrs"].values()) == 16
    old_pid = m.pid

    m.umount()
    assert not pid_alive(old_pid)
    assert (m.store / "lock").read_text() == ""  # closed cleanly
    m.mount()
    assert m.pid != old_pid
    assert m.recovery()["ran"] is False
    assert sorted(os.listdir(m.mnt / "buffers")) == ["alpha", "beta"]
    after_a, after_b = snapshot(a), snapshot(b)
    assert after_a == before_a
    assert after_b == before_b
    for name, data in after_a["data"].items():
        assert verify_payload(data, "a59" if name == "a59" else None)
    # sequence numbers go on after the old ones; sampling still works
    write_entry(a, "new", b"new")
    assert int(xattr(a / "entries" / "new", "seq")) > max(int(x["seq"]) for x in before_a["xattrs"].values())
    with open(a / "sample" / "4", "rb") as f:
        assert len(f.read().splitlines()) == 4
    # and a second cycle keeps everything again
    before_a = snapshot(a)
    m.remount()
    assert snapshot(a) == before_a
    assert snapshot(b) == before_b


def test_segment_threshold_option(fresh_mount):
    m = fresh_mount("segment_threshold=65536")
    cfg = json.loads((m.mnt / ".distorefs" / "config.json").read_bytes())
    assert cfg["segment_threshold"] == 65536
    b = m.buffer("t", {"compression": "none"})
    write_entry(b, "mid", os.urandom(100_000))
    write_entry(b, "tiny", os.urandom(60_000))
    assert xattr(b / "entries" / "mid", "tier") == "nvme"
    assert xattr(b / "entries" / "tiny", "tier") == "lmdb"
    data = read_entry(b, "mid")
    m.remount()
    assert read_entry(b, "mid") == data
    assert xattr(b / "entries" / "mid", "tier") == "nvme"


# ----- kill -9 ---------------------------------------------------------------------------

def _crash_writer(entries_dir: str, log_path: str, prefix: str, seed: int) -> None:
    rng = random.Random(seed)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    written: list[str] = []
    i = 0
    try:
        while True:
            if written and rng.random() < 0.1:
                key = rng.choice(written)  # a rewrite of an earlier entry
            else:
                key = f"{prefix}-{i:05d}"
                i += 1
            r = rng.random()
            size = rng.randint(600 << 10, 900 << 10) if r < 0.05 else rng.randint(200, 150_000)
            data = make_payload(key, size, seed=rng.randrange(1 << 30))
            try:
                with open(os.path.join(entries_dir, key), "wb") as f:
                    f.write(data)
            except OSError:
                return  # the daemon is gone
            os.write(log, (key + "\n").encode())  # only after close() returned
            if key not in written:
                written.append(key)
    finally:
        os.close(log)


CYCLES = 3
WRITERS = 3


def test_kill9_keeps_every_closed_entry(fresh_mount, tmp_path):
    m = fresh_mount()
    b = m.buffer("crash")
    ctx = multiprocessing.get_context("fork")
    logged: set[str] = set()
    prios: dict[str, float] = {}
    for cycle in range(CYCLES):
        # config and priority writes whose close() returned must survive the crash too
        set_config(b, {"alpha": 0.1 * (cycle + 1), "capacity": 100_000 - cycle})
        some = sorted(logged)[:: 7]
        if some:
            with open(b / "priorities", "w") as f:
                f.write("".join(f"{k} {cycle + 1 + i / 8}\n" for i, k in enumerate(some)))
            prios.update({k: cycle + 1 + i / 8 for i, k in enumerate(some)})
        logs = [tmp_path / f"c{cycle}-w{w}.log" for w in range(WRITERS)]
        procs = [ctx.Process(target=_crash_writer,
                             args=(str(b / "entries"), str(logs[w]), f"c{cycle}w{w}", cycle * 100 + w))
                 for w in range(WRITERS)]
        for p in procs:
            p.start()
        time.sleep(1.0 + 0.3 * cycle)
        killed = m.kill9()
        for p in procs:
            p.join(timeout=30)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
        assert not hung, "writers did not fail after the daemon died"
        assert not pid_alive(killed)
        m.lazy_umount()
        assert not is_mounted(m.mnt)
        m.pid = None
        assert (m.store / "lock").read_text().split()[:2] == ["pid", str(killed)]  # not closed cleanly
        m.mount()
        assert m.pid != killed
        rec = m.recovery()  # so the mount recovered the store first
        assert rec["ran"] and rec["previous_holder"].split()[:2] == ["pid", str(killed)], rec
        assert rec["unrepaired"] == 0 and rec["blocking"] == 0, rec
        for log in logs:
            keys = log.read_text().split() if log.exists() else []
            assert keys, f"writer {log.name} committed nothing in {1.0 + 0.3 * cycle}s"
            logged.update(keys)
        names = entry_names(b)
        present = set(names)
        missing = sorted(logged - present)
        assert not missing, f"cycle {cycle}: {len(missing)} closed entries lost, e.g. {missing[:5]}"
        assert len(names) == len(present)
        bad = [n for n in names if not verify_payload(read_entry(b, n), n)]
        assert not bad, f"cycle {cycle}: partial or corrupt entries {bad[:5]}"
        assert get_stats(b)["entries"] == len(names)
        config = get_config(b)
        assert config["alpha"] == pytest.approx(0.1 * (cycle + 1)) and config["capacity"] == 100_000 - cycle
        for k, v in prios.items():
            assert float(xattr(b / "entries" / k, "priority")) == v, k
        # the store works normally after the crash
        write_entry(b, f"after-{cycle}", make_payload(f"after-{cycle}", 1000))
        assert verify_payload(read_entry(b, f"after-{cycle}"), f"after-{cycle}")
        logged.add(f"after-{cycle}")
    assert len(logged) > 50


def test_a_crashed_store_that_cannot_be_recovered_is_not_mounted(fresh_mount):
    import lmdb
    m = fresh_mount()
    b = m.buffer("keep")
    write_entry(b, "a", b"a value")
    killed = m.kill9()
    m.lazy_umount()
    m.pid = None
    env = lmdb.open(str(m.store / "meta"), max_dbs=32, subdir=True)
    ns = env.open_db(b"ns")
    with env.begin(write=True) as txn:
        txn.put(b"banks/broken", b"{not json", db=ns)  # nothing can repair this
    env.close()
    for _ in range(2):  # refused with the reason, and again: the lock still says "recover first"
        res = subprocess.run(list(CLI) + ["mount", str(m.store), str(m.mnt)], capture_output=True, text=True,
                             timeout=90)
        assert res.returncode != 0 and not is_mounted(m.mnt)
        assert "banks/broken" in res.stderr and f"distorefs verify --repair {m.store}" in res.stderr, res.stderr
        assert (m.store / "lock").read_text().split()[:2] == ["pid", str(killed)]
    env = lmdb.open(str(m.store / "meta"), max_dbs=32, subdir=True)
    ns = env.open_db(b"ns")
    with env.begin(write=True) as txn:
        txn.delete(b"banks/broken", db=ns)
    env.close()
    m.mount()
    assert m.recovery()["ran"] and read_entry(b, "a") == b"a value"


# ----- corruption ------------------------------------------------------------------------

MARK = b"<<VICTIM-MARKER-7d1f3c>>"


def test_corrupt_segment_value_reads_eio(fresh_mount):
    m = fresh_mount()
    b = m.buffer("corrupt", {"compression": "none"})
    victim = bytearray(make_payload("victim", 700 << 10))
    victim[300_000:300_000 + len(MARK)] = MARK
    victim = bytes(victim)
    good_big = make_payload("good_big", 650 << 10, seed=5)
    good_small = make_payload("good_small", 5000)
    write_entry(b, "good_before", make_payload("good_before", 600 << 10, seed=2))
    write_entry(b, "victim", victim)
    write_entry(b, "good_big", good_big)
    write_entry(b, "good_small", good_small)
    assert xattr(b / "entries" / "victim", "tier") == "nvme"
    m.umount()

    hits = []
    for seg in sorted((m.store / "segments").glob("seg-*.dat")):
        raw = seg.read_bytes()
        at = raw.find(MARK)
        if at >= 0:
            hits.append((seg, at))
            assert raw.find(MARK, at + 1) < 0
    assert len(hits) == 1, hits
    seg, at = hits[0]
    with open(seg, "r+b") as f:
        f.seek(at)
        f.write(bytes(x ^ 0xFF for x in MARK))

    m.mount()
    assert_errno(errno.EIO, read_entry, b, "victim")
    assert_errno(errno.EIO, read_entry, b, "victim")  # every time: no bad copy is cached
    cat = subprocess.run(["cat", str(b / "entries" / "victim")], capture_output=True)
    assert cat.returncode != 0 and b"Input/output error" in cat.stderr
    assert read_entry(b, "good_big") == good_big
    assert read_entry(b, "good_small") == good_small
    assert verify_payload(read_entry(b, "good_before"), "good_before")
    deadline = time.monotonic() + 5
    while "victim" not in m.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = m.log()
    assert "victim" in log and ("corrupt" in log.lower() or "checksum" in log.lower()), m.log_tail()
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["corrupt_reads"] >= 2
    # metadata is still there; the daemon is alive; new writes work
    assert "victim" in entry_names(b)
    assert xattr(b / "entries" / "victim", "tier") == "nvme"
    assert m.alive()
    write_entry(b, "later", b"fine")
    assert read_entry(b, "later") == b"fine"
    # a batch containing the corrupt entry fails, without hurting the daemon
    set_config(b, {"sampler": "fifo"})
    with pytest.raises(OSError) as info:
        with open(b / "batch" / "2.npz", "rb") as f:
            f.read()
    assert info.value.errno == errno.EIO
    assert m.alive()
    # removing the corrupt entry is allowed, the rest stays readable
    os.unlink(b / "entries" / "victim")
    assert "victim" not in entry_names(b)
    assert read_entry(b, "good_big") == good_big


def _store_stats(m) -> dict:
    return json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())


def test_priorities_the_front_acknowledged_survive_a_kill9_before_python_took_them(fresh_mount):
    """A `priorities` write is appended to STORE/priorities.wal by the library's front and
    answered before Python sees it (Python takes it at its next request, or within 0.1 s).
    A kill -9 right after the close leaves it there; the next mount commits it. The file
    holds what the write said, in records Python reads back."""
    from distorefs import priowal
    m = fresh_mount()
    b = m.buffer("wal", {"sampler": "prioritized"})
    for i in range(8):
        write_entry(b, f"k{i}", make_payload(f"k{i}", 200))
    replayed = 0
    for cycle in range(4):
        texts = ["".join(f"k{i} {cycle * 10 + n + i / 4}\n" for i in range(8)) for n in range(3)]
        for text in texts:
            with open(b / "priorities", "w") as f:
                f.write(text)
        records = priowal.read_records((m.store / priowal.FILE_NAME).read_bytes())
        killed = m.kill9()  # (the records were read from the file, not through the mount)
        assert records and records[-1].text == texts[-1].encode()
        assert [r.number for r in records] == sorted({r.number for r in records})
        m.lazy_umount()
        assert not pid_alive(killed)
        m.pid = None
        m.mount()
        for i in range(8):
            assert float(xattr(b / "entries" / f"k{i}", "priority")) == cycle * 10 + 2 + i / 4, (cycle, i)
        replayed += _store_stats(m)["priority_wal"]["replayed"]
        if replayed and cycle:
            break
    # (Python takes a write within 0.1 s when nothing else asks: a kill that came after it
    # finds it committed, which one cycle may; not all of them)
    assert replayed >= 1
    assert _store_stats(m)["mount"]["priority_log"] is True


def test_the_priorities_wal_is_emptied_once_committed(fresh_mount):
    """Past 1 MiB, the front empties the file at the first commit that leaves nothing in it
    uncommitted: its size stays bounded under a learner's steady writes."""
    from distorefs import priowal
    m = fresh_mount()
    b = m.buffer("trim", {"sampler": "prioritized"})
    keys = [f"entry-{i:04d}" for i in range(64)]
    for k in keys:
        write_entry(b, k, make_payload(k, 100))
    wal = m.store / priowal.FILE_NAME
    text = "".join(f"{k} {i + 0.125}\n" for i, k in enumerate(keys))  # about 1.2 KB a write
    sizes = []
    for n in range(1500):  # about 1.9 MB in all
        with open(b / "priorities", "w") as f:
            f.write(text)
        if n % 100 == 99:
            time.sleep(0.15)  # Python takes them (and the commit trims) while the learner trains
            sizes.append(wal.stat().st_size)
    stats = _store_stats(m)["mount"]
    assert stats["priority_writes_taken"] >= 1500 and stats["priority_log_trims"] >= 1, stats
    assert max(sizes) < (1 << 20) + 200 * (len(text) + priowal.HEADER.size), sizes
    assert float(xattr(b / "entries" / keys[5], "priority")) == 5.125

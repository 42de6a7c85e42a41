"""What the kernel serves without the daemon (issue 12, part 4): committed entry versions
from the page cache, batch files read ahead in large READs, and the rules that keep that
correct (a version's inode never changes content; one inode never has two batches open).
Requests are counted by the mount itself (stats.json mount.requests)."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distorefs_it import CLI, entry_names, get_stats, mount_stats, npy, read_entry, set_config, write_entry, xattr


def requests(fs) -> dict:
    return mount_stats(fs)["requests"]


def _counted(fs, kind: str, fn) -> int:
    before = requests(fs).get(kind, 0)
    fn()
    return requests(fs).get(kind, 0) - before


def requests_during(fs, kind: str, fn) -> int:
    """`kind` requests the daemon answered while `fn` ran (less what reading the counts costs)."""
    return _counted(fs, kind, fn) - _counted(fs, kind, lambda: None)


def reads_during(fs, fn) -> int:
    return requests_during(fs, "read", fn)


def passed_during(fs, fn) -> int:
    """Requests the library's front handed to Python while `fn` ran, less reading the count."""
    def count(fn) -> int:
        before = mount_stats(fs)["front_passed"]
        fn()
        return mount_stats(fs)["front_passed"] - before
    return count(fn) - count(lambda: None)



def test_a_second_read_of_an_entry_is_served_by_the_page_cache(fs, buf):
    data = os.urandom(300_000)
    write_entry(buf, "cached", data)
    assert read_entry(buf, "cached") == data
    assert reads_during(fs, lambda: read_entry(buf, "cached")) == 0  # no READ reached the daemon
    assert read_entry(buf, "cached") == data


def test_a_weights_version_read_again_is_served_by_the_page_cache(fs):
    """Collectors re-reading the same weights read memory (their inode's pages are kept)."""
    d = fs.mnt / "weights" / f"pc{os.getpid()}"
    d.mkdir()
    data = os.urandom(8 << 20)
    (d / "w.bin").write_bytes(data)
    assert (d / "w.bin").read_bytes() == data
    assert reads_during(fs, lambda: (d / "w.bin").read_bytes()) == 0
    assert (d / "w.bin").read_bytes() == data


def test_the_first_read_of_an_entry_needs_no_read_request(fs, buf):
    """The value taken at open goes into the page cache before OPEN is answered."""
    data = os.urandom(300_000)
    write_entry(buf, "stored", data)
    with open(buf / "entries" / "stored", "rb") as f:  # opened, and a second reader beside it
        assert reads_during(fs, lambda: read_entry(buf, "stored")) == 0
        assert f.read() == data


def test_a_rewrite_is_a_new_inode_and_old_readers_keep_theirs(buf):
    write_entry(buf, "r", b"one" * 1000)
    ino1 = os.stat(buf / "entries" / "r").st_ino
    assert read_entry(buf, "r") == b"one" * 1000  # its pages are in the kernel now
    with open(buf / "entries" / "r", "rb") as old:
        write_entry(buf, "r", b"two" * 500)
        assert old.read() == b"one" * 1000
        assert os.fstat(old.fileno()).st_size == 3000
    assert os.stat(buf / "entries" / "r").st_ino != ino1
    assert read_entry(buf, "r") == b"two" * 500  # not the old version's cached pages


def test_an_entry_moved_between_tiers_keeps_its_inode_and_attributes(fresh_mount):
    m = fresh_mount("lmdb_bytes=1048576", "sync_interval=0.1")
    buf = m.buffer("t", {"compression": "none"})
    payloads = {f"e{i:03d}": os.urandom(100_000) for i in range(40)}  # 4 MB: most must leave LMDB
    for key, data in payloads.items():
        write_entry(buf, key, data)
    os.setxattr(buf / "entries" / "e000", "user.distorefs.priority", b"7.5")
    inode = os.stat(buf / "entries" / "e000").st_ino
    deadline = time.monotonic() + 30
    while xattr(buf / "entries" / "e000", "tier") != "nvme" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert xattr(buf / "entries" / "e000", "tier") == "nvme"  # demoted by the tier mover
    assert os.stat(buf / "entries" / "e000").st_ino == inode
    assert float(xattr(buf / "entries" / "e000", "priority")) == 7.5
    for key, data in payloads.items():
        assert read_entry(buf, key) == data
    assert get_stats(buf)["entries"] == 40


def test_a_batch_is_read_in_few_requests(fs, buf):
    frames = [np.full((16, 84, 84), i, np.uint8) for i in range(64)]
    for i, a in enumerate(frames):
        write_entry(buf, f"f{i:02d}.npy", npy(a))
    set_config(buf, {"sampler": "fifo"})

    def load():
        with np.load(buf / "batch" / "64.npz") as z:
            assert z["data"].tobytes() == np.stack(frames).tobytes()
    load()
    # 7 MB: the kernel reads ahead in 1 MiB READs (direct I/O would take the reader's
    # 128-256 KiB pieces: 60 and more)
    assert reads_during(fs, load) <= 20


def test_small_batches_are_read_without_read_requests(fs, buf):
    """A learner's batch of small transitions goes into the page cache at its open; every
    draw still gives its own rows (the stored pages are the new batch, never the last)."""
    for i in range(100):
        write_entry(buf, f"t{i:03d}.npy", npy(np.full(30, i, np.int32)))
    set_config(buf, {"sampler": "uniform"})
    seen = []

    def load() -> None:
        for _ in range(10):
            with np.load(buf / "batch" / "16.npz") as z:
                rows, keys = z["data"], list(z["keys"])
            assert [f"t{int(r[0]):03d}.npy" for r in rows] == keys  # each row is its key's entry
            seen.append(tuple(keys))
    load()
    assert reads_during(fs, load) == 0
    assert len(set(seen)) > 15  # fresh draws, not one batch served again from the cache


def test_one_process_with_two_batches_open_reads_each_whole(buf):
    for i in range(200):
        write_entry(buf, f"k{i:03d}.npy", npy(np.full(5000, i, np.int64)))
    set_config(buf, {"sampler": "uniform"})
    with open(buf / "batch" / "50.npz", "rb") as a, open(buf / "batch" / "50.npz", "rb") as b:
        assert os.fstat(a.fileno()).st_ino != os.fstat(b.fileno()).st_ino
        parts_a, parts_b = [], []
        while True:  # interleaved, in pieces: each handle must read its own batch
            x, y = a.read(65536), b.read(65536)
            parts_a.append(x)
            parts_b.append(y)
            if not x and not y:
                break
    for raw in (b"".join(parts_a), b"".join(parts_b)):
        with np.load(io.BytesIO(raw)) as z:
            keys, data = z["keys"], z["data"]
            assert [int(k[1:4]) for k in keys] == [int(row[0]) for row in data]
            assert all((row == row[0]).all() for row in data)


def test_an_insert_asks_for_the_new_entrys_attributes_no_more(fs, buf):
    """A writer's new inode answers its open's permission check and Python's fstat from
    the attributes CREATE returned: the kernel tracks what it writes itself. What is left
    is the entries/ directory's, which the kernel drops on every create in it."""
    data = npy(np.arange(100))
    write_entry(buf, "attrs-first", data)

    def insert() -> None:
        with open(buf / "entries" / "attrs-second", "wb") as f:  # fstat, write, close
            f.write(data)
    assert requests_during(fs, "getattr", insert) <= 1
    st = os.stat(buf / "entries" / "attrs-second")
    assert st.st_size == len(data)
    assert read_entry(buf, "attrs-second") == data


def staged(fs, tmp_path, name: str, prefix: str, count: int, size: int) -> tuple:
    """`count` files of random bytes (`size` + i bytes) staged into datasets/NAME (sealed):
    (the dataset's path, {file name: its bytes})."""
    src = tmp_path / "src"
    src.mkdir()
    payloads = {f"{prefix}{i}.bin": os.urandom(size + i) for i in range(count)}
    for file, data in payloads.items():
        (src / file).write_bytes(data)
    ds = fs.mnt / "datasets" / name
    subprocess.run(CLI + ["stage", "-q", str(src), str(ds)], check=True, capture_output=True, timeout=120)
    return ds, payloads


def test_reads_of_sealed_items_cost_no_attribute_requests(fs, tmp_path):
    """A sealed dataset never changes: the path to an item (datasets/NAME, items/) and the
    item's attributes stay cached, so an open + read + close again costs OPEN and RELEASE
    (no FLUSH: test_closing_a_file_opened_for_reading_sends_no_flush), and no GETATTR of a
    directory on the way."""
    ds, payloads = staged(fs, tmp_path, "pagecache", "i", 20, 5000)
    items = [ds / "items" / f"i{i}.bin" for i in range(20)]

    def read_all() -> None:
        for p in items:  # no fstat: only what the path walk and the read ask for
            fd = os.open(p, os.O_RDONLY)
            try:
                assert len(os.read(fd, 1 << 16)) == len(payloads[p.name])
            finally:
                os.close(fd)
    read_all()  # looked up, attributes and pages cached
    assert requests_during(fs, "getattr", read_all) == 0


def test_closing_a_file_opened_for_reading_sends_no_flush(fs, buf, tmp_path):
    """A read-only open whose handle has nothing to do at close is answered with
    FOPEN_NOFLUSH (mount/interpose.py): closing an entry, a drawn batch, a dataset item or
    a control file sends no FLUSH. A writer's close still does: it commits there."""
    for i in range(8):
        write_entry(buf, f"n{i}.npy", npy(np.full(10, i, np.int32)))
    ds, payloads = staged(fs, tmp_path, "noflush", "n", 5, 3000)

    def read_everything() -> None:
        for i in range(8):
            read_entry(buf, f"n{i}.npy")
        with np.load(buf / "batch" / "4.npz") as z:
            assert z["data"].shape == (4, 10)
        (buf / "sample" / "2").read_bytes()
        for name, data in payloads.items():
            assert (ds / "items" / name).read_bytes() == data
        (buf / "config.json").read_bytes()
        (buf / "stats.json").read_bytes()
    assert requests_during(fs, "flush", read_everything) == 0
    assert requests_during(fs, "open", read_everything) >= 8 + 2 + 5 + 2  # the opens were made
    assert requests_during(fs, "flush", lambda: write_entry(buf, "w.npy", npy(np.full(10, 99, np.int32)))) == 1
    assert read_entry(buf, "w.npy") == npy(np.full(10, 99, np.int32))  # committed by the time close() returned


def test_the_kernels_capability_checks_are_answered_without_python(fs, buf):
    """Before a write() to a file, and at an open with O_TRUNC, the kernel asks for the
    file's security.capability (to drop it). The libfuse library (mount/interpose.py)
    answers those ENODATA itself, counted among the daemon's GETXATTRs; distorefs' own
    attributes are still the daemon's. The IOCTL of Python's isatty() at every open is
    answered there too, and counted."""
    def foreign() -> int:
        return mount_stats(fs)["foreign_xattrs_answered"]

    before = foreign()
    write_entry(buf, "cap.npy", npy(np.full(4, 7, np.int32)))
    with open(buf / "priorities", "w") as f:  # O_TRUNC, then a write
        f.write("cap.npy 2.5\n")
    assert foreign() - before >= 3
    path = buf / "entries" / "cap.npy"
    with pytest.raises(OSError) as err:
        os.getxattr(path, "security.capability")
    assert err.value.errno == errno.ENODATA
    assert float(xattr(path, "priority")) == 2.5
    assert requests_during(fs, "getxattr", lambda: xattr(path, "size")) >= 1
    assert requests_during(fs, "ioctl", lambda: open(path, "rb").close()) == 1


def test_the_front_thread_answers_the_kernels_checks_and_queues_the_rest(fs, buf):
    """The library's front thread reads every request (mount/interpose.py): the kernel's
    security.capability checks and Python's isatty IOCTLs are answered there and never
    handed to pyfuse3; the daemon's own requests (an entry's own attributes, a read) are."""
    path = buf / "entries" / "front.npy"
    write_entry(buf, "front.npy", npy(np.arange(5, dtype=np.int64)))

    def handed() -> int:
        return mount_stats(fs)["front_passed"]

    def checks() -> None:
        for _ in range(200):
            with pytest.raises(OSError) as err:
                os.getxattr(path, "security.capability")
            assert err.value.errno == errno.ENODATA
            with open(path, "rb") as f:  # isatty: an IOCTL
                f.isatty()

    assert mount_stats(fs)["front"] is True
    idle = handed()
    idle = handed() - idle  # what reading the counts hands over
    before = handed()
    checks()
    answered = handed() - before - idle
    # 200 checks, 200 opens (OPEN; LOOKUP and RELEASE at most) and 400 IOCTLs: only the
    # opens' own requests reach pyfuse3
    assert 200 <= answered <= 3 * 200 + 20
    before = handed()
    assert int(xattr(path, "size")) == os.path.getsize(path)  # distorefs' own name: pyfuse3's handler
    assert handed() - before - idle >= 1
    assert np.array_equal(np.load(path), np.arange(5))


def test_a_priorities_write_reaches_no_python(fs, buf):
    """A learner's `open(priorities, "w")` + write + close: the library's front answers the
    OPEN (with a handle number of its own), the GETATTR of Python's open() (the truncating
    open dropped the kernel's attributes), the WRITE (appended to the store's priority
    write-ahead file, then taken by Python), the FLUSH (nothing to wait for) and the
    RELEASE. No request of it reaches Python; the counts still show every request, and
    what a read shows right after the close is the last write's."""
    for i in range(3):
        write_entry(buf, f"p{i}.npy", npy(np.full(2, i, np.int32)))

    def handed() -> int:
        return mount_stats(fs)["front_passed"]

    def update(text: str) -> None:
        with open(buf / "priorities", "w") as f:
            f.write(text)

    update("p0.npy 1.0\n")  # the attributes are held from the first reply on
    os.stat(buf / "priorities")
    idle = handed()
    idle = handed() - idle
    first = mount_stats(fs)
    for n in range(20):
        update(f"p0.npy {n + 2.5}\np1.npy {n + 0.5}\n")
    time.sleep(0.2)  # the last RELEASE
    last = mount_stats(fs)
    counted, now = first["requests"], last["requests"]
    # before, per update: the WRITE (and before the front answered them: OPEN, GETATTR,
    # FLUSH, RELEASE)
    assert last["front_passed"] - first["front_passed"] - idle <= 4
    assert last["priority_writes_taken"] - first["priority_writes_taken"] == 20
    assert float(xattr(buf / "entries" / "p0.npy", "priority")) == 21.5
    assert float(xattr(buf / "entries" / "p1.npy", "priority")) == 19.5
    for kind in ("open", "write", "flush", "getattr", "release"):
        assert now[kind] - counted[kind] >= 20, kind
    assert mount_stats(fs)["front"] is True

    # a last line without its newline is the close's to apply: that FLUSH is Python's
    update("p2.npy 6.5")
    assert float(xattr(buf / "entries" / "p2.npy", "priority")) == 6.5
    with pytest.raises(OSError) as err:  # and a bad line still fails the close that sends it
        update("p2.npy x\n")
    assert err.value.errno == errno.EINVAL
    assert float(xattr(buf / "entries" / "p2.npy", "priority")) == 6.5


def test_a_buffers_stats_count_the_priorities_writes_acknowledged_before(fs, buf):
    """A `priorities` write the front answered is committed by Python a moment later; a
    read of the buffer's stats.json after it counts it, as a draw or the priorities file
    sees it (the make-run demo's report was one write short about half the time)."""
    for i in range(4):
        write_entry(buf, f"s{i}.npy", npy(np.full(2, i, np.int32)))

    def counted() -> int:
        stats = json.loads((buf / "stats.json").read_bytes())
        return stats["priority_updates"] + stats["priority_unknown_keys"]

    start = counted()
    for n in range(40):
        with open(buf / "priorities", "w") as f:
            f.write(f"s0.npy {n + 1.5}\ns1.npy {n + 2.5}\ngone.npy 1.0\n")
        assert counted() - start == 3 * (n + 1), n
    assert mount_stats(fs)["priority_writes_taken"] >= 40


def test_priorities_writes_the_front_takes_and_those_it_leaves_apply_in_order(fs, buf):
    """On one descriptor: a write of whole lines (the front's), then a line split across two
    writes and a write with a comment (Python's, and so is every later write of that
    handle), then whole lines again; and a single write() of 10,000 lines, which the kernel
    sends as several WRITEs of which only the first starts on a line: every line applies,
    the later one of two for the same key winning."""
    keys = [f"o{i}.npy" for i in range(4)]
    for i, k in enumerate(keys):
        write_entry(buf, k, npy(np.full(2, i, np.int32)))
    taken = mount_stats(fs)["priority_writes_taken"]
    fd = os.open(buf / "priorities", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, b"o0.npy 1\no1.npy 2\n")
        os.write(fd, b"o1.npy 3\no2.npy")
        os.write(fd, b" 4\n# a comment\n")
        os.write(fd, b"o3.npy 5\no0.npy 6\n")
    finally:
        os.close(fd)
    assert [float(xattr(buf / "entries" / k, "priority")) for k in keys] == [6.0, 3.0, 4.0, 5.0]
    assert mount_stats(fs)["priority_writes_taken"] - taken == 1
    many = [f"n{i:05d}" for i in range(10_000)]
    for k in many[:3]:
        write_entry(buf, k, npy(np.zeros(2, np.int32)))
    with open(buf / "priorities", "w") as f:
        f.write("".join(f"{k} {i + 0.5}\n" for i, k in enumerate(many)) + "n00001 7.25\n")
    assert [float(xattr(buf / "entries" / k, "priority")) for k in many[:3]] == [0.5, 7.25, 2.5]


def test_an_insert_reaches_python_four_times(fs, buf):
    """An insert by Python's open(): the create drops entries/' attributes in the kernel and
    the next insert's path walk asks for them; the front answers that GETATTR from what
    Python holds there, as it answers the IOCTL and the GETXATTR before write(), and the
    RELEASE (the writer is released before Python's next request). Python sees LOOKUP,
    CREATE, WRITE and FLUSH (the commit)."""
    write_entry(buf, "i0.npy", npy(np.zeros(2, np.int32)))
    (buf / "entries").stat()

    def handed() -> int:
        return mount_stats(fs)["front_passed"]

    idle = handed()
    idle = handed() - idle
    first = mount_stats(fs)
    for i in range(1, 21):
        write_entry(buf, f"i{i}.npy", npy(np.full(2, i, np.int32)))
    time.sleep(0.2)  # the last RELEASE
    last = mount_stats(fs)
    assert last["front_passed"] - first["front_passed"] - idle <= 20 * 4 + 4
    assert last["requests"]["getattr"] - first["requests"]["getattr"] >= 20  # still counted
    assert last["requests"]["release"] - first["requests"]["release"] >= 20  # released by Python
    assert last["open_handles"] == first["open_handles"]
    assert np.array_equal(np.load(buf / "entries" / "i20.npy"), np.full(2, 20, np.int32))


def test_a_file_created_unwritten_commits_at_its_release_whoever_answers_it(fresh_mount):
    """The commit of an entry created and closed unwritten happens at its release, which
    the front answers: Python releases the writer before its next request (the listing
    sees the entry), and before it stops (an unmount just after the close keeps it)."""
    m = fresh_mount()
    b = m.buffer("b", {"raw": True})
    (b / "entries" / "e0").touch()
    assert entry_names(b) == ["e0"]
    assert (b / "entries" / "e0").read_bytes() == b""
    fd = os.open(b / "entries" / "e1", os.O_WRONLY | os.O_CREAT, 0o640)
    os.close(fd)
    m.remount()
    assert entry_names(b) == ["e0", "e1"]
    assert os.stat(b / "entries" / "e1").st_mode & 0o777 == 0o640


def test_a_read_reaches_python_once(fs, buf):
    """open + read + close of an entry: the content goes into the page cache at OPEN and
    the close sends no FLUSH; the RELEASE that follows is answered by the library's front,
    which keeps the handle's number for Python to take before its next request. Python
    sees the OPEN alone; the handles are gone by the next request, and counted."""
    write_entry(buf, "r.npy", npy(np.arange(6, dtype=np.int16)))
    path = buf / "entries" / "r.npy"
    data = path.read_bytes()

    idle = mount_stats(fs)["front_passed"]
    idle = mount_stats(fs)["front_passed"] - idle
    first = mount_stats(fs)
    for _ in range(20):
        with open(path, "rb") as f:
            assert f.read() == data
    time.sleep(0.2)  # the last RELEASE
    last = mount_stats(fs)
    assert last["front_passed"] - first["front_passed"] - idle <= 20 + 4  # before: OPEN and RELEASE
    assert last["requests"]["release"] - first["requests"]["release"] >= 20
    assert last["open_handles"] <= first["open_handles"] + 1  # stats.json's own


def test_the_fronts_priorities_handles_work_like_pythons(fs, buf):
    """Handles the front opened: one closed unwritten never reaches Python; fsync, dup'd
    descriptors (two FLUSHes of one handle, both parked until the commit) and a forked
    writer work; a read-write or read-only open is still Python's. None is left behind:
    after more opens than the front's tables hold, its opens are still its own."""
    for i in range(3):
        write_entry(buf, f"q{i}.npy", npy(np.full(2, i, np.int32)))
    with open(buf / "priorities", "w") as f:  # the attributes (and the opens) are the front's from now on
        f.write("q0.npy 1\n")
    before = mount_stats(fs)
    for _ in range(100):  # opened and closed, never written
        os.close(os.open(buf / "priorities", os.O_WRONLY | os.O_TRUNC))
    after = mount_stats(fs)
    assert after["requests"]["open"] - before["requests"]["open"] >= 100
    assert after["front_passed"] - before["front_passed"] < 50  # stats.json's own reads, not 100 OPENs
    assert after["open_handles"] == before["open_handles"]

    fd = os.open(buf / "priorities", os.O_WRONLY)
    os.write(fd, b"q0.npy 3\n")
    os.fsync(fd)
    twin = os.dup(fd)
    os.write(twin, b"q1.npy 4\n")
    os.close(twin)  # a FLUSH of the handle while the other descriptor is open
    os.write(fd, b"q2.npy 5\n")
    os.close(fd)
    assert [float(xattr(buf / "entries" / f"q{i}.npy", "priority")) for i in range(3)] == [3.0, 4.0, 5.0]

    code = f"""
import os
with open({str(buf / "priorities")!r}, "w") as f:
    f.write("q0.npy 6\\n")
    f.flush()
    if os.fork() == 0:
        f.write("q1.npy 7\\n")
        f.flush()
        os._exit(0)
    os.wait()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert float(xattr(buf / "entries" / "q0.npy", "priority")) == 6.0
    assert float(xattr(buf / "entries" / "q1.npy", "priority")) == 7.0

    opens = requests(fs)["open"]
    passed = mount_stats(fs)["front_passed"]
    with open(buf / "priorities", "r+") as f:  # read-write: Python's open
        f.write("q2.npy 8\n")
    assert b"q2.npy 5" not in (buf / "priorities").read_bytes()  # read-only: Python's too
    assert float(xattr(buf / "entries" / "q2.npy", "priority")) == 8.0
    assert mount_stats(fs)["front_passed"] - passed >= 2 + 2  # both opens (and their WRITE, RELEASEs)
    assert requests(fs)["open"] - opens >= 2

    for n in range(200):  # more than the front's tables hold: every handle it opened was let go
        with open(buf / "priorities", "w") as f:
            f.write(f"q0.npy {n}\n")
    assert passed_during(fs, lambda: [os.close(os.open(buf / "priorities", os.O_WRONLY | os.O_TRUNC))
                                      for _ in range(20)]) < 5
    tables = mount_stats(fs)["front_tables"]
    assert tables["opened"] == 0 and tables["flushing"] == 0, tables  # every handle let go
    assert float(xattr(buf / "entries" / "q0.npy", "priority")) == 199.0


def test_a_chmod_of_the_buffer_reaches_the_attributes_the_library_holds(fs, buf):
    """priorities' and entries/' attributes follow the buffer's owner and mode: a chmod of
    the buffer forgets what the front holds, so the stat after the next truncating open, or
    after the next insert, is new."""
    write_entry(buf, "c.npy", npy(np.zeros(2, np.int32)))

    def mode_after_update() -> int:
        with open(buf / "priorities", "w") as f:
            f.write("c.npy 2\n")
            return os.fstat(f.fileno()).st_mode & 0o777

    os.stat(buf / "priorities")
    assert mode_after_update() == 0o644
    assert mode_after_update() == 0o644  # from the front
    def entries_mode_after_insert(name: str) -> int:  # a create drops entries/' attributes
        write_entry(buf, name, npy(np.zeros(2, np.int32)))
        return (buf / "entries").stat().st_mode & 0o7777

    assert entries_mode_after_insert("d1.npy") == 0o755
    assert entries_mode_after_insert("d2.npy") == 0o755  # from the front
    os.chmod(buf, 0o700)
    try:
        assert mode_after_update() == 0o600
        assert (buf / "priorities").stat().st_mode & 0o777 == 0o600
        assert entries_mode_after_insert("d3.npy") == 0o700
    finally:
        os.chmod(buf, 0o755)
    assert mode_after_update() == 0o644
    assert entries_mode_after_insert("d4.npy") == 0o755


def test_without_the_front_pyfuse3_reads_the_requests(fresh_mount, monkeypatch):
    """DISTOREFS_FRONT=0 (for comparisons): pyfuse3's loop reads /dev/fuse as it would
    alone; the library still answers the capability checks, on that loop."""
    monkeypatch.setenv("DISTOREFS_FRONT", "0")
    m = fresh_mount()
    buf = m.mnt / "buffers" / "nofront"
    buf.mkdir()
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())["mount"]
    assert stats["front"] is False and stats["front_passed"] == 0
    write_entry(buf, "a.npy", npy(np.full(3, 9, np.int32)))
    with open(buf / "priorities", "w") as f:
        f.write("a.npy 4.5\n")
    assert float(xattr(buf / "entries" / "a.npy", "priority")) == 4.5
    with pytest.raises(OSError) as err:
        os.getxattr(buf / "entries" / "a.npy", "security.capability")
    assert err.value.errno == errno.ENODATA
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())["mount"]
    assert stats["foreign_xattrs_answered"] >= 3


def test_a_learners_batches_cost_an_open_and_a_release(fs, buf):
    """One process loading batch/N.npz again and again (a learner's loop): the kernel keeps
    the name and, the batches being all one size, the size; each np.load costs OPEN and
    RELEASE only, and each batch is a new draw with the right contents."""
    for i in range(40):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))

    def load() -> set:
        with np.load(buf / "batch" / "8.npz") as z:
            assert z["data"].shape == (8, 3)
            for key, row in zip(z["keys"], z["data"]):
                assert (row == int(key[1:4])).all()
            return set(z["keys"].tolist())
    load()
    drawn: list[set] = []
    counts = {kind: requests_during(fs, kind, lambda: drawn.extend(load() for _ in range(10)))
              for kind in ("lookup", "getattr", "open")}
    assert counts == {"lookup": 0, "getattr": 0, "open": 10}
    assert len(set().union(*drawn)) > 8  # new draws, not one batch read again


def test_batches_of_other_sizes_and_other_processes_keep_their_own_sizes(fs, buf, tmp_path):
    """Batches whose size changes from one open to the next (keys of several lengths), read
    by this process and, at the same time, by another: every np.load sees its own batch's
    size and contents (the kernel keeps one inode per name, whoever asks)."""
    for i in range(60):
        np.save(buf / "entries" / (("k" * (1 + i % 7)) + f"{i:03d}.npy"), np.full(3, i, dtype=np.int32))
    script = tmp_path / "loader.py"
    script.write_text(f"""
import numpy as np, sys
for _ in range(150):
    with np.load({str(buf / "batch" / "5.npz")!r}) as z:
        for key, row in zip(z["keys"], z["data"]):
            assert (row == int(key.lstrip("k")[:3])).all(), (key, row)
""")
    others = [subprocess.Popen([sys.executable, str(script)]) for _ in range(2)]
    try:
        for _ in range(150):
            with np.load(buf / "batch" / "5.npz") as z:
                for key, row in zip(z["keys"], z["data"]):
                    assert (row == int(key.lstrip("k")[:3])).all()
            with open(buf / "batch" / "5.npz", "rb") as f:
                assert os.fstat(f.fileno()).st_size == len(f.read())
    finally:
        assert [p.wait(timeout=120) for p in others] == [0, 0]


def _learner_load(buf, n: int) -> list[str]:
    """np.load of batch/N.npz, as a learner's loop does; each row checked against its key."""
    with np.load(buf / "batch" / f"{n}.npz") as z:
        for key, row in zip(z["keys"], z["data"]):
            assert (row == int(key[1:4])).all(), (key, row)
        return z["keys"].tolist()


def test_a_learners_next_batch_is_opened_by_the_front(fs, buf):
    """While a learner trains on a batch it closed, the next batch built ahead goes into its
    inode's page cache and the library's front answers its next open: a batch then sends
    Python no request at all. Every batch is a new draw with the right contents, and a
    batch is counted as drawn at its open, not when it was set aside."""
    for i in range(40):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))
    _learner_load(buf, 8)  # through Python: its size is the one the kernel holds from now on
    time.sleep(0.2)
    before = get_stats(buf)["batches"]
    drawn: list[list[str]] = []

    def loop() -> None:
        for _ in range(20):
            drawn.append(_learner_load(buf, 8))
            time.sleep(0.01)  # the training step

    assert passed_during(fs, loop) <= 2  # (a note taken late sends an open through Python)
    assert len({tuple(d) for d in drawn}) == 20  # new draws, not one batch read again
    assert get_stats(buf)["batches"] - before == 20  # the one set aside now is not counted


def test_a_learners_batch_opened_by_the_front_wakes_python_once(fs, buf):
    """The front's open of a batch set aside wakes Python no more: the RELEASE that follows
    does, and Python takes both notes then (counts the draw, sets the next batch aside).
    One wake-up per batch of a learner's loop, not two (the code before: about 40 for 20)."""
    for i in range(40):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))
    _learner_load(buf, 8)
    time.sleep(0.2)
    before = get_stats(buf)["batches"]
    wakes = mount_stats(fs)["notes_wakes"]
    drawn: list[list[str]] = []

    def loop() -> None:
        for _ in range(20):
            drawn.append(_learner_load(buf, 8))
            time.sleep(0.02)  # the training step: each open and release is its own wake-up before

    assert passed_during(fs, loop) <= 2  # the opens were the front's
    woken = mount_stats(fs)["notes_wakes"] - wakes
    assert 15 <= woken <= 22, woken
    assert len({tuple(d) for d in drawn}) == 20
    assert get_stats(buf)["batches"] - before == 20  # every draw counted, on the release's wake-up

def test_the_notes_timer_is_no_wake_up_of_the_front(fs, buf):
    """The periodic look for the front's notes (a tick of Python's own timer into the same
    eventfd) is not counted as the front waking Python: an idle second adds none."""
    np.save(buf / "entries" / "k.npy", np.zeros(3, dtype=np.int32))
    time.sleep(0.3)
    wakes = mount_stats(fs)["notes_wakes"]
    time.sleep(1.2)  # two ticks at least (every 0.1 s, doubling to 0.5 s while nothing is found)
    assert mount_stats(fs)["notes_wakes"] == wakes


def test_a_batch_python_opened_sets_the_next_one_aside_at_its_close(fs, buf):
    """A learner's batch/N.npz that Python opened (its first, or one whose open came before
    the set-aside) has its RELEASE answered by the library's front; the front wakes Python
    for it, which sets the next batch aside at once, so the learner's next open is the
    front's. The code before woke no one: the set-aside waited for the next request (that
    open, which then reached Python too, and so on) or a timer of 0.1 s."""
    for i in range(40):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))
    sizes = (5, 6, 7, 9, 10, 11)

    def first_opens() -> None:
        for n in sizes:
            with open(buf / "batch" / f"{n}.npz", "rb") as f:  # Python's open (a new size)
                time.sleep(0.05)  # read while the next batches are drawn ahead
                with np.load(f) as z:
                    assert z["data"].shape == (n, 3)
    # each first open asks Python for the name, the open and the size
    alone = passed_during(fs, first_opens) / len(sizes)

    def first_and_next() -> None:
        for n in (12, 13, 14, 15, 16, 17):
            with open(buf / "batch" / f"{n}.npz", "rb") as f:
                time.sleep(0.05)
                with np.load(f) as z:
                    assert z["data"].shape == (n, 3)
            time.sleep(0.02)  # the training step: shorter than the timer
            _learner_load(buf, n)
    passed = passed_during(fs, first_and_next)
    assert passed <= 6 * alone + 1, (passed, alone)  # the next opens were the front's

def test_an_entry_removed_after_its_batch_was_set_aside_is_not_handed_out(fs, buf):
    """A batch set aside for a learner's next open (in the page cache, the front told to
    answer it) that holds an entry removed since is not handed out: the removal takes the
    front's mark away, and the open draws again."""
    for i in range(3):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))
    _learner_load(buf, 32)
    time.sleep(0.2)
    assert set(_learner_load(buf, 32)) == {"k000.npy", "k001.npy", "k002.npy"}  # (by the front)
    time.sleep(0.2)  # the next one set aside: 32 draws of 3 entries, so it holds k001
    os.remove(buf / "entries" / "k001.npy")
    assert set(_learner_load(buf, 32)) == {"k000.npy", "k002.npy"}


def test_the_batch_set_aside_for_a_learner_is_not_opened_by_another_process(fs, buf, tmp_path):
    """The front answers a set-aside batch's open for the learner's thread alone: another
    process reaching the learner's inode through the name the kernel keeps goes through
    Python (ESTALE, then an inode of its own), not to the learner's batch."""
    for i in range(40):
        np.save(buf / "entries" / f"k{i:03d}.npy", np.full(3, i, dtype=np.int32))
    _learner_load(buf, 8)
    time.sleep(0.2)
    _learner_load(buf, 8)
    time.sleep(0.2)
    script = tmp_path / "other.py"
    script.write_text(f"""
import numpy as np
with np.load({str(buf / "batch" / "8.npz")!r}) as z:
    assert z["data"].shape == (8, 3)
""")
    # answered by the front, it would send Python nothing (the name is the kernel's already)
    assert passed_during(fs, lambda: subprocess.run([sys.executable, str(script)], check=True)) >= 2
    before = get_stats(buf)["batches"]
    assert len(_learner_load(buf, 8)) == 8
    assert get_stats(buf)["batches"] - before == 1


def test_items_read_out_of_any_order_are_loaded_at_their_open(fs, tmp_path):
    """No order declared: an item's value is loaded at its open and put into the page cache
    before OPEN is answered (no READ); an open of an item whose pages the kernel holds
    loads nothing again."""
    ds, payloads = staged(fs, tmp_path, "atopen", "a", 12, 6000)

    def reads() -> int:
        return json.loads((ds / "stats.json").read_bytes())["reads"]

    def read_all() -> None:
        for name, data in payloads.items():
            with open(ds / "items" / name, "rb") as f:
                assert f.read() == data
    loaded = reads()
    assert reads_during(fs, read_all) == 0
    assert reads() - loaded == len(payloads)  # each loaded once, at its open
    read_all()
    assert reads() - loaded == len(payloads)  # from the page cache: not loaded again


def test_prefetched_items_are_read_without_read_requests(fs, tmp_path):
    """Items loaded ahead along a declared order go into the page cache at their open."""
    ds, payloads = staged(fs, tmp_path, "prefetched", "p", 12, 7000)
    index = np.load(ds / "index.npy")
    order = np.arange(len(index), dtype=np.int64)
    with open(ds / "order", "wb") as f:
        np.save(f, order)
    deadline = time.monotonic() + 30
    while json.loads((ds / "stats.json").read_bytes())["prefetch"]["loaded"] < len(index):
        assert time.monotonic() < deadline, "the prefetcher did not load the declared order"
        time.sleep(0.05)

    def read_in_order() -> None:
        for row in index[order]:
            name = row["path"].decode()
            with open(ds / "items" / name, "rb") as f:
                assert f.read() == payloads[name]
    assert reads_during(fs, read_in_order) == 0
    assert json.loads((ds / "stats.json").read_bytes())["prefetch"]["hits"] >= len(index)


def pushed_ahead(ds, payloads: dict) -> np.ndarray:
    """Every item of `ds` looked up by the kernel, the order of the index declared, and each
    value pushed into the page cache by the prefetcher: the index."""
    for name in payloads:  # the kernel knows every inode: values loaded ahead are pushed
        (ds / "items" / name).read_bytes()
    index = np.load(ds / "index.npy")
    with open(ds / "order", "wb") as f:
        np.save(f, np.arange(len(index), dtype=np.int64))
    deadline = time.monotonic() + 30
    while (prefetch := json.loads((ds / "stats.json").read_bytes())["prefetch"])["pushed"] < len(index):
        assert time.monotonic() < deadline, prefetch
        time.sleep(0.05)
    return index


def test_items_pushed_ahead_are_opened_by_the_front(fs, tmp_path):
    """An item whose value the prefetcher pushed into the page cache is opened by the
    library's front (keep_cache, no FLUSH) and read from the pages: its open, reads and
    release reach no Python; its prefetch hit is counted all the same, and every handle the
    front opened is let go. Its next open (the mark was for one) is Python's again."""
    ds, payloads = staged(fs, tmp_path, "frontopens", "f", 40, 5000)
    index = pushed_ahead(ds, payloads)
    time.sleep(0.2)  # the pusher's thread marks each inode once the kernel took its value

    def prefetch() -> dict:
        return json.loads((ds / "stats.json").read_bytes())["prefetch"]

    def read_in_order() -> None:
        for row in index:
            name = row["path"].decode()
            with open(ds / "items" / name, "rb") as f:
                assert f.read() == payloads[name]

    hits = prefetch()["hits"]
    opens = requests(fs)["open"]
    assert passed_during(fs, read_in_order) < len(index) // 4  # not an OPEN each
    assert requests(fs)["open"] - opens >= len(index)  # still counted
    assert prefetch()["hits"] - hits == len(index)
    tables = mount_stats(fs)["front_tables"]
    assert tables["opened"] == 0 and tables["opened_noted"] == 0, tables
    assert passed_during(fs, read_in_order) >= len(index)  # opened again: Python's


def test_items_loaded_before_the_kernel_knew_them_are_pushed_once_listed(fresh_mount, tmp_path):
    """The prefetcher loads along a declared order while the daemon's own listing tells
    the kernel the items' names (mount/namewarmer.py). A value loaded before the listing
    reached its item could not be pushed (the kernel held no inode to put it in) and was
    held in memory, so its open went through Python. Now the listing's reply pushes it:
    once the order is loaded and listed, nothing is held, and the items are opened by the
    front. The order is the listing's backwards, so its first loads come before the
    listing reaches them. And more items than the front's table of marks once held
    (12,288: the opens past it went through Python)."""
    m = fresh_mount()
    src = tmp_path / "src"
    src.mkdir()
    payloads = {f"n{i:05d}.bin": os.urandom(100 + i % 97) for i in range(16_000)}
    for file, data in payloads.items():
        (src / file).write_bytes(data)
    ds = m.mnt / "datasets" / "late"
    subprocess.run(CLI + ["stage", "-q", str(src), str(ds)], check=True, capture_output=True, timeout=300)
    m.remount()  # the kernel knows none of the items
    index = np.load(ds / "index.npy")
    order = np.argsort(index["path"])[::-1].astype(np.int64)  # last listed, first loaded
    with open(ds / "order", "wb") as f:
        np.save(f, order)

    def prefetch() -> dict:
        return json.loads((ds / "stats.json").read_bytes())["prefetch"]
    deadline = time.monotonic() + 30
    while (p := prefetch())["pushed"] < len(order):
        assert time.monotonic() < deadline, p  # held values are never pushed
        time.sleep(0.05)
    assert p["held"] == 0 and p["bytes_ahead"] == 0, p
    time.sleep(0.2)  # the pusher's thread marks each inode once the kernel took its value

    def read_in_order() -> None:
        for i in order:
            name = index["path"][i].decode()
            with open(ds / "items" / name, "rb") as f:
                assert f.read() == payloads[name]
    assert passed_during(m, read_in_order) < len(order) // 20  # not an OPEN each
    assert prefetch()["hits"] == len(order)


def test_an_item_pushed_ahead_counts_once_when_its_pages_are_gone(fs, tmp_path):
    """A prefetched value pushed into the page cache is a hit at open; if the kernel has
    dropped those pages by the time the item is read, its READ must not count a miss too."""
    ds, payloads = staged(fs, tmp_path, "pushedgone", "q", 10, 9000)
    index = pushed_ahead(ds, payloads)

    def prefetch() -> dict:
        return json.loads((ds / "stats.json").read_bytes())["prefetch"]
    before = prefetch()
    for row in index:
        name = row["path"].decode()
        fd = os.open(ds / "items" / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the pushed pages are gone
            assert os.read(fd, 1 << 16) == payloads[name]
        finally:
            os.close(fd)
    after = prefetch()
    assert after["hits"] - before["hits"] == len(index)
    assert after["misses"] - before["misses"] == 0


def test_an_item_pushed_for_an_order_replaced_before_its_read_is_still_counted(fs, tmp_path):
    """The front answers one open of an item whose value was pushed for the declared order.
    If a new order replaced that one before the item was read (the next epoch declared while
    the reader was still behind the prefetcher, or a loader reading part of an epoch), the
    open the front answers no longer finds the push in the new plan. It is still an open the
    kernel's pages served: it counts once (page_cache), not nowhere (flaky
    test_datasets.py::test_list_file_with_metadata_and_loader, 399 of 400 opens counted)."""
    ds, payloads = staged(fs, tmp_path, "replaced", "r", 24, 3000)
    index = pushed_ahead(ds, payloads)
    time.sleep(0.2)  # the pusher's thread marks each inode once the kernel took its value

    def prefetch() -> dict:
        return json.loads((ds / "stats.json").read_bytes())["prefetch"]
    with open(ds / "order", "wb") as f:
        np.save(f, np.array([0], dtype=np.int64))  # a new plan, of one item
    before = prefetch()
    for row in index:
        name = row["path"].decode()
        with open(ds / "items" / name, "rb") as f:
            assert f.read() == payloads[name]
    after = prefetch()
    opens = {k: after[k] - before[k] for k in ("hits", "late", "page_cache", "misses")}
    assert sum(opens.values()) == len(index), (opens, after)


def test_the_fronts_thread_runs_ahead_of_the_daemons_other_threads(fs):
    """The front's thread (named distorefs-front) runs at nice -10 where the daemon may
    (root): a caller blocked in a request the front answers in C waits for that thread to
    get a core, not behind the slices of the daemon's Python, the actors and the learner.
    The daemon's other threads keep its own priority."""
    assert os.geteuid() == 0, "the mount tests run as root (FUSE, allow_other)"
    tasks = Path(f"/proc/{fs.pid}/task")
    nice = {}
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a thread that ended meanwhile
        nice.setdefault(name, set()).add(int(fields[16]))
    assert nice.get("distorefs-front") == {-10}, nice
    assert all(v == {0} for k, v in nice.items() if k != "distorefs-front"), nice


def python_getattrs_during(fs, fn) -> int:
    """GETATTRs that reached Python while `fn` ran (those the front answered left out)."""
    def count(fn) -> int:
        before = mount_stats(fs)
        fn()
        after = mount_stats(fs)
        return ((after["requests"]["getattr"] - after["front_getattrs"])
                - (before["requests"]["getattr"] - before["front_getattrs"]))
    return count(fn) - count(lambda: None)


def test_a_sample_file_of_a_new_size_is_stated_by_the_front(fs, buf):
    """sample/N's size changes from draw to draw (keys and numbers of several widths): the
    stat after each open is answered by the front with the new batch's size, which Python
    gave it at the OPEN, and every stat agrees with what the read returns."""
    for i in range(60):
        np.save(buf / "entries" / (("k" * (1 + i % 9)) + f"{i}.npy"), np.full(2, i, dtype=np.int32))
    sizes: set[int] = set()

    def draw_all() -> None:
        for _ in range(30):
            with open(buf / "sample" / "4", "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read()
            assert size == len(data) and len(data.splitlines()) == 4
            sizes.add(size)
    draw_all()
    assert python_getattrs_during(fs, draw_all) == 0
    assert len(sizes) > 3  # the sizes did change


def test_many_buffers_leave_the_front_room_for_a_sample_files_attributes(fresh_mount):
    """Every buffer in use has its entries/ attributes held by the front for good; with many
    buffers, the attributes Python gives at a sample file's OPEN (for the stat that follows)
    and a `priorities` file's lasting hold must still find room. The code before: its table
    (64) full of lasting holds, every such stat went to Python."""
    m = fresh_mount()
    for i in range(70):
        b = m.buffer(f"b{i}")
        (b / "entries" / "e").write_bytes(b"x")  # (its entries/ is looked up, its attributes held)
        os.stat(b / "entries")
    buf = m.buffer("drawn")
    for i in range(20):
        np.save(buf / "entries" / (("k" * (1 + i % 9)) + f"{i}.npy"), np.full(2, i, dtype=np.int32))

    def draw_all() -> None:
        for _ in range(20):
            with open(buf / "sample" / "4", "rb") as f:
                size = os.fstat(f.fileno()).st_size
                assert size == len(f.read())
    draw_all()
    assert python_getattrs_during(m, draw_all) == 0

    def update() -> None:
        for n in range(10):
            with open(buf / "priorities", "w") as f:
                f.write(f"k0.npy {n + 1.5}\n")
    update()  # (held from its first reply on)
    assert python_getattrs_during(m, update) == 0


def test_items_written_before_the_seal_are_stated_by_the_front_after_it(fs):
    """Items written through the mount were given attributes not to be cached, so each
    one's first open after the seal asked Python for them (the permission check). Sealed,
    they are the front's to answer; a chmod of the dataset (Python's answer) reaches what
    the front answers with."""
    ds = fs.mnt / "datasets" / "sealedlater"
    ds.mkdir()
    (ds / "items" / "sub").mkdir()
    payloads = {f"sub/s{i}.bin": os.urandom(3000 + 7 * i) for i in range(12)}
    for name, data in payloads.items():
        (ds / "items" / name).write_bytes(data)
    os.setxattr(ds, "user.distorefs.sealed", b"1")

    def read_all() -> None:
        for name, data in payloads.items():
            with open(ds / "items" / name, "rb") as f:
                st = os.fstat(f.fileno())
                assert (st.st_size, f.read()) == (len(data), data)
                assert st.st_mode & 0o777 == 0o644
    assert python_getattrs_during(fs, read_all) == 0

    def mode_asked_again() -> str:  # statx(AT_STATX_FORCE_SYNC): a GETATTR whatever the kernel holds
        return subprocess.run(["stat", "--cached=never", "-c", "%a", str(ds)], capture_output=True, text=True,
                              check=True).stdout.strip()
    os.chmod(ds, 0o750)
    try:
        modes: list[str] = []
        assert python_getattrs_during(fs, lambda: modes.append(mode_asked_again())) == 0
        assert modes == ["750"]
    finally:
        os.chmod(ds, 0o755)
    assert mode_asked_again() == "755"

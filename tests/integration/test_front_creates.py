"""Creates of new entries answered by the library's front (mount/_interpose.c
answer_creates): in an `entries/` whose names the front holds, a write-only create of a name
it lacks gets an inode number Python reserved and a handle whose WRITEs the front keeps,
without Python; Python makes the inode and the writer from the front's record before any
request that could name them. What a program sees must be what a create through Python
gave: the mode less the umask, the owner, the size while it writes, the inode number for
the file's life, EEXIST, a rate limiter's wait, an empty file created and closed."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from distorefs_it import mount_stats, read_entry, set_config


def front_creates(m) -> int:
    return mount_stats(m)["front_creates"]


def test_an_inserts_create_reaches_no_python(fs, buf):
    """np.save into entries/: the create is the front's (counted), and of the insert's
    requests only the FLUSH that commits reaches Python; the entry holds the array."""
    a = np.arange(30_000, dtype=np.int32)
    np.save(buf / "entries" / "warm.npy", a)  # (the directory's names handed to the front at its lookup)
    passed_idle = mount_stats(fs)["front_passed"]
    passed_idle = mount_stats(fs)["front_passed"] - passed_idle  # reading the counts
    before = mount_stats(fs)
    np.save(buf / "entries" / "a.npy", a)
    after = mount_stats(fs)
    assert after["front_creates"] - before["front_creates"] == 1
    # before: the CREATE came to Python too (2)
    assert after["front_passed"] - before["front_passed"] - passed_idle <= 1
    assert np.array_equal(np.load(buf / "entries" / "a.npy"), a)
    assert after["requests"]["create"] - before["requests"]["create"] == 1  # counted as a create still


def test_a_created_entry_has_its_mode_owner_size_and_inode_number(fs, buf):
    """os.open(O_CREAT, 0o640) under a umask: the mode less the umask from the create on,
    the caller's uid and gid, the size written so far from fstat and from another process's
    stat, and one inode number from the create to after the commit."""
    (buf / "entries" / "warm").write_bytes(b"w")
    path = buf / "entries" / "moded"
    before = front_creates(fs)
    old = os.umask(0o027)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    finally:
        os.umask(old)
    try:
        assert front_creates(fs) == before + 1
        os.write(fd, b"x" * 5000)
        st = os.fstat(fd)
        assert (st.st_mode & 0o7777, st.st_size, st.st_uid, st.st_gid) == (0o640, 5000, os.getuid(), os.getgid())
        other = subprocess.run([sys.executable, "-c", f"import os; s = os.stat({str(path)!r}); print(s.st_size, s.st_ino)"],
                               capture_output=True, text=True, timeout=60, check=True)
        assert other.stdout.split() == ["5000", str(st.st_ino)]
        ino = st.st_ino
    finally:
        os.close(fd)
    st = os.stat(path)
    assert (st.st_mode & 0o7777, st.st_size, st.st_ino) == (0o640, 5000, ino)
    assert read_entry(buf, "moded") == b"x" * 5000


def test_creates_the_front_leaves_to_python(fs, buf):
    """A name that exists (O_EXCL: EEXIST; without it the file is truncated and rewritten)
    and a read-write create go to Python, and do what they did."""
    (buf / "entries" / "there").write_bytes(b"old")
    before = front_creates(fs)
    with pytest.raises(FileExistsError):
        os.open(buf / "entries" / "there", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    (buf / "entries" / "there").write_bytes(b"new")
    with open(buf / "entries" / "rw", "w+b") as f:  # O_RDWR: reads what it wrote
        f.write(b"abc")
        f.seek(0)
        assert f.read() == b"abc"
    assert front_creates(fs) == before
    assert read_entry(buf, "there") == b"new" and read_entry(buf, "rw") == b"abc"
    fd = os.open(buf / "entries" / "excl", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # a new name: the front's
    os.write(fd, b"e")
    os.close(fd)
    assert front_creates(fs) == before + 1 and read_entry(buf, "excl") == b"e"
    with pytest.raises(FileExistsError):  # and now it is there
        os.open(buf / "entries" / "excl", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def test_an_empty_create_and_a_writer_that_exits_without_close_are_entries(fs, buf):
    """A file created and closed unwritten commits at its release (empty), one whose
    process exits without close() at the FLUSH the exit sends; both are listed after."""
    (buf / "entries" / "warm").write_bytes(b"w")
    before = front_creates(fs)
    open(buf / "entries" / "empty", "wb").close()
    code = f"import os\nfd = os.open({str(buf / 'entries' / 'exited')!r}, os.O_WRONLY | os.O_CREAT, 0o644)\n" \
           f"os.write(fd, b'kept')\nos._exit(0)\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert front_creates(fs) == before + 2
    assert sorted(os.listdir(buf / "entries")) == ["empty", "exited", "warm"]
    assert read_entry(buf, "empty") == b"" and read_entry(buf, "exited") == b"kept"


def test_many_creates_between_two_requests_of_python_all_become_entries(fs, buf):
    """More creates than the front holds inode numbers for (it is topped up as Python takes
    them; past them the creates are Python's): 400 writers in a row from 4 processes, every
    entry whole, with distinct inode numbers."""
    (buf / "entries" / "warm").write_bytes(b"w")
    before = front_creates(fs)
    code = ("import os, sys\nd, k = sys.argv[1], int(sys.argv[2])\n"
            "for i in range(100):\n"
            "    with open(f'{d}/p{k}-{i}', 'wb') as f:\n"
            "        f.write(f'{k}:{i}'.encode() * 50)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(buf / "entries"), str(k)]) for k in range(4)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    names = [f"p{k}-{i}" for k in range(4) for i in range(100)]
    assert front_creates(fs) - before > 300  # (a few may be Python's while the pool refills)
    inos = set()
    for name in names:
        k, i = name[1:].split("-")
        assert read_entry(buf, name) == f"{k}:{i}".encode() * 50
        inos.add(os.stat(buf / "entries" / name).st_ino)
    assert len(inos) == len(names)


def test_a_rate_limited_buffer_creates_through_python(fs, buf):
    """Once the buffer has a rate limiter, creates are Python's again (each is admitted
    there): the limiter still holds an actor back when it is ahead."""
    (buf / "entries" / "warm").write_bytes(b"w")
    before = front_creates(fs)
    (buf / "entries" / "free").write_bytes(b"f")
    assert front_creates(fs) == before + 1
    set_config(buf, {"min_size_to_sample": 2, "samples_per_insert": 1, "error_buffer": 1})
    (buf / "entries" / "limited").write_bytes(b"l")  # 3 entries: the limit's edge
    assert front_creates(fs) == before + 1
    with pytest.raises(BlockingIOError):  # ahead: O_NONBLOCK gets EAGAIN at the create (Python's)
        os.open(buf / "entries" / "held", os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644)
    set_config(buf, {"samples_per_insert": None, "error_buffer": None})
    (buf / "entries" / "again").write_bytes(b"a")
    assert front_creates(fs) == before + 2


def test_a_store_mounted_without_front_creates_creates_the_same(fresh_mount):
    """DISTOREFS_CREATES=0 is how benchmarks compare: every create is Python's, and what a
    program sees is the same."""
    m = fresh_mount()
    m.umount()
    os.environ["DISTOREFS_CREATES"] = "0"
    try:
        m.mount()
    finally:
        del os.environ["DISTOREFS_CREATES"]
    (m.mnt / "buffers" / "b").mkdir()
    buf = m.mnt / "buffers" / "b"
    a = np.ones(1000, dtype=np.uint8)
    bio = io.BytesIO()
    np.save(bio, a)
    for i in range(3):
        (buf / "entries" / f"e{i}").write_bytes(bio.getvalue())
    assert front_creates(m) == 0 and mount_stats(m)["create_dirs"] == 0
    assert all(np.array_equal(np.load(buf / "entries" / f"e{i}"), a) for i in range(3))
    with pytest.raises(OSError) as e:
        os.open(buf / "entries" / "e0", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    assert e.value.errno == errno.EEXIST

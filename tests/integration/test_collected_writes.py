"""An insert's WRITEs answered by the library's front (mount/_interpose.c, collect_writes):
the bytes a new entry's writer writes are kept there, each WRITE answered without Python,
and reach Python with the handle's first request that does (its close's FLUSH, which
commits them). Whatever the front does not keep (a write past the end, past the buffer's
limit, a read-write handle) goes to Python with what it kept, in order; the entry a
reader sees is what was written, byte for byte."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from distorefs_it import entry_names, mount_stats, read_entry, set_config


def collected(fs) -> int:
    return mount_stats(fs)["writes_collected"]


def test_an_inserts_writes_reach_no_python(fs, buf):
    """np.save sends 5 WRITEs (the header, then the array through a duplicate descriptor,
    with an fstat between): none of them reaches Python, all are counted, and the entry
    holds the array."""
    a = np.arange(30_000, dtype=np.int32)  # 120 KB
    np.save(buf / "entries" / "warm.npy", a)  # (the directory's attributes held from here on)

    def insert(name: str) -> tuple[int, int, int]:
        before = mount_stats(fs)
        np.save(buf / "entries" / name, a)
        after = mount_stats(fs)
        return (after["requests"]["write"] - before["requests"]["write"],
                after["writes_collected"] - before["writes_collected"],
                after["front_passed"] - before["front_passed"])

    idle = mount_stats(fs)["front_passed"]
    idle = mount_stats(fs)["front_passed"] - idle  # reading the counts
    writes, kept, passed = insert("a.npy")
    assert writes >= 2 and kept == writes  # every WRITE counted, none of them Python's
    # LOOKUP, CREATE and the FLUSH that commits are what Python answers (np.save closes a
    # duplicate first; its own close's FLUSH is the library's, and so is the GETATTR of its
    # fstat between the WRITEs); before, the five WRITEs, that GETATTR and the second FLUSH
    # came on top
    assert passed - idle <= 3
    assert np.array_equal(np.load(buf / "entries" / "a.npy"), a)
    assert mount_stats(fs)["writers_collecting"] == 0  # the closed writer holds nothing there
    assert mount_stats(fs)["collected_bytes"] == 0


def test_a_writers_size_shows_while_the_front_keeps_its_bytes(fs, buf):
    """stat() of a file being written shows what was written so far, from the writer and
    from another process, and the front keeps the writes that follow."""
    path = buf / "entries" / "growing"
    # started first: a process forked while the file is open closes its copy of the
    # descriptor at exec, and that close's FLUSH commits what was written (as any close)
    other = subprocess.Popen([sys.executable, "-c", f"import os\ninput()\nprint(os.stat({str(path)!r}).st_size)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = mount_stats(fs)["writes_collected"]
    with open(path, "wb", buffering=0) as f:
        f.write(b"x" * 1000)
        assert os.fstat(f.fileno()).st_size == 1000
        f.write(b"y" * 500)
        out, _ = other.communicate("\n", timeout=60)
        assert int(out) == 1500
        f.write(b"z" * 10)
        st = os.fstat(f.fileno())  # (the library's answer: one writer, its bytes with the front)
        mask = os.umask(0)
        os.umask(mask)
        assert (st.st_size, st.st_mode & 0o777, st.st_nlink) == (1510, 0o666 & ~mask, 1)
        os.chmod(path, 0o600)  # a writer's new mode goes in with its commit; stat shows it now
        f.write(b"!")
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert os.fstat(f.fileno()).st_size == 1511
    assert collected(fs) - first == 3
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_entry(buf, "growing") == b"x" * 1000 + b"y" * 500 + b"z" * 10 + b"!"


def _as_locally(fs, buf, name: str, calls) -> int:
    """Make entry `name` with `calls(f)` on a new file, check it holds what the same calls
    make of a local file, and return how many WRITEs the front kept."""
    local = io.BytesIO()
    calls(local)
    first = collected(fs)
    with open(buf / "entries" / name, "wb", buffering=0) as f:
        calls(f)
    assert read_entry(buf, name) == local.getvalue()
    return collected(fs) - first


def test_writes_the_front_does_not_keep_go_to_python_in_order(fs, buf):
    """A write past the end (a hole), then appends, a rewrite of the start and a truncation:
    the entry is what the same calls make of a local file."""
    def calls(f) -> None:
        f.write(b"a" * 100)
        f.write(b"b" * 50)  # (both kept by the front)
        f.seek(300)
        f.write(b"c" * 10)  # past the end: Python's, with the 150 bytes kept before it
        f.write(b"d" * 20)
        f.seek(0)
        f.write(b"HEAD")
        f.truncate(320)
        f.seek(0, os.SEEK_END)
        f.write(b"e" * 7)

    assert _as_locally(fs, buf, "holes", calls) == 2

    def kept_calls(f) -> None:  # only writes within what was written, or right after it
        f.write(b"a" * 100)
        f.seek(10)
        f.write(b"R" * 5)
        f.seek(0, os.SEEK_END)
        f.write(b"b" * 3)

    assert _as_locally(fs, buf, "rewritten", kept_calls) == 3


def test_a_write_past_the_buffers_limit_fails_as_before(fs, buf):
    """EFBIG at the write that crosses max_entry_bytes, again at close, and nothing is
    published: the front keeps nothing past the limit, Python refuses it."""
    set_config(buf, {"max_entry_bytes": 4096})
    f = open(buf / "entries" / "big", "wb", buffering=0)
    f.write(b"x" * 3000)  # kept by the front
    # (the kernel may send what fits in the page as a WRITE of its own: then the write
    # returns short, and the next one fails, as POSIX has it)
    with pytest.raises(OSError) as err:
        n = f.write(b"y" * 2000)
        assert n < 2000
        f.write(b"y" * (2000 - n))
    assert err.value.errno == errno.EFBIG
    with pytest.raises(OSError) as err:
        f.close()
    assert err.value.errno == errno.EFBIG
    assert "big" not in entry_names(buf)


def test_an_entry_larger_than_the_front_keeps_is_whole(fs, buf):
    """The front keeps at most 8 MiB of one writer: a 12 MB entry's later WRITEs go to
    Python, after what the front kept."""
    data = os.urandom(12 << 20)
    with open(buf / "entries" / "large", "wb", buffering=0) as f:
        for off in range(0, len(data), 1 << 20):
            f.write(data[off:off + (1 << 20)])
    assert read_entry(buf, "large") == data
    assert mount_stats(fs)["collected_bytes"] == 0


def test_a_writer_that_exits_without_close_commits_what_the_front_kept(fs, buf):
    path = buf / "entries" / "exited"
    code = f"import os\nfd = os.open({str(path)!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'kept' * 100)\nos._exit(0)\n"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert read_entry(buf, "exited") == b"kept" * 100


def test_a_read_write_handle_is_left_to_python(fs, buf):
    first = collected(fs)
    with open(buf / "entries" / "rw", "w+b", buffering=0) as f:
        f.write(b"0123456789")
        f.seek(2)
        assert f.read(3) == b"234"
    assert collected(fs) == first
    assert read_entry(buf, "rw") == b"0123456789"


def test_a_close_after_the_committing_one_is_the_libraries_until_something_changes(fs, buf):
    """np.save closes a duplicate descriptor (that FLUSH commits) and then its own: the
    second FLUSH has nothing to do and is answered without Python. A write or a truncation
    (through the descriptor or by path) after the first close gives the next one work again:
    what each close returned is what a read right after it sees."""
    path = buf / "entries" / "closed-twice"

    def passed(fn) -> int:
        before = mount_stats(fs)["front_passed"]
        fn()
        return mount_stats(fs)["front_passed"] - before

    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"first")
    os.close(os.dup(fd))  # commits
    assert read_entry(buf, "closed-twice") == b"first"
    idle = passed(lambda: None)
    assert passed(lambda: os.close(os.dup(fd))) - idle == 0  # nothing to commit: the library's
    os.write(fd, b"+more")
    os.close(os.dup(fd))
    assert read_entry(buf, "closed-twice") == b"first+more"
    os.ftruncate(fd, 3)
    os.close(os.dup(fd))
    assert read_entry(buf, "closed-twice") == b"fir"
    os.truncate(path, 2)  # by path, the writer still open
    os.close(fd)
    assert read_entry(buf, "closed-twice") == b"fi"


def _insert_many(directory: str, tag: int, count: int) -> None:
    for i in range(count):
        with open(f"{directory}/q{tag}-{i:05d}.bin", "wb") as f:
            f.write(bytes([tag]) * (300 + i % 7))


def test_requests_queued_behind_others_are_taken_without_a_wait_and_all_land(fs, buf):
    """With several writers at once, requests queue at the front while Python answers one:
    pyfuse3's loop takes those without waiting for its fd again (interpose.
    take_queued_without_waiting), and every insert lands whole, none twice."""
    import multiprocessing

    before = mount_stats(fs)["taken_without_waiting"]
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_insert_many, args=(str(buf / "entries"), tag, 300)) for tag in range(1, 5)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    assert mount_stats(fs)["taken_without_waiting"] > before
    names = entry_names(buf)
    assert len(names) == 1200
    for tag in range(1, 5):
        for i in (0, 151, 299):
            assert read_entry(buf, f"q{tag}-{i:05d}.bin") == bytes([tag]) * (300 + i % 7)

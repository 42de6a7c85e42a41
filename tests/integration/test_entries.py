"""Entries: insert, read, rewrite, delete, rename, FIFO readdir, visibility at close,
concurrent inserts, eviction."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

from distorefs_it import (assert_errno, entry_names, get_stats, make_payload, read_entry, set_config,
                          verify_payload, write_entry, xattr)


def test_insert_read_rewrite_delete(buf):
    write_entry(buf, "a", b"alpha")
    write_entry(buf, "b", b"bravo" * 1000)
    write_entry(buf, "c", b"")
    # An entry never written appears when its last descriptor is released, a moment after
    # close() (README: a shell's `>` closes a dup first); the kernel sends RELEASE after
    # close() returns. Until then the name looks up (the writer's inode) but other openers
    # get ENOENT: wait for it to open, not merely to exist.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            read_entry(buf, "c")
            break
        except FileNotFoundError:
            time.sleep(0.01)
    assert read_entry(buf, "a") == b"alpha"
    assert read_entry(buf, "b") == b"bravo" * 1000
    assert read_entry(buf, "c") == b""
    assert os.stat(buf / "entries" / "b").st_size == 5000
    seq_a = int(xattr(buf / "entries" / "a", "seq"))
    seq_b = int(xattr(buf / "entries" / "b", "seq"))
    seq_c = int(xattr(buf / "entries" / "c", "seq"))
    assert seq_a < seq_b < seq_c

    # rewrite: new content, same FIFO position
    write_entry(buf, "a", b"ALPHA-rewritten")
    assert read_entry(buf, "a") == b"ALPHA-rewritten"
    assert os.stat(buf / "entries" / "a").st_size == len(b"ALPHA-rewritten")
    assert int(xattr(buf / "entries" / "a", "seq")) == seq_a
    assert entry_names(buf) == ["a", "b", "c"]

    # rewrite in place through r+ (no truncation): the tail is kept
    with open(buf / "entries" / "a", "r+b") as f:
        f.write(b"alpha")
    assert read_entry(buf, "a") == b"alpha-rewritten"
    assert int(xattr(buf / "entries" / "a", "seq")) == seq_a

    # append
    with open(buf / "entries" / "c", "ab") as f:
        f.write(b"tail")
    assert read_entry(buf, "c") == b"tail"
    assert int(xattr(buf / "entries" / "c", "seq")) == seq_c

    # delete
    os.unlink(buf / "entries" / "b")
    assert_errno(errno.ENOENT, read_entry, buf, "b")
    assert_errno(errno.ENOENT, os.stat, buf / "entries" / "b")
    assert_errno(errno.ENOENT, os.unlink, buf / "entries" / "b")
    assert entry_names(buf) == ["a", "c"]

    # a re-created key is a new entry at the end of the FIFO
    write_entry(buf, "b", b"new b")
    assert int(xattr(buf / "entries" / "b", "seq")) > seq_c
    assert entry_names(buf) == ["a", "c", "b"]


def test_open_reader_keeps_its_version(buf):
    write_entry(buf, "v", b"version-1" * 100)
    with open(buf / "entries" / "v", "rb") as old:
        first = old.read(10)
        write_entry(buf, "v", b"version-2" * 50)
        rest = old.read()
    assert first + rest == b"version-1" * 100
    assert read_entry(buf, "v") == b"version-2" * 50


def test_open_reader_survives_unlink_and_eviction(buf):
    set_config(buf, {"capacity": 2})
    write_entry(buf, "gone", b"G" * 300_000)
    with open(buf / "entries" / "gone", "rb") as f:
        head = f.read(1000)
        os.unlink(buf / "entries" / "gone")
        assert_errno(errno.ENOENT, os.stat, buf / "entries" / "gone")
        assert head + f.read() == b"G" * 300_000
    write_entry(buf, "old", b"O" * 200_000)
    with open(buf / "entries" / "old", "rb") as f:
        write_entry(buf, "n1", b"1")
        write_entry(buf, "n2", b"2")  # evicts "old"
        assert entry_names(buf) == ["n1", "n2"]
        assert f.read() == b"O" * 200_000


def test_rename_keeps_seq(fs, buf):
    for k in ("r1", "r2", "r3"):
        write_entry(buf, k, k.encode() * 10)
    seq2 = int(xattr(buf / "entries" / "r2", "seq"))
    os.rename(buf / "entries" / "r2", buf / "entries" / "moved")
    assert entry_names(buf) == ["r1", "moved", "r3"]
    assert int(xattr(buf / "entries" / "moved", "seq")) == seq2
    assert read_entry(buf, "moved") == b"r2" * 10
    assert_errno(errno.ENOENT, os.stat, buf / "entries" / "r2")

    # rename over an existing entry replaces it; the moved entry keeps its own seq
    seq1 = int(xattr(buf / "entries" / "r1", "seq"))
    os.rename(buf / "entries" / "r1", buf / "entries" / "r3")
    assert entry_names(buf) == ["r3", "moved"]
    assert int(xattr(buf / "entries" / "r3", "seq")) == seq1
    assert read_entry(buf, "r3") == b"r1" * 10
    assert get_stats(buf)["entries"] == 2

    # to another buffer: EXDEV, and nothing moves
    other = fs.buffer(buf.name + "-other")
    assert_errno(errno.EXDEV, os.rename, buf / "entries" / "moved", other / "entries" / "moved")
    assert entry_names(buf) == ["r3", "moved"]
    assert entry_names(other) == []
    # mv falls back to copy + delete
    mv = subprocess.run(["mv", str(buf / "entries" / "moved"), str(other / "entries" / "moved")],
                        capture_output=True, text=True)
    assert mv.returncode == 0, mv.stderr
    assert entry_names(buf) == ["r3"]
    assert read_entry(other, "moved") == b"r2" * 10


def test_readdir_fifo_order(buf):
    keys = [f"z{i:02d}" if i % 2 else f"a{i:02d}" for i in range(40)]  # not sorted by name
    for k in keys:
        write_entry(buf, k, k.encode())
    assert entry_names(buf) == keys
    ls = subprocess.run(["ls", "-U", str(buf / "entries")], capture_output=True, text=True, check=True)
    assert ls.stdout.split() == keys
    seqs = [int(xattr(buf / "entries" / k, "seq")) for k in keys]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # a rewrite does not move an entry; a delete + insert does
    write_entry(buf, keys[3], b"again")
    os.unlink(buf / "entries" / keys[5])
    write_entry(buf, keys[5], b"back")
    expected = keys[:5] + keys[6:] + [keys[5]]
    assert entry_names(buf) == expected
    # priorities lists the same order
    lines = (buf / "priorities").read_text().splitlines()
    assert [line.split()[0] for line in lines] == expected


_WRITER = textwrap.dedent("""
    import sys
    path = sys.argv[1]
    f = open(path, "wb", buffering=0)
    f.write(b"first half|")
    print("written", flush=True)
    sys.stdin.readline()
    f.write(b"second half")
    f.close()
    print("closed", flush=True)
""")


@contextlib.contextmanager
def held_writer(path):
    """A process that has written half of `path` and holds it open; calling the yielded
    function makes it write the rest and close. It runs in its own process so no fd of it
    is inherited (and closed) by the readers: a close of any duplicate would commit."""
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)

    def finish() -> None:
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "closed"

    try:
        assert writer.stdout.readline().strip() == "written"
        yield finish
    finally:
        writer.stdin.close()
        writer.wait(timeout=30)
    assert writer.returncode == 0


def test_entry_invisible_until_close(buf):
    path = buf / "entries" / "pending"
    write_entry(buf, "before", b"b")
    with held_writer(path) as finish:
        assert_errno(errno.ENOENT, open, path, "rb")
        cat = subprocess.run(["cat", str(path)], capture_output=True)
        assert cat.returncode != 0 and cat.stdout == b""
        ls = subprocess.run(["ls", str(buf / "entries")], capture_output=True, text=True, check=True)
        assert "pending" not in ls.stdout.split()
        assert "pending" not in entry_names(buf)
        assert get_stats(buf)["entries"] == 1
        finish()
    assert read_entry(buf, "pending") == b"first half|second half"
    assert entry_names(buf) == ["before", "pending"]
    cat = subprocess.run(["cat", str(path)], capture_output=True, check=True)
    assert cat.stdout == b"first half|second half"


def test_rewrite_invisible_until_close(buf):
    path = buf / "entries" / "doc"
    write_entry(buf, "doc", b"old content")
    with held_writer(path) as finish:
        # readers still get the whole old version while the rewrite is open
        cat = subprocess.run(["cat", str(path)], capture_output=True, check=True)
        assert cat.stdout == b"old content"
        finish()
    assert read_entry(buf, "doc") == b"first half|second half"


# ----- concurrent inserts ------------------------------------------------------------

PROCS = 4
PER_PROC = 200
SIZE = 110_000


def _insert_many(entries_dir: str, proc: int, count: int) -> None:
    for i in range(count):
        key = f"p{proc}-{i:04d}"
        data = make_payload(key, SIZE - (i % 7) * 100, seed=proc)
        with open(os.path.join(entries_dir, key), "wb") as f:
            f.write(data)


def test_concurrent_inserts(buf):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_insert_many, args=(str(buf / "entries"), p, PER_PROC)) for p in range(PROCS)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    elapsed = time.monotonic() - t0
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    names = entry_names(buf)
    assert len(names) == PROCS * PER_PROC
    assert len(set(names)) == len(names)
    assert get_stats(buf)["entries"] == PROCS * PER_PROC
    # FIFO order per writer is its own insertion order
    for p in range(PROCS):
        mine = [n for n in names if n.startswith(f"p{p}-")]
        assert mine == [f"p{p}-{i:04d}" for i in range(PER_PROC)]
    bad = []
    for name in names:
        data = read_entry(buf, name)
        i = int(name.split("-")[1])
        if len(data) != SIZE - (i % 7) * 100 or not verify_payload(data, name):
            bad.append(name)
    assert bad == []
    seqs = [int(xattr(buf / "entries" / n, "seq")) for n in names[:50]]
    assert seqs == sorted(seqs)
    print(f"{PROCS * PER_PROC} inserts of ~{SIZE} bytes in {elapsed:.2f}s")


# ----- eviction ----------------------------------------------------------------------

def test_eviction_by_capacity(buf):
    set_config(buf, {"capacity": 5})
    for i in range(8):
        write_entry(buf, f"e{i}", b"%d" % i * 10)
    assert entry_names(buf) == [f"e{i}" for i in range(3, 8)]
    for i in range(3):
        assert_errno(errno.ENOENT, read_entry, buf, f"e{i}")
    for i in range(3, 8):
        assert read_entry(buf, f"e{i}") == b"%d" % i * 10
    stats = get_stats(buf)
    assert stats["entries"] == 5 and stats["evictions"] == 3
    # a rewrite does not evict anything
    write_entry(buf, "e3", b"rewritten")
    assert entry_names(buf) == [f"e{i}" for i in range(3, 8)]
    # shrinking the capacity evicts the oldest at once
    set_config(buf, {"capacity": 2})
    assert entry_names(buf) == ["e6", "e7"]
    assert get_stats(buf)["entries"] == 2


def test_eviction_by_max_bytes(buf):
    set_config(buf, {"max_bytes": 10_000, "compression": "none"})
    for i in range(6):
        write_entry(buf, f"m{i}", bytes([i]) * 3000)
        assert get_stats(buf)["bytes"] <= 10_000
    assert entry_names(buf) == ["m3", "m4", "m5"]
    assert get_stats(buf)["bytes"] == 9000
    # one big entry pushes out several small ones
    write_entry(buf, "big", b"B" * 8000)
    assert entry_names(buf) == ["big"]
    assert read_entry(buf, "big") == b"B" * 8000
    # an entry larger than max_bytes itself is refused: EFBIG at write() or at close()
    f = open(buf / "entries" / "huge", "wb", buffering=0)

    def write_and_close():
        try:
            f.write(b"H" * 10_001)
        finally:
            f.close()

    assert_errno(errno.EFBIG, write_and_close)
    assert "huge" not in entry_names(buf)
    assert entry_names(buf) == ["big"]
    assert read_entry(buf, "big") == b"B" * 8000


def test_invalid_names(buf):
    long_name = "n" * 256
    for fn in (lambda: write_entry(buf, long_name, b"x"),
               lambda: os.stat(buf / "entries" / long_name),
               lambda: os.mkdir(buf.parent / long_name)):
        assert_errno((errno.ENAMETOOLONG, errno.EINVAL), fn)
    very_long = "n" * 2000
    assert_errno((errno.ENAMETOOLONG, errno.EINVAL), write_entry, buf, very_long, b"x")
    # exactly 255 bytes (multi-byte UTF-8 counts in bytes) is fine
    ok = "é" * 127 + "x"
    assert len(ok.encode()) == 255
    write_entry(buf, ok, b"ok")
    assert read_entry(buf, ok) == b"ok"
    too_long = "é" * 128
    assert_errno((errno.ENAMETOOLONG, errno.EINVAL), write_entry, buf, too_long, b"x")
    # names the kernel refuses itself
    assert_errno((errno.EISDIR, errno.EEXIST, errno.EINVAL, errno.ENOENT), write_entry, buf, ".", b"x")
    assert_errno((errno.EISDIR, errno.EEXIST, errno.EINVAL, errno.ENOTEMPTY, errno.EBUSY),
                 os.rmdir, buf / "entries" / "..")
    assert entry_names(buf) == [ok]
    assert get_stats(buf)["entries"] == 1


def test_a_path_call_right_after_reading_a_rewritten_entry_finds_the_entry(buf):
    """A writer keeps its descriptor and commits with the close of a duplicate, reading the
    entry back after each commit, then truncates it by path. A read that reaches the version
    its own commit just replaced (the kernel's name not yet invalidated) is sent, with
    ESTALE, to an inode of its own, and that redirect used to hold for the process's lookups
    of the name for 2 s: the truncate(path) got that inode, which has no value of its own,
    and failed with ENOENT (in 4 of 30 rounds here). The reader's open now ends it."""
    for k in range(30):
        path = buf / "entries" / f"kept{k}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"first")
            os.close(os.dup(fd))
            assert read_entry(buf, f"kept{k}") == b"first"
            os.write(fd, b"+more")
            os.close(os.dup(fd))
            assert read_entry(buf, f"kept{k}") == b"first+more"
            os.ftruncate(fd, 3)
            os.close(os.dup(fd))
            assert read_entry(buf, f"kept{k}") == b"fir"
            os.truncate(path, 2)
        finally:
            os.close(fd)
        assert read_entry(buf, f"kept{k}") == b"fi"

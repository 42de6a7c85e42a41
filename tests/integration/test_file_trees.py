"""The general file trees (weights/, a checkpoint step, an unsealed dataset's items/) keep
the POSIX promises issue 14 found broken, one test per bug, each through a real mount and
ordinary file APIs and tools, on every tree the bug was seen in."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from distorefs_it import assert_errno, xattr

_n = itertools.count()
TREES = ["weights", "checkpoint", "dataset"]


def make_tree(mnt, kind: str):
    """A fresh directory of the tree `kind` to work in."""
    n = next(_n)
    if kind == "weights":
        d = mnt / "weights" / f"ft{n}"
        d.mkdir()
    elif kind == "checkpoint":
        d = mnt / "checkpoints" / f"ftrun{n}" / "step"
        d.mkdir(parents=True)
    else:
        (mnt / "datasets" / f"ft{n}").mkdir()
        d = mnt / "datasets" / f"ft{n}" / "items"
    return d


@pytest.fixture(params=TREES)
def tree(fs, request):
    return make_tree(fs.mnt, request.param)


@pytest.fixture
def wtree(fs):
    return make_tree(fs.mnt, "weights")


# ----- data loss and visibility -----------------------------------------------------------

def test_output_of_a_process_that_exits_without_close_is_kept(tree):
    subprocess.run(f'{sys.executable} -c "print(1)" > {tree}/x', shell=True, check=True)
    assert (tree / "x").read_bytes() == b"1\n"


def test_a_rewrite_that_keeps_the_mtime_is_read_back(tree):
    """A file rewritten with its timestamps set back before close (tar, rsync -t, the
    model test's writer): a reader gets the new bytes, not a copy of the old version kept
    in memory under the same timestamps."""
    p = tree / "t"

    def write(data: bytes) -> None:
        fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.utime(fd, ns=(10**9, 10**9))
        finally:
            os.close(fd)
    write(b"\x02" * 1000)
    assert p.read_bytes() == b"\x02" * 1000
    write(b"\x01" * 500)
    assert p.read_bytes() == b"\x01" * 500
    assert os.stat(p).st_mtime_ns == 10**9


def test_an_empty_file_is_listed_and_openable_right_after_close(tree):
    for i in range(50):  # it used to appear a moment after close(): a race, so many tries
        p = tree / f"empty{i}"
        open(p, "wb").close()
        assert p.name in os.listdir(tree)
        with open(p, "wb") as f:  # a just-created empty file opens for writing again
            f.write(b"")
    sub = tree / "sub"
    sub.mkdir()
    for i in range(10):
        open(sub / f"e{i}", "wb").close()
    shutil.rmtree(sub)
    assert not sub.exists()


# ----- metadata -------------------------------------------------------------------------

def test_utimes_and_touch_d_set_times(tree):
    p = tree / "f"
    p.write_bytes(b"abc")
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(p)
    assert st.st_mtime_ns == 2_000_000_000 and st.st_atime_ns == 1_000_000_000
    subprocess.run(["touch", "-d", "2001-02-03 04:05:06 UTC", str(p)], check=True)
    assert time.gmtime(os.stat(p).st_mtime)[:6] == (2001, 2, 3, 4, 5, 6)


def test_attributes_set_before_the_first_close_are_kept(tree, tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"payload")
    os.chmod(src, 0o640)
    os.utime(src, ns=(3_000_000_000, 4_000_000_000))
    shutil.copy2(src, tree / "copy")  # write, then fchmod... by path after close
    fd = os.open(tree / "fd", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"x")
    os.fchmod(fd, 0o600)
    os.utime(fd, ns=(5_000_000_000, 6_000_000_000))
    os.fchown(fd, 1234, 5678)
    os.close(fd)
    st = os.stat(tree / "fd")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime_ns == 6_000_000_000
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    st = os.stat(tree / "copy")
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_mtime_ns == 4_000_000_000


def test_cp_a_and_rsync_a_keep_modes_and_times(tree, tmp_path):
    src = tmp_path / "tree"
    (src / "d").mkdir(parents=True)
    for i, mode in enumerate((0o600, 0o644, 0o755)):
        p = src / "d" / f"f{i}"
        p.write_bytes(os.urandom(1000 + i))
        os.chmod(p, mode)
        os.utime(p, ns=(1_500_000_000_000_000_000 + i, 1_500_000_000_000_000_000 + i))
    for tool, dest in ((["cp", "-a"], tree / "cp"), (["rsync", "-a"], tree / "rsync")):
        subprocess.run(tool + [f"{src}/", str(dest)], check=True, capture_output=True)
        for i in range(3):
            a, b = os.stat(src / "d" / f"f{i}"), os.stat(dest / "d" / f"f{i}")
            assert (stat.S_IMODE(a.st_mode), a.st_mtime_ns) == (stat.S_IMODE(b.st_mode), b.st_mtime_ns), tool
            assert (src / "d" / f"f{i}").read_bytes() == (dest / "d" / f"f{i}").read_bytes()


def test_directory_times_and_link_counts_follow_their_entries(tree):
    d = tree / "dir"
    d.mkdir()
    before = os.stat(d)
    time.sleep(0.01)
    (d / "f").write_bytes(b"x")
    after = os.stat(d)
    assert after.st_mtime_ns > before.st_mtime_ns and after.st_ctime_ns > before.st_ctime_ns
    assert os.stat(d).st_nlink == 2
    (d / "a").mkdir()
    (d / "b").mkdir()
    assert os.stat(d).st_nlink == 4
    os.rmdir(d / "a")
    assert os.stat(d).st_nlink == 3


def test_chown_h_changes_a_symlink(wtree):
    os.symlink("target", wtree / "link")
    os.lchown(wtree / "link", 4321, 8765)
    st = os.lstat(wtree / "link")
    assert (st.st_uid, st.st_gid) == (4321, 8765)


# ----- errors ---------------------------------------------------------------------------

def test_truncate_by_path(tree):
    p = tree / "t"
    p.write_bytes(b"0123456789")
    os.truncate(p, 4)
    assert p.read_bytes() == b"0123"
    os.truncate(p, 8)
    assert p.read_bytes() == b"0123\0\0\0\0"


def test_names_over_255_bytes_are_enametoolong(tree):
    long = "n" * 256
    assert_errno(errno.ENAMETOOLONG, open, tree / long, "wb")
    assert_errno(errno.ENAMETOOLONG, os.stat, tree / long)
    assert_errno(errno.ENAMETOOLONG, os.mkdir, tree / long)
    (tree / "ok").write_bytes(b"x")
    assert_errno(errno.ENAMETOOLONG, os.rename, tree / "ok", tree / long)


def test_special_files_and_hard_links_are_eperm(tree):
    assert_errno(errno.EPERM, os.mkfifo, tree / "fifo")
    assert_errno(errno.EPERM, os.mknod, tree / "node", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    (tree / "f").write_bytes(b"x")
    assert_errno(errno.EPERM, os.link, tree / "f", tree / "hard")


def test_unknown_distorefs_xattrs_are_enotsup(tree):
    (tree / "f").write_bytes(b"x")
    assert_errno(errno.ENOTSUP, os.setxattr, tree / "f", "user.distorefs.bogus", b"1")


# ----- open files -----------------------------------------------------------------------

def test_inode_is_stable_across_a_publish(tree):
    p = tree / "f"
    with open(p, "wb") as f:
        f.write(b"one")
        f.flush()
        os.fsync(f.fileno())
        ino = os.fstat(f.fileno()).st_ino
        assert os.stat(p).st_ino == ino
        f.write(b"two")
    assert os.stat(p).st_ino == ino
    with open(p, "r+b") as f:
        f.write(b"X")
    assert os.stat(p).st_ino == ino


def test_inode_numbers_survive_the_kernel_forgetting_them(tree):
    """The kernel forgets inodes nobody holds whenever it likes (here: made to, by dropping
    the dentry and inode caches, as memory pressure does); a file's st_ino is its number for
    its whole life all the same (pjdfstest rename/09 compares it across renames)."""
    (tree / "d").mkdir()
    with open(tree / "d" / "f", "wb") as f:
        f.write(b"x")
        created = os.fstat(f.fileno()).st_ino  # a file's number from its create on
    os.symlink("d/f", tree / "l")
    before = {n: os.lstat(tree / n).st_ino for n in ("d", "d/f", "l")}
    assert before["d/f"] == created
    os.rename(tree / "d" / "f", tree / "d" / "g")
    before["d/g"] = before.pop("d/f")
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")  # dentries and inodes only (no page cache): every unused one is forgotten
    assert {n: os.lstat(tree / n).st_ino for n in before} == before


def test_sqlite_database_round_trips(tree):
    db = tree / "t.db"
    con = sqlite3.connect(db)
    con.execute("create table t (k integer primary key, v text)")
    for i in range(3):
        with con:
            con.executemany("insert into t (v) values (?)", [(f"row{i}-{j}",) for j in range(100)])
    con.close()
    con = sqlite3.connect(db)
    assert con.execute("select count(*) from t").fetchone()[0] == 300
    con.close()


def test_fstat_and_seek_end_see_the_size_being_written(tree):
    p = tree / "f"
    p.write_bytes(b"0123456789")
    with open(p, "r+b") as f:
        f.seek(20)
        f.write(b"end")
        f.flush()
        assert os.fstat(f.fileno()).st_size == 23
        assert f.seek(0, os.SEEK_END) == 23
    with open(p, "ab") as f:
        f.write(b"more")
        f.flush()
        assert os.fstat(f.fileno()).st_size == 27


def test_unlink_of_an_open_file(tree):
    p = tree / "f"
    p.write_bytes(b"content" * 1000)
    r = open(p, "rb")
    w = open(tree / "w", "wb")
    w.write(b"written")
    w.flush()
    os.unlink(p)
    os.unlink(tree / "w")
    assert r.read() == b"content" * 1000  # reads of a removed file go on
    assert os.fstat(r.fileno()).st_nlink == 0
    w.close()
    r.close()
    time.sleep(0.2)
    assert sorted(os.listdir(tree)) == []  # the removed writer does not come back at close
    with tempfile.TemporaryFile(dir=tree) as t:
        t.write(b"temp" * 10000)
        t.seek(0)
        assert t.read() == b"temp" * 10000
    assert os.listdir(tree) == []


def test_shared_mmap_of_a_file_open_for_writing(tree):
    p = tree / "m"
    p.write_bytes(bytes(8192))
    with open(p, "r+b") as f:
        m = mmap.mmap(f.fileno(), 8192)
        m[100:105] = b"hello"
        m.flush()
        m.close()
    assert p.read_bytes()[100:105] == b"hello"


# ----- versions (weights) ---------------------------------------------------------------

def test_safetensors_saves_are_versions_and_wait_sees_them(fs, wtree):
    import safetensors.numpy as st
    p = wtree / "m.safetensors"
    for i in range(3):
        st.save_file({"w": np.full((16,), i, np.float32)}, str(p))
        assert xattr(p, "version") == str(i + 1)  # at once, without listing the directory
    rel = f"{wtree.name}/m.safetensors"
    with open(fs.mnt / ".distorefs" / "wait", "r+b", buffering=0) as w:
        w.write(f"{rel} 2\n".encode())
        assert int(w.read()) == 3
    assert st.load_file(str(p))["w"][0] == 2


# ----- rewrites ---------------------------------------------------------------------------

def test_holes_stay_holes_and_files_have_a_size_bound(fs, wtree):
    p = wtree / "sparse"
    with open(p, "wb") as f:
        f.truncate(1 << 30)
        f.seek(5 << 20)
        f.write(b"x")
    assert os.stat(p).st_size == 1 << 30
    assert int(xattr(p, "stored_size")) <= 4 << 20  # one chunk written: the holes took nothing
    with open(p, "rb") as f:
        f.seek(5 << 20)
        assert f.read(2) == b"x\0"
    with open(p, "r+b") as f:
        assert_errno(errno.EFBIG, f.truncate, 1 << 41)


def test_a_write_past_the_size_bound_fails_alone(tree):
    """EFBIG fails that write only: the file created and what was written before stay, as on a
    local filesystem (pjdfstest open/25: an unsealed dataset lost the whole file)."""
    p = tree / "bounded"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"kept")
        assert_errno(errno.EFBIG, os.pwrite, fd, b"a", 1 << 50)
    finally:
        os.close(fd)
    assert p.read_bytes() == b"kept"


# ----- whole-mount tools --------------------------------------------------------------------

def test_tar_of_the_whole_mount(fresh_mount, tmp_path):
    m = fresh_mount()
    for kind in TREES:
        (make_tree(m.mnt, kind) / "f").write_bytes(b"x" * 1000)
    buf = m.buffer("b")
    (buf / "entries" / "e").write_bytes(b"entry")
    res = subprocess.run(["tar", "cf", str(tmp_path / "all.tar"), "-C", str(m.mnt), "."],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_a_sparse_file_stores_next_to_nothing_in_every_tree(tree):
    """Writes are staged sparsely (a draft on disk, or the checkpoints' chunks): a file of
    200 MiB with one byte written stores about one chunk, and reads back zeros around it."""
    p = tree / "sparse"
    with open(p, "wb") as f:
        f.truncate(200 << 20)
        f.seek(100 << 20)
        f.write(b"x")
    deadline = time.time() + 10
    while "memory" in os.getxattr(p, "user.distorefs.tier").decode() and time.time() < deadline:
        time.sleep(0.1)  # a checkpoint file is stored behind close()
    assert os.stat(p).st_size == 200 << 20
    assert int(xattr(p, "stored_size")) <= 8 << 20
    with open(p, "rb") as f:
        f.seek((100 << 20) - 1)
        assert f.read(3) == b"\0x\0"


def test_a_file_grown_past_its_last_chunk_reads_back(tree):
    """Appending far past a short last chunk keeps every chunk but the last whole."""
    p = tree / "grow"
    p.write_bytes(b"head")
    with open(p, "r+b") as f:
        f.seek(9 << 20)
        f.write(b"tail")
    with open(p, "ab") as f:
        f.write(b"more")
    data = p.read_bytes()
    assert data[:4] == b"head" and data[9 << 20:] == b"tailmore" and data.count(0) == (9 << 20) - 4

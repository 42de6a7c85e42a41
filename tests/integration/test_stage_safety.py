"""`distorefs stage` against hostile sources (issue 15): the daemon reads sources with the
rights of the user who asked, never follows a link out of the source tree, keeps the
source's modes and owners, refuses FIFOs and devices, bounds every read, refuses list
entries outside the list's directory; a rerun on a sealed dataset compares, and a
destination that is not MNT/datasets/NAME is named as the mistake."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from distorefs.tools.stage import stage as stage_in_process  # imported here: the child as another user cannot
from distorefs_it import CLI, ChildFailed, in_child_as, xattr


def stage(src, dest, *extra, check=False):
    return subprocess.run(CLI + ["stage", "-q", str(src), str(dest), *extra], capture_output=True, text=True,
                          check=check, timeout=300)


def _stage_as_user(src: str, dest: str) -> dict:
    """In the child (already the other user): stage and report what happened."""
    report = stage_in_process(src, dest, progress=False)
    return {"ok": report.ok, "errors": report.errors, "sealed": report.sealed}


def test_stage_reads_sources_with_the_rights_of_the_user_who_asked(shared_mount, temp_user):
    name, uid, gid = temp_user
    m = shared_mount()
    src = m.root / "src"
    src.mkdir()
    os.chown(src, uid, gid)
    (src / "mine.txt").write_bytes(b"the user's own data")
    os.chown(src / "mine.txt", uid, gid)
    (src / "secret.txt").write_bytes(b"root's secret")  # in the user's directory, but 0600 root's
    os.chmod(src / "secret.txt", 0o600)
    ds = m.mnt / "datasets" / "theirs"
    ds.mkdir()
    os.chown(ds, uid, gid)  # the dataset is the user's: its .stage is theirs to open
    assert os.stat(ds).st_uid == uid
    os.chmod(ds, 0o750)
    assert stat.S_IMODE(os.stat(ds).st_mode) == 0o750
    report = in_child_as(uid, gid, _stage_as_user, str(src), str(ds))
    assert report["ok"] == 1 and not report["sealed"], report
    assert len(report["errors"]) == 1 and "secret.txt" in report["errors"][0], report
    assert "Permission denied" in report["errors"][0], report
    assert (ds / "items" / "mine.txt").read_bytes() == b"the user's own data"
    assert not (ds / "items" / "secret.txt").exists()
    assert os.stat(ds / "items" / "mine.txt").st_uid == uid  # staged by the user: the user's item


def test_stage_does_not_follow_symlinks_out_of_the_source_tree(fresh_mount, tmp_path):
    m = fresh_mount()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"TOP SECRET")
    os.chmod(outside / "secret.txt", 0o600)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"plain a")
    os.symlink("a.txt", src / "inner-link")  # stays inside: staged as the file it names
    os.symlink("../a.txt", src / "sub" / "up-link")  # up, but still inside the tree
    os.symlink("../outside/secret.txt", src / "b.txt")  # a relative link out
    os.symlink(str(outside / "secret.txt"), src / "abs-link")  # an absolute link out
    ds = m.mnt / "datasets" / "links"
    out = stage(src, ds)
    assert out.returncode == 1, out
    assert "b.txt" in out.stderr and "abs-link" in out.stderr and "outside the source tree" in out.stderr, out.stderr
    items = ds / "items"
    assert (items / "a.txt").read_bytes() == b"plain a"
    assert (items / "inner-link").read_bytes() == b"plain a"
    assert (items / "sub" / "up-link").read_bytes() == b"plain a"
    assert not (items / "b.txt").exists() and not (items / "abs-link").exists()
    assert xattr(ds, "state") == "open"  # a stage with errors is not sealed
    found = subprocess.run(["grep", "-r", "TOP SECRET", str(items)], capture_output=True)
    assert found.returncode == 1, found.stdout
    # opting in follows every link
    ds2 = m.mnt / "datasets" / "followed"
    out = stage(src, ds2, "--follow-symlinks")
    assert out.returncode == 0, out
    assert (ds2 / "items" / "b.txt").read_bytes() == b"TOP SECRET"


def test_staged_items_keep_the_source_modes_and_owners(shared_mount, temp_user):
    name, uid, gid = temp_user
    m = shared_mount()
    src = m.root / "tree"
    (src / "private").mkdir(parents=True)
    os.chmod(src / "private", 0o700)
    (src / "private" / "p.txt").write_bytes(b"private")
    os.chmod(src / "private" / "p.txt", 0o600)
    (src / "pub.txt").write_bytes(b"public")
    os.chmod(src / "pub.txt", 0o644)
    (src / "run.sh").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o750)
    for p in (src / "private", src / "private" / "p.txt", src / "pub.txt", src / "run.sh"):
        os.chown(p, uid, gid)
    ds = m.mnt / "datasets" / "modes"
    out = stage(src, ds)
    assert out.returncode == 0, out
    items = ds / "items"

    def mode_owner(p: Path) -> tuple[int, int, int]:
        st = os.stat(p)
        return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid

    assert mode_owner(items / "private") == (0o700, uid, gid)
    assert mode_owner(items / "private" / "p.txt") == (0o600, uid, gid)
    assert mode_owner(items / "pub.txt") == (0o644, uid, gid)
    assert mode_owner(items / "run.sh") == (0o750, uid, gid)
    # so the owner reads the private file through the mount, and nobody else may
    assert in_child_as(uid, gid, lambda: (items / "private" / "p.txt").read_text()) == "private"


def test_a_list_naming_files_outside_its_directory_is_refused(fresh_mount, tmp_path):
    m = fresh_mount()
    lists = tmp_path / "lists"
    lists.mkdir()
    (lists / "a.txt").write_bytes(b"listed a")
    (tmp_path / "outside.txt").write_bytes(b"not for the list")
    listing = lists / "files.txt"
    listing.write_text("a.txt\n../outside.txt\n")
    ds = m.mnt / "datasets" / "listed"
    out = stage(listing, ds)
    assert out.returncode != 0, out
    assert "../outside.txt" in out.stderr and "--allow-outside" in out.stderr, out.stderr
    assert not ds.exists()  # refused before anything was made
    out = stage(listing, ds, "--allow-outside")
    assert out.returncode == 0, out
    assert sorted(p.name for p in (ds / "items").rglob("*") if p.is_file()) == ["a.txt", "outside.txt"]


def _stage_requests(ds: Path, requests: list[dict]) -> list[list[str]]:
    fd = os.open(ds / ".stage", os.O_RDWR)
    try:
        os.write(fd, b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        results = b""
        while chunk := os.pread(fd, 1 << 20, len(results)):
            results += chunk
    finally:
        os.close(fd)
    return [line.split("\t") for line in results.decode().splitlines()]


def test_stage_refuses_fifos_and_devices_and_reads_only_what_fstat_says(fresh_mount, tmp_path):
    m = fresh_mount()
    ds = m.mnt / "datasets" / "hostile"
    ds.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    answer: list = []
    t = threading.Thread(target=lambda: answer.append(_stage_requests(ds, [{"src": str(fifo), "path": "f"}])),
                         daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # the daemon's worker is stuck opening the FIFO: let it go, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(20)
        pytest.fail("staging a FIFO blocked the daemon")
    assert answer[0][0][0] == "error" and "FIFO" in answer[0][0][3], answer
    zero = _stage_requests(ds, [{"src": "/dev/zero", "path": "z", "size": 0}])
    assert zero[0][0] == "error" and "character device" in zero[0][3], zero
    # a request that lies about the size: the source's own size counts, read whole
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(12 << 20))  # over the size read in one piece: streamed
    small = tmp_path / "small.bin"
    small.write_bytes(b"s" * 5000)
    results = _stage_requests(ds, [{"src": str(big), "path": "big.bin", "size": 10},
                                   {"src": str(small), "path": "small.bin", "size": 1 << 30},
                                   {"src": "relative/path", "path": "rel"}])
    assert [r[0] for r in results] == ["error", "ok", "ok"] or sorted(r[0] for r in results) == \
        ["error", "ok", "ok"], results
    assert (ds / "items" / "big.bin").read_bytes() == big.read_bytes()
    assert (ds / "items" / "small.bin").read_bytes() == small.read_bytes()
    assert m.alive()
    # the tool reports special files of a tree instead of skipping them without a word
    src = tmp_path / "tree"
    src.mkdir()
    (src / "ok.txt").write_bytes(b"ok")
    os.mkfifo(src / "pipe")
    out = stage(src, m.mnt / "datasets" / "withfifo")
    assert out.returncode == 1 and "pipe" in out.stderr and "not a regular file" in out.stderr, out


def test_restage_of_a_sealed_dataset_and_a_wrong_destination(fresh_mount, tmp_path):
    m = fresh_mount()
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(5):
        (src / "d" / f"f{i}").write_bytes(b"x" * (100 * i))
    ds = m.mnt / "datasets" / "again"
    assert stage(src, ds).returncode == 0
    out = stage(src, ds)  # a job script that stages at every start
    assert out.returncode == 0 and "already staged, identical" in out.stdout, out
    (src / "d" / "f1").write_bytes(b"changed")
    out = stage(src, ds)
    assert out.returncode == 1 and "does not match" in out.stderr and "f1" in out.stderr, out
    # a destination that is not MNT/datasets/NAME: named, and nothing is made there
    for wrong in (tmp_path / "plain" / "x", m.mnt / "weights" / "x", m.mnt / "datasets"):
        out = stage(src, wrong)
        assert out.returncode != 0 and "MNT/datasets/NAME" in out.stderr, (wrong, out)
    assert not (tmp_path / "plain").exists()
    assert not (m.mnt / "weights" / "x").exists() and not (m.mnt / "datasets" / ".stage").exists()


def test_a_user_without_rights_on_the_dataset_cannot_stage(shared_mount, temp_user):
    name, uid, gid = temp_user
    m = shared_mount()
    ds = m.mnt / "datasets" / "roots"
    ds.mkdir()
    with pytest.raises(ChildFailed) as info:
        in_child_as(uid, gid, lambda: os.close(os.open(ds / ".stage", os.O_RDWR)))
    assert info.value.errno == errno.EACCES

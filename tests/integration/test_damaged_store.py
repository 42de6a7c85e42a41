"""Damaged stores (issue 15): verify names damaged LMDB pages and exits 4 without a
traceback, its --repair changes nothing on such a store (which stays mountable), and a
truncated data.mdb is refused with a message instead of a SIGBUS of verify or the daemon."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from distorefs_it import CLI, entry_names, make_payload, write_entry


def verify(store, *extra):
    return subprocess.run(CLI + ["verify", "--json", *extra, str(store)], capture_output=True, text=True,
                          timeout=300)


def _filled(fresh_mount, n=400):
    m = fresh_mount()
    b = m.buffer("b", {"compression": "none"})
    for i in range(n):
        write_entry(b, f"e{i:04d}", make_payload(f"e{i:04d}", 3000, seed=i))
    m.umount()
    return m, b


def test_verify_names_damaged_lmdb_pages_and_repair_leaves_the_store_as_it_was(fresh_mount):
    m, b = _filled(fresh_mount)
    data = m.store / "meta" / "data.mdb"
    psize = 4096
    pages = data.stat().st_size // psize
    rng = random.Random(7)
    with open(data, "r+b") as f:  # garbage over a few pages of the B-trees (not the meta pages)
        for page in rng.sample(range(pages // 3, pages - 2), 4):
            f.seek(page * psize)
            f.write(rng.randbytes(psize))
    lock_before = (m.store / "lock").read_bytes()
    res = verify(m.store)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 4, (res.returncode, res.stderr[-2000:])
    report = json.loads(res.stdout)
    assert report["damaged"] and any("damaged" in f["message"] for f in report["findings"]), report["findings"][:3]
    res = verify(m.store, "--repair")
    assert "Traceback" not in res.stderr and res.returncode == 4, (res.returncode, res.stderr[-2000:])
    assert (m.store / "lock").read_bytes() == lock_before  # the clean mark as it was: no recovery forced
    m.mount()  # still mountable: what is readable is served
    names = entry_names(b)
    assert names, "nothing readable"
    assert m.alive()
    m.umount()


@pytest.mark.parametrize("keep", [0.5, 0.05])
def test_a_truncated_data_mdb_is_refused_with_a_reason(fresh_mount, keep):
    m, b = _filled(fresh_mount)
    data = m.store / "meta" / "data.mdb"
    os.truncate(data, int(data.stat().st_size * keep) // 4096 * 4096)
    res = verify(m.store)
    assert res.returncode == 8, (res.returncode, res.stderr)  # not -7 (SIGBUS): it could not run, and says why
    assert "truncated" in res.stderr or "damaged" in res.stderr, res.stderr
    res = subprocess.run(CLI + ["mount", str(m.store), str(m.mnt)], capture_output=True, text=True, timeout=90)
    assert res.returncode != 0 and ("truncated" in res.stderr or "damaged" in res.stderr), res
    assert "truncated" in m.log() or "damaged" in m.log()


def _sha(path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_read_only_mount_serves_a_store_and_changes_nothing(fresh_mount):
    import errno

    import numpy as np

    from distorefs_it import assert_errno, get_stats, read_entry, set_config
    m = fresh_mount()
    b = m.buffer("ro", {"compression": "none"})
    set_config(b, {"max_times_sampled": 1})  # a read-write draw would remove what it drew
    arrays = {f"e{i:02d}.npy": np.full((50,), i, np.int32) for i in range(20)}
    for name, a in arrays.items():
        with open(b / "entries" / name, "wb") as f:
            np.save(f, a)
    (m.mnt / "weights" / "policy").mkdir()
    weights = os.urandom(300_000)
    (m.mnt / "weights" / "policy" / "w.bin").write_bytes(weights)
    (m.mnt / "checkpoints" / "run" / "step-1").mkdir(parents=True)
    (m.mnt / "checkpoints" / "run" / "step-1" / "model.pt").write_bytes(weights[:5000])
    for name, sealed in (("frozen", True), ("open", False)):
        (m.mnt / "datasets" / name).mkdir()
        (m.mnt / "datasets" / name / "items" / "a.bin").write_bytes(name.encode() * 100)
        if sealed:
            os.setxattr(m.mnt / "datasets" / name, "user.distorefs.sealed", b"1")
    m.umount()
    data, lock = m.store / "meta" / "data.mdb", m.store / "lock"
    before = _sha(data)
    scratch = m.store / "spool" / "draft-left-by-a-crash"
    scratch.write_bytes(b"x")  # a read-write open removes such files; a read-only one must not
    m.mount(flags=("--read-only",))
    assert "read-only" in lock.read_text()
    assert sorted(entry_names(b)) == sorted(arrays)
    for name, a in arrays.items():
        assert np.load(b / "entries" / name).tobytes() == a.tobytes()
    for _ in range(5):  # draws work, and spend nothing
        with np.load(b / "batch" / "4.npz") as z:
            assert [int(r[0]) for r in z["data"]] == [int(k[1:3]) for k in z["keys"]]
    assert get_stats(b)["entries"] == 20
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["read_only"] is True
    assert_errno(errno.EROFS, open, b / "entries" / "new.npy", "wb")
    assert_errno(errno.EROFS, os.mkdir, m.mnt / "buffers" / "another")
    assert_errno(errno.EROFS, os.unlink, b / "entries" / "e00.npy")
    assert_errno(errno.EROFS, os.setxattr, b / "entries" / "e01.npy", "user.distorefs.priority", b"2")
    assert_errno(errno.EROFS, open, b / "priorities", "w")
    assert (m.mnt / "weights" / "policy" / "w.bin").read_bytes() == weights
    assert (m.mnt / "checkpoints" / "run" / "step-1" / "model.pt").read_bytes() == weights[:5000]
    for name in ("frozen", "open"):
        assert (m.mnt / "datasets" / name / "items" / "a.bin").read_bytes() == name.encode() * 100
        assert_errno(errno.EROFS, open, m.mnt / "datasets" / name / "items" / "b.bin", "wb")
    assert_errno(errno.EROFS, open, m.mnt / "weights" / "policy" / "w.bin", "r+b")
    assert_errno(errno.EROFS, os.mkdir, m.mnt / "checkpoints" / "run" / "step-2")
    assert m.alive()
    m.umount()
    assert scratch.exists()
    assert _sha(data) == before  # not a byte of the catalog changed
    assert lock.read_text() == ""  # clean as it was found
    m.mount(flags=("-o", "ro"))  # mount(8)'s way of saying it
    assert_errno(errno.EROFS, open, b / "entries" / "new.npy", "wb")
    m.umount()
    m.mount()
    assert get_stats(b)["entries"] == 20 and read_entry(b, "e05.npy")


def test_a_store_recovery_refuses_is_served_read_only(fresh_mount):
    m = fresh_mount()
    b = m.buffer("b", {"compression": "none"})
    payloads = {f"e{i:04d}": make_payload(f"e{i:04d}", 3000, seed=i) for i in range(400)}
    for key, data in payloads.items():
        write_entry(b, key, data)
    m.kill9()  # not closed cleanly: the next mount recovers
    m.lazy_umount()
    m.pid = None
    data = m.store / "meta" / "data.mdb"
    psize = 4096
    pages = data.stat().st_size // psize
    rng = random.Random(7)
    with open(data, "r+b") as f:
        for page in rng.sample(range(pages // 3, pages - 2), 4):
            f.seek(page * psize)
            f.write(rng.randbytes(psize))
    marker = (m.store / "lock").read_text()
    assert marker
    res = subprocess.run(CLI + ["mount", str(m.store), str(m.mnt)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "--read-only" in res.stderr, (res.returncode, res.stderr)
    assert (m.store / "lock").read_text() == marker
    m.mount(flags=("--read-only",))
    names = entry_names(b)
    assert names, "nothing readable"
    good = bad = 0
    for name in names:
        try:
            with open(b / "entries" / name, "rb") as f:
                got = f.read()
        except OSError as exc:
            assert exc.errno in (5, 2), exc  # a damaged value is EIO, never wrong bytes
            bad += 1
            continue
        assert got == payloads[name], name
        good += 1
    assert good > 0
    assert m.alive()
    m.umount()
    assert (m.store / "lock").read_text() == marker  # still to be recovered by a read-write mount

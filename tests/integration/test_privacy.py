"""What another user of an allow_other mount may see (issue 15): the files below a buffer
or bank follow the namespace's mode; sample/, batch/, index.npy and the stats files name
no namespace or item the reader may not list; chown/chmod of datasets/NAME work."""

from __future__ import annotations

import json
import os
import stat
import subprocess

from distorefs_it import CLI, as_user, write_entry


def _denied(res) -> bool:
    return res.returncode != 0 and "Permission denied" in res.stderr


def test_files_below_a_namespace_follow_its_mode(shared_mount, temp_user):
    user, uid, gid = temp_user
    m = shared_mount()
    buf = m.buffer("closed")
    write_entry(buf, "e1", b"one")
    bank = m.mnt / "banks" / "closedbank"
    bank.mkdir()
    write_entry(bank, "b1", b"bank one")
    for ns in (buf, bank):
        os.chmod(ns, 0o711)  # others may pass through, not list or read
    paths = [buf / "config.json", buf / "stats.json", buf / "priorities", buf / "client", buf / "sample" / "1",
             buf / "batch" / "1.npz", bank / "config.json", bank / "stats.json"]
    for p in paths:
        assert _denied(as_user(user, "cat", str(p))), p
    assert _denied(as_user(user, "ls", str(bank / "at")))
    assert stat.S_IMODE(os.stat(buf / "stats.json").st_mode) == 0o400
    assert stat.S_IMODE(os.stat(buf / "config.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(buf / "client").st_mode) == 0o600  # a client's session: the owner's
    assert stat.S_IMODE(os.stat(buf / "sample").st_mode) == 0o511  # search, no listing
    # opened again, they follow the new mode
    os.chmod(buf, 0o755)
    res = as_user(user, "cat", str(buf / "stats.json"))
    assert res.returncode == 0 and json.loads(res.stdout)["entries"] == 1, res
    assert as_user(user, "cat", str(buf / "sample" / "1")).stdout.startswith("e1 ")


def test_stats_and_index_name_nothing_the_reader_may_not_list(shared_mount, temp_user, tmp_path):
    user, uid, gid = temp_user
    m = shared_mount()
    hidden = m.buffer("hidden-buffer-name")
    os.chmod(hidden, 0o700)
    write_entry(hidden, "hidden-entry", b"x")
    m.buffer("open-buffer-name")
    hidden_ds = m.mnt / "datasets" / "hidden-dataset-name"
    hidden_ds.mkdir()
    os.chmod(hidden_ds, 0o700)
    for name in ("stats.json", "metrics"):
        res = as_user(user, "cat", str(m.mnt / ".distorefs" / name))
        assert res.returncode == 0, res
        assert "open-buffer-name" in res.stdout, name
        assert "hidden-buffer-name" not in res.stdout and "hidden-dataset-name" not in res.stdout, name
    assert "hidden-buffer-name" in (m.mnt / ".distorefs" / "stats.json").read_text()  # root sees all
    # index.npy names every item: readable only by whoever may list every directory
    src = tmp_path / "src"
    (src / "private").mkdir(parents=True)
    (src / "private" / "secret-file-name").write_bytes(b"s")
    (src / "public.txt").write_bytes(b"p")
    os.chmod(src / "private", 0o700)
    (tmp_path / "src2").mkdir()
    (tmp_path / "src2" / "public.txt").write_bytes(b"p")
    for s, name in ((src, "mixed"), (tmp_path / "src2", "public")):
        out = subprocess.run(CLI + ["stage", "-q", str(s), str(m.mnt / "datasets" / name)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out
    res = as_user(user, "cat", str(m.mnt / "datasets" / "mixed" / "index.npy"))
    assert _denied(res) and "secret-file-name" not in res.stdout, res
    res = as_user(user, "sh", "-c", f"cat '{m.mnt}/datasets/public/index.npy' | grep -c public.txt")
    assert res.returncode == 0 and res.stdout.strip() == "1", res


def test_chown_and_chmod_of_a_dataset(fresh_mount, temp_user):
    user, uid, gid = temp_user
    m = fresh_mount()
    ds = m.mnt / "datasets" / "owned"
    ds.mkdir()
    os.chown(ds, uid, gid)
    os.chmod(ds, 0o700)
    st = os.stat(ds)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o700)
    assert os.stat(ds / "stats.json").st_uid == uid
    m.remount()
    st = os.stat(ds)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o700)  # kept in the store

"""The inspection and operation commands on real mounts: ls, inspect, stats (tables, JSON,
Prometheus), .distorefs/metrics, gc (through the daemon and offline), export, verify
(clean, corrupt, in use), and the mount.fuse.distorefs helper mount(8) runs."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import zlib

import numpy as np
import pytest

from distorefs_it import (CLI, PYTHON, Mount, as_user, fsync_dir, is_mounted, make_payload, npy, npz, reclaimed,
                          set_config, write_entry, xattr)


def cli(*args, check=True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(CLI) + [str(a) for a in args], capture_output=True, text=True, timeout=120)
    if check:
        assert res.returncode == 0, f"{args}: {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res




def test_ls_inspect_stats_metrics(fs, buf):
    set_config(buf, {"raw": True, "compress_hot": True})  # entries of several layouts, compressed in LMDB too
    write_entry(buf, "obs.npy", npy(np.zeros((84, 84, 4), np.uint8)))
    write_entry(buf, "step.npz", npz(obs=np.ones((3, 4), np.float32), action=np.arange(3, dtype=np.int16)))
    write_entry(buf, "raw", make_payload("raw", 3000))
    os.setxattr(buf / "entries" / "raw", "user.distorefs.priority", b"2.5")
    with open(buf / "sample" / "2", "rb") as f:
        f.read()

    rows = [json.loads(line) for line in cli("ls", buf, "--json").stdout.splitlines()]
    assert [r["name"] for r in rows] == ["obs.npy", "step.npz", "raw"]  # FIFO order
    by = {r["name"]: r for r in rows}
    assert by["obs.npy"]["tier"] == "lmdb" and by["obs.npy"]["ratio"] > 50  # zeros compress
    assert by["raw"]["priority"] == 2.5 and by["raw"]["seq"] == 3
    assert sum(r["times_sampled"] for r in rows) == 2
    table = cli("ls", buf).stdout
    assert re.search(r"^obs\.npy\s+27\.7 KiB\s+\S+ B\s+\d+\.\d\d\s+lmdb", table, re.M), table
    assert cli("ls", buf, "-n", "1", "--json").stdout.count("\n") == 1

    info = json.loads(cli("inspect", buf / "entries" / "step.npz", "--json").stdout)
    assert info["content"]["format"] == "npz"
    assert info["content"]["arrays"] == {"obs": {"dtype": "float32", "shape": [3, 4], "fortran_order": False},
                                         "action": {"dtype": "int16", "shape": [3], "fortran_order": False}}
    assert info["xattrs"]["checksum"] == xattr(buf / "entries" / "step.npz", "checksum")
    text = cli("inspect", buf / "entries" / "obs.npy").stdout
    assert "dtype uint8, shape (84, 84, 4)" in text and "times_sampled" in text

    text = cli("stats", fs.mnt).stdout
    assert "TIER" in text and "NAMESPACE" in text and f"buffers/{buf.name}" in text
    assert json.loads(cli("stats", buf, "--json").stdout)["entries"] == 3
    prom = cli("stats", fs.mnt, "--prometheus").stdout
    line = f'distorefs_namespace_entries{{kind="buffers",name="{buf.name}"}} 3'
    assert line in prom
    metrics = (fs.mnt / ".distorefs" / "metrics").read_text()
    assert line in metrics and "# TYPE distorefs_namespace_inserts_total counter" in metrics
    _check_exposition(metrics)
    with pytest.raises(OSError):
        open(fs.mnt / ".distorefs" / "metrics", "wb")


def _check_exposition(text: str) -> None:
    """Every line is a comment or `name{labels} value`, every family typed once, values numeric."""
    typed = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in typed and kind in ("counter", "gauge")
            typed.add(name)
        elif not line.startswith("#"):
            m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)', line)
            assert m, line
            assert m.group(1) in typed
            float(m.group(3).replace("+Inf", "inf"))


def test_export_gc_and_verify(fresh_mount, tmp_path):
    # No periodic sync during the test: its collection would free the segments before `gc` does.
    m = fresh_mount("segment_bytes=1048576", "sync_interval=600")
    b = m.buffer("ex", {"compression": "none"})
    data = {f"e{i}": make_payload(f"e{i}", 700 << 10 if i % 3 == 0 else 5000 + i, seed=i) for i in range(6)}
    for k, v in data.items():
        write_entry(b, k, v)
    os.setxattr(b / "entries" / "e2", "user.distorefs.priority", b"7")
    (m.mnt / "weights" / "model").mkdir()
    (m.mnt / "weights" / "model" / "w.bin").write_bytes(b"weights" * 1000)
    os.symlink("w.bin", m.mnt / "weights" / "model" / "latest")

    cli("export", b, tmp_path / "out", "-q")
    out = tmp_path / "out"
    assert sorted(os.listdir(out / "entries")) == sorted(data)
    assert not (out / "sample").exists() and not (out / "batch").exists()
    for k, v in data.items():
        assert (out / "entries" / k).read_bytes() == v
    manifest = json.loads((out / ".distorefs-export.json").read_text())
    files = [f for f in manifest["files"] if f["path"].startswith("entries/")]
    assert [f["path"] for f in files] == [f"entries/{k}" for k in data]  # FIFO order kept
    assert {f["path"]: f["priority"] for f in files}["entries/e2"] == "7"
    assert files[0]["checksum"] == f"crc32:{zlib.crc32(data['e0']):08x}"
    assert json.loads((out / "config.json").read_text())["compression"] == "none"
    cli("export", m.mnt / "weights", tmp_path / "w", "-q")
    assert (tmp_path / "w" / "model" / "w.bin").read_bytes() == b"weights" * 1000
    assert os.readlink(tmp_path / "w" / "model" / "latest") == "w.bin"
    assert cli("export", b, tmp_path / "out", check=False).returncode != 0  # not empty
    cli("export", m.mnt, tmp_path / "all", "-q")  # the whole mount: data, not control files
    assert not (tmp_path / "all" / ".distorefs").exists()
    assert (tmp_path / "all" / "buffers" / "ex" / "entries" / "e1").read_bytes() == data["e1"]

    # gc through the daemon: delete every value of the oldest segment files, collect now
    segs = lambda: sorted(p.name for p in (m.store / "segments").glob("seg-*.dat"))  # noqa: E731
    before = segs()
    for k in ("e0", "e3"):
        os.unlink(b / "entries" / k)
    res = cli("gc", m.mnt)
    assert "freed" in res.stdout and "daemon" in res.stdout
    assert json.loads((m.mnt / ".distorefs" / "gc").read_bytes())["segment_bytes_freed"] > 0
    assert len(segs()) < len(before)
    assert (b / "entries" / "e1").read_bytes() == data["e1"]

    # verify refuses a mounted store, then passes once it is unmounted
    res = cli("verify", m.store, check=False)
    assert res.returncode == 8 and "in use" in res.stderr
    m.umount()
    res = cli("verify", m.store, "--json", check=False)
    report = json.loads(res.stdout)
    assert res.returncode == 0 and report["problems"] == 0, res.stdout
    assert set(report["passes"]) >= {"values", "segments", "lmdb-space", "ring-entries", "weights-tree"}
    assert cli("gc", m.store).stdout.startswith(f"store {m.store.resolve()} (offline)")


def test_verify_reports_flipped_bytes_and_repair_keeps_data(fresh_mount):
    m = fresh_mount()
    b = m.buffer("c", {"compression": "none"})
    victim = bytearray(make_payload("victim", 600 << 10))
    marker = b"<<tools-victim>>"
    victim[4096:4096 + len(marker)] = marker
    write_entry(b, "victim", bytes(victim))
    write_entry(b, "ok", make_payload("ok", 600 << 10, seed=1))
    m.umount()
    seg = next(p for p in (m.store / "segments").glob("seg-*.dat") if marker in p.read_bytes())
    raw = bytearray(seg.read_bytes())
    at = raw.find(marker)
    raw[at] ^= 0xFF
    seg.write_bytes(bytes(raw))

    res = cli("verify", m.store, check=False)
    assert res.returncode == 4, res.stdout
    assert "buffers/c/entries/victim" in res.stdout and "ERROR" in res.stdout
    res = cli("verify", m.store, "--repair", "--json", check=False)
    assert res.returncode == 4  # a corrupt value is never "repaired" away
    m.mount()
    with pytest.raises(OSError):
        (b / "entries" / "victim").read_bytes()
    assert (b / "entries" / "ok").read_bytes() == make_payload("ok", 600 << 10, seed=1)
    os.unlink(b / "entries" / "victim")  # the way out: rm through the mount
    m.umount()
    assert cli("verify", m.store, check=False).returncode == 0


def test_mount_helper_as_mount8_calls_it(tmp_path):
    from distorefs.tools.mount_helper import parse
    args, fake = parse(["/s", "/m", "-o", "rw,nofail,_netdev,allow_other,x-systemd.automount,cache_bytes=1000",
                        "-t", "fuse.distorefs", "-n"])
    assert args == ["mount", "/s", "/m", "--allow-other", "-o", "cache_bytes=1000"] and not fake
    assert parse(["/s", "/m", "-f"])[1]
    assert parse(["/s", "/m", "-o", "ro,noatime"])[0] == ["mount", "/s", "/m", "--read-only"]  # fstab's ro
    for bad in (["/s", "/m", "-o", "bogus=1"], ["/s"]):
        with pytest.raises(SystemExit):
            parse(bad)

    m = Mount(tmp_path)
    helper = [PYTHON, "-m", "distorefs.tools.mount_helper"]
    try:
        res = subprocess.run(helper + [str(m.store), str(m.mnt), "-o", "rw,defaults,nofail,sync_interval=2.5,"
                                       "cache_bytes=33554432", "-t", "fuse.distorefs"],
                             capture_output=True, text=True, timeout=90)
        assert res.returncode == 0, res.stdout + res.stderr
        m.pid = int(re.search(r"daemon pid (\d+)", res.stdout).group(1))
        m.pids.add(m.pid)
        assert is_mounted(m.mnt)
        config = json.loads((m.mnt / ".distorefs" / "config.json").read_bytes())
        assert config["sync_interval"] == 2.5 and config["cache_bytes"] == 33554432
        assert "fuse.distorefs" in open("/proc/mounts").read()
        res = subprocess.run(helper + [str(m.store), str(m.mnt)], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0  # already mounted
        m.umount()
    finally:
        m.cleanup()


def test_umount_force_recovers_a_hung_daemon(fresh_mount):
    """A daemon that answers nothing (stopped here; after a kill -9 it can be a dead process
    that cannot exit) leaves callers waiting: umount --force aborts the FUSE connection."""
    import signal
    import time

    m = fresh_mount()
    b = m.buffer("hang")
    write_entry(b, "e", b"data")
    os.kill(m.pid, signal.SIGSTOP)
    try:
        reader = subprocess.Popen(["cat", str(b / "entries" / "e")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(0.5)
        assert reader.poll() is None  # waiting for the daemon
        cli("umount", "--force", "--timeout", "1", m.mnt, check=False)  # the stopped daemon cannot exit yet
        assert reader.wait(timeout=20) != 0  # its call failed instead of waiting forever
        assert not is_mounted(m.mnt)
    finally:
        os.kill(m.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while m.lock_pid() is not None and os.path.exists(f"/proc/{m.pid}") and time.monotonic() < deadline:
        if open(f"/proc/{m.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    m.mount()  # the store is whole and mounts again
    assert (b / "entries" / "e").read_bytes() == b"data"


def test_inspect_tensor_files_in_weights(fs, tmp_path):
    """safetensors and torch.save files published under weights/: tensors by name, dtype and
    shape; a torch archive whose pickle names os.system is refused (exit 1) and never run."""
    torch = pytest.importorskip("torch")
    import pickle
    import struct
    import zipfile
    model = fs.mnt / "weights" / "inspect-tensors"
    model.mkdir()
    header = json.dumps({"__metadata__": {"step": "12"},
                         "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
    (model / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    torch.save({"layer.weight": torch.zeros(4, 2, dtype=torch.float16), "step": 5}, model / "ck.pt")

    info = json.loads(cli("inspect", model / "m.safetensors", "--json").stdout)
    assert info["content"] == {"format": "safetensors", "metadata": {"step": "12"},
                               "tensors": {"w": {"dtype": "F32", "shape": [2, 3], "bytes": 24}}}
    assert info["xattrs"]["version"] == "1"
    text = cli("inspect", model / "ck.pt").stdout
    assert "torch.save archive with 1 tensors" in text
    assert re.search(r"layer\.weight\s+float16\s+\(4, 2\)", text), text
    info = json.loads(cli("inspect", model / "ck.pt", "--json").stdout)
    assert info["content"]["tensors"] == {"layer.weight": {"dtype": "float16", "shape": [4, 2]}}

    marker = tmp_path / "ran"
    evil = pickle.dumps({"w": _Runs(f"touch {marker}")}, protocol=2)
    with zipfile.ZipFile(model / "evil.pt", "w") as z:
        z.writestr("archive/data.pkl", evil)
    res = cli("inspect", model / "evil.pt", check=False)
    assert res.returncode == 1 and "cannot read" in res.stdout and "system" in res.stdout
    assert not marker.exists()


class _Runs:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


# ----- import ---------------------------------------------------------------------------------

def _fill_store(m) -> dict:
    """A prioritized buffer with entries sampled, a gap and an exact priority; a bank; weights
    with a sub-directory and a symlink; a dataset staged from a CSV with a metadata column;
    a checkpoint run of two steps, the first pinned. What the test expects back."""
    b = m.buffer("replay", {"sampler": "prioritized", "alpha": 0.7, "capacity": 1000})
    data = {f"e{i:02d}": make_payload(f"e{i}", 3000 + 997 * i, seed=i) for i in range(10)}
    data["big"] = make_payload("big", 700 << 10)  # a segment-tier value
    for k, v in data.items():
        write_entry(b, k, v)
    os.unlink(b / "entries" / "e04")
    del data["e04"]
    os.setxattr(b / "entries" / "e03", "user.distorefs.priority", b"0.12345678901234567")
    with open(b / "priorities", "w") as f:
        f.write("e07 3.75\ne01 1e-07\n")
    for n in (4, 3):
        with open(b / "sample" / str(n), "rb") as f:
            f.read()
    bank = m.mnt / "banks" / "mem"
    bank.mkdir()
    for i in range(3):
        write_entry(bank, f"m{i}", make_payload(f"m{i}", 500 + i))
    w = m.mnt / "weights" / "policy"
    (w / "v1").mkdir(parents=True)
    (w / "v1" / "model.bin").write_bytes(make_payload("model", 300_000))
    (w / "v1" / "model.bin").write_bytes(make_payload("model", 310_000, seed=2))  # version 2
    (w / "notes.txt").write_text("weights notes\n")
    os.chmod(w / "notes.txt", 0o600)
    os.symlink("v1", w / "latest")
    os.chown(w / "notes.txt", 1234, 1235)  # owners: kept by an export and an import run as root
    os.chown(w / "v1", 1234, 1235)
    os.chown(b / "entries" / "e05", 1234, 1235)
    src = m.root / "ds-src"
    (src / "a").mkdir(parents=True)
    rows = ["path,label,score"]
    for i in range(5):
        (src / "a" / f"x{i}.bin").write_bytes(make_payload(f"x{i}", 2000 + i))
        rows.append(f"a/x{i}.bin,{i % 2},{i / 4}")
    (src / "top.bin").write_bytes(b"top")
    rows.append("top.bin,9,2.0")  # (a list's paths are relative to its files' common directory)
    (src / "list.csv").write_text("\n".join(rows) + "\n")
    cli("stage", "-q", src / "list.csv", m.mnt / "datasets" / "ds")
    run = m.mnt / "checkpoints" / "run1"
    run.mkdir()
    for step in ("step-2", "step-10"):  # created in this order: names do not sort so
        (run / step / "sub").mkdir(parents=True)
        (run / step / "model.pt").write_bytes(make_payload(step, 50_000))
        (run / step / "sub" / "optim.pt").write_bytes(make_payload(step + "o", 20_000))
        fsync_dir(run / step)
    os.setxattr(run / "step-2", "user.distorefs.pinned", b"1")
    return data


_VARIES = {"seq", "tier", "stored_size", "version"}  # the store's to give: not restored
_GENERATED_FILES = ("stats.json", "priorities")


def _comparable(manifest: dict) -> tuple[list, list]:
    files = []
    for f in manifest["files"]:
        name = f["path"].rsplit("/", 1)[-1]
        keep = {k: v for k, v in f.items() if k not in _VARIES}
        if name in _GENERATED_FILES or name in ("config.json", "index.npy"):  # the store's times
            keep = {"path": f["path"]} if name in _GENERATED_FILES else {k: keep[k] for k in ("path", "crc32")}
        files.append(keep)
    fixed = {"buffers", "banks", "datasets", "checkpoints", "weights", "buffers/replay", "buffers/replay/entries",
             "banks/mem", "banks/mem/entries", "datasets/ds"}  # their times are the store's
    dirs = [{k: v for k, v in d.items() if k not in _VARIES} for d in manifest["dirs"] if d["path"] not in fixed]
    return files, dirs


def test_export_import_round_trip(fresh_mount, tmp_path):
    a = fresh_mount("segment_threshold=524288")
    data = _fill_store(a)
    sampled = {k: int(xattr(a.mnt / "buffers" / "replay" / "entries" / k, "times_sampled")) for k in data}
    assert sum(sampled.values()) == 7 and any(v == 0 for v in sampled.values())
    cli("export", "-q", a.mnt, tmp_path / "one")
    b = fresh_mount()
    res = cli("import", "-q", tmp_path / "one", b.mnt)
    assert "imported" in res.stdout and not res.stderr, res.stdout + res.stderr
    cli("export", "-q", b.mnt, tmp_path / "two")
    one = json.loads((tmp_path / "one" / ".distorefs-export.json").read_text())
    two = json.loads((tmp_path / "two" / ".distorefs-export.json").read_text())
    assert one["format"] == 2 and one["kind"] == "mount"
    assert [f["path"] for f in one["files"]] == [f["path"] for f in two["files"]]  # FIFO order and all files
    f1, d1 = _comparable(one)
    f2, d2 = _comparable(two)
    assert f1 == f2  # contents (CRC), sizes, priorities, times sampled, modes, mtimes, dataset items
    assert d1 == d2  # directory modes and times, checkpoint steps' state and pinned
    entries = b.mnt / "buffers" / "replay" / "entries"
    assert os.listdir(entries) == list(data)  # the same relative order
    assert {k: int(xattr(entries / k, "times_sampled")) for k in data} == sampled
    assert xattr(entries / "e03", "priority") == "0.12345678901234566"  # exact: repr of the same float
    assert float(xattr(entries / "e01", "priority")) == 1e-07
    for k, v in data.items():
        assert (entries / k).read_bytes() == v
    w = b.mnt / "weights" / "policy"
    assert os.readlink(w / "latest") == "v1" and (w / "latest" / "model.bin").read_bytes() == \
        make_payload("model", 310_000, seed=2)
    assert oct(os.stat(w / "notes.txt").st_mode & 0o777) == "0o600"
    for path in (w / "notes.txt", w / "v1", entries / "e05"):  # (also compared in the manifests)
        assert (os.stat(path).st_uid, os.stat(path).st_gid) == (1234, 1235), path
    assert os.stat(entries / "e06").st_uid == 0
    ds = b.mnt / "datasets" / "ds"
    assert xattr(ds, "state") == "sealed"
    index = np.load(ds / "index.npy")
    assert index.dtype.names == ("item", "path", "size", "checksum", "label", "score")
    assert index["label"].tolist() == [0, 1, 0, 1, 0, 9]
    assert index["score"].tolist() == [0, 0.25, 0.5, 0.75, 1.0, 2.0]
    assert index["path"].tolist()[:2] == [b"a/x0.bin", b"a/x1.bin"]
    assert (np.load(tmp_path / "one" / "datasets" / "ds" / "index.npy") == index).all()
    run = b.mnt / "checkpoints" / "run1"
    assert os.readlink(run / "latest") == "step-10"  # created last, though it sorts first
    assert xattr(run / "step-2", "pinned") == "1" and xattr(run / "step-10", "state") == "durable"
    assert sorted(os.listdir(tmp_path / "two" / "buffers" / "replay")) == ["config.json", "entries", "priorities",
                                                                          "stats.json"]

    # one namespace into a new name; a non-empty destination is refused, nothing changed
    cli("import", "-q", tmp_path / "one" / "buffers" / "replay", b.mnt / "buffers" / "copy")
    assert os.listdir(b.mnt / "buffers" / "copy" / "entries") == list(data)
    res = cli("import", "-q", tmp_path / "one" / "buffers" / "replay", b.mnt / "buffers" / "copy", check=False)
    assert res.returncode == 1 and "already holds entries" in res.stderr
    res = cli("import", "-q", tmp_path / "one" / "buffers" / "replay", b.mnt / "weights" / "x", check=False)
    assert res.returncode == 1 and "export of a buffer" in res.stderr
    assert not (b.mnt / "weights" / "x").exists()

    # a manifest of the first format (files only, attributes merged in) still imports
    cli("export", "-q", a.mnt / "buffers" / "replay", tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / ".distorefs-export.json").read_text())
    old = {"source": manifest["source"], "exported_at": manifest["exported_at"],
           "files": [{k: v for k, v in f.items() if k not in ("crc32", "mode", "mtime_ns")}
                     for f in manifest["files"]]}
    (tmp_path / "old" / ".distorefs-export.json").write_text(json.dumps(old))
    cli("import", "-q", tmp_path / "old", b.mnt / "buffers" / "fromold")
    entries = b.mnt / "buffers" / "fromold" / "entries"
    assert os.listdir(entries) == list(data)
    assert {k: int(xattr(entries / k, "times_sampled")) for k in data} == sampled


def _flip(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def test_import_refuses_corrupt_files(fresh_mount, tmp_path):
    a = fresh_mount()
    data = _fill_store(a)
    cli("export", "-q", a.mnt, tmp_path / "exp")
    exp = tmp_path / "exp"
    for p in ("buffers/replay/entries/e05", "weights/policy/v1/model.bin", "datasets/ds/items/a/x2.bin",
              "checkpoints/run1/step-10/sub/optim.pt"):
        _flip(exp / p)
    (exp / "buffers" / "replay" / "entries" / "stray").write_bytes(b"not exported")
    b = fresh_mount()
    res = cli("import", "-q", exp, b.mnt, check=False)
    assert res.returncode == 1
    for p in ("buffers/replay/entries/e05", "weights/policy/v1/model.bin", "datasets/ds/items/a/x2.bin",
              "checkpoints/run1/step-10/sub/optim.pt"):
        assert f"{p}: checksum mismatch" in res.stderr, res.stderr
    assert "entries/stray: not in the manifest" in res.stderr
    # nothing refused is there, half or whole; the rest is, in order
    entries = b.mnt / "buffers" / "replay" / "entries"
    assert os.listdir(entries) == [k for k in data if k != "e05"]
    assert not (b.mnt / "weights" / "policy" / "v1" / "model.bin").exists()
    assert os.listdir(b.mnt / "weights" / "policy" / "v1") == []  # no temporary file left
    assert (b.mnt / "weights" / "policy" / "notes.txt").read_text() == "weights notes\n"
    ds = b.mnt / "datasets" / "ds"
    assert xattr(ds, "state") == "open" and not (ds / "items" / "a" / "x2.bin").exists()
    assert "left unsealed" in res.stdout
    run = b.mnt / "checkpoints" / "run1"
    assert sorted(os.listdir(run)) == ["latest", "step-2"] and os.readlink(run / "latest") == "step-2"
    # fixed, a rerun resumes the dataset and seals it
    (exp / "datasets" / "ds" / "items" / "a" / "x2.bin").write_bytes(make_payload("x2", 2002))
    cli("import", "-q", exp / "datasets" / "ds", ds)
    assert xattr(ds, "state") == "sealed" and xattr(ds, "items") == "6"


def test_times_sampled_xattr(fresh_mount):
    m = fresh_mount()
    b = m.buffer("ts", {"max_times_sampled": 5})
    write_entry(b, "e", b"x")
    e = b / "entries" / "e"
    os.setxattr(e, "user.distorefs.times_sampled", b"4")
    assert xattr(e, "times_sampled") == "4"
    for bad in (b"5", b"-1", b"two", b"99999999999"):
        with pytest.raises(OSError) as info:
            os.setxattr(e, "user.distorefs.times_sampled", bad)
        assert info.value.errno == errno.EINVAL
    with open(b / "sample" / "1", "rb") as f:  # the fifth draw spends it
        assert f.read().startswith(b"e ")
    m.remount()  # the count was stored
    assert not (b / "entries" / "e").exists()  # spent: removed
    write_entry(b, "f", b"y")
    os.setxattr(b / "entries" / "f", "user.distorefs.times_sampled", b"2")
    m.remount()
    assert xattr(b / "entries" / "f", "times_sampled") == "2"


def test_times_sampled_only_by_the_buffers_owner(shared_mount, temp_user):
    user, uid, gid = temp_user
    m = shared_mount()
    b = m.buffer("owned")
    write_entry(b, "e", b"x")
    os.chmod(b / "entries" / "e", 0o666)  # anyone may rewrite it, not set its counts
    res = as_user(user, "setfattr", "-n", "user.distorefs.times_sampled", "-v", "3", str(b / "entries" / "e"))
    assert res.returncode != 0 and "not permitted" in res.stderr, res.stderr
    res = as_user(user, "setfattr", "-n", "user.distorefs.priority", "-v", "3", str(b / "entries" / "e"))
    assert res.returncode == 0, res.stderr
    assert xattr(b / "entries" / "e", "times_sampled") == "0"


# ----- warmup ---------------------------------------------------------------------------------

def _stats(m) -> dict:
    return json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())


def test_warmup_fills_the_memory_tier_and_the_page_cache(fresh_mount, tmp_path):
    from distorefs.tools.warmup import resident_bytes
    m = fresh_mount()
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(30):
        (src / "d" / f"f{i}.bin").write_bytes(make_payload(f"f{i}", 100_000 + i))
    (src / "big.bin").write_bytes(make_payload("big", 9 << 20))  # three 4 MiB chunks
    cli("stage", "-q", src, m.mnt / "datasets" / "ds")
    b = m.buffer("wb")
    for i in range(5):
        write_entry(b, f"e{i}", make_payload(f"e{i}", 50_000))
    (m.mnt / "weights" / "w").mkdir()
    (m.mnt / "weights" / "w" / "model.bin").write_bytes(make_payload("model", 3 << 20))
    (m.mnt / "checkpoints" / "r" / "s1").mkdir(parents=True)
    (m.mnt / "checkpoints" / "r" / "s1" / "ck.pt").write_bytes(make_payload("ck", 200_000))
    fsync_dir(m.mnt / "checkpoints" / "r" / "s1")
    m.remount()  # an empty memory tier and nothing of the mount in the page cache
    data_bytes = sum(p.stat().st_size for p in src.rglob("*.bin")) + 5 * 50_000 + (3 << 20)
    before = _stats(m)
    host_took = reclaimed()
    res = cli("warmup", "--json", m.mnt / "datasets" / "ds", b, m.mnt / "weights" / "w", m.mnt / "checkpoints")
    r = json.loads(res.stdout)
    index_bytes = (m.mnt / "datasets" / "ds" / "index.npy").stat().st_size
    assert r["files"] == 31 + 1 + 5 + 1 + 1 and r["errors"] == []  # items, index.npy, entries, weights, checkpoint
    assert r["memory_held"] == data_bytes + index_bytes
    assert r["memory_not_served"] == 200_000 and r["memory_over_budget"] == r["memory_refused"] == 0
    after = _stats(m)
    assert after["memory"]["cache"]["warmed_bytes"] - before["memory"]["cache"]["warmed_bytes"] == r["memory_loaded"]
    # (an entry's open puts its value into the page cache itself, and so does the open of a
    # dataset item up to 1 MiB: those need no read)
    items_at_open = sum(p.stat().st_size for p in (src / "d").iterdir())
    assert r["read_bytes"] + r["page_cache_already"] == r["bytes"]
    assert r["page_cache_already"] == 5 * 50_000 + items_at_open
    # everything is in the page cache now (unless this VM's host took pages meanwhile: see
    # reclaimed(); pages put into the page cache and not read since are the first it takes);
    # a read of the data costs the daemon no disk read
    def resident(p) -> bool:
        with open(p, "rb") as f:
            return resident_bytes(f.fileno(), p.stat().st_size) == p.stat().st_size
    warm = [*(m.mnt / "datasets" / "ds" / "items" / "d").iterdir(), m.mnt / "weights" / "w" / "model.bin"]
    gone = [p.name for p in warm if not resident(p)]
    assert not gone or reclaimed() != host_took, gone
    reads = after["disk_reads"]
    for p in (m.mnt / "datasets" / "ds" / "items").rglob("*.bin"):
        p.read_bytes()
    for i in range(5):
        assert (b / "entries" / f"e{i}").read_bytes() == make_payload(f"e{i}", 50_000)  # an open reads the value
    assert _stats(m)["disk_reads"] == reads
    # again: all of it is warm already, nothing is read. The host's reclaim took a few pages
    # of big.bin here in some runs (the mount invalidated nothing), and warmup then read the
    # whole file again: the pages are checked right before, and nothing read is asserted over
    # a window the host took nothing in.
    all_resident = all(resident(p) for p in (m.mnt / "datasets" / "ds" / "items").rglob("*.bin"))
    before = reclaimed()
    r = json.loads(cli("warmup", "--json", m.mnt / "datasets" / "ds").stdout)
    assert r["memory_loaded"] == 0, r  # the memory tier kept everything
    if all_resident and reclaimed() == before:
        assert r["read_bytes"] == 0 and r["page_cache_already"] == r["bytes"], (r, _stats(m)["mount"])
    value = os.getxattr(m.mnt / "datasets" / "ds" / "items" / "big.bin", "user.distorefs.warm")
    assert value == b"values=3 bytes=%d already=%d loaded=0 refused=0" % ((9 << 20,) * 2)
    assert "user.distorefs.warm" not in os.listxattr(m.mnt / "datasets" / "ds" / "items" / "big.bin")


def test_warmup_within_the_memory_budget(fresh_mount, tmp_path):
    m = fresh_mount("cache_bytes=1048576")  # 1 MiB: a few of the files below
    b = m.buffer("budget")
    for i in range(20):
        write_entry(b, f"e{i:02d}", make_payload(f"e{i}", 100_000))
    write_entry(b, "huge", make_payload("huge", 400_000))  # over a quarter of the tier: never kept
    m.remount()
    before = reclaimed()
    res = cli("warmup", "-j", "1", b)
    assert "memory tier full" in res.stdout, res.stdout
    r = json.loads(cli("warmup", "--json", "--no-memory", b).stdout)  # page cache only: warm now
    assert r["memory_loaded"] == 0 and r["page_cache_already"] + r["read_bytes"] == r["bytes"]
    if reclaimed() == before:  # (the kernel took no pages meanwhile: CI's once did, and 2 files were read again)
        assert r["read_bytes"] == 0, r
    m.remount()
    r = json.loads(cli("warmup", "--json", "-j", "1", b).stdout)
    assert 8 * 100_000 <= r["memory_held"] <= 1 << 20
    assert r["memory_over_budget"] + r["memory_refused"] + r["memory_held"] == 20 * 100_000 + 400_000
    assert _stats(m)["memory"]["cache"]["used_bytes"] <= 1 << 20

"""weights/: atomic publication at close, versions, the symlink-swap idiom, waiting for a
newer version, and crashes mid-publish — through real mounts."""

import errno
import hashlib
import json
import multiprocessing
import os
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

from distorefs_it import assert_errno, xattr

HDR = struct.Struct("<Q32s")  # version, sha256 of the body


def blob(version: int, size: int) -> bytes:
    body = np.random.default_rng(version).integers(0, 256, size - HDR.size, dtype=np.uint8).tobytes()
    return HDR.pack(version, hashlib.sha256(body).digest()) + body


def check(data: bytes) -> int:
    """The version a whole copy carries; raises if the copy is torn."""
    version, digest = HDR.unpack_from(data)
    if hashlib.sha256(data[HDR.size:]).digest() != digest:
        raise AssertionError(f"torn read: {len(data)} bytes claiming version {version}")
    return version


@pytest.fixture
def model(fs, request):
    path = fs.mnt / "weights" / request.node.name[:60]
    path.mkdir()
    return path


def publish(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_tree_basics(fs, model):
    assert {"config.json", "stats.json"} <= set(os.listdir(fs.mnt / "weights"))
    (model / "sub" / "deeper").mkdir(parents=True)
    publish(model / "sub" / "deeper" / "w.bin", b"abc")
    assert (model / "sub" / "deeper" / "w.bin").read_bytes() == b"abc"
    assert xattr(model / "sub" / "deeper" / "w.bin", "version") == "1"
    assert_errno(errno.ENOTEMPTY, os.rmdir, model / "sub")
    os.rename(model / "sub", model / "moved")
    assert (model / "moved" / "deeper" / "w.bin").read_bytes() == b"abc"
    os.unlink(model / "moved" / "deeper" / "w.bin")
    os.rmdir(model / "moved" / "deeper")
    assert os.listdir(model / "moved") == []
    assert_errno(errno.EXDEV, os.rename, model / "moved", fs.mnt / "buffers" / "x")
    assert_errno(errno.EACCES, os.unlink, fs.mnt / "weights" / "stats.json")


def test_publish_is_atomic_and_old_readers_keep_their_version(model):
    path = model / "w.bin"
    publish(path, blob(1, 3 << 20))
    old = open(path, "rb")
    head = old.read(1000)
    writer = open(path, "wb")  # in-place rewrite: O_TRUNC on the name readers use
    writer.write(blob(2, 2 << 20)[:1 << 20])
    # mid-write: new opens still get version 1 whole, the old reader continues
    assert check(path.read_bytes()) == 1
    writer.write(blob(2, 2 << 20)[1 << 20:])
    writer.close()
    assert check(path.read_bytes()) == 2  # every open after close() sees the new version
    assert check(head + old.read()) == 1  # the old handle read version 1 to its end
    old.close()
    assert xattr(path, "version") == "2"


def _reader(path: str, seconds: float, q) -> None:
    end, reads, versions, torn = time.time() + seconds, 0, set(), 0
    while time.time() < end:
        with open(path, "rb") as f:
            data = f.read()
        try:
            versions.add(check(data))
        except AssertionError:
            torn += 1
        reads += 1
    q.put((reads, torn, sorted(versions)))


def test_no_torn_reads_while_republishing(model):
    path = model / "w.bin"
    publish(path, blob(1, 1 << 20))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(str(path), 4.0, q)) for _ in range(4)]
    for r in readers:
        r.start()
    version, end = 1, time.time() + 4.0
    while time.time() < end:
        version += 1
        publish(path, blob(version, (1 << 20) + version * 4096))  # sizes change too
    results = [q.get(timeout=60) for _ in readers]
    for r in readers:
        r.join(timeout=30)
    reads = sum(r[0] for r in results)
    assert sum(r[1] for r in results) == 0, results
    print(f"{reads} checked reads, {version} versions published")
    assert reads > 100  # thousands on an idle machine
    assert len(set().union(*[r[2] for r in results])) > 3  # readers saw many versions
    assert version > 5


def test_symlink_swap_publishes_a_directory_at_once(model):
    for v in (1, 2):
        (model / f"v{v}").mkdir()
        for part in ("a", "b", "c"):
            publish(model / f"v{v}" / f"{part}.bin", blob(v, 4096))
    os.symlink("v1", model / "latest")
    assert {check((model / "latest" / f"{p}.bin").read_bytes()) for p in "abc"} == {1}
    subprocess.run("ln -sfn v2 latest.tmp && mv -T latest.tmp latest", shell=True, cwd=model, check=True)
    assert os.readlink(model / "latest") == "v2"
    assert {check((model / "latest" / f"{p}.bin").read_bytes()) for p in "abc"} == {2}
    assert "latest.tmp" not in os.listdir(model)
    # RENAME_NOREPLACE via `mv -n` keeps the target; plain rename over a file replaces it
    publish(model / "x", b"x")
    publish(model / "y", b"y")
    subprocess.run(["mv", "-n", str(model / "x"), str(model / "y")], check=False)
    assert (model / "y").read_bytes() == b"y"
    os.rename(model / "x", model / "y")
    assert (model / "y").read_bytes() == b"x" and not (model / "x").exists()


def test_versions_are_collected_beyond_keep_versions(fs, model):
    stats = lambda: json.loads((fs.mnt / "weights" / "stats.json").read_bytes())  # noqa: E731
    path = model / "w.bin"
    publish(path, blob(1, 100_000))
    held = open(path, "rb")  # holds version 1
    for v in range(2, 6):
        publish(path, blob(v, 100_000))
    mine = [n for n in range(1, 6)]
    time.sleep(0.3)
    s = stats()
    assert s["keep_versions"] == 2
    assert check(held.read()) == 1  # still readable: a handle holds it
    held.close()
    deadline = time.time() + 5
    while time.time() < deadline and stats()["versions_collected"] < s["versions_collected"] + 1:
        time.sleep(0.05)
    assert stats()["versions_collected"] >= 3  # versions 1..3 of this file are gone
    assert check(path.read_bytes()) == 5
    assert mine


def test_numpy_and_memmap(model):
    arr = np.arange(2_000_000, dtype=np.float32).reshape(1000, 2000)
    np.save(model / "layer.npy", arr)
    assert np.array_equal(np.load(model / "layer.npy"), arr)
    mm = np.load(model / "layer.npy", mmap_mode="r")
    assert mm[999, 1999] == arr[999, 1999]
    np.savez(model / "all.npz", a=arr, b=arr[:10])
    with np.load(model / "all.npz") as z:
        assert np.array_equal(z["b"], arr[:10])


def test_safetensors(model):
    import safetensors.numpy as st
    tensors = {"w": np.ones((64, 64), np.float32), "b": np.zeros(64, np.float32)}
    st.save_file(tensors, str(model / "m.safetensors"))
    back = st.load_file(str(model / "m.safetensors"))
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())


def test_wait_for_a_newer_version(fs, model):
    path = model / "w.bin"
    publish(path, blob(1, 1000))
    rel = f"{model.name}/w.bin"
    with open(fs.mnt / ".distorefs" / "wait", "r+b", buffering=0) as f:
        f.write(f"{rel} 0\n".encode())
        assert f.read() == b"1\n"  # already past 0
    fd = os.open(fs.mnt / ".distorefs" / "wait", os.O_RDWR | os.O_NONBLOCK)
    os.write(fd, f"{rel} 1\n".encode())
    assert_errno(errno.EAGAIN, os.read, fd, 100)
    os.close(fd)
    got = []

    def waiter():
        with open(fs.mnt / ".distorefs" / "wait", "r+b", buffering=0) as f:
            f.write(f"weights/{rel} 1\n".encode())
            got.append(f.read())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.3)
    assert not got
    publish(path, blob(2, 1000))
    t.join(timeout=10)
    assert got == [b"2\n"]


def test_crash_mid_publish_keeps_the_last_closed_version(fresh_mount):
    m = fresh_mount()
    model = m.mnt / "weights" / "m"
    model.mkdir()
    path = model / "w.bin"
    publish(path, blob(1, 8 << 20))
    for cycle in range(3):
        writer = open(path, "wb")
        writer.write(blob(cycle + 2, 8 << 20)[:4 << 20])  # half written, never closed
        m.kill9()
        try:
            writer.close()
        except OSError:
            pass
        m.lazy_umount()
        m.mount()
        assert check(path.read_bytes()) == 1
    publish(path, blob(9, 1 << 20))
    m.kill9()
    m.lazy_umount()
    m.mount()
    assert check(path.read_bytes()) == 9  # close() returned: it survives kill -9


def test_a_process_that_exits_publishes_like_a_close(model):
    """A process's files are closed by the kernel when it exits, killed or not: the two cannot
    be told apart reliably, so both publish what was written (atomic: write, then rename)."""
    import signal
    import sys
    subprocess.run(f'{sys.executable} -c "print(1)" > {model}/out.txt', shell=True, check=True)
    assert (model / "out.txt").read_bytes() == b"1\n" and xattr(model / "out.txt", "version") == "1"
    proc = subprocess.Popen([sys.executable, "-c", "import os, sys, time; f = open(sys.argv[1], 'wb'); "
                             "f.write(b'half'); f.flush(); print('written', flush=True); time.sleep(60)",
                             str(model / "killed.bin")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 5
    while time.time() < deadline and (model / "killed.bin").read_bytes() != b"half":
        time.sleep(0.05)
    assert (model / "killed.bin").read_bytes() == b"half"


def test_rename_exchange_and_noreplace(model):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD, RENAME_NOREPLACE, RENAME_EXCHANGE = -100, 1, 2

    def renameat2(a, b, flags) -> int:
        r = libc.renameat2(AT_FDCWD, str(a).encode(), AT_FDCWD, str(b).encode(), flags)
        return 0 if r == 0 else ctypes.get_errno()

    publish(model / "a", b"A")
    publish(model / "b", b"B")
    assert renameat2(model / "a", model / "b", RENAME_NOREPLACE) == errno.EEXIST
    assert renameat2(model / "a", model / "b", RENAME_EXCHANGE) == 0
    assert (model / "a").read_bytes() == b"B" and (model / "b").read_bytes() == b"A"
    assert renameat2(model / "a", model / "c", RENAME_EXCHANGE) == errno.ENOENT

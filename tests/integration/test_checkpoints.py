"""checkpoints/ through real mounts: a save loop watched through `latest`, backpressure
with the daemon's memory bounded, keep_last and pinning, fsync, a writer killed mid-save,
kill -9 of the daemon at random points of the persist phase, and resuming."""

import contextlib
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from distorefs_it import fsync_dir, xattr

MiB = 1 << 20


def configure(m, **config) -> None:
    with open(m.mnt / "checkpoints" / "config.json", "w") as f:
        f.write(json.dumps(config))


def stats(m) -> dict:
    return json.loads((m.mnt / "checkpoints" / "stats.json").read_bytes())


def npy(step: int, name: str, nbytes: int) -> bytes:
    """The bytes np.save writes for the array `name` of step `step` (deterministic)."""
    arr = np.random.default_rng([step, len(name)]).standard_normal(nbytes // 8)
    out = io.BytesIO()
    np.save(out, arr)
    return out.getvalue()


# A trainer's save loop, unmodified: mkdir STEP, np.save the arrays, a small meta.json last.
SAVER = r"""
import hashlib, io, json, os, sys
import numpy as np
run, first, last, sizes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
for step in range(first, last):
    d = os.path.join(run, f"step-{step:04d}")
    os.makedirs(d)
    sums = {}
    for name, nbytes in sizes.items():
        arr = np.random.default_rng([step, len(name)]).standard_normal(nbytes // 8)
        np.save(os.path.join(d, name), arr)
        out = io.BytesIO(); np.save(out, arr); sums[name + ".npy"] = hashlib.sha256(out.getvalue()).hexdigest()
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump({"step": step, "sha256": sums}, f)
    print(step, flush=True)
"""


def saver(run: Path, first: int, last: int, sizes: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SAVER, str(run), str(first), str(last), json.dumps(sizes)],
                            stdout=subprocess.PIPE, text=True)


def check_step(step_dir: Path) -> int:
    """The step a whole, matching step directory holds; AssertionError if anything differs."""
    meta = json.loads((step_dir / "meta.json").read_bytes())
    for name, digest in meta["sha256"].items():
        data = (step_dir / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{step_dir / name} does not match"
    return meta["step"]


def test_save_loop_latest_names_only_complete_matching_steps(fresh_mount):
    m = fresh_mount()
    configure(m, keep_last=3)  # steps close when the next one is made (and the last by fsync)
    run = m.mnt / "checkpoints" / "run"
    run.mkdir()
    sizes = {"model": 16 * MiB, "optim": 8 * MiB}
    proc = saver(run, 0, 12, sizes)
    seen, checked, mismatches, incomplete = [], 0, [], []
    done = False

    def watch():
        nonlocal checked
        while not done:
            try:
                target = os.readlink(run / "latest")
            except FileNotFoundError:
                time.sleep(0.01)
                continue
            if not seen or seen[-1] != target:
                seen.append(target)
                try:
                    state = xattr(run / target, "state")
                    if state != "durable":
                        incomplete.append((target, state))
                    assert check_step(run / target) == int(target.split("-")[1])
                    checked += 1
                except FileNotFoundError:
                    pass  # retired by keep_last meanwhile: a newer step is complete
                except AssertionError as exc:
                    mismatches.append(str(exc))
            time.sleep(0.01)

    t = threading.Thread(target=watch)
    t.start()
    try:
        assert proc.wait(timeout=60) == 0
        last = run / "step-0011"
        fsync_dir(last)  # the step directory's fsync: closed and durable
        time.sleep(0.1)
    finally:
        done = True
        t.join()
    assert not mismatches and not incomplete, (mismatches, incomplete)
    assert checked >= 2, seen
    assert os.readlink(run / "latest") == "step-0011"
    assert [int(s.split("-")[1]) for s in seen] == sorted(int(s.split("-")[1]) for s in seen)
    deadline = time.monotonic() + 10
    while sorted(os.listdir(run)) != ["latest", "step-0009", "step-0010", "step-0011"]:
        assert time.monotonic() < deadline, os.listdir(run)
        time.sleep(0.05)
    for name in ("step-0009", "step-0010", "step-0011"):
        assert xattr(run / name, "state") == "durable"
        assert check_step(run / name) == int(name[-4:])
    s = stats(m)
    assert s["steps_completed"] >= 3 and s["persist_failures"] == 0
    # resume after a restart: np.load of the latest step, whole
    m.remount()
    latest = run / os.readlink(run / "latest")
    arr = np.load(latest / "model.npy")
    assert arr.tobytes() == np.load(io.BytesIO(npy(11, "model", 16 * MiB))).tobytes()
    mm = np.load(latest / "optim.npy", mmap_mode="r")  # resume through mmap works too
    assert float(mm[123]) == float(np.load(io.BytesIO(npy(11, "optim", 8 * MiB)))[123])
    assert xattr(latest / "model.npy", "checksum").startswith("crc32:")


def rss_anon_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon")


WRITER = r"""
import os, sys
import numpy as np
path, total = sys.argv[1], int(sys.argv[2])
block = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for first in range(0, total >> 20, 16):  # 16 MiB write() calls: 16 WRITE requests in flight at once
    os.write(fd, b"".join(block[i % 256:] + block[:i % 256] for i in range(first, first + 16)))
os.close(fd)
"""


def test_backpressure_keeps_the_daemon_memory_bounded(fresh_mount):
    m = fresh_mount()
    # A budget of four 1 MiB chunks: the writer's 16 MiB write() calls arrive as 16 WRITE
    # requests at once (the kernel sends a direct write's requests together), more than the
    # budget holds, so the budget is reached whatever the speed of the persister.
    budget = 4 * MiB
    configure(m, writeback_bytes=budget, chunk_bytes=MiB, seal_after=0.2)
    step = m.mnt / "checkpoints" / "run" / "s"
    step.mkdir(parents=True)
    total = 256 * MiB  # 64x the budget
    base = rss_anon_kb(m.pid)
    peak = base
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(step / "big.bin"), str(total)])
    t0 = time.monotonic()
    while proc.poll() is None:
        peak = max(peak, rss_anon_kb(m.pid))
        time.sleep(0.005)
    assert proc.returncode == 0
    closed_s = time.monotonic() - t0
    fsync_dir(step)
    s = stats(m)["writeback"]
    assert s["waits"] > 0, "the writer never waited: the budget was not reached"
    assert s["peak_bytes"] <= budget
    grew_mib = (peak - base) / 1024
    assert grew_mib < budget / MiB + 96, f"daemon anonymous memory grew {grew_mib:.0f} MiB (budget 4 MiB)"
    assert xattr(step, "state") == "durable"
    block = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    with open(step / "big.bin", "rb") as f:
        for i in range(total >> 20):
            assert f.read(MiB) == block[i % 256:] + block[:i % 256], f"block {i}"
    print(f"256 MiB through a 4 MiB budget: closed after {closed_s:.1f}s, daemon +{grew_mib:.0f} MiB, "
          f"{s['waits']} waits")


def test_keep_last_and_pinning(fresh_mount):
    m = fresh_mount()
    configure(m, keep_last=2, seal_after=0.1)
    run = m.mnt / "checkpoints" / "run"
    run.mkdir()
    for i in range(5):
        d = run / f"s{i}"
        d.mkdir()
        (d / "w.bin").write_bytes(bytes([i]) * 100_000)
        if i == 1:
            fsync_dir(d)
            os.setxattr(d, "user.distorefs.pinned", b"1")
    fsync_dir(run / "s4")
    assert os.stat(run).st_nlink >= 2 + 3  # (held by the kernel from here on)
    deadline = time.monotonic() + 10
    while sorted(os.listdir(run)) != ["latest", "s1", "s3", "s4"]:
        assert time.monotonic() < deadline, os.listdir(run)
        time.sleep(0.05)
    # the run's attributes the kernel holds went with the steps retention removed
    assert os.stat(run).st_nlink == 2 + 3
    assert os.readlink(run / "latest") == "s4"
    assert xattr(run / "s1", "pinned") == "1" and xattr(run / "s1", "state") == "durable"
    assert (run / "s1" / "w.bin").read_bytes() == bytes([1]) * 100_000
    os.setxattr(run / "s1", "user.distorefs.pinned", b"0")
    before = os.stat(run)
    while "s1" in os.listdir(run):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = os.stat(run)
    assert after.st_nlink == 2 + 2 and after.st_mtime_ns > before.st_mtime_ns
    assert stats(m)["steps_removed"] == 3
    m.remount()
    assert sorted(os.listdir(run)) == ["latest", "s3", "s4"]


def test_fsync_and_reading_before_durable(fresh_mount):
    m = fresh_mount()
    configure(m, seal_after=0)  # steps close only by fsync of their directory or a newer step
    run = m.mnt / "checkpoints" / "run"
    s1 = run / "s1"
    s1.mkdir(parents=True)
    data = np.random.default_rng(1).integers(0, 256, 20 * MiB, dtype=np.uint8).tobytes()
    f = open(s1 / "model.bin", "wb")
    f.write(data)
    f.flush()
    with open(s1 / "model.bin", "rb") as r:  # held in memory, not yet durable: readable
        assert r.read() == data
    os.fsync(f.fileno())  # durable while still open
    assert xattr(s1 / "model.bin", "stored_size") == str(len(data))
    assert "memory" not in xattr(s1 / "model.bin", "tier")
    assert xattr(s1 / "model.bin", "state") == "writing" and xattr(s1, "state") == "writing"
    m.kill9()
    try:
        f.close()
    except OSError:
        pass
    m.lazy_umount()
    m.mount()
    assert (s1 / "model.bin").read_bytes() == data  # what fsync returned for survived
    assert xattr(s1, "state") == "incomplete"  # but the step was never closed: not complete
    assert not os.path.lexists(run / "latest")
    s2 = run / "s2"
    s2.mkdir()
    (s2 / "a.bin").write_bytes(b"a" * 1000)
    time.sleep(0.3)
    assert xattr(s2, "state") == "writing"  # seal_after 0: not closed by time
    fsync_dir(s2)
    assert xattr(s2, "state") == "durable" and os.readlink(run / "latest") == "s2"
    time.sleep(0.5)  # retention runs behind: an interrupted step holding an fsynced file stays
    assert (s1 / "model.bin").read_bytes() == data


def test_a_writer_that_exits_without_close_completes_its_step(fresh_mount):
    """The kernel closes an exiting process's files, killed or not: that close is a close like
    any other (an exit and a kill cannot be told apart reliably), so the step completes."""
    m = fresh_mount()
    configure(m, seal_after=0.1)
    run = m.mnt / "checkpoints" / "run"
    step = run / "s1"
    step.mkdir(parents=True)
    subprocess.run(f'{sys.executable} -c "print(1)" > {step}/out.txt', shell=True, check=True)
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'wb'); "
                             "f.write(b'x' * (3 << 20)); f.flush(); print('written', flush=True); time.sleep(60)",
                             str(step / "killed.bin")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(0.3)
    fsync_dir(step)
    assert xattr(step, "state") == "durable" and os.readlink(run / "latest") == "s1"
    assert (step / "out.txt").read_bytes() == b"1\n" and (step / "killed.bin").read_bytes() == b"x" * (3 << 20)


def test_kill9_at_random_points_of_the_persist_phase(fresh_mount):
    m = fresh_mount()
    configure(m, seal_after=3, keep_last=10, writeback_bytes=256 * MiB)
    run = m.mnt / "checkpoints" / "run"
    run.mkdir()
    rng = random.Random(5)
    sizes = {"model": 64 * MiB, "optim": 24 * MiB, "extra": 2 * MiB}
    good: list[int] = []
    states = []
    # random points spread over the whole persist phase, one per fifth of it
    shares = [(k + rng.random()) / 5 for k in range(5)]
    rng.shuffle(shares)
    for cycle in range(5):
        g, big = 2 * cycle, 2 * cycle + 1
        proc = saver(run, g, g + 1, {"model": 4 * MiB})
        assert proc.wait(timeout=60) == 0
        fsync_dir(run / f"step-{g:04d}")
        assert os.readlink(run / "latest") == f"step-{g:04d}"
        good.append(g)
        # ~90 MB; killed once a random share of it has been persisted (chunk writes, file
        # commits, syncs); in the last cycles, at a random moment after the saver closed
        # everything and fsynced the step directory (the sync and the completion)
        base = stats(m)["bytes_persisted"]
        big_dir = run / f"step-{big:04d}"
        proc = saver(run, big, big + 1, sizes)
        if shares[cycle] < 0.6:
            deadline = time.monotonic() + 30
            while stats(m)["bytes_persisted"] - base < shares[cycle] * sum(sizes.values()):
                assert time.monotonic() < deadline
                time.sleep(0.002)
        else:
            assert proc.wait(timeout=60) == 0

            def close_step():
                try:
                    fsync_dir(big_dir)
                except OSError:
                    pass  # the daemon was killed first

            threading.Thread(target=close_step, daemon=True).start()
            time.sleep(rng.uniform(0, 0.02))
        s = stats(m)
        state = xattr(big_dir, "state") if big_dir.exists() else "absent"
        states.append((state, (s["bytes_persisted"] - base) >> 20, s["writeback"]["held_bytes"] >> 20))
        m.kill9()
        proc.kill()
        proc.wait(timeout=30)
        m.lazy_umount()
        m.mount()
        latest = os.readlink(run / "latest")
        if latest == big_dir.name:  # it had completed before the kill: then it is whole
            assert state == "durable", state
            assert check_step(big_dir) == big
            good.append(big)
        else:
            assert latest == f"step-{g:04d}", (latest, state)
            assert not big_dir.exists() or xattr(big_dir, "state") == "incomplete"
        for step in good:  # every complete step is whole
            assert check_step(run / f"step-{step:04d}") == step
    print("state, MiB persisted and MiB held at each kill:", states)
    assert any(state != "durable" and persisted for state, persisted, _ in states), "no kill hit the persist phase"
    # interrupted steps go once a newer step completes; complete ones stay
    proc = saver(run, 100, 101, {"model": MiB})
    assert proc.wait(timeout=60) == 0
    fsync_dir(run / "step-0100")
    deadline = time.monotonic() + 10
    expect = sorted([f"step-{s:04d}" for s in good + [100]] + ["latest"])
    while sorted(os.listdir(run)) != expect:
        assert time.monotonic() < deadline, (os.listdir(run), expect)
        time.sleep(0.05)
    assert m.alive()


def _durable_step(m):
    """checkpoints/run/s1 of `m` (keep_last 1, sealed at once) with a.bin (300 KB of A) and
    b.bin (1 KB of B), fsynced: complete and durable. Returns (run, s1)."""
    configure(m, seal_after=0, keep_last=1)
    run = m.mnt / "checkpoints" / "run"
    s1 = run / "s1"
    s1.mkdir(parents=True)
    (s1 / "a.bin").write_bytes(b"A" * 300_000)
    (s1 / "b.bin").write_bytes(b"B" * 1000)
    fsync_dir(s1)
    assert xattr(s1, "state") == "durable"
    return run, s1


def test_a_file_removed_while_open_in_a_step_cut_short_comes_back_with_the_step(fresh_mount):
    """A complete step written again, one of its files removed while a reader holds it open,
    then a crash: the step is given back as it was when last complete, that file with it
    (its record, kept for the open handle, must not take the restored file away at start)."""
    m = fresh_mount()
    run, s1 = _durable_step(m)
    (run / "s2").mkdir()  # a newer step closes the older ones
    with open(s1 / "a.bin", "r+b") as f:  # written again: the step is reopened
        f.write(b"new" * 1000)
    held = open(s1 / "b.bin", "rb")
    try:
        os.unlink(s1 / "b.bin")
        m.kill9()
    finally:
        with contextlib.suppress(OSError):
            held.close()
    m.lazy_umount()
    m.mount()
    assert sorted(os.listdir(s1)) == ["a.bin", "b.bin"]
    assert (s1 / "a.bin").read_bytes() == b"A" * 300_000
    assert (s1 / "b.bin").read_bytes() == b"B" * 1000


def test_fsync_is_a_promise_and_a_reopened_step_cut_short_goes_back(fresh_mount):
    """What an fsync acknowledged survives a later crash, and a complete step that is written
    again and cut short by a crash is given back as it was when last complete."""
    m = fresh_mount()
    run, s1 = _durable_step(m)
    s2 = run / "s2"  # a step never complete (its file acknowledged by fsync below); made first,
    s2.mkdir()  # as a newer step closes the older ones
    with open(s1 / "a.bin", "r+b") as f:  # written again, never fsynced: goes back
        f.write(b"new" * 1000)
    os.unlink(s1 / "b.bin")  # removed: comes back
    (s1 / "junk.bin").write_bytes(b"J")  # new, never fsynced: goes
    with open(s1 / "acked.bin", "wb") as f:  # new and fsynced: kept
        f.write(b"K" * 5000)
        f.flush()
        os.fsync(f.fileno())
    f = open(s2 / "x.bin", "wb")
    f.write(b"X" * 70_000)
    f.flush()
    os.fsync(f.fileno())
    m.kill9()  # the writer of x.bin has not closed it
    try:
        f.close()
    except OSError:
        pass
    m.lazy_umount()
    m.mount()
    assert xattr(s1, "state") == "durable" and os.readlink(run / "latest") == "s1"
    assert sorted(os.listdir(s1)) == ["a.bin", "acked.bin", "b.bin"]
    assert (s1 / "a.bin").read_bytes() == b"A" * 300_000
    assert (s1 / "b.bin").read_bytes() == b"B" * 1000
    assert (s1 / "acked.bin").read_bytes() == b"K" * 5000
    assert (s2 / "x.bin").read_bytes() == b"X" * 70_000
    s3 = run / "s3"  # newer complete steps: retention never takes the acknowledged file
    s3.mkdir()
    (s3 / "w").write_bytes(b"w")
    fsync_dir(s3)
    time.sleep(0.5)
    assert (s2 / "x.bin").read_bytes() == b"X" * 70_000
    res = subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "umount", str(m.mnt)], capture_output=True)
    assert res.returncode == 0
    res = subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "verify", str(m.store)], capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    m.mount()


def test_a_checkpoint_files_open_asks_for_no_attributes_of_the_directories_above_its_step(fresh_mount):
    """The kernel holds checkpoint directories' attributes: writing files into a step asks
    for the step's own once per file (each create changes it) and for no other
    directory's (Python's open also asks for the new file's, its fstat, and the close its
    size); before, every open asked for checkpoints/, the run and the step (twice)."""
    m = fresh_mount()
    step = m.mnt / "checkpoints" / "run" / "s1"
    step.mkdir(parents=True)

    def getattrs() -> int:
        return json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())["mount"]["requests"].get("getattr", 0)

    (step / "first.bin").write_bytes(b"x" * 1000)
    before = getattrs()
    for i in range(20):
        with open(step / f"f{i}.bin", "wb") as f:
            f.write(bytes([i]) * 100_000)
    per_file = (getattrs() - before) / 20
    assert per_file <= 3.5, per_file
    for i in range(20):
        assert (step / f"f{i}.bin").read_bytes() == bytes([i]) * 100_000

"""A checkpoint writer's WRITEs answered by the library's front (mount/_interpose.c,
chunks_arm): a write-only writer appending at a chunk boundary has chunk buffers lent to
the front, which copies each WRITE into them and answers it without Python; a chunk
filled whole is persisted as a written one. Whatever the front does not take (a write
elsewhere, past the chunks lent) goes to Python with everything it took, in order, and so
does the file whenever anything else asks for it (its size, its bytes, a truncation, a
removal); the file a reader sees is what was written, byte for byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from distorefs_it import mount_stats

MiB = 1 << 20
CHUNK = 8 * MiB  # checkpoints' default chunk_bytes


def step_dir(m, name: str):
    d = m.mnt / "checkpoints" / name / "1"
    d.mkdir(parents=True)
    return d


def pattern(n: int, salt: int = 0) -> bytes:
    return bytes((i * 7 + salt) % 251 for i in range(4096)) * (n // 4096) + bytes(n % 4096)


def write_in_pieces(fd: int, data: bytes, piece: int = MiB) -> None:
    view = memoryview(data)
    for i in range(0, len(data), piece):
        rest = view[i:i + piece]
        while rest:
            rest = rest[os.write(fd, rest):]


def test_a_checkpoints_writes_reach_no_python(fs, request):
    """20.5 MiB in 1 MiB writes: every WRITE counted and answered by the front (Python
    sees what it sees of a one-write file), two whole chunks and the tail persisted, the
    bytes read back as written; the closed writer holds nothing there."""
    d = step_dir(fs, request.node.name)

    def save(name: str, data: bytes) -> tuple[dict, dict, dict]:
        before = mount_stats(fs)
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_in_pieces(fd, data)
        during = mount_stats(fs)
        os.close(fd)
        return before, during, mount_stats(fs)

    small_before, _, small_after = save("small.bin", b"x" * 4096)
    small_passed = small_after["front_passed"] - small_before["front_passed"]
    data = pattern(20 * MiB + MiB // 2)
    before, during, after = save("model.bin", data)
    writes = after["requests"].get("write", 0) - before["requests"].get("write", 0)
    chunked = after["writes_chunked"] - before["writes_chunked"]
    assert writes >= 21 and chunked == writes
    # every one read straight into its chunk, the first too (its chunks were lent at the open)
    assert after["writes_landed"] - before["writes_landed"] == writes
    assert after["chunks_filled"] - before["chunks_filled"] == 2  # the tail comes back at the close
    assert during["writers_chunked"] - before["writers_chunked"] == 1 and after["writers_chunked"] == 0
    assert after["front_passed"] - before["front_passed"] <= small_passed  # nothing per WRITE
    assert (d / "model.bin").read_bytes() == data
    assert os.stat(d / "model.bin").st_size == len(data)


def test_the_files_size_and_bytes_show_while_the_front_fills_its_chunks(fs, request):
    """An fstat, a stat by path and a read by another process mid-write see every byte
    written so far; the writes after them reach the front again from the next chunk
    boundary."""
    path = step_dir(fs, request.node.name) / "model.bin"
    data = pattern(30 * MiB, salt=3)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    write_in_pieces(fd, data[:13 * MiB])
    assert os.fstat(fd).st_size == 13 * MiB
    assert os.stat(path).st_size == 13 * MiB
    got = subprocess.run([sys.executable, "-c", f"import sys; sys.stdout.buffer.write(open({str(path)!r}, 'rb').read())"],
                         capture_output=True, check=True).stdout
    assert got == data[:13 * MiB]
    before = mount_stats(fs)
    write_in_pieces(fd, data[13 * MiB:])
    after = mount_stats(fs)
    os.close(fd)
    # 16..30 MiB is past the next boundary: the front's again
    assert after["writes_chunked"] - before["writes_chunked"] >= 14
    assert path.read_bytes() == data


def test_requests_that_come_while_a_writer_streams_land_whole_where_they_belong(fs, request):
    """The front reads each request after a checkpoint WRITE with its payload landing in the
    writer's chunks; other processes' requests meanwhile (1 MiB and small entry writes,
    stats, listings, xattrs, a rewrite of another checkpoint file) are moved back whole.
    Every file reads back as written."""
    d = step_dir(fs, request.node.name)
    buf = fs.buffer(request.node.name.replace("_", "-")[:40])
    data = pattern(48 * MiB, salt=11)
    script = (f"import os, sys\n"
              f"entries, other = {str(buf / 'entries')!r}, {str(d / 'other.bin')!r}\n"
              f"for i in range(40):\n"
              f"    body = bytes([i % 251]) * ((1 << 20) + i * 4097 if i % 2 else 300 + i)\n"
              f"    with open(os.path.join(entries, f'e{{i:03d}}'), 'wb') as f:\n"
              f"        f.write(body)\n"
              f"    os.listdir(entries)\n"
              f"    os.stat(os.path.join(entries, f'e{{i:03d}}'))\n"
              f"    os.listxattr(entries)\n"
              f"    with open(other, 'wb') as f:\n"
              f"        f.write(bytes([i]) * 70000)\n")
    others = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(2)]
    try:
        before = mount_stats(fs)
        fd = os.open(d / "model.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_in_pieces(fd, data)
        os.close(fd)
        after = mount_stats(fs)
    finally:
        codes = [p.wait(timeout=120) for p in others]
    assert codes == [0, 0]
    assert after["writes_landed"] > before["writes_landed"]
    assert (d / "model.bin").read_bytes() == data
    assert (d / "other.bin").read_bytes() == bytes([39]) * 70000
    for i in range(40):
        body = bytes([i % 251]) * ((1 << 20) + i * 4097 if i % 2 else 300 + i)
        assert (buf / "entries" / f"e{i:03d}").read_bytes() == body, i


def test_writers_streaming_at_once_each_get_their_own_bytes(fs, request):
    """Three processes write checkpoint files at once in 1 MiB writes (and one in odd-sized
    ones): the front reads for one writer at a time, so most WRITEs arrive while it reads
    for another and are moved back, or land in their own chunks; every file is whole."""
    d = step_dir(fs, request.node.name)
    sizes = {"a.bin": (40 * MiB, MiB), "b.bin": (40 * MiB + 4097, MiB), "c.bin": (24 * MiB + 3, 65536 + 17)}
    procs = []
    for i, (name, (size, piece)) in enumerate(sizes.items()):
        script = (f"import os, sys\n"
                  f"sys.path.insert(0, {str(os.path.dirname(__file__))!r})\n"
                  f"from test_chunked_writes import pattern, write_in_pieces\n"
                  f"fd = os.open({str(d / name)!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)\n"
                  f"write_in_pieces(fd, pattern({size}, salt={i + 20}), {piece})\n"
                  f"os.close(fd)\n")
        procs.append(subprocess.Popen([sys.executable, "-c", script]))
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    for i, (name, (size, _)) in enumerate(sizes.items()):
        assert (d / name).read_bytes() == pattern(size, salt=i + 20), name


def _as_locally(path, local, calls) -> None:
    for p in (path, local):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for call in calls:
                call(fd)
        finally:
            os.close(fd)


def test_writes_the_front_does_not_take_go_to_python_in_order(fs, request, tmp_path):
    """A rewrite behind the end, a hole past it, a truncation and appends after each:
    the file holds what the same calls leave in a local file."""
    path = step_dir(fs, request.node.name) / "model.bin"
    a, b = pattern(12 * MiB, salt=5), pattern(3 * MiB, salt=9)
    calls = [
        lambda fd: write_in_pieces(fd, a),
        lambda fd: os.pwrite(fd, b"rewritten" * 1000, 5 * MiB + 17),  # behind the end
        lambda fd: write_in_pieces(fd, b[:MiB]),  # (the file's end, mid-chunk: Python's)
        lambda fd: os.pwrite(fd, b"past", 20 * MiB + 5),  # a hole
        lambda fd: os.ftruncate(fd, 24 * MiB),  # to a chunk boundary: the front's again
        lambda fd: os.lseek(fd, 0, os.SEEK_END),
        lambda fd: write_in_pieces(fd, b),
        lambda fd: os.ftruncate(fd, 25 * MiB + 3),
    ]
    _as_locally(path, tmp_path / "local.bin", calls)
    assert path.read_bytes() == (tmp_path / "local.bin").read_bytes()


def test_a_file_unlinked_while_written_takes_its_writes_and_lets_go(fs, request):
    """Unlinked mid-write, the open file still takes writes (POSIX), its name is gone, and
    once closed nothing of it is held: no writer armed, the write-back budget back where
    it was."""
    path = step_dir(fs, request.node.name) / "model.bin"
    used = json.loads((fs.mnt / "checkpoints" / "stats.json").read_bytes())["writeback"]["held_bytes"]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_in_pieces(fd, pattern(9 * MiB))
        os.unlink(path)
        write_in_pieces(fd, pattern(9 * MiB))
    finally:
        os.close(fd)
    assert not path.exists()
    assert mount_stats(fs)["writers_chunked"] == 0
    deadline = time.monotonic() + 10
    while json.loads((fs.mnt / "checkpoints" / "stats.json").read_bytes())["writeback"]["held_bytes"] != used:
        assert time.monotonic() < deadline, "the budget did not come back"
        time.sleep(0.05)


def test_a_writer_waiting_for_the_budget_gets_the_chunks_lent_to_others(fresh_mount):
    """writeback_bytes of 4 chunks, all of them lent to the front for two armed writers
    that wrote a little and wait: a third writer's writes wait for the budget, which the
    lent chunks come back to (without that it waited for good), and every file ends whole."""
    m = fresh_mount()
    (m.mnt / "checkpoints" / "config.json").write_text(json.dumps({"writeback_bytes": 4 * CHUNK}))
    d = step_dir(m, "budget")
    little, much = pattern(MiB, salt=1), pattern(3 * CHUNK, salt=2)
    fds = [os.open(d / f"{name}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for name in "abc"]
    try:
        write_in_pieces(fds[0], little)  # (3 chunks lent)
        write_in_pieces(fds[1], little)  # (the last one)
        write_in_pieces(fds[2], much)
        write_in_pieces(fds[0], little)
        write_in_pieces(fds[1], little)
    finally:
        for fd in fds:
            os.close(fd)
    assert (d / "a.bin").read_bytes() == little + little
    assert (d / "b.bin").read_bytes() == little + little
    assert (d / "c.bin").read_bytes() == much


def test_chunks_the_front_filled_survive_a_remount(fresh_mount):
    m = fresh_mount()
    d = step_dir(m, "again")
    data = pattern(2 * CHUNK + 12345, salt=7)
    fd = os.open(d / "model.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    write_in_pieces(fd, data)
    os.fsync(fd)
    os.close(fd)
    m.remount()
    assert (m.mnt / "checkpoints" / "again" / "1" / "model.bin").read_bytes() == data

"""Reads racing evictions, rewrites and renames (several writers of entries, weights,
checkpoint and unsealed dataset files): ENOENT or a whole version, never EIO, a torn value
or a false corruption report."""

import errno
import json
import multiprocessing
import os
import struct
import time
import zlib

from distorefs_it import write_entry


def _writer(entries: str, seconds: float, q) -> None:
    end = time.time() + seconds
    i, errs = 0, []
    while time.time() < end:
        with open(os.path.join(entries, f"w{os.getpid()}-{i}"), "wb") as f:
            f.write(os.urandom(20000))
        i += 1
        if i % 5 == 0:  # rewrites too (an LMDB value replaced under the same location), of an
            try:        # entry the ring evicts now and then while it is being written
                with open(os.path.join(entries, "hot"), "wb") as f:
                    f.write(os.urandom(20000))
            except OSError as e:
                errs.append(("rewrite", e.errno))
    q.put(("writer", errs, i))


def _reader(bufdir: str, seconds: float, q) -> None:
    end = time.time() + seconds
    errs, reads = [], 0
    while time.time() < end:
        try:
            with open(os.path.join(bufdir, "batch", "8.npz"), "rb") as f:
                f.read()
            reads += 1
        except OSError as e:
            errs.append(("batch", e.errno))
        for name in os.listdir(os.path.join(bufdir, "entries"))[:3] + ["hot"]:
            try:
                with open(os.path.join(bufdir, "entries", name), "rb") as f:
                    got = len(f.read())
                if got != 20000:  # a reader found a writer's inode (truncated, being written)
                    errs.append(("short read", got))
                reads += 1
            except OSError as e:
                errs.append(("entry", e.errno))
    q.put(("reader", errs, reads))


def _run_all(procs: list, q, timeout: float) -> list:
    """Start the worker processes, take the result each puts on `q`, and join them."""
    for p in procs:
        p.start()
    results = [q.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return results


def test_no_eio_when_reads_race_evictions_and_rewrites(fresh_mount):
    m = fresh_mount("cache_bytes=0")
    b = m.buffer("race", {"capacity": 20, "compression": "none"})
    for i in range(20):
        write_entry(b, f"init{i}", os.urandom(20000))
    write_entry(b, "hot", os.urandom(20000))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(b / "entries"), 2.0, q)) for _ in range(2)]
    procs += [ctx.Process(target=_reader, args=(str(b), 2.0, q)) for _ in range(2)]
    results = _run_all(procs, q, timeout=60)
    readers = [r for r in results if r[0] == "reader"]
    assert sum(r[2] for r in readers) > 20  # the readers really read
    errs = [e for r in readers for e in r[1]]
    assert all(code == errno.ENOENT for _, code in errs), sorted(set(errs))
    # a writer's close stores its value even if the ring evicted the entry it was rewriting
    assert [e for r in results if r[0] == "writer" for e in r[1]] == []
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["corrupt_reads"] == 0


SHARED = ["hot", "warm", "shared0", "shared1", "shared2"]


def _sealed_value(i: int) -> bytes:
    """A value that says how long it is and what its CRC is: a reader can tell it whole."""
    body = os.urandom(1000 + i * 7919 % 30000)
    return struct.pack("<II", len(body), zlib.crc32(body)) + body


def _whole(data: bytes) -> bool:
    if len(data) < 8:
        return False
    n, crc = struct.unpack("<II", data[:8])
    return len(data) == 8 + n and zlib.crc32(data[8:]) == crc


def _name_writer(directory: str, seconds: float, q, wid: int, rename: bool, new_names: bool) -> None:
    """Rewrites the SHARED names, by temp file and rename or in place; `new_names`: every
    sixth write creates a name of its own."""
    end = time.time() + seconds
    i, errs = 0, []
    while time.time() < end:
        name = f"w{wid}-{i}" if new_names and i % 6 == 5 else SHARED[i % 6 % len(SHARED)]
        try:
            if rename:  # the atomic publish idiom: a temp file renamed over the name
                tmp = os.path.join(directory, f".tmp-{wid}-{i}")
                with open(tmp, "wb") as f:
                    f.write(_sealed_value(i))
                os.replace(tmp, os.path.join(directory, name))
            else:
                with open(os.path.join(directory, name), "wb") as f:
                    f.write(_sealed_value(i))
        except OSError as e:
            errs.append((name, e.errno))
        i += 1
    q.put(("writer", errs, i))


def _whole_reader(directory: str, seconds: float, q, evicting: bool) -> None:
    """Reads the SHARED names (and, where names are `evicting`, two listed ones, any of
    them possibly gone: ENOENT) and checks each whole."""
    end = time.time() + seconds
    errs, reads = [], 0
    while time.time() < end:
        for name in SHARED + (os.listdir(directory)[:2] if evicting else []):
            try:
                with open(os.path.join(directory, name), "rb") as f:
                    data = f.read()
            except OSError as e:
                if not (evicting and e.errno == errno.ENOENT):
                    errs.append((name, e.errno))
                continue
            reads += 1
            if not _whole(data):
                errs.append((name, "not whole", len(data)))
    q.put(("reader", errs, reads))


def _race(directory, writers: int, *, rename: bool = False, evicting: bool = False) -> list:
    """Each SHARED name written once, then `writers` writers and 3 readers of `directory`
    for 5 s; the errors any of them met. `evicting`: a buffer's entries/, where writers
    create new names too and the ring evicts."""
    for name in SHARED:
        with open(directory / name, "wb") as f:
            f.write(_sealed_value(1))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_name_writer, args=(str(directory), 5.0, q, k, rename, evicting))
             for k in range(writers)]
    procs += [ctx.Process(target=_whole_reader, args=(str(directory), 5.0, q, evicting)) for _ in range(3)]
    results = _run_all(procs, q, timeout=90)
    assert sum(r[2] for r in results if r[0] == "reader") > 100  # the readers really read
    return [e for r in results for e in r[1]]


def test_writers_of_the_same_names_never_show_readers_part_of_a_value(fresh_mount):
    """4 writers rewrite and create the same few names while the ring evicts them and 3
    readers read them: every read is a whole value (or ENOENT), every write succeeds. A
    writer never writes through an inode readers may share: one committed but not yet
    released, one its writers left, or another writer's create its retry came upon."""
    m = fresh_mount("cache_bytes=0")
    b = m.buffer("names", {"capacity": 20, "compression": "none"})
    assert _race(b / "entries", 4, evicting=True) == []
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["corrupt_reads"] == 0


def test_weights_replaced_by_rename_are_read_whole_while_old_versions_go(fresh_mount):
    """Two writers publish three names by temp file and rename, 3 readers read them: every
    read is a whole version. The replaced files' versions are freed as they go unread,
    never under a reader that opened one (EIO before: freed by the rename's transaction
    while the name still opened the old file)."""
    m = fresh_mount("cache_bytes=0")
    d = m.mnt / "weights" / "run"
    d.mkdir(parents=True)
    assert _race(d, 2, rename=True) == []
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["corrupt_reads"] == 0


def test_unsealed_dataset_files_rewritten_by_many_writers_are_read_whole(fresh_mount):
    """4 writers rewrite three files of an unsealed dataset, 3 readers read them: every read
    is a whole version, never EIO. A rewrite stores its chunks where the version before
    kept them; a reader holding the old record reads the file as it is now."""
    m = fresh_mount("cache_bytes=0")
    (m.mnt / "datasets" / "ds").mkdir(parents=True)
    assert _race(m.mnt / "datasets" / "ds" / "items", 4) == []
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["corrupt_reads"] == 0


def test_checkpoint_files_replaced_by_rename_are_read_whole(fresh_mount):
    """4 writers replace the files of a step by temp file and rename, 3 readers read them:
    every read is a whole file, never EIO or ESTALE. A replaced file keeps its data until
    its last reader closes (EIO before: freed by the rename's transaction while the name
    still opened it), and for a second after it lost its name (ESTALE before: a reader's
    lookup and open, and the kernel's one retry, each straddled a replace)."""
    m = fresh_mount("cache_bytes=0")
    d = m.mnt / "checkpoints" / "run" / "step-1"
    d.mkdir(parents=True)
    assert _race(d, 4, rename=True) == []
    stats = json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["corrupt_reads"] == 0

"""LOOKUPs of names an `entries/` directory lacks, answered ENOENT by the library's front
(mount/_interpose.c absent_names): the kernel looks every new entry's name up before it
creates it. The front holds the directory's names (the ring's keys and the names of inodes
writers created and hold) and answers only names it does not hold; every name that
exists must still be found, through every way a name comes and goes.

The mounts here keep no name in the kernel's cache (entry_timeout=0), so every stat is a
LOOKUP the daemon answers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from distorefs_it import mount_stats


def answered(m) -> int:
    return mount_stats(m)["lookups_answered_absent"]


def exists(path) -> bool:
    try:
        os.stat(path)
        return True
    except FileNotFoundError:
        return False


@pytest.fixture
def uncached(fresh_mount):
    m = fresh_mount("entry_timeout=0")
    (m.mnt / "buffers" / "b").mkdir()
    return m


def test_names_that_come_and_go_are_found_and_the_front_answers_the_rest(uncached):
    """Inserts (the table grows past its first 64 slots), deletes in random order (slots
    emptied in the middle of probe runs), re-inserts and renames: afterwards every name
    that exists is found, every other is not, and the front answered the misses."""
    d = uncached.mnt / "buffers" / "b" / "entries"
    names = [f"e{i}" for i in range(1500)]
    before = answered(uncached)
    for name in names:
        (d / name).write_bytes(name.encode())
    # each create's LOOKUP but the first (the directory's names are handed over at it)
    assert answered(uncached) - before >= len(names) - 1
    rng = random.Random(5)
    gone = rng.sample(names, 900)
    for name in gone:
        os.unlink(d / name)
    back = gone[:300]
    for name in back:
        (d / name).write_bytes(b"again")
    for i, name in enumerate(rng.sample(sorted(set(names) - set(gone)), 50)):
        os.rename(d / name, d / f"moved{i}")
    present = set(os.listdir(d))
    expected = (set(names) - set(gone)) | set(back)
    assert len(present) == len(expected)  # (50 of them renamed)
    before = answered(uncached)
    for name in names + [f"moved{i}" for i in range(50)]:
        assert exists(d / name) == (name in present), name
    missing = len(names) + 50 - len(present)
    assert answered(uncached) - before == missing  # each miss the front's, no hit
    assert (d / "moved0").read_bytes()  # (a moved entry reads)
    assert (d / back[0]).read_bytes() == b"again"


def test_a_name_being_written_is_found_by_another_process(uncached):
    """A create's inode is found by its name before its writer closes (another process's
    stat shows what was written so far)."""
    d = uncached.mnt / "buffers" / "b" / "entries"
    (d / "first").write_bytes(b"x")  # (the directory's names with the front from here on)
    path = d / "writing"
    # started first: a process forked while the file is open closes its copy of the
    # descriptor at exec, and that close's FLUSH would commit what was written
    other = subprocess.Popen([sys.executable, "-c", f"import os\ninput()\nprint(os.stat({str(path)!r}).st_size)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with open(path, "wb", buffering=0) as f:
        f.write(b"y" * 700)
        out, _ = other.communicate("\n", timeout=60)
        assert other.returncode == 0
        assert int(out) == 700
    assert path.read_bytes() == b"y" * 700
    os.unlink(path)
    assert not exists(path)


def test_names_held_before_a_remount_are_found_after_it(fresh_mount):
    """The names a store holds when it is mounted (the ring loaded from the catalog) are
    the front's from the directory's first LOOKUP on; evicted names are not found."""
    m = fresh_mount("entry_timeout=0")
    b = m.mnt / "buffers" / "b"
    b.mkdir()
    (b / "config.json").write_text(json.dumps({"capacity": 200}))
    for i in range(260):
        (b / "entries" / f"n{i}").write_bytes(b"v%d" % i)
    m.umount()
    m.mount()
    d = m.mnt / "buffers" / "b" / "entries"
    before = answered(m)
    found = [exists(d / f"n{i}") for i in range(260)]
    assert found == [i >= 60 for i in range(260)]  # the 60 oldest evicted
    assert answered(m) - before >= 59  # (the first LOOKUP hands the names over)
    assert (d / "n259").read_bytes() == b"v259"


def _insert_and_tell(d: str, prefix: str, n: int, done) -> None:
    for i in range(n):
        path = os.path.join(d, f"{prefix}{i}")
        with open(path, "wb") as f:
            f.write(b"x" * (100 + i))
        done.put(path)  # after close() returned
    done.put(None)


def test_an_entry_is_found_by_others_as_soon_as_its_close_returned(uncached):
    """Writers in three processes insert while this one stats each name the moment its
    writer's close() returned (close-to-open: the name is the front's before the FLUSH is
    answered), and names that were never created are answered by the front meanwhile."""
    import multiprocessing

    d = uncached.mnt / "buffers" / "b" / "entries"
    (d / "first").write_bytes(b"x")
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Queue()
    writers = [ctx.Process(target=_insert_and_tell, args=(str(d), f"w{k}-", 200, done)) for k in range(3)]
    for w in writers:
        w.start()
    seen = ended = 0
    before = answered(uncached)
    try:
        while ended < len(writers):
            path = done.get(timeout=120)
            if path is None:
                ended += 1
                continue
            assert os.stat(path).st_size >= 100, path
            assert not exists(path + ".never")
            seen += 1
    finally:
        for w in writers:
            w.join(timeout=60)
    assert seen == 600 and all(w.exitcode == 0 for w in writers)
    assert answered(uncached) - before >= 600  # the misses (and the creates' LOOKUPs), the front's

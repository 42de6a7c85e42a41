"""The inode table's numbers: counter numbers never reused, stable numbers the same each
time their object is looked up again after the kernel forgot it."""

from __future__ import annotations

from mount.inodes import DATASET_FILE, WEIGHTS_FILE, InodeTable, stable_number


class Obj:
    open_handles = 0


def test_a_stable_number_comes_back_after_a_forget():
    t = InodeTable()
    n = stable_number(WEIGHTS_FILE, 0, 42)
    a = t.intern(("wfile", 42, 0), Obj, n)
    assert a.ino == n
    t.looked_up(n)
    t.forget(n, 1)
    b = t.intern(("wfile", 42, 0), Obj, n)
    assert b is not a and b.ino == n


def test_counter_numbers_are_never_reused():
    t = InodeTable()
    a = t.intern(("x",), Obj)
    t.looked_up(a.ino)
    t.forget(a.ino, 1)
    assert t.intern(("x",), Obj).ino != a.ino


def test_a_stable_number_held_by_another_object_falls_back_to_the_counter():
    t = InodeTable()
    n = stable_number(DATASET_FILE, 3, 7)
    held = t.intern(("dsitem", 3, 0, 7), Obj, n)  # before a seal renumbered the items
    t.looked_up(held.ino)
    other = t.intern(("dsitem", 3, 1, 7), Obj, n)
    assert held.ino == n and other.ino != n and other.ino < n


def test_stable_numbers_are_distinct_and_bounded():
    assert len({stable_number(k, s, o) for k in (1, 9) for s in (0, 1) for o in (0, 1)}) == 8
    assert stable_number(WEIGHTS_FILE, 0, 1 << 32) is None
    assert stable_number(WEIGHTS_FILE, 1 << 16, 1) is None
    assert stable_number(15, (1 << 16) - 1, (1 << 32) - 1) < 1 << 53

"""The front's tables of attributes it answers GETATTR with (mount/_interpose.c `held`, `kept`): holds
Python keeps (hold_attributes) stay until forgotten; ones given once at an OPEN
(give_attributes) make room for others when the table is full, and never push a lasting
hold out; and lasting holds leave HELD_ONCE_ROOM slots to attributes given once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.setdlopenflags(sys.getdlopenflags() | os.RTLD_GLOBAL)
    from distorefs.mount import _interpose as lib

    def give(ino, once):
        return lib.give_attributes(ino, 0o100444, 1, 0, 0, 10 + ino, 1, 4096, 0, 0, 0, 60.0, once)

    def held():
        return lib.front_tables()["held"]

    MAX, ROOM = lib.HOLDS_MAX, lib.HELD_ONCE_ROOM  # (ROOM: slots only attributes given once take)
    assert all(give(i, True) for i in range(1, MAX + 1)) and held() == MAX
    assert give(MAX + 1, True) and held() == MAX  # the first given made room
    assert lib.hold_attributes(100_000, True) and held() == MAX  # so does a lasting hold
    for ino in range(200_000, 200_000 + MAX - ROOM - 1):
        assert lib.hold_attributes(ino, True)
    assert held() == MAX  # MAX - ROOM lasting holds (100000 and these), the rest given once
    assert not lib.hold_attributes(300_001, True)  # no more: the rest is for attributes given once
    assert not give(300_002, False)  # (given to last, likewise)
    assert give(300_000, True)  # takes the place of the first one given once
    assert not lib.hold_attributes(300_000, True)  # and stays one given once
    assert give(200_000, True)  # a lasting hold given new attributes stays one
    for ino in range(400_000, 400_000 + ROOM):
        assert give(ino, True)  # the ones given once make room for each other
    assert held() == MAX
    lib.hold_attributes(200_000, False)
    assert lib.hold_attributes(300_001, True)  # the room it left
    assert not lib.hold_attributes(300_003, True)
    assert held() == MAX
    print("done", flush=True)
""")


def test_attributes_given_once_make_room_and_lasting_holds_stay():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=40)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


KEPT_SCRIPT = textwrap.dedent("""
    import os, random, sys
    sys.setdlopenflags(sys.getdlopenflags() | os.RTLD_GLOBAL)
    from distorefs.mount import _interpose as lib

    def keep(ino):
        return lib.keep_attributes(ino, 0o100444, 1, 0, 0, ino, 1, 4096, 0, 0, 0, 300.0)

    def kept():
        return lib.front_tables()["kept"]

    rng = random.Random(7)
    inos = rng.sample(range(1, 1 << 40), 8192)
    assert all(keep(i) for i in inos) and kept() == 8192
    assert not keep(1 << 41)  # full: the rest is Python's to answer
    assert keep(inos[0]) and kept() == 8192  # one kept already is found, not added again
    gone = set(rng.sample(inos, 4096))
    for i in gone:
        lib.hold_attributes(i, False)  # forgotten
    assert kept() == 4096
    # every one left is still found after the others' removal (none is kept twice)
    assert all(keep(i) for i in inos if i not in gone) and kept() == 4096
    assert all(keep(i) for i in gone) and kept() == 8192
    print("done", flush=True)
""")


def test_kept_attributes_are_found_after_others_are_forgotten():
    r = subprocess.run([sys.executable, "-c", KEPT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])

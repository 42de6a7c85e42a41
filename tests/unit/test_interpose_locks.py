"""The library's tables (mount/_interpose.c) are guarded by a mutex that the front's thread,
which never holds the GIL, shares with Python's threads. A call from Python must never hold
that mutex while it makes Python objects: an allocation may run the cycle collector, whose
callbacks are Python code that lets go of the GIL, and another Python thread that then
takes the GIL and waits for the mutex would never let the first one go on. A cold epoch
deadlocked so (the event loop in take_opened under a collector callback, the page cache
pusher in answer_opens): every reader of the mount hung in OPEN."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, os, sys, threading, time
    sys.setdlopenflags(sys.getdlopenflags() | os.RTLD_GLOBAL)
    from distorefs.mount import _interpose as lib
    sys.setswitchinterval(1e-6)  # the GIL changes hands as often as it can
    gc.set_threshold(5)  # a collection every few allocations
    gc.callbacks.append(lambda phase, info: time.sleep(0.0002))  # lets go of the GIL, as any Python code may
    stop = time.monotonic() + float(sys.argv[1])

    def tables():
        kept = []  # held, so that each dict is new (not one of the free list's, which no collection follows)
        while time.monotonic() < stop:
            kept.append(lib.front_tables())  # a dict made while the tables are read
            if len(kept) > 5000:
                kept.clear()

    def marks():
        ino = 1
        while time.monotonic() < stop:
            lib.answer_opens(ino, os.O_RDONLY, 1)  # takes the mutex with the GIL held
            lib.hold_attributes(ino, False)  # drops the mark again
            ino = ino % 1000 + 1

    threads = [threading.Thread(target=f) for f in (tables, marks, tables, marks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("done", flush=True)
""")


def test_a_collection_while_a_table_is_read_does_not_deadlock_another_thread():
    r = subprocess.run([sys.executable, "-c", SCRIPT, "5"], capture_output=True, text=True, timeout=40)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])

"""The daemon's malloc settings (mount/daemon.py, _Glibc): a request's megabyte is the memory
the request before it freed, not memory touched for the first time."""

import subprocess
import sys

# In a process of its own: the settings are process-wide. Each block is a copy, as pyfuse3
# makes a WRITE's bytes: every page is written, so new memory costs a fault per 4 KiB page.
CODE = """
import resource
from distorefs.mount.daemon import _Glibc
_Glibc()
def faults():
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
src = memoryview(b"x" * (2 << 20))
keep = []
bytes(src[:1 << 20])  # the first one: new memory, once
before = faults()
for i in range(50):
    data = bytes(src[:(1 << 20) + 64 * i])  # a 1 MiB WRITE's bytes, freed when its request ends
    keep.append(bytes(200))  # what the request leaves behind
    del data
print(faults() - before)
"""


def test_a_requests_megabyte_reuses_the_memory_the_one_before_freed():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    faults = int(out.stdout)
    assert faults < 50 * 256 // 10, f"{faults} page faults for 50 blocks of 1 MiB (256 pages each)"


# The trims of an idle daemon: one each TRIM_IDLE_TICKS ticks while nothing is served, one
# at the first tick after a request.
IDLE = """
import trio
from distorefs.mount.daemon import TRIM_IDLE_TICKS, _Glibc
g = _Glibc()
trims = []
served = [0]

class Counted:  # the C library, its trims counted
    def __init__(self, libc):
        self.libc = libc
    def __getattr__(self, name):
        return getattr(self.libc, name)
    def malloc_trim(self, pad):
        trims.append(pad)
        return self.libc.malloc_trim(pad)

g.libc = Counted(g.libc)

async def main():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(g.trim_every, 0.02, lambda: served[0])
        await trio.sleep(0.1)
        before = len(trims)
        await trio.sleep(0.8)  # 40 ticks, nothing served
        idle = len(trims) - before
        served[0] += 1
        await trio.sleep(0.05)
        print(idle, len(trims) - before - idle, 40 // TRIM_IDLE_TICKS)
        nursery.cancel_scope.cancel()

trio.run(main)
"""


def test_an_idle_daemon_trims_its_heap_seldom_and_soon_after_a_request():
    out = subprocess.run([sys.executable, "-c", IDLE], capture_output=True, text=True, check=True)
    idle, after_request, expected = map(int, out.stdout.split())
    assert idle <= expected + 1, f"{idle} trims in 40 idle ticks"
    assert after_request >= 1, "no trim in the ticks after a request"

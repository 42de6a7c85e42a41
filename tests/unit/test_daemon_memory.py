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

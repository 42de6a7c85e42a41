"""The compiled parts, all optional: mount/_interpose.c (see mount/interpose.py; without a C
compiler or libfuse's headers the package installs and closes send FLUSH as before),
distorefs/_sumtree.c (see distorefs/sumtree.py; without it the sum tree runs on numpy alone)
and distorefs/_batchfill.c (see distorefs/batch.py; without it small batch files are made
in Python)."""

import subprocess

from setuptools import Extension, setup


def pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.split()


cflags = pkg_config("--cflags")
libs = pkg_config("--libs") or ["-lfuse3"]

setup(ext_modules=[Extension(
    "distorefs.mount._interpose",
    sources=["mount/_interpose.c"],
    depends=["distorefs/crc32.h"],
    include_dirs=[f[2:] for f in cflags if f.startswith("-I")],
    extra_compile_args=[f for f in cflags if not f.startswith("-I")],
    library_dirs=[f[2:] for f in libs if f.startswith("-L")],
    libraries=[f[2:] for f in libs if f.startswith("-l")] + ["dl"],
    optional=True,
), Extension(
    "distorefs._sumtree",
    sources=["distorefs/_sumtree.c"],
    extra_compile_args=["-O2"],
    optional=True,
), Extension(
    "distorefs._batchfill",
    sources=["distorefs/_batchfill.c"],
    depends=["distorefs/crc32.h"],
    extra_compile_args=["-O2"],
    optional=True,
)])

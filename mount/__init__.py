"""The FUSE layer: a thin pyfuse3 translation of inodes and handles into core calls."""

# Before any module of this package imports pyfuse3: its calls to the libfuse functions
# distorefs takes over must bind to mount/_interpose.c's definitions (see interpose.py).
from . import interpose  # noqa: F401

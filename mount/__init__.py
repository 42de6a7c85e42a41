"""The FUSE layer: a thin pyfuse3 translation of inodes and handles into core calls."""

# Before any module of this package imports pyfuse3: its replies to OPEN must bind to
# mount/_openreply.c's fuse_reply_open (see openreply.py).
from . import openreply  # noqa: F401

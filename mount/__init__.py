"""The FUSE layer: a thin pyfuse3 translation of inodes and handles into core calls."""

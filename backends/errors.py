"""Errors the value tiers and the metadata engine raise.

Backends sit below the core and know nothing of it: they raise these, and the core's value
layer and committer turn them into the core's typed errors (distorefs/errors.py), which
carry the errno a caller sees.
"""

from __future__ import annotations


class BackendError(Exception):
    """Base of every error a backend raises on purpose."""


class Missing(BackendError):
    """No value at that location (never stored, deleted, or its segment collected)."""


class Damaged(BackendError):
    """The bytes at a location do not verify (record header, length or checksum)."""


class Full(BackendError):
    """No room: the disk, the LMDB map or a directory's capacity."""


class BadRequest(BackendError):
    """An argument the backend cannot take (a key too long, a malformed location)."""


class Unreadable(BackendError):
    """The engine's own files are damaged past reading (a truncated LMDB file): nothing of
    the store can be opened safely."""


class ReadOnly(BackendError):
    """The engine was opened read-only (a read-only mount): nothing can be written."""


class Unavailable(BackendError):
    """A shared engine did not answer, or did not replicate a write, within its time limit."""


class NotReplicated(Unavailable):
    """A write was made on a master but did not reach its replicas in time: it must not be
    made again (the engine's retries stop at it)."""

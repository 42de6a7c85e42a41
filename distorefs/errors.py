"""Typed errors of the core, each carrying the errno a POSIX caller should see.

The core raises these at the source; only the FUSE layer turns them into
`FUSEError(exc.errno)`. Nothing classifies errors by their message text.
"""

from __future__ import annotations

import errno as _errno

from distorefs.backends import errors as _backend


class DistorefsError(Exception):
    """Base of every error the core raises on purpose."""

    errno: int = _errno.EIO


class InvalidName(DistorefsError):
    errno = _errno.EINVAL


class NameTooLong(InvalidName):
    """A name over 255 bytes (ENAMETOOLONG, as Linux filesystems answer)."""

    errno = _errno.ENAMETOOLONG


class InvalidArgument(DistorefsError):
    errno = _errno.EINVAL


class InvalidConfig(DistorefsError):
    errno = _errno.EINVAL


class NotFound(DistorefsError):
    errno = _errno.ENOENT


class AlreadyExists(DistorefsError):
    errno = _errno.EEXIST


class NotEmpty(DistorefsError):
    errno = _errno.ENOTEMPTY


class ReadOnly(DistorefsError):
    errno = _errno.EROFS


class NotPermitted(DistorefsError):
    errno = _errno.EACCES


class OperationNotPermitted(DistorefsError):
    """What a Linux filesystem refuses with EPERM (special files, hard links here)."""

    errno = _errno.EPERM


class Unsupported(DistorefsError):
    """An extended attribute name the namespace does not know (ENOTSUP)."""

    errno = _errno.ENOTSUP


class TooLarge(DistorefsError):
    errno = _errno.EFBIG


class NoSpace(DistorefsError):
    errno = _errno.ENOSPC


class IsADirectory(DistorefsError):
    errno = _errno.EISDIR


class NotADirectory(DistorefsError):
    errno = _errno.ENOTDIR


class CrossDevice(DistorefsError):
    """A rename between namespaces: EXDEV, so tools fall back to copy and delete."""

    errno = _errno.EXDEV


class Stale(DistorefsError):
    errno = _errno.ESTALE


class Busy(DistorefsError):
    """In use here, where the change would take it away (EBUSY)."""

    errno = _errno.EBUSY


class CorruptValue(DistorefsError):
    """A stored value whose checksum does not match: the read fails with EIO."""

    errno = _errno.EIO


class WouldBlock(DistorefsError):
    errno = _errno.EAGAIN


class EngineUnavailable(DistorefsError):
    """The shared engine (a Redis Cluster) did not answer or replicate in time: EIO, and
    nothing acknowledged."""

    errno = _errno.EIO


class StoreLocked(DistorefsError):
    """The store directory is already opened (mounted) by another process."""

    errno = _errno.EBUSY


class RecoveryFailed(DistorefsError):
    """A store left open by a crash still has problems after automatic recovery: it is not
    opened (EUCLEAN, "structure needs cleaning", as a filesystem that needs fsck)."""

    errno = _errno.EUCLEAN


class Interrupted(DistorefsError):
    """A request gave up waiting because its caller is gone or has a signal to take (EINTR):
    the kernel waits for the daemon's answer even through SIGKILL (distorefs/waiting.py)."""

    errno = _errno.EINTR


class DamagedStore(DistorefsError):
    """The store's files are damaged in a way no check or repair can read past (a truncated
    LMDB file, unreadable pages): it is not opened for writing (EUCLEAN)."""

    errno = _errno.EUCLEAN


def from_backend(exc: BaseException) -> BaseException:
    """The core error for an error a backend raised (backends/errors.py); anything else
    is returned as it is."""
    for kind, mapped in ((_backend.Missing, NotFound), (_backend.Damaged, CorruptValue), (_backend.Full, NoSpace),
                         (_backend.BadRequest, InvalidArgument), (_backend.Unreadable, DamagedStore),
                         (_backend.ReadOnly, ReadOnly), (_backend.Unavailable, EngineUnavailable)):
        if isinstance(exc, kind):
            return mapped(str(exc))
    return exc

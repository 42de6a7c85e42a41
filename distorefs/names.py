"""Validation of the names users give to entries and namespaces (DESIGN.md §2, Errors)."""

from __future__ import annotations

from .errors import InvalidName

MAX_NAME_BYTES = 255


def check_name(name: bytes) -> bytes:
    """Return `name` if it is a valid single path component, else raise InvalidName (EINVAL)."""
    if not name:
        raise InvalidName("empty name")
    if len(name) > MAX_NAME_BYTES:
        raise InvalidName(f"name longer than {MAX_NAME_BYTES} bytes ({len(name)})")
    if name in (b".", b".."):
        raise InvalidName(f"reserved name {name!r}")
    if b"/" in name or b"\0" in name:
        raise InvalidName(f"name contains '/' or NUL: {name!r}")
    return name

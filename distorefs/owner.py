"""Who owns a file or a namespace: mode (with the file type bits) and uid/gid, as stat shows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Owner:
    mode: int
    uid: int
    gid: int

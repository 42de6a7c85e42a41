"""Restore points of checkpoint files: what a crash must give back.

A restore point is a file's state (its name, attributes, size and stored chunks) as it was
when it was last acknowledged: when its step was last complete (taken as the step is
reopened), or when an fsync of it returned. It lives in the catalog (`r` + file id) until
its step completes again; meanwhile the chunk values it names are *pinned*: a rewrite, a
truncate or a removal of the file leaves them in place (the live file no longer names
them), and they are freed when the restore point goes and nothing else names them.

After a crash, recovery puts every file of a step that has restore points back to them
(distorefs/checkpoints.py, `Restore`): a reopened step goes back to the content it had
when it was last complete (plus what an fsync acknowledged since), so it is complete
again; files acknowledged by fsync in a step never complete are kept as acknowledged.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from .values import StoredValue


@dataclass
class RestorePoint:
    file_id: int
    step_id: int
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    size: int
    chunk_bytes: int
    chunks: dict[int, StoredValue] = field(default_factory=dict)

    def pack(self) -> bytes:
        return json.dumps({"step": self.step_id, "parent": self.parent, "name": self.name.hex(), "mode": self.mode,
                           "uid": self.uid, "gid": self.gid, "atime_ns": self.atime_ns, "mtime_ns": self.mtime_ns,
                           "ctime_ns": self.ctime_ns, "size": self.size, "chunk_bytes": self.chunk_bytes,
                           "chunks": {str(i): c.pack().hex() for i, c in self.chunks.items()}}).encode()

    @classmethod
    def unpack(cls, file_id: int, data: bytes) -> "RestorePoint":
        d = json.loads(data)
        return cls(file_id, d["step"], d["parent"], bytes.fromhex(d["name"]), d["mode"], d["uid"], d["gid"],
                   d["atime_ns"], d["mtime_ns"], d["ctime_ns"], d["size"], d["chunk_bytes"],
                   {int(i): StoredValue.unpack_from(bytes.fromhex(c), 0)[0] for i, c in d["chunks"].items()})

    def values(self) -> set[tuple[int, bytes]]:
        return {(c.tier, c.loc) for c in self.chunks.values()}


class Pins:
    """The chunk values restore points name (a value may be named by several)."""

    def __init__(self) -> None:
        self.count: Counter[tuple[int, bytes]] = Counter()

    def add(self, rp: RestorePoint) -> None:
        self.count.update(rp.values())

    def remove(self, rp: RestorePoint) -> None:
        self.count.subtract(rp.values())
        self.count = +self.count

    def __contains__(self, value: StoredValue) -> bool:
        return self.count.get((value.tier, value.loc), 0) > 0


__all__ = ["RestorePoint", "Pins"]

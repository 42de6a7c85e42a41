"""A snapshot's weights/ records (distorefs/weightsreplay.py) give the tree the whole log
gives: random sequences of the log's weights records (publishes, directories, removals,
renames and exchanges, also ones a follower refuses) applied by a real store's
WeightsLog, against the compacted records applied to another store. No FUSE, no Redis."""

from __future__ import annotations

import json
import random

import pytest

from distorefs.clusterlog import Record
from distorefs.errors import DistorefsError
from distorefs.weights import ROOT_ID
from distorefs.weightslog import WeightsLog
from distorefs.weightsreplay import compact
from store_runner import run

PATHS = ["a", "b", "d/a", "d/b", "d/e/a", "e", "e/a"]


def _records(seed: int, n: int) -> list[Record]:
    rng = random.Random(seed)
    out = []
    number = 0
    for i in range(n):
        op = rng.choice(["wpublish"] * 5 + ["wmkdir", "wremove", "wrename", "wrename"])
        path = "weights/" + rng.choice(PATHS)
        owner = rng.choice([(0o100644, 0, 0), (0o100600, 1000, 1000)])
        fields = {b"op": op.encode(), b"ns": path.encode(), b"origin": b"n1", b"mode": str(owner[0]).encode(),
                  b"uid": str(owner[1]).encode(), b"gid": str(owner[2]).encode()}
        if op == "wpublish":
            number += rng.choice([1, 1, 1, -2])  # now and then an older version, arriving late
            fields[b"version"] = json.dumps({"number": max(number, 1), "size": i, "mtime_ns": i,
                                             "checksum": i, "chunk_bytes": 0, "chunks": []}).encode()
        elif op == "wmkdir":
            fields[b"mode"] = b"16877"
        elif op == "wrename":
            fields[b"to"] = ("weights/" + rng.choice(PATHS)).encode()
            fields[b"exchange"] = rng.choice([b"0", b"0", b"1"])
        out.append(Record.of(b"%d-0" % (i + 1), fields))
    return out


def _tree_after(tmp_path, records: list[Record]) -> set:
    async def go(store):
        applier = WeightsLog(store.weights, None, store.committer, "me")  # type: ignore[arg-type]
        for rec in records:
            try:  # as the follower does: a refused record is logged, and the next one applied
                await applier.apply(rec)
            except DistorefsError:
                pass
        await store.committer.drain()
        tree = store.weights
        out = set()
        stack = [tree.nodes[ROOT_ID]]
        while stack:
            node = stack.pop()
            for child_id in node.children.values():
                child = tree.nodes[child_id]
                out.add((tree.path_of(child), child.kind, child.mode, child.uid, child.gid, child.number))
                stack.append(child)
        return out

    return run(tmp_path, go)


@pytest.mark.parametrize("seed", range(8))
def test_the_compacted_records_give_the_tree_the_whole_log_gives(tmp_path, seed):
    records = _records(seed, 300)
    whole = _tree_after(tmp_path / "whole", records)
    fields = compact((r.op, r.name, r.fields) for r in records)
    compacted = _tree_after(tmp_path / "compacted", [Record.of(b"%d-0" % (i + 1), f) for i, f in enumerate(fields)])
    assert compacted == whole
    assert len(fields) <= len(whole) < len(records)

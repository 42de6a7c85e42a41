"""`distorefs verify` as a library: a clean store passes every pass; each kind of damage
is found by the pass that owns it, --repair fixes what is safe and the store then passes."""

import os
import struct

import lmdb
import numpy as np
import pytest

from distorefs.checkpoints import ROOT_ID as CK_ROOT
from distorefs.catalog import DB_ENTRIES, DB_PRIO, DB_SAMPLED, entry_key, pack_f64, pack_u32
from distorefs.errors import StoreLocked
from distorefs.owner import Owner
from distorefs.store import Store
from distorefs.verify import EXIT_CLEAN, EXIT_PROBLEMS, EXIT_REPAIRED, PASSES, verify_store
from distorefs.weights import ROOT_ID
from store_runner import run

DIR = Owner(0o40755, 0, 0)
FILE = Owner(0o100644, 0, 0)
RNG = np.random.default_rng(7)
BIG = RNG.integers(0, 256, 700 << 10, dtype=np.uint8).tobytes()  # goes to a segment file
MARK = b"<<verify-victim>>"


async def publish(tree, parent, name, data):
    return await tree.write_file(parent, name, data, FILE)


def build(path):
    """A store with a buffer (small, big, compressed entries), a bank, weights and a dataset."""
    async def body(store):
        buf = await store.create_buffer("replay", DIR)
        for i in range(20):
            await buf.insert(b"k%02d" % i, bytes([i]) * (3000 + i), FILE)
        victim = bytearray(BIG)
        victim[1000:1000 + len(MARK)] = MARK
        await buf.insert(b"big", bytes(victim), FILE)
        await buf.insert(b"big2", BIG[::-1], FILE)
        await buf.set_priorities([(b"k01", 2.5)])
        await buf.sample(4)
        await buf.ring.delete(b"k05")
        bank = await store.create("banks", "mem", DIR)
        await bank.insert(b"b0", b"bank value", FILE)
        model = await store.weights.mkdir(ROOT_ID, b"model", DIR)
        await publish(store.weights, model.id, b"w.bin", BIG)
        await publish(store.weights, model.id, b"w.bin", BIG[:5000])
        await store.weights.symlink(model.id, b"latest", b"w.bin", FILE)
        ds = await store.create("datasets", "imgs", DIR)
        await ds.put(1, b"a.bin", b"dataset item" * 100, FILE)
        await ds.seal()
        ck = store.checkpoints  # a durable checkpoint step of two chunks
        await ck.configure(b'{"chunk_bytes": 65536}')
        run_dir = await ck.mkdir(CK_ROOT, b"run", DIR)
        step = await ck.mkdir(run_dir.id, b"step-1", DIR)
        f = await ck.create(step.id, b"model.bin", FILE)
        await ck.write(f, 0, BIG[:100_000])
        ck.flushed(f)
        ck.released(f, write=True)
        await ck.sync_dir(step)
        await store.sync()
        # space for --repair to reclaim: every segment holds a live value except this one
        await buf.insert(b"gone", BIG[:600 << 10], FILE)
        await buf.ring.delete(b"gone")
    run(path, body, config={"segment_bytes": 1 << 20})


def raw_env(path):
    return lmdb.open(str(path / "meta"), max_dbs=32, subdir=True)


def test_clean_store_passes_every_pass(tmp_path):
    build(tmp_path / "s")
    seen = []
    report = verify_store(tmp_path / "s", on_pass=lambda name, summary, found: seen.append(name))
    assert seen == [p.name for p in PASSES]
    assert [f for f in report.problems] == [], report.findings
    assert report.exit_code == EXIT_CLEAN
    assert report.counts["entries"] == 21 + 1  # buffer + bank
    assert report.counts["weights_versions"] == 2
    assert report.counts["dataset_items"] == 1
    assert report.counts["checkpoint_chunks"] == 2
    assert report.counts["bad_values"] == 0
    # the store still mounts (opens) normally afterwards and verify changed nothing
    Store(tmp_path / "s").close()
    assert verify_store(tmp_path / "s").exit_code == EXIT_CLEAN


def test_refuses_a_store_in_use(tmp_path):
    store = Store(tmp_path / "s")
    try:
        with pytest.raises(StoreLocked):
            verify_store(tmp_path / "s")
    finally:
        store.close()


def test_flipped_segment_bytes_are_reported_not_repaired(tmp_path):
    build(tmp_path / "s")
    hits = [(seg, seg.read_bytes().find(MARK)) for seg in sorted((tmp_path / "s" / "segments").glob("seg-*"))]
    seg, at = next((s, a) for s, a in hits if a >= 0)
    with open(seg, "r+b") as f:
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in MARK))
    report = verify_store(tmp_path / "s", repair=True)
    bad = [f for f in report.problems if f.check == "values"]
    assert len(bad) == 1 and "buffers/replay/entries/big" in bad[0].message and not bad[0].repair
    assert report.exit_code == EXIT_PROBLEMS


def test_dangling_rows_leaks_and_accounting_are_repaired(tmp_path):
    build(tmp_path / "s")
    env = raw_env(tmp_path / "s")
    entries, prio, sampled = (env.open_db(n) for n in (DB_ENTRIES, DB_PRIO, DB_SAMPLED))
    values, segments, meta = env.open_db(b"values"), env.open_db(b"segments"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(entry_key(1, 999), pack_f64(1.0), db=prio)  # a priority of no entry
        txn.put(entry_key(1, 2), pack_f64(float("nan")), db=prio)  # a NaN priority
        txn.put(entry_key(77, 1), pack_u32(3), db=sampled)  # of no namespace
        txn.put(b"orphan-value", b"x" * 5000, db=values)  # leaked value
        row = next(iter(txn.cursor(db=segments)))
        live, total, n, stream = struct.unpack("<QQQI", row[1])
        txn.put(row[0], struct.pack("<QQQI", live + 1, total, n + 1, stream), db=segments)  # wrong accounting
        # an entry of a dropped namespace, with its value
        k = entry_key(55, 1)
        rec = bytes(txn.get(entry_key(1, 1), db=entries))
        txn.put(b"dropped-ns-value", b"y", db=values)
        txn.put(k, rec, db=entries)
        txn.put(b"next_ns", pack_u32(1), db=meta)  # below existing namespace ids
    env.close()

    report = verify_store(tmp_path / "s")
    kinds = {(f.check, f.kind) for f in report.problems}
    assert ("ring-indexes", "error") in kinds and ("lmdb-space", "leak") in kinds
    assert ("segments", "error") in kinds and ("namespaces", "error") in kinds
    assert ("ring-entries", "error") in kinds
    assert report.exit_code == EXIT_PROBLEMS
    assert not any(f.repair for f in report.findings)

    fixed = verify_store(tmp_path / "s", repair=True)
    assert fixed.exit_code == EXIT_REPAIRED, [f for f in fixed.unrepaired]
    assert all(f.repair for f in fixed.problems)
    assert any(f.kind == "space" and f.repair == "removed" for f in fixed.findings)
    after = verify_store(tmp_path / "s")
    assert after.exit_code == EXIT_CLEAN, after.problems
    assert not [f for f in after.findings if f.kind == "space"]

    async def still_there(store):
        buf = store.buffer("replay")
        assert len(buf.ring) == 21
        assert await buf.ring.read(buf.ring.get(b"big2")) == BIG[::-1]
        assert store.namespace("banks", "mem")
        created = await store.create_buffer("new", DIR)  # next_ns repaired: a fresh id
        assert created.ns_id not in (buf.ns_id, store.namespace("banks", "mem").ns_id)
    run(tmp_path / "s", still_there)


def test_unreachable_weights_node_goes_to_lost_and_found(tmp_path):
    build(tmp_path / "s")
    env = raw_env(tmp_path / "s")
    wnodes = env.open_db(b"wnodes")
    import json
    with env.begin(write=True) as txn:
        for k, v in txn.cursor(db=wnodes):
            record = json.loads(bytes(v))
            if bytes.fromhex(record["name"]) == b"model":
                record["parent"] = 4242  # its parent is gone
                txn.put(bytes(k), json.dumps(record).encode(), db=wnodes)
    env.close()
    report = verify_store(tmp_path / "s", repair=True)
    lost = [f for f in report.problems if f.check == "weights-tree"]
    assert len(lost) == 1 and "lost+found" in lost[0].repair
    assert verify_store(tmp_path / "s").exit_code == EXIT_CLEAN

    async def moved(store):
        node = store.weights.resolve(lost[0].repair.split("weights/")[1] + "/w.bin")
        assert await store.weights.read(node, node.current, 0, 5000) == BIG[:5000]
    run(tmp_path / "s", moved)


def test_unknown_database_blocks_freeing_space(tmp_path):
    build(tmp_path / "s")
    env = raw_env(tmp_path / "s")
    values, other = env.open_db(b"values"), env.open_db(b"someone-elses")
    with env.begin(write=True) as txn:
        txn.put(b"maybe-referenced", b"z" * 100, db=values)
        txn.put(b"k", b"maybe-referenced", db=other)
    env.close()
    report = verify_store(tmp_path / "s", repair=True)
    leak = [f for f in report.problems if f.check == "lmdb-space"]
    assert leak and not leak[0].repair
    assert any("someone-elses" in f.message for f in report.findings if f.kind == "note")
    env = raw_env(tmp_path / "s")
    values = env.open_db(b"values")
    with env.begin() as txn:
        assert txn.get(b"maybe-referenced", db=values) is not None
    env.close()


def test_sparse_and_rewritten_weights_files_verify_clean(tmp_path):
    """Holes are no chunks (a file only truncated holds none), and a rewrite keeps the chunks
    it did not change: neither is a problem for verify (nor so for the recovery at mount)."""
    async def body(store):
        tree = store.weights
        await store.configure_weights(b'{"chunk_bytes": 65536}')
        model = await tree.mkdir(ROOT_ID, b"m", DIR)
        node, _ = await tree.create(model.id, b"holes", FILE, exclusive=True)
        for change in (lambda w: w.truncate(10 << 20), lambda w: w.write(5 << 20, b"x"), lambda w: w.write(0, BIG)):
            writer = await tree.open_write(node, node.gen, truncate=False, readable=False, redirect=False)
            await change(writer)
            await writer.flush()
            await writer.release()
        assert [v.size for v in node.versions][-2:] == [10 << 20, 10 << 20]
        only, _ = await tree.create(model.id, b"only-holes", FILE, exclusive=True)
        writer = await tree.open_write(only, only.gen, truncate=False, readable=False, redirect=False)
        await writer.truncate(3 << 20)
        await writer.flush()
        await writer.release()
        assert only.current.chunks == [] and only.current.size == 3 << 20
        assert await tree.read(node, node.current, (5 << 20) - 1, 3) == b"\0x\0"
    run(tmp_path / "s", body)
    report = verify_store(tmp_path / "s")
    assert report.problems == [], report.findings

"""The priority write-ahead file (distorefs/priowal.py): records the mount's front appended
and acknowledged are committed at the next open if the daemon that took them did not, each
exactly once, in order; what is cut short or damaged ends the file; a record of a buffer
gone since is done with all the same. No FUSE: the records are written as the front writes
them (the integration tests check the front writes what this reads)."""

import os
import zlib

from distorefs import priowal
from distorefs.owner import Owner
from store_runner import run

DIR = Owner(0o40755, 0, 0)
FILE = Owner(0o100644, 0, 0)


def append(store_path, *records: tuple[int, int, bytes]) -> None:
    with open(store_path / priowal.FILE_NAME, "ab") as f:
        for ns_id, number, text in records:
            f.write(priowal.pack(ns_id, number, text))


def priorities(store, name="replay") -> dict[bytes, float]:
    buf = store.buffer(name)
    return {m.key: float(buf.sampler.priority[m.slot]) for m in buf.ring.oldest()}


async def make_buffer(store, name="replay", keys=(b"a", b"b", b"c")):
    buf = await store.create_buffer(name, DIR)
    for key in keys:
        await buf.insert(key, b"x", FILE)
    return buf.ns_id


def test_records_read_back_and_a_damaged_tail_ends_them():
    texts = [b"a 1\n", b"b 2.5\nc 3\n", b""]
    data = b"".join(priowal.pack(7, n + 1, t) for n, t in enumerate(texts))
    assert [(r.ns_id, r.number, r.text) for r in priowal.read_records(data)] == [(7, 1, texts[0]), (7, 2, texts[1]),
                                                                                (7, 3, b"")]
    # the CRC is zlib's, over the header before it and the text
    head = data[:20]
    assert int.from_bytes(data[20:24], "little") == zlib.crc32(texts[0], zlib.crc32(head))
    assert len(priowal.read_records(data[:-1])) == 2  # the last record (empty text) missing a byte of its CRC
    cut = data[:len(data) - priowal.HEADER.size - 2]
    assert len(priowal.read_records(cut)) == 1  # the second cut inside its text, the third gone
    flipped = bytearray(data)
    flipped[priowal.HEADER.size + 1] ^= 1  # the first record's text
    assert priowal.read_records(bytes(flipped)) == []


def test_records_not_committed_are_committed_at_the_next_open_once(tmp_path):
    path = tmp_path / "s"

    async def setup(store):
        return await make_buffer(store, keys=(b"raw", b"a", b"b", b"c"))
    ns_id = run(path, setup)
    # as a daemon killed right after its front acknowledged them leaves them
    append(path, (ns_id, 1, b"a 5\nb 6\n"), (ns_id, 2, b"a 7\nnobody 1\n"), (ns_id + 100, 3, b"a 9\n"))

    async def reopened(store):
        wal = store.priority_wal
        assert wal.replayed == 3 and wal.applied == 3 and wal.next_number == 4
        assert priorities(store) == {b"raw": 1.0, b"a": 7.0, b"b": 6.0, b"c": 1.0}
        assert os.path.getsize(path / priowal.FILE_NAME) == 0  # all committed: emptied
        return store.stats()["priority_wal"]
    assert run(path, reopened) == {"applied": 3, "replayed": 3}

    # a record at or below the committed number is never applied again; numbering goes on
    append(path, (ns_id, 2, b"a 100\n"), (ns_id, 4, b"b 8\n"))

    async def again(store):
        assert store.priority_wal.replayed == 1 and store.priority_wal.next_number == 5
        assert priorities(store)[b"a"] == 7.0 and priorities(store)[b"b"] == 8.0
    run(path, again)

    async def quiet(store):  # nothing left: nothing replayed, the number kept
        assert store.priority_wal.replayed == 0 and store.priority_wal.next_number == 5
    run(path, quiet)


def test_a_record_cut_short_is_not_applied_and_what_follows_it_is_not_read(tmp_path):
    path = tmp_path / "s"
    ns_id = run(path, make_buffer)
    whole = priowal.pack(ns_id, 1, b"a 2\n")
    torn = priowal.pack(ns_id, 2, b"b 3\n")[:-3]  # a power loss inside the append
    (path / priowal.FILE_NAME).write_bytes(whole + torn)

    async def reopened(store):
        assert store.priority_wal.replayed == 1
        assert priorities(store) == {b"a": 2.0, b"b": 1.0, b"c": 1.0}
        assert os.path.getsize(path / priowal.FILE_NAME) == 0
    run(path, reopened)


def test_records_committed_live_are_not_replayed(tmp_path):
    """What the mount does with the records its front took: commit each with its number
    (Store.commit_priority_record); a reopened store then has nothing to replay, even with
    the file not emptied (below its 1 MiB trim)."""
    path = tmp_path / "s"

    async def body(store):
        ns_id = await make_buffer(store)
        wal = store.priority_wal
        for n, text in enumerate([b"a 4\n", b"b 5\n", b"c bad\n"], start=wal.next_number):
            append(path, (ns_id, n, text))
            await store.commit_priority_record(ns_id, n, text).wait()  # (the bad line: the number alone)
        assert wal.applied == 3
        return ns_id
    run(path, body)
    assert os.path.getsize(path / priowal.FILE_NAME) > 0

    async def reopened(store):
        assert store.priority_wal.replayed == 0 and store.priority_wal.next_number == 4
        assert priorities(store) == {b"a": 4.0, b"b": 5.0, b"c": 1.0}
    run(path, reopened)

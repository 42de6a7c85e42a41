"""Entries parsed once (distorefs/layout.py) and batches gathered from slices
(distorefs/batch.py), checked byte for byte against numpy; the format-1 migration."""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib

import numpy as np
import pytest

from distorefs.backends.lmdbenv import LmdbEnv
from distorefs import batch as batch_module
from distorefs.batch import Batch, Blob, BatchFile, Member, Stacked, _array_member, batch_file, zip_parts
from distorefs.catalog import DB_ENTRIES, DB_META, DB_NS, FORMAT_VERSION, EntryMeta, pack_u32
from distorefs.codec import checksums
from distorefs.config import BufferConfig
from distorefs.errors import InvalidConfig
from distorefs.layout import Layout, NotStackable, SlotPlaces, pack_places, parse, place, unpack_places
from distorefs.owner import Owner
from distorefs.values import StoredValue
from store_runner import run

OWNER = Owner(0o100644, 0, 0)
DIR = Owner(0o40755, 0, 0)


def npy(a: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, a)
    return out.getvalue()


def npz(compressed: bool = False, **arrays) -> bytes:
    out = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(out, **arrays)
    return out.getvalue()


def transition(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"obs": rng.standard_normal((4, 3)).astype(np.float32), "action": np.int64(i),
            "reward": np.float32(i / 10), "done": np.bool_(i % 2)}


# ----- parsing ---------------------------------------------------------------------------------

def test_npy_entry_layout_and_offset():
    a = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    data = npy(a)
    layout, (off,) = parse(data)
    assert layout == Layout("npy", (layout.fields[0],)) and layout.fields[0].shape == (2, 3, 4)
    assert layout.fields[0].dtype == "<i2" and layout.fields[0].nbytes == a.nbytes
    assert data[off:] == a.tobytes()


def test_npz_entry_fields_in_order_with_their_bytes():
    t = transition(3)
    data = npz(**t)
    layout, offsets = parse(data)
    assert [f.name for f in layout.fields] == list(t)
    for f, off in zip(layout.fields, offsets):
        assert data[off:off + f.nbytes] == np.asarray(t[f.name]).tobytes()


@pytest.mark.parametrize("data, why", [
    (npy(np.asfortranarray(np.arange(6).reshape(2, 3))), "Fortran"),
    (npy(np.array([{"a": 1}], dtype=object)), "Python objects"),
    (npz(compressed=True, x=np.arange(100)), "compressed member"),
    (npy(np.arange(10))[:-3], "bytes of array data"),
    (b"\x80\x04pickled", "neither an .npy"),
    (b"PK\x03\x04 not really a zip", "not a ZIP"),
])
def test_what_cannot_be_stacked_says_why(data, why):
    with pytest.raises(NotStackable, match=why):
        parse(data)


def test_place_against_a_layout():
    layout, _ = parse(npz(**transition(0)))
    t = transition(1)
    reordered = npz(reward=t["reward"], done=t["done"], obs=t["obs"], action=t["action"])
    offsets = place(layout, reordered)  # the same arrays in another member order
    for f, off in zip(layout.fields, offsets):
        assert reordered[off:off + f.nbytes] == np.asarray(t[f.name]).tobytes()
    with pytest.raises(NotStackable, match="differs"):
        place(layout, npz(**{**t, "obs": t["obs"].astype(np.float64)}))
    with pytest.raises(NotStackable, match="differs"):
        place(layout, npz(obs=t["obs"], action=t["action"]))
    with pytest.raises(NotStackable, match=r"an \.npy entry in a buffer of \.npz"):
        place(layout, npy(np.zeros(3)))


def _zipped(members: dict, when: tuple, descriptor: bool = False) -> bytes:
    """An .npz as np.savez writes it, its members stamped `when`; `descriptor`: written
    through a stream that cannot seek, so each member is followed by a data descriptor."""
    class Unseekable(io.RawIOBase):
        def __init__(self) -> None:
            self.out = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.out += b
            return len(b)

    sink = Unseekable() if descriptor else io.BytesIO()
    with zipfile.ZipFile(sink, "w") as z:  # type: ignore[arg-type]
        for name, a in members.items():
            with z.open(zipfile.ZipInfo(name + ".npy", date_time=when), "w") as f:
                np.lib.format.write_array(f, np.asarray(a))
    return bytes(sink.out) if descriptor else sink.getvalue()


def test_an_entry_like_the_last_one_placed_is_placed_from_its_skeleton(monkeypatch):
    """Entries of a layout that differ from the last one placed only in their arrays and in
    what np.savez stamps anew (times, dates, CRC-32s) are placed without a parse, at the
    same offsets; one whose headers differ (a field renamed or retyped at the same size)
    is parsed and refused as before; one with data descriptors is parsed every time."""
    def members(i: int, name: str = "obs", dtype=np.float32) -> dict:
        return {name: np.full(8, i, dtype=dtype), "action": np.int64(i), "done": np.bool_(i % 2)}

    first = _zipped(members(0), (2026, 1, 1, 0, 0, 0))
    layout, offsets = parse(first)
    assert place(layout, first) == offsets
    parses = []
    real_parse = parse

    def counted(data, unread=None):
        parses.append(len(data))
        return real_parse(data, unread)
    monkeypatch.setattr("distorefs.layout.parse", counted)
    for i in range(1, 6):
        later = _zipped(members(i), (2026, 11, 30, 12, i, 2 * i))
        assert later != first and len(later) == len(first)
        assert place(layout, later) == offsets == real_parse(later)[1]
    assert parses == []
    for other in (members(1, name="obz"), members(1, dtype=np.int32)):  # same size, other headers
        with pytest.raises(NotStackable):
            place(layout, _zipped(other, (2026, 1, 1, 0, 0, 0)))
    assert len(parses) == 2
    streamed = [_zipped(members(i), (2026, 1, 1, 0, 0, 2 * i), descriptor=True) for i in range(3)]
    s_layout, s_offsets = real_parse(streamed[0])
    assert s_layout == layout
    for data in streamed:
        assert place(layout, data) == real_parse(data)[1]
    assert len(parses) == 2 + len(streamed)


def test_schema_json_and_validation():
    layout, _ = parse(npz(**transition(0)))
    assert Layout.from_json(layout.to_json()) == layout
    config = BufferConfig.from_dict({"schema": {"format": "npy", "dtype": "float32", "shape": [84, 84]}})
    assert config.schema == {"format": "npy", "dtype": "<f4", "shape": [84, 84]}
    assert BufferConfig.from_dict({"schema": config.schema, "raw": True}).schema is None  # raw wins
    for bad in ({"format": "npz"}, {"format": "npy", "dtype": "O", "shape": []},
                {"format": "npy", "dtype": "<f4", "shape": [-1]}, {"format": "csv"}, []):
        with pytest.raises(InvalidConfig):
            BufferConfig.from_dict({"schema": bad})


def test_places_by_slot():
    places = SlotPlaces(2)
    places.grow(4)
    places.set(1, pack_places([10, 200], [7, 8]))
    places.set(3, pack_places([11, 300], [9, 10]))
    assert unpack_places(pack_places([1, 2], [3, 4])) == ((1, 2), (3, 4))
    offsets, crcs = places.take(np.array([3, 1]))
    assert offsets.tolist() == [[11, 300], [10, 200]] and crcs.tolist() == [[9, 10], [7, 8]]
    assert places.take(np.array([1, 2])) is None  # slot 2 has no places
    places.clear(3)
    assert places.take(np.array([3])) is None


# ----- batch files, byte for byte ----------------------------------------------------------------

def _batch(entries: list[bytes], layout: Layout | None) -> tuple[Batch, list[bytes]]:
    metas, offs, crcs = [], [], []
    for i, data in enumerate(entries):
        places = b""
        if layout is not None:
            o = place(layout, data)
            crc = checksums(data, [(a, f.nbytes) for a, f in zip(o, layout.fields)])[1]
            offs.append(o)
            crcs.append(crc)
            places = pack_places(o, crc)
        value = StoredValue(len(data), len(data), zlib.crc32(data), 0, 0, b"loc%d" % i)
        metas.append(EntryMeta(i + 1, b"key-%d" % i, value, 0o100644, 0, 0, 0, places))
    n = len(entries)
    batch = Batch(metas, np.linspace(0.1, 0.2, n), np.linspace(1, 0.5, n),
                  places=(np.array(offs, dtype=np.int64), np.array(crcs, dtype=np.uint32)) if layout else None)
    return batch, entries


def _load(f: BatchFile) -> dict:
    data = bytes(f)
    assert len(data) == f.size
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None  # every member's CRC-32 is right
    with np.load(io.BytesIO(data)) as z:
        return {k: z[k] for k in z.files}


def test_npy_batch_is_np_stack_of_the_entries():
    arrays = [np.random.default_rng(i).integers(0, 255, size=(16, 84, 84), dtype=np.uint8) for i in range(5)]
    entries = [npy(a) for a in arrays]
    layout, _ = parse(entries[0])
    z = _load(batch_file(*_batch(entries, layout), layout))
    assert z["data"].dtype == np.uint8 and z["data"].tobytes() == np.stack(arrays).tobytes()
    assert list(z["keys"]) == [f"key-{i}" for i in range(5)] and list(z["seqs"]) == [1, 2, 3, 4, 5]
    assert z["probabilities"].dtype == z["weights"].dtype == np.float64


def test_npz_batch_stacks_each_field_and_renames_reserved_ones():
    ts = [{**transition(i), "keys": np.int64(100 + i)} for i in range(7)]
    entries = [npz(**t) for t in ts]
    layout, _ = parse(entries[0])
    z = _load(batch_file(*_batch(entries, layout), layout))
    for name in ("obs", "action", "reward", "done"):
        expected = np.stack([np.asarray(t[name]) for t in ts])
        assert z[name].dtype == expected.dtype and z[name].shape == expected.shape
        assert z[name].tobytes() == expected.tobytes()
    assert list(z["entry_keys"]) == [100 + i for i in range(7)] and list(z["keys"])[0] == "key-0"


def test_raw_batch_concatenates():
    entries = [b"first", b"", b"the third entry", npy(np.arange(3))]
    z = _load(batch_file(*_batch(entries, None), None))
    off = z["offsets"]
    assert [bytes(z["data"][off[i]:off[i + 1]]) for i in range(4)] == entries


def test_reads_at_any_offset_are_slices_of_the_whole():
    # 9 x 160 KB: the data member is gathered from slices of the entries at each read
    arrays = [np.arange(40_000 * i, 40_000 * i + 39_999, dtype=np.int32) for i in range(9)]
    entries = [npy(a) for a in arrays]
    layout, _ = parse(entries[0])
    f = batch_file(*_batch(entries, layout), layout)
    whole = bytes(f)
    rng = np.random.default_rng(0)
    assert any(isinstance(p, Stacked) for p in f.parts)
    for _ in range(300):
        off = int(rng.integers(0, f.size + 10))
        size = int(rng.integers(0, 400_000))
        assert bytes(f.read(off, size)) == whole[off:off + size]
    # the same reads gathered into a reused buffer (too small for some: those get new bytes)
    scratch = bytearray(300_000)
    for _ in range(300):
        off = int(rng.integers(0, f.size + 10))
        size = int(rng.integers(0, 400_000))
        got = f.read(off, size, scratch)
        assert bytes(got) == whole[off:off + size]
        scratch[:] = b"\xee" * len(scratch)  # the next read must not depend on what was left


def test_zip64_archives_load():
    members = [_array_member("a.npy", np.arange(10)), _array_member("b.npy", np.ones((3, 3)))]
    data = bytes(BatchFile(zip_parts(members, force_zip64=True)))
    with np.load(io.BytesIO(data)) as z:
        assert list(z["a"]) == list(range(10)) and z["b"].sum() == 9
    assert parse(data)[0].kind == "npz"  # the parser reads ZIP64 records too
    assert isinstance(Member("x", b"", Blob(b""), 0).size, int)


# ----- the format-1 migration ------------------------------------------------------------------------

def _downgrade_to_format_1(path) -> None:
    """Rewrite a store's entry records as format 1 wrote them (no places), format key 1."""
    env = LmdbEnv(path / "meta")
    for db in (DB_META, DB_ENTRIES, DB_NS):
        env.db(db)

    def fn(txn):
        rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(DB_ENTRIES)]
        for k, v in rows:
            m = EntryMeta.unpack(int.from_bytes(k[4:], "big"), v)
            rec = struct.pack("<QQIBBIIIqH", m.value.size, m.value.stored_size, m.value.checksum, m.value.codec,
                              m.value.tier, m.mode, m.uid, m.gid, m.mtime_ns, len(m.value.loc))
            txn.put(k, rec + m.value.loc + m.key, db=DB_ENTRIES)
        for k, v in list(txn.cursor(DB_NS)):
            record = json.loads(bytes(v))
            record["config"].pop("schema", None)
            record["config"].pop("raw", None)
            txn.put(bytes(k), json.dumps(record).encode(), db=DB_NS)
        txn.put(b"format", pack_u32(1), db=DB_META)
    env.write(fn)
    env.close()


def test_a_format_1_store_is_migrated(tmp_path):
    async def write(store):
        buf = await store.create_buffer("arrays", DIR)
        for i in range(6):
            await buf.insert(b"t%d" % i, npz(**transition(i)), OWNER)
        mixed = await store.create_buffer("mixed", DIR)
        await store.configure_buffer("mixed", b'{"raw": true}')
        await mixed.insert(b"a", npy(np.zeros(3)), OWNER)
        await mixed.insert(b"b", b"plain bytes", OWNER)

    run(tmp_path / "s", write)
    _downgrade_to_format_1(tmp_path / "s")

    async def read(store):
        buf = store.buffer("arrays")
        assert buf.config.schema is not None and buf.layout is not None
        assert all(len(m.places) == 12 * 4 for m in buf.ring.oldest())
        await store.configure_buffer("arrays", b'{"sampler": "fifo"}')
        _, f = await buf.sample_npz(6)
        z = _load(f)
        assert z["obs"].tobytes() == np.stack([transition(i)["obs"] for i in range(6)]).tobytes()
        assert store.buffer("mixed").config.raw  # entries of two layouts: raw mode
        return store.env.read(lambda txn: bytes(txn.get(b"format", db=DB_META)))

    assert run(tmp_path / "s", read) == pack_u32(FORMAT_VERSION)


def test_a_small_batch_file_from_its_template_is_the_zip_built_record_by_record():
    """A small batch file is a copy of a per-layout image with the members' bytes and CRCs
    written in (batch._SmallZip): byte for byte the archive zip_parts builds, for members of
    several sizes (an empty one too), and again for other bytes of the same sizes."""
    rng = np.random.default_rng(3)
    for round_ in range(3):
        arrays = {"obs": rng.standard_normal((8, 4)).astype(np.float32),
                  "action": rng.integers(0, 9, size=8, dtype=np.int64),
                  "none": np.zeros((8, 0), dtype=np.float32),
                  "keys": np.array([f"k{round_}-{i}" for i in range(8)])}
        members = [_array_member(name + ".npy", a) for name, a in arrays.items()]
        generic = [_array_member(name + ".npy", a) for name, a in arrays.items()]
        for m in generic:
            m.crc = zlib.crc32(bytes(m.body.data), zlib.crc32(m.head))  # the record-by-record way
        expected = bytes(BatchFile(zip_parts(generic)))
        f = batch_module._file(members)
        assert bytes(f) == expected
        assert zipfile.ZipFile(io.BytesIO(expected)).testzip() is None
        with np.load(io.BytesIO(bytes(f))) as z:
            for name, a in arrays.items():
                assert z[name].dtype == a.dtype and np.array_equal(z[name], a)


def _rows_batch(ts: list[dict], named: bool) -> tuple[Batch, Layout]:
    """A batch of npz entries as a buffer that keeps rows draws it: each entry's fields side
    by side in a row (distorefs/rows.py), its names from the ring's table when `named`."""
    entries = [npz(**t) for t in ts]
    layout, _ = parse(entries[0])
    batch, _ = _batch(entries, layout)
    rows = np.zeros((len(entries), sum(f.nbytes for f in layout.fields)), dtype=np.uint8)
    for i, data in enumerate(entries):
        rows[i] = np.frombuffer(b"".join(data[o:o + f.nbytes] for o, f in zip(place(layout, data), layout.fields)),
                                dtype=np.uint8)
    batch.rows = rows
    batch.seqs = np.array([m.seq for m in batch.metas], dtype=np.int64)
    if named:
        batch.names = np.array([m.key for m in batch.metas], dtype="S16")
    return batch, layout


def test_a_batch_of_rows_made_in_one_call_is_the_file_made_in_python(monkeypatch):
    """The file of a batch drawn from rows, made by distorefs/_batchfill.c (the fields gathered
    from the rows, the names cast to str, each member's CRC set in a copy of the image): byte
    for byte the file batch_file makes member by member in Python, for batches of several
    sizes, names of several lengths from the ring's table or from the entries, a field
    renamed; one past SMALL, or with an array not contiguous, is left to Python."""
    if batch_module._batchfill is None:
        pytest.fail("distorefs/_batchfill.c is not built (make deps builds it)")
    calls = []
    fill = batch_module._batchfill.fill
    monkeypatch.setattr(batch_module._batchfill, "fill", lambda *a: calls.append(1) or fill(*a))
    for n, named in ((1, True), (64, True), (64, False), (300, True)):
        ts = [{**transition(i), "keys": np.int64(100 + i), "frame": np.full((5, 7), i % 251, dtype=np.uint8)}
              for i in range(n)]
        batch, layout = _rows_batch(ts, named)
        before = len(calls)
        made = bytes(batch_file(batch, None, layout))
        assert len(calls) == before + 1
        with monkeypatch.context() as m:
            m.setattr(batch_module, "_batchfill", None)
            assert made == bytes(batch_file(batch, None, layout))
        z = _load(BatchFile([Blob(made)]))
        for name in ("obs", "action", "reward", "done", "frame"):
            assert z[name].tobytes() == np.stack([np.asarray(t[name]) for t in ts]).tobytes()
        assert list(z["entry_keys"]) == [100 + i for i in range(n)] and list(z["keys"])[-1] == f"key-{n - 1}"
    strided, layout = _rows_batch([transition(i) for i in range(9)], True)
    strided.probabilities = np.linspace(0.1, 0.2, 18)[::2]  # not contiguous: made in Python
    before = len(calls)
    made = bytes(batch_file(strided, None, layout))
    assert len(calls) == before
    assert np.array_equal(_load(BatchFile([Blob(made)]))["probabilities"], strided.probabilities)
    assert batch_module._batchfill.ascii_keys(np.array([b"k\xff"], dtype="S4")) is None  # (cast by numpy then)
    big, layout = _rows_batch([{"x": np.full(4096, i, dtype=np.uint8)} for i in range(80)], True)
    before = len(calls)
    made = bytes(batch_file(big, None, layout))  # 320 KiB: past SMALL, parts as before
    assert len(calls) == before
    assert _load(BatchFile([Blob(made)]))["x"].shape == (80, 4096)

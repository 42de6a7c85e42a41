"""The Python client beside the mount (distorefs.client) against real mounts: the same
arrays as batch/N.npz for the same draw, values read from LMDB and segment files in this
process, never torn or stale while the daemon moves, evicts and rewrites them, damage named,
pipelined inserts acknowledged by flush, and the file path as a fallback."""

from __future__ import annotations

import glob
import io
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from distorefs.client import ClientBuffer, FileBuffer, InsertFailed, open_buffer
from distorefs.errors import CorruptValue
from distorefs_it import get_stats, make_payload, set_config, verify_payload, write_entry


def _npz_entry(i: int) -> bytes:
    import io
    out = io.BytesIO()
    rng = np.random.default_rng(i)
    np.savez(out, obs=rng.standard_normal((4, 3)).astype(np.float32), action=np.int64(i),
             reward=np.float64(i / 7), offsets=np.arange(3, dtype=np.int16) + i)
    return out.getvalue()


def _load_batch(buf, n: int) -> dict[str, np.ndarray]:
    with np.load(buf / "batch" / f"{n}.npz") as npz:
        return {name: npz[name] for name in npz.files}


def _same_draw(buf, seed: int, draw):
    """draw() with the buffer's sampler reseeded to `seed` (the same draw twice)."""
    set_config(buf, {"seed": seed + 1})
    set_config(buf, {"seed": seed})
    return draw()


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), name


def _fill_prioritized(buf, count: int, entry=_npz_entry) -> None:
    set_config(buf, {"sampler": "prioritized", "alpha": 0.7, "beta": 0.5, "presample_batches": 0})
    for i in range(count):
        write_entry(buf, f"e{i:03d}", entry(i))
    with open(buf / "priorities", "w") as f:
        f.writelines(f"e{i:03d} {1 + (i % 7) * 0.5}\n" for i in range(count))


def test_sample_is_batch_npz_for_the_same_draw(buf):
    _fill_prioritized(buf, 40)
    with open_buffer(buf, direct=True) as client:
        assert isinstance(client, ClientBuffer)
        mine = _same_draw(buf, 11, lambda: client.sample(16))
    theirs = _same_draw(buf, 11, lambda: _load_batch(buf, 16))
    assert "entry_offsets" in mine and "obs" in mine and mine["obs"].shape == (16, 4, 3)
    assert len(set(mine["weights"].tolist())) > 1  # prioritized: the weights say something
    assert client.counters["rows"] == 1  # narrow entries: the fields came in the daemon's answer
    _assert_same(mine, theirs)


def test_a_remounted_buffer_answers_from_values_then_rows_alike(fresh_mount):
    """After a remount the daemon's rows (distorefs/rows.py) are empty: a draw answers with
    the values' places and the client reads them (batch/N.npz reads the values); the rows
    are read back behind that draw, and the same draw answered from them gives the same
    arrays, through the client and batch/N.npz alike."""
    m = fresh_mount()
    buf = m.buffer("remounted", {"presample_batches": 0})
    _fill_prioritized(buf, 200)

    def rows_filled(count: int) -> None:
        deadline = time.monotonic() + 20
        while (get_stats(buf)["rows"] or {}).get("filled", 0) < count:
            assert time.monotonic() < deadline, get_stats(buf)["rows"]
            time.sleep(0.05)

    m.umount()
    m.mount()
    with open_buffer(buf, direct=True) as client:
        client_values = _same_draw(buf, 7, lambda: client.sample(64))
        assert client.counters["rows"] == 0
        rows_filled(200)
        client_rows = _same_draw(buf, 7, lambda: client.sample(64))
        assert client.counters["rows"] == 1
    file_rows = _same_draw(buf, 7, lambda: _load_batch(buf, 64))
    m.umount()
    m.mount()
    assert get_stats(buf)["rows"] is None  # made at the first draw
    file_values = _same_draw(buf, 7, lambda: _load_batch(buf, 64))
    _assert_same(client_values, client_rows)
    _assert_same(client_rows, file_rows)
    _assert_same(file_rows, file_values)
    rows_filled(200)  # read back behind the file path's draw too


def test_raw_and_npy_buffers_match_batch_npz(fs):
    raw = fs.buffer("client-raw", {"presample_batches": 0})
    for i in range(20):
        write_entry(raw, f"r{i}", make_payload(f"r{i}", 100 + 37 * i))
    npy = fs.buffer("client-npy", {"presample_batches": 0})
    import io
    for i in range(20):
        out = io.BytesIO()
        np.save(out, np.full((5, 2), i, dtype=np.uint16))
        write_entry(npy, f"n{i}", out.getvalue())
    for path in (raw, npy):
        with open_buffer(path, direct=True) as client:
            mine = _same_draw(path, 5, lambda: client.sample(8))
        _assert_same(mine, _same_draw(path, 5, lambda: _load_batch(path, 8)))
    assert "offsets" in mine or "data" in mine


def test_values_in_both_tiers(fresh_mount):
    """Values at least segment_threshold bytes are read from segment files, the rest from
    LMDB: both in one batch."""
    m = fresh_mount("segment_threshold=2048")
    buf = m.buffer("tiers", {"presample_batches": 0})
    keys = [f"k{i}" for i in range(30)]
    for i, key in enumerate(keys):
        write_entry(buf, key, make_payload(key, 500 if i % 2 else 6000))
    tiers = {os.getxattr(buf / "entries" / k, "user.distorefs.tier") for k in keys}
    assert tiers == {b"lmdb", b"nvme"}
    with open_buffer(buf, direct=True) as client:
        batch = _same_draw(buf, 3, lambda: client.sample(64))
        data, offsets = batch["data"], batch["offsets"]
        for i, key in enumerate(batch["keys"].tolist()):
            assert verify_payload(data[offsets[i]:offsets[i + 1]].tobytes(), key)
    _assert_same(batch, _same_draw(buf, 3, lambda: _load_batch(buf, 64)))


def test_file_path_fallback_gives_the_same_results(buf):
    _fill_prioritized(buf, 30)
    files = open_buffer(buf, direct=False)
    assert isinstance(files, FileBuffer)
    with open_buffer(buf, direct=True) as client:
        _assert_same(_same_draw(buf, 2, lambda: client.sample(12)), _same_draw(buf, 2, lambda: files.sample(12)))
        files.update_priorities(["e001", "e002"], [9.0, 0.25])
        client.update_priorities(["e003"], [4.0])
        client.flush()
        prios = dict(line.split() for line in (buf / "priorities").read_text().splitlines())
        assert float(prios["e001"]) == 9.0 and float(prios["e002"]) == 0.25 and float(prios["e003"]) == 4.0
        files.insert("f1", {"obs": np.ones((4, 3), np.float32), "action": np.int64(1), "reward": np.float64(0),
                            "offsets": np.zeros(3, np.int16)})
        client.insert("c1", {"obs": np.ones((4, 3), np.float32), "action": np.int64(1), "reward": np.float64(0),
                             "offsets": np.zeros(3, np.int16)})
        assert files.flush() == 1 and client.flush() == 1
        assert (buf / "entries" / "f1").read_bytes() == (buf / "entries" / "c1").read_bytes()
        assert client.stats()["entries"] == files.stats()["entries"] == 32


def test_another_user_falls_back_to_the_file_path(shared_mount, temp_user):
    """The store's files are the mount owner's (0700): another user's client says so once
    and samples through the file path, with the same results."""
    from distorefs_it import in_child_as
    name, uid, gid = temp_user
    m = shared_mount()
    buf = m.buffer("shared", {"presample_batches": 0, "seed": 4})
    os.chmod(buf, 0o777)
    for i in range(10):
        write_entry(buf, f"s{i}", make_payload(f"s{i}", 300))

    def child(path: str) -> dict:
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b = open_buffer(path)
        batch = b.sample(6)
        return {"kind": type(b).__name__, "warned": [str(w.message) for w in caught],
                "keys": batch["keys"].tolist(), "seqs": batch["seqs"].tolist()}

    set_config(buf, {"seed": 5})
    set_config(buf, {"seed": 4})
    out = in_child_as(uid, gid, child, str(buf))
    assert out["kind"] == "FileBuffer"
    assert len(out["warned"]) == 1 and "file path" in out["warned"][0]
    mine = _same_draw(buf, 4, lambda: open_buffer(buf, direct=True).sample(6))
    assert out["keys"] == mine["keys"].tolist() and out["seqs"] == mine["seqs"].tolist()


def test_pipelined_inserts_commit_in_order_at_flush(buf):
    with open_buffer(buf, direct=True) as client:
        payloads = {f"p{i:04d}": make_payload(f"p{i:04d}", 2000 + i) for i in range(300)}
        client.insert_many(payloads)
        assert client.flush() == 300
        names = os.listdir(buf / "entries")
        assert names == sorted(payloads)  # listed oldest first: the order they were sent in
        for key in ("p0000", "p0150", "p0299"):
            assert (buf / "entries" / key).read_bytes() == payloads[key]
        set_config(buf, {"max_entry_bytes": 4096})
        client.insert("ok", b"x" * 100)
        client.insert("big", b"x" * 5000)
        client.insert("ok2", b"y" * 100)
        with pytest.raises(InsertFailed) as info:
            client.flush()
        assert [f[0] for f in info.value.failures] == ["big"]
        assert (buf / "entries" / "ok").exists() and (buf / "entries" / "ok2").exists()
        assert client.flush() == 0


def test_flush_can_leave_the_newest_inserts_in_flight(buf):
    """flush(keep=n), as a Reverb writer's flush(block_until_num_items=n): every insert but
    the last n is committed when it returns (their failures reported), the last n may still
    be committing; flush() then waits for them too. Inserts over several sends (the sender
    thread) arrive whole and in order."""
    with open_buffer(buf, direct=True) as client:
        set_config(buf, {"max_entry_bytes": 4096})
        for i in range(200):
            client.insert(f"k{i:04d}", b"x" * (5000 if i == 3 else 100 + i))
        with pytest.raises(InsertFailed) as info:
            client.flush(keep=20)
        assert [f[0] for f in info.value.failures] == ["k0003"]
        present = set(os.listdir(buf / "entries"))
        assert {f"k{i:04d}" for i in range(180) if i != 3} <= present
        for i in range(200, 260):
            client.insert(f"k{i:04d}", b"y" * 50)
        done = client.flush(keep=10)
        assert 0 < done <= 260
        done += client.flush()
        names = [n for n in os.listdir(buf / "entries") if n.startswith("k")]
        assert names == [f"k{i:04d}" for i in range(260) if i != 3]  # in the order sent
        # Each commit is counted by one flush. The later flushes count the 60 new inserts and
        # those of the first 200 that the first flush did not: at most the 20 it left in flight
        # (179 of the 199 were committed when it returned), at least those not yet listed when
        # `present` was read (the ones in flight may commit before or after that listing).
        assert 259 - len(present & {f"k{i:04d}" for i in range(200)}) <= done <= 259 - 179
        assert (buf / "entries" / "k0199").read_bytes() == b"x" * 299


def test_spent_entries_are_read_before_they_go(buf):
    """max_times_sampled 1: each drawn entry is spent, and removed only once the client
    read it (its next request), so no draw has to be made again."""
    set_config(buf, {"max_times_sampled": 1, "presample_batches": 0})
    for i in range(64):
        write_entry(buf, f"m{i}", make_payload(f"m{i}", 700))
    seen = []
    with open_buffer(buf, direct=True) as client:
        for _ in range(8):
            batch = client.sample(8)
            for i, key in enumerate(batch["keys"].tolist()):
                assert verify_payload(batch["data"][batch["offsets"][i]:batch["offsets"][i + 1]].tobytes(), key)
            seen += batch["keys"].tolist()
        assert client.counters["redraws"] == 0
    assert len(seen) == len(set(seen)) == 64
    deadline = time.monotonic() + 5
    while get_stats(buf)["entries"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert get_stats(buf)["entries"] == 0


def test_never_torn_or_stale_while_the_daemon_moves_values(fresh_mount):
    """Inserts (evicting the oldest), rewrites, deletes, demotion to segments and compaction
    run while a client samples: every value it returns is whole and the version its draw
    named (each payload names its key and verifies itself)."""
    m = fresh_mount("segment_threshold=4096", "lmdb_bytes=262144", f"segment_bytes={1 << 20}")
    buf = m.buffer("churn", {"capacity": 200, "presample_batches": 1})
    for i in range(200):
        write_entry(buf, f"c{i}", make_payload(f"c{i}", 1500 + (i % 5) * 1000, seed=0))
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        i = 200
        try:
            while not stop.is_set():
                write_entry(buf, f"c{i}", make_payload(f"c{i}", 1500 + (i % 5) * 1000, seed=i))
                victim = f"c{i - 150}"
                if i % 3 == 0:  # a rewrite, new content, same name
                    try:
                        write_entry(buf, victim, make_payload(victim, 3000, seed=i))
                    except FileNotFoundError:
                        pass
                elif i % 3 == 1:
                    try:
                        os.unlink(buf / "entries" / victim)
                    except FileNotFoundError:
                        pass
                i += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    writer = threading.Thread(target=churn)
    writer.start()
    checked = 0
    try:
        with open_buffer(buf, direct=True) as client:
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                batch = client.sample(32)
                data, offsets = batch["data"], batch["offsets"]
                for i, key in enumerate(batch["keys"].tolist()):
                    assert verify_payload(data[offsets[i]:offsets[i + 1]].tobytes(), key), key
                    checked += 1
            counters = dict(client.counters)
    finally:
        stop.set()
        writer.join()
    assert not errors, errors
    stats = get_stats(buf)
    root = json_stats(m)
    assert checked > 1000
    assert stats["evictions"] > 0 and stats["rewrites"] > 0 and stats["deletes"] > 0
    assert root["tiering"]["demoted_entries"] > 0, root["tiering"]
    print("client counters", counters, "tiering", root["tiering"])


def json_stats(m) -> dict:
    import json
    return json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())


def test_corrupt_value_is_named(fresh_mount):
    m = fresh_mount("lmdb_bytes=0")  # every value in a segment file
    buf = m.buffer("damaged", {"presample_batches": 0})
    good, bad = make_payload("good", 5000), make_payload("bad", 5000)
    write_entry(buf, "good", good)
    write_entry(buf, "bad", bad)
    m.umount()  # the daemon's memory tier holds the good copy: flip a byte on disk, cold
    for path in glob.glob(str(m.store / "segments" / "seg-*.dat")):
        data = bytearray(open(path, "rb").read())
        at = data.find(bad[1000:1064])
        if at >= 0:
            data[at] ^= 0xFF
            open(path, "wb").write(bytes(data))
            break
    else:
        raise AssertionError("the value was not found in any segment file")
    m.mount()
    set_config(buf, {"sampler": "fifo"})
    with open_buffer(buf, direct=True) as client:
        assert client.sample(1)["keys"].tolist() == ["good"]  # oldest first
        with pytest.raises(CorruptValue) as info:
            client.sample(2)
        assert "buffers/damaged/entries/bad" in str(info.value)


def test_no_fuse_or_trio_import():
    code = ("import sys, distorefs.client; "
            "assert 'trio' not in sys.modules and 'pyfuse3' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_read_ahead_draws_the_next_batch_meanwhile(buf):
    set_config(buf, {"sampler": "prioritized", "presample_batches": 0})
    for i in range(50):
        write_entry(buf, f"a{i}", make_payload(f"a{i}", 900))
    with open_buffer(buf, direct=True, read_ahead=True) as client:
        for step in range(20):
            batch = client.sample(16)
            for i, key in enumerate(batch["keys"].tolist()):
                assert verify_payload(batch["data"][batch["offsets"][i]:batch["offsets"][i + 1]].tobytes(), key)
            client.update_priorities(batch["keys"], np.full(16, 1.0 + step))
        assert client.sample(8)["keys"].shape == (8,)  # another size: drawn now
        client.flush()
    # Taken: 20 of 16 (the first drawn at once, each next one ahead) and the 8 drawn at once.
    # Drawn in the daemon besides: one more of 16 ahead (never taken), one of 8 ahead.
    assert client.counters["draws"] == 21
    assert get_stats(buf)["batches"] == 23
    prios = [float(line.split()[1]) for line in (buf / "priorities").read_text().splitlines()]
    assert max(prios) == 20.0


def test_priorities_of_a_batch_go_to_the_entries_drawn(buf):
    """update_priorities with a batch's keys names its entries by sequence number: an
    entry removed since and made again under the same key keeps its own priority."""
    set_config(buf, {"sampler": "prioritized", "presample_batches": 0})
    for i in range(6):
        write_entry(buf, f"p{i}", _npz_entry(i))
    with open_buffer(buf, direct=True) as client:
        batch = client.sample(6)
        first = str(batch["keys"][0])
        os.unlink(buf / "entries" / first)
        write_entry(buf, first, _npz_entry(99))  # another entry, the same key
        client.update_priorities(batch["keys"], np.full(6, 9.0))
        client.flush()
    prios = {k: float(p) for k, p in (line.split() for line in (buf / "priorities").read_text().splitlines())}
    assert prios[first] != 9.0
    assert all(prios[k] == 9.0 for k in set(batch["keys"].tolist()) - {first})
    assert get_stats(buf)["priority_unknown_keys"] == 1


def test_read_ahead_of_rows_draws_two_batches_a_request(buf):
    """A buffer that keeps rows answers a read-ahead with two batches, drawn one after
    another: each is whole and right, handed out in turn; priorities still arrive."""
    _fill_prioritized(buf, 50)
    with open_buffer(buf, direct=True, read_ahead=True) as client:
        for step in range(20):
            batch = client.sample(16)
            assert batch["obs"].shape == (16, 4, 3) and batch["probabilities"].shape == (16,)
            for key, obs, action, offsets in zip(batch["keys"].tolist(), batch["obs"], batch["action"].tolist(),
                                                 batch["entry_offsets"]):
                with np.load(io.BytesIO(_npz_entry(int(key[1:])))) as want:
                    assert np.array_equal(obs, want["obs"]) and action == int(want["action"])
                    assert np.array_equal(offsets, want["offsets"])
            client.update_priorities(batch["keys"], np.full(16, 1.0 + step))
        # the first drawn at once, then a request for two at every other step (b2..b21)
        assert client.counters["rows"] == client.counters["draws"] == 21
        assert get_stats(buf)["batches"] == 21
        assert client.sample(8)["keys"].shape == (8,)  # another size: the one kept goes, drawn now
        client.flush()
    assert get_stats(buf)["batches"] == 24  # and two of 8 ahead, sent before close() ended
    prios = [float(line.split()[1]) for line in (buf / "priorities").read_text().splitlines()]
    assert max(prios) == 20.0


def test_a_client_killed_inside_a_read_leaves_no_reader_slot(fresh_mount):
    """A client process killed while it holds an LMDB read transaction: its reader slot
    (which would pin the pages it saw forever) is freed by the daemon's next sync."""
    import signal
    import json as _json
    m = fresh_mount()
    buf = m.buffer("readers")
    write_entry(buf, "e", b"x" * 100)
    script = ("import sys, time; from distorefs.client import open_buffer\n"
              "b = open_buffer(sys.argv[1], direct=True)\n"
              "with b.reader.snapshot():\n"
              "    print('holding', flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(buf)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    fd = os.open(buf / "entries" / "e", os.O_RDONLY)
    try:
        os.fsync(fd)  # a sync of the store
    finally:
        os.close(fd)
    stats = _json.loads((m.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["stale_readers_cleared"] >= 1, {k: v for k, v in stats.items() if not isinstance(v, dict)}


def test_min_size_to_sample_waits_or_says_eagain(buf):
    import errno
    set_config(buf, {"min_size_to_sample": 5, "presample_batches": 0})
    with open_buffer(buf, direct=True) as client:
        with pytest.raises(OSError) as info:
            client.sample(2, nonblocking=True)
        assert info.value.errno == errno.EAGAIN

        def fill() -> None:
            time.sleep(0.5)
            for i in range(5):
                write_entry(buf, f"late{i}", make_payload(f"late{i}", 300))
        filler = threading.Thread(target=fill)
        filler.start()
        t0 = time.monotonic()
        batch = client.sample(2)  # waits for the fifth entry
        filler.join()
        assert time.monotonic() - t0 >= 0.4 and len(batch["keys"]) == 2


def test_a_session_waiting_in_the_daemon_holds_back_no_other_session(buf):
    """A learner's draw waiting for min_size_to_sample must not hold back the inserts of the
    actor it waits for: the kernel writes into one inode at a time, so each session has its
    own (with one `client` inode the actor's write waited behind the learner's for good)."""
    set_config(buf, {"min_size_to_sample": 3, "presample_batches": 0})
    with open_buffer(buf, direct=True) as learner, open_buffer(buf, direct=True) as actor:
        got: list = []
        drawing = threading.Thread(target=lambda: got.append(learner.sample(2)), daemon=True)
        drawing.start()
        drawing.join(1.0)
        assert drawing.is_alive()  # waiting for the entries
        flushed: list = []
        inserting = threading.Thread(target=lambda: (actor.insert_many({"a": b"1", "b": b"2", "c": b"3"}),
                                                     flushed.append(actor.flush())), daemon=True)
        inserting.start()
        inserting.join(30)
        drawing.join(30)
        assert flushed == [3] and len(got) == 1 and len(got[0]["keys"]) == 2


def test_requests_split_across_write_requests_arrive_whole(buf):
    """A write of several large inserts reaches the daemon as many WRITE requests (the
    kernel's max_write): frames cut anywhere are put back together."""
    payloads = {f"big{i}": make_payload(f"big{i}", 300_000 + 4099 * i) for i in range(6)}
    with open_buffer(buf, direct=True) as client:
        client.insert_many(payloads)  # about 1.9 MB, sent as one write
        assert client.flush() == 6
    for key, data in payloads.items():
        assert (buf / "entries" / key).read_bytes() == data


def test_a_read_only_mount_is_read_through_the_file_path(fresh_mount):
    import warnings
    m = fresh_mount()
    buf = m.buffer("ro", {"presample_batches": 0})
    for i in range(8):
        write_entry(buf, f"k{i}", make_payload(f"k{i}", 400))
    m.umount()
    m.mount(flags=("--read-only",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = open_buffer(buf)
    assert isinstance(client, FileBuffer) and any("file path" in str(w.message) for w in caught)
    batch = client.sample(4)
    for i, key in enumerate(batch["keys"].tolist()):
        assert verify_payload(batch["data"][batch["offsets"][i]:batch["offsets"][i + 1]].tobytes(), key)


def test_malformed_requests_fail_with_einval_and_the_session_goes_on(buf):
    import errno
    from distorefs import clientwire as wire
    write_entry(buf, "one", make_payload("one", 300))
    fd = os.open(buf / "client", os.O_RDWR)
    try:
        for bad in (b"\x05\x00\x00\x00\x63", wire.frame(wire.DRAW, b"\x01"), wire.frame(wire.LOCATE, b"123"),
                    wire.frame(wire.PRIORITIES, b"\xff\xff\xff\xff")):
            with pytest.raises(OSError) as info:
                os.pwrite(fd, bad, 0)
            assert info.value.errno == errno.EINVAL, bad
        os.pwrite(fd, wire.draw_request(1), 0)
        reply = os.pread(fd, 1 << 16, 0)
        _meta, arrays = wire.unpack_tables(reply[4:])
        assert wire.keys_of(arrays) == [b"one"]
    finally:
        os.close(fd)
    with pytest.raises(OSError) as info:
        os.open(buf / "client", os.O_RDONLY)  # a session reads and writes
    assert info.value.errno == errno.EINVAL


def test_read_ahead_never_waits_in_the_daemon(buf):
    """A batch drawn ahead when no entry is left to draw does not wait (a process could
    not exit while it did): the next sample draws, and waits, itself."""
    set_config(buf, {"max_times_sampled": 1, "presample_batches": 0, "min_size_to_sample": 4})
    for i in range(8):
        write_entry(buf, f"x{i}", make_payload(f"x{i}", 300))
    client = open_buffer(buf, direct=True, read_ahead=True)
    assert set(client.sample(8)["keys"].tolist()) == {f"x{i}" for i in range(8)}  # every entry spent

    def refill() -> None:
        time.sleep(0.5)
        for i in range(8, 12):
            write_entry(buf, f"x{i}", make_payload(f"x{i}", 300))
    filler = threading.Thread(target=refill)
    filler.start()
    assert set(client.sample(4)["keys"].tolist()) == {f"x{i}" for i in range(8, 12)}
    filler.join()
    t0 = time.monotonic()
    client.close()  # the draw ahead found nothing and did not wait
    assert time.monotonic() - t0 < 2


def test_damage_in_an_lmdb_array_is_named_by_a_big_batch(fresh_mount):
    """A batch over 256 KB of values kept in LMDB uses them in place and checks each array
    as it copies it, not each whole value first: a damaged byte in an array is still named."""
    m = fresh_mount()
    buf = m.buffer("lmdbbig", {"capacity": 100, "presample_batches": 0, "sampler": "fifo"})
    frames = [np.random.default_rng(i).integers(0, 256, 40_000, dtype=np.uint8) for i in range(10)]
    for i, frame in enumerate(frames):
        out = io.BytesIO()
        np.save(out, frame)
        write_entry(buf, f"f{i}", out.getvalue())  # 40 KB: under segment_threshold, kept in LMDB
    with open_buffer(buf, direct=True) as client:
        assert np.array_equal(client.sample(10)["data"], np.stack(frames))
    m.umount()
    pattern = frames[5][1000:5096].tobytes()
    with open(m.store / "meta" / "data.mdb", "r+b") as f:
        data = f.read()
        at = data.find(pattern)
        assert at >= 0, "f5's array was not found in LMDB"
        f.seek(at + 100)
        f.write(bytes([data[at + 100] ^ 0xFF]))
    m.mount()
    with open_buffer(buf, direct=True) as client:
        with pytest.raises(CorruptValue) as info:
            client.sample(10)
        assert "buffers/lmdbbig/entries/f5" in str(info.value)

"""Sequence sampling in the core, without FUSE: the episode index (distorefs/sequences.py)
against a brute-force model, and a buffer of sequences in a real store (batches, refusals,
eviction, persistence, the client's draw tables)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

from distorefs import clientwire as wire
from distorefs.config import BufferConfig
from distorefs.errors import InvalidArgument, InvalidConfig, WouldBlock
from distorefs.owner import Owner
from distorefs.sampler import Sampler
from distorefs.sequences import SequenceIndex, split_key
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
DIR = Owner(0o40755, 1000, 1000)


# ----- keys ---------------------------------------------------------------------------------

@pytest.mark.parametrize("key, sep, expected", [
    (b"ep1.5", b".", (b"ep1", 5)),
    (b"ep1.000005.npy", b".", (b"ep1", 5)),
    (b"ep.1.2.3", b".", (b"ep.1.2", 3)),  # the last separator before the step
    (b"actor-3-ep-12-000045.npz", b"-", (b"actor-3-ep-12", 45)),
    (b"run.v2-7", b"-", (b"run.v2", 7)),  # '.v2-7' is no extension: the key parses whole first
    (b"ep-7.npy", b"-", (b"ep", 7)),
    (b"ep__3", b"__", (b"ep", 3)),
    (b"episode7.npy", b".", None),  # no step
    (b".5", b".", None),  # no episode
    (b"ep.5x", b".", None),
    (b"ep.-5", b".", None),
    (b"ep." + b"9" * 19, b".", None),  # does not fit an int64
])
def test_split_key(key, sep, expected):
    assert split_key(key, sep) == expected


# ----- the index against a model ------------------------------------------------------------

class Model:
    """The sequences of a set of (slot -> key) entries, computed the slow, obvious way."""

    def __init__(self, length: int, stride: int, how: str, alpha: float, sep: bytes = b".") -> None:
        self.length, self.stride, self.how, self.alpha, self.sep = length, stride, how, alpha, sep
        self.keys: dict[int, bytes] = {}

    def steps(self) -> dict[tuple[bytes, int], int]:
        out = {}
        for slot, key in sorted(self.keys.items()):
            parsed = split_key(key, self.sep)
            if parsed is not None and parsed not in out:
                out[parsed] = slot
        return out

    def sequences(self, priority: np.ndarray) -> dict[int, tuple[list[int], float]]:
        """start slot -> (real step slots, priority ** alpha)."""
        steps = self.steps()
        out = {}
        for (ep, step), slot in steps.items():
            if step % self.stride:
                continue
            run = []
            for k in range(step, step + self.length):
                s = steps.get((ep, k))
                if s is None:
                    break
                run.append(s)
            p = [priority[s] for s in run]
            agg = max(p) if self.how == "max" else sum(p) / len(p)
            out[slot] = (run, agg ** self.alpha)
        return out


def _index(length=4, stride=1, how="max", alpha=0.7, sampler="prioritized", capacity=64):
    config = BufferConfig(sequence_length=length, sequence_stride=stride, sequence_priority=how, alpha=alpha,
                          sampler=sampler, seed=5)
    s = Sampler(config)
    s.grow(capacity)
    index = SequenceIndex(config, s)
    index.grow(capacity)
    return index, s


def _check(index: SequenceIndex, model: Model, sampler: Sampler) -> None:
    want = model.sequences(sampler.priority)
    index._flush()
    cap = index.capacity
    uniform = index.uniform.get(np.arange(cap))
    weighted = index.weighted.get(np.arange(cap))
    assert set(np.flatnonzero(uniform).tolist()) == set(want), "which steps start a sequence"
    for start, (run, w) in want.items():
        assert math.isclose(weighted[start], w, rel_tol=1e-12, abs_tol=1e-300), (start, run)
        slots, mask = index.windows(np.array([start]))
        assert slots[0][mask[0]].tolist() == run
        assert (slots[0][~mask[0]] == -1).all()
    others = np.setdiff1d(np.arange(cap), list(want))
    assert not weighted[others].any()
    assert index.count() == len(want)


@pytest.mark.parametrize("length, stride, how", [(4, 1, "max"), (3, 2, "mean"), (1, 1, "max"), (5, 5, "mean")])
def test_index_matches_a_model_through_random_changes(length, stride, how):
    """Inserts in and out of order, removals (front eviction and holes), renames, priority
    changes: after each, every start's window, mask and weight are what the model says."""
    rng = np.random.default_rng(length * 10 + stride)
    index, sampler = _index(length, stride, how)
    model = Model(length, stride, how, 0.7)
    free = list(range(64))
    next_step = {b"a": 0, b"b": 0, b"c": 5}
    for op in range(400):
        r = rng.random()
        if (r < 0.45 or not model.keys) and free:
            ep = [b"a", b"b", b"c"][rng.integers(3)]
            if rng.random() < 0.8:
                step = next_step[ep]
                next_step[ep] += 1
            else:
                step = int(rng.integers(0, next_step[ep] + 3))  # an earlier step (a hole filled) or a clash
            key = b"%s.%d" % (ep, step)
            if key in model.keys.values():
                continue
            slot = free.pop(int(rng.integers(len(free))))
            sampler.add(slot, float(rng.integers(1, 10)))
            index.add(slot, key)
            model.keys[slot] = key
        elif r < 0.7:
            slot = list(model.keys)[rng.integers(len(model.keys))]  # a hole, or the front (eviction)
            if rng.random() < 0.5:
                ep = model.keys[slot].split(b".")[0]
                slot = min((s for s, k in model.keys.items() if k.startswith(ep + b".")),
                           key=lambda s: int(model.keys[s].split(b".")[1]))
            sampler.remove(slot)
            index.remove(slot)
            del model.keys[slot]
            free.append(slot)
        elif r < 0.75:
            slot = list(model.keys)[rng.integers(len(model.keys))]
            new = b"c.%d" % (100 + op)
            index.rename(slot, new)
            model.keys[slot] = new
        else:
            slots = rng.choice(list(model.keys), size=min(3, len(model.keys)), replace=False)
            values = rng.integers(0, 20, len(slots)).astype(np.float64)
            sampler.set_priorities(slots, values)
            index.priorities_changed(slots)
        if op % 7 == 0:
            _check(index, model, sampler)
    _check(index, model, sampler)
    assert index.unkeyed == set()


def test_rebuild_equals_incremental():
    index, sampler = _index(length=3, how="mean")
    keys = [b"x.%d" % i for i in range(10)] + [b"y.%d" % i for i in range(0, 20, 2)] + [b"junk"]
    for slot, key in enumerate(keys):
        sampler.add(slot, float(slot + 1))
        index.add(slot, key)
    assert index.count() == 10 + 10  # (brings the trees up to date)
    incremental = index.weighted.get(np.arange(64)).copy()
    assert index.unkeyed == {len(keys) - 1}

    class Meta:
        def __init__(self, slot, key):
            self.slot, self.key = slot, key
    config = BufferConfig(sequence_length=3, sequence_priority="max", alpha=0.7, sampler="prioritized", seed=5)
    index.reconfigure(config, lambda: [Meta(s, k) for s, k in enumerate(keys)])
    assert not np.allclose(index.weighted.get(np.arange(64)), incremental)  # max, not mean, now
    config = BufferConfig(sequence_length=3, sequence_priority="mean", alpha=0.7, sampler="prioritized", seed=5)
    index.reconfigure(config, lambda: [Meta(s, k) for s, k in enumerate(keys)])
    assert np.allclose(index.weighted.get(np.arange(64)), incremental)
    # y has every other step only: each of its sequences is its start alone
    slots, mask = index.windows(np.array([keys.index(b"y.4")]))
    assert mask.tolist() == [[True, False, False]]


def test_check_refuses_what_cannot_be_a_step():
    index, sampler = _index()
    sampler.add(0, 1.0)
    index.add(0, b"ep.5")
    with pytest.raises(InvalidArgument, match="does not name an episode step"):
        index.check(b"ep5.npy")
    with pytest.raises(InvalidArgument, match="another entry"):
        index.check(b"ep.05")  # step 5 again
    index.check(b"ep.5", slot=0)  # a rewrite of the same entry
    index.check(b"ep.6")
    with pytest.raises(InvalidArgument, match="span"):
        index.check(b"ep.%d" % (5 + (1 << 20)))


def test_draw_frequencies_follow_sequence_priorities():
    """Prioritized draws of starts: frequencies match priority ** alpha (chi-square), and the
    probabilities and weights reported are the PER ones over sequences."""
    index, sampler = _index(length=3, how="max", alpha=1.0, capacity=32)
    for slot in range(12):  # one episode of 12 steps
        sampler.add(slot, 1.0)
        index.add(slot, b"e.%d" % slot)
    sampler.set_priorities(np.array([5, 9]), np.array([6.0, 3.0]))
    index.priorities_changed(np.array([5, 9]))
    prio = sampler.priority[:12]
    agg = np.array([prio[s:s + 3].max() for s in range(12)])
    expected = agg / agg.sum()
    counts = np.zeros(12)
    for _ in range(200):
        drawn = index.select(50, None, lambda s, q: np.ones(len(s), bool))
        counts += np.bincount(drawn.starts, minlength=12)
        assert np.allclose(drawn.probabilities, expected[drawn.starts])
        assert np.allclose(drawn.weights, (expected[drawn.starts] / expected.min()) ** -0.4)
    assert _chi_square(counts, expected) < _chi_square_bound(len(expected) - 1)
    assert sampler.times[:12].sum() == counts @ np.minimum(3, 12 - np.arange(12))  # every real step counted


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    e = expected * counts.sum()
    return float(((counts - e) ** 2 / e).sum())


def _chi_square_bound(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty; z is that normal quantile)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# ----- a buffer of sequences in a store -----------------------------------------------------

async def make_buffer(store, config: dict):
    """Buffer `rb` of `store` with `config` (merged into the defaults)."""
    buf = await store.create_buffer("rb", DIR)
    await store.configure_buffer("rb", json.dumps(config).encode())
    return buf


def step_npz(ep: int, step: int) -> bytes:
    out = io.BytesIO()
    np.savez(out, obs=np.array([ep, step], dtype=np.int32), reward=np.float32(step), mask=np.uint8(1))
    return out.getvalue()


async def episodes(buf, lengths: dict[int, int], one_by_one: bool = False) -> None:
    """Episodes written side by side, step after step (`one_by_one`: a commit each, so that
    capacity evicts as it goes)."""
    items = [(b"ep%d.%06d.npz" % (ep, step), step_npz(ep, step))
             for step in range(max(lengths.values())) for ep, n in lengths.items() if step < n]
    if one_by_one:
        for key, data in items:
            await buf.insert(key, data, OWNER)
        return
    results = await buf.insert_many(items, OWNER)
    assert not [r for r in results if isinstance(r, BaseException)]


def load(data) -> dict[str, np.ndarray]:
    """The arrays of a batch file (distorefs.batch.BatchFile)."""
    with np.load(io.BytesIO(bytes(data))) as f:
        return {k: f[k] for k in f.files}


def check_batch(z: dict, length: int, live: set[tuple[int, int]] | None = None) -> None:
    """Every sequence: consecutive steps of one episode, mask a prefix ending where the next
    step is absent, padding zero."""
    obs, mask, keys = z["obs"], z["mask"], z["keys"]
    assert obs.shape == mask.shape + (2,) and keys.shape == mask.shape and mask.shape[1] == length
    for i in range(len(mask)):
        k = int(mask[i].sum())
        assert k >= 1 and mask[i, :k].all() and not mask[i, k:].any()
        ep, first = obs[i, 0]
        assert (obs[i, :k, 0] == ep).all() and (obs[i, :k, 1] == first + np.arange(k)).all()
        assert (obs[i, k:] == 0).all() and (z["reward"][i, k:] == 0).all() and (z["seqs"][i, k:] == -1).all()
        assert list(keys[i, :k]) == [f"ep{ep}.{s:06d}.npz" for s in range(first, first + k)]
        assert (keys[i, k:] == "").all()
        if live is not None:
            assert (ep, first + k) not in live or k == length  # cut short only where the next step is absent


def test_buffer_batches_of_sequences(tmp_path):
    async def body(store):
        buf = await make_buffer(store, {"sequence_length": 6, "seed": 4, "presample_batches": 0})
        await episodes(buf, {0: 10, 1: 3, 2: 25})
        assert buf.stats()["sequences"] == {"length": 6, "stride": 1, "priority": "max", "episodes": 3,
                                            "starts": 38, "unkeyed_entries": 0}
        live = {(e, s) for e, n in {0: 10, 1: 3, 2: 25}.items() for s in range(n)}
        starts = set()
        for _ in range(20):
            batch, data = await buf.sample_npz(16)
            z = load(data)
            assert set(z) == {"obs", "reward", "entry_mask", "keys", "seqs", "mask", "probabilities", "weights"}
            check_batch(z, 6, live)
            assert np.allclose(z["probabilities"], 1 / 38) and (z["weights"] == 1).all()
            assert (z["entry_mask"][z["mask"]] == 1).all() and (z["entry_mask"][~z["mask"]] == 0).all()
            starts |= {tuple(o) for o in z["obs"][:, 0].tolist()}
            assert [m.key for m in batch.metas] == [k.encode() for k in z["keys"][z["mask"]]]
        assert len(starts) > 30  # uniform over the 38 starts
        lines = batch.manifest().decode().splitlines()
        assert len(lines) == 16
        for line, keys, mask in zip(lines, z["keys"], z["mask"]):
            key, seq, p, w, n = line.split()
            assert key == keys[0] and int(n) == mask.sum() and float(p) == pytest.approx(1 / 38)
    run(tmp_path / "s", body)


def test_stride_eviction_and_refusals(tmp_path):
    async def body(store):
        buf = await make_buffer(store, {"sequence_length": 4, "sequence_stride": 4, "capacity": 30,
                                        "presample_batches": 1})
        await episodes(buf, {0: 20, 1: 20}, one_by_one=True)  # 40 steps into 30: the oldest 10 evicted
        assert len(buf.ring) == 30
        live = {(e, s) for e in (0, 1) for s in range(20)} - {(0, s) for s in range(5)} - {(1, s) for s in range(5)}
        for _ in range(10):
            _, data = await buf.sample_npz(8)
            z = load(data)
            check_batch(z, 4, live)
            firsts = z["obs"][:, 0]
            assert (firsts[:, 1] % 4 == 0).all() and (firsts[:, 1] >= 5).all()  # never an evicted start
        assert buf.sequences.count() == 6  # steps 8, 12, 16 of each episode
        with pytest.raises(InvalidArgument, match="does not name an episode step"):
            await buf.insert(b"loose.npz", step_npz(9, 9), OWNER)
        with pytest.raises(InvalidArgument, match="another entry"):
            await buf.insert(b"ep1.19.npz", step_npz(1, 19), OWNER)  # step 19 is ep1.000019.npz
        await buf.insert(b"ep1.000019.npz", step_npz(1, 19), OWNER)  # a rewrite is fine
        with pytest.raises(InvalidArgument, match="sequences of 4 steps"):
            buf.check_batch_size(store.config.max_batch_entries // 4 + 1)
        for text, word in ((b'{"sequence_length": -1}', "sequence_length"),
                           (b'{"sequence_priority": "min"}', "sequence_priority"),
                           (b'{"sequence_separator": "_1"}', "sequence_separator"),
                           (b'{"sequence_stride": 0}', "sequence_stride"),
                           (b'{"sampler": "fifo"}', "sampler"),
                           (b'{"max_times_sampled": 2}', "max_times_sampled")):
            with pytest.raises(InvalidConfig, match=word):
                await store.configure_buffer("rb", text)
        await store.configure_buffer("rb", b'{"sequence_length": 0}')  # off: entries again
        assert len((await buf.sample(5)).metas) == 5
        await store.configure_buffer("rb", b'{"sequence_length": 2, "sequence_stride": 1}')
        assert buf.sequences.count() == 30
    run(tmp_path / "s", body)


def test_a_refused_first_entry_fixes_no_layout(tmp_path):
    async def body(store):
        buf = await make_buffer(store, {"sequence_length": 2})
        with pytest.raises(InvalidArgument, match="does not name an episode step"):
            await buf.insert(b"nostep.npz", step_npz(0, 0), OWNER)
        assert buf.config.schema is None and not buf.config.raw
        await buf.insert(b"e.1", b"plain bytes", OWNER)  # the first entry taken fixes it: raw mode
        assert buf.config.raw
    run(tmp_path / "s", body)


def test_prioritized_sequences_mean_and_max(tmp_path):
    async def body(store):
        buf = await make_buffer(store, {"sequence_length": 3, "sampler": "prioritized", "alpha": 1.0, "beta": 1.0,
                                        "sequence_priority": "mean", "presample_batches": 0})
        await episodes(buf, {0: 4})
        await buf.set_priorities([(b"ep0.%06d.npz" % s, p) for s, p in enumerate((1.0, 2.0, 6.0, 3.0))])
        mean = np.array([3.0, 11 / 3, 4.5, 3.0])  # starts 0..3 (the last two cut by the episode's end)
        batch = await buf.sample(40)
        firsts = [m.key for m in batch.starts]
        for key, p, w in zip(firsts, batch.probabilities, batch.weights):
            s = int(key[4:10])
            assert p == pytest.approx(mean[s] / mean.sum())
            assert w == pytest.approx(mean.min() / mean[s])
        await store.configure_buffer("rb", b'{"sequence_priority": "max"}')
        batch = await buf.sample(40)
        top = np.array([6.0, 6.0, 6.0, 3.0])
        for key, p in zip([m.key for m in batch.starts], batch.probabilities):
            assert p == pytest.approx(top[int(key[4:10])] / top.sum())
        await buf.set_priorities([(b"ep0.%06d.npz" % 3, 0.0)])  # a sequence of priority 0 is never drawn
        batch = await buf.sample(100)
        assert b"ep0.000003.npz" not in {m.key for m in batch.starts}
    run(tmp_path / "s", body)


def test_sequences_wait_then_persist(tmp_path):
    async def body(store):
        buf = await make_buffer(store, {"sequence_length": 5, "sequence_separator": "-"})
        with pytest.raises(WouldBlock, match="0 sequences"):
            await buf.sample(2, nonblocking=True)
        for s in range(7):
            await buf.insert(b"run-a-%d" % s, bytes([s]) * 40, OWNER)  # plain bytes: raw mode
        batch, data = await buf.sample_npz(3)
        z = load(data)
        assert set(z) == {"data", "offsets", "keys", "seqs", "mask", "probabilities", "weights"}
        real = [k for k in z["keys"][z["mask"]]]
        off = z["offsets"]
        for i, key in enumerate(real):  # raw: the real steps' bytes, row after row
            assert bytes(z["data"][off[i]:off[i + 1]]) == bytes([int(key.split("-")[-1])]) * 40

    async def again(store):
        buf = store.buffer("rb")
        assert buf.sequences.count() == 7 and buf.config.sequence_separator == "-"
        batch = await buf.sample(4)
        assert batch.mask.shape == (4, 5)
    run(tmp_path / "s", body)
    run(tmp_path / "s", again)


def test_client_draw_of_sequences(tmp_path):
    async def body(store):
        from distorefs.client.buffer import stack, stack_rows
        from distorefs.layout import Layout
        buf = await make_buffer(store, {"sequence_length": 4})
        await episodes(buf, {0: 6, 1: 2})
        session = store.client_session(buf, OWNER)
        op, payload = wire.split_frame(wire.draw_request(10))
        meta, t = wire.unpack_tables(await session.request(op, payload))
        assert meta["rows"]  # a narrow layout: the steps' fields come in the reply
        mask = t["mask"]
        assert mask.shape == (10, 4) and len(t["seqs"]) == mask.sum() and t["probabilities"].shape == (10,)
        layout, keys = Layout.from_json(meta["layout"]), wire.keys_of(t)
        z = stack_rows(layout, t["rows"], keys, t["seqs"], mask)
        check_batch(z, 4)
        assert "entry_mask" in z and z["mask"].flags.writeable
        # the same arrays as the steps' values read and stacked
        metas = [buf.ring.by_seq[s] for s in t["seqs"].tolist()]
        values = [await buf.ring.read(m) for m in metas]
        places = buf.places.take(np.array([m.slot for m in metas]))[0]  # type: ignore[index]
        read = stack(layout, places, values, keys, t["seqs"], mask)
        assert sorted(read) == sorted(z)
        for name in read:
            assert read[name].dtype == z[name].dtype and np.array_equal(read[name], z[name]), name
    run(tmp_path / "s", body)


def test_rate_limiter_counts_the_real_steps_of_sequences(tmp_path):
    """With sequences, a draw counts each real step it hands out (inserts are steps)."""
    async def body(store):
        buf = await make_buffer(store, {"sequence_length": 4, "seed": 2, "presample_batches": 0,
                                        "samples_per_insert": 1, "error_buffer": 1000})
        await episodes(buf, {0: 5, 1: 2})  # 7 steps; sequences of 4, cut at each episode's end
        batch, data = await buf.sample_npz(8)
        real = int(load(data)["mask"].sum())
        assert real == len(batch.metas) and 8 <= real < 8 * 4  # some sequences run past an end
        stats = buf.stats()["rate_limiter"]
        assert stats["inserts"] == 7 and stats["samples"] == real
    run(tmp_path / "s", body)

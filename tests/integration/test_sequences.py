"""Sequence sampling through a real mount: entries EPISODE.STEP grouped into episodes,
batch/N.npz of N sequences of L consecutive steps (N, L, ...) with a mask, sample/N one line
per sequence, prioritized sequences drawn by max/mean of their steps' priorities, eviction
and holes never mixing episodes, and the Python client's draw equal to the file's."""

from __future__ import annotations

import collections
import errno
import io
import math
import os

import numpy as np
import pytest

from distorefs.client import ClientBuffer, open_buffer
from distorefs_it import assert_errno, get_config, get_stats, set_config, write_entry


def step_entry(ep: int, step: int, pad: int = 0) -> bytes:
    out = io.BytesIO()
    np.savez(out, obs=np.array([ep, step], dtype=np.int32), reward=np.float32(step / 10),
             frame=np.full(pad, step % 251, dtype=np.uint8))
    return out.getvalue()


def key(ep: int, step: int) -> str:
    return f"ep{ep}.{step:06d}.npz"


def write_episodes(buf, lengths: dict[int, int], pad: int = 0) -> None:
    """Episodes written side by side, one step of each in turn (as parallel actors write)."""
    for step in range(max(lengths.values())):
        for ep, n in lengths.items():
            if step < n:
                write_entry(buf, key(ep, step), step_entry(ep, step, pad))


def present_steps(buf) -> set[tuple[int, int]]:
    """(episode, step) of every entry the buffer lists."""
    return {(int(k[2:k.index(".")]), int(k.split(".")[1])) for k in os.listdir(buf / "entries")}


def load_batch(buf, n: int) -> dict[str, np.ndarray]:
    with np.load(buf / "batch" / f"{n}.npz") as z:
        return {name: z[name] for name in z.files}


def check_sequences(z: dict, length: int, present: set[tuple[int, int]], stride: int = 1) -> None:
    """Each sequence: consecutive steps of one episode from a start that is a multiple of
    `stride`; real steps a prefix, cut exactly where the next step is not `present`; padding
    zero, '' and -1."""
    obs, mask, keys, seqs = z["obs"], z["mask"], z["keys"], z["seqs"]
    n = len(mask)
    assert mask.dtype == bool and mask.shape == (n, length) and obs.shape == (n, length, 2)
    assert keys.shape == seqs.shape == (n, length) and z["probabilities"].shape == z["weights"].shape == (n,)
    for i in range(n):
        k = int(mask[i].sum())
        assert k >= 1 and mask[i, :k].all() and not mask[i, k:].any(), mask[i]
        ep, first = (int(v) for v in obs[i, 0])
        assert first % stride == 0
        assert (obs[i, :k, 0] == ep).all(), f"sequence {i} mixes episodes: {obs[i, :k, 0]}"
        assert (obs[i, :k, 1] == first + np.arange(k)).all(), f"sequence {i} is not consecutive: {obs[i, :k, 1]}"
        assert all((ep, s) in present for s in range(first, first + k))
        assert k == length or (ep, first + k) not in present, f"sequence {i} cut at {k} though the step is there"
        assert list(keys[i, :k]) == [key(ep, s) for s in range(first, first + k)]
        assert (obs[i, k:] == 0).all() and (z["reward"][i, k:] == 0).all()
        assert (keys[i, k:] == "").all() and (seqs[i, k:] == -1).all() and (seqs[i, :k] > 0).all()


def test_batch_of_sequences_through_files(buf):
    set_config(buf, {"sequence_length": 8, "sequence_stride": 2, "seed": 3})
    lengths = {0: 30, 1: 5, 2: 17}
    write_episodes(buf, lengths)
    present = {(e, s) for e, n in lengths.items() for s in range(n)}
    starts = collections.Counter()
    for _ in range(15):
        z = load_batch(buf, 12)
        assert set(z) == {"obs", "reward", "frame", "keys", "seqs", "mask", "probabilities", "weights"}
        check_sequences(z, 8, present, stride=2)
        assert np.allclose(z["probabilities"], 1 / 27) and (z["weights"] == 1).all()  # 15 + 3 + 9 starts
        starts.update(tuple(int(v) for v in o) for o in z["obs"][:, 0])
    assert len(starts) > 20
    # an episode's end pads: the last start of episode 1 (step 4) has one real step
    assert (1, 4) in starts
    stats = get_stats(buf)["sequences"]
    assert stats == {"length": 8, "stride": 2, "priority": "max", "episodes": 3, "starts": 27, "unkeyed_entries": 0}

    # sample/N: one line per sequence, START_KEY SEQ PROBABILITY WEIGHT LENGTH
    with open(buf / "sample" / "10", "rb") as f:
        lines = f.read().decode().splitlines()
    assert len(lines) == 10
    for line in lines:
        start, seq, p, w, n = line.split()
        ep, step = int(start[2:start.index(".")]), int(start.split(".")[1])
        assert step % 2 == 0 and int(n) == min(8, lengths[ep] - step)
        assert int(seq) == int(os.getxattr(buf / "entries" / start, "user.distorefs.seq"))
        assert float(p) == pytest.approx(1 / 27) and float(w) == 1.0


def test_large_sequences_stack_off_the_loop(buf):
    """N*L over a thousand steps of 2 KB (the batch is built in a worker thread, its members
    gathered from slices with combined CRCs, which np.load checks)."""
    set_config(buf, {"sequence_length": 80, "sequence_stride": 20, "seed": 9})
    lengths = {0: 130, 1: 95}
    write_episodes(buf, lengths, pad=2000)
    present = {(e, s) for e, n in lengths.items() for s in range(n)}
    for _ in range(3):
        z = load_batch(buf, 16)
        check_sequences(z, 80, present, stride=20)
        frame, mask = z["frame"], z["mask"]
        assert frame.shape == (16, 80, 2000)
        assert (frame[mask][:, 0] == z["obs"][mask][:, 1] % 251).all() and (frame[~mask] == 0).all()
        assert not mask.all()  # some sequences run past their episode's end


def test_eviction_and_holes_never_mix_episodes(buf):
    set_config(buf, {"sequence_length": 5, "capacity": 40, "seed": 1})
    lengths = {0: 30, 1: 30}
    write_episodes(buf, lengths)  # 60 steps into 40: the oldest 10 of each evicted
    present = present_steps(buf)
    assert present == {(e, s) for e in (0, 1) for s in range(10, 30)}
    os.unlink(buf / "entries" / key(0, 20))  # a hole: sequences through it stop before it
    present.discard((0, 20))
    for _ in range(10):
        z = load_batch(buf, 20)
        check_sequences(z, 5, present)
        assert (z["obs"][:, 0, 1] >= 10).all()
    assert get_stats(buf)["sequences"]["starts"] == 39
    # more steps: the episodes go on, the oldest go
    for step in range(30, 35):
        for ep in (0, 1):
            write_entry(buf, key(ep, step), step_entry(ep, step))
    present = present_steps(buf)
    assert len(present) == 40 and (0, 20) not in present and min(s for _, s in present) >= 14
    for _ in range(5):
        check_sequences(load_batch(buf, 30), 5, present)


def test_bad_keys_and_settings_are_refused(buf):
    set_config(buf, {"sequence_length": 4})
    write_entry(buf, key(0, 0), step_entry(0, 0))
    assert_errno(errno.EINVAL, write_entry, buf, "no-step-here.npz", step_entry(0, 1))
    assert_errno(errno.EINVAL, write_entry, buf, "ep0.0.npz", step_entry(0, 0))  # step 0 is another entry
    assert not (buf / "entries" / "no-step-here.npz").exists()
    for bad in ({"sequence_length": -2}, {"sequence_priority": "median"}, {"sequence_separator": "/"},
                {"sampler": "lifo"}, {"max_times_sampled": 1}, {"sequence_stride": 0}):
        assert_errno(errno.EINVAL, set_config, buf, bad)
    assert get_config(buf)["sequence_length"] == 4 and get_config(buf)["sampler"] == "uniform"
    limit = 65536 // 4 + 1  # max_batch_entries: N * L entries
    assert_errno(errno.EINVAL, open, buf / "batch" / f"{limit}.npz", "rb")
    fd = os.open(buf / "sample" / "2", os.O_RDONLY)  # one step: one sequence
    os.close(fd)


def test_no_sequence_yet_waits_or_eagain(buf):
    set_config(buf, {"sequence_length": 3, "sequence_stride": 3})
    write_entry(buf, key(0, 1), step_entry(0, 1))  # step 1: no start (stride 3)
    assert_errno(errno.EAGAIN, os.open, buf / "batch" / "2.npz", os.O_RDONLY | os.O_NONBLOCK)
    write_entry(buf, key(0, 3), step_entry(0, 3))
    z = load_batch(buf, 2)
    assert z["mask"].tolist() == [[True, False, False]] * 2


def _expected(prio: dict[tuple[int, int], float], lengths: dict[int, int], length: int, how: str, alpha: float):
    out = {}
    for ep, n in lengths.items():
        for s in range(n):
            run = [prio[(ep, k)] for k in range(s, min(s + length, n))]
            out[(ep, s)] = (max(run) if how == "max" else sum(run) / len(run)) ** alpha
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def _chi_square_bound(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty; z is that normal quantile)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("how", ["max", "mean"])
def test_prioritized_sequences_follow_priorities(buf, how):
    """Draw frequencies of sequences follow (max or mean of their steps' priorities) ** alpha
    within a chi-square bound; probabilities and weights are PER's over sequences."""
    alpha, beta, length = 0.8, 0.6, 4
    set_config(buf, {"sequence_length": length, "sampler": "prioritized", "alpha": alpha, "beta": beta,
                     "sequence_priority": how, "presample_batches": 0, "seed": 17})
    lengths = {0: 10, 1: 6}
    write_episodes(buf, lengths)
    rng = np.random.default_rng(4)
    prio = {(e, s): float(rng.choice([0.5, 1, 2, 8])) for e, n in lengths.items() for s in range(n)}
    with open(buf / "priorities", "w") as f:
        f.writelines(f"{key(e, s)} {p}\n" for (e, s), p in prio.items())
    _check_frequencies(buf, _expected(prio, lengths, length, how, alpha), lengths, length, beta)

    # a learner's update: every real step of one drawn sequence gets that sequence's TD error
    z = load_batch(buf, 1)
    raised = z["keys"][0][z["mask"][0]]
    with open(buf / "priorities", "w") as f:
        f.writelines(f"{k} 50\n" for k in raised)
    for k in raised:
        prio[(int(k[2:k.index(".")]), int(k.split(".")[1]))] = 50.0
    _check_frequencies(buf, _expected(prio, lengths, length, how, alpha), lengths, length, beta)


def _check_frequencies(buf, expected: dict, lengths: dict, length: int, beta: float) -> None:
    smallest = min(expected.values())
    counts: collections.Counter = collections.Counter()
    for _ in range(40):
        with open(buf / "sample" / "100", "rb") as f:
            for line in f.read().decode().splitlines():
                start, _seq, p, w, n = line.split()
                ep, step = int(start[2:start.index(".")]), int(start.split(".")[1])
                counts[(ep, step)] += 1
                assert float(p) == pytest.approx(expected[(ep, step)], rel=1e-6)
                assert float(w) == pytest.approx((expected[(ep, step)] / smallest) ** -beta, rel=1e-6)
                assert int(n) == min(length, lengths[ep] - step)
    total = sum(counts.values())
    chi2 = sum((counts[k] - e * total) ** 2 / (e * total) for k, e in expected.items())
    assert chi2 < _chi_square_bound(len(expected) - 1), (chi2, counts)


def test_client_samples_sequences_as_the_file_does(buf):
    set_config(buf, {"sequence_length": 6, "sampler": "prioritized", "presample_batches": 0})
    write_episodes(buf, {0: 14, 3: 9})
    present = {(e, s) for e, n in {0: 14, 3: 9}.items() for s in range(n)}

    def same_draw(draw):
        set_config(buf, {"seed": 8})
        set_config(buf, {"seed": 7})
        return draw()

    with open_buffer(buf, direct=True) as client:
        assert isinstance(client, ClientBuffer)
        mine = same_draw(lambda: client.sample(10))
        check_sequences(mine, 6, present)
        theirs = same_draw(lambda: load_batch(buf, 10))
        assert sorted(mine) == sorted(theirs)
        for name in mine:
            assert mine[name].dtype == theirs[name].dtype and np.array_equal(mine[name], theirs[name]), name
        client.update_priorities(mine["keys"][mine["mask"]], np.full(int(mine["mask"].sum()), 3.0))
        client.flush()
    prio = dict(line.split() for line in (buf / "priorities").read_text().splitlines())
    assert {prio[k] for k in mine["keys"][mine["mask"]]} == {"3"}


def test_readme_example_runs(fs):
    """The README's example of sequences runs as written (its mnt/ pointed at the mount)."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("### Sequences (`sequence_length`)"):]
    section = section[:section.index("\n### ", 3)]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {}
    exec(compile(code.replace('"mnt/', f'"{fs.mnt}/'), "README.md", "exec"), scope)  # noqa: S102 - the README's own
    mask, keys = scope["mask"], scope["keys"]
    starts = np.array([int(k.split(".")[1]) for k in keys[:, 0]])
    assert (starts % 40 == 0).all()
    assert (mask.sum(axis=1) == np.minimum(80, 200 - starts)).all()  # episodes of 200 steps: from 160, 40 real
    prio = dict(line.split() for line in (fs.mnt / "buffers" / "r2d2" / "priorities").read_text().splitlines())
    assert all(float(prio[k]) >= 1e-3 for k in keys[mask])

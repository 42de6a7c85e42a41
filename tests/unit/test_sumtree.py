"""Unit tests for distorefs.sumtree.SumTree against numpy brute force, each run twice: with
the C loops of distorefs/_sumtree.c and on numpy alone (what a machine without a compiler
runs)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import distorefs.sumtree as sumtree_module
from distorefs.sumtree import SumTree

# (capacity, branching): a top-only tree, then trees whose find() descends
# through one and two row levels below the top level (<= TOP_MAX nodes).
SHAPES = [(37, 16), (20_000, 16), (40_000, 8), (100_000, 16)]


@pytest.fixture(autouse=True, params=["native", "numpy"])
def code(request, monkeypatch):
    """Which code the trees made in a test run: the C loops, or numpy alone."""
    if request.param == "numpy":
        monkeypatch.setattr(sumtree_module, "_native", None)
    elif sumtree_module._native is None:
        pytest.fail("distorefs/_sumtree.c is not built (make deps builds it)")
    return request.param


def test_the_c_loops_and_numpy_build_the_same_tree_and_find_the_same_slots():
    from distorefs import _sumtree  # type: ignore[attr-defined]
    rng = np.random.default_rng(11)
    for capacity, branching in SHAPES + [(1_000_000, 16)]:
        trees = [SumTree(capacity, branching=branching) for _ in range(2)]
        trees[0]._native, trees[1]._native = _sumtree, None
        values = rng.random(capacity) * (rng.random(capacity) >= 0.3)
        for tree in trees:
            tree.update(np.arange(capacity), values)
        for _ in range(300):  # small updates: the C path of the first tree
            m = int(rng.integers(1, 40))
            slots, new = rng.integers(0, capacity, m), rng.random(m) * (rng.random(m) >= 0.2)
            for tree in trees:
                tree.update(slots, new)
        native, plain = trees
        for k in range(len(plain._sums)):
            np.testing.assert_allclose(native._sums[k], plain._sums[k], rtol=1e-12)
            if k:
                np.testing.assert_array_equal(native._mins[k], plain._mins[k])
        assert native.min_positive() == plain.min_positive()
        total = plain.total()
        prefix = np.concatenate([rng.random(5_000) * total, [0.0, -1.0, total, 2 * total]])
        np.testing.assert_array_equal(native.find(prefix), plain.find(prefix))


def test_a_stratified_draw_takes_the_slots_of_its_prefixes(code):
    """sample() makes its prefixes (i + u_i) * total / n in C (find's stride) where the C
    loops are built: the same slots as finding those prefixes made by numpy, from the same
    uniforms (a seeded sampler draws what it drew before)."""
    rng = np.random.default_rng(5)
    for capacity, branching in SHAPES:
        tree = SumTree(capacity, branching=branching)
        tree.update(np.arange(capacity), rng.random(capacity) * (rng.random(capacity) >= 0.5))
        for n in (1, 7, 64, 1000):
            drawn = tree.sample(n, np.random.default_rng(n))
            prefixes = (np.arange(n) + np.random.default_rng(n).random(n)) * (tree.total() / n)
            np.testing.assert_array_equal(drawn, tree.find(prefixes))
            assert drawn.dtype == np.int64 and (tree.get(drawn) > 0).all()


def _depth(tree: SumTree) -> int:
    """Levels below the top (peeks at internals to keep SHAPES honest)."""
    return len(tree._sums) - 1


def _random_tree(rng, capacity, branching, zero_fraction=0.3):
    tree = SumTree(capacity, branching=branching)
    values = rng.random(capacity) * (rng.random(capacity) >= zero_fraction)
    tree.update(np.arange(capacity), values)
    return tree, values


def _chi2_critical(df: int) -> float:
    """Upper 1e-6 quantile of chi-square(df), Wilson-Hilferty approximation.

    z = 4.753 is the standard normal upper 1e-6 point; for df=49 this gives
    ~111.6 (exact: ~111.1), plenty accurate for a generous threshold.
    """
    z = 4.753
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_shapes_are_really_multilevel():
    assert [_depth(SumTree(c, branching=b)) for c, b in SHAPES] == [0, 1, 2, 2]


@pytest.mark.parametrize("capacity,branching", SHAPES)
def test_total_min_positive_get_match_brute_force(capacity, branching):
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity, branching=branching)
    ref = np.zeros(capacity)
    assert tree.total() == 0.0 and tree.min_positive() == math.inf
    for _ in range(30):
        m = int(rng.integers(1, 500))
        slots = rng.integers(0, capacity, m)
        values = rng.random(m) * (rng.random(m) < 0.7)
        tree.update(slots, values)
        for s, v in zip(slots, values):  # unambiguous last-wins reference
            ref[s] = v
        assert tree.total() == pytest.approx(ref.sum(), rel=1e-12, abs=1e-300)
        positive = ref[ref > 0]
        assert tree.min_positive() == (positive.min() if positive.size else math.inf)
    np.testing.assert_array_equal(tree.get(np.arange(capacity)), ref)


def test_min_positive_tracks_removals():
    tree = SumTree(10_000, branching=8)
    tree.update(np.array([5, 9_000, 42]), np.array([0.5, 0.01, 3.0]))
    assert tree.min_positive() == 0.01
    tree.update(np.array([9_000]), np.array([0.0]))
    assert tree.min_positive() == 0.5
    tree.update(np.array([5, 42]), 0.0)
    assert tree.min_positive() == math.inf and tree.total() == 0.0


@pytest.mark.parametrize("capacity,branching", SHAPES)
def test_find_matches_searchsorted(capacity, branching):
    rng = np.random.default_rng(7 + capacity)
    tree, values = _random_tree(rng, capacity, branching)
    cs = np.cumsum(values)
    prefix = rng.random(20_000) * cs[-1]
    got = tree.find(prefix)
    want = np.searchsorted(cs, prefix, side="right")
    off = got != want
    # The tree sums in a different order than np.cumsum, so only a prefix
    # within rounding distance of a boundary may legitimately disagree.
    lower = np.where(want > 0, cs[np.maximum(want - 1, 0)], 0.0)
    upper = cs[np.minimum(want, capacity - 1)]
    near = np.minimum(np.abs(prefix - lower), np.abs(prefix - upper))
    assert not off.any() or (near[off] <= 1e-9 * cs[-1]).all(), np.flatnonzero(off)[:5]
    assert off.sum() <= 3
    assert (values[got] > 0).all()


@pytest.mark.parametrize("capacity,branching", SHAPES)
def test_find_clamps_out_of_range_prefixes(capacity, branching):
    rng = np.random.default_rng(3)
    tree, values = _random_tree(rng, capacity, branching, zero_fraction=0.5)
    positive = np.flatnonzero(values)
    total = tree.total()
    got = tree.find(np.array([-5.0, 0.0, total, np.nextafter(total, 0), 2 * total]))
    assert got[0] == got[1] == positive[0]
    assert got[2] == got[3] == got[4] == positive[-1]


@pytest.mark.parametrize("capacity,branching", SHAPES)
def test_zero_slots_never_returned_even_at_boundaries(capacity, branching):
    rng = np.random.default_rng(11)
    for _ in range(3):
        # Mostly zeros, magnitudes over 16 decades: rounding is at its worst.
        values = rng.random(capacity) * (rng.random(capacity) < 0.2)
        values *= 10.0 ** rng.integers(-8, 8, capacity)
        values[-1] = 0.0  # a zero at the very end catches overshoot
        tree = SumTree(capacity, branching=branching)
        tree.update(np.arange(capacity), values)
        cs = np.cumsum(values)
        prefix = np.concatenate(
            [cs, np.nextafter(cs, 0), np.nextafter(cs, np.inf), rng.random(5_000) * cs[-1]]
        )
        assert (values[tree.find(prefix)] > 0).all()
        assert (values[tree.sample(4_096, rng)] > 0).all()


def test_single_positive_slot_is_always_found():
    for capacity, branching in SHAPES:
        tree = SumTree(capacity, branching=branching)
        tree.update(np.array([capacity - 1]), np.array([1e-300]))
        rng = np.random.default_rng(0)
        assert (tree.sample(1_000, rng) == capacity - 1).all()


def test_update_repeated_slot_last_value_wins():
    tree = SumTree(1_000, branching=8)
    tree.update(np.array([3, 5, 3, 3, 900, 5]), np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    np.testing.assert_array_equal(tree.get(np.array([3, 5, 900])), [4.0, 6.0, 5.0])
    assert tree.total() == 15.0

    rng = np.random.default_rng(5)
    tree = SumTree(50_000, branching=8)
    ref = np.zeros(50_000)
    for _ in range(20):
        slots = rng.integers(0, 300, 2_000)  # heavy repetition, spread over rows
        slots *= 150
        values = rng.random(2_000)
        tree.update(slots, values)
        for s, v in zip(slots, values):
            ref[s] = v
    np.testing.assert_array_equal(tree.get(np.arange(50_000)), ref)
    assert tree.total() == pytest.approx(ref.sum(), rel=1e-12)
    assert tree.min_positive() == ref[ref > 0].min()


def test_scalar_value_and_empty_update():
    tree = SumTree(100)
    tree.update(np.arange(0, 100, 10), 2.0)
    assert tree.total() == 20.0
    tree.update(np.array([], dtype=np.int64), np.array([]))
    assert tree.total() == 20.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0, -1e-300])
def test_invalid_values_raise_and_change_nothing(bad):
    tree = SumTree(1_000, branching=8)
    tree.update(np.array([1, 2]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=re.escape(repr(float(bad)))):
        tree.update(np.array([1, 7, 8]), np.array([0.5, bad, 1.0]))
    np.testing.assert_array_equal(tree.get(np.array([1, 2, 7, 8])), [1.0, 2.0, 0.0, 0.0])
    assert tree.total() == 3.0


def test_invalid_arguments():
    with pytest.raises(ValueError):
        SumTree(0)
    tree = SumTree(10)
    with pytest.raises(IndexError):
        tree.update(np.array([10]), np.array([1.0]))
    with pytest.raises(IndexError):
        tree.update(np.array([-1]), np.array([1.0]))
    with pytest.raises(IndexError):
        tree.get(np.array([10]))
    with pytest.raises(ValueError):
        tree.update(np.array([1, 2]), np.array([1.0]))
    with pytest.raises(ValueError):
        tree.sample(4, np.random.default_rng(0))  # total is 0
    with pytest.raises(ValueError):
        tree.find(np.array([0.0]))
    tree.update(np.array([1]), np.array([1.0]))
    with pytest.raises(ValueError):
        tree.sample(-1, np.random.default_rng(0))
    with pytest.raises(ValueError):
        tree.find(np.array([np.nan]))
    with pytest.raises(ValueError):
        tree.grow(5)
    assert tree.sample(0, np.random.default_rng(0)).shape == (0,)


def test_grow_keeps_values_and_adds_zero_slots():
    rng = np.random.default_rng(9)
    tree, values = _random_tree(rng, 3_000, 8)
    total = tree.total()
    tree.grow(3_000)  # same size: a no-op
    tree.grow(60_000)  # gains levels
    assert tree.capacity == 60_000
    np.testing.assert_array_equal(tree.get(np.arange(3_000)), values)
    assert (tree.get(np.arange(3_000, 60_000)) == 0).all()
    assert tree.total() == pytest.approx(total, rel=1e-12)
    assert tree.min_positive() == values[values > 0].min()
    assert (tree.sample(5_000, rng) < 3_000).all()

    tree.update(np.array([59_999]), np.array([total]))  # now half the mass
    picks = tree.sample(10_000, rng)
    assert abs((picks == 59_999).mean() - 0.5) < 0.01


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_frequencies_chi_square():
    rng = np.random.default_rng(2024)
    # 50 slots spread over several rows (branching 8), a few of them zero.
    tree = SumTree(50, branching=8)
    values = rng.random(50) + 0.05
    values[[4, 17, 33]] = 0.0
    tree.update(np.arange(50), values)
    positive = values > 0
    probs = values[positive] / values.sum()
    critical = _chi2_critical(int(positive.sum()) - 1)

    # Stratified sample() calls: counts are less dispersed than iid, so a
    # correct sampler passes easily and a biased one still fails.
    picks = np.concatenate([tree.sample(256, rng) for _ in range(800)])
    counts = np.bincount(picks, minlength=50)
    assert counts[~positive].sum() == 0
    assert _chi2(counts[positive], probs) < critical

    # iid uniform prefixes through find(): the textbook chi-square setting.
    picks = tree.find(rng.random(200_000) * tree.total())
    counts = np.bincount(picks, minlength=50)
    assert counts[~positive].sum() == 0
    assert _chi2(counts[positive], probs) < critical

    # The test has power: the same counts against uniform odds are rejected.
    uniform = np.full(int(positive.sum()), 1.0 / positive.sum())
    assert _chi2(counts[positive], uniform) > 100 * critical


def test_sampling_deep_tree_matches_mass_per_block():
    # Same check through a multi-level tree, pooled into 50 contiguous blocks.
    rng = np.random.default_rng(77)
    tree, values = _random_tree(rng, 40_000, 8, zero_fraction=0.5)
    picks = np.concatenate([tree.sample(256, rng) for _ in range(400)])
    assert (values[picks] > 0).all()
    counts = np.bincount(picks // 800, minlength=50)
    probs = values.reshape(50, 800).sum(axis=1) / values.sum()
    assert _chi2(counts, probs) < _chi2_critical(49)


def test_sampler_adds_and_removals_queued_together_match_the_state():
    """The sampler queues both new entries and removals and brings its trees up to date in
    one update before its next read: whatever the order of adds, removals and reuses of a
    slot before that read, the trees hold exactly the live entries' weights."""
    from distorefs.config import BufferConfig
    from distorefs.sampler import Sampler
    cfg = BufferConfig.from_dict({"sampler": "prioritized", "alpha": 0.6, "max_times_sampled": 2})
    s = Sampler(cfg)
    s.grow(64)
    rng = np.random.default_rng(4)
    live: dict[int, float] = {}
    for step in range(400):
        slot = int(rng.integers(64))
        if slot in live and rng.random() < 0.5:
            s.remove(slot)
            del live[slot]
        elif slot not in live:
            p = float(rng.uniform(0.1, 5))
            times = 2 if rng.random() < 0.1 else 0  # spent already: not drawable
            s.add(slot, p, times)
            live[slot] = p if times < 2 else 0.0
        if step % 37 == 0 or step == 399:  # a read: the queue is applied
            want = sum(p ** 0.6 for p in live.values())
            assert math.isclose(s.weighted_total(), want, rel_tol=1e-9, abs_tol=1e-9)
            assert s.drawable_count() == sum(1 for p in live.values() if p > 0)
            drawn = s.draw(32, None)
            assert all(live.get(int(d), 0) > 0 for d in drawn)
    # inserts and evictions with no read between them: the queue stays bounded
    from distorefs.sampler import QUEUED_MAX
    for i in range(3 * QUEUED_MAX):
        s.remove(i % 64)
        s.add(i % 64, 1.0)
        assert len(s._queued) < QUEUED_MAX
    assert s.drawable_count() == 64


def test_a_weighted_draw_takes_the_slots_of_sample_with_their_probabilities_and_weights(code):
    """sample_weighted() draws what sample() draws from the same generator state and gives
    each slot's probability (leaf / total) and importance weight ((leaf / min_positive) **
    -beta) from the same C call; on numpy alone it is None (the caller computes them)."""
    rng = np.random.default_rng(8)
    for capacity, branching in SHAPES:
        tree, values = _random_tree(rng, capacity, branching, zero_fraction=0.5)
        for n, beta in ((1, 0.4), (64, 0.4), (256, 1.0), (1000, 0.0)):
            drawn = tree.sample_weighted(n, np.random.default_rng(n), beta)
            if code == "numpy":
                assert drawn is None
                continue
            slots, pw = drawn
            np.testing.assert_array_equal(slots, tree.sample(n, np.random.default_rng(n)))
            leaf = values[slots]
            np.testing.assert_allclose(pw[0], leaf / values.sum(), rtol=1e-9)
            np.testing.assert_allclose(pw[1], (leaf / values[values > 0].min()) ** -beta, rtol=1e-9)
    assert SumTree(16).sample_weighted(4, rng, 0.4) is None  # every value 0: sample() raises


def test_the_samplers_weighted_draw_gives_what_probabilities_gives(code):
    """Sampler.draw_weighted() is draw() with probabilities() of its slots, in one call, for a
    prioritized buffer; None for the other samplers and an empty buffer."""
    from distorefs.config import BufferConfig
    from distorefs.sampler import Sampler
    cfg = BufferConfig.from_dict({"sampler": "prioritized", "alpha": 0.6, "beta": 0.4, "seed": 3})
    twins = [Sampler(cfg), Sampler(cfg)]
    rng = np.random.default_rng(2)
    priorities = rng.uniform(0.01, 5, 300)
    for s in twins:
        s.grow(512)
        assert s.draw_weighted(8) is None  # nothing drawable yet
        for slot, p in enumerate(priorities):
            s.add(slot, float(p), 0)
    one, other = twins
    for n in (1, 64, 256):
        drawn = one.draw_weighted(n)
        if code == "numpy":
            assert drawn is None
            continue
        slots, probs, weights = drawn
        np.testing.assert_array_equal(slots, other.draw(n, None))
        want_p, want_w = other.probabilities(slots, np.zeros(0, dtype=np.int64))
        np.testing.assert_allclose(probs, want_p, rtol=1e-9)
        np.testing.assert_allclose(weights, want_w, rtol=1e-9)
    uniform = Sampler(BufferConfig.from_dict({"sampler": "uniform"}))
    uniform.grow(8)
    uniform.add(0, 1.0, 0)
    assert uniform.draw_weighted(1) is None

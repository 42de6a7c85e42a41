"""The prefetcher without FUSE: hits along the plan, late arrivals, misses off the plan,
the byte budget, skipped values dropped behind the reader, and a new plan per epoch."""

import threading

import trio

from distorefs.prefetcher import PrefetchBudget, Prefetcher, PrefetchStreams


def run(fn):
    async def main():
        async with trio.open_nursery() as nursery:
            await fn(nursery)
            nursery.cancel_scope.cancel()
    trio.run(main)


async def settle(p: Prefetcher) -> None:
    """Wait until the prefetcher has loaded its whole plan (the machine may be slow)."""
    with trio.fail_after(10):
        while True:
            s = p.stats()
            if s["in_flight"] == 0 and s["position"] == s["planned"]:
                return
            await trio.sleep(0.01)


def both_kinds(nursery):
    """(streams?, budget, a Prefetcher, then a PrefetchStreams) over values of 100 bytes."""
    def fetch(keys):
        return [bytes([k % 256]) * 100 for k in keys]
    for streams in (False, True):
        budget = PrefetchBudget(1 << 20)
        kind = PrefetchStreams if streams else Prefetcher
        yield streams, budget, kind(budget, fetch, spawn=nursery.start_soon, batch_items=8)


def test_hits_late_misses_budget_and_new_plans():
    loaded = []
    gate = threading.Event()
    gate.set()

    def fetch(keys):
        gate.wait()
        loaded.extend(keys)
        return [bytes([k % 256]) * 1000 for k in keys]

    async def fn(nursery):
        budget = PrefetchBudget(50_000)
        p = Prefetcher(budget, fetch, spawn=nursery.start_soon, batch_items=4, workers=2, lag=8)
        p.declare(list(range(200)))
        await trio.sleep(0.2)
        assert 40_000 <= budget.used <= 50_000 + 4 * 1000 and p.stats()["position"] < 100  # bounded
        budget.capacity = 1 << 20  # now room for the whole plan: every read below is a hit or late
        p.declare(list(range(200)))
        await settle(p)
        for k in range(200):
            value = await p.take(k)
            assert value == bytes([k % 256]) * 1000
        s = p.stats()
        assert s["hits"] + s["late"] == 200 and s["misses"] == 0
        assert await p.take(5000) is None and p.stats()["misses"] == 1  # not in the plan
        assert budget.used == 0
        # a reader that skips: values it went past are dropped, the budget comes back
        p.declare(list(range(1000, 1040)))
        await settle(p)
        assert await p.take(1030) is not None
        assert p.stats()["skipped"] >= 20
        # a new plan drops what the old one held
        p.declare(list(range(2000, 2010)))
        await settle(p)
        assert all(k >= 2000 for k in p._held) and p.stats()["plans"] == 4
        # a value still loading when asked for is waited for (late), not read twice
        gate.clear()
        p.declare([3000])
        await trio.sleep(0.05)
        nursery.start_soon(trio.to_thread.run_sync, lambda: (trio.from_thread.run_sync(lambda: None), gate.set()))
        assert await p.take(3000) == bytes([3000 % 256]) * 1000
        assert p.stats()["late"] >= 1 and loaded.count(3000) == 1

    run(fn)


def test_streams_each_read_ahead_and_replace_only_their_own_plan():
    """Two ranks declare their halves of an epoch: both are read ahead (a second declaration
    used to replace the first); a rank's next epoch replaces its own plan only."""

    def fetch(keys):
        return [bytes([k % 256]) * 100 for k in keys]

    async def fn(nursery):
        budget = PrefetchBudget(1 << 20)
        p = PrefetchStreams(budget, fetch, spawn=nursery.start_soon, batch_items=8)
        p.declare(list(range(0, 100, 2)), stream=1)
        p.declare(list(range(1, 100, 2)), stream=2)
        for s in p.streams.values():
            await settle(s)
        for k in range(100):
            assert await p.take(k) == bytes([k % 256]) * 100
        c = p.stats()
        assert c["hits"] + c["late"] == 100 and c["misses"] == 0 and c["streams"] == 2
        p.declare(list(range(200, 210)), stream=1)
        p.declare([7, 9], stream=2)
        for s in p.streams.values():
            await settle(s)
        assert await p.take(205) is not None and await p.take(9) is not None
        p.drop(1)
        assert list(p.streams) == [2] and budget.used == 100  # what stream 1 held went with it
        assert await p.take(5000) is None and p.stats()["misses"] == 1

    run(fn)


def test_a_value_pushed_into_the_page_cache_counts_once_when_its_read_asks_for_it():
    """A value the prefetcher pushed into the kernel's page cache is a hit with nothing held
    here. If the read asks for it anyway (its open came before the push, its READ after),
    that read is counted once: a hit, not also a miss (a DDP epoch of 400 files once counted
    401 opens)."""
    async def fn(nursery):
        for streams, budget, p in both_kinds(nursery):
            p.push = lambda key, value: True  # the kernel took every value
            p.declare([1, 2, 3])
            await settle(p.streams[None] if streams else p)
            assert await p.take(2) is None  # pushed: the read is served elsewhere
            c = p.stats()
            assert (c["hits"], c["late"], c["misses"]) == (1, 0, 0), (streams, c)

    run(fn)


def test_a_value_held_because_its_push_was_refused_is_pushed_when_asked_again():
    """A value the push hook refused at its load (the kernel did not hold the item's inode
    yet) is held in memory; `push_held` pushes it once the hook takes it: it leaves the
    budget, and its read is a hit with nothing held here. A refused push keeps it held."""
    async def fn(nursery):
        for streams, budget, p in both_kinds(nursery):
            known: set[int] = set()
            pushed: list[tuple[int, bytes]] = []

            def push(key, value):
                if key not in known:
                    return False
                pushed.append((key, value))
                return True
            p.push = push
            p.declare([1, 2, 3])
            await settle(p.streams[None] if streams else p)
            assert p.stats()["held"] == 3 and budget.used == 300 and not pushed
            assert not p.push_held(2)  # still refused: kept
            assert p.stats()["held"] == 3
            known.add(2)
            assert p.push_held(2) and pushed == [(2, bytes([2]) * 100)]
            assert not p.push_held(2)  # nothing held for it any more
            s = p.stats()
            assert (s["held"], s["pushed"], budget.used) == (2, 1, 200), (streams, s)
            assert p.take_nowait(2) == (None, True)  # a hit, served by the page cache
            assert await p.take(1) == bytes([1]) * 100
            c = p.stats()
            assert (c["hits"], c["late"], c["misses"]) == (2, 0, 0), (streams, c)

    run(fn)

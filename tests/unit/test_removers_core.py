"""Removers (evict = fifo | lifo | uniform | lowest_priority) on a real store, no FUSE."""

import collections

import pytest
import trio

from distorefs.errors import InvalidConfig
from distorefs.owner import Owner
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
DIR = Owner(0o40755, 1000, 1000)


async def raw_buffer(store, config: bytes):
    buf = await store.create_buffer("rb", DIR)
    await store.configure_buffer("rb", config)
    return buf


async def insert(buf, *keys):
    for key in keys:
        await buf.insert(key.encode(), b"value of " + key.encode(), OWNER)


def keys(ring) -> list[str]:
    return [m.key.decode() for m in ring.oldest()]


def test_fifo_lifo_uniform(tmp_path):
    async def body(store):
        buf = await raw_buffer(store, b'{"capacity": 3, "raw": true}')
        await insert(buf, "a", "b", "c", "d")
        assert keys(buf.ring) == ["b", "c", "d"]  # fifo: the default
        await store.configure_buffer("rb", b'{"evict": "lifo"}')
        await insert(buf, "e", "f")
        assert keys(buf.ring) == ["b", "c", "f"]  # a stack: each insert pushes out the newest
        await store.configure_buffer("rb", b'{"evict": "uniform", "seed": 7}')
        evicted = collections.Counter()  # position (0 = oldest) of the entry each insert evicted
        for i in range(300):
            before = keys(buf.ring)
            await insert(buf, f"u{i}")
            (gone,) = set(before) - set(keys(buf.ring))
            evicted[before.index(gone)] += 1
        # uniform: each position about a third of the time (fifo or lifo put all 300 in one)
        assert all(60 <= evicted[p] <= 140 for p in range(3)), evicted
        assert buf.stats()["evict"] == "uniform"
    run(tmp_path / "s", body)


def test_lowest_priority(tmp_path):
    async def body(store):
        buf = await raw_buffer(store, b'{"capacity": 4, "raw": true, "evict": "lowest_priority", '
                                      b'"initial_priority": 1.0}')
        await insert(buf, "a", "b", "c", "d", "e")
        assert keys(buf.ring) == ["b", "c", "d", "e"]  # equal priorities: the oldest first
        await buf.set_priorities([(b"b", 5.0), (b"c", 0.5), (b"d", 3.0), (b"e", 2.0)])
        await insert(buf, "f")  # priority 1.0
        assert keys(buf.ring) == ["b", "d", "e", "f"]  # c (0.5) left
        await insert(buf, "g")
        assert keys(buf.ring) == ["b", "d", "e", "g"]  # f (1.0) and g tie: the older one leaves
        await buf.set_priorities([(b"b", 0.1)])  # a priority lowered later counts
        await insert(buf, "h")
        assert keys(buf.ring) == ["d", "e", "g", "h"]
        # shrinking the capacity evicts by priority too
        await buf.set_priorities([(b"d", 0.2), (b"g", 9.0), (b"h", 8.0)])
        await store.configure_buffer("rb", b'{"capacity": 2}')
        assert keys(buf.ring) == ["g", "h"]
        # many priority updates: the heap is rebuilt, never loses a live entry
        await store.configure_buffer("rb", b'{"capacity": 50}')
        await insert(buf, *[f"m{i}" for i in range(48)])
        for rnd in range(200):
            await buf.set_priorities([(f"m{i}".encode(), float((i * 7 + rnd) % 50 + 10)) for i in range(48)])
        prio = {m.key.decode(): buf.sampler.priority[m.slot] for m in buf.ring.oldest()}
        lowest = min(prio, key=lambda k: (prio[k], buf.ring.get(k.encode()).seq))
        await insert(buf, "n")
        assert lowest not in keys(buf.ring) and len(buf.ring) == 50
    run(tmp_path / "s", body)


def test_reopen_and_switch(tmp_path):
    path = tmp_path / "s"

    async def first(store):
        buf = await raw_buffer(store, b'{"capacity": 3, "raw": true, "evict": "lowest_priority"}')
        await insert(buf, "a", "b", "c")
        await buf.set_priorities([(b"a", 3.0), (b"b", 1.0), (b"c", 2.0)])
    run(path, first)

    async def second(store):  # priorities loaded from the store order the evictions
        buf = store.buffer("rb")
        await insert(buf, "d")
        assert keys(buf.ring) == ["a", "c", "d"]
        await store.configure_buffer("rb", b'{"evict": "fifo"}')
        await insert(buf, "e")
        assert keys(buf.ring) == ["c", "d", "e"]
        with pytest.raises(InvalidConfig, match="evict must be one of"):
            await store.configure_buffer("rb", b'{"evict": "random"}')
        bank = await store.create("banks", "mem", DIR)
        await store.configure("banks", "mem", b'{"capacity": 2, "evict": "lifo"}')
        for key in (b"x", b"y", b"z"):
            await bank.insert(key, key, OWNER)
        assert keys(bank.ring) == ["x", "z"]
        with pytest.raises(InvalidConfig, match="evict must be one of fifo, lifo, uniform, got 'lowest_priority'"):
            await store.configure("banks", "mem", b'{"evict": "lowest_priority"}')  # banks have no priorities
    run(path, second)


@pytest.mark.parametrize("evict", ["fifo", "lifo", "uniform", "lowest_priority"])
def test_concurrent_inserts_stay_within_capacity(tmp_path, evict):
    """Inserts committed in one group plan their evictions together."""
    async def body(store):
        buf = await raw_buffer(store, b'{"capacity": 20, "raw": true, "evict": "%s"}' % evict.encode())
        for rnd in range(4):
            async with trio.open_nursery() as nursery:
                for w in range(8):
                    nursery.start_soon(insert, buf, f"r{rnd}w{w}")
            assert len(buf.ring) == min(20, 8 * (rnd + 1))
        await insert(buf, "last")
        assert len(buf.ring) == 20 and "last" in keys(buf.ring)
    run(tmp_path / "s", body)


@pytest.mark.parametrize("evict", ["fifo", "lifo", "uniform", "lowest_priority"])
def test_a_group_never_leaves_the_ring_over_its_bounds(tmp_path, evict):
    """More new entries in one commit group than the ring holds (insert_many, or many
    writers at once into a small ring): the ring stays within capacity and max_bytes."""
    async def body(store):
        buf = await raw_buffer(store, b'{"capacity": 30, "raw": true, "evict": "%s"}' % evict.encode())
        results = await buf.ring.insert_many([(b"a%d" % i, b"v" * 10) for i in range(40)], OWNER)
        assert all(not isinstance(r, BaseException) for r in results)
        assert len(buf.ring) == 30
        await store.configure_buffer("rb", b'{"capacity": 5}')
        async with trio.open_nursery() as nursery:
            for w in range(8):
                nursery.start_soon(insert, buf, f"w{w}")
        assert len(buf.ring) == 5
        await store.configure_buffer("rb", b'{"capacity": 1000, "max_bytes": 100}')
        results = await buf.ring.insert_many([(b"b%d" % i, b"v" * 30) for i in range(10)], OWNER)
        assert all(not isinstance(r, BaseException) for r in results)
        assert buf.ring.bytes <= 100 and len(buf.ring) == 3
    run(tmp_path / "s", body)

"""The sample-to-insert rate limiter (distorefs/ratelimit.py) without FUSE: Reverb's range,
the waits of both sides (on trio's mock clock: waited seconds are virtual), batches larger
than the range, interruption, reconfiguration, and a buffer's counting (new entries, not
rewrites; counting starting over when the store is opened again)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from distorefs.config import BufferConfig
from distorefs.errors import Interrupted, InvalidConfig, WouldBlock
from distorefs.owner import Owner
from distorefs.ratelimit import RateLimiter, Ratio
from store_runner import run

OWNER = Owner(0o100644, 1000, 1000)
DIR = Owner(0o40755, 1000, 1000)


class Table:
    """A buffer as the limiter sees it: a size, inserts committed through tickets."""

    def __init__(self, r: float, e: float, m: int) -> None:
        self.entries = 0
        self.limiter = RateLimiter("t", lambda: self.entries, Ratio(r, e, m))
        self.errors: list[float] = []

    async def insert(self, nonblocking: bool = False, abandoned=None) -> None:
        ticket = await self.limiter.admit_insert(nonblocking, abandoned)
        self.entries += 1
        self.limiter.inserted()
        if ticket is not None:  # None: no limiter
            ticket.release()
        self.errors.append(self.limiter.error())

    async def sample(self, n: int, nonblocking: bool = False, abandoned=None) -> None:
        await self.limiter.admit_sample(n, nonblocking, abandoned)
        self.errors.append(self.limiter.error())


def mock_run(fn, *args):
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_range_is_reverbs_and_nonblocking_calls_get_wouldblock():
    async def body():
        t = Table(2.0, 4.0, 3)  # the error must stay in [3*2 - 4, 3*2 + 4] = [2, 10]
        lim = t.limiter
        with pytest.raises(WouldBlock, match="holds samples back"):
            await t.sample(1, nonblocking=True)  # fewer than min_size entries: nothing to sample
        for _ in range(3):
            await t.insert(nonblocking=True)  # below min_size inserts never wait
        assert lim.error() == 6.0  # filled from empty: the middle of the range
        await t.insert(nonblocking=True)  # 8
        await t.insert(nonblocking=True)  # 10: the top
        with pytest.raises(WouldBlock, match="holds inserts back"):
            await t.insert(nonblocking=True)  # 12 > 10
        with pytest.raises(WouldBlock):
            await t.sample(9, nonblocking=True)  # 10 - 9 < 2: all or nothing
        await t.sample(8, nonblocking=True)  # 2: the bottom
        with pytest.raises(WouldBlock):
            await t.sample(1, nonblocking=True)
        await t.insert(nonblocking=True)  # 4
        s = lim.stats()
        assert (s["inserts"], s["samples"], s["ratio"], s["error"]) == (6, 8, round(8 / 6, 4), 4.0)
        assert (s["min_error"], s["max_error"]) == (2.0, 10.0)
        assert s["insert"]["eagain"] == 1 and s["sample"]["eagain"] == 3
        assert s["insert"]["waits"] == s["sample"]["waits"] == 0
        assert min(t.errors[3:]) >= 2.0 and max(t.errors) <= 10.0
    mock_run(body)


def test_admitted_inserts_count_before_they_commit():
    async def body():
        t = Table(1.0, 1.0, 1)  # range [0, 2]
        await t.insert()  # error 1
        first = await t.limiter.admit_insert(True)  # would make 2
        with pytest.raises(WouldBlock):
            await t.limiter.admit_insert(True)  # 3 with the one admitted: actors creating together cannot overshoot
        first.release()
        first.release()  # twice is harmless
        assert t.limiter.admitted == 0
        await t.limiter.admit_insert(True)
    mock_run(body)


def test_each_side_waits_for_the_other_and_the_time_is_counted():
    async def body():
        t = Table(1.0, 1.0, 2)  # range [1, 3]
        for _ in range(3):
            await t.insert()  # 3: the top
        done = []

        async def inserter():
            await t.insert()
            done.append(("insert", trio.current_time()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(inserter)
            await trio.sleep(10)
            assert not done and t.limiter.stats()["insert"]["waiting"] == 1
            await t.sample(1)  # 2: room for the insert
        assert done == [("insert", 10.0)]
        s = t.limiter.stats()["insert"]
        assert s["waits"] == 1 and s["wait_seconds"] == 10.0 and s["waiting"] == 0

        await t.sample(2)  # 3 - 2 = 1: the bottom
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.sample, 1)
            await trio.sleep(4)
            assert t.limiter.stats()["sample"]["waiting"] == 1
            await t.insert()
        s = t.limiter.stats()["sample"]
        assert s["waits"] == 1 and s["wait_seconds"] == 4.0
        assert t.limiter.stats()["samples"] == 4
    mock_run(body)


def test_a_batch_larger_than_the_range_takes_what_there_is_and_waits_for_the_rest():
    async def body():
        t = Table(1.0, 2.0, 1)  # range [-1, 3]: a batch of 25 can never fit at once
        await t.insert()

        async def actor():
            while True:
                await t.insert()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor)
            await t.sample(25)
            nursery.cancel_scope.cancel()
        assert t.limiter.samples == 25
        assert -1.0 <= min(t.errors) and max(t.errors) <= 3.0  # never outside the range meanwhile
    mock_run(body)


def test_an_abandoned_wait_is_interrupted_and_gives_back_what_it_counted():
    async def body():
        t = Table(1.0, 2.0, 1)  # range [-1, 3]
        await t.insert()  # error 1: room for 2 samples
        gave_up = False
        ended = []

        async def learner():
            with pytest.raises(Interrupted):
                await t.sample(5, False, lambda: gave_up)
            ended.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(learner)
            await trio.sleep(2)
            assert t.limiter.samples == 2  # the room there was, taken
            gave_up = True
        assert ended and ended[0] <= 2.5  # within a tick of giving up
        assert t.limiter.samples == 0
        with pytest.raises(Interrupted):
            for _ in range(4):
                await t.insert(abandoned=lambda: True)
        assert t.limiter.inserts == 3 and t.limiter.admitted == 0
    mock_run(body)


def test_new_settings_wake_the_waiters_and_counting_starts_over():
    async def body():
        t = Table(1.0, 1.0, 2)  # range [1, 3]
        for _ in range(3):
            await t.insert()
        woken = []

        async def inserter():
            await t.insert()
            woken.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(inserter)
            await trio.sleep(3)
            t.limiter.configure(Ratio(1.0, 1.0, 2))  # the same settings: nothing changes
            await trio.sleep(3)
            assert not woken and t.limiter.inserts == 3
            t.limiter.configure(Ratio(1.0, 5.0, 2))  # a wider range: counting restarts at min(size, m) = 2
        assert woken == [6.0] and t.limiter.inserts == 3 and t.limiter.samples == 0
        claim = await t.limiter.admit_sample(1)
        t.limiter.restart()
        claim.give_back()  # counted before the restart: nothing to undo
        assert t.limiter.samples == 0
        async with trio.open_nursery() as nursery:  # switched off: every waiter goes
            t.limiter.configure(Ratio(1.0, 1.0, 2))  # 4 entries: counting from 2 inserts, error 2
            await t.insert(nonblocking=True)  # 3: the top
            nursery.start_soon(t.insert)
            await trio.sleep(1)
            assert t.entries == 5 and t.limiter.stats()["insert"]["waiting"] == 1
            t.limiter.configure(None)
        assert t.entries == 6 and t.limiter.stats() is None and not t.limiter.enabled
    mock_run(body)


def test_config_needs_an_error_buffer_both_sides_can_move_in():
    with pytest.raises(InvalidConfig, match=r"error_buffer must be >= max\(1, samples_per_insert\) = 4 .*got 3"):
        BufferConfig.from_dict({"samples_per_insert": 4, "error_buffer": 3})
    with pytest.raises(InvalidConfig, match=r"= 1 .*got None"):
        BufferConfig.from_dict({"samples_per_insert": 0.5})
    with pytest.raises(InvalidConfig, match="samples_per_insert must be in .*got -1"):
        BufferConfig.from_dict({"samples_per_insert": -1, "error_buffer": 2})
    with pytest.raises(InvalidConfig, match="error_buffer must be in .*got -2"):
        BufferConfig.from_dict({"error_buffer": -2})
    assert Ratio.of(0, 10, 3) is None and Ratio.of(None, None, 3) is None  # 0 and null: no limiter
    config = BufferConfig.from_dict({"samples_per_insert": 0.5, "error_buffer": 1, "min_size_to_sample": 10})
    ratio = Ratio.of(config.samples_per_insert, config.error_buffer, config.min_size_to_sample)
    assert (ratio.min_error, ratio.max_error) == (4.0, 6.0)
    assert BufferConfig.from_dict({"samples_per_insert": 0, "error_buffer": 2}).samples_per_insert == 0


def test_a_buffer_counts_new_entries_and_starts_counting_again_when_reopened(tmp_path):
    config = b'{"samples_per_insert": 2, "error_buffer": 2, "min_size_to_sample": 3, "sampler": "fifo"}'

    async def first(store):
        buf = await store.create_buffer("b", DIR)
        assert buf.stats()["rate_limiter"] is None  # the default: no limiter
        await store.configure("buffers", "b", config)
        for i in range(4):  # range [4, 8]: 3 free, then 8
            ticket = await buf.admit_insert(nonblocking=True)
            await buf.insert(b"k%d" % i, b"x" * 10, OWNER)
            ticket.release()
        with pytest.raises(WouldBlock):
            await buf.admit_insert(nonblocking=True)
        await buf.insert(b"k0", b"y" * 10, OWNER)  # a rewrite is no insert
        s = buf.stats()["rate_limiter"]
        assert (s["inserts"], s["samples"], s["error"]) == (4, 0, 8.0)
        batch = await buf.sample(8, nonblocking=True)  # fifo: the 4 entries there are; 4 given back
        assert len(batch.metas) == 4 and buf.stats()["rate_limiter"]["samples"] == 4
        with pytest.raises(WouldBlock):
            await buf.sample(1, nonblocking=True)  # 8 - 4 = 4: the bottom

    async def again(store):
        buf = store.buffer("b")
        s = buf.stats()["rate_limiter"]
        # counting started over: the 4 entries held count as min(4, 3) inserts, no samples
        assert (s["inserts"], s["samples"], s["error"]) == (3, 0, 6.0)
        batch, _ = await buf.sample_npz(2, nonblocking=True)
        buf.release(batch)
        assert buf.stats()["rate_limiter"]["samples"] == 2

    run(tmp_path / "s", first)
    run(tmp_path / "s", again)

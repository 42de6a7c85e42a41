"""The committer's thread (distorefs/lane.py): calls run in order in one thread, results
and errors come back to the caller, an idle thread ends and the next call starts another,
and a wait is not cut short by a cancellation (the work is under way)."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from distorefs import lane as lane_mod
from distorefs.lane import Lane


def test_calls_run_in_order_in_one_thread_and_answer_their_caller():
    async def main():
        lane = Lane("test-lane")
        seen: list[tuple[int, int]] = []

        async def call(i: int) -> None:
            assert await lane.run(lambda: seen.append((i, threading.get_ident())) or i * 2) == i * 2

        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(call, i)
        assert sorted(i for i, _ in seen) == list(range(50))
        assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await lane.run(lambda: 1 / 0)
        assert await lane.run(lambda: "after an error") == "after an error"
    trio.run(main)


def test_an_idle_thread_ends_and_the_next_call_starts_another(monkeypatch):
    monkeypatch.setattr(lane_mod, "IDLE_S", 0.01)

    async def main():
        lane = Lane("test-lane-idle")
        first = await lane.run(threading.get_ident)
        await trio.sleep(0.2)
        assert not any(t.ident == first and t.is_alive() for t in threading.enumerate())
        answers = []
        for i in range(200):  # calls that come as the thread is deciding to end are all served
            answers.append(await lane.run(lambda i=i: i))
            if i % 7 == 0:
                await trio.sleep(0.012)
        assert answers == list(range(200))
    trio.run(main)


def test_a_cancelled_caller_still_gets_the_work_done():
    async def main():
        lane = Lane("test-lane-cancel")
        done = []
        with trio.move_on_after(0.01):
            answer = await lane.run(lambda: time.sleep(0.1) or done.append(1) or "done")
        assert done == [1] and answer == "done"
    trio.run(main)


def test_a_lane_of_several_threads_runs_that_many_calls_at_once_and_no_more():
    async def main():
        lane = Lane("test-lane-wide", threads=3)
        lock = threading.Lock()
        running, most, threads = [0], [0], set()

        def work() -> int:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
                threads.add(threading.get_ident())
            time.sleep(0.02)
            with lock:
                running[0] -= 1
            return 1

        results = []

        async def call() -> None:
            results.append(await lane.run(work))

        async with trio.open_nursery() as nursery:
            for _ in range(12):
                nursery.start_soon(call)
        assert results == [1] * 12
        assert most[0] == 3 and len(threads) == 3
        with pytest.raises(ValueError):
            Lane("none", threads=0)
    trio.run(main)


def test_handing_a_call_over_never_blocks_the_event_loop_on_the_lanes_bookkeeping():
    """The event loop hands a call over and goes on at once, even while a lane thread holds
    the lane's lock (the OS may preempt it there on a busy machine: the loop, and every
    request it serves, would wait for that thread to be scheduled again)."""
    async def main():
        lane = Lane("test-lane-busy")
        assert await lane.run(lambda: 1) == 1  # its thread is up, and idle
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await trio.sleep(0.005)

        held = threading.Event()
        release = threading.Event()

        def hold_lock():  # as a lane thread preempted inside its bookkeeping would
            with lane._lock:
                held.set()
                release.wait(0.5)

        holder = threading.Thread(target=hold_lock)
        holder.start()
        held.wait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0.02)
            start = time.monotonic()
            nursery.start_soon(lane.run, lambda: 2)  # handed over while the lock is held
            await trio.sleep(0.2)
            loop_ticks = [t for t in ticks if t > start]
            release.set()
            nursery.cancel_scope.cancel()
        holder.join()
        # the loop kept running (a tick every ~5 ms) while the lock was held
        assert len(loop_ticks) >= 10, f"the event loop stalled: {len(loop_ticks)} ticks in 0.2 s"
        assert await lane.run(lambda: 3) == 3
    trio.run(main)

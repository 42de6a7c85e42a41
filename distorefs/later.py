"""Work put off by a delay, at most once per key waiting: the retirement grace of replaced
weights versions and checkpoint files (a timer each, in the store's nursery)."""

from __future__ import annotations

from typing import Callable, Hashable

import trio


class Later:
    """Calls `fn(*args)` `delay` seconds after `call` asked, once per key: a call for a key
    already waiting does nothing (the waiting one looks at things afresh when it runs)."""

    def __init__(self, spawn: Callable[..., None]) -> None:
        self._spawn = spawn
        self._waiting: set[Hashable] = set()

    def call(self, key: Hashable, delay: float, fn: Callable[..., None], *args) -> None:
        if key not in self._waiting:
            self._waiting.add(key)
            self._spawn(self._run, key, delay, fn, args)

    async def _run(self, key: Hashable, delay: float, fn: Callable[..., None], args: tuple) -> None:
        try:
            await trio.sleep(delay)
        finally:
            self._waiting.discard(key)
        fn(*args)

"""Running a store in a test: open it, run one coroutine with its background tasks, close it."""

import trio

from distorefs.store import Store


def run(path, fn, **store_kwargs):
    """Open the store at `path`, run `await fn(store)` with its tasks running, close it."""
    store = Store(path, **store_kwargs)
    result = None

    async def main():
        nonlocal result
        async with store.running():
            result = await fn(store)

    try:
        trio.run(main)
    finally:
        store.close()
    return result

"""The weights tree as a library (no FUSE): publish from a draft, versions, reads across
chunks, renames, collection and persistence."""

import numpy as np

from distorefs.owner import Owner
from store_runner import run
from distorefs.weights import ROOT_ID

DIR = Owner(0o40755, 0, 0)
FILE = Owner(0o100644, 0, 0)
DATA = np.random.default_rng(0).integers(0, 256, (3 << 20) + 123, dtype=np.uint8).tobytes()


async def publish(tree, parent, name, data):
    return await tree.write_file(parent, name, data, FILE)


def test_publish_read_versions_rename_and_persist(tmp_path):
    async def write(store):
        tree = store.weights
        tree.RETIRE_GRACE_S = 0  # versions retired are collected at once
        await store.configure_weights(b'{"chunk_bytes": 1048576, "keep_versions": 2}')
        model = await tree.mkdir(ROOT_ID, b"m", DIR)
        node = await publish(tree, model.id, b"w.bin", DATA)
        v1 = node.current
        assert len(v1.chunks) == 4 and v1.size == len(DATA)
        # ranges across chunk borders
        for off, size in ((0, 10), ((1 << 20) - 5, 10), (len(DATA) - 7, 100), (123, 3 << 20)):
            assert await tree.read(node, v1, off, size) == DATA[off:off + size]
        tree.opened(v1)  # a reader holds version 1
        for i in range(2, 5):
            await publish(tree, model.id, b"w.bin", bytes([i]) * 1000)
        await store.committer.drain()  # collection runs behind the publish
        assert [v.number for v in node.versions] == [1, 3, 4]  # 2 collected, 1 still read
        assert await tree.read(node, v1, 0, 100) == DATA[:100]
        tree.closed(node, v1)
        await store.committer.drain()
        assert [v.number for v in node.versions] == [3, 4]
        await tree.mkdir(model.id, b"v1", DIR)
        await tree.symlink(model.id, b"latest", b"v1", FILE)
        await tree.rename(model.id, b"w.bin", model.id, b"renamed.bin")
        assert tree.child(model.id, b"renamed.bin") is node
        return node.id

    node_id = run(tmp_path / "s", write)

    async def read(store):
        tree = store.weights
        assert tree.config.keep_versions == 2 and tree.config.chunk_bytes == 1 << 20
        node = tree.resolve("m/renamed.bin")
        assert node.id == node_id and node.current.number == 4
        assert await tree.read(node, node.current, 0, 2000) == bytes([4]) * 1000
        assert tree.resolve("m/latest").target == b"v1"
        assert tree.stats()["versions"] == 2

    run(tmp_path / "s", read)


def test_an_open_of_a_file_replaced_since_its_lookup_reads_it_within_the_grace_else_asks_again(tmp_path):
    """tmp + rename from another process (or node) between a reader's lookup and its open.
    Within the retirement grace the replaced file's version is still there: the open reads
    it whole (under writers that replace the name faster than a lookup and its open, even
    the kernel's one retry of a Stale open would find its file replaced again). Once
    collected, the open is Stale (the kernel then looks the name up again and opens the new
    file) rather than an empty read."""
    from distorefs.errors import Stale
    import pytest

    async def body(store):
        tree = store.weights
        model = await tree.mkdir(ROOT_ID, b"m", DIR)
        old = await publish(tree, model.id, b"w.bin", DATA)
        gen = old.gen  # what the reader's lookup found
        for i in range(2):  # replaced twice
            await publish(tree, model.id, b"tmp", b"new" * 1000)
            await tree.rename(model.id, b"tmp", model.id, b"w.bin")
        await store.committer.drain()
        handle = tree.open_read(old, gen)
        assert await handle.read(0, len(DATA)) == DATA
        handle.release()
        tree.RETIRE_GRACE_S = 0
        tree.collect_unkept(old)
        await store.committer.drain()
        with pytest.raises(Stale):
            tree.open_read(old, gen)
        new = tree.child(model.id, b"w.bin")
        handle = tree.open_read(new, new.gen)  # what the second lookup finds
        assert handle.version is not None and handle.version.size == 3000

    run(tmp_path / "s", body)


def test_a_reader_that_opens_a_file_while_a_rename_over_it_commits_reads_it_whole(tmp_path):
    """The safetensors idiom from another writer (tmp, then rename over the name) while a
    reader opens the name: the rename is planned, its transaction runs in a worker thread,
    and the open comes in between (the name still names the old file). The reader then
    holds the old version, so its chunks must outlive that transaction: they go when its
    last reader closes, not in the rename."""
    import trio

    from distorefs.committer import Overlay
    from distorefs.weights import Rename

    async def body(store):
        tree = store.weights
        tree.RETIRE_GRACE_S = 0
        model = await tree.mkdir(ROOT_ID, b"m", DIR)
        small = b"old" * 1000  # a small value: in LMDB, where a delete takes it at once
        old = await publish(tree, model.id, b"w.bin", small)
        await publish(tree, model.id, b"tmp", b"new" * 1000)
        await store.committer.drain()
        rename = Rename(tree, model.id, b"tmp", model.id, b"w.bin", False, False)
        rename.plan(Overlay())
        await trio.to_thread.run_sync(store.committer._write_txn, rename.txn)
        handle = tree.open_read(old, old.gen)  # the reader's open, before the rename is applied
        rename.apply()
        assert await handle.read(0, len(small)) == small
        handle.release()
        await store.committer.drain()  # the old file's version goes once unread
        assert old.versions == [] and old.id not in tree.nodes
        assert tree.stats()["versions"] == 1

    run(tmp_path / "s", body, config={"cache_bytes": 0})  # every read from the store


def test_a_version_being_collected_is_not_opened(tmp_path):
    """From the moment a collection of old versions is planned until it is applied, its
    transaction frees their chunks while the event loop serves opens: an open of such a
    version (through an inode the name moved on from) is Stale, and the kernel opens the
    name's current version instead. A collection that fails gives them back."""
    import pytest

    from distorefs.committer import Overlay
    from distorefs.errors import Stale
    from distorefs.weights import Collect

    async def body(store):
        tree = store.weights
        tree.RETIRE_GRACE_S = 0
        await store.configure_weights(b'{"keep_versions": 1}')
        model = await tree.mkdir(ROOT_ID, b"m", DIR)
        node = await publish(tree, model.id, b"w.bin", DATA)
        first, old_gen = node.current, node.gen
        reader = tree.open_read(node, old_gen)  # read through the page cache of inode old_gen
        with pytest.raises(Stale):  # so a writer gets an inode of its own
            await tree.open_write(node, old_gen, truncate=True, readable=False)
        writer = await tree.open_write(node, tree.lookup_gen(node, True), truncate=True, readable=False)
        await writer.write(0, b"2" * 100)
        await writer.flush()
        await writer.release()
        assert node.gen != old_gen and tree.version_at(node, old_gen) is first
        reader.release()  # the first version is unread: its collection is queued, not run yet
        collect = Collect(tree, node)
        collect.plan(Overlay())
        assert collect.victims == [first]
        with pytest.raises(Stale):
            tree.open_read(node, old_gen)
        collect.failed()
        tree.open_read(node, old_gen).release()  # given back: opened again
        await store.committer.drain()

    run(tmp_path / "s", body)


def test_versions_retired_at_different_times_all_go_once_their_grace_has_passed(tmp_path):
    """The grace's timer, when it fires, collects the versions whose grace has passed; one
    retired later, still in its grace then, goes when its own grace has passed too, with
    no further publish or close to ask for it."""
    import trio

    async def body(store):
        tree = store.weights
        tree.RETIRE_GRACE_S = 0.5
        await store.configure_weights(b'{"keep_versions": 1}')
        model = await tree.mkdir(ROOT_ID, b"m", DIR)
        node = await publish(tree, model.id, b"w.bin", b"1" * 100)
        await publish(tree, model.id, b"w.bin", b"2" * 100)  # version 1 retired: a timer
        await trio.sleep(0.3)
        await publish(tree, model.id, b"w.bin", b"3" * 100)  # version 2 retired, in its grace
        await trio.sleep(1.2)
        await store.committer.drain()
        assert [v.number for v in node.versions] == [3]

    run(tmp_path / "s", body)

"""The mount's entries/ nodes without FUSE: a writer refused on an inode readers share
(ESTALE) must get a writable inode on the kernel's retry, whatever the ring did to the
name between the retry's lookups. The kernel retries an ESTALE once only."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from distorefs.errors import NotFound, Stale
from distorefs.owner import Owner
from mount.handles import EntryWriter
from mount.operations import Filesystem
from store_runner import run

OWNER = Owner(0o100644, os.getuid(), os.getgid())
WRITE_TRUNC = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


@dataclass
class Ctx:
    """What a FUSE request says about its caller."""
    pid: int
    uid: int = os.getuid()
    gid: int = os.getgid()
    umask: int = 0o022


async def _entries(fs: Filesystem, name: str):
    buffers = await fs.root.lookup(b"buffers")
    return await (await buffers.lookup(name.encode())).lookup(b"entries")


async def _new_buffer_entries(store):
    """entries/ of a new buffer b, through the mount's nodes of a Filesystem on `store`."""
    fs = Filesystem(store)
    await store.create_buffer("b", OWNER)
    return await _entries(fs, "b")


async def _buffer_holding(store, key: bytes, value: bytes):
    """Buffer b holding `key` = `value`, through the mount's nodes of a Filesystem on
    `store`: (the buffer, its entries/ node)."""
    fs = Filesystem(store)
    await store.create_buffer("b", OWNER)
    buf = store.namespace("buffers", "b")
    await buf.insert(key, value, OWNER)
    return buf, await _entries(fs, "b")


async def _refused_then_gone_then_back(store, proc: Ctx, flags: int):
    """entries/hot of buffer b: `proc`'s write open refused on its shared version (ESTALE),
    the entry evicted before the retry's first lookup (ENOENT), then created anew (v2) by
    another writer before the retry's second lookup. Returns the entries/ node."""
    buf, entries = await _buffer_holding(store, b"hot", b"v1")
    shared = await entries.lookup(b"hot", proc)  # the name the kernel kept
    with pytest.raises(Stale):  # its version's readers share it: refused, retried
        await shared.open(flags, proc)
    await buf.ring.delete(b"hot")
    with pytest.raises(NotFound):
        await entries.lookup(b"hot", proc)
    await buf.insert(b"hot", b"v2", OWNER)
    return entries


def test_a_redirected_writer_whose_entry_was_evicted_and_recreated_between_lookups_gets_a_writer(tmp_path):
    """The ESTALE's retry: its revalidating LOOKUP finds the entry gone (ENOENT), the
    fresh LOOKUP that follows finds it created again by another writer. That second
    lookup must still give this writer its own inode, not the shared version (which
    would refuse the open with a second ESTALE, returned to the program)."""

    async def scenario(store):
        writer = Ctx(pid=4242)
        entries = await _refused_then_gone_then_back(store, writer, WRITE_TRUNC)
        node = await entries.lookup(b"hot", writer)
        handle = await node.open(WRITE_TRUNC, writer)
        assert isinstance(handle, EntryWriter)
        reader = await (await entries.lookup(b"hot", Ctx(pid=1))).open(os.O_RDONLY, Ctx(pid=1))
        assert reader.data == b"v2"  # other processes still read the committed version
        return True

    assert run(tmp_path / "store", scenario)


def test_a_create_committed_while_another_writer_still_writes_it_is_read_whole(tmp_path):
    """Two writers create one new name: the second's lookup finds the first's inode, and
    both write into it. When the first closes, its bytes are the entry; a reader must get
    them with their size, not the size (or pages) of the second writer still writing."""
    value = os.urandom(20000)

    async def scenario(store):
        entries = await _new_buffer_entries(store)
        first, second, reader = Ctx(pid=11), Ctx(pid=12), Ctx(pid=13)
        created, w1 = await entries.create(b"new", 0o644, WRITE_TRUNC, first)
        shared = await entries.lookup(b"new", second)  # being created: the same inode
        assert shared is created
        w2 = await shared.open(WRITE_TRUNC, second)
        await w1.write(0, value)
        await w1.flush()  # the first close: committed
        node = await entries.lookup(b"new", reader)
        assert node.attributes(reader).st_size == len(value)
        handle = await node.open(os.O_RDONLY, reader)
        assert handle.data == value
        await w2.write(0, b"later")
        await w2.flush()  # the second close: the entry's next version
        node = await entries.lookup(b"new", reader)
        assert node.attributes(reader).st_size == 5
        assert (await node.open(os.O_RDONLY, reader)).data == b"later"
        return True

    assert run(tmp_path / "store", scenario)


def test_a_redirect_left_by_an_open_that_failed_does_not_hide_the_entry_from_reads(tmp_path):
    """A write open without O_CREAT whose retry found the entry gone ends in ENOENT and
    takes its redirect with neither an open nor a create: the same process reading the
    name again (created anew meanwhile) must read it."""

    async def scenario(store):
        proc = Ctx(pid=77)
        entries = await _refused_then_gone_then_back(store, proc, os.O_WRONLY)  # no O_CREAT: ENOENT
        node = await entries.lookup(b"hot", proc)
        assert node.attributes(proc).st_size == 2
        assert (await node.open(os.O_RDONLY, proc)).data == b"v2"
        return True

    assert run(tmp_path / "store", scenario)


async def _open_for(entries, name: bytes, flags: int, ctx: Ctx):
    """An open as the kernel makes it: through the node it holds for the name, and once
    more after a fresh lookup if that open is refused with ESTALE."""
    node = await entries.lookup(name, ctx)
    try:
        return node, await node.open(flags, ctx)
    except Stale:
        node = await entries.lookup(name, ctx)
        return node, await node.open(flags, ctx)


def test_a_writer_opening_a_committed_entry_before_its_writer_released_it_gets_its_own_inode(tmp_path):
    """Between a writer's close (its commit) and its release, its inode is the name's
    version and readers share it. A second writer opening the name then must not write
    (and truncate) into it: readers would get its size, 0 after O_TRUNC, and read nothing."""
    value = os.urandom(20000)

    async def scenario(store):
        entries = await _new_buffer_entries(store)
        first, second, reader = Ctx(pid=21), Ctx(pid=22), Ctx(pid=23)
        created, w1 = await entries.create(b"new", 0o644, WRITE_TRUNC, first)
        await w1.write(0, value)
        await w1.flush()  # committed; its RELEASE has not come yet
        writing, w2 = await _open_for(entries, b"new", WRITE_TRUNC, second)
        assert isinstance(w2, EntryWriter)
        node = await entries.lookup(b"new", reader)
        assert node is not writing
        assert node.attributes(reader).st_size == len(value)
        assert (await node.open(os.O_RDONLY, reader)).data == value
        return True

    assert run(tmp_path / "store", scenario)


def test_an_inode_two_writers_wrote_never_becomes_a_version_readers_share(tmp_path):
    """Writers that created a name together wrote into one inode: its pages in the kernel
    hold both writers' writes, interleaved, whatever each committed. Even after the others
    released it, the last commit's version gets an inode of its own (clean pages)."""

    async def scenario(store):
        entries = await _new_buffer_entries(store)
        first, second, reader = Ctx(pid=31), Ctx(pid=32), Ctx(pid=33)
        shared, w1 = await entries.create(b"new", 0o644, WRITE_TRUNC, first)
        assert await entries.lookup(b"new", second) is shared
        w2 = await shared.open(WRITE_TRUNC, second)
        await w1.write(0, b"A" * 30000)
        await w1.flush()
        shared.writer_closed(w1)  # the first writer's release
        await w2.write(0, b"B" * 20000)
        await w2.flush()
        shared.writer_closed(w2)
        node = await entries.lookup(b"new", reader)
        assert node is not shared
        assert (await node.open(os.O_RDONLY, reader)).data == b"B" * 20000
        return True

    assert run(tmp_path / "store", scenario)


def test_a_writer_reaching_a_former_writers_inode_readers_still_read_gets_its_own(tmp_path):
    """The inode two writers created a name in leaves the name when they commit, but the
    kernel may still hold the name for it (its invalidation is asynchronous), and readers
    that found it read the version it was left with. A third writer reaching it through
    that name must not write (and truncate) into it: refused (ESTALE), its retry gets an
    inode of its own, and the readers' inode keeps its size."""

    async def scenario(store):
        entries = await _new_buffer_entries(store)
        first, second, third, reader = Ctx(pid=41), Ctx(pid=42), Ctx(pid=43), Ctx(pid=44)
        shared, w1 = await entries.create(b"new", 0o644, WRITE_TRUNC, first)
        w2 = await (await entries.lookup(b"new", second)).open(WRITE_TRUNC, second)
        for w, data in ((w1, b"A" * 30000), (w2, b"B" * 20000)):
            await w.write(0, data)
            await w.flush()
            shared.writer_closed(w)
        assert (await shared.open(os.O_RDONLY, reader)).data == b"B" * 20000
        with pytest.raises(Stale):
            await shared.open(WRITE_TRUNC, third)  # through the name the kernel still holds
        node = await entries.lookup(b"new", third)  # the retry
        assert node is not shared
        assert isinstance(await node.open(WRITE_TRUNC, third), EntryWriter)
        assert shared.attributes(reader).st_size == 20000
        return True

    assert run(tmp_path / "store", scenario)


def test_a_redirected_writer_whose_retry_finds_the_name_being_created_never_joins_its_version(tmp_path):
    """A writer refused on a shared version (ESTALE); the entry is evicted and another
    writer creates it anew before the retry's lookup. Should that lookup give the create's
    inode, the create may commit before the retry's open, and the open would then truncate
    the version readers share. The retry must create (or rewrite) through an inode of its own."""
    value = os.urandom(20000)

    async def scenario(store):
        buf, entries = await _buffer_holding(store, b"hot", b"v1")
        retrying, creator, reader = Ctx(pid=51), Ctx(pid=52), Ctx(pid=53)
        with pytest.raises(Stale):
            await (await entries.lookup(b"hot", retrying)).open(WRITE_TRUNC, retrying)
        await buf.ring.delete(b"hot")
        created, w = await entries.create(b"hot", 0o644, WRITE_TRUNC, creator)
        try:  # the retry: its lookup, then its open of what it found, or its create
            node = await entries.lookup(b"hot", retrying)
        except NotFound:
            node = None
        await w.write(0, value)
        await w.flush()  # the create commits before the retry's open
        if node is not None:
            handle = await node.open(WRITE_TRUNC, retrying)
        else:
            node, handle = await entries.create(b"hot", 0o644, WRITE_TRUNC, retrying)
        assert isinstance(handle, EntryWriter)
        assert node is not created
        assert created.attributes(reader).st_size == len(value)
        return True

    assert run(tmp_path / "store", scenario)


def test_an_open_of_a_version_rewritten_since_its_lookup_asks_for_the_name_again(tmp_path):
    """A process rewrote an entry (through its own inode: at/I, or entries/KEY) and reads it
    back at once, through the name the kernel still holds for the old version (the
    invalidation of that name is asynchronous). The old version's value is gone (a rewrite
    stores the new one in its place), so its open is Stale, and the kernel's retry looks the
    name up again and reads the new version (through an inode of its own, whose open is
    never Stale again), rather than ENOENT for an entry that exists."""

    async def scenario(store):
        _, entries = await _buffer_holding(store, b"k", b"v1")
        proc = Ctx(pid=61)
        old = await entries.lookup(b"k", proc)  # the name the kernel keeps
        writing, w = await _open_for(entries, b"k", WRITE_TRUNC, proc)
        assert writing is not old
        await w.write(0, b"v2")
        await w.flush()
        with pytest.raises(Stale):
            await old.open(os.O_RDONLY, proc)
        node = await entries.lookup(b"k", proc)  # the retry
        assert (await node.open(os.O_RDONLY, proc)).data == b"v2"
        return True

    assert run(tmp_path / "store", scenario, config={"cache_bytes": 0})

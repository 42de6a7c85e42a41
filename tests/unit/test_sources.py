"""Opening and reading stage sources from the kernel's caches only (distorefs/sources.py):
what is cached is opened and read without waiting, what is not says so (NotCached) and
is left to the parallel path, and the rules that refuse a source hold on both paths."""

from __future__ import annotations

import os
import time

import pytest

from distorefs.sources import (CachedFirst, NotCached, SourceRefused, open_root, open_source, read_ahead,
                               read_bounded, read_cached, relative_to_root)


def _drop_pages(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages only can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    (root / "d" / "a.bin").write_bytes(os.urandom(10_000))
    (root / "empty").write_bytes(b"")
    os.symlink("/etc/passwd", root / "out")
    return root


def _open(root, rel, cached, follow=False):
    fd = open_root(str(root))
    try:
        return open_source(fd, str(root), str(root / rel), follow, cached)
    finally:
        os.close(fd)


def test_a_cached_source_is_opened_and_read_whole(tree):
    data = (tree / "d" / "a.bin").read_bytes()
    src = _open(tree, "d/a.bin", cached=True)
    try:
        assert src.size == len(data)
        assert read_cached(src) == data
    finally:
        src.close()


def test_what_would_wait_for_the_disk_is_not_read_from_the_cache_until_read_ahead(tree):
    """An uncached source is NotCached for a read that must not wait; what `read_ahead`
    asks for is then read by the kernel on its own, and that read finds it (a stage reads
    a batch's uncached files this way)."""
    path = tree / "d" / "a.bin"
    data = path.read_bytes()
    _drop_pages(path)
    src = _open(tree, "d/a.bin", cached=True)
    try:
        with pytest.raises(NotCached):
            read_cached(src)
        read_ahead(src)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert read_cached(src) == data
                break
            except NotCached:
                assert time.monotonic() < deadline, "the pages asked for never came"
                time.sleep(0.01)
        assert b"".join(read_bounded(src, str(path))) == data
    finally:
        src.close()


def test_a_source_that_changed_is_left_to_the_checked_read(tree):
    path = tree / "d" / "a.bin"
    src = _open(tree, "d/a.bin", cached=True)
    try:
        with open(path, "ab") as f:
            f.write(b"more")
        with pytest.raises(NotCached):
            read_cached(src)
        with pytest.raises(SourceRefused, match="grew"):
            b"".join(read_bounded(src, str(path)))
    finally:
        src.close()


def _refused_by_the_lanes(tree, rel, why):
    """What the daemon does: the cached lane first, the other path if that defers. The
    cached lane never opens what the rules refuse; it refuses it itself, or defers
    (RESOLVE_CACHED may answer EAGAIN whenever the walk cannot finish in RCU mode, as when
    a rename elsewhere in the system moves the global rename sequence: CI saw it, and 1 run
    in 30 here), and then the other path refuses it."""
    try:
        _open(tree, rel, cached=True)
    except SourceRefused as exc:
        assert why in str(exc)
        return
    except NotCached:
        pass
    else:
        raise AssertionError(f"{rel} was opened on the cached path")
    with pytest.raises(SourceRefused, match=why):
        _open(tree, rel, cached=False)


def test_the_rules_hold_on_the_cached_path(tree):
    _refused_by_the_lanes(tree, "out", "outside the source tree")
    _refused_by_the_lanes(tree, "d", "not a regular file")
    for cached in (True, False):  # not in the lookup cache either way: the parallel path says so
        with pytest.raises(NotCached if cached else SourceRefused):
            _open(tree, "d/missing", cached=cached)
    with pytest.raises(NotCached):  # links followed anywhere: opened by the parallel path only
        _open(tree, "out", cached=True, follow=True)


def test_a_cold_tree_is_not_tried_in_the_caches_for_a_while():
    first = CachedFirst()
    assert first.worth_trying()
    first.tried(cached=10, total=16)  # mostly cached: go on trying
    assert first.worth_trying()
    first.tried(cached=3, total=16)  # mostly not: the next batches go straight to the threads
    assert [first.worth_trying() for _ in range(CachedFirst.RETRY_EVERY)] == [False] * CachedFirst.RETRY_EVERY
    assert first.worth_trying()  # then it looks again


def test_an_empty_source_is_read_from_the_cache_and_one_that_grew_is_not(tree):
    src = _open(tree, "empty", cached=True)
    try:
        assert read_cached(src) == b""
        (tree / "empty").write_bytes(b"x")
        with pytest.raises(NotCached):
            read_cached(src)
    finally:
        src.close()


@pytest.mark.parametrize("root", ["/data/tree", "/data/tree/", "/"])
@pytest.mark.parametrize("src", [
    "/data/tree/a", "/data/tree/d/e/f.bin", "/data/tree", "/data/tree/", "/data/tree/./a", "/data/tree/../x",
    "/data/tree/d/../../x", "/data/tree//a", "/data/treex/a", "/data/tree/a/", "/data/tree/..", "/data/tree/.",
    "/data/tree/d/.", "/data/tree/d/..", "/data/tree/.hidden", "/data/tree/..a", "/data/tree/a..", "/elsewhere/a",
    "/data/tree/d/.../e",
])
def test_the_quick_way_below_the_root_agrees_with_relpath(root, src):
    """relative_to_root takes a path that plainly lies below the root without os.path.relpath
    (which cost more than the open it prepares); whatever it takes must be what relpath says,
    and what is not below the root is refused either way."""
    def slow():
        rel = os.path.relpath(os.path.normpath(src), os.path.normpath(root))
        if rel in (os.curdir, os.pardir) or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
            return None
        return rel
    try:
        quick = relative_to_root(src, root)
    except SourceRefused:
        quick = None
    assert quick == slow()

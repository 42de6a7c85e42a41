"""Running out of disk (issue 15): a buffer that may evict does so only when its entries'
space would take the new one, not when another namespace holds the disk; an NVMe
directory that does not exist is refused, naming it, instead of being made on the root
disk."""

from __future__ import annotations

import errno
import subprocess

import pytest

from distorefs_it import CLI, Mount, entry_names, get_stats, is_mounted, make_payload, read_entry, write_entry, small_tmpfs


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB tmpfs (root only), unmounted afterwards."""
    with small_tmpfs(tmp_path / "disk", 48) as disk:
        yield disk


def test_no_eviction_when_another_namespace_holds_the_disk(small_disk):
    m = Mount(small_disk)
    try:
        m.mount("sync_interval=0.2", "segment_bytes=1048576")
        small = m.buffer("small", {"compression": "none"})  # evict_when_full: true (the default)
        kept = {f"s{i}": make_payload(f"s{i}", 20_000, seed=i) for i in range(6)}
        for key, data in kept.items():
            write_entry(small, key, data)  # small values: LMDB
        hog = m.buffer("hog", {"compression": "none", "evict_when_full": False})
        for i in range(200):  # 1.5 MiB values, one segment file each, until the disk is full
            try:
                write_entry(hog, f"h{i:03d}", make_payload(f"h{i}", 3 << 19, seed=i))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
        else:
            raise AssertionError("the disk never filled")
        with pytest.raises(OSError) as info:  # room held by `hog`: evicting `small` cannot help
            write_entry(small, "big", make_payload("big", 3 << 19))
        assert info.value.errno == errno.ENOSPC
        assert sorted(entry_names(small)) == sorted(kept), "entries evicted for nothing"
        assert get_stats(small).get("evictions_for_space", 0) == 0
        for key, data in kept.items():
            assert read_entry(small, key) == data
        assert "would not make room" in m.log()
        m.umount()
    finally:
        m.cleanup()


def test_a_missing_nvme_dir_is_refused_naming_it(tmp_path):
    m = Mount(tmp_path / "m")
    typo = tmp_path / "nvme-typo" / "seg"
    res = subprocess.run(CLI + ["mount", "--nvme-dir", f"{typo}:1G", str(m.store), str(m.mnt)], capture_output=True,
                         text=True, timeout=90)
    try:
        assert res.returncode != 0, res
        assert str(typo) in res.stderr and "does not exist" in res.stderr, res.stderr
        assert not typo.exists() and not typo.parent.exists()
        assert not is_mounted(m.mnt)
    finally:
        if is_mounted(m.mnt):
            m.cleanup()

"""The tree, buffer directories, config.json and stats.json through a real mount."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess

from distorefs_it import (CLI, assert_errno, get_config, get_stats, is_mounted, read_entry, set_config,
                      write_entry)


def test_tree_and_version(fs):
    root = sorted(os.listdir(fs.mnt))
    assert ".distorefs" in root and "buffers" in root
    assert sorted(os.listdir(fs.mnt / ".distorefs")) == ["config.json", "gc", "metrics", "stats.json", "version",
                                                          "wait"]
    version = (fs.mnt / ".distorefs" / "version").read_text()
    assert re.fullmatch(r"distorefs \d+\.\d+\.\d+\S*\n", version), version
    stats = json.loads((fs.mnt / ".distorefs" / "stats.json").read_bytes())
    assert stats["version"] in version
    assert "buffers" in stats and "tiers" in stats
    config = json.loads((fs.mnt / ".distorefs" / "config.json").read_bytes())
    assert config["segment_threshold"] == 512 << 10
    assert "default_buffer" in config
    # the control files are regular files; the store path is the filesystem's source
    assert (fs.mnt / ".distorefs" / "stats.json").is_file()
    with open("/proc/mounts") as f:
        line = next(l for l in f if l.split()[1] == str(fs.mnt.resolve()))
    assert line.split()[0] == str(fs.store.resolve())
    assert line.split()[2] == "fuse.distorefs"


def test_lock_file_names_the_daemon(fs):
    assert fs.lock_pid() == fs.pid
    assert os.path.exists(f"/proc/{fs.pid}")


def test_second_mount_of_same_store_fails(fs, tmp_path):
    other = tmp_path / "mnt2"
    other.mkdir()
    res = subprocess.run(CLI + ["mount", "--timeout", "30", str(fs.store), str(other)],
                         capture_output=True, text=True, timeout=60)
    try:
        assert res.returncode != 0, res.stdout
        assert "already in use" in (res.stdout + res.stderr)
        assert not is_mounted(other)
    finally:
        if is_mounted(other):
            subprocess.run(["fusermount3", "-uz", str(other)])
        m = re.search(r"daemon pid (\d+)", res.stdout)
        if m and int(m.group(1)) != fs.pid:
            try:
                os.kill(int(m.group(1)), signal.SIGKILL)
            except ProcessLookupError:
                pass
    # the first mount is unaffected
    assert fs.alive()
    assert fs.lock_pid() == fs.pid


def test_mkdir_rmdir_buffer(fs):
    buffers = fs.mnt / "buffers"
    path = buffers / "mkdir-rmdir"
    path.mkdir()
    assert path.is_dir()
    assert "mkdir-rmdir" in os.listdir(buffers)
    assert sorted(os.listdir(path)) == sorted(["config.json", "stats.json", "priorities", "entries",
                                               "sample", "batch", "client"])
    assert_errno(errno.EEXIST, os.mkdir, path)
    write_entry(path, "one", b"1")
    assert_errno(errno.ENOTEMPTY, os.rmdir, path)
    assert path.is_dir() and read_entry(path, "one") == b"1"
    os.unlink(path / "entries" / "one")
    os.rmdir(path)
    assert not path.exists()
    assert "mkdir-rmdir" not in os.listdir(buffers)
    assert_errno(errno.ENOENT, os.rmdir, path)
    # the name can be used again, starting empty
    path.mkdir()
    assert os.listdir(path / "entries") == []
    os.rmdir(path)


def test_config_read_write_merge(buf):
    config = get_config(buf)
    for key in ("capacity", "max_bytes", "max_entry_bytes", "compression", "compression_level", "sampler",
                "alpha", "beta", "initial_priority", "max_times_sampled", "min_size_to_sample",
                "presample_batches", "seed"):
        assert key in config, key
    assert config["sampler"] == "uniform"
    set_config(buf, {"capacity": 100, "sampler": "prioritized"})
    after = get_config(buf)
    assert after["capacity"] == 100 and after["sampler"] == "prioritized"
    # keys not written are kept (merge, not replace)
    assert {k: v for k, v in after.items() if k not in ("capacity", "sampler")} == \
           {k: v for k, v in config.items() if k not in ("capacity", "sampler")}
    set_config(buf, {"alpha": 0.9})
    again = get_config(buf)
    assert again["alpha"] == 0.9 and again["capacity"] == 100 and again["sampler"] == "prioritized"
    assert get_stats(buf)["sampler"] == "prioritized"
    # a shell redirect works too
    subprocess.run(f"echo '{{\"beta\": 0.5}}' > '{buf}/config.json'", shell=True, check=True)
    assert get_config(buf)["beta"] == 0.5


def test_config_invalid_keeps_old(buf):
    set_config(buf, {"capacity": 77, "sampler": "fifo"})
    before = get_config(buf)
    bad = [
        b"this is not json",
        b"[1, 2, 3]",
        b'{"capacity": -5}',
        b'{"capacity": "many"}',
        b'{"sampler": "bogus"}',
        b'{"no_such_key": 1}',
        b'{"beta": 2.0}',
        b'{"compression": "lz4"}',
        b'{"capacity": 10, "alpha": -1}',  # one bad key: nothing of the write applies
    ]
    for text in bad:
        f = open(buf / "config.json", "wb", buffering=0)
        if text.rstrip().endswith(b"}"):  # a whole JSON object is judged by this write() already
            assert_errno(errno.EINVAL, f.write, text)
        else:
            f.write(text)
        err = assert_errno(errno.EINVAL, f.close)  # and close() says it again
        assert err is not None
        assert get_config(buf) == before, text
    # and a good write still works afterwards
    set_config(buf, {"capacity": 78})
    assert get_config(buf)["capacity"] == 78


def test_stats_json_counts(buf):
    stats = get_stats(buf)
    assert stats["entries"] == 0
    for i in range(5):
        write_entry(buf, f"k{i}", b"x" * (100 + i))
    write_entry(buf, "k0", b"y" * 50)  # rewrite
    os.unlink(buf / "entries" / "k4")
    stats = get_stats(buf)
    assert stats["entries"] == 4
    assert stats["inserts"] == 5
    assert stats["rewrites"] == 1
    assert stats["deletes"] == 1
    assert stats["bytes"] == 50 + 101 + 102 + 103
    assert stats["name"] == buf.name
    store_stats = json.loads((buf.parent.parent / ".distorefs" / "stats.json").read_bytes())
    assert store_stats["buffers"][buf.name]["entries"] == 4
    assert store_stats["ops"]["entries"] >= 4


def test_stats_json_is_read_only(fs, buf):
    for path in (buf / "stats.json", fs.mnt / ".distorefs" / "stats.json", fs.mnt / ".distorefs" / "version",
                 fs.mnt / ".distorefs" / "config.json"):
        assert_errno((errno.EACCES, errno.EROFS), open, path, "wb")
        assert_errno((errno.EACCES, errno.EROFS), os.open, path, os.O_WRONLY)
    json.loads((buf / "stats.json").read_bytes())
    assert fs.alive()

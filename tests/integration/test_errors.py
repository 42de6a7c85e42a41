"""Bad requests get a clear errno, lose nothing, and never take the daemon down."""

from __future__ import annotations

import errno
import os

from distorefs_it import (assert_errno, entry_names, get_config, get_stats, make_payload, read_entry,
                          set_config, verify_payload, write_entry, xattr)


def write_past_limit(f, data: bytes) -> None:
    """A write crossing the size limit fails with EFBIG, or (POSIX) writes what fits and
    returns short; either way the handle is refused at close."""
    try:
        n = f.write(data)
    except OSError as exc:
        assert exc.errno == errno.EFBIG
    else:
        assert n < len(data)
        assert_errno(errno.EFBIG, f.write, data[n:])


def test_errors_leave_daemon_and_data_intact(fs, buf):
    # data that must survive everything below
    keep = {f"keep{i}": make_payload(f"keep{i}", 2000 + 100 * i) for i in range(5)}
    for k, v in keep.items():
        write_entry(buf, k, v)
    set_config(buf, {"max_entry_bytes": 4096, "capacity": 1000})
    config = get_config(buf)
    entry = buf / "entries" / "keep0"

    # EFBIG: a write past max_entry_bytes fails, close() reports it again, and nothing
    # of that handle is published (not even the part written before the limit)
    f = open(buf / "entries" / "toobig", "wb", buffering=0)
    f.write(b"b" * 4000)
    write_past_limit(f, b"a" * 5000)
    assert_errno(errno.EFBIG, f.close)
    assert "toobig" not in entry_names(buf)
    # a rewrite over the limit keeps the old value
    f = open(entry, "r+b", buffering=0)
    f.write(b"y" * 100)
    write_past_limit(f, b"x" * 5000)
    assert_errno(errno.EFBIG, f.close)
    assert read_entry(buf, "keep0") == keep["keep0"]
    f = open(entry, "r+b", buffering=0)
    f.seek(8192)
    assert_errno(errno.EFBIG, f.write, b"x")
    assert_errno(errno.EFBIG, f.close)
    assert read_entry(buf, "keep0") == keep["keep0"]
    # truncate over the limit
    assert_errno(errno.EFBIG, os.truncate, buf / "entries" / "keep1", 10_000)
    assert read_entry(buf, "keep1") == keep["keep1"]

    # EINVAL: invalid config keeps the old one
    for text in (b'{"capacity": 0}', b"{bad json", b'{"sampler": 3}', b'{"max_entry_bytes": 0}'):
        f = open(buf / "config.json", "wb", buffering=0)
        if text.endswith(b"}"):  # a whole JSON object is judged by this write() already
            assert_errno(errno.EINVAL, f.write, text)
        else:
            f.write(text)
        assert_errno(errno.EINVAL, f.close)
    assert get_config(buf) == config

    # EINVAL: priorities lines (malformed, NaN, negative, inf); nothing of such a write applies
    os.setxattr(entry, "user.distorefs.priority", b"2.5")
    for text in (b"keep0\n", b"keep0 abc\n", b"keep0 nan\n", b"keep0 -1\n", b"keep0 inf\n",
                 b"keep1 3\nkeep0 -0.5\n"):
        fd = os.open(buf / "priorities", os.O_WRONLY)
        try:
            assert_errno(errno.EINVAL, os.write, fd, text)
        finally:
            os.close(fd)
        assert xattr(entry, "priority") == "2.5", text
    assert float(xattr(buf / "entries" / "keep1", "priority")) != 3.0

    # xattrs: priority must be a number >= 0, times_sampled a whole number, the others are
    # read-only, other names unsupported
    for bad in (b"abc", b"-3", b"nan", b""):
        assert_errno(errno.EINVAL, os.setxattr, entry, "user.distorefs.priority", bad)
    assert xattr(entry, "priority") == "2.5"
    for name in ("seq", "tier", "size", "stored_size", "compression", "checksum"):
        before = xattr(entry, name)
        assert_errno(errno.EACCES, os.setxattr, entry, f"user.distorefs.{name}", b"1")
        assert xattr(entry, name) == before
    # times_sampled is writable for restores (distorefs import): a whole number
    for bad in (b"abc", b"-1", b"1.5", b""):
        assert_errno(errno.EINVAL, os.setxattr, entry, "user.distorefs.times_sampled", bad)
    assert_errno((errno.ENOTSUP, errno.EOPNOTSUPP), os.setxattr, entry, "user.other", b"1")
    assert_errno((errno.ENOTSUP, errno.EOPNOTSUPP), os.setxattr, entry, "user.distorefsx", b"1")
    assert_errno(errno.ENODATA, os.getxattr, entry, "user.distorefs.nonexistent")
    assert_errno(errno.ENODATA, os.getxattr, entry, "user.other")
    assert set(os.listxattr(entry)) >= {f"user.distorefs.{n}" for n in (
        "seq", "tier", "size", "stored_size", "compression", "checksum", "priority", "times_sampled")}

    # EACCES: read-only control files
    assert_errno((errno.EACCES, errno.EROFS), open, buf / "stats.json", "wb")
    assert_errno((errno.EACCES, errno.EROFS), open, fs.mnt / ".distorefs" / "stats.json", "ab")
    assert_errno((errno.EACCES, errno.EROFS, errno.EPERM), open, buf / "sample" / "2", "wb")
    # no files outside entries/
    assert_errno((errno.EACCES, errno.EROFS, errno.EPERM), open, buf / "newfile", "wb")
    assert_errno((errno.EACCES, errno.EROFS, errno.EPERM), open, fs.mnt / "newfile", "wb")
    assert_errno((errno.EACCES, errno.EROFS, errno.EPERM), os.mkdir, buf / "entries" / "subdir")

    # long names
    long = "L" * 256
    assert_errno((errno.ENAMETOOLONG, errno.EINVAL), write_entry, buf, long, b"x")
    assert_errno((errno.ENAMETOOLONG, errno.EINVAL), os.rename, entry, buf / "entries" / long)
    assert_errno((errno.ENAMETOOLONG, errno.EINVAL), os.mkdir, fs.mnt / "buffers" / long)

    # missing things
    assert_errno(errno.ENOENT, read_entry, buf, "nope")
    assert_errno(errno.ENOENT, os.listdir, fs.mnt / "buffers" / "no-such-buffer")
    assert_errno(errno.ENOENT, os.unlink, buf / "entries" / "nope")

    # the daemon is alive and everything committed is intact
    assert fs.alive()
    assert get_stats(buf)["entries"] == len(entry_names(buf))
    for k, v in keep.items():
        assert read_entry(buf, k) == v
        assert verify_payload(read_entry(buf, k), k)
    assert get_config(buf) == config
    write_entry(buf, "after", b"still works")
    assert read_entry(buf, "after") == b"still works"

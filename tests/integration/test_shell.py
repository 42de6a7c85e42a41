"""Ordinary shell tools on the mount: ls, cat, cp, cmp, getfattr, df; and large values."""

from __future__ import annotations

import os
import subprocess

from distorefs_it import entry_names, get_stats, make_payload, read_entry, set_config, write_entry, xattr


def sh(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=True, timeout=60, **kw)


def test_ls_cat_cp_cmp(buf, tmp_path):
    write_entry(buf, "hello.txt", b"hello world\n")
    write_entry(buf, "bin", bytes(range(256)) * 40)
    out = sh("ls", "-l", str(buf / "entries")).stdout.splitlines()
    rows = {line.split()[-1]: line.split() for line in out if not line.startswith("total")}
    assert set(rows) == {"hello.txt", "bin"}
    assert rows["hello.txt"][0].startswith("-rw-")
    assert rows["hello.txt"][4] == "12"
    assert rows["bin"][4] == str(256 * 40)
    listing = sh("ls", str(buf)).stdout.split()
    assert sorted(listing) == sorted(["batch", "client", "config.json", "entries", "priorities", "sample",
                                    "stats.json"])
    assert sh("cat", str(buf / "entries" / "hello.txt")).stdout == "hello world\n"
    assert sh("cat", str(buf / "config.json")).stdout.lstrip().startswith("{")

    # cp a file in, cmp it
    src = tmp_path / "src.bin"
    src.write_bytes(make_payload("src.bin", 300_000))
    sh("cp", str(src), str(buf / "entries" / "copied.bin"))
    sh("cmp", str(src), str(buf / "entries" / "copied.bin"))
    assert entry_names(buf)[-1] == "copied.bin"
    # and out again
    sh("cp", str(buf / "entries" / "copied.bin"), str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    # cp over an existing entry rewrites it in place
    seq = xattr(buf / "entries" / "hello.txt", "seq")
    sh("cp", str(src), str(buf / "entries" / "hello.txt"))
    sh("cmp", str(src), str(buf / "entries" / "hello.txt"))
    assert xattr(buf / "entries" / "hello.txt", "seq") == seq
    # shell redirections
    subprocess.run(f"printf 'abc' > '{buf}/entries/redir' && printf 'def' >> '{buf}/entries/redir'",
                   shell=True, check=True)
    assert read_entry(buf, "redir") == b"abcdef"
    # dd in small blocks commits one whole entry
    subprocess.run(["dd", f"if={src}", f"of={buf}/entries/dd.bin", "bs=4096", "status=none"], check=True)
    sh("cmp", str(src), str(buf / "entries" / "dd.bin"))
    # rm and ls agree
    sh("rm", str(buf / "entries" / "redir"))
    assert "redir" not in sh("ls", str(buf / "entries")).stdout.split()
    # head reads a prefix
    assert subprocess.run(["head", "-c", "5", str(buf / "entries" / "bin")], capture_output=True,
                          check=True).stdout == bytes(range(5))


def test_getfattr(buf):
    write_entry(buf, "x", b"payload" * 100)
    os.setxattr(buf / "entries" / "x", "user.distorefs.priority", b"3.5")
    out = sh("getfattr", "-d", "-m", "user.distorefs", str(buf / "entries" / "x")).stdout
    attrs = {}
    for line in out.splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            attrs[k] = v.strip('"')
    assert attrs["user.distorefs.seq"] == xattr(buf / "entries" / "x", "seq")
    assert attrs["user.distorefs.tier"] == "lmdb"
    assert attrs["user.distorefs.size"] == "700"
    assert attrs["user.distorefs.priority"] == "3.5"
    assert attrs["user.distorefs.times_sampled"] == "0"
    # in the hot tier as written (compressed when demoted, README "Data larger than memory")
    assert (attrs["user.distorefs.compression"], attrs["user.distorefs.stored_size"]) == ("none", "700")
    assert attrs["user.distorefs.checksum"].startswith("crc32:")
    import zlib
    assert attrs["user.distorefs.checksum"] == "crc32:%08x" % zlib.crc32(b"payload" * 100)
    # setfattr works for the priority
    sh("setfattr", "-n", "user.distorefs.priority", "-v", "9", str(buf / "entries" / "x"))
    assert sh("getfattr", "--only-values", "-n", "user.distorefs.priority",
              str(buf / "entries" / "x")).stdout == "9"
    bad = subprocess.run(["setfattr", "-n", "user.distorefs.seq", "-v", "1", str(buf / "entries" / "x")],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "ermission denied" in bad.stderr


def df_used_bytes(mnt) -> tuple[int, int]:
    out = sh("df", "-B1", "--output=size,used,avail,target", str(mnt)).stdout.splitlines()
    size, used, avail, target = out[-1].split()
    assert target == str(mnt)
    return int(size), int(used)


def test_large_value_nvme_tier_and_df(fs, buf):
    set_config(buf, {"compression": "none"})
    size0, used0 = df_used_bytes(fs.mnt)
    assert size0 > 0
    big = os.urandom(3 << 20)
    write_entry(buf, "big", big)
    write_entry(buf, "small", b"s" * 1000)
    assert xattr(buf / "entries" / "big", "tier") == "nvme"
    assert xattr(buf / "entries" / "small", "tier") == "lmdb"
    assert int(xattr(buf / "entries" / "big", "stored_size")) == 3 << 20
    assert xattr(buf / "entries" / "big", "compression") == "none"
    assert read_entry(buf, "big") == big
    with open(buf / "entries" / "big", "rb") as f:  # random access
        f.seek(1 << 20)
        assert f.read(4096) == big[1 << 20:(1 << 20) + 4096]
    stats = get_stats(buf)
    assert stats["tiers"]["nvme"]["entries"] == 1
    assert stats["tiers"]["nvme"]["stored_bytes"] == 3 << 20
    assert stats["tiers"]["lmdb"]["entries"] == 1
    # df shows the real usage: it grew by at least the 3 MB just written
    _, used1 = df_used_bytes(fs.mnt)
    assert used1 - used0 >= 3 << 20, (used0, used1)
    segs = list((fs.store / "segments").glob("seg-*.dat"))
    assert sum(p.stat().st_size for p in segs) >= 3 << 20
    # just under the threshold stays in lmdb, at it goes to nvme
    write_entry(buf, "under", os.urandom((512 << 10) - 1))
    write_entry(buf, "at", os.urandom(512 << 10))
    assert xattr(buf / "entries" / "under", "tier") == "lmdb"
    assert xattr(buf / "entries" / "at", "tier") == "nvme"
    # a compressible large value is stored compressed and placed by its stored size
    set_config(buf, {"compression": "zstd"})
    write_entry(buf, "zeros", bytes(3 << 20))
    assert xattr(buf / "entries" / "zeros", "compression") == "zstd"
    assert int(xattr(buf / "entries" / "zeros", "stored_size")) < 512 << 10
    assert xattr(buf / "entries" / "zeros", "tier") == "lmdb"
    assert read_entry(buf, "zeros") == bytes(3 << 20)
    # du sees the sizes too
    du = sh("du", "-s", "-B1", "--apparent-size", str(buf / "entries")).stdout.split()[0]
    assert int(du) >= (3 << 20) * 2 + (1 << 20)

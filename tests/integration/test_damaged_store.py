"""Damaged stores (issue 15): verify names damaged LMDB pages and exits 4 without a
traceback, its --repair changes nothing on such a store (which stays mountable), and a
truncated data.mdb is refused with a message instead of a SIGBUS of verify or the daemon."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from distorefs_it import CLI, entry_names, make_payload, write_entry


def verify(store, *extra):
    return subprocess.run(CLI + ["verify", "--json", *extra, str(store)], capture_output=True, text=True,
                          timeout=300)


def _filled(fresh_mount, n=400):
    m = fresh_mount()
    b = m.buffer("b", {"compression": "none"})
    for i in range(n):
        write_entry(b, f"e{i:04d}", make_payload(f"e{i:04d}", 3000, seed=i))
    m.umount()
    return m, b


def test_verify_names_damaged_lmdb_pages_and_repair_leaves_the_store_as_it_was(fresh_mount):
    m, b = _filled(fresh_mount)
    data = m.store / "meta" / "data.mdb"
    psize = 4096
    pages = data.stat().st_size // psize
    rng = random.Random(7)
    with open(data, "r+b") as f:  # garbage over a few pages of the B-trees (not the meta pages)
        for page in rng.sample(range(pages // 3, pages - 2), 4):
            f.seek(page * psize)
            f.write(rng.randbytes(psize))
    lock_before = (m.store / "lock").read_bytes()
    res = verify(m.store)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 4, (res.returncode, res.stderr[-2000:])
    report = json.loads(res.stdout)
    assert report["damaged"] and any("damaged" in f["message"] for f in report["findings"]), report["findings"][:3]
    res = verify(m.store, "--repair")
    assert "Traceback" not in res.stderr and res.returncode == 4, (res.returncode, res.stderr[-2000:])
    assert (m.store / "lock").read_bytes() == lock_before  # the clean mark as it was: no recovery forced
    m.mount()  # still mountable: what is readable is served
    names = entry_names(b)
    assert names, "nothing readable"
    assert m.alive()
    m.umount()


@pytest.mark.parametrize("keep", [0.5, 0.05])
def test_a_truncated_data_mdb_is_refused_with_a_reason(fresh_mount, keep):
    m, b = _filled(fresh_mount)
    data = m.store / "meta" / "data.mdb"
    os.truncate(data, int(data.stat().st_size * keep) // 4096 * 4096)
    res = verify(m.store)
    assert res.returncode == 8, (res.returncode, res.stderr)  # not -7 (SIGBUS): it could not run, and says why
    assert "truncated" in res.stderr or "damaged" in res.stderr, res.stderr
    res = subprocess.run(CLI + ["mount", str(m.store), str(m.mnt)], capture_output=True, text=True, timeout=90)
    assert res.returncode != 0 and ("truncated" in res.stderr or "damaged" in res.stderr), res
    assert "truncated" in m.log() or "damaged" in m.log()

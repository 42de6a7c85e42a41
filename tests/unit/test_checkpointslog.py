"""Another node's checkpoint step applied to a tree (distorefs/checkpointslog.py ApplyStep),
without FUSE or a cluster: complete and `latest` at once, a replay changes nothing, a local
step of the same name is left alone, read-only after a restart too, and removing it here
frees no cluster value (this store has no cluster tier: freeing one would fail)."""

import pytest

from distorefs.checkpoints import ROOT_ID
from distorefs.checkpointslog import ApplyStep, _fill, manifest_of
from distorefs.errors import ReadOnly
from distorefs.fileattrs import AttrChange
from distorefs.placement import TIER_CLUSTER
from distorefs.values import StoredValue
from test_checkpoints_core import FILE, new_step, payload, save
from store_runner import run


def test_an_applied_step_is_complete_read_only_and_removed_here_only(tmp_path):
    async def apply(store):
        ck, r, mine = await new_step(store, step=b"mine")
        await save(ck, mine.id, b"a.bin", payload(100_000, 1))
        await ck.sync_dir(mine)
        assert mine.complete
        manifest, values = manifest_of(ck, mine)
        _fill(manifest, [StoredValue(v.size, v.stored_size, v.checksum, v.codec, TIER_CLUSTER, b"c:%d" % i)
                         for i, v in enumerate(values)])
        theirs_manifest = {**manifest, "name": b"theirs".hex()}
        change = ApplyStep(ck, "node-b", 7, "n1", theirs_manifest)
        await store.committer.submit(change)
        theirs = ck.child(r.id, b"theirs")
        assert not change.skip and theirs.complete and theirs.origin == "node-b" and ck.latest(r) is theirs
        assert ck.child(theirs.id, b"a.bin").stored[0].tier == TIER_CLUSTER
        replay = ApplyStep(ck, "node-b", 7, "n1", theirs_manifest)
        await store.committer.submit(replay)
        assert replay.skip and ck.child(r.id, b"theirs") is theirs
        clash = ApplyStep(ck, "node-b", 8, "n2", {**manifest, "name": b"mine".hex()})
        await store.committer.submit(clash)
        assert clash.skip and ck.child(r.id, b"mine") is mine and not mine.origin

    async def after_restart(store):
        ck = store.checkpoints
        r = ck.child(ROOT_ID, b"run")
        theirs = ck.child(r.id, b"theirs")
        assert theirs.complete and (theirs.origin, theirs.sid, theirs.nonce) == ("node-b", 7, "n1")
        f = ck.child(theirs.id, b"a.bin")
        with pytest.raises(ReadOnly, match="written on node node-b"):
            await ck.create(theirs.id, b"new.bin", FILE)
        with pytest.raises(ReadOnly):
            await ck.open_write(f, truncate=False)
        with pytest.raises(ReadOnly):
            await ck.set_attrs(f, AttrChange(mode=0o100600))
        with pytest.raises(ReadOnly):
            await ck.rename(theirs.id, b"a.bin", theirs.id, b"b.bin", noreplace=False)
        await ck.remove(theirs.id, b"a.bin", want_dir=False)  # rm -r here: this node's copy only
        assert not theirs.complete and ck.latest(r) is ck.child(r.id, b"mine")
        await ck.remove(r.id, b"theirs", want_dir=True)
        assert sorted(ck.dir(r.id).children) == [b"mine"]

    run(tmp_path / "s", apply)
    run(tmp_path / "s", after_restart)

"""checkpoints/ of a shared store (real mounts, a real Redis Cluster on loopback: the
`cluster` and `nodes` fixtures are conftest's): a step complete on the node that wrote it is
read whole on every node, `latest` included; the writer's retention removes it everywhere;
another node's copy is read-only; a node that joins late has the complete steps; and a
complete, exported step outlives its writer (kill -9)."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from distorefs_it import Mount, fsync_dir, have_fuse, wait_for, xattr

pytestmark = pytest.mark.skipif(not have_fuse(), reason="needs /dev/fuse and fusermount3")

MiB = 1 << 20


def configure(node: Mount, **config) -> None:
    (node.mnt / "checkpoints" / "config.json").write_text(json.dumps(config))


def stats(node: Mount) -> dict:
    return json.loads((node.mnt / "checkpoints" / "stats.json").read_bytes())


def npy(seed: int, nbytes: int) -> bytes:
    out = io.BytesIO()
    np.save(out, np.random.default_rng(seed).standard_normal(nbytes // 8))
    return out.getvalue()


def save_step(node: Mount, run: str, step: str, seed: int, big: int = 3 * MiB) -> dict[str, bytes]:
    """A step as a trainer writes it (np.save, a sub-directory, a small JSON last), closed
    and made durable by the fsync of its directory: complete on return. Returns its files."""
    d = node.mnt / "checkpoints" / run / step
    d.mkdir(parents=True)
    np.save(d / "model.npy", np.random.default_rng(seed).standard_normal(big // 8))
    (d / "optim").mkdir()
    np.save(d / "optim" / "adam.npy", np.random.default_rng(seed + 1).standard_normal(MiB // 8))
    (d / "meta.json").write_text(json.dumps({"step": step, "seed": seed}))
    os.symlink("model.npy", d / "weights.npy")
    fsync_dir(d)
    assert xattr(d, "state") == "durable"
    return {"model.npy": npy(seed, big), "optim/adam.npy": npy(seed + 1, MiB),
            "meta.json": json.dumps({"step": step, "seed": seed}).encode()}


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def has_step(node: Mount, run: str, step: str, files: dict[str, bytes]) -> bool:
    d = node.mnt / "checkpoints" / run / step
    return d.is_dir() and sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) == \
        sorted({*files, "optim", "weights.npy"})


def exported(node: Mount, n: int) -> bool:
    return stats(node)["steps_exported"] >= n


def test_a_complete_step_is_read_whole_on_another_node_and_is_read_only_there(nodes):
    a, b = nodes(), nodes()
    files = save_step(a, "run", "step-0001", seed=1)
    run_b = b.mnt / "checkpoints" / "run"
    assert wait_for(lambda: has_step(b, "run", "step-0001", files), 20.0), b.log_tail()
    assert os.readlink(run_b / "latest") == "step-0001"
    step_b = run_b / "step-0001"
    for name, data in files.items():  # byte for byte, from the cluster
        assert (step_b / name).read_bytes() == data, name
    assert os.readlink(step_b / "weights.npy") == "model.npy"
    assert np.load(step_b / "weights.npy").shape == (3 * MiB // 8,)
    assert xattr(step_b, "state") == "durable" and xattr(step_b / "model.npy", "tier") == "cluster"
    assert xattr(step_b / "model.npy", "checksum") == xattr(a.mnt / "checkpoints/run/step-0001/model.npy",
                                                           "checksum")
    assert len(xattr(step_b, "origin")) == 32  # the writer's node id
    # another node's step is read-only here, and says whose it is
    for attempt in (lambda: open(step_b / "model.npy", "r+b"),
                    lambda: open(step_b / "new.bin", "wb"),
                    lambda: os.truncate(step_b / "meta.json", 0),
                    lambda: (step_b / "optim" / "more").mkdir(),
                    lambda: os.chmod(step_b / "meta.json", 0o600),
                    lambda: os.rename(step_b / "meta.json", step_b / "optim" / "meta.json")):
        with pytest.raises(OSError) as exc:
            attempt()
        assert exc.value.errno == errno.EROFS, attempt
    # this node's own steps in the same run are its own
    mine = save_step(b, "run", "step-0002", seed=2, big=MiB)
    assert (run_b / "step-0002" / "meta.json").read_bytes() == mine["meta.json"]
    assert os.readlink(run_b / "latest") == "step-0002"
    # ... and shared the other way
    assert wait_for(lambda: has_step(a, "run", "step-0002", mine), 20.0)
    assert (a.mnt / "checkpoints/run/step-0002/model.npy").read_bytes() == mine["model.npy"]
    # rm -r of another node's step here removes this node's copy only
    shutil.rmtree(step_b)
    assert os.readlink(run_b / "latest") == "step-0002"
    assert (a.mnt / "checkpoints/run/step-0001/model.npy").read_bytes() == files["model.npy"]


def test_retention_on_the_writer_removes_the_step_on_every_node(nodes):
    a, b = nodes(), nodes()
    configure(a, keep_last=1)
    first = save_step(a, "r", "s1", seed=10, big=MiB)
    assert wait_for(lambda: has_step(b, "r", "s1", first), 20.0)
    second = save_step(a, "r", "s2", seed=11, big=MiB)
    assert wait_for(lambda: sorted(os.listdir(a.mnt / "checkpoints/r")) == ["latest", "s2"], 20.0)
    assert wait_for(lambda: sorted(os.listdir(b.mnt / "checkpoints/r")) == ["latest", "s2"], 20.0), \
        os.listdir(b.mnt / "checkpoints/r")
    assert os.readlink(b.mnt / "checkpoints/r/latest") == "s2"
    assert (b.mnt / "checkpoints/r/s2/model.npy").read_bytes() == second["model.npy"]
    assert stats(b)["applied_steps_removed"] == 1


def test_another_nodes_step_shows_in_the_runs_attributes_the_kernel_held(nodes):
    """The kernel holds a checkpoint directory's attributes; a step another node shares
    changes the run's link count and times here without a request: they are dropped."""
    a, b = nodes(), nodes()
    save_step(a, "held", "s1", seed=30, big=MiB)
    run_b = b.mnt / "checkpoints" / "held"
    assert wait_for(lambda: run_b.is_dir() and "s1" in os.listdir(run_b), 20.0)
    before = os.stat(run_b)
    assert before.st_nlink == 2 + 1
    second = save_step(a, "held", "s2", seed=31, big=MiB)
    assert wait_for(lambda: has_step(b, "held", "s2", second), 20.0)
    after = os.stat(run_b)
    assert after.st_nlink == 2 + 2 and after.st_mtime_ns > before.st_mtime_ns


def test_a_node_that_joins_late_has_the_complete_steps(nodes):
    a = nodes()
    configure(a, seal_after=0)  # only an fsync closes a step
    steps = {f"s{i}": save_step(a, "late", f"s{i}", seed=20 + i, big=MiB) for i in (1, 2)}
    (a.mnt / "checkpoints/late/s3").mkdir()  # a step the writer has not completed: its own
    (a.mnt / "checkpoints/late/s3/model.npy").write_bytes(b"not done")
    assert wait_for(lambda: exported(a, 2), 20.0)
    late = nodes()  # ready once it applied the log up to its head
    run = late.mnt / "checkpoints" / "late"
    assert sorted(os.listdir(run)) == ["latest", "s1", "s2"]
    assert os.readlink(run / "latest") == "s2"
    for name, files in steps.items():
        for rel, data in files.items():
            assert (run / name / rel).read_bytes() == data


def test_a_complete_step_survives_kill9_of_the_node_that_wrote_it(nodes):
    a, b = nodes(), nodes()
    files = save_step(a, "crash", "s1", seed=30, big=4 * MiB)
    assert wait_for(lambda: exported(a, 1), 20.0)
    a.kill9()
    a.lazy_umount()
    step_b = b.mnt / "checkpoints/crash/s1"
    assert wait_for(lambda: has_step(b, "crash", "s1", files), 20.0)
    for name, data in files.items():
        assert (step_b / name).read_bytes() == data, name
    assert os.readlink(b.mnt / "checkpoints/crash/latest") == "s1"
    # the writer comes back (recovery, then the log): its step is still its own, exported once
    a.mount(flags=a.cluster_flags)  # type: ignore[attr-defined]
    assert (a.mnt / "checkpoints/crash/s1/model.npy").read_bytes() == files["model.npy"]
    with pytest.raises(OSError):
        xattr(a.mnt / "checkpoints/crash/s1", "origin")
    time.sleep(0.5)
    assert sorted(os.listdir(b.mnt / "checkpoints/crash")) == ["latest", "s1"]


def test_a_step_completed_again_by_its_writer_replaces_the_copy_on_other_nodes(nodes):
    a, b = nodes(), nodes()
    files = save_step(a, "again", "s1", seed=40, big=MiB)
    step_a, step_b = a.mnt / "checkpoints/again/s1", b.mnt / "checkpoints/again/s1"
    assert wait_for(lambda: has_step(b, "again", "s1", files), 20.0)
    (step_a / "meta.json").write_text('{"rewritten": true}')  # the writer's step is written again
    fsync_dir(step_a)
    assert xattr(step_a, "state") == "durable"
    # Written again, the step is not complete on its writer until its new export is shared:
    # meanwhile b's copy may be gone for a moment (polled: ENOENT is not a failure here).
    assert wait_for(lambda: read_or_none(step_b / "meta.json") == b'{"rewritten": true}', 20.0), b.log_tail()
    assert (step_b / "model.npy").read_bytes() == files["model.npy"]
    assert os.readlink(b.mnt / "checkpoints/again/latest") == "s1"
    assert wait_for(lambda: stats(a)["steps_exported"] == 2, 20.0)

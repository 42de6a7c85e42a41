"""Integration fixtures: real FUSE mounts of fresh stores (see distorefs_it.Mount).

Every mount made here is unmounted in teardown whatever happened.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil

import pytest

from distorefs.tools.rediscluster import LoopbackCluster
from distorefs_it import Mount, have_fuse, is_mounted


# ----- fixtures -----------------------------------------------------------------------

@pytest.fixture(scope="session")
def fs(tmp_path_factory):
    """A session-wide mount of a fresh store; each test makes its own buffers in it."""
    if not have_fuse():
        pytest.skip("needs /dev/fuse and fusermount3")
    m = Mount(tmp_path_factory.mktemp("shared"))
    try:
        m.mount()
        yield m
    finally:
        m.cleanup()
    assert not is_mounted(m.mnt)


@pytest.fixture
def fresh_mount(tmp_path):
    """A factory of private mounts (for remount, crash and corruption tests)."""
    if not have_fuse():
        pytest.skip("needs /dev/fuse and fusermount3")
    made: list[Mount] = []

    def make(*options: str) -> Mount:
        m = Mount(tmp_path / f"m{len(made)}", options)
        made.append(m)
        m.mount()
        return m

    yield make
    for m in made:
        m.cleanup()
    for m in made:
        assert not is_mounted(m.mnt)


_counter = iter(range(1, 1 << 30))


@pytest.fixture
def buf(fs, request):
    """A new buffer in the shared mount, named after the test."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:100] + f"-{next(_counter)}"
    return fs.buffer(name)




@pytest.fixture
def temp_user():
    """A user made for this test (useradd) and removed after it (userdel): (name, uid, gid)."""
    import os
    import pwd
    import shutil
    import subprocess
    import uuid
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd")
    name = f"dfs{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", "--user-group", name],
                   check=True, capture_output=True)
    try:
        pw = pwd.getpwnam(name)
        yield name, pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared_mount(tmp_path_factory):
    """A factory of --allow-other mounts under a directory every user can reach (pytest's
    own tmp dirs are 0700), removed afterwards."""
    import os
    import shutil
    import tempfile
    from pathlib import Path
    if not have_fuse():
        pytest.skip("needs /dev/fuse and fusermount3")
    root = Path(tempfile.mkdtemp(prefix="distorefs-shared-", dir="/tmp"))
    os.chmod(root, 0o755)
    made: list[Mount] = []

    def make(*options: str) -> Mount:
        m = Mount(root / f"m{len(made)}", options)
        os.chmod(m.root, 0o755)
        os.chmod(m.mnt, 0o755)
        made.append(m)
        m.mount_allow_other()
        return m

    try:
        yield make
    finally:
        for m in made:
            m.cleanup()
        for m in made:
            assert not is_mounted(m.mnt)
        shutil.rmtree(root, ignore_errors=True)


# ----- several nodes on one Redis Cluster (test_cluster*.py) ----------------------------

_names = itertools.count(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is missing: scripts/system-deps.sh installs it")
    c = LoopbackCluster(tmp_path_factory.mktemp("redis"), masters=3, replicas=1).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def nodes(tmp_path, cluster):
    """A factory of nodes (mounts) joining one shared store of `cluster` made for the test."""
    made: list[Mount] = []
    store = f"t{next(_names)}-{os.getpid()}"

    def make(c: LoopbackCluster = cluster, flags: tuple[str, ...] = ()) -> Mount:
        m = Mount(tmp_path / f"node{len(made)}")
        m.cluster_store = store  # type: ignore[attr-defined]
        m.cluster_flags = ("--cluster", c.url, "--cluster-store", store, *flags)  # type: ignore[attr-defined]
        m.mount(flags=m.cluster_flags)  # type: ignore[attr-defined]
        made.append(m)
        return m

    yield make
    for m in made:
        m.cleanup()
    for m in made:
        assert not is_mounted(m.mnt)

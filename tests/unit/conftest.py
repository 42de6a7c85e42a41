"""Fixtures shared by the unit tests."""

from __future__ import annotations

import shutil

import pytest

from distorefs.backends.redisengine import ClusterEngine
from distorefs.tools.rediscluster import LoopbackCluster


@pytest.fixture(scope="module")
def redis_engine(tmp_path_factory):
    """A Redis Cluster of 3 masters on loopback for the module, and an engine on it."""
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is missing: scripts/system-deps.sh installs it")
    with LoopbackCluster(tmp_path_factory.mktemp("redis"), masters=3) as c:
        engine = ClusterEngine(c.url)
        yield engine
        engine.close()

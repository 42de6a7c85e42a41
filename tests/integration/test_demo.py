"""The `make run` workload (distorefs demo) against a real mount: actors insert, a learner
samples batches and writes priorities, and the numbers it reports match the buffer."""

import subprocess
import sys

from distorefs.tools.workload import run_dataset_epoch, run_workload


def test_demo_workload_runs_and_adds_up(fs):
    result = run_workload(fs.mnt, actors=2, seconds=1.5, capacity=400, quiet=True)
    assert result["inserts"] > 0
    assert all(a["errors"] == 0 for a in result["per_actor"])
    assert result["buffer_delta"]["inserts"] == result["inserts"]
    assert result["learner"]["batches"] > 0
    assert result["learner"]["errors"] == 0
    assert result["priority_updates_sent"] > 0
    # lines for entries evicted since their batch was drawn are skipped, not lost
    assert (result["buffer_delta"]["priority_updates"] + result["buffer_delta"]["priority_unknown_keys"]
            == result["priority_updates_sent"])
    assert result["final_entries"] == min(400, result["inserts"])


def test_demo_command_prints_a_report(fs):
    out = subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "demo", str(fs.mnt),
                          "--actors", "1", "--seconds", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "inserts/s" in out.stdout and "learner" in out.stdout
    assert "one shuffled epoch" in out.stdout and "prefetch hits" in out.stdout


def test_demo_dataset_epoch_is_prefetched(fs):
    r = run_dataset_epoch(fs.mnt, items=300, item_bytes=4096, quiet=True, name="demo-test")
    assert r["stage"]["copied"] == 300 and r["stage"]["errors"] == 0
    assert r["epoch"]["prefetch_hits"] >= 0.95 * 300
    again = run_dataset_epoch(fs.mnt, items=300, item_bytes=4096, quiet=True, name="demo-test")  # staged already: reused
    assert "stage" not in again and again["epoch"]["prefetch_hits"] + again["epoch"]["prefetch_misses"] <= 300


def test_cluster_demo_runs_and_leaves_nothing_behind(tmp_path):
    """`make run`'s second half: two nodes on a Redis Cluster it starts and stops itself."""
    out = subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "demo-cluster", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "read on node 1: 300 items, 0 differing" in out.stdout, out.stdout
    assert "priority total" in out.stdout and "read whole on node 1" in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == []  # its mounts, stores and Redis files are gone
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()

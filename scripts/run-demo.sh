#!/usr/bin/env bash
# Mount the embedded store, run the RL-style demo workload through plain file APIs, unmount.
set -euo pipefail
store=${1:-store}
mnt=${2:-mnt}
bin=.venv/bin/distorefs
mkdir -p "$mnt"
if grep -q " $(realpath "$mnt") fuse.distorefs" /proc/mounts; then
  $bin umount "$mnt"
fi
$bin mount "$store" "$mnt"
trap '$bin umount "$mnt"' EXIT
$bin demo "$mnt" --actors 4 --seconds 5
# then two nodes on one shared store, on a Redis Cluster started (and stopped) for it
$bin demo-cluster

#!/usr/bin/env bash
# Install the Debian packages distorefs needs (FUSE 3, its headers for pyfuse3, bindfs and
# attr and rsync for tests and benchmarks, redis-server for shared stores on a Redis Cluster), only when something is missing.
set -euo pipefail
need=()
command -v fusermount3 >/dev/null || need+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need+=(libfuse3-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v bindfs >/dev/null || need+=(bindfs)
command -v getfattr >/dev/null || need+=(attr)
command -v rsync >/dev/null || need+=(rsync)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
echo "installing Debian packages: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null

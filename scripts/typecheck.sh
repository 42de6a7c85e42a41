#!/usr/bin/env bash
# Type-check the distorefs package with mypy (make test runs it first).
#
# The package's subpackages live beside it (pyproject.toml [tool.setuptools.package-dir]:
# backends/, mount/, tools/), a layout mypy cannot follow from the source tree, so the check
# runs on a tree of links with the installed layout, made in a temporary directory.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PY:-$root/.venv/bin/python}"
case "$py" in /*) ;; */*) py="$PWD/$py" ;; esac  # a relative path is the caller's (the check runs elsewhere)
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/distorefs"
for f in "$root"/distorefs/*; do
    ln -s "$f" "$tree/distorefs/"
done
for sub in backends mount tools; do
    ln -s "$root/$sub" "$tree/distorefs/$sub"
done
cd "$tree"
"$py" -m mypy --config-file "$root/pyproject.toml" -p distorefs

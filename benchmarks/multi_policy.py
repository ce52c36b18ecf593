"""Two policies in one run vs two single-policy runs, one after the other (#33).

The workload is `examples/propose_check.yaml` (SmolLM2-135M-Instruct, two
agents per episode: a proposer and a checker). Three `agentrl train` runs of
`--steps` steps each, every one in a fresh subprocess, the same seed, groups
and budgets:

- `two_policies`: `proposer` and `checker` are two LoRA policies, each trained
  on its own turns in the same episodes;
- `proposer_only`, then `checker_only`: the same run training one policy while
  the other agent is played by the frozen base (`train: false, adapter:
  false`): what a user without multi-policy runs does, one job per policy.

Both ways every policy gets `--steps` optimizer steps on the same number of
episodes; the two-run way samples every episode twice and loads the model
twice. The time of a run is its whole wall time (start-up, model load,
rollouts, training, checkpoint), measured from outside; the peak RSS is the
subprocess's (`wait4`), as in benchmarks/memory.py.

    python benchmarks/multi_policy.py [--steps 3] [a.b=c ...]

Summary line: two_policies_s= two_runs_s= two_policies_vs_two_runs=<two_policies_s / two_runs_s>
peak_rss_mb=<two_policies> solo_peak_rss_mb=<max of the two> (goal of the ratio: <= 0.6)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from memory import run_measured  # benchmarks/memory.py: wall-clock run with the child's peak RSS

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "propose_check.yaml"
FROZEN = "{train: false, adapter: false}"
RUNS = {
    "two_policies": "{proposer: {trainer: {lr: 1.0e-4}}, checker: {trainer: {lr: 5.0e-5}}}",
    "proposer_only": "{proposer: {trainer: {lr: 1.0e-4}}, checker: " + FROZEN + "}",
    "checker_only": "{proposer: " + FROZEN + ", checker: {trainer: {lr: 5.0e-5}}}",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", default=[], help="a.b=c overrides of examples/propose_check.yaml")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def one_run(name: str, policies: str, args: argparse.Namespace, out: Path, env: dict[str, str]) -> dict[str, float]:
    """One `agentrl train` of the workload: wall seconds, peak RSS, and what its metrics say it trained."""
    cmd = [
        sys.executable, "-m", "agentrl.cli", "train", str(CONFIG), *args.overrides,
        f"policies={policies}", f"run.steps={args.steps}", "run.eval_every=0", f"run.save_every={args.steps}",
        f"run.output_dir={out}", f"run.name={name}", "run.loggers=[jsonl]",
    ]  # fmt: skip
    started = time.monotonic()
    rc, peak = run_measured(cmd, args.timeout, env)
    wall = time.monotonic() - started
    if rc != 0:
        raise SystemExit(f"{name}: agentrl train failed (exit {rc}); see its output above")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step_s" in r]
    trained = sorted({k.split("/")[1] for r in steps for k in r if k.startswith("policy/") and k.endswith("/time/train_step_s")})
    print(f"{name:14s} wall {wall:7.1f}s  peak {peak:7.0f} MB  steps {len(steps)}  policies trained {trained}",
          file=sys.stderr, flush=True)  # fmt: skip
    if len(steps) != args.steps:
        raise SystemExit(f"{name}: {len(steps)} steps logged, expected {args.steps}")
    return {"wall_s": wall, "peak_mb": peak}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="agentrl-multi-policy-") as tmp:
        results = {name: one_run(name, policies, args, Path(tmp), env) for name, policies in RUNS.items()}
    two = results["two_policies"]["wall_s"]
    solo = results["proposer_only"]["wall_s"] + results["checker_only"]["wall_s"]
    solo_peak = max(results["proposer_only"]["peak_mb"], results["checker_only"]["peak_mb"])
    print(
        f"two_policies_s={two:.1f} two_runs_s={solo:.1f} two_policies_vs_two_runs={two / solo:.3f} "
        f"peak_rss_mb={results['two_policies']['peak_mb']:.0f} solo_peak_rss_mb={solo_peak:.0f} steps={args.steps}"
    )


if __name__ == "__main__":
    main()

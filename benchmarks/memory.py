"""Memory of the default example: per-step RSS of `agentrl train`, its peak, its growth, and TRL's peak.

Runs `agentrl train CONFIG` (default `examples/calculator.yaml`) for `--steps`
optimizer steps with an evaluation every `--eval-every` steps (and at step 0),
in a fresh subprocess, and reads the run's own `memory/*` metrics
(`agentrl.run.memory`) from its metrics.jsonl. The peak is the subprocess's
maximum resident set size as the kernel counts it (`wait4`'s rusage: the same
number as `/usr/bin/time -v`), so nothing the run reports about itself is
trusted for the headline.

With `--trl`, TRL's GRPOTrainer runs `benchmarks/e2e_vs_trl.py`'s workload
(the same config, prompts, group size, LoRA and precision) for
`--trl-steps` steps in its own subprocess, and its peak is measured the same way.

    python benchmarks/memory.py [CONFIG] [a.b=c ...] [--steps 6] [--eval-every 5] [--trl]

Per step: `step  rss_mb  peak_rss_mb  trimmed_mb` and the engine's/trainer's own
shares. Summary line: peak_rss_mb=<agentrl peak> rss_growth=<RSS at the last step /
RSS after the first evaluation - 1> [trl_peak_rss_mb=<TRL peak> peak_vs_trl=<ratio>]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "calculator.yaml"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="run config YAML")
    p.add_argument("overrides", nargs="*", default=[], help="a.b=c overrides of the run config")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps of the agentrl run")
    p.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every N steps (and at step 0)")
    p.add_argument("--trl", action="store_true", help="also measure TRL's GRPOTrainer on e2e_vs_trl's workload")
    p.add_argument("--trl-steps", type=int, default=3, help="TRL optimizer steps (the first is a warm-up)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per run")
    p.add_argument("--keep", help="write the agentrl run under this directory and keep it (default: a temp dir)")
    args = p.parse_intermixed_args(argv)
    if "=" in args.config and not args.config.endswith((".yaml", ".yml")):  # a lone override lands in config
        args.overrides = [args.config, *args.overrides]
        args.config = str(DEFAULT_CONFIG)
    if args.steps < 2 or args.eval_every < 1:
        p.error(f"--steps must be >= 2 and --eval-every >= 1 (got {args.steps}, {args.eval_every})")
    if args.trl_steps < 2:
        p.error(f"--trl-steps must be >= 2 (one warm-up, one measured), got {args.trl_steps}")
    return args


def run_measured(cmd: Sequence[str], timeout: float, env: dict[str, str]) -> tuple[int, float]:
    """Run `cmd` to its end; (exit status, its peak RSS in MiB, descendants included)."""
    print(f"== {' '.join(cmd)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - started > timeout:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    print(f"== done in {time.monotonic() - started:.0f}s (rc={proc.returncode})", file=sys.stderr, flush=True)
    return proc.returncode, usage.ru_maxrss / 1024  # KiB on Linux


def agentrl_rows(args: argparse.Namespace, out: Path, env: dict[str, str]) -> tuple[float, list[dict[str, float]]]:
    cmd = [
        sys.executable, "-m", "agentrl.cli", "train", args.config, *args.overrides,
        f"run.steps={args.steps}", f"run.eval_every={args.eval_every}", f"run.save_every={args.steps + 1}",
        f"run.output_dir={out}", "run.name=memory", "run.loggers=[jsonl]",
    ]  # fmt: skip
    rc, peak = run_measured(cmd, args.timeout, env)
    if rc != 0:
        raise SystemExit(f"agentrl train failed (exit {rc}); see its output above")
    (run,) = list(out.iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return peak, sorted((r for r in rows if "memory/rss_mb" in r), key=lambda r: r["step"])


def trl_peak(args: argparse.Namespace, env: dict[str, str]) -> float:
    """TRL's peak RSS in MiB on e2e_vs_trl's workload (nan when its run fails)."""
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "e2e_vs_trl.py"), args.config, *args.overrides,
        "--systems", "trl", "--warmup", "1", "--steps", str(args.trl_steps - 1),
    ]  # fmt: skip
    rc, peak = run_measured(cmd, args.timeout, env)
    if rc != 0:  # the agentrl numbers stand; the summary line says TRL's are missing
        print(f"TRL run failed or timed out (exit {rc}); see its output above", file=sys.stderr)
        return math.nan
    return peak


def rss_growth(rows: Sequence[dict[str, float]], eval_every: int) -> float:
    """RSS at the last step over the RSS after the first evaluation of a trained policy, minus 1.

    The first evaluation after training started (step `eval_every`) is the
    reference: by then every buffer a step and an evaluation need has been
    allocated once; the step-0 evaluation ran before any training.
    """
    after_eval = [r for r in rows if r["step"] >= eval_every and "eval/reward_mean" in r]
    if not after_eval or rows[-1]["step"] <= after_eval[0]["step"]:
        return math.nan
    return rows[-1]["memory/rss_mb"] / after_eval[0]["memory/rss_mb"] - 1


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        peak, rows = agentrl_rows(args, Path(tempfile.mkdtemp(prefix="memory-", dir=args.keep)), env)
    else:
        with tempfile.TemporaryDirectory(prefix="agentrl-memory-") as tmp:
            peak, rows = agentrl_rows(args, Path(tmp), env)
    shares = sorted({k for r in rows for k in r if k.startswith(("memory/engine/", "memory/trainer/"))})
    print(f"{'step':>4} {'rss_mb':>8} {'peak_mb':>8} {'trimmed':>8} {'eval':>4}  " + " ".join(
        k.removeprefix("memory/") for k in shares))  # fmt: skip
    for r in rows:
        print(
            f"{int(r['step']):4d} {r['memory/rss_mb']:8.0f} {r['memory/peak_rss_mb']:8.0f} "
            f"{r.get('memory/trimmed_mb', 0.0):8.0f} {'yes' if 'eval/reward_mean' in r else '':>4}  "
            + " ".join(f"{r.get(k, math.nan):.0f}" for k in shares)
        )
    line = f"peak_rss_mb={peak:.0f} rss_growth={rss_growth(rows, args.eval_every):.3f} steps={args.steps}"
    if args.trl:
        sys.stdout.flush()  # the agentrl table stays even if TRL's run is stopped
        trl = trl_peak(args, env)
        line += f" trl_peak_rss_mb={trl:.0f} peak_vs_trl={peak / trl:.2f}"
    print(line)


if __name__ == "__main__":
    main()

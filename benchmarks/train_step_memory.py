"""Peak memory and time of one training step of a run config's trainer, for trainer settings side by side.

The trainer (`trainer:` section of CONFIG, default `examples/calculator.yaml`,
its model) trains `--steps` steps on GRPO groups shaped like that example's:
`--groups` groups of `--group-size` samples, one `--prompt`-token prompt per
group (shared by its samples, loss-free) and completions of `--completion`
tokens (uniform in the range). Ids, rewards and behaviour logprobs are random
with a fixed seed, so every variant trains on the same batches. No engine, no
env: this isolates the training step, which is the default example's peak.

Each variant (`--variant "a=b c=d"`, trainer overrides; the first is the
baseline) runs in a fresh subprocess. Before each step the child trims the heap
(`malloc_trim`, as `agentrl train` does after a step), records its resident set
size and resets the kernel's peak counter (5 > /proc/self/clear_refs);
after it, step peak = VmHWM - RSS before (allocator slack included). Reported
per variant: the process's peak RSS over all steps, and the median over steps
after the first (the first pays one-time allocations) of the step peak and time.
Losses are printed per step: settings that are exact (checkpointing, micro-batch
budget) give the same losses up to summation order.

    python benchmarks/train_step_memory.py [--steps 3] [--variant "..."]...

Summary line: for variant i (v0 = the baseline) `v<i>_peak_mb=` (process peak),
`v<i>_step_peak_mb=`, `v<i>_step_s=`, `v<i>_vs_v0_s=` (step time over the baseline's).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "calculator.yaml"
DEFAULT_VARIANTS = (
    "micro_batch_tokens=512 gradient_checkpointing=false",
    "micro_batch_tokens=512 gradient_checkpointing=true",
    "micro_batch_tokens=1024 gradient_checkpointing=true",
)


def trainer_config(config: Path, variant: str) -> tuple[dict[str, Any], str]:
    """The config's trainer section with the variant's `a=b c.d=e` overrides set (as `agentrl train`'s
    `trainer.a=b` would), and its model path."""
    import yaml

    from agentrl.config import apply_overrides

    raw = apply_overrides(yaml.safe_load(config.read_text()), [f"trainer.{item}" for item in variant.split()])
    trainer = {k: v for k, v in (raw.get("trainer") or {}).items() if k != "name"}
    return trainer, str((raw.get("model") or {}).get("path", "smollm2-135m-instruct"))


def groups(args: argparse.Namespace, step: int) -> list[Any]:
    """GRPO groups of the workload's shape for `step` (the same for every variant)."""
    from agentrl.types import Group, Trajectory, Turn

    rng = random.Random(1000 * args.seed + step)
    lo, hi = args.completion
    out = []
    for g in range(args.groups):
        prompt = [rng.randrange(1, 49000) for _ in range(args.prompt)]
        trajs = []
        for _ in range(args.group_size):
            n = rng.randint(lo, hi)
            completion = [rng.randrange(1, 49000) for _ in range(n)]
            p = len(prompt)
            trajs.append(Trajectory(
                task_id=f"t{g}", env="bench", messages=[], token_ids=prompt + completion,
                loss_mask=[0] * p + [1] * n, logprobs=[0.0] * p + [-1.5 + rng.uniform(-0.5, 0.5) for _ in range(n)],
                versions=[-1] * p + [step] * n, turns=[Turn(start=p, end=p + n)],
                reward=float(rng.random() < 0.5), group_id=f"g{step}-{g}",
            ))  # fmt: skip
        out.append(Group(task_id=f"t{g}", trajectories=trajs, id=f"g{step}-{g}"))
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.engines.models import resolve_model
    from agentrl.run.memory import AllocatorTrim, bound_heap_retention, process_memory_mb
    from agentrl.trainers.torch_trainer import TorchTrainer

    bound_heap_retention()  # as `agentrl train` does, and it trims the heap after each step
    trim = AllocatorTrim()
    trainer_cfg, model = trainer_config(Path(args.config), args.child)
    trainer = TorchTrainer(trainer_cfg, resolve_model(model))
    steps = []
    for step in range(args.steps):
        batch = groups(args, step)
        trim()
        before, _ = process_memory_mb()
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch).metrics
        seconds = time.perf_counter() - t0
        _, hwm = process_memory_mb()
        steps.append({"step_peak_mb": hwm - before, "hwm_mb": max(hwm, before), "seconds": seconds,
                      "loss": float(metrics["loss"])})  # fmt: skip
    # each step's counter starts at the RSS before it, so the largest is the process's peak since the model loaded
    return {"steps": steps, "peak_mb": max(s["hwm_mb"] for s in steps)}


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", variant, "--config", args.config, "--steps", str(args.steps),
           "--groups", str(args.groups), "--group-size", str(args.group_size), "--prompt", str(args.prompt),
           "--completion", *map(str, args.completion), "--seed", str(args.seed)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"variant {variant!r} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--variant", action="append", help="trainer overrides 'a=b c=d' (repeat; the first is the baseline)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt", type=int, default=290, help="prompt tokens per group (the default example's ~290)")
    p.add_argument("--completion", type=int, nargs=2, default=(40, 130), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is not counted)")
    if args.child is not None:
        print(json.dumps(child(args)))
        return
    variants = args.variant or list(DEFAULT_VARIANTS)
    rows = []
    for i, variant in enumerate(variants):
        r = run_variant(args, variant)
        counted = r["steps"][1:]
        row = {
            "peak_mb": r["peak_mb"],
            "step_peak_mb": statistics.median(s["step_peak_mb"] for s in counted),
            "step_s": statistics.median(s["seconds"] for s in counted),
            "loss": [round(s["loss"], 6) for s in r["steps"]],
        }
        rows.append(row)
        print(f"v{i} [{variant}]  peak {row['peak_mb']:.0f} MB  step peak {row['step_peak_mb']:.0f} MB  "
              f"step {row['step_s']:.1f} s  "
              f"losses {row['loss']}", flush=True)  # fmt: skip
    summary = [f"v{i}_peak_mb={r['peak_mb']:.0f} v{i}_step_peak_mb={r['step_peak_mb']:.0f} v{i}_step_s={r['step_s']:.1f} "
               f"v{i}_vs_v0_s={r['step_s'] / rows[0]['step_s']:.2f}" for i, r in enumerate(rows)]  # fmt: skip
    print(" ".join([*summary, f"steps={args.steps}"]))


if __name__ == "__main__":
    main()

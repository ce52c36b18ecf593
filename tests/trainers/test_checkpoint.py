"""Checkpoint/resume: HF model dir, optimizer, scheduler, RNG, step, extra state."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from agentrl.trainers.torch_trainer import TorchTrainer

CFG: dict[str, Any] = {"dtype": "fp32", "lr": 1e-2, "warmup_steps": 1, "schedule": "linear", "total_steps": 5}


def params(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


def test_resume_gives_the_same_next_step(tiny_llama_path: str, tmp_path: Path, build: Any) -> None:
    batches = [build.groups(2, 2, seed=s) for s in range(3)]
    a = TorchTrainer(CFG, tiny_llama_path)
    a.train_step(batches[0])
    a.train_step(batches[1])
    a.save(str(tmp_path / "ckpt"), extra_state={"cursor": 2, "rollout": {"epoch": 0}})
    rng_probe = (torch.rand(3), random.random())
    m_a = a.train_step(batches[2]).metrics
    after_a = params(a)

    b = TorchTrainer(CFG, tiny_llama_path)
    assert b.load(str(tmp_path / "ckpt")) == {"cursor": 2, "rollout": {"epoch": 0}}
    assert (b.step, b.policy_version) == (2, 2)
    assert torch.equal(torch.rand(3), rng_probe[0]) and random.random() == rng_probe[1]
    b.load(str(tmp_path / "ckpt"))  # reload so RNG is exactly at the save point again
    m_b = b.train_step(batches[2]).metrics
    assert m_b["loss"] == m_a["loss"] and m_b["lr"] == m_a["lr"]
    for n, p in params(b).items():
        assert torch.equal(p, after_a[n]), n


def test_checkpoint_model_dir_loads_with_from_pretrained(
    tiny_llama_path: str, tmp_path: Path, build: Any
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = TorchTrainer(CFG, tiny_llama_path)
    t.train_step(build.groups(1, 2, seed=0))
    t.save(str(tmp_path / "c"), extra_state={})
    files = {p.name for p in (tmp_path / "c").iterdir()}
    assert {"model", "trainer_state.pt", "rng_rank0.pt", "extra_state.json"} <= files
    assert list((tmp_path / "c" / "model").glob("*.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "c" / "model"), dtype=torch.float32)
    AutoTokenizer.from_pretrained(str(tmp_path / "c" / "model"))
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, t.model(input_ids=ids).logits)
    assert json.loads((tmp_path / "c" / "extra_state.json").read_text()) == {}


def test_lora_checkpoint_saves_merged_model_and_resumes_adapter(
    tiny_llama_path: str, tmp_path: Path, build: Any
) -> None:
    from transformers import AutoModelForCausalLM

    cfg = dict(CFG, lora={"r": 4}, weight_bucket_mb=0.05)  # several shards: the merge is written bucket by bucket
    t = TorchTrainer(cfg, tiny_llama_path)
    t.train_step(build.groups(1, 2, seed=0))
    t.save(str(tmp_path / "l"), extra_state={"k": 1})
    assert len(list((tmp_path / "l" / "model").glob("model-*.safetensors"))) > 1
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "l" / "model"), dtype=torch.float32)
    r = TorchTrainer(cfg, tiny_llama_path)
    r.load(str(tmp_path / "l"))
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        want = t.model(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r.model(input_ids=ids).logits, want)


DEFAULT_RUN_WITHOUT_DEEPSPEED = """
import sys
from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.torch_trainer import TorchTrainer

trainer = TorchTrainer(TrainerConfig(dtype="fp32"), sys.argv[1])
list(trainer.state_for_engines().buckets())
trainer.save(sys.argv[2], {"step": 1})
print("deepspeed imported:", "deepspeed" in sys.modules)
"""


def test_a_default_trainer_never_imports_deepspeed(tiny_llama_path: str, tmp_path: Path) -> None:
    """Building, syncing and checkpointing a default (non-DeepSpeed) trainer leaves DeepSpeed unimported,
    so a default run does not print its accelerator warning (a fresh interpreter: this one may hold it)."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        import pytest

        pytest.skip("deepspeed is not installed: nothing could import it")
    done = subprocess.run(
        [sys.executable, "-c", DEFAULT_RUN_WITHOUT_DEEPSPEED, tiny_llama_path, str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "deepspeed imported: False" in done.stdout, done.stdout + done.stderr
    assert "real_accelerator" not in done.stderr  # DeepSpeed's "Setting accelerator to CPU" warning
    assert (tmp_path / "ckpt" / "model" / "config.json").exists()

"""examples/minimal_grpo.py computes the loss and gradients TorchTrainer computes on the same batch."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from agentrl.trainers.torch_trainer import TorchTrainer
from agentrl.types import Group

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "minimal_grpo.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("minimal_grpo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["minimal_grpo"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _samples(mg: ModuleType, groups: list[Group]) -> list[Any]:
    """The example's samples for `groups`: its own group z-score of each group's rewards."""
    out = []
    for g in groups:
        adv = mg.grpo_advantages(torch.tensor([t.reward for t in g.trajectories]))
        for t, a in zip(g.trajectories, adv.tolist(), strict=True):
            out.append(mg.Sample(list(t.token_ids), list(t.loss_mask), list(t.logprobs), a))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_minimal_grpo_loss_and_gradients_equal_the_torch_trainers(
    tiny_llama_path: str, build: Any, temperature: float
) -> None:
    mg = _example()
    groups = build.groups(3, 4, seed=11)
    trainer = TorchTrainer({"dtype": "fp32", "lr": 1e-3, "temperature": temperature}, tiny_llama_path)
    metrics = trainer.compute_gradients(groups).metrics
    ref_grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    model = type(trainer.model).from_pretrained(tiny_llama_path, dtype=torch.float32)
    model.load_state_dict(trainer.model.state_dict())  # the same weights (trainer.model is unchanged)
    loss = mg.grpo_loss(model, _samples(mg, groups), temperature=temperature)
    loss.backward()

    assert float(loss.detach()) == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)
    assert abs(float(loss.detach())) > 1e-4  # a batch with signal: the comparison is not 0 == 0
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max()) + 1e-9, msg=name)


def test_grpo_advantages_are_the_group_z_score_and_zero_without_signal() -> None:
    mg = _example()
    adv = mg.grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std(correction=1)
    torch.testing.assert_close(adv, (torch.tensor([1.0, 0.0, 0.0, 1.0]) - 0.5) / (std + 1e-6))
    assert torch.equal(mg.grpo_advantages(torch.ones(4)), torch.zeros(4))


def test_minimal_grpo_trains_and_the_engine_serves_each_new_version(
    tiny_llama_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mg = _example()
    args = mg.parse_args(["--model", tiny_llama_path, "--steps", "2", "--prompts", "2", "--group-size", "3",
                          "--max-tokens", "4", "--lr", "1e-3"])  # fmt: skip
    rewards = asyncio.run(mg.train(args))
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["1", "2"]  # the engine's version after each sync

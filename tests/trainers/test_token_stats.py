"""TorchTrainer returns per-token trainer values (`TrainStepResult.token_stats`, the replay token view)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentrl.trainers.torch_trainer import TorchTrainer
from agentrl.types import Group, Trajectory

FIELDS = ("trainer_logprobs", "advantages", "is_weights", "is_mask")


def trainer(path: str, **cfg: Any) -> TorchTrainer:
    base: dict[str, Any] = {"dtype": "fp32", "lr": 1e-2}
    base.update(cfg)
    return TorchTrainer(base, path)


@torch.no_grad()
def direct_logprobs(t: TorchTrainer, traj: Trajectory) -> list[float]:
    """log p(token_ids[k] | token_ids[<k]) by one plain forward pass (0.0 for k = 0)."""
    ids = torch.tensor([traj.token_ids])
    logits = t.model(input_ids=ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return [0.0, *lp.tolist()]


def grpo_advantages(group: Group) -> list[float]:
    rewards = torch.tensor([tr.reward for tr in group.trajectories])
    return ((rewards - rewards.mean()) / (rewards.std(correction=1) + 1e-6)).tolist()


def test_train_step_records_trainer_logprobs_advantages_and_weights(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, micro_batch_tokens=64)  # several packed micro-batches
    groups = build.groups(3, 4, seed=0)
    for g in groups:
        for k, tr in enumerate(g.trajectories):
            tr.reward = [0.0, 1.0, 3.0, 0.5][k]
    expected = {tr.id: direct_logprobs(t, tr) for g in groups for tr in g.trajectories}
    result = t.train_step(groups)
    assert result.metrics["pack/micro_batches"] > 1
    assert all("token_stats" not in tr.info for g in groups for tr in g.trajectories)  # returned, not written

    for g in groups:
        for tr, adv in zip(g.trajectories, grpo_advantages(g), strict=True):
            stats = result.token_stats[tr.id]
            assert set(stats) == set(FIELDS)
            for name in FIELDS:
                assert len(stats[name]) == len(tr.token_ids), name
            for k, on in enumerate(tr.loss_mask):
                if not on:
                    assert all(stats[name][k] is None for name in FIELDS), k
                    continue
                assert stats["trainer_logprobs"][k] == pytest.approx(expected[tr.id][k], abs=1e-4)
                assert stats["advantages"][k] == pytest.approx(adv, abs=1e-5)
                assert stats["is_weights"][k] == 1.0 and stats["is_mask"][k] == 1  # mode none
            assert any(tr.loss_mask)


def test_importance_mask_and_weights_are_the_applied_ones(tiny_llama_path: str, build: Any) -> None:
    """mis_token with several updates per batch (proximal pass): on-policy tokens kept with
    weight ~1, tokens whose behaviour logprob is 2 nats lower (ratio e^2 > mis_high) masked."""
    t = trainer(tiny_llama_path, off_policy={"mode": "mis_token"}, mini_batches=2)
    prompt = [5, 6, 7, 8]
    trajs = []
    for comp in ([9, 10, 11, 12], [13, 14, 15], [16, 17, 18, 19, 20]):
        probe = build.trajectory(prompt, comp, reward=float(len(comp)))
        lp = direct_logprobs(t, probe)[len(prompt) :]
        behav = [x if j % 2 == 0 else x - 2.0 for j, x in enumerate(lp)]
        trajs.append(build.trajectory(prompt, comp, reward=float(len(comp)), logprobs=behav))
    expected = [direct_logprobs(t, tr) for tr in trajs]
    result = t.train_step([Group(task_id="x", trajectories=trajs[:2]), Group(task_id="y", trajectories=trajs[2:])])

    for tr, lp in zip(trajs, expected, strict=True):
        stats = result.token_stats[tr.id]
        for k in range(len(prompt), len(tr.token_ids)):
            assert stats["trainer_logprobs"][k] == pytest.approx(lp[k], abs=1e-4)
            if (k - len(prompt)) % 2 == 0:
                assert stats["is_mask"][k] == 1 and stats["is_weights"][k] == pytest.approx(1.0, abs=1e-3)
            else:
                assert stats["is_mask"][k] == 0 and stats["is_weights"][k] == 0.0
    assert result.token_stats[trajs[2].id]["advantages"][len(prompt)] == 0.0  # a group of one


def test_record_token_stats_false_writes_nothing(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, record_token_stats=False)
    groups = build.groups(2, 2, seed=1)
    assert t.train_step(groups).token_stats == {}
    assert all("token_stats" not in tr.info for g in groups for tr in g.trajectories)

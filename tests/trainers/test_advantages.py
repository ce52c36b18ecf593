"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.trainers.advantages import compute_advantages, gae, token_rewards, turn_returns
from agentrl.types import TrainSample


def sample(n_prompt: int, n_comp: int, reward: float) -> TrainSample:
    n = n_prompt + n_comp
    return TrainSample(
        input_ids=list(range(n)),
        loss_mask=[0] * n_prompt + [1] * n_comp,
        behaviour_logprobs=[0.0] * n,
        versions=[0] * n,
        reward=reward,
        turn_spans=[(n_prompt, n)],
        turn_rewards=[0.0],
        group_id="g",
        trajectory_id="x",
    )


def two_turn(reward: float, turn_rewards: list[float]) -> TrainSample:
    # prompt 0..2, turn0 2..4 (sampled), tool output 4..6, turn1 6..8 (sampled)
    return TrainSample(
        input_ids=list(range(8)),
        loss_mask=[0, 0, 1, 1, 0, 0, 1, 1],
        behaviour_logprobs=[0.0] * 8,
        versions=[0] * 8,
        reward=reward,
        turn_spans=[(2, 4), (6, 8)],
        turn_rewards=turn_rewards,
        group_id="g",
        trajectory_id="y",
    )


def completion_values(adv: torch.Tensor, s: TrainSample) -> list[float]:
    return [float(a) for a, m in zip(adv, s.loss_mask, strict=True) if m]


GROUP = [sample(2, 2, 1.0), sample(2, 3, 0.0), sample(2, 1, 0.0), sample(2, 2, 1.0)]


def test_grpo_by_hand() -> None:
    out = compute_advantages([GROUP], "grpo", eps=0.0)
    a = 0.5 / math.sqrt(1.0 / 3.0)  # mean 0.5, unbiased std sqrt(1/3)
    assert completion_values(out.advantages[0], GROUP[0]) == pytest.approx([a, a])
    assert completion_values(out.advantages[1], GROUP[1]) == pytest.approx([-a] * 3)
    assert out.advantages[0][:2].tolist() == [0.0, 0.0]  # prompt tokens carry nothing


def test_dr_grpo_has_no_std() -> None:
    out = compute_advantages([GROUP], "dr_grpo")
    assert completion_values(out.advantages[0], GROUP[0]) == pytest.approx([0.5, 0.5])
    assert completion_values(out.advantages[2], GROUP[2]) == pytest.approx([-0.5])


def test_rloo_leave_one_out() -> None:
    out = compute_advantages([GROUP], "rloo")
    assert completion_values(out.advantages[0], GROUP[0]) == pytest.approx([1 - 1 / 3] * 2)
    assert completion_values(out.advantages[1], GROUP[1]) == pytest.approx([-2 / 3] * 3)
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages([[GROUP[0]]], "rloo")


def test_groups_are_normalised_separately() -> None:
    g2 = [sample(1, 1, 5.0), sample(1, 1, 7.0)]
    out = compute_advantages([GROUP, g2], "dr_grpo")
    assert completion_values(out.advantages[4], g2[0]) == pytest.approx([-1.0])


def test_all_equal_rewards_give_zero_advantage() -> None:
    g = [sample(1, 2, 1.0), sample(1, 2, 1.0)]
    out = compute_advantages([g], "grpo")
    assert all(float(a.abs().max()) == 0.0 for a in out.advantages)


def test_reinforce_pp_batch_whitened_discounted() -> None:
    a, b = sample(1, 2, 1.0), sample(1, 1, 0.0)
    out = compute_advantages([[a], [b]], "reinforce_pp", gamma=1.0, eps=0.0)
    std = math.sqrt(1 / 3)  # returns [1, 1, 0]: mean 2/3, unbiased std sqrt(1/3)
    assert completion_values(out.advantages[0], a) == pytest.approx([(1 / 3) / std] * 2)
    assert completion_values(out.advantages[1], b) == pytest.approx([(-2 / 3) / std])
    out = compute_advantages([[a], [b]], "reinforce_pp", gamma=0.5)
    assert completion_values(out.returns[0], a) == pytest.approx([0.5, 1.0])


def test_gae_by_hand() -> None:
    r, v, m = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]), torch.ones(3)
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    assert adv.tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert ret.tolist() == pytest.approx([1.0, 1.0, 1.0])
    adv, _ = gae(r, v, m, gamma=1.0, lam=0.5)
    assert adv.tolist() == pytest.approx([0.125, 0.25, 0.5])
    # env tokens (mask 0) are skipped: the next sampled token's value bootstraps across them
    adv, _ = gae(
        torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.2, 9.0, 0.6]), torch.tensor([1.0, 0.0, 1.0]), 1.0, 1.0
    )
    assert adv.tolist() == pytest.approx([0.8, 0.0, 0.4])


def test_gae_estimator_uses_critic_values() -> None:
    s = sample(1, 2, 1.0)
    vals = torch.tensor([0.0, 0.25, 0.75])
    out = compute_advantages(
        [[s], [sample(1, 2, 0.0)]], "gae", gamma=1.0, lam=1.0, values=[[vals], [torch.zeros(3)]]
    )
    assert out.returns[0].tolist() == pytest.approx([0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="critic"):
        compute_advantages([[s]], "gae")


def test_turn_rewards_give_turn_level_returns() -> None:
    s = two_turn(1.5, [0.5, 0.0])
    # 0.5 on the last token of turn 0; the unattributed 1.0 on the last sampled token
    assert token_rewards(s).tolist() == [0, 0, 0, 0.5, 0, 0, 0, 1.0]
    assert turn_returns(s, 1.0).tolist() == [0, 0, 1.5, 1.5, 0, 0, 1.0, 1.0]
    assert turn_returns(s, 0.5).tolist() == [0, 0, 1.0, 1.0, 0, 0, 1.0, 1.0]
    # final-reward only: every sampled token gets R (plain GRPO)
    plain = two_turn(2.0, [0.0, 0.0])
    assert turn_returns(plain, 1.0).tolist() == [0, 0, 2, 2, 0, 0, 2, 2]


def test_grpo_with_turn_returns_by_hand() -> None:
    s, other = two_turn(1.5, [0.5, 0.0]), sample(2, 2, 0.5)
    out = compute_advantages([[s, other]], "grpo", eps=0.0)
    std = math.sqrt(0.5)  # episode returns [1.5, 0.5]
    assert out.advantages[0].tolist() == pytest.approx([0, 0, 0.5 / std, 0.5 / std, 0, 0, 0, 0])
    assert completion_values(out.advantages[1], other) == pytest.approx([-0.5 / std] * 2)


def test_kl_in_reward_lowers_returns() -> None:
    a, b = sample(1, 2, 1.0), sample(1, 2, 1.0)
    pen = [[torch.tensor([0.0, 0.1, 0.1])], [torch.tensor([0.0, 0.3, 0.3])]]
    out = compute_advantages([[a], [b]], "reinforce_pp", kl_penalty=pen, gamma=1.0)
    assert completion_values(out.returns[0], a) == pytest.approx([0.8, 0.9])
    out = compute_advantages([[a, b]], "dr_grpo", kl_penalty=[[pen[0][0], pen[1][0]]])
    assert completion_values(out.advantages[0], a) == pytest.approx([0.2, 0.2])  # 0.8 - mean(0.8, 0.4)


def test_unknown_estimator_is_named() -> None:
    with pytest.raises(ValueError, match="ppo2"):
        compute_advantages([GROUP], "ppo2")

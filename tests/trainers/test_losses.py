"""Losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.trainers.losses import (
    PolicyLossInputs,
    aggregate,
    aggregation_weights,
    kl_estimate,
    policy_loss,
    ppo_clip_loss,
    value_loss,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def test_ppo_clip_asymmetric_by_hand() -> None:
    ratios = [1.5, 0.5, 1.1, 0.7, 1.25]
    logp = torch.log(t(*ratios))
    adv = t(1.0, -1.0, 1.0, -1.0, 2.0)
    loss, clipped = ppo_clip_loss(
        logp, torch.zeros(5, dtype=torch.float64), adv, clip_low=0.2, clip_high=0.28
    )
    # r=1.5,A=1 -> -min(1.5, 1.28) = -1.28 ; r=0.5,A=-1 -> max(0.5, 0.8) = 0.8 ; r=1.1 -> -1.1
    # r=0.7,A=-1 -> max(0.7, 0.8) = 0.8 ; r=1.25 (inside the high bound 1.28), A=2 -> -2.5
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -1.1, 0.8, -2.5])
    assert clipped.tolist() == [True, True, False, True, False]


def test_ppo_clip_gradient_is_zero_when_clipped() -> None:
    logp = torch.log(t(1.5, 1.1)).requires_grad_(True)
    loss, _ = ppo_clip_loss(
        logp, torch.zeros(2, dtype=torch.float64), t(1.0, 1.0), clip_low=0.2, clip_high=0.2
    )
    loss.sum().backward()
    assert logp.grad is not None
    # d(-A r)/dlogp = -A r = -1.1 for the unclipped token, 0 for the clipped one
    assert logp.grad.tolist() == pytest.approx([0.0, -1.1])


def test_dual_clip_caps_negative_advantages() -> None:
    logp = torch.log(t(5.0, 5.0, 0.5))
    adv = t(-1.0, 1.0, -2.0)
    loss, clipped = ppo_clip_loss(
        logp, torch.zeros(3, dtype=torch.float64), adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    # r=5, A=-1: max(5, 1.28) = 5, capped at 3 ; A=+1 unaffected: -min(5,1.28) = -1.28
    # r=0.5, A=-2: max(1.0, 1.6) = 1.6 < cap 6 -> 1.6
    assert loss.tolist() == pytest.approx([3.0, -1.28, 1.6])
    assert clipped.tolist() == [True, True, True]


def test_kl_estimators_by_hand() -> None:
    logp, ref = t(math.log(0.5)), t(math.log(0.25))
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(0.5 - 1 + math.log(2))
    same = kl_estimate(logp, logp, "k3")
    assert float(same) == 0.0
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


LOSS = [[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 7.0 / 3.0),
        ("seq_mean_token_mean", (1.5 + 4.0) / 2),
        ("seq_mean_token_sum", (3.0 + 4.0) / 2),
    ],
)
def test_aggregation_by_hand(mode: str, expected: float) -> None:
    loss, mask = torch.tensor(LOSS, dtype=torch.float64), torch.tensor(MASK)
    assert float(aggregate(loss, mask, mode)) == pytest.approx(expected)
    # the packed weight form gives the same number on the flattened row
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    w = aggregation_weights(
        mask.flatten(), seq_ids, mode, num_seqs=2, num_tokens=3, seq_lengths=torch.tensor([2.0, 1.0])
    ).double()
    assert float((w * loss.flatten()).sum()) == pytest.approx(expected)


def test_aggregation_weights_split_across_micro_batches_sum_to_whole() -> None:
    loss = torch.tensor(LOSS, dtype=torch.float64)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        parts = 0.0
        for i in range(2):  # one sequence per "micro-batch", global counts
            w = aggregation_weights(
                torch.tensor(MASK[i]), torch.zeros(3, dtype=torch.long), mode,
                num_seqs=2, num_tokens=3, seq_lengths=torch.tensor([sum(MASK[i])]),
            ).double()  # fmt: skip
            parts += float((w * loss[i]).sum())
        assert parts == pytest.approx(float(aggregate(loss, torch.tensor(MASK), mode)))


def test_value_loss_clipped_by_hand() -> None:
    v, old, ret = t(1.0, 0.0), t(0.5, 0.0), t(0.0, 1.0)
    # token 0: unclipped (1-0)^2 = 1, clipped v=0.7 -> 0.49, max = 1 -> 0.5
    # token 1: unclipped 1, clipped v = 0 -> 1 -> 0.5
    assert value_loss(v, old, ret, 0.2).tolist() == pytest.approx([0.5, 0.5])
    # v=0.2 moving towards ret 0 from old 0.5: unclipped .04, clipped v=0.3 -> .09 -> 0.045
    assert value_loss(t(0.2), t(0.5), t(0.0), 0.2).tolist() == pytest.approx([0.045])
    assert value_loss(t(0.2), t(0.5), t(0.0), None).tolist() == pytest.approx([0.02])


def test_policy_loss_combines_terms_by_hand() -> None:
    logp = torch.log(t(1.1, 1.0, 1.0))
    x = PolicyLossInputs(
        logprobs=logp,
        old_logprobs=torch.zeros(3, dtype=torch.float64),
        advantages=t(1.0, -1.0, 5.0),
        is_weights=t(1.0, 0.5, 1.0),
        agg_weights=t(0.5, 0.5, 0.0),  # third token masked out
        entropy=t(2.0, 4.0, 100.0),
        ref_logprobs=torch.log(t(1.1, 0.5, 1.0)),
    )
    total, parts = policy_loss(
        x, clip_low=0.2, clip_high=0.2, kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01
    )
    pg = 0.5 * 1.0 * -1.1 + 0.5 * 0.5 * 1.0
    kl = 0.5 * 0.0 + 0.5 * math.log(2)
    ent = 0.5 * 2.0 + 0.5 * 4.0
    assert float(parts["pg_loss"]) == pytest.approx(pg)
    assert float(parts["kl"]) == pytest.approx(kl)
    assert float(parts["entropy_sum"]) == pytest.approx(6.0)
    assert float(total) == pytest.approx(pg + 0.1 * kl - 0.01 * ent)
    assert float(parts["clipped_tokens"]) == 0.0


def test_gspo_clips_one_geometric_mean_ratio_per_sequence() -> None:
    """Two packed sequences: the ratio every token sees is its sequence's geometric mean, and so is its gradient."""
    from agentrl.trainers.losses import gspo_old_logprobs, ppo_clip_loss

    old = torch.tensor([-1.0, -2.0, -1.5, -0.5, -3.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    shift = torch.tensor([0.3, -0.1, 0.1, 0.02, 0.0, 5.0])  # seq 0: mean log-ratio 0.1; seq 1: 0.01
    logp = (old + shift).requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0, 0.0])
    gspo_old = gspo_old_logprobs(logp, old, mask, seq_ids)
    loss, clipped = ppo_clip_loss(logp, gspo_old, adv, clip_low=0.05, clip_high=0.05)
    s0, s1 = math.exp(0.1), math.exp(0.01)
    ratio = torch.exp(logp - gspo_old).detach()
    assert ratio[:3].tolist() == pytest.approx([s0] * 3) and ratio[3:5].tolist() == pytest.approx([s1] * 2)
    # seq 0 (A > 0) is above 1 + 0.05: clipped as a whole, no gradient; seq 1 is inside: -A * s1 per token
    assert clipped[:3].all() and not clipped[3:5].any()
    (loss * mask).sum().backward()
    assert logp.grad is not None
    assert logp.grad[:3].tolist() == [0.0, 0.0, 0.0]
    assert logp.grad[3:5].tolist() == pytest.approx([2.0 * s1, 2.0 * s1])

"""Off-policy weights and mismatch diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.trainers.off_policy import MismatchStats, off_policy_weights

MODES = ["none", "tis", "mis_token", "mis_seq", "decoupled"]


@pytest.mark.parametrize("mode", MODES)
def test_identical_logprobs_give_weight_exactly_one(mode: str) -> None:
    torch.manual_seed(0)
    lp = -torch.rand(50) * 5
    mask = (torch.rand(50) > 0.3).float()
    seq_ids = torch.arange(50) // 10
    old, w = off_policy_weights(lp.clone(), lp.clone(), mask, seq_ids, mode, tis_cap=2.0, decoupled_cap=1.5)
    assert torch.equal(w[mask.bool()], torch.ones(int(mask.sum())))  # exact, not approx
    assert torch.equal(w[~mask.bool()], torch.zeros(int((1 - mask).sum())))
    assert torch.equal(old, lp)


def test_tis_truncates_at_cap() -> None:
    prox = torch.log(torch.tensor([3.0, 0.5, 1.0]))
    _, w = off_policy_weights(
        prox, torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.long), "tis", tis_cap=2.0
    )
    assert w.tolist() == pytest.approx([2.0, 0.5, 1.0])


def test_mis_token_masks_outside_bounds() -> None:
    prox = torch.log(torch.tensor([3.0, 0.4, 1.5, 0.5]))
    old, w = off_policy_weights(
        prox,
        torch.zeros(4),
        torch.ones(4),
        torch.zeros(4, dtype=torch.long),
        "mis_token",
        mis_low=0.5,
        mis_high=2.0,
    )
    assert w.tolist() == pytest.approx([0.0, 0.0, 1.5, 0.5])
    assert torch.equal(old, prox)  # ratio against the proximal policy


def test_mis_seq_uses_geometric_mean_per_sequence() -> None:
    # seq 0: ratios 4 and 0.25 -> geometric mean 1 (kept); seq 1: ratios 3, 3 -> 3 (masked)
    prox = torch.log(torch.tensor([4.0, 0.25, 9.0, 3.0, 3.0]))
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])  # token 2 is not a loss token: ignored
    seq_ids = torch.tensor([0, 0, 0, 1, 1])
    _, w = off_policy_weights(prox, torch.zeros(5), mask, seq_ids, "mis_seq", mis_low=0.5, mis_high=2.0)
    assert w.tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.0])
    prox2 = torch.log(torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0]))
    _, w2 = off_policy_weights(prox2, torch.zeros(5), mask, seq_ids, "mis_seq", mis_low=0.5, mis_high=2.0)
    assert w2.tolist() == pytest.approx([math.sqrt(2), math.sqrt(2), 0.0, 1.0, 1.0])


def test_decoupled_weight_is_prox_over_behaviour_with_cap_mask() -> None:
    prox = torch.log(torch.tensor([1.5, 3.0]))
    behav = torch.zeros(2)
    old, w = off_policy_weights(prox, behav, torch.ones(2), torch.zeros(2, dtype=torch.long), "decoupled")
    assert w.tolist() == pytest.approx([1.5, 3.0])
    assert torch.equal(old, prox)
    _, w = off_policy_weights(
        prox, behav, torch.ones(2), torch.zeros(2, dtype=torch.long), "decoupled", decoupled_cap=2.0
    )
    assert w.tolist() == pytest.approx([1.5, 0.0])


def test_none_mode_ratio_against_behaviour() -> None:
    prox, behav = torch.tensor([-1.0]), torch.tensor([-2.0])
    old, w = off_policy_weights(prox, behav, torch.ones(1), torch.zeros(1, dtype=torch.long), "none")
    assert torch.equal(old, behav) and w.tolist() == [1.0]


def test_unknown_mode_is_named() -> None:
    with pytest.raises(ValueError, match="bogus"):
        off_policy_weights(
            torch.zeros(1), torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long), "bogus"
        )


def test_mismatch_stats_by_hand() -> None:
    prox = torch.log(torch.tensor([1.0, 2.0, 0.5, 7.0]))
    behav = torch.zeros(4)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    versions = torch.tensor([3.0, 1.0, 2.0, -1.0])
    _, w = off_policy_weights(prox, behav, mask, torch.zeros(4, dtype=torch.long), "tis", tis_cap=1.5)
    s = MismatchStats()
    s.add(prox, behav, mask, versions, 4, w, mode="tis", tis_cap=1.5)
    m = s.metrics()
    d = [0.0, math.log(2), math.log(0.5)]
    assert m["off_policy/max_abs_dlogp"] == pytest.approx(math.log(2))
    assert m["off_policy/mismatch_kl_k1"] == pytest.approx(-sum(d) / 3)
    assert m["off_policy/mismatch_kl"] == pytest.approx(sum(math.expm1(x) - x for x in d) / 3)
    ws = [1.0, 2.0, 0.5]
    assert m["off_policy/ess"] == pytest.approx(sum(ws) ** 2 / (3 * sum(x * x for x in ws)))
    assert m["off_policy/is_clipped_fraction"] == pytest.approx(1 / 3)
    assert m["staleness/mean"] == pytest.approx((1 + 3 + 2) / 3)
    assert m["staleness/max"] == 3.0
    assert "off_policy/fresh_mismatch_kl" not in m and m["off_policy/fresh_fraction"] == 0.0  # no token of version 4
    # trainer at version 2: only the third token (dlogp = log 0.5) is fresh; its k3 alone is the fresh mismatch
    fresh = MismatchStats()
    fresh.add(prox, behav, mask, versions, 2, w, mode="tis", tis_cap=1.5)
    assert fresh.metrics()["off_policy/fresh_fraction"] == pytest.approx(1 / 3)
    assert fresh.metrics()["off_policy/fresh_mismatch_kl"] == pytest.approx(math.expm1(d[2]) - d[2])
    assert fresh.metrics()["off_policy/fresh_max_abs_dlogp"] == pytest.approx(math.log(2))  # |log 0.5|, not stale log 2's
    assert "off_policy/fresh_max_abs_dlogp" not in m
    merged = MismatchStats()
    merged.merge_(fresh.as_tensor())  # the all-reduce path carries the fresh sums too
    assert merged.metrics()["off_policy/fresh_mismatch_kl"] == fresh.metrics()["off_policy/fresh_mismatch_kl"]
    on = MismatchStats()
    on.add(prox, prox, mask, versions, 3, mask, mode="none", tis_cap=2.0)
    assert on.metrics()["off_policy/ess"] == 1.0
    assert on.metrics()["off_policy/mismatch_kl"] == 0.0

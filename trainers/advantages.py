"""Advantage estimators: GRPO, Dr. GRPO, RLOO, REINFORCE++, GAE, and turn-level turn_rloo and GiGPO.

Everything works on per-sample 1-D float tensors aligned with the sample's
tokens; only positions with `loss_mask == 1` (tokens the policy sampled) carry
meaning, all others are 0.

Rewards. A `TrainSample` has an episode reward `R` and optional per-turn rewards
`r_k` (the env's reward for the step after turn k). The per-turn rewards are
placed on the last sampled token of their turn and whatever part of `R` they do
not account for (`R - sum r_k`, e.g. a final verifier score) on the last sampled
token of the episode. So an env that reports only a final reward and one whose
turn rewards already sum to `R` are both read correctly, with no double count.

Group estimators (grpo, dr_grpo, rloo) give each token the return-to-go of its
turn, `G_k = sum_{j>=k} gamma^(j-k) rho_j` (rho: the rewards placed as above),
and subtract a baseline computed from the group's episode returns `G_0`. With
one turn (or only a final reward, gamma=1) this is exactly the textbook
estimator. Token estimators (reinforce_pp, gae) discount per sampled token and
can take a per-token KL penalty in the reward. The turn-level estimators
(turn_rloo, gigpo) give each turn its own baseline: see `turn_credit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentrl.trainers import turn_credit
from agentrl.trainers.config import AdvantageName, StepNorm
from agentrl.types import TrainSample


def token_rewards(sample: TrainSample) -> torch.Tensor:
    """Per-token reward placement (see module docstring); float32, zeros elsewhere."""
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    rewards = torch.zeros(len(sample.input_ids), dtype=torch.float32)
    sampled = mask.nonzero().flatten()
    if sampled.numel() == 0:
        return rewards
    placed = 0.0
    for (start, end), r in zip(sample.turn_spans, sample.turn_rewards, strict=True):
        inside = sampled[(sampled >= start) & (sampled < end)]
        if inside.numel() == 0 or r == 0.0:
            continue
        rewards[inside[-1]] += r
        placed += r
    rewards[sampled[-1]] += sample.reward - placed
    return rewards


def turn_returns(sample: TrainSample, gamma: float) -> torch.Tensor:
    """Per-token return-to-go of the token's turn (gamma discounts per turn).

    Sampled tokens outside every turn span (or all of them when there are no
    turns) belong to one implicit turn.
    """
    n = len(sample.input_ids)
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    rewards = token_rewards(sample)
    # turn id per token: index of the span containing it, implicit last turn otherwise
    spans = list(sample.turn_spans)
    turn_of = torch.full((n,), len(spans), dtype=torch.long)
    for k, (start, end) in enumerate(spans):
        turn_of[start:end] = k
    num_turns = len(spans) + 1
    per_turn = torch.zeros(num_turns, dtype=torch.float32)
    per_turn.index_add_(0, turn_of[mask], rewards[mask])
    present = torch.zeros(num_turns, dtype=torch.bool)
    present[turn_of[mask]] = True
    # return-to-go over the turns that actually hold sampled tokens, in order
    order = present.nonzero().flatten().tolist()
    ret = torch.zeros(num_turns, dtype=torch.float32)
    running = 0.0
    for k in reversed(order):
        running = float(per_turn[k]) + gamma * running
        ret[k] = running
    out = torch.zeros(n, dtype=torch.float32)
    out[mask] = ret[turn_of[mask]]
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reverse discounted cumulative sum over the masked positions only (1-D)."""
    out = torch.zeros_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    for t in reversed(mask.nonzero().flatten().tolist()):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the sampled tokens of one sequence.

    The time axis is the sequence of masked positions (env tokens are skipped);
    the value after the last sampled token is 0 (episode end). Returns
    (advantages, returns = advantages + values), zeros off the mask.
    """
    adv = torch.zeros_like(rewards)
    idx = mask.nonzero().flatten().tolist()
    next_value = 0.0
    running = 0.0
    for t in reversed(idx):
        delta = float(rewards[t]) + gamma * next_value - float(values[t])
        running = delta + gamma * lam * running
        adv[t] = running
        next_value = float(values[t])
    returns = torch.where(mask.bool(), adv + values, torch.zeros_like(adv))
    return adv, returns


def whiten(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """Normalise masked entries of all tensors together to mean 0, std 1."""
    flat = torch.cat([v[m.bool()] for v, m in zip(values, masks, strict=True)])
    if flat.numel() == 0:
        return [v.clone() for v in values]
    mean = flat.mean()
    std = flat.std(correction=1) if flat.numel() > 1 else torch.zeros(())
    return [
        torch.where(m.bool(), (v - mean) / (std + eps), torch.zeros_like(v))
        for v, m in zip(values, masks, strict=True)
    ]


@dataclass(slots=True)
class Advantages:
    """Per-sample advantages and returns (returns feed the critic under GAE)."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    metrics: dict[str, float]


def compute_advantages(
    groups: Sequence[Sequence[TrainSample]],
    estimator: AdvantageName,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    kl_penalty: Sequence[Sequence[torch.Tensor]] | None = None,
    values: Sequence[Sequence[torch.Tensor]] | None = None,
    step_weight: float = 1.0,
    step_norm: StepNorm = "std",
) -> Advantages:
    """Advantages for every sample of every group, in the same nested order, flattened.

    `kl_penalty[g][i]` (optional) is the per-token `coef * KL` to subtract from the
    reward (KL in reward): token estimators subtract it per token, group
    estimators subtract its sum from the episode return, turn estimators from
    the reward of the turn it fell in. `values` is needed by gae;
    `step_weight` and `step_norm` are gigpo's.
    """
    samples = [s for g in groups for s in g]
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    flat_kl = [k for g in kl_penalty for k in g] if kl_penalty is not None else None

    if estimator in ("turn_rloo", "gigpo"):
        return _turn_advantages(groups, estimator, gamma, eps, flat_kl, masks, samples, step_weight, step_norm)

    if estimator in ("grpo", "dr_grpo", "rloo"):
        advs: list[torch.Tensor] = []
        rets: list[torch.Tensor] = []
        i = 0
        for group in groups:
            group_rets = []
            for s in group:
                r = turn_returns(s, gamma)
                if flat_kl is not None:
                    r = r - masks[i] * flat_kl[i].sum()
                group_rets.append(r)
                i += 1
            episode = torch.tensor([_episode_return(r, s) for r, s in zip(group_rets, group, strict=True)])
            advs.extend(_group_baseline(group_rets, episode, estimator, eps, masks[i - len(group) : i]))
            rets.extend(group_rets)
        return Advantages(advs, rets, _adv_metrics(advs, masks))

    token_r = [token_rewards(s) for s in samples]
    if flat_kl is not None:
        token_r = [r - m * k for r, m, k in zip(token_r, masks, flat_kl, strict=True)]
    if estimator == "reinforce_pp":
        rets = [discounted_returns(r, m, gamma) for r, m in zip(token_r, masks, strict=True)]
        advs = whiten(rets, masks, eps)
        return Advantages(advs, rets, _adv_metrics(advs, masks))
    if estimator == "gae":
        if values is None:
            raise ValueError("advantage 'gae' needs critic values")
        flat_v = [v for g in values for v in g]
        pairs = [gae(r, v, m, gamma, lam) for r, v, m in zip(token_r, flat_v, masks, strict=True)]
        advs = whiten([a for a, _ in pairs], masks, eps)
        rets = [r for _, r in pairs]
        return Advantages(advs, rets, _adv_metrics(advs, masks))
    raise ValueError(
        f"unknown advantage estimator {estimator!r}; allowed: grpo, dr_grpo, rloo, reinforce_pp, gae, "
        "turn_rloo, gigpo"
    )


def _turn_advantages(
    groups: Sequence[Sequence[TrainSample]],
    estimator: AdvantageName,
    gamma: float,
    eps: float,
    flat_kl: Sequence[torch.Tensor] | None,
    masks: Sequence[torch.Tensor],
    samples: Sequence[TrainSample],
    step_weight: float,
    step_norm: StepNorm,
) -> Advantages:
    """turn_rloo or gigpo over every group (`turn_credit`); returns are the per-token turn returns."""
    advs: list[torch.Tensor] = []
    rets: list[torch.Tensor] = []
    totals = {"turns": 0.0, "grouped_turns": 0.0, "step_groups": 0.0}
    i = 0
    for group in groups:
        tables = [
            turn_credit.turn_table(s, token_rewards(s), flat_kl[i + j] if flat_kl is not None else None, gamma)
            for j, s in enumerate(group)
        ]
        if estimator == "turn_rloo":
            advs.extend(turn_credit.turn_rloo(group, tables))
        else:
            group_advs, counts = turn_credit.gigpo(group, tables, step_weight=step_weight, step_norm=step_norm, eps=eps)
            advs.extend(group_advs)
            totals = {k: totals[k] + counts[k] for k in totals}
        rets.extend(turn_credit.per_token(group, tables))
        i += len(group)
    metrics = _adv_metrics(advs, masks)
    if estimator == "gigpo" and totals["turns"]:
        metrics["adv/step_grouped_fraction"] = totals["grouped_turns"] / totals["turns"]
        metrics["adv/step_groups"] = totals["step_groups"]
    return Advantages(advs, rets, metrics)


def _episode_return(returns: torch.Tensor, sample: TrainSample) -> float:
    """G_0: the return of the first sampled token (0.0 for a sample with none)."""
    idx = [t for t, m in enumerate(sample.loss_mask) if m]
    return float(returns[idx[0]]) if idx else 0.0


def _group_baseline(
    returns: list[torch.Tensor],
    episode: torch.Tensor,
    estimator: AdvantageName,
    eps: float,
    masks: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    n = episode.numel()
    if estimator == "rloo":
        if n < 2:
            raise ValueError("advantage 'rloo' needs groups of at least 2 samples (leave-one-out baseline)")
        total = episode.sum()
        return [
            (r - (total - episode[i]) / (n - 1)) * m
            for i, (r, m) in enumerate(zip(returns, masks, strict=True))
        ]
    mean = episode.mean()
    if estimator == "dr_grpo":
        return [(r - mean) * m for r, m in zip(returns, masks, strict=True)]
    spread = float(episode.max() - episode.min())
    if spread <= 1e-9 * max(1.0, float(episode.abs().max())):
        # Equal episode returns: the group carries no signal, every advantage is 0. Without this,
        # a later turn's return-to-go minus the episode mean (the rewards of earlier turns) would
        # be divided by eps alone and explode.
        return [torch.zeros_like(r) for r in returns]
    std = episode.std(correction=1)
    return [(r - mean) / (std + eps) * m for r, m in zip(returns, masks, strict=True)]


def _adv_metrics(advs: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> dict[str, float]:
    flat = torch.cat([a[m.bool()] for a, m in zip(advs, masks, strict=True)]) if advs else torch.zeros(0)
    out: dict[str, float] = {}  # reward/mean and reward/std: the loop's batch metrics (one computation)
    if flat.numel():
        out |= {
            "adv/mean": float(flat.mean()),
            "adv/abs_mean": float(flat.abs().mean()),
            "adv/zero_fraction": float((flat == 0).float().mean()),
        }
    return out

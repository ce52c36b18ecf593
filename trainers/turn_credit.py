"""Turn-level credit assignment: per-turn baselines that stay unbiased, and GiGPO.

Both estimators work on a group's *turn table*: for every sample i and turn
index k, the return-to-go `G[i, k] = sum_{j>=k} gamma^(j-k) rho[i, j]`, where
`rho[i, j]` is the reward placed on turn j (the env's step reward, the
unaccounted rest of the episode reward on the last turn, minus any per-token
KL penalty of the turn). A sample that ended before turn k has `G[i, k] = 0`.
Every token of turn k gets the advantage of (i, k); sampled tokens outside
every turn span belong to the turn before them.

`turn_rloo`: `A[i, k] = G[i, k] - mean_{j != i} G[j, k]`. The baseline of turn
k is built from the *other* samples only, zeros included for those that had
already stopped, so it does not depend on sample i's own actions, its choice to
stop included. Normalising per turn index over only the samples that reached
it (MT-GRPO style) makes the baseline's terms depend on the sample's own
stopping turn, which biases the gradient towards or against taking more turns
(verl RFC #7244); `benchmarks/credit_assignment.py` measures both exactly.

`gigpo` (Group-in-Group Policy Optimisation, Feng et al. 2025): the episode
advantage of GRPO, `(G[i, 0] - mean G[:, 0]) / (std + eps)`, plus
`step_weight` times a step advantage. Turns of the group that acted on the
same state (`TrainSample.turn_states`: the env's `state_key` or the rendered
observation) form a step group; a turn's step advantage is its return-to-go
normalised within its step group (minus the mean, over the std with
`step_norm: std`). A turn whose state no sibling saw gets step advantage 0.
Like GRPO's std normalisation, GiGPO trades a little bias for lower variance.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from agentrl.trainers.config import StepNorm
from agentrl.types import TrainSample


def turn_index(sample: TrainSample) -> torch.Tensor:
    """The turn each token belongs to: the last turn span starting at or before it (0 before the first)."""
    n = len(sample.input_ids)
    index = torch.zeros(n, dtype=torch.long)
    for k, (start, _end) in enumerate(sample.turn_spans):
        index[start:] = k
    return index


def turn_table(
    sample: TrainSample, token_rewards: torch.Tensor, kl_penalty: torch.Tensor | None, gamma: float
) -> torch.Tensor:
    """Return-to-go per turn index (length: number of turns, at least 1) from per-token rewards."""
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    index = turn_index(sample)
    rho = torch.zeros(max(len(sample.turn_spans), 1), dtype=torch.float64)
    rewards = token_rewards.to(torch.float64)
    if kl_penalty is not None:
        rewards = rewards - kl_penalty.to(torch.float64)
    rho.index_add_(0, index[mask], rewards[mask])
    returns = torch.zeros_like(rho)
    running = 0.0
    for k in range(rho.numel() - 1, -1, -1):
        running = float(rho[k]) + gamma * running
        returns[k] = running
    return returns


def _padded(tables: Sequence[torch.Tensor]) -> torch.Tensor:
    """The group's turn tables as one [samples, max turns] matrix, zeros past each sample's end."""
    width = max(t.numel() for t in tables)
    out = torch.zeros(len(tables), width, dtype=torch.float64)
    for i, t in enumerate(tables):
        out[i, : t.numel()] = t
    return out


def per_token(samples: Sequence[TrainSample], tables: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The turn tables spread over the tokens: each sampled token gets its turn's return (0 elsewhere)."""
    return _spread(samples, _padded(tables))


def _spread(samples: Sequence[TrainSample], per_turn: torch.Tensor) -> list[torch.Tensor]:
    """Per-token values from a [samples, turns] matrix: each sampled token gets its turn's value."""
    out = []
    for i, s in enumerate(samples):
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        out.append(per_turn[i, turn_index(s)].to(torch.float32) * mask)
    return out


def turn_rloo(samples: Sequence[TrainSample], tables: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leave-one-out baseline per turn index (module docstring); per-token advantages."""
    n = len(samples)
    if n < 2:
        raise ValueError("advantage 'turn_rloo' needs groups of at least 2 samples (leave-one-out baseline)")
    g = _padded(tables)
    baseline = (g.sum(dim=0, keepdim=True) - g) / (n - 1)
    return _spread(samples, g - baseline)


def gigpo(
    samples: Sequence[TrainSample],
    tables: Sequence[torch.Tensor],
    *,
    step_weight: float,
    step_norm: StepNorm,
    eps: float,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Episode plus step advantages (module docstring); per-token advantages and step-group counts."""
    g = _padded(tables)
    episode = g[:, 0]
    n = episode.numel()
    std = episode.std(correction=1) if n > 1 else torch.zeros((), dtype=torch.float64)
    episode_adv = (episode - episode.mean()) / (std + eps)
    step_adv = torch.zeros_like(g)
    groups: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, (s, t) in enumerate(zip(samples, tables, strict=True)):
        states = s.turn_states
        if len(states) != len(s.turn_spans):
            raise ValueError(
                f"advantage 'gigpo' needs a state key per turn: trajectory {s.trajectory_id} has "
                f"{len(s.turn_spans)} turns and {len(states)} turn_states (build samples with Trajectory.tokens())"
            )
        for k in range(t.numel()):
            groups[states[k] if states else f"turn:{k}"].append((i, k))
    grouped = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        grouped += len(members)
        rows = torch.tensor([i for i, _ in members])
        cols = torch.tensor([k for _, k in members])
        values = g[rows, cols]
        centred = values - values.mean()
        step_adv[rows, cols] = centred / (values.std(correction=1) + eps) if step_norm == "std" else centred
    advantages = _spread(samples, episode_adv[:, None] + step_weight * step_adv)
    turns = sum(t.numel() for t in tables)
    multi = [m for m in groups.values() if len(m) > 1]
    counts = {
        "turns": float(turns),
        "grouped_turns": float(grouped),
        "step_groups": float(len(multi)),
    }
    return advantages, counts

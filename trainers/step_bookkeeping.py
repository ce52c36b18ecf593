"""The RL step's bookkeeping around the forward/backward (`torch_trainer.TorchTrainer._step`).

Step 3 (advantages over whole groups, with the KL penalty in the reward when
configured) and step 5 (loss terms averaged over updates; mismatch and packing
stats reduced over all ranks; the LR) are arithmetic on tensors the step has
already computed. They live here so the trainer reads as the step itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from agentrl.trainers.advantages import Advantages, compute_advantages
from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.distributed import World, all_reduce_max, all_reduce_sum
from agentrl.trainers.losses import kl_estimate
from agentrl.trainers.off_policy import MismatchStats
from agentrl.trainers.packing import PackedBatch, padding_counts, padding_metrics
from agentrl.trainers.shared_prefix import layout_cost
from agentrl.types import TrainSample

Samples = Sequence[Sequence[TrainSample]]
"""A batch as the trainer takes it: the samples of each group (`Trajectory.tokens()`), group by group."""


def group_advantages(
    cfg: TrainerConfig,
    groups: Samples,
    base: Mapping[str, Sequence[torch.Tensor]],
    ref: Mapping[int, torch.Tensor],
    values: Mapping[int, torch.Tensor],
) -> Advantages:
    """The configured estimator over whole groups (KL in reward subtracted first, when on)."""
    n = len(base["loss_mask"])
    kl_pen = None
    kl_metrics: dict[str, float] = {}
    if cfg.kl.enabled and cfg.kl.in_reward:
        flat_pen = [
            cfg.kl.coef
            * kl_estimate(base["behaviour_logprobs"][i], ref[i], cfg.kl.estimator)
            * base["loss_mask"][i]
            for i in range(n)
        ]
        kl_pen = nest(flat_pen, groups)
        loss_tokens = max(float(torch.cat(list(base["loss_mask"])).sum()), 1.0)
        kl_metrics["kl/in_reward_mean"] = float(torch.cat(flat_pen).sum() / loss_tokens)
    adv = compute_advantages(
        groups,
        cfg.advantage,
        gamma=cfg.gamma,
        lam=cfg.critic.lam if cfg.critic is not None else 1.0,
        eps=cfg.adv_eps,
        kl_penalty=kl_pen,
        values=nest([values[i] for i in range(n)], groups) if values else None,
        step_weight=cfg.gigpo.step_weight if cfg.gigpo is not None else 1.0,
        step_norm=cfg.gigpo.step_norm if cfg.gigpo is not None else "std",
    )
    adv.metrics = kl_metrics | adv.metrics
    return adv


def step_metrics(
    cfg: TrainerConfig,
    world: World,
    sums: Mapping[str, float],
    stats: MismatchStats,
    updates: int,
    batches: Sequence[PackedBatch],
    ids: Sequence[Sequence[int]],
    lr: float,
) -> dict[str, float]:
    """Loss terms averaged over the updates, mismatch and packing stats over all ranks, the LR."""
    out = {k: v / updates for k, v in sums.items()}
    merged = all_reduce_sum(stats.as_tensor(), world)
    maxes = all_reduce_max(
        torch.tensor([stats.max_abs_dlogp, stats.staleness_max, stats.fresh_max_abs_dlogp], dtype=torch.float64),
        world,
    )
    stats.merge_(merged)
    stats.max_abs_dlogp, stats.staleness_max, stats.fresh_max_abs_dlogp = (float(x) for x in maxes.tolist())
    out |= stats.metrics()
    out |= packing_metrics(world, batches, ids)
    if cfg.shared_prefix and batches:
        real = sum(b.num_tokens - b.num_pad for b in batches)
        run = sum(layout_cost(b.cu_seqlens.tolist(), b.families) for b in batches)
        out["pack/shared_prefix_saved"] = 1.0 - run / max(real, 1)
    out["lr"] = lr
    out["samples"] = float(len(ids))
    return out


def packing_metrics(
    world: World, batches: Sequence[PackedBatch], ids: Sequence[Sequence[int]]
) -> dict[str, float]:
    """`packing.padding_metrics` over every rank's micro-batches."""
    counts = torch.tensor(padding_counts(batches, [len(x) for x in ids]), dtype=torch.float64)
    return padding_metrics(all_reduce_sum(counts, world).tolist())


def nest(flat: Sequence[torch.Tensor], nested: Samples) -> list[list[torch.Tensor]]:
    """`flat` (one entry per sample) cut back into the groups of `nested`."""
    out, i = [], 0
    for g in nested:
        out.append(list(flat[i : i + len(g)]))
        i += len(g)
    return out


def add_sums(sums: dict[str, float], values: Mapping[str, float]) -> None:
    """Accumulate `values` into `sums` key by key."""
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + v

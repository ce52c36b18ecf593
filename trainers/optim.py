"""The policy's optimizer: AdamW, the LR schedule, and a clipped step that skips non-finite gradients.

Shared by the RL and the SFT step of the torch trainer; the RNG seeding that
comes before the models are built lives here too.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.distributed import full_tensor


def build_optimizer(
    config: TrainerConfig, params: Sequence[nn.Parameter]
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and its LR schedule (warmup, then constant / linear / cosine decay)."""
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    return optimizer, lr_schedule(config, optimizer)


def lr_schedule(config: TrainerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of `optimizer` (also the one a DeepSpeed engine steps with)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config))


def clipped_step(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], max_norm: float | None) -> float:
    """Clip and apply the accumulated gradients; returns the norm before clipping.

    A non-finite norm (a NaN or inf anywhere in the gradients: a NaN reward,
    an overflow) skips the update: one AdamW step on NaN gradients would make
    every weight NaN, and the engine would serve them. The norm is all-reduced
    (under FSDP the norm over all shards), so every rank skips together.
    """
    norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)))
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def advance_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """One LR-schedule step per train step, applied or skipped (torch warns when no update ran yet)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()


def lr_factor(cfg: TrainerConfig) -> Callable[[int], float]:
    """The LR multiplier at each trainer step (`LambdaLR`'s lambda)."""
    warmup, total, floor = cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant" or total is None:
            return 1.0
        progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
        if cfg.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def seed_everything(seed: int) -> None:
    """Seed the python, numpy and torch RNGs (before the models: LoRA and the critic head initialise randomly)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass

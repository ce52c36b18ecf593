"""Per-token trainer values for the replay token view (`trajectory.info["token_stats"]`).

During the first epoch of a step the trainer hands each micro-batch's trainer
logprobs (the step-start policy, what the mismatch metrics compare with the
behaviour logprobs) and applied importance weights to a `TokenStatsRecorder`;
after the step `stats` cuts them back per trajectory together with the
advantages used in the loss. The step returns them
(`TrainStepResult.token_stats`); the training loop stores them with the
trajectories. Lists are aligned with `token_ids`, null off the
loss mask, floats rounded to 6 decimals (they are stored as JSON). Under data
parallelism each rank records only the trajectories it trained on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from agentrl.trainer import TokenStats
from agentrl.trainers.packing import PackedBatch
from agentrl.types import JSON, TrainSample


class TokenStatsRecorder:
    """Collects per-sample trainer logprobs and importance weights from packed micro-batches."""

    def __init__(self) -> None:
        self._parts: dict[int, tuple[list[float], list[float]]] = {}

    def add(self, batch: PackedBatch, trainer_logprobs: torch.Tensor, is_weights: torch.Tensor) -> None:
        """Record one real (not dummy) micro-batch; both tensors are per packed token [T]."""
        lp = batch.split(trainer_logprobs.detach().float().cpu())
        w = batch.split(is_weights.detach().float().cpu())
        for i, lp_i, w_i in zip(batch.sample_indices, lp, w, strict=True):
            self._parts[i] = (lp_i.tolist(), w_i.tolist())

    def stats(
        self,
        samples: Sequence[TrainSample],
        loss_masks: Sequence[torch.Tensor],
        advantages: Sequence[torch.Tensor],
    ) -> dict[str, TokenStats]:
        """The recorded samples' token stats by trajectory id (sample indices as in `add`)."""
        out: dict[str, TokenStats] = {}
        for i, (lp, w) in self._parts.items():
            sample = samples[i]
            mask = [bool(m) for m in loss_masks[i].tolist()]
            if not len(lp) == len(mask) == len(sample.input_ids):
                raise ValueError(f"trajectory {sample.trajectory_id}: token stats do not align with its token_ids")
            out[sample.trajectory_id] = {
                "trainer_logprobs": _on_mask(lp, mask),
                "advantages": _on_mask(advantages[i].tolist(), mask),
                "is_weights": _on_mask(w, mask),
                "is_mask": [int(x > 0.0) if m else None for x, m in zip(w, mask, strict=True)],
            }
        return out


def _on_mask(values: Sequence[float], mask: Sequence[bool]) -> list[JSON]:
    """Rounded values on loss tokens, None elsewhere (and for non-finite values: valid JSON)."""
    return [round(x, 6) if m and math.isfinite(x) else None for x, m in zip(values, mask, strict=True)]

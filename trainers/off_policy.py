"""Off-policy correction between the behaviour policy (engine) and the trainer.

Three log-probabilities per sampled token: `behav` (what the engine sampled
with, possibly several versions old, possibly a different kernel), `prox` (the
trainer's own policy at the start of the step, no grad), and the current policy
inside the loss. Every mode returns the logprobs the PPO ratio is taken against
and a detached weight per token; `exp(0)` is exactly 1, so a trainer and engine
that agree bit for bit get weight 1 in every mode.

`MismatchStats` accumulates the always-logged diagnostics over micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.trainers.config import OffPolicyMode


def off_policy_weights(
    prox_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    mode: OffPolicyMode,
    *,
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
    decoupled_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(old_logprobs for the PPO ratio, detached per-token weights), 0 weight off the mask.

    none: ratio vs behav, w = 1. tis: ratio vs prox, w = min(prox/behav, cap).
    mis_token: ratio vs prox, w = prox/behav inside [low, high], else 0.
    mis_seq: ratio vs prox, w = geometric mean of prox/behav over the sequence's
    loss tokens, the whole sequence 0 outside [low, high].
    decoupled (AReaL): ratio vs prox, w = prox/behav, 0 above `decoupled_cap` if set.
    """
    mask_f = mask.to(torch.float32)
    prox = prox_logprobs.detach().to(torch.float32)
    behav = behav_logprobs.to(torch.float32)
    if mode == "none":
        return behav, mask_f
    log_w = (prox - behav) * mask_f
    w = torch.exp(log_w)
    if mode == "tis":
        w = torch.clamp(w, max=tis_cap)
    elif mode == "mis_token":
        w = torch.where((w >= mis_low) & (w <= mis_high), w, torch.zeros_like(w))
    elif mode == "mis_seq":
        seq_w = torch.exp(_seq_mean(log_w, mask_f, seq_ids))
        keep = (seq_w >= mis_low) & (seq_w <= mis_high)
        w = torch.where(keep, seq_w, torch.zeros_like(seq_w))[seq_ids]
    elif mode == "decoupled":
        if decoupled_cap is not None:
            w = torch.where(w <= decoupled_cap, w, torch.zeros_like(w))
    else:
        raise ValueError(
            f"unknown off_policy.mode {mode!r}; allowed: none, tis, mis_token, mis_seq, decoupled"
        )
    return prox, w * mask_f


def _seq_mean(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Mean of masked `values` per sequence id (0 for sequences without loss tokens)."""
    n = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype).index_add_(0, seq_ids, values * mask)
    counts = torch.zeros(n, dtype=values.dtype).index_add_(0, seq_ids, mask)
    return sums / counts.clamp(min=1.0)


@dataclass(slots=True)
class MismatchStats:
    """Running sums of train/inference mismatch diagnostics over loss tokens."""

    tokens: float = 0.0
    kl_k3: float = 0.0
    kl_k1: float = 0.0
    max_abs_dlogp: float = 0.0
    w_sum: float = 0.0
    w_sq_sum: float = 0.0
    masked: float = 0.0
    clipped: float = 0.0
    staleness_sum: float = 0.0
    staleness_max: float = 0.0
    fresh_tokens: float = 0.0  # tokens sampled by the weights the trainer held at the start of the step
    fresh_kl_k3: float = 0.0
    fresh_max_abs_dlogp: float = 0.0  # same weights on both sides: numerics only, unless the weight sync broke

    def add(
        self,
        prox_logprobs: torch.Tensor,
        behav_logprobs: torch.Tensor,
        mask: torch.Tensor,
        versions: torch.Tensor,
        trainer_version: int,
        weights: torch.Tensor,
        *,
        mode: OffPolicyMode,
        tis_cap: float,
    ) -> None:
        """Fold one micro-batch in. `weights` are what `off_policy_weights` returned."""
        m = mask.bool()
        if not bool(m.any()):
            return
        d = (prox_logprobs.detach().float() - behav_logprobs.float())[m]
        raw_w = torch.exp(d)
        self.tokens += float(m.sum())
        # KL(behav || trainer) estimated from behaviour samples: k1 = -d, k3 = e^d - 1 - d
        self.kl_k1 += float((-d).sum())
        k3 = torch.expm1(d) - d
        self.kl_k3 += float(k3.sum())
        self.max_abs_dlogp = max(self.max_abs_dlogp, float(d.abs().max()))
        self.w_sum += float(raw_w.sum())
        self.w_sq_sum += float(raw_w.square().sum())
        if mode != "none":
            self.masked += float((weights[m] == 0).sum())
        if mode == "tis":
            self.clipped += float((raw_w > tis_cap).sum())
        stale = (trainer_version - versions[m]).float()
        self.staleness_sum += float(stale.sum())
        self.staleness_max = max(self.staleness_max, float(stale.max()))
        fresh = stale == 0  # same weights on both sides: any difference is numerics or a broken weight sync
        self.fresh_tokens += float(fresh.sum())
        self.fresh_kl_k3 += float(k3[fresh].sum())
        if bool(fresh.any()):
            self.fresh_max_abs_dlogp = max(self.fresh_max_abs_dlogp, float(d[fresh].abs().max()))

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        ess = self.w_sum**2 / (n * self.w_sq_sum) if self.w_sq_sum > 0 else 1.0
        out = {
            "off_policy/mismatch_kl": self.kl_k3 / n,
            "off_policy/mismatch_kl_k1": self.kl_k1 / n,
            "off_policy/max_abs_dlogp": self.max_abs_dlogp,
            "off_policy/ess": ess,  # (sum w)^2 / (n sum w^2), 1 when on-policy
            "off_policy/masked_fraction": self.masked / n,
            "off_policy/is_clipped_fraction": self.clipped / n,
            "staleness/mean": self.staleness_sum / n,  # the run's one staleness measure (docs/metrics.md)
            "staleness/max": self.staleness_max,
            "off_policy/fresh_fraction": self.fresh_tokens / n,
        }
        if self.fresh_tokens:
            out["off_policy/fresh_mismatch_kl"] = self.fresh_kl_k3 / self.fresh_tokens
            out["off_policy/fresh_max_abs_dlogp"] = self.fresh_max_abs_dlogp
        return out

    def merge_(self, values: torch.Tensor) -> None:
        """Overwrite from an all-reduced vector made by `as_tensor` (sums; maxima reduced separately)."""
        (self.tokens, self.kl_k3, self.kl_k1, self.w_sum, self.w_sq_sum, self.masked, self.clipped,
         self.staleness_sum, self.fresh_tokens, self.fresh_kl_k3) = (float(v) for v in values.tolist())  # fmt: skip

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [self.tokens, self.kl_k3, self.kl_k1, self.w_sum, self.w_sq_sum, self.masked, self.clipped,
             self.staleness_sum, self.fresh_tokens, self.fresh_kl_k3], dtype=torch.float64,
        )  # fmt: skip

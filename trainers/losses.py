"""Losses as pure functions over typed per-token tensors.

All tensors are 1-D over the (packed) tokens of a micro-batch, or any shape as
long as they agree. Aggregation is expressed as per-token weights so that a loss
split over micro-batches, gradient-accumulation steps and data-parallel ranks
sums to exactly the loss of the whole batch (see `aggregation_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.trainers.config import KLEstimator, LossAgg


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi (Schulman's k1/k2/k3).

    k1 = log pi - log ref (unbiased, can be negative); k2 = 0.5 (log pi - log ref)^2;
    k3 = ref/pi - 1 - log(ref/pi) (unbiased, always >= 0).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: k1, k2, k3")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss with asymmetric bounds and optional dual clip.

    ratio = exp(logp - old); loss = max(-A r, -A clip(r, 1-clip_low, 1+clip_high));
    with dual clip c and A < 0 the loss is further capped at -c A.
    Returns (loss, clipped) where `clipped` marks tokens whose gradient the clip removed.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = -advantages * clipped_ratio
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped


def gspo_old_logprobs(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor
) -> torch.Tensor:
    """The `old_logprobs` that make `ppo_clip_loss` compute GSPO's sequence-level ratio.

    GSPO (Zheng et al. 2025) clips one ratio per sequence, the geometric mean
    s_i = exp(mean over sequence i's loss tokens of (logp - old)), and gives each
    token the gradient s_i * grad logp_t (the "GSPO-token" form, which takes
    per-token advantages). `ppo_clip_loss` uses r_t = exp(logp_t - old'_t); with
    old'_t = sg[logp_t] - sg[log s_i], r_t has the value s_i and that gradient,
    so the clip, the dual clip and every aggregation apply unchanged. A whole
    sequence is clipped or not. A sequence's tokens must all be in `logprobs`:
    they are, under sequence parallelism too (the shards' logprobs are gathered).
    """
    mask_f = mask.to(logprobs.dtype)
    detached = logprobs.detach()
    n = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    sums = torch.zeros(n, dtype=logprobs.dtype).index_add_(0, seq_ids, (detached - old_logprobs) * mask_f)
    counts = torch.zeros(n, dtype=logprobs.dtype).index_add_(0, seq_ids, mask_f)
    log_s = sums / counts.clamp(min=1.0)
    return detached - log_s[seq_ids]


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """Per-token PPO value loss 0.5 (V - R)^2, with the clipped variant's max when `clip` is set."""
    loss = (values - returns).square()
    if clip is not None:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (v_clipped - returns).square())
    return 0.5 * loss


def aggregation_weights(
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    mode: LossAgg,
    *,
    num_seqs: int,
    num_tokens: int,
    seq_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weights w such that sum(w * loss_per_token) is the aggregated loss.

    `num_seqs`/`num_tokens` are the counts over the *whole* batch (all micro-batches
    and ranks), so partial sums add up to the global loss.
    - token_mean: mean over all loss tokens of the batch -> w = mask / num_tokens
    - seq_mean_token_mean: mean over sequences of each sequence's token mean
      -> w = mask / (len_i * num_seqs); `seq_lengths[seq_ids]` = loss tokens of seq i
    - seq_mean_token_sum (Dr. GRPO): mean over sequences of token sums -> w = mask / num_seqs
    """
    mask = mask.to(torch.float32)
    if mode == "token_mean":
        return mask / max(num_tokens, 1)
    if mode == "seq_mean_token_sum":
        return mask / max(num_seqs, 1)
    if mode == "seq_mean_token_mean":
        if seq_lengths is None:
            raise ValueError("seq_mean_token_mean needs seq_lengths")
        per_token_len = seq_lengths.to(torch.float32)[seq_ids].clamp(min=1.0)
        return mask / (per_token_len * max(num_seqs, 1))
    raise ValueError(
        f"unknown loss_agg {mode!r}; allowed: token_mean, seq_mean_token_mean, seq_mean_token_sum"
    )


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: LossAgg) -> torch.Tensor:
    """Aggregate a padded [batch, time] per-token loss (reference form of the weights above)."""
    mask = mask.to(loss.dtype)
    if mode == "token_mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1)
    per_seq_sum = (loss * mask).sum(-1)
    if mode == "seq_mean_token_sum":
        return per_seq_sum.mean()
    if mode == "seq_mean_token_mean":
        return (per_seq_sum / mask.sum(-1).clamp(min=1)).mean()
    raise ValueError(
        f"unknown loss_agg {mode!r}; allowed: token_mean, seq_mean_token_mean, seq_mean_token_sum"
    )


@dataclass(slots=True)
class PolicyLossInputs:
    """Typed per-token inputs of the policy loss (all the same shape).

    `old_logprobs` is what the PPO ratio is taken against (behaviour logprobs, or the
    proximal policy's for decoupled/IS modes); `is_weights` the detached off-policy
    weights (1 where no correction); `agg_weights` from `aggregation_weights` (0 off the mask).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    is_weights: torch.Tensor
    agg_weights: torch.Tensor
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def policy_loss(
    x: PolicyLossInputs,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full per-micro-batch policy objective (to minimise) and its parts (detached sums).

    loss = sum w * [ is_w * ppo_clip + kl_coef * KL - entropy_coef * H ].
    Returned parts are sums that add up across micro-batches: `pg_loss`/`kl` are
    weighted like the loss; `clipped_tokens`/`entropy_sum` are plain sums over loss tokens.
    """
    pg, clipped = ppo_clip_loss(
        x.logprobs, x.old_logprobs, x.advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    w = x.agg_weights
    pg_term = (w * x.is_weights * pg).sum()
    total = pg_term
    parts: dict[str, torch.Tensor] = {
        "pg_loss": pg_term.detach(),
        "clipped_tokens": ((w > 0) & clipped).sum().detach().to(torch.float32),
    }
    if kl_coef > 0.0 and x.ref_logprobs is not None:
        kl = (w * kl_estimate(x.logprobs, x.ref_logprobs, kl_estimator)).sum()
        total = total + kl_coef * kl
        parts["kl"] = kl.detach()
    if x.entropy is not None:
        if entropy_coef != 0.0:
            total = total - entropy_coef * (w * x.entropy).sum()
        parts["entropy_sum"] = (x.entropy * (w > 0)).sum().detach()
    return total, parts

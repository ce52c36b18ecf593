"""Per-row sampling for a batch of next-token logits, with exact logprobs.

Each row has its own temperature / top-k / top-p. The logprob returned for a
sampled token is its log-probability under the distribution it was actually
drawn from: logits / temperature, then top-k, then top-p (renormalised). At
temperature 0 the choice is greedy and the logprob is taken under the plain
(temperature 1, unfiltered) distribution, the one a trainer recomputes.

Imports torch: only the hf engine imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RowSampling:
    """The sampling parameters of one batch row."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and then top-p nucleus.

    `top_k` holds 0 for "no limit"; `top_p` holds 1.0 for "no limit". The most
    likely token of a row is always kept.
    """
    vocab = scaled.shape[-1]
    if bool((top_k > 0).all()):  # only the top max(k) candidates can survive: topk, not a full sort
        sorted_logits, order = scaled.topk(min(int(top_k.max()), vocab), dim=-1)
    else:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_logits.shape[-1], device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    remove = ranks >= k
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if bool((top_p < 1.0).any()):
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        remove = before > top_p.unsqueeze(1)
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter_(1, order, sorted_logits)


def sample_rows(
    logits: torch.Tensor, rows: Sequence[RowSampling], generator: torch.Generator | None = None
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [B, V]; return (ids, logprobs).

    Sampling runs on the host, whatever device the logits come from (a CUDA model's
    are copied over: [B, V] fp32, ~6 MB for 32 rows of a 49k vocabulary): the row
    generators are CPU generators, so a seed samples the same tokens on any device.
    """
    logits = logits.float().cpu()
    batch = logits.shape[0]
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
    greedy = temps == 0
    ids = torch.empty(batch, dtype=torch.long)
    logprobs = torch.empty(batch, dtype=torch.float32)
    if bool(greedy.any()):
        g_idx = greedy.nonzero().squeeze(1)
        g_logp = logits[g_idx].log_softmax(dim=-1)
        g_ids = g_logp.argmax(dim=-1)
        ids[g_idx] = g_ids
        logprobs[g_idx] = g_logp.gather(1, g_ids.unsqueeze(1)).squeeze(1)
    if not bool(greedy.all()):
        s_idx = (~greedy).nonzero().squeeze(1)
        s_rows = [rows[i] for i in s_idx.tolist()]
        scaled = logits[s_idx] / temps[s_idx].unsqueeze(1)
        top_k = torch.tensor([r.top_k for r in s_rows], dtype=torch.long)
        top_p = torch.tensor([r.top_p for r in s_rows], dtype=torch.float32)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            scaled = filter_logits(scaled, top_k, top_p)
        logp = scaled.log_softmax(dim=-1)
        probs = logp.exp()
        s_ids = torch.empty(len(s_rows), dtype=torch.long)
        shared = [j for j, r in enumerate(s_rows) if r.generator is None]
        if shared:
            s_ids[shared] = torch.multinomial(probs[shared], 1, generator=generator).squeeze(1)
        for j, r in enumerate(s_rows):
            if r.generator is not None:
                s_ids[j] = torch.multinomial(probs[j], 1, generator=r.generator)[0]
        ids[s_idx] = s_ids
        logprobs[s_idx] = logp.gather(1, s_ids.unsqueeze(1)).squeeze(1)
    return ids.tolist(), logprobs.tolist()

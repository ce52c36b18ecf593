"""Chunked logprobs/entropy equal the naive full-logits computation, gradients included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agentrl.trainers.logprobs import chunked_logprobs, token_logprobs_from_logits


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_with_gradients(temperature: float) -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 300, bias=False).double()
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (37,))
    w = torch.rand(37, dtype=torch.float64)

    logits = head(hidden) / temperature
    ref_lp = token_logprobs_from_logits(logits * temperature, targets, temperature).double()
    p = torch.softmax(logits, -1)
    ref_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    (ref_lp * w).sum().add((ref_ent * w).sum()).backward()
    ref_gh, ref_gw = hidden.grad.clone(), head.weight.grad.clone()  # type: ignore[union-attr]

    hidden.grad = None
    head.weight.grad = None
    lp, ent = chunked_logprobs(
        hidden, targets, head, chunk_tokens=8, temperature=temperature, with_entropy=True
    )
    assert ent is not None
    (lp * w).sum().add((ent * w).sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp)
    torch.testing.assert_close(ent.double(), ref_ent)
    torch.testing.assert_close(hidden.grad, ref_gh)
    torch.testing.assert_close(head.weight.grad, ref_gw)


def test_no_grad_path_and_without_entropy() -> None:
    head = nn.Linear(8, 50)
    hidden = torch.randn(10, 8)
    targets = torch.randint(0, 50, (10,))
    with torch.no_grad():
        lp, ent = chunked_logprobs(hidden, targets, head, chunk_tokens=3)
        ref = token_logprobs_from_logits(head(hidden), targets)
    assert ent is None
    torch.testing.assert_close(lp, ref)


def test_scoring_only_needed_positions_matches_the_full_row(tiny_llama_path: str) -> None:
    """Loss-token-only scoring: same logprobs/entropy there, zeros elsewhere, same gradients."""
    from transformers import AutoModelForCausalLM

    from agentrl.trainers.logprobs import packed_logprobs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float64)
    ids = torch.randint(5, 1000, (1, 23))
    positions = torch.tensor([list(range(11)) + list(range(12))])  # two packed sequences
    needed = torch.zeros(23, dtype=torch.bool)
    needed[[4, 5, 9, 15, 16, 22]] = True
    weights = torch.rand(23, dtype=torch.float64) * needed

    def run(mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        lp, ent = packed_logprobs(model, ids, positions, chunk_tokens=4, with_entropy=True, needed=mask)
        assert ent is not None
        ((lp * weights).sum() + (ent * weights).sum()).backward()
        return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full_lp, full_ent, full_grads = run(None)
    lp, ent, grads = run(needed)
    torch.testing.assert_close(lp[needed], full_lp[needed])
    torch.testing.assert_close(ent[needed], full_ent[needed])
    assert lp[~needed].abs().sum() == 0 and ent[~needed].abs().sum() == 0
    assert len(grads) == len(full_grads)
    for g, ref in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(g, ref)
    nothing, _ = packed_logprobs(model, ids, positions, needed=torch.zeros(23, dtype=torch.bool))
    assert nothing.requires_grad  # still a graph through the lm_head, for DDP

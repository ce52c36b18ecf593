"""Chunked logprobs/entropy equal the naive full-logits computation, gradients included."""

from __future__ import annotations

import pytest
import torch
from agentrl.trainers.logprobs import chunked_logprobs, token_logprobs_from_logits
from torch import nn


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

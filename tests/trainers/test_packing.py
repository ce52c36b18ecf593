"""Padding-free packing: layout, budgets, and packed == unpacked (loss and gradients)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agentrl.trainers.logprobs import packed_logprobs, token_logprobs_from_logits
from agentrl.trainers.packing import (
    PACKED_ATTENTION,
    pack,
    pack_all,
    padding_stats,
    plan_micro_batches,
    use_packed_attention,
)


def test_plan_respects_budget_and_keeps_every_sequence() -> None:
    lengths = [5, 9, 3, 7, 2, 20, 4]
    plan = plan_micro_batches(lengths, 10)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    for b in plan:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1  # oversize sequence alone
    assert [5] in plan  # the 20-token one has a bin of its own
    assert len(plan) == 5  # FFD: [20] [9] [7,3] [5,4] [2]... -> 5 bins
    with pytest.raises(ValueError):
        plan_micro_batches(lengths, 0)


def test_pack_layout_positions_and_cu_seqlens() -> None:
    ids = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    adv = [torch.full((len(x),), float(i)) for i, x in enumerate(ids)]
    b = pack(ids, {"adv": adv}, [2, 0], pad_to_multiple_of=4, pad_id=0)
    assert b.input_ids.tolist() == [[31, 32, 33, 34, 11, 12, 13, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert b.cu_seqlens.tolist() == [0, 4, 7, 8]  # padding is its own segment
    assert b.seq_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 2]
    assert b.fields["adv"].tolist() == [2, 2, 2, 2, 0, 0, 0, 0]
    assert b.num_pad == 1
    assert [x.tolist() for x in b.split(b.fields["adv"])] == [[2, 2, 2, 2], [0, 0, 0]]
    stats = padding_stats([b], [len(x) for x in ids])
    assert stats["pack/padding_fraction"] == pytest.approx(1 / 8)
    assert stats["pack/padded_layout_padding_fraction"] == pytest.approx(1 - 7 / 8)
    with pytest.raises(ValueError, match="field 'adv'"):
        pack(ids, {"adv": [torch.zeros(1)] * 3}, [0])


def _sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 5000, (n,), generator=g).tolist() for n in (7, 13, 4, 10)]


def load(path: str, attention: str) -> Any:
    """Tiny Llama with HF's own packed mask ("sdpa") or the trainer's per-sequence attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if attention == "packed_sdpa":
        use_packed_attention(model)
        assert model.config._attn_implementation == PACKED_ATTENTION
    return model


ATTENTIONS = ["sdpa", "packed_sdpa"]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_does_not_cross_sequence_boundaries(tiny_llama_path: str, attention: str) -> None:
    model = load(tiny_llama_path, attention)
    seqs = _sequences()
    b1 = pack(seqs, {}, [0, 1])
    changed = [list(seqs[0]), seqs[1]]
    changed[0][2] = (changed[0][2] + 1) % 5000 + 1
    b2 = pack(changed, {}, [0, 1])
    with torch.no_grad():
        lp1, _ = packed_logprobs(model, b1.input_ids, b1.position_ids)
        lp2, _ = packed_logprobs(model, b2.input_ids, b2.position_ids)
    n0 = len(seqs[0])
    assert not torch.equal(lp1[:n0], lp2[:n0])  # the edit matters inside its own sequence ...
    assert torch.equal(lp1[n0:], lp2[n0:])  # ... and not at all in the next one


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_packed_loss_and_gradients_equal_unpacked(tiny_llama_path: str, attention: str) -> None:
    model = load(tiny_llama_path, attention)
    seqs = _sequences()
    g = torch.Generator().manual_seed(1)
    weights = [torch.rand(len(s), generator=g) for s in seqs]

    # unpacked reference: one plain HF forward per sequence, full logits
    model.zero_grad()
    ref_loss = torch.zeros((), dtype=torch.float32)
    for s, w in zip(seqs, weights, strict=True):
        ids = torch.tensor([s])
        logits = model(input_ids=ids).logits[0, :-1]
        lp = token_logprobs_from_logits(logits, ids[0, 1:])
        ref_loss = ref_loss + (lp * w[1:]).sum()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # packed: all sequences in one row (chunk smaller than the row to exercise chunking)
    model.zero_grad()
    batches = pack_all(seqs, {"w": weights}, token_budget=1000)
    assert len(batches) == 1
    b = batches[0]
    lp, _ = packed_logprobs(model, b.input_ids, b.position_ids, chunk_tokens=5)
    loss = (lp * b.fields["w"]).sum()
    loss.backward()

    assert float(loss.detach()) == pytest.approx(float(ref_loss), rel=1e-6, abs=1e-6)
    assert ref_grads
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        ref = ref_grads[name]
        # fp32 summation order differs (one row vs four): allow 1e-5 of the tensor's own scale
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=name)

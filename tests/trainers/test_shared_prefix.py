"""Shared-prompt forward: same logprobs and gradients as running every sample in full."""

from __future__ import annotations

import pytest
import torch

from agentrl.trainers.logprobs import base_causal_lm, packed_logprobs
from agentrl.trainers.packing import pack, use_packed_attention
from agentrl.trainers.shared_prefix import (
    Family,
    common_prefix_len,
    family_cost,
    find_families,
    plan_families,
    shared_prefix_hidden,
    split_family,
)


def test_common_prefix_stops_at_the_first_loss_token_and_leaves_a_suffix() -> None:
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], [1, 2, 3, 4]]
    masks = [[0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1]]
    assert common_prefix_len(seqs, masks) == 3
    assert common_prefix_len([[1, 2, 3], [1, 2, 3]], [[0, 0, 0], [0, 0, 0]]) == 2  # one suffix token left
    assert common_prefix_len([[1, 2, 3, 4]], [[0, 1, 1, 1]]) == 1


def test_families_plan_whole_groups_and_split_short_prefixes() -> None:
    ids = [[7] * 20 + [1, 2], [7] * 20 + [3], [5, 6, 1], [5, 9, 1, 1]]
    masks = [[0] * 20 + [1, 1], [0] * 20 + [1], [0, 1, 1], [0, 0, 1, 1]]
    fams = find_families([[0, 1], [2, 3]], ids, masks, min_prefix=16)
    assert fams == [Family((0, 1), 20), Family((2,), 1), Family((3,), 2)]
    lengths = [len(s) for s in ids]
    assert family_cost(fams[0], lengths) == 20 + 2 * 2
    bins = plan_families(fams, lengths, token_budget=26)
    assert sorted(m for b in bins for f in b for m in f.members) == [0, 1, 2, 3]
    assert all(sum(family_cost(f, lengths) for f in b) <= 26 for b in bins if len(b) > 1)


def test_a_family_over_the_budget_splits_into_parts_within_it() -> None:
    lengths = [20 + n for n in (5, 1, 9, 3, 2)]  # a 20-token prefix, suffixes of 5, 1, 9, 3, 2
    fam = Family((0, 1, 2, 3, 4), 20)
    assert family_cost(fam, lengths) == 20 + 5 * 9
    assert split_family(fam, lengths, 100) == [fam]  # within the budget: unchanged
    parts = split_family(fam, lengths, 40)
    assert parts == [Family((2, 0), 20), Family((3, 4, 1), 20)]  # longest first: 20 + 2*9, 20 + 3*3
    assert all(family_cost(p, lengths) <= 40 for p in parts)
    assert split_family(fam, lengths, 23) == [Family((m,), 20) for m in (2, 0, 3, 4, 1)]  # one member each, even over
    bins = plan_families([fam], lengths, 40)
    assert sorted(m for b in bins for f in b for m in f.members) == [0, 1, 2, 3, 4]
    assert all(sum(family_cost(f, lengths) for f in b) <= 40 for b in bins)


@pytest.mark.parametrize(("lora", "checkpointed"), [(False, False), (True, False), (False, True), (True, True)])
def test_shared_prefix_equals_the_full_forward_with_gradients(tiny_llama_path: str, lora: bool,
                                                              checkpointed: bool) -> None:  # fmt: skip
    """Exact logprobs and gradients, also with the layers checkpointed (recomputed in backward: the
    suffixes read the prefix's keys from the attention's kwargs, which a recompute leaves alone)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float64)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():  # non-zero B so the adapters matter
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    use_packed_attention(model)
    prompt = torch.randint(5, 1000, (12,)).tolist()
    seqs = [prompt + torch.randint(5, 1000, (n,)).tolist() for n in (5, 9, 3)]
    seqs.append(torch.randint(5, 1000, (8,)).tolist())  # an unrelated sample, its own family
    masks = [[0] * 12 + [1] * (len(s) - 12) for s in seqs[:3]] + [[0, 0, 0] + [1] * 5]
    masks[1][15] = 0  # a tool-output token inside a suffix
    fields = {"loss_mask": [torch.tensor(m, dtype=torch.float64) for m in masks]}
    b = pack(seqs, fields, [0, 1, 2, 3])
    needed = b.fields["loss_mask"] > 0
    weights = torch.rand(b.num_tokens, dtype=torch.float64) * needed
    decoder = base_causal_lm(model).get_decoder()
    fams = find_families([[0, 1, 2], [3]], seqs, masks, min_prefix=4)
    assert fams[0].prefix_len == 12 and fams[1].prefix_len == 3

    layer_calls = [0]
    decoder.layers[0].register_forward_pre_hook(lambda *_: layer_calls.__setitem__(0, layer_calls[0] + 1))

    def run(shared: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        if shared and checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        layer_calls[0] = 0
        hidden = (
            shared_prefix_hidden(decoder, b.input_ids, b.cu_seqlens, [(0, 3, 12), (3, 1, 3)]) if shared else None
        )
        lp, _ = packed_logprobs(model, b.input_ids, b.position_ids, hidden=hidden, needed=needed)
        (lp * weights).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return lp.detach(), grads

    full, full_grads = run(False)
    shared, grads = run(True)
    assert layer_calls[0] == (8 if checkpointed else 4)  # 2 families x (prefix, suffixes), again in backward
    torch.testing.assert_close(shared[needed], full[needed])
    assert len(grads) == len(full_grads) > 0
    for g, ref in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(g, ref)

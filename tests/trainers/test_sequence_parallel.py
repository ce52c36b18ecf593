"""Sequence parallelism on HF models: setup, sharding, the patched attention, and P=2 / DP x SP steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from agentrl.trainers.sequence_parallel import (
    ATTN_IMPLEMENTATION,
    SPGroups,
    gather_logprobs,
    patch_model_for_sp,
    shard_packed_batch,
    sp_setup,
)

sys.path.insert(0, str(Path(__file__).parent))
import sp_workers


def test_sp_setup_without_a_process_group() -> None:
    assert sp_setup(1) == SPGroups()
    with pytest.raises(RuntimeError, match="sequence_parallel_size=2"):
        sp_setup(2)
    with pytest.raises(ValueError, match=">= 1"):
        sp_setup(0)


def test_shards_cover_the_batch_with_global_positions() -> None:
    batch = sp_workers.packed_batch(0, [9, 4, 15])
    shards = [
        shard_packed_batch(
            batch["ids"], batch["pos"][None], batch["cu"], SPGroups(sp_size=2, sp_rank=r), pad_token_id=7
        )
        for r in range(2)
    ]
    assert shards[0].input_ids.shape == shards[1].input_ids.shape == (1, shards[0].layout.local_len)
    layout = shards[0].layout
    assert torch.equal(layout.unshard([s.input_ids[0] for s in shards]), batch["ids"])
    assert torch.equal(layout.unshard([s.position_ids[0] for s in shards]), batch["pos"])
    for r, s in enumerate(shards):  # padding continues each sequence's positions with the pad id
        pad = layout.global_index(r) < 0
        assert torch.equal(s.position_ids[0][pad], layout.positions(r)[pad])
        assert bool((s.input_ids[0][pad] == 7).all())
    assert shards[1].shard(batch["labels"], fill=-100).shape == (1, layout.local_len)


def test_shard_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="cu_seqlens"):
        shard_packed_batch(
            torch.zeros(10, dtype=torch.long), torch.zeros(10), torch.tensor([0, 4, 9]), SPGroups()
        )
    shard = shard_packed_batch(
        torch.zeros(9, dtype=torch.long), torch.zeros(9), torch.tensor([0, 4, 9]), SPGroups()
    )
    with pytest.raises(ValueError, match=r"\(9, \.\.\.\)"):
        shard.shard(torch.zeros(8))


def test_patched_model_at_p1_matches_sdpa() -> None:
    """The patched model (SP path with P=1, and a plain forward without a ring context)
    gives transformers' own sdpa log-probs on a packed batch."""
    model = sp_workers.tiny_llama()
    batch = sp_workers.packed_batch(3, [12, 5, 20])
    with torch.no_grad():
        want = model(input_ids=batch["ids"][None], position_ids=batch["pos"][None], use_cache=False).logits[0]
        assert patch_model_for_sp(model) == "sdpa"
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
        shard = shard_packed_batch(batch["ids"], batch["pos"], batch["cu"], SPGroups())
        got = model(**shard.model_inputs()).logits
        plain = model(input_ids=batch["ids"][None], position_ids=batch["pos"][None], use_cache=False).logits[
            0
        ]
    labels = batch["labels"]
    lp = gather_logprobs(sp_workers.token_logprobs(got, shard.shard(labels)), shard)
    assert lp.shape == (37,)
    assert (lp - sp_workers.token_logprobs(want, labels)).abs().max() <= 1e-5
    assert (plain - want).abs().max() <= 1e-5


def test_patched_attention_refuses_dropout() -> None:
    model = sp_workers.tiny_llama()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    patch_model_for_sp(model)
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_p2_training_step_equals_p1() -> None:
    """Tiny HF Llama, packed batch, per-sequence-mean PG loss: with P=2 the loss, every parameter
    gradient and the weights after an optimizer step equal the single-process sdpa run (1e-5)."""
    sp_workers.launch(sp_workers.llama_sp_step, 2)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_dp2_x_sp2_on_four_ranks_composes() -> None:
    """4 ranks = DP 2 x SP 2: each rank's loss equals its replica's P=1 loss and the reduced
    gradients equal the mean of the two replicas' P=1 gradients."""
    sp_workers.launch(sp_workers.llama_dp_sp_step, 4, 2)

"""Ring attention: zigzag layout, single-process exactness, and 2/4-rank gloo rings vs full attention."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from agentrl.trainers.ring_attention import ZigzagLayout, reference_attention, ring_attention

sys.path.insert(0, str(Path(__file__).parent))
import sp_workers


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


@pytest.mark.parametrize("sp_size", [1, 2, 3, 4])
def test_zigzag_layout_round_trips_and_balances(sp_size: int) -> None:
    lens = [7, 20, 1, 13]
    layout = ZigzagLayout.from_cu_seqlens(_cu(lens), sp_size)
    x = torch.arange(sum(lens)) * 10
    shards = [layout.shard(x, r, fill=-1) for r in range(sp_size)]
    assert {len(s) for s in shards} == {layout.local_len}  # equal tokens (and equal causal work) per rank
    assert torch.equal(layout.unshard(shards), x)
    assert torch.equal(layout.local_cu_seqlens()[-1], torch.tensor(layout.local_len, dtype=torch.int32))
    for n, padded in zip(lens, layout.padded, strict=True):
        assert padded >= n and padded % (1 if sp_size == 1 else 2 * sp_size) == 0
    if sp_size > 1:
        c = layout.chunk[1]
        start = layout.local_seqlens[0]  # rank 1's tokens of sequence 1: chunk 1 then chunk 2P-2
        got = layout.positions(1)[start : start + 2 * c].tolist()
        assert got == [*range(c, 2 * c), *range((2 * sp_size - 2) * c, (2 * sp_size - 1) * c)]


def test_zigzag_padding_is_a_suffix_of_each_sequence() -> None:
    layout = ZigzagLayout.from_cu_seqlens(_cu([5, 1]), 2)
    for r in range(2):
        pos, glob = layout.positions(r), layout.global_index(r)
        is_pad = glob < 0
        seq_len = torch.tensor([5] * layout.local_seqlens[0] + [1] * layout.local_seqlens[1])
        assert torch.equal(is_pad, pos >= seq_len)


def test_layout_rejects_bad_cu_seqlens() -> None:
    with pytest.raises(ValueError, match="start with 0"):
        ZigzagLayout.from_cu_seqlens([1, 4], 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        ZigzagLayout.from_cu_seqlens([0, 4, 4], 2)
    with pytest.raises(ValueError, match="sp_size"):
        ZigzagLayout.from_cu_seqlens([0, 4], 0)


@pytest.mark.parametrize("q_chunk", [3, 1024])
def test_single_process_matches_full_attention(q_chunk: int) -> None:
    torch.manual_seed(0)
    cu = _cu([9, 30, 1, 17])
    q = torch.randn(57, 6, 8, requires_grad=True)
    k = torch.randn(57, 2, 8, requires_grad=True)
    v = torch.randn(57, 2, 8, requires_grad=True)
    dout = torch.randn(57, 6, 8)
    out = ring_attention(q, k, v, cu, q_chunk=q_chunk, scale=0.3)
    ref = reference_attention(q, k, v, cu, scale=0.3)
    assert (out - ref).abs().max() <= 1e-5
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= 1e-5


def test_bf16_inputs_keep_dtype_and_stay_close() -> None:
    torch.manual_seed(0)
    cu = _cu([16, 8])
    q, k, v = (torch.randn(24, 2, 8) for _ in range(3))
    out = ring_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu)
    assert out.dtype == torch.bfloat16
    assert (out.float() - reference_attention(q, k, v, cu)).abs().max() < 5e-2


def test_bad_arguments_name_the_problem() -> None:
    q, k = torch.randn(8, 3, 4), torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ring_attention(q, k, k, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="cu_seqlens ends at 6"):
        ring_attention(k, k, k, torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="causal"):
        ring_attention(k, k, k, torch.tensor([0, 8]), causal=False)
    with pytest.raises(ValueError, match="backend"):
        ring_attention(k, k, k, torch.tensor([0, 8]), backend="nope")  # type: ignore[arg-type]


@pytest.mark.skipif(sp_workers.flash_installed(), reason="ring-flash-attn is installed here")
def test_flash_backend_without_the_package_says_what_is_missing() -> None:
    k = torch.randn(8, 2, 4)
    with pytest.raises(RuntimeError, match="ring-flash-attn"):
        ring_attention(k, k, k, torch.tensor([0, 8]), backend="flash")


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_full_attention_on_gloo_ranks(world: int) -> None:
    """Causal single sequence, packed unequal lengths, and a length not divisible by 2P:
    outputs and dq/dk/dv equal full attention within 1e-5 (asserted on every rank)."""
    sp_workers.launch(sp_workers.ring_attention_cases, world)


def test_autocast_does_not_lower_the_internal_precision() -> None:
    torch.manual_seed(0)
    cu = _cu([20, 12])
    q, k, v = (torch.randn(32, 2, 8, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(q, k, v, cu, q_chunk=5)
    assert out.dtype == torch.float32
    assert (out - reference_attention(q, k, v, cu)).abs().max() <= 1e-5
    out.sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())

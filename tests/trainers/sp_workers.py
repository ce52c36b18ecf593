"""Spawned-process workers for the ring-attention and sequence-parallel tests.

They live in a plain module (not a test file) so that `torch.multiprocessing`
can import them by name in the children. Each worker asserts on its own rank;
a failing assertion fails the spawn and therefore the test.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-5


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run fn(rank, world, *args) in `world` spawned processes joined in one gloo process group."""
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    mp.start_processes(
        _entry, args=(fn, world, free_port(), args), nprocs=world, join=True, start_method="spawn"
    )


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _gather(local: torch.Tensor, layout: Any) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return layout.unshard(parts)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- ring attention


RING_CASES: dict[str, list[int]] = {
    "causal_single": [48],
    "packed_unequal": [7, 20, 1, 13, 3],
    "not_divisible": [37],
}


def ring_attention_cases(rank: int, world: int) -> None:
    """Outputs and dq/dk/dv of the ring equal full attention (fp32, 1e-5) for every case."""
    from agentrl.trainers.ring_attention import ZigzagLayout, reference_attention, ring_attention

    for name, lens in RING_CASES.items():
        torch.manual_seed(1234)
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        q = torch.randn(total, 4, 16, requires_grad=True)
        k = torch.randn(total, 2, 16, requires_grad=True)
        v = torch.randn(total, 2, 16, requires_grad=True)
        dout = torch.randn(total, 4, 16)
        ref = reference_attention(q, k, v, cu)
        ref_grads = torch.autograd.grad(ref, (q, k, v), dout)

        layout = ZigzagLayout.from_cu_seqlens(cu, world)
        assert total % (2 * world) or name != "not_divisible", "case must not be divisible by 2P"
        local = [layout.shard(t.detach(), rank).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, layout.local_cu_seqlens(), group=dist.group.WORLD, q_chunk=8)
        out.backward(layout.shard(dout, rank))

        diffs = {"out": _max_diff(_gather(out.detach(), layout), ref.detach())}
        for label, t, g in zip(("dq", "dk", "dv"), local, ref_grads, strict=True):
            assert t.grad is not None
            diffs[label] = _max_diff(_gather(t.grad, layout), g)
        bad = {k_: d for k_, d in diffs.items() if not d <= TOL}
        assert not bad, f"P={world} case {name}: max |ring - full| above {TOL}: {bad}"


# --------------------------------------------------------------------------- HF training step


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def packed_batch(seed: int, lens: list[int]) -> dict[str, torch.Tensor]:
    """A packed RL-style batch: ids, per-sequence positions, cu_seqlens, next-token labels, mask, advantages."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    ids = torch.randint(0, 128, (total,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in lens])
    labels = torch.full((total,), -100)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        labels[a : b - 1] = ids[a + 1 : b]
    mask = (labels >= 0) & (torch.rand(total, generator=g) < 0.7)
    seq_adv = torch.randn(len(lens), generator=g)
    adv = torch.repeat_interleave(seq_adv, torch.tensor(lens))
    return {"ids": ids, "pos": pos, "cu": cu, "labels": labels, "mask": mask.float(), "adv": adv}


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def seq_mean_loss(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Policy-gradient loss with per-sequence token means, then a mean over sequences."""
    per_tok = -batch["adv"] * logprobs * batch["mask"]
    seq = torch.repeat_interleave(torch.arange(len(batch["cu"]) - 1), batch["cu"].diff())
    num = torch.zeros(len(batch["cu"]) - 1).index_add(0, seq, per_tok)
    den = torch.zeros(len(batch["cu"]) - 1).index_add(0, seq, batch["mask"]).clamp(min=1)
    return (num / den).mean()


def reference_step(model: Any, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """P=1 with transformers' own sdpa attention (packing from position_ids): loss and gradients."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    logits = ref(input_ids=batch["ids"][None], position_ids=batch["pos"][None], use_cache=False).logits[0]
    loss = seq_mean_loss(token_logprobs(logits, batch["labels"]), batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def sp_step(model: Any, batch: dict[str, torch.Tensor], groups: Any, bucket_bytes: int = 64 * 2**20) -> float:
    """One SP training step through the public API (loss on every rank; grads reduced)."""
    from agentrl.trainers.sequence_parallel import gather_logprobs, reduce_gradients, shard_packed_batch

    shard = shard_packed_batch(batch["ids"], batch["pos"], batch["cu"], groups, q_chunk=16)
    logits = model(**shard.model_inputs()).logits
    local_lp = token_logprobs(logits, shard.shard(batch["labels"], fill=-100))
    loss = seq_mean_loss(gather_logprobs(local_lp, shard), batch)
    loss.backward()
    reduce_gradients(model.parameters(), groups, bucket_bytes=bucket_bytes)
    return loss.item()


def _check_grads(model: Any, ref_grads: dict[str, torch.Tensor], what: str) -> None:
    worst = max(_max_diff(p.grad, ref_grads[n]) for n, p in model.named_parameters())
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert worst <= TOL * max(1.0, scale), (
        f"{what}: max |grad - reference grad| = {worst} (grad scale {scale})"
    )


TRAIN_LENS = [[29, 11, 40, 7], [17, 33, 5, 21]]


def llama_sp_step(rank: int, world: int) -> None:
    """SP = world (one DP replica): loss, gradients and the SGD-updated weights equal P=1."""
    from agentrl.trainers.sequence_parallel import patch_model_for_sp, sp_setup

    groups = sp_setup(world)
    assert groups.sp_size == world and groups.dp_size == 1 and groups.sp_rank == rank
    model = tiny_llama()
    batch = packed_batch(0, TRAIN_LENS[0])
    ref_loss, ref_grads = reference_step(model, batch)
    ref_model = copy.deepcopy(model)
    for n, p in ref_model.named_parameters():
        p.grad = ref_grads[n].clone()

    patch_model_for_sp(model)
    loss = sp_step(model, batch, groups)
    assert abs(loss - ref_loss) <= TOL, f"P={world} loss {loss} != P=1 loss {ref_loss}"
    _check_grads(model, ref_grads, f"P={world}")

    # Plain SGD: the update is linear in the gradient (Adam's first step, g/|g|, would amplify
    # float noise on near-zero gradients and compare nothing about SP).
    for m in (model, ref_model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    worst = max(_max_diff(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
    assert worst <= TOL, f"P={world}: weights after the optimizer step differ by {worst}"


def llama_dp_sp_step(rank: int, world: int, sp_size: int) -> None:
    """DP x SP: each DP replica trains its own batch; reduced grads equal the mean of P=1 grads."""
    from agentrl.trainers.sequence_parallel import patch_model_for_sp, sp_setup

    groups = sp_setup(sp_size)
    dp = world // sp_size
    assert (groups.dp_size, groups.dp_rank, groups.sp_rank) == (dp, rank // sp_size, rank % sp_size)
    model = tiny_llama()
    batches = [packed_batch(100 + r, TRAIN_LENS[r % len(TRAIN_LENS)]) for r in range(dp)]
    refs = [reference_step(model, b) for b in batches]
    mean_grads = {n: sum(r[1][n] for r in refs) / dp for n in refs[0][1]}

    patch_model_for_sp(model)
    loss = sp_step(model, batches[groups.dp_rank], groups, bucket_bytes=4096)  # many small buckets
    ref_loss = refs[groups.dp_rank][0]
    assert abs(loss - ref_loss) <= TOL, f"rank {rank}: loss {loss} != its replica's P=1 loss {ref_loss}"
    _check_grads(model, mean_grads, f"DP={dp} x SP={sp_size}")


def flash_installed() -> bool:
    from agentrl.trainers.ring_attention import flash_backend_available

    return flash_backend_available()

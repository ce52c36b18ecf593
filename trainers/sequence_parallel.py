"""Sequence parallelism (SP) for Hugging Face causal LMs, on top of ring attention.

The trainer's side of the contract, in order (every rank of an SP group runs the
same code on the SAME packed batch; DP replicas get different batches)::

    groups = sp_setup(config.sequence_parallel_size)         # after init_process_group
    patch_model_for_sp(model)                                 # once, before training
    shard = shard_packed_batch(input_ids, position_ids, cu_seqlens, groups)
    logits = model(**shard.model_inputs()).logits             # (1, local_len, V)
    local_lp = logprobs_of(logits, shard.shard(labels))       # labels built on the GLOBAL batch
    logprobs = gather_logprobs(local_lp, shard)               # (T,) in packed order, differentiable
    loss = loss_fn(logprobs, ...)                             # unchanged P=1 loss code
    loss.backward()
    reduce_gradients(model.parameters(), groups)              # SUM over SP, MEAN over DP

Why this gives exactly the P=1 loss and gradients: every SP rank gathers the
same full per-token tensor and computes the same loss, so any aggregation
(token mean, per-sequence means, ...) is identical to P=1. `gather_logprobs`
sends back to each rank only the gradient of its own tokens, ring attention
returns dK/dV to the ranks that own those tokens, so each rank's parameter
gradient is its tokens' share and the SP sum is the full gradient.

Layout: each sequence is zigzag-sharded (see `ZigzagLayout`) and padded at its
end to a multiple of 2P; pads never reach a real token (causal) and are dropped
by `gather`. Positions stay global (within-sequence), so RoPE is unchanged.
Process groups: SP groups are blocks of consecutive ranks, DP groups stride
across them (world = DP x SP).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from agentrl.trainers.ring_attention import Backend, ZigzagLayout, ring_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CONTEXT_KWARG",
    "RingContext",
    "SPGroups",
    "SPShard",
    "gather_logprobs",
    "patch_model_for_sp",
    "reduce_gradients",
    "shard_packed_batch",
    "sp_attention_forward",
    "sp_setup",
]

ATTN_IMPLEMENTATION = "agentrl_ring"
"""Name under which the ring attention function is registered in transformers' AttentionInterface."""

CONTEXT_KWARG = "ring_context"
"""Model-forward keyword that carries the `RingContext` down to every attention layer."""


# --------------------------------------------------------------------------- process groups


@dataclass(frozen=True)
class SPGroups:
    """This rank's place in a DP x SP grid. Groups are None when their size is 1."""

    sp_size: int = 1
    sp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    sp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None

    @property
    def world_size(self) -> int:
        return self.sp_size * self.dp_size


def sp_setup(sequence_parallel_size: int) -> SPGroups:
    """Split the default process group into SP groups of consecutive ranks and strided DP groups.

    Ranks [k*P, (k+1)*P) form SP group k; ranks with the same SP rank form a DP group.
    Every rank must call this (collective: `new_group` for every group, in the same order).
    Without an initialised process group only `sequence_parallel_size=1` is allowed.
    """
    p = sequence_parallel_size
    if p < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {p}")
    if not dist.is_available() or not dist.is_initialized():
        if p == 1:
            return SPGroups()
        raise RuntimeError(
            f"sequence_parallel_size={p} needs torch.distributed initialised with a world size divisible by {p}"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % p:
        raise ValueError(
            f"world size {world} is not divisible by sequence_parallel_size={p} (world = DP x SP)"
        )
    dp = world // p
    sp_group = dp_group = None
    for k in range(dp):
        ranks = list(range(k * p, (k + 1) * p))
        group = dist.new_group(ranks) if p > 1 else None
        if rank in ranks:
            sp_group = group
    for j in range(p):
        ranks = list(range(j, world, p))
        group = dist.new_group(ranks) if dp > 1 else None
        if rank in ranks:
            dp_group = group
    return SPGroups(
        sp_size=p, sp_rank=rank % p, dp_size=dp, dp_rank=rank // p, sp_group=sp_group, dp_group=dp_group
    )


# --------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class RingContext:
    """What the attention layers need: the SP group and the local packing (passed as a forward kwarg)."""

    group: dist.ProcessGroup | None
    cu_seqlens: Tensor  # LOCAL cu_seqlens of this rank's shard
    backend: Backend = "auto"
    q_chunk: int = 1024


@dataclass(frozen=True)
class SPShard:
    """This rank's zigzag shard of one packed batch, plus the means to shard/gather per-token tensors."""

    layout: ZigzagLayout
    groups: SPGroups
    input_ids: Tensor  # (1, local_len)
    position_ids: Tensor  # (1, local_len), global within-sequence positions
    context: RingContext

    @property
    def num_tokens(self) -> int:
        """Real tokens of the whole packed batch (what `gather` returns along dim 0)."""
        return self.layout.total

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for the patched HF model's forward."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            CONTEXT_KWARG: self.context,
            "use_cache": False,
        }

    def shard(self, x: Tensor, fill: float | int = 0) -> Tensor:
        """This rank's part of a per-token tensor of the packed batch: (T, ...) or (1, T, ...) -> (1, L, ...)."""
        return self.layout.shard(_drop_batch(x, self.layout.total), self.groups.sp_rank, fill).unsqueeze(0)

    def gather(self, local: Tensor) -> Tensor:
        """All shards of a per-token tensor, in packed order without padding: (1, L, ...) or (L, ...) -> (T, ...).

        Differentiable: the backward keeps only this rank's tokens' gradient, which is right because
        every SP rank computes the same loss from the gathered tensor.
        """
        flat = _drop_batch(local, self.layout.local_len)
        if self.groups.sp_group is None:
            return flat
        out: Tensor = _GatherTokens.apply(  # type: ignore[no-untyped-call]
            flat, self.layout, self.groups.sp_rank, self.groups.sp_group
        )
        return out


def _drop_batch(x: Tensor, tokens: int) -> Tensor:
    """(tokens, ...) stays, (1, tokens, ...) loses its batch dim; anything else is an error."""
    if x.dim() >= 1 and x.shape[0] == tokens:
        return x
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == tokens:
        return x[0]
    raise ValueError(
        f"expected a per-token tensor of shape ({tokens}, ...) or (1, {tokens}, ...), got {tuple(x.shape)}"
    )


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: Tensor, layout: ZigzagLayout, rank: int, group: dist.ProcessGroup
    ) -> Tensor:
        ctx.layout, ctx.rank = layout, rank
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(layout.sp_size)]
        dist.all_gather(parts, local, group=group)
        return layout.unshard(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return ctx.layout.shard(grad, ctx.rank, 0), None, None, None


def shard_packed_batch(
    input_ids: Tensor,
    position_ids: Tensor,
    cu_seqlens: Tensor,
    groups: SPGroups,
    *,
    pad_token_id: int = 0,
    backend: Backend = "auto",
    q_chunk: int = 1024,
) -> SPShard:
    """Zigzag-shard one packed batch for this rank of its SP group.

    Args:
        input_ids, position_ids: (T,) or (1, T) packed batch; positions restart at 0 per sequence.
        cu_seqlens: (n+1,) sequence boundaries in the packed batch (0, ..., T).
        groups: from `sp_setup`. With sp_size 1 the shard is the whole batch (no padding).
        pad_token_id: token id written into the per-sequence padding (its outputs are dropped).
    """
    ids = input_ids.reshape(-1)
    pos = position_ids.reshape(-1)
    layout = ZigzagLayout.from_cu_seqlens(cu_seqlens, groups.sp_size)
    if ids.shape[0] != layout.total or pos.shape[0] != layout.total:
        raise ValueError(
            f"input_ids ({ids.shape[0]}) and position_ids ({pos.shape[0]}) must both hold "
            f"cu_seqlens[-1] = {layout.total} tokens"
        )
    rank = groups.sp_rank
    local_ids = layout.shard(ids, rank, pad_token_id)
    is_pad = layout.global_index(rank).to(ids.device) < 0
    local_pos = torch.where(is_pad, layout.positions(rank).to(pos), layout.shard(pos, rank))
    context = RingContext(
        group=groups.sp_group,
        cu_seqlens=layout.local_cu_seqlens(ids.device),
        backend=backend,
        q_chunk=q_chunk,
    )
    return SPShard(
        layout=layout,
        groups=groups,
        input_ids=local_ids.unsqueeze(0),
        position_ids=local_pos.unsqueeze(0),
        context=context,
    )


def gather_logprobs(local_logprobs: Tensor, shard: SPShard) -> Tensor:
    """Per-token log-probs (or any per-token tensor) of the whole packed batch; see `SPShard.gather`."""
    return shard.gather(local_logprobs)


@torch.no_grad()
def reduce_gradients(
    params: Iterable[torch.nn.Parameter], groups: SPGroups, *, bucket_bytes: int = 64 * 2**20
) -> None:
    """Sum gradients over the SP group (each rank holds its tokens' share), then average over DP.

    Gradients are flattened into buckets of about `bucket_bytes` (one all-reduce per bucket and
    group) so the extra memory stays bounded for large models.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or groups.world_size == 1:
        return
    bucket: list[Tensor] = []
    size = 0
    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes:
            _reduce_bucket(bucket, groups)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, groups)


def _reduce_bucket(grads: list[Tensor], groups: SPGroups) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    if groups.sp_group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.sp_group)
    if groups.dp_group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups.dp_group)
        flat /= groups.dp_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# --------------------------------------------------------------------------- HF integration


def sp_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: query (B, H, L, D), key/value (B, Hkv, L, D) -> (B, L, H, D).

    With a `ring_context` kwarg it runs ring attention over the SP group (B must be 1: a packed
    batch). Without one it runs plain causal attention per row, splitting packed rows where
    `position_ids` restart, so a patched model still works for ordinary forwards.
    """
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported by {ATTN_IMPLEMENTATION}; set it to 0"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION} takes no 4D attention mask: express packing with cu_seqlens/position_ids"
        )
    context: RingContext | None = kwargs.get(CONTEXT_KWARG)
    if context is not None:
        if query.shape[0] != 1:
            raise ValueError(f"sequence-parallel forward expects one packed row, got batch {query.shape[0]}")
        out = ring_attention(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            context.cu_seqlens,
            group=context.group,
            scale=scaling,
            backend=context.backend,
            q_chunk=context.q_chunk,
        )
        return out.unsqueeze(0), None
    position_ids: Tensor | None = kwargs.get("position_ids")
    rows = []
    for b in range(query.shape[0]):
        cu = _cu_seqlens_from_positions(position_ids, b, query.shape[2], query.device)
        rows.append(
            ring_attention(
                query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1), cu, scale=scaling
            )
        )
    return torch.stack(rows), None


def _cu_seqlens_from_positions(
    position_ids: Tensor | None, row: int, length: int, device: torch.device
) -> Tensor:
    if position_ids is None:
        return torch.tensor([0, length], device=device)
    pos = position_ids[min(row, position_ids.shape[0] - 1)].reshape(-1)
    starts = torch.nonzero(torch.diff(pos) != 1).reshape(-1) + 1  # a sequence starts where positions jump
    edges = [torch.zeros(1, dtype=starts.dtype, device=starts.device), starts]
    return torch.cat([*edges, torch.tensor([length], device=starts.device)]).to(device)


def patch_model_for_sp(model: Any) -> str:
    """Route every attention layer of an HF model through `sp_attention_forward`.

    Registers the function in transformers' `AttentionInterface` under "agentrl_ring" and sets
    the model's attention implementation to it (no model code is forked). Returns the previous
    implementation name, e.g. to restore it with `model.set_attn_implementation(previous)`.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, sp_attention_forward)
    previous = str(model.config._attn_implementation)
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (AttributeError, ValueError):  # older transformers, or a model that refuses the setter
        model.config._attn_implementation = ATTN_IMPLEMENTATION
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"could not switch {type(model).__name__} to {ATTN_IMPLEMENTATION!r}")
    return previous

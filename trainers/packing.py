"""Padding-free packing: several sequences in one row, micro-batches by token budget.

A packed row is `[1, T]` input ids with position ids that restart at 0 for each
sequence, plus `cu_seqlens` (cumulative sequence starts, flash-attention style).
Attention cannot cross sequence boundaries: with `attention_mask=None`,
transformers derives a block-diagonal causal mask from the restarting position
ids (sdpa/eager) or varlen boundaries (flash-attention); the ring-attention
path consumes `cu_seqlens` directly. Optional padding to a multiple (for
sequence-parallel splits) is one extra segment of its own, loss mask 0.

Per-token float/int fields (loss mask, advantages, behaviour logprobs, …)
travel alongside, packed the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class PackedBatch:
    """One micro-batch: a single packed row and its per-token fields.

    `seq_ids[t]` is the index (within this micro-batch) of the sequence token t
    belongs to; the padding segment, if any, has index `len(sample_indices)`.
    `sample_indices[i]` is the caller's index of packed sequence i.
    """

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    cu_seqlens: torch.Tensor  # [num_segments + 1] int32 (padding segment included)
    seq_ids: torch.Tensor  # [T] long
    sample_indices: list[int]
    fields: dict[str, torch.Tensor]  # each [T]
    num_pad: int
    # shared-prefix families: (first sequence index, member count, prefix length); () = none
    families: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def seq_starts(self) -> torch.Tensor:
        """Index of the first token of every real sequence."""
        return self.cu_seqlens[: len(self.sample_indices)].long()

    def to(self, device: str | torch.device) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            seq_ids=self.seq_ids.to(device),
            sample_indices=self.sample_indices,
            fields={k: v.to(device) for k, v in self.fields.items()},
            num_pad=self.num_pad,
            families=self.families,
        )

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Cut a per-token tensor [T] back into one tensor per real sequence."""
        bounds = self.cu_seqlens.tolist()
        return [values[bounds[i] : bounds[i + 1]] for i in range(len(self.sample_indices))]


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence indices into bins of <= token_budget tokens.

    A sequence longer than the budget gets a bin of its own (it must be trained
    on, not dropped). Bins keep indices in descending-length order; the result is
    deterministic for equal inputs.
    """
    if token_budget < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {token_budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(max(token_budget - n, 0))
    return bins


def pack(
    input_ids: Sequence[Sequence[int]],
    fields: Mapping[str, Sequence[torch.Tensor]],
    indices: Sequence[int],
    *,
    pad_to_multiple_of: int = 1,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack sequences `indices` (into `input_ids` / each field list) into one row."""
    if not indices:
        raise ValueError("pack() needs at least one sequence")
    ids: list[int] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    cu = [0]
    for k, i in enumerate(indices):
        seq = input_ids[i]
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty; nothing to train on")
        ids.extend(seq)
        positions.extend(range(len(seq)))
        seq_ids.extend([k] * len(seq))
        cu.append(len(ids))
    total = len(ids)
    num_pad = (-total) % pad_to_multiple_of
    if num_pad:
        ids.extend([pad_id] * num_pad)
        positions.extend(range(num_pad))
        seq_ids.extend([len(indices)] * num_pad)
        cu.append(total + num_pad)
    packed_fields: dict[str, torch.Tensor] = {}
    for name, per_seq in fields.items():
        parts = [per_seq[i] for i in indices]
        for i, p in zip(indices, parts, strict=True):
            if p.shape[0] != len(input_ids[i]):
                raise ValueError(
                    f"field {name!r} of sequence {i} has {p.shape[0]} entries for {len(input_ids[i])} tokens"
                )
        if num_pad:
            parts.append(torch.zeros(num_pad, dtype=parts[0].dtype))
        packed_fields[name] = torch.cat(parts)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        seq_ids=torch.tensor(seq_ids, dtype=torch.long),
        sample_indices=list(indices),
        fields=packed_fields,
        num_pad=num_pad,
    )


def pack_all(
    input_ids: Sequence[Sequence[int]],
    fields: Mapping[str, Sequence[torch.Tensor]],
    token_budget: int,
    *,
    pad_to_multiple_of: int = 1,
    pad_id: int = 0,
    subset: Sequence[int] | None = None,
) -> list[PackedBatch]:
    """Plan and pack micro-batches for `subset` (default: all sequences)."""
    chosen = list(range(len(input_ids))) if subset is None else list(subset)
    plan = plan_micro_batches([len(input_ids[i]) for i in chosen], token_budget)
    return [
        pack(input_ids, fields, [chosen[j] for j in b], pad_to_multiple_of=pad_to_multiple_of, pad_id=pad_id)
        for b in plan
    ]


def padding_stats(batches: Sequence[PackedBatch], lengths: Sequence[int]) -> dict[str, float]:
    """Padding fraction of the packed micro-batches vs. a padded [n, max_len] layout of the same bins."""
    return padding_metrics(padding_counts(batches, lengths))


def padding_counts(batches: Sequence[PackedBatch], lengths: Sequence[int]) -> list[float]:
    """What `padding_metrics` reads, as sums (so ranks can add theirs up first).

    [pad tokens, packed tokens, tokens of the padded layout, micro-batches, real tokens]
    """
    return [
        float(sum(b.num_pad for b in batches)),
        float(sum(b.num_tokens for b in batches)),
        float(sum(len(b.sample_indices) * max(lengths[i] for i in b.sample_indices) for b in batches)),
        float(len(batches)),
        float(sum(lengths[i] for b in batches for i in b.sample_indices)),
    ]


def padding_metrics(counts: Sequence[float]) -> dict[str, float]:
    """`pack/*` metrics from `padding_counts` (of one rank, or summed over ranks)."""
    pad, packed, padded, micro_batches, real = counts
    return {
        "pack/padding_fraction": pad / packed if packed else 0.0,
        "pack/padded_layout_padding_fraction": 1.0 - real / padded if padded else 0.0,
        "pack/micro_batches": micro_batches,
        "pack/tokens": real,
    }


# ----------------------------------------------------------------------------- attention
RECORD_PREFIX_KV = "agentrl_record_prefix_kv"
"""Model-forward kwarg read by `packed_sdpa_attention`: a `PrefixKV` whose `layers` it fills with
each layer's (keys, values) of the prefix being run (`shared_prefix.shared_prefix_hidden`)."""

READ_PREFIX_KV = "agentrl_read_prefix_kv"
"""Model-forward kwarg read by `packed_sdpa_attention`: a `PrefixKV` every suffix row attends to."""


class PrefixKV:
    """A shared prefix's (keys, values) per layer index, read by `readers` suffix rows.

    Handed to the attention by keyword rather than through an HF cache: nothing is
    appended to it, so a checkpointed layer recomputed in backward reads the same
    tensors (HF's checkpointed layers drop caches), and the suffix pass leaves it as it was.
    A plain class, neither a dict nor a dataclass, also for recording: wrappers that map
    over a layer's arguments (FSDP's per-layer pre-forward) rebuild dicts and dataclasses,
    and the layer would record into a copy.
    """

    __slots__ = ("layers", "readers")

    def __init__(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]], readers: int) -> None:
        self.layers = layers
        self.readers = readers


PACKED_ATTENTION = "agentrl_packed_sdpa"
"""transformers attention-implementation name of `packed_sdpa_attention`."""


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Varlen causal attention for a packed row: one causal SDPA call per sequence.

    A dense block-diagonal mask costs O(T^2) for a row of T tokens whatever the
    sequences; this costs O(sum len_i^2) and builds no mask (what flash-attention's
    varlen kernel does on GPU, available on every device). Sequence boundaries come
    from the restarting `position_ids`. Anything that is not a single packed row
    without a mask (generation with a cache, padded batches) goes to HF's sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shared: PrefixKV | None = kwargs.get(READ_PREFIX_KV)
    if shared is not None:  # suffixes [B, L] reading a shared prefix's keys
        prefix_k, prefix_v = shared.layers[module.layer_idx]  # type: ignore[index]
        key = torch.cat([prefix_k.expand(shared.readers, -1, -1, -1), key], dim=2)
        value = torch.cat([prefix_v.expand(shared.readers, -1, -1, -1), value], dim=2)
        return _prefix_suffix_attention(module, query, key, value, prefix_k.shape[2], dropout, scaling), None
    record: PrefixKV | None = kwargs.get(RECORD_PREFIX_KV)
    if record is not None:  # a prefix pass: its keys are what the suffixes will read
        record.layers[module.layer_idx] = (key, value)  # type: ignore[index]
    position_ids = kwargs.get("position_ids")
    t = query.shape[2]
    if query.shape[0] != 1 or position_ids is None or attention_mask is not None or key.shape[2] != t:
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    bounds = [*starts, t]
    gqa = key.shape[1] != query.shape[1]
    p = dropout if module.training else 0.0
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=p,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in itertools.pairwise(bounds)
        if e > s
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _prefix_suffix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_len: int,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Suffix query i sees every prefix key and suffix keys 0..i (right padding is never seen).

    Grouped-query keys are not repeated per head (`enable_gqa`): autograd then keeps the
    kv heads' keys, not a copy per query head (366 MB of the default example's peak).
    """
    q_len = query.shape[2]
    mask = torch.ones(q_len, key.shape[2], dtype=torch.bool, device=query.device).tril(diagonal=prefix_len)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous()


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def use_packed_attention(model: Any) -> None:
    """Switch an HF model (or peft wrapper) to `packed_sdpa_attention` (registered once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _no_mask)
    target = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    try:
        target.set_attn_implementation(PACKED_ATTENTION)
    except (AttributeError, ValueError):
        target.config._attn_implementation = PACKED_ATTENTION

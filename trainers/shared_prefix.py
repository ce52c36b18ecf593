"""Shared-prompt forward for GRPO groups: the prompt runs once per group, not once per sample.

All samples of a group start with the same prompt (system prompt, few-shot
demonstrations, the task), which is most of their tokens. Here the longest
loss-free prefix common to a group ("family") is run through the decoder once;
its keys and values are broadcast to the members, whose suffixes run as one padded
batch attending to them (handed to the attention by keyword, not through an HF
cache, so the layers may be checkpointed: `trainer.gradient_checkpointing`).
Gradients flow back through the shared keys and values into the prefix pass, so logprobs and gradients equal the per-sample computation exactly (up to float
rounding); only the redundant prefix work is gone.

Families live inside ordinary `PackedBatch`es (members stored contiguously, the
usual per-token fields), so losses, masks and token stats need no change; only
the hidden states are produced differently (`shared_prefix_hidden`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agentrl.trainers.packing import READ_PREFIX_KV, RECORD_PREFIX_KV, PrefixKV, plan_micro_batches


@dataclass(frozen=True, slots=True)
class Family:
    """Samples (caller's indices) that start with the same `prefix_len` loss-free tokens."""

    members: tuple[int, ...]
    prefix_len: int


def common_prefix_len(seqs: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]]) -> int:
    """Longest prefix shared by all `seqs` that holds no loss token and leaves each a suffix token."""
    limit = min(len(s) for s in seqs) - 1
    for mask in loss_masks:
        first_loss = next((t for t, m in enumerate(mask) if m), len(mask))
        limit = min(limit, first_loss)
    first = seqs[0]
    n = 0
    while n < limit and all(s[n] == first[n] for s in seqs[1:]):
        n += 1
    return max(n, 0)


def find_families(
    groups: Sequence[Sequence[int]],
    input_ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    *,
    min_prefix: int = 16,
) -> list[Family]:
    """One family per group of sample indices; a group whose shared prefix is short splits into singles."""
    out: list[Family] = []
    for members in groups:
        if not members:
            continue
        if min(len(input_ids[i]) for i in members) < 2:
            raise ValueError("shared prefix: every sequence needs at least 2 tokens")
        p = common_prefix_len([input_ids[i] for i in members], [loss_masks[i] for i in members])
        if len(members) > 1 and p >= min_prefix:
            out.append(Family(tuple(members), p))
        else:  # alone: split at its own first loss token, which costs the same as one full pass
            for i in members:
                out.append(Family((i,), max(1, common_prefix_len([input_ids[i]], [loss_masks[i]]))))
    return out


def family_cost(family: Family, lengths: Sequence[int]) -> int:
    """Tokens the decoder processes for a family: the prefix once, plus the padded suffix batch."""
    longest = max(lengths[i] for i in family.members) - family.prefix_len
    return family.prefix_len + len(family.members) * longest


def layout_cost(cu_seqlens: Sequence[int], layout: Sequence[tuple[int, int, int]]) -> int:
    """`family_cost` summed over a packed row's families (padding of the suffix batch included)."""
    lengths = [b - a for a, b in itertools.pairwise(cu_seqlens)]
    return sum(family_cost(Family(tuple(range(first, first + count)), p), lengths) for first, count, p in layout)


def split_family(family: Family, lengths: Sequence[int], token_budget: int) -> list[Family]:
    """A family over the budget as several with the same prefix, each within it where one member fits.

    Members go longest suffix first, so each part pads to lengths close to its own.
    Each part runs the prefix again: more compute for a smaller peak (activations
    scale with a micro-batch's tokens), only when a group exceeds `micro_batch_tokens`.
    """
    if len(family.members) == 1 or family_cost(family, lengths) <= token_budget:
        return [family]
    parts: list[Family] = []
    for m in sorted(family.members, key=lambda i: -lengths[i]):
        grown = Family((*parts[-1].members, m), family.prefix_len) if parts else None
        if grown is not None and family_cost(grown, lengths) <= token_budget:
            parts[-1] = grown
        else:
            parts.append(Family((m,), family.prefix_len))
    return parts


def plan_families(families: Sequence[Family], lengths: Sequence[int], token_budget: int) -> list[list[Family]]:
    """Families into micro-batches of <= token_budget cost (first-fit decreasing); a family over
    the budget is split first (`split_family`)."""
    parts = [part for f in families for part in split_family(f, lengths, token_budget)]
    bins = plan_micro_batches([family_cost(f, lengths) for f in parts], token_budget)
    return [[parts[i] for i in b] for b in bins]


def shared_prefix_hidden(
    decoder: nn.Module,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    layout: Sequence[tuple[int, int, int]],
) -> torch.Tensor:
    """Last hidden states [1, T, H] of a packed row whose families are given by `layout`.

    `layout` holds (first sequence index in the row, member count, prefix length) per
    family. Rows a loss token can read (the last prefix position of each member and its
    suffix) are filled; the other prefix rows stay zero (no loss token reads them).
    """
    ids = input_ids[0]
    bounds = cu_seqlens.tolist()
    n_layers = len(list(decoder.get_submodule("layers").children()))
    dest: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    for first, count, p in layout:
        starts = bounds[first : first + count]
        ends = bounds[first + 1 : first + count + 1]
        prefix = ids[starts[0] : starts[0] + p]
        recorded = PrefixKV({}, readers=count)
        pre = decoder(
            input_ids=prefix[None],
            position_ids=torch.arange(p, device=ids.device)[None],
            use_cache=False,
            **{RECORD_PREFIX_KV: recorded},
        )
        # a copy: a checkpointed prefix layer recomputed in backward records into `recorded` again
        shared = PrefixKV(dict(recorded.layers), readers=count)
        if len(shared.layers) != n_layers:
            raise RuntimeError(f"shared prefix: {len(shared.layers)} of {n_layers} layers recorded their keys "
                               "(the attention must be trainer.attention='packed_sdpa')")  # fmt: skip
        suffix_lens = [e - s - p for s, e in zip(starts, ends, strict=True)]
        width = max(suffix_lens)
        suffix = ids.new_zeros(count, width)  # right-padded; causality keeps real tokens off the padding
        for k, (s, n) in enumerate(zip(starts, suffix_lens, strict=True)):
            suffix[k, :n] = ids[s + p : s + p + n]
        positions = torch.arange(p, p + width, device=ids.device).expand(count, -1)
        out = decoder(input_ids=suffix, position_ids=positions, use_cache=False, **{READ_PREFIX_KV: shared})
        # member k's rows: the prefix's last position, then its real suffix positions
        last = pre.last_hidden_state[:, p - 1 : p].expand(count, -1, -1)
        both = torch.cat([last, out.last_hidden_state], dim=1).reshape(count * (width + 1), -1)
        src = [torch.arange(k * (width + 1), k * (width + 1) + n + 1) for k, n in enumerate(suffix_lens)]
        rows.append(both.index_select(0, torch.cat(src).to(ids.device)))
        dest.extend(torch.arange(s + p - 1, s + p + n, device=ids.device) for s, n in zip(starts, suffix_lens, strict=True))
    hidden_size = rows[0].shape[-1]
    full = rows[0].new_zeros(ids.shape[0], hidden_size)
    full = full.index_copy(0, torch.cat(dest), torch.cat(rows))
    return full[None]

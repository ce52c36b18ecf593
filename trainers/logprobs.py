"""Token log-probabilities and entropies in chunks, so logits never exist whole.

A naive `log_softmax(lm_head(h))` over T tokens materialises T x V logits (plus
their softmax and gradients): 8k tokens x 49k vocabulary is 1.6 GB per fp32
copy. Here the decoder runs once to hidden states [T, H]; the lm_head, the
log-softmax and the entropy then run over `chunk` rows at a time inside
`torch.utils.checkpoint`, so the backward pass recomputes each chunk's logits
instead of keeping them. Peak logits memory is O(chunk x V), independent of T.

Alignment: `out[t]` is log p(ids[t] | ids[<t]) within t's sequence; the first
token of every packed sequence has no prediction and gets 0 (it is always
prompt, loss mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from agentrl.trainers.shared_prefix import shared_prefix_hidden


def base_causal_lm(model: nn.Module) -> Any:
    """The HF causal LM inside a peft wrapper (LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def token_logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference (naive) log p(target) from full logits [..., V]."""
    return (
        torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    )


def _chunk_stats(
    hidden: torch.Tensor, targets: torch.Tensor, lm_head: nn.Module, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    # the head runs in fp32 even under autocast: logprob precision matters for the
    # train/inference mismatch, and on CPU a bf16 [chunk x 49k] matmul is ~4x slower
    with torch.autocast(hidden.device.type, enabled=False):
        h = hidden if hidden.dtype in (torch.float32, torch.float64) else hidden.float()
        logits = lm_head(h)
        if logits.dtype != torch.float64:
            logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: nn.Module,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets[i] | hidden[i]) and (optionally) the entropy, for hidden [N, H], targets [N].

    Chunks run under non-reentrant checkpointing when gradients are needed, so
    backward recomputes one chunk's logits at a time.
    """
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        t = targets[start : start + chunk_tokens]
        if grad:
            lp, ent = checkpoint(_chunk_stats, h, t, lm_head, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(h, t, lm_head, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    entropy = (
        (torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32)) if with_entropy else None
    )
    return logp, entropy


def hidden_states(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Last hidden states [1, T, H] of a (possibly LoRA-wrapped) HF causal LM for a packed row."""
    lm = base_causal_lm(model)
    decoder = lm.get_decoder()
    out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    return out.last_hidden_state  # type: ignore[no-any-return]


def packed_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    hidden: torch.Tensor | None = None,
    needed: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, Sequence[tuple[int, int, int]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and entropy) [T] for one packed row [1, T], aligned with the ids.

    `out[t]` = log p(ids[t] | earlier ids); positions where `position_ids == 0`
    (sequence starts) are 0, since the previous row token belongs to another sequence.
    With `needed` ([T] bool, e.g. the loss mask) only those positions are scored and
    the rest are 0: prompts and tool outputs are most tokens of an agent trajectory,
    and the lm_head + vocabulary softmax over them is a quarter of the step's compute.
    `shared` = (cu_seqlens, families) runs each family's common prefix once
    (`shared_prefix.shared_prefix_hidden`); it needs `needed` inside the suffixes.
    """
    if hidden is None and shared is not None:
        hidden = shared_prefix_hidden(base_causal_lm(model).get_decoder(), input_ids, *shared)
    if hidden is None:
        hidden = hidden_states(model, input_ids, position_ids)
    h = hidden[0, :-1]
    targets = input_ids[0, 1:]
    idx = None
    if needed is not None:
        idx = needed.reshape(-1)[1:].nonzero().flatten()
        if idx.numel() == 0:  # keep the lm_head in the graph (DDP expects every rank to use it)
            idx = idx.new_zeros(1)
        h, targets = h.index_select(0, idx), targets.index_select(0, idx)
    lm_head = base_causal_lm(model).get_output_embeddings()
    logp, entropy = chunked_logprobs(
        h, targets, lm_head, chunk_tokens=chunk_tokens, temperature=temperature, with_entropy=with_entropy
    )
    if idx is not None:
        rows = input_ids.shape[1] - 1
        logp = logp.new_zeros(rows).index_copy(0, idx, logp)
        if entropy is not None:
            entropy = entropy.new_zeros(rows).index_copy(0, idx, entropy)
    starts = position_ids[0] == 0
    zero = logp.new_zeros(1)
    logp = torch.cat([zero, logp]).masked_fill(starts, 0.0)
    if entropy is not None:
        entropy = torch.cat([zero, entropy]).masked_fill(starts, 0.0)
    return logp, entropy


class PackedLogprobs(nn.Module):
    """`packed_logprobs` as a module, so DistributedDataParallel can wrap the forward."""

    def __init__(self, model: nn.Module, *, chunk_tokens: int, temperature: float) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        with_entropy: bool = False,
        needed: torch.Tensor | None = None,
        shared: tuple[torch.Tensor, Sequence[tuple[int, int, int]]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return packed_logprobs(
            self.model,
            input_ids,
            position_ids,
            chunk_tokens=self.chunk_tokens,
            temperature=self.temperature,
            with_entropy=with_entropy,
            needed=needed,
            shared=shared,
        )


class SequenceParallelLogprobs(nn.Module):
    """`sequence_parallel_logprobs` as a module: the root FSDP unit under sharded SP (its forward gathers
    the embeddings, final norm and lm_head that the decoder blocks' own units do not hold)."""

    def __init__(self, model: nn.Module, groups: Any, *, pad_token_id: int, chunk_tokens: int, temperature: float) -> None:
        super().__init__()
        self.model = model
        self.groups = groups
        self.pad_token_id = pad_token_id
        self.chunk_tokens = chunk_tokens
        self.temperature = temperature

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return sequence_parallel_logprobs(
            self.model, input_ids, position_ids, cu_seqlens, self.groups, pad_token_id=self.pad_token_id,
            chunk_tokens=self.chunk_tokens, temperature=self.temperature, with_entropy=with_entropy,
        )  # fmt: skip


def sequence_parallel_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    groups: Any,
    *,
    pad_token_id: int = 0,
    chunk_tokens: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`packed_logprobs` for a model patched for ring-attention sequence parallelism.

    Every rank of the SP group passes the same packed row; each runs the decoder on
    its zigzag shard (agentrl.trainers.sequence_parallel), computes chunked logprobs
    of the *global* next-token labels on its tokens, and the shards are gathered
    (differentiably) into the full [T] tensor, aligned exactly like `packed_logprobs`.
    """
    from agentrl.trainers.sequence_parallel import shard_packed_batch

    shard = shard_packed_batch(input_ids, position_ids, cu_seqlens, groups, pad_token_id=pad_token_id)
    lm = base_causal_lm(model)
    hidden = lm.get_decoder()(**shard.model_inputs()).last_hidden_state[0]
    ids = input_ids.reshape(-1)
    labels = torch.cat([ids[1:], ids.new_zeros(1)])  # label of token t is ids[t+1] (global)
    local_labels = shard.shard(labels)[0]
    logp, entropy = chunked_logprobs(
        hidden,
        local_labels,
        lm.get_output_embeddings(),
        chunk_tokens=chunk_tokens,
        temperature=temperature,
        with_entropy=with_entropy,
    )
    starts = position_ids.reshape(-1) == 0
    zero = logp.new_zeros(1)
    full = torch.cat([zero, shard.gather(logp)[:-1]]).masked_fill(starts, 0.0)
    ent = None
    if entropy is not None:
        ent = torch.cat([zero, shard.gather(entropy)[:-1]]).masked_fill(starts, 0.0)
    return full, ent

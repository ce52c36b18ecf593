"""The PPO critic: an HF decoder backbone plus a scalar value head, with its own optimizer.

`values[t]` estimates the return from the state *before* token t is sampled
(the head reads hidden state t-1), the same alignment as the policy's logprobs.
Trained with the clipped value loss, token-mean over the batch's loss tokens.
Under `data_parallel: fsdp` the value model is sharded like the policy (one
FSDP unit per transformer block), and its checkpoint state is gathered whole.
Under `data_parallel: deepspeed` it has a DeepSpeed engine of its own (the
policy's ZeRO stage and offload), whose partitions each rank checkpoints.
Under sequence parallelism each rank runs the backbone on its zigzag shard
of the packed row (ring attention, like the policy) and the values are
gathered, so every SP rank sees the whole row's values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agentrl.trainers.config import CriticConfig, DeepSpeedConfig
from agentrl.trainers.distributed import (
    World,
    full_tensor,
    fully_shard,
    load_whole_model_state,
    load_whole_optimizer_state,
    maybe_no_sync,
    whole_model_state,
    whole_optimizer_state,
    wrap,
)
from agentrl.trainers.losses import value_loss
from agentrl.trainers.packing import PackedBatch

if TYPE_CHECKING:
    from agentrl.trainers.deepspeed_backend import ZeroEngine


_ADAMW_WEIGHT_DECAY = 0.01
"""The critic's AdamW weight decay (torch's default, which it has always used), under every backend."""


class ValueModel(nn.Module):
    """Decoder backbone + linear head (zero-initialised, so initial values are 0).

    With `sp_groups` the backbone (patched for ring attention) runs on this
    rank's shard of the packed row and the per-token head outputs are gathered.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, sp_groups: Any = None, pad_token_id: int = 0) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.sp_groups = sp_groups
        self.pad_token_id = pad_token_id

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.sp_groups is None:
            hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            after = self.head(hidden[0]).squeeze(-1).float()  # the value of the state after each token
        else:
            from agentrl.trainers.sequence_parallel import shard_packed_batch

            if cu_seqlens is None:
                raise ValueError("a sequence-parallel value model needs the packed batch's cu_seqlens")
            shard = shard_packed_batch(input_ids, position_ids, cu_seqlens, self.sp_groups,
                                       pad_token_id=self.pad_token_id)  # fmt: skip
            hidden = self.backbone(**shard.model_inputs()).last_hidden_state[0]
            after = shard.gather(self.head(hidden).squeeze(-1).float())
        v = torch.cat([after.new_zeros(1), after[:-1]])  # value[t]: the state before token t
        return v.masked_fill(position_ids.reshape(-1) == 0, 0.0)


class Critic:
    """Value model, optimizer and the PPO value update over packed micro-batches."""

    def __init__(
        self,
        config: CriticConfig,
        model_path: str,
        *,
        device: str = "cpu",
        autocast_dtype: torch.dtype | None = None,
        world: World | None = None,
        load: Callable[[Any, str], Any] | None = None,
        shard: bool = False,
        sp_groups: Any = None,
        processes: World | None = None,
        pad_token_id: int = 0,
        zero: DeepSpeedConfig | None = None,
    ) -> None:
        """`load(auto_cls, path)` loads the backbone (the trainer passes its attention setup).

        `world` is the data-parallel world; `processes` every rank (they differ under
        sequence parallelism, `sp_groups`). `shard` spreads the value model's
        parameters over every rank with FSDP2; else DDP over `world`, or, under
        SP, the gradient reduction of `sequence_parallel.reduce_gradients`.
        """
        from transformers import AutoModel

        self.config = config
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.world = world or World()
        path = config.model_path or model_path
        backbone = load(AutoModel, path) if load else AutoModel.from_pretrained(path, dtype=torch.float32)
        processes = processes or self.world
        self.sp_groups = sp_groups
        if sp_groups is not None:
            from agentrl.trainers.sequence_parallel import patch_model_for_sp

            patch_model_for_sp(backbone)
        self.model = ValueModel(backbone, backbone.config.hidden_size, sp_groups, pad_token_id).to(device)
        self.sharded = shard and processes.size > 1
        self.module: nn.Module = self.model  # FSDP shards in place; under SP gradients are reduced after backward
        self.zero: ZeroEngine | None = None
        if zero is not None:  # its own DeepSpeed engine; every forward goes through it (ZeRO-3 gathers)
            from agentrl.trainers.deepspeed_backend import ZeroEngine

            self.zero = ZeroEngine(self.model, list(self.model.parameters()), zero, lr=config.lr,
                                   weight_decay=_ADAMW_WEIGHT_DECAY, max_grad_norm=config.max_grad_norm,
                                   device=device)  # fmt: skip
            self.module = self.zero.engine
        elif self.sharded:
            self.module = fully_shard(self.model, backbone, processes, device)
        elif sp_groups is None:
            self.module = wrap(self.model, self.world, device)
        # scaled so that the gradient reduction (a mean over its ranks) gives the whole batch's sum
        self.grad_scale = processes.size if self.sharded else self.world.size
        self.optimizer: torch.optim.Optimizer = (
            self.zero.optimizer
            if self.zero is not None
            else torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=_ADAMW_WEIGHT_DECAY)
        )

    def _autocast(self) -> Any:
        dev = torch.device(self.device).type
        return torch.autocast(dev, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    @torch.no_grad()
    def values(self, batches: Sequence[PackedBatch], extra_forwards: int = 0) -> dict[int, torch.Tensor]:
        """Values per sample index (CPU float32), for GAE and as old values for clipping.

        The last `extra_forwards` batches are dummies run only to match the
        other ranks' forwards (FSDP gathers parameters in each): no values.
        """
        out: dict[int, torch.Tensor] = {}
        self.model.eval()
        real = len(batches) - extra_forwards
        forward = self.module if self.zero is not None else self.model
        for k, b in enumerate(batches):
            with self._autocast():
                v = forward(b.input_ids.to(self.device), b.position_ids.to(self.device), b.cu_seqlens).float().cpu()
            if k >= real:
                continue
            for i, part in zip(b.sample_indices, b.split(v), strict=True):
                out[i] = part
        return out

    def update(self, batches: Sequence[PackedBatch], num_tokens: int) -> dict[str, float]:
        """One optimizer step on fields `returns`, `old_values`, `loss_mask`; token-mean over `num_tokens`."""
        self.model.train()
        if self.zero is None:
            self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for k, b in enumerate(batches):
            b = b.to(self.device)
            last = k == len(batches) - 1
            if self.zero is not None:
                self.zero.boundary(last)
            sync = maybe_no_sync(self.module, sync=last) if self.zero is None else contextlib.nullcontext()
            with sync, self._autocast():
                v = self.module(b.input_ids, b.position_ids, b.cu_seqlens).float()
                per_token = value_loss(v, b.fields["old_values"], b.fields["returns"], self.config.value_clip)
                loss = (per_token * b.fields["loss_mask"]).sum() / max(num_tokens, 1)
            if self.zero is not None:
                self.zero.backward(loss * self.grad_scale)
            else:
                torch.autograd.backward(loss * self.grad_scale)
            total += loss.detach().double().cpu()
        if self.zero is not None:  # DeepSpeed clips (critic.max_grad_norm) and steps
            return {"critic/loss_local": float(total), "critic/grad_norm": self.zero.step()}
        if self.sp_groups is not None and not self.sharded:
            from agentrl.trainers.sequence_parallel import reduce_gradients

            reduce_gradients([p for p in self.model.parameters() if p.grad is not None], self.sp_groups)
        grad_norm = torch.tensor(0.0)
        if self.config.max_grad_norm is not None:
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        return {"critic/loss_local": float(total), "critic/grad_norm": float(grad_norm)}

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state. Sharded: gathered whole on CPU, complete on rank 0 only
        (a collective: every rank calls it). DeepSpeed: checkpointed by its engine instead (`zero.save`)."""
        if not self.sharded:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {"model": whole_model_state(self.model), "optimizer": whole_optimizer_state(self.model, self.optimizer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` gave; sharded, every rank passes the whole state and keeps its shard."""
        if not self.sharded:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            return
        load_whole_model_state(self.model, state["model"])
        load_whole_optimizer_state(self.model, self.optimizer, state["optimizer"])

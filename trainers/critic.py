"""The PPO critic: an HF decoder backbone plus a scalar value head, with its own optimizer.

`values[t]` estimates the return from the state *before* token t is sampled
(the head reads hidden state t-1), the same alignment as the policy's logprobs.
Trained with the clipped value loss, token-mean over the batch's loss tokens.
Under `data_parallel: fsdp` the value model is sharded like the policy (one
FSDP unit per transformer block), and its checkpoint state is gathered whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from agentrl.trainers.config import CriticConfig
from agentrl.trainers.distributed import World, full_tensor, fully_shard, maybe_no_sync, wrap
from agentrl.trainers.losses import value_loss
from agentrl.trainers.packing import PackedBatch
from torch import nn


class ValueModel(nn.Module):
    """Decoder backbone + linear head (zero-initialised, so initial values are 0)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        v = self.head(hidden[0, :-1]).squeeze(-1).float()
        v = torch.cat([v.new_zeros(1), v])
        return v.masked_fill(position_ids[0] == 0, 0.0)


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
    ) -> None:
        """`load(auto_cls, path)` loads the backbone (the trainer passes its attention setup);
        `shard` spreads the value model's parameters over the world with FSDP2 (else DDP)."""
        from transformers import AutoModel

        self.config = config
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.world = world or World()
        path = config.model_path or model_path
        backbone = load(AutoModel, path) if load else AutoModel.from_pretrained(path, dtype=torch.float32)
        self.model = ValueModel(backbone, backbone.config.hidden_size).to(device)
        self.sharded = shard and self.world.size > 1
        # FSDP shards in place (the model is its own module); DDP wraps it
        self.module = fully_shard(self.model, backbone, self.world, device) if self.sharded else wrap(
            self.model, self.world, device
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr)

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
        for k, b in enumerate(batches):
            with self._autocast():
                v = self.model(b.input_ids.to(self.device), b.position_ids.to(self.device)).float().cpu()
            if k >= real:
                continue
            for i, part in zip(b.sample_indices, b.split(v), strict=True):
                out[i] = part
        return out

    def update(self, batches: Sequence[PackedBatch], num_tokens: int) -> dict[str, float]:
        """One optimizer step on fields `returns`, `old_values`, `loss_mask`; token-mean over `num_tokens`."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for k, b in enumerate(batches):
            b = b.to(self.device)
            with maybe_no_sync(self.module, sync=k == len(batches) - 1), self._autocast():
                v = self.module(b.input_ids, b.position_ids).float()
                per_token = value_loss(v, b.fields["old_values"], b.fields["returns"], self.config.value_clip)
                loss = (per_token * b.fields["loss_mask"]).sum() / max(num_tokens, 1)
            (loss * self.world.size).backward()
            total += loss.detach().double().cpu()
        grad_norm = torch.tensor(0.0)
        if self.config.max_grad_norm is not None:
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        self.optimizer.step()
        return {"critic/loss_local": float(total), "critic/grad_norm": float(grad_norm)}

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state. Sharded: gathered whole on CPU, complete on rank 0 only
        (a collective: every rank calls it)."""
        if not self.sharded:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=whole),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=whole),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` gave; sharded, every rank passes the whole state and keeps its shard."""
        if not self.sharded:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=whole)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state["optimizer"], options=whole)

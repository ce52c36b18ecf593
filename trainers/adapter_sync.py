"""The torch trainer's side of one-copy-of-the-base: which policy an embedded engine may share, and
the adapter-only weight source a sync then hands over (`agentrl.engines.hf_shared`).

An engine may share the trainer's frozen base only when the trainer is one
process holding the whole model (no DDP/FSDP/ZeRO wrapper, no sharding) and
the policy is a peft LoRA model; full fine-tuning changes the base at every
step and keeps the merged-weights path (`TorchTrainer.state_for_engines`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from agentrl.engines.hf_shared import adapter_named_tensors, is_lora
from agentrl.weights.buckets import NamedTensorBuckets

if TYPE_CHECKING:
    from agentrl.trainers.torch_trainer import TorchTrainer


def shareable_policy(trainer: TorchTrainer) -> nn.Module | None:
    """The trainer's LoRA policy when an engine in this process may sample with its frozen base, else None."""
    if trainer.world.size > 1 or trainer.processes.size > 1:
        return None
    if trainer.fsdp or trainer.models.zero is not None:
        return None
    model = trainer.model
    return model if is_lora(model) else None


def adapter_source(trainer: TorchTrainer, *, bucket_mb: float | None = None) -> NamedTensorBuckets:
    """The trainable tensors alone (the adapters, under the inner HF model's names), copied per sync."""
    model = trainer.model
    if not is_lora(model):
        raise ValueError("adapter_for_engines needs trainer.lora: without LoRA the whole model changes")
    return NamedTensorBuckets(
        lambda: adapter_named_tensors(model),
        bucket_mb=bucket_mb or trainer.config.weight_bucket_mb,
        source_device=torch.device(trainer.device).type,
    )


def share_frozen_base(trainer: TorchTrainer, other: TorchTrainer) -> bool:
    """Make `trainer`'s frozen base tensors *be* `other`'s (one base copy for several LoRA policies).

    Both must be one-process LoRA policies of the same base (same parameter names
    and shapes); each keeps its own adapter and optimizer. Returns whether it did.
    Only frozen parameters are replaced: the optimizer (built over the trainable
    ones) is untouched.
    """
    mine, theirs = shareable_policy(trainer), shareable_policy(other)
    if mine is None or theirs is None or mine is theirs:
        return False
    # every name of a tied tensor (lm_head = embed_tokens), so the tie survives the swap
    source = dict(theirs.named_parameters(remove_duplicate=False))
    frozen = [(n, p) for n, p in mine.named_parameters(remove_duplicate=False) if not p.requires_grad]
    if any(n not in source or source[n].shape != p.shape or source[n].requires_grad for n, p in frozen):
        return False
    for name, _ in frozen:
        module_name, _, attr = name.rpartition(".")
        module = mine.get_submodule(module_name) if module_name else mine
        setattr(module, attr, source[name])
    return True

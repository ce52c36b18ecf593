"""One copy of the base weights: the embedded hf engine samples with the trainer's frozen base.

With LoRA, the trainer's policy is a peft model whose base weights never
change. When the hf engine runs in the trainer's process, `shared_base_model`
builds the engine's model as a copy of that peft model's module tree in which
every frozen tensor *is* the trainer's (the same storage, no copy) and only the
trainable tensors (the LoRA adapters, and any `modules_to_save`) are the
engine's own. The engine serves the adapter unmerged (base(x) + B(A(x)) * s),
so a sync hands over the adapter tensors alone (`adapter_named_tensors`):
kilobytes to a few MB instead of the merged model, and no merge per step.

The engine's adapter is its own copy, not the trainer's, because rollouts run
while the trainer steps: the engine must keep sampling the version it serves
until the next sync, which copies the new adapter in under the engine's step lock.

Imports torch and peft: only the hf engine and the torch trainer import this module.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from agentrl.trainer import AdapterTrainer


def inner_model(model: nn.Module) -> Any:
    """The HF causal LM inside a peft wrapper (its LoRA layers stay injected), else the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def adapter_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainable tensors of a peft model under the inner HF model's names (e.g.
    `model.layers.0.self_attn.q_proj.lora_A.default.weight`): what a shared-base engine takes at a sync."""
    for name, p in inner_model(model).named_parameters():
        if p.requires_grad:
            yield name, p.detach()


def shared_base_model(peft_model: nn.Module, *, attn_implementation: str = "sdpa") -> Any:
    """A serving copy of `peft_model`'s inner HF model: frozen tensors shared, trainable ones copied.

    The copy is in eval mode, with the KV cache on and `attn_implementation`
    (the trainer may run a packed-sequence attention that has no KV cache).
    """
    if not is_lora(peft_model):
        raise ValueError("shared_base_model needs a peft (LoRA) model: full fine-tuning changes the base weights")
    inner = inner_model(peft_model)
    shared: dict[int, Any] = {id(p): p for p in inner.parameters() if not p.requires_grad}
    # the trainer may keep .grad on frozen tensors' neighbours; a deepcopy of the module tree
    # with the frozen parameters in its memo makes them the same objects, not copies
    engine_model = copy.deepcopy(inner, memo=shared)
    for p in engine_model.parameters():
        p.requires_grad_(False)
        p.grad = None
    engine_model.config.use_cache = True
    if getattr(engine_model, "is_gradient_checkpointing", False):
        engine_model.gradient_checkpointing_disable()
    try:
        engine_model.set_attn_implementation(attn_implementation)
    except (AttributeError, ValueError):
        engine_model.config._attn_implementation = attn_implementation
    return engine_model.eval()


def adopt_trainer_base(engine: Any, trainer: object) -> bool:
    """Make a not-yet-started hf engine sample with `trainer`'s frozen base weights; True when it did.

    It does when the trainer offers a shareable LoRA policy
    (`lora_policy_for_engine()`, e.g. the torch trainer in one process), the
    engine allows it (`share_trainer_base`), and both sides agree on device and
    dtype; an engine with `dtype: auto` takes the trainer's dtype (a bf16 checkpoint
    beside an fp32 trainer would otherwise keep a second, bf16 copy and get merged
    syncs). The engine's own model is dropped; from then on a sync hands it the
    trainer's adapter alone (`weights_wanted == "adapter"`).
    """
    if not engine.config.share_trainer_base or not isinstance(trainer, AdapterTrainer) or engine._worker is not None:
        return False
    policy = trainer.lora_policy_for_engine()
    if policy is None:
        return False
    frozen = next(p for p in policy.parameters() if not p.requires_grad)
    own = next(iter(engine.model.parameters()))
    if frozen.device != own.device or (frozen.dtype != own.dtype and engine.config.dtype != "auto"):
        return False  # e.g. an engine pinned to bf16 beside an fp32 trainer: it keeps its own model
    engine.model = shared_base_model(policy)
    engine._adapters.rebind(engine.model)  # named adapters sit on the shared frozen base
    engine.shared_storages = frozenset(
        p.untyped_storage().data_ptr() for p in engine.model.parameters() if p.untyped_storage().data_ptr()
        in storage_ptrs(policy)
    )  # fmt: skip
    engine.weights_wanted = "adapter"
    return True


def storage_ptrs(model: nn.Module) -> frozenset[int]:
    """The storages of a model's parameters and buffers (to tell a shared tensor from a copy)."""
    return frozenset(t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()])

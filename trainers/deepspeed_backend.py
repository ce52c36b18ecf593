"""DeepSpeed ZeRO as the trainer's data-parallel engine (`trainer.data_parallel: deepspeed`).

The algorithm is the torch trainer's, unchanged: losses, advantages, packing,
off-policy correction, LoRA, the KL reference. This module only changes how
a model is wrapped, stepped and gathered:

- wrapped: the policy's logprob module (`PackedLogprobs`, whose forward runs
  the decoder and the chunked lm_head) goes into a `deepspeed.initialize`
  engine with the AdamW the `ddp`/`fsdp` modes use (DeepSpeed's CPU Adam with
  `offload_optimizer`, a C++ op built on first use). ZeRO-2 partitions the
  optimizer state and gradients over the ranks; ZeRO-3 the weights too (each
  module's are gathered for its forward and backward). Under ZeRO-3 the
  frozen KL reference is a second, optimizer-less engine, partitioned the
  same way (OpenRLHF does the same); under ZeRO-2 it is a plain copy.
- stepped: a micro-batch's loss goes through `engine.backward`; the last
  micro-batch of a mini-batch is the gradient-accumulation boundary
  (`set_gradient_accumulation_boundary`, since packing gives each rank its
  own count), where gradients are reduced; `engine.step` clips to
  `max_grad_norm` and skips an update whose gradient norm is not finite
  (every rank together), as `optim.clipped_step` does for ddp/fsdp.
- gathered: the weights for the engines and for checkpoints are read one
  bucket of parameters at a time (`deepspeed.zero.GatheredParameters`, a
  collective every rank joins), so no rank ever holds the whole model
  (ZeRO-2 keeps a whole copy on each rank anyway: nothing to gather).
- checkpointed: the optimizer state stays partitioned; each rank writes its
  own part with `engine.save_checkpoint` (DeepSpeed's layout, under
  `deepspeed/` in the checkpoint) beside the HF `model/` dir, and resumes
  from it with the same number of ranks and ZeRO stage.

Ranks start the way the `ray` trainer starts ddp/fsdp ranks (an initialised
torch.distributed group: gloo on CPU, nccl on GPU); a single-process trainer
gets a one-rank group of its own.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.trainers.config import DeepSpeedConfig, TrainerConfig

STATE_TAG = "state"
"""The tag (sub-directory) of DeepSpeed's checkpoint inside `<checkpoint>/deepspeed/`."""


def ensure_process_group(device: str) -> None:
    """DeepSpeed needs torch.distributed: a one-rank group (127.0.0.1) when the trainer runs alone.

    It also reads LOCAL_RANK (its launcher sets it): the index of this rank's
    device, 0 for a Ray actor that sees only its own GPU, or on a CPU.
    """
    import os

    dev = torch.device(device)
    os.environ.setdefault("LOCAL_RANK", str(dev.index if dev.type == "cuda" and dev.index is not None else 0))
    if dist.is_initialized():
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def engine_config(zero: DeepSpeedConfig, *, max_grad_norm: float | None, train: bool, device: str) -> dict[str, Any]:
    """The DeepSpeed config dict of one engine (`train=False`: a frozen model, no optimizer)."""
    pin = torch.device(device).type == "cuda"  # pinned host memory only helps copies to a GPU
    stage = zero.zero_stage if train or zero.zero_stage == 3 else 0  # a frozen model: partitioned (3) or whole
    section: dict[str, Any] = {"stage": stage}
    if stage:
        # no overlap: on gloo/CPU it buys nothing, and it keeps the reduction order (and the result) fixed
        section |= {"overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        section["stage3_param_persistence_threshold"] = zero.param_persistence_threshold
        if zero.offload_params:
            section["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if train and zero.offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    return {
        # the trainer packs its own micro-batches and marks the accumulation boundary itself
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "zero_optimization": section,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class ZeroEngine:
    """One trainable model in a DeepSpeed engine: forward through `engine`, backward and step by it.

    `module` is what the forward runs (for the policy its `PackedLogprobs`);
    `params` are the ones the optimizer updates (LoRA: the adapters).
    `optimizer` is the underlying AdamW, on which the LR schedule acts.
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[nn.Parameter],
        zero: DeepSpeedConfig,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        max_grad_norm: float | None,
        device: str,
    ) -> None:
        import deepspeed

        ensure_process_group(device)
        self.zero = zero
        self.optimizer: torch.optim.Optimizer
        if zero.offload_optimizer:  # DeepSpeed insists on its own CPU Adam for offloaded state (a JIT-built op)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self.optimizer = DeepSpeedCPUAdam(list(params), lr=lr, betas=betas, weight_decay=weight_decay,
                                              adamw_mode=True)  # fmt: skip
        else:
            self.optimizer = torch.optim.AdamW(list(params), lr=lr, betas=betas, weight_decay=weight_decay)
        config = engine_config(zero, max_grad_norm=max_grad_norm, train=True, device=device)
        self.engine: Any = deepspeed.initialize(model=module, optimizer=self.optimizer, config=config)[0]

    def boundary(self, last: bool) -> None:
        """Before a micro-batch's forward: whether its backward ends the accumulation (gradients reduced)."""
        self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate `loss`'s gradients (not divided by DeepSpeed's accumulation steps: the trainer scales)."""
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip and apply the accumulated gradients; the norm before clipping (not finite: update skipped)."""
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def save(self, directory: Path) -> None:
        """Every rank writes its partition of the weights' master copy and the optimizer state (a collective)."""
        # LoRA: the frozen base is not saved (resume loads it from the model path, as it was)
        self.engine.save_checkpoint(str(directory), tag=STATE_TAG, save_latest=False, exclude_frozen_parameters=True)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (same ranks and ZeRO stage); every rank reads its own partition."""
        if not (directory / STATE_TAG).is_dir():
            raise FileNotFoundError(f"{directory}: no DeepSpeed state ({STATE_TAG}/) to resume from")
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=STATE_TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
            load_module_strict=False,  # LoRA: the frozen base was not saved
        )
        if path is None:
            raise RuntimeError(f"{directory}: DeepSpeed could not load its state")

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of the model's parameters and of the optimizer state (for memory reports)."""
        return {"params": parameter_bytes(self.engine.module), "optimizer": optimizer_bytes(self.engine.optimizer)}


def frozen_engine(module: nn.Module, zero: DeepSpeedConfig, device: str) -> Any:
    """A frozen model (the KL reference) partitioned like the policy under ZeRO-3: an engine without optimizer."""
    import deepspeed

    ensure_process_group(device)
    config = engine_config(zero, max_grad_norm=None, train=False, device=device)
    return deepspeed.initialize(model=module, config=config)[0]


def is_partitioned(model: nn.Module) -> bool:
    """Whether `model`'s parameters are ZeRO-3 partitions (reading them whole is a collective)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def gathered_named_tensors(model: nn.Module, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """ZeRO-3: `model`'s weights under HF names (LoRA merged, tied aliases once), gathered per bucket.

    The same tensors as `weights.hf_named_tensors` gives for a whole model.
    A collective: every rank iterates it to the end, in step. Each bucket of
    about `bucket_bytes` of parameters is gathered whole on every rank, read,
    and partitioned again before the next, so no rank holds more than one.
    The tensors yielded stay valid after their bucket is released.
    """
    from deepspeed.runtime.zero import GatheredParameters

    from agentrl.weights.buckets import tied_aliases

    peft = hasattr(model, "get_base_model") and hasattr(model, "peft_config")
    base: nn.Module = model.get_base_model() if peft else model  # type: ignore[operator]
    units = _units(base, tied_aliases(base))
    for bucket in _bucketed(units, bucket_bytes):
        params = [p for unit in bucket for p in unit.params]
        with GatheredParameters(params, modifier_rank=None):
            for unit in bucket:
                yield unit.name, unit.tensor()
    aliases = tied_aliases(base)
    for name, buf in _persistent_buffers(base):
        if name not in aliases:
            yield name, buf


class _Unit:
    """One tensor the engines get and the parameters it is computed from (a LoRA layer: W + its adapters)."""

    def __init__(self, name: str, weight: nn.Parameter, lora: Any = None) -> None:
        self.name, self.weight, self.lora = name, weight, lora
        self.params: list[nn.Parameter] = [weight]
        if lora is not None:
            self.params += [p for n, p in lora.named_parameters() if "lora_" in n]

    def nbytes(self) -> int:
        return sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in self.params)

    def tensor(self) -> torch.Tensor:
        w = self.weight.data.detach()
        if self.lora is None:
            return w
        delta: torch.Tensor | None = None
        for adapter in self.lora.active_adapters:
            if adapter in self.lora.lora_A:
                d = self.lora.get_delta_weight(adapter)
                delta = d if delta is None else delta + d
        return w if delta is None else (w + delta.to(w.dtype)).detach()


def _units(base: nn.Module, aliases: set[str]) -> list[_Unit]:
    lora_layers: dict[str, Any] = {}
    try:
        from peft.tuners.lora import LoraLayer

        lora_layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    except ImportError:  # pragma: no cover - peft is part of the train extra
        pass
    units: list[_Unit] = []
    for name, p in base.named_parameters(remove_duplicate=False):
        if name in aliases or ".lora_" in name or "lora_embedding" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        owner = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        units.append(_Unit(clean, p, lora_layers.get(owner) if owner is not None else None))
    return units


def _bucketed(units: Sequence[_Unit], bucket_bytes: int) -> Iterator[list[_Unit]]:
    bucket: list[_Unit] = []
    size = 0
    for unit in units:
        n = unit.nbytes()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(unit)
        size += n
    if bucket:
        yield bucket


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mod_name, mod in module.named_modules():
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is not None and buf_name not in skip:
                yield (f"{mod_name}.{buf_name}" if mod_name else buf_name), buf.detach()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds: its ZeRO-3 partitions, or the whole tensors."""
    total = 0
    for p in model.parameters():
        held = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        total += held.numel() * held.element_size()
    return total


def optimizer_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state this rank holds: Adam's moments and any master copy of the weights."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    inner = getattr(optimizer, "optimizer", optimizer)  # a ZeRO wrapper around the AdamW
    for state in inner.state.values():
        for v in state.values():
            add(v)
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-2 / ZeRO-3 masters
        for t in getattr(optimizer, attr, None) or []:
            add(t)
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """`ZeroEngine.state_bytes` for a model outside DeepSpeed (one process, ddp): parameters and AdamW state."""
    return {"params": parameter_bytes(model), "optimizer": optimizer_bytes(optimizer)}


def zero_settings(config: TrainerConfig) -> DeepSpeedConfig:
    """`config.zero`, which data_parallel=deepspeed guarantees."""
    zero = config.zero
    if zero is None:
        raise ValueError("trainer.data_parallel is not 'deepspeed'")
    return zero


@contextlib.contextmanager
def deepspeed_left_unimported() -> Iterator[None]:
    """Keep DeepSpeed unimported through a call into transformers (`save_pretrained`) outside DeepSpeed runs.

    `save_pretrained` unwraps its model with accelerate's `extract_model_from_parallel`,
    which imports DeepSpeed whenever it is installed, only to test whether the model is
    a `DeepSpeedEngine`; the import prints DeepSpeed's accelerator warning in runs that
    never use it. No engine can exist before DeepSpeed is imported, so until then that
    test is skipped here. The one place, with `require_deepspeed`, that decides when
    DeepSpeed is imported: `trainer.data_parallel: deepspeed` only.
    """
    if "deepspeed" in sys.modules:
        yield
        return
    try:
        from accelerate.utils import other
    except ImportError:  # no accelerate: transformers unwraps by hand, without DeepSpeed
        yield
        return
    probe = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = probe


def require_deepspeed() -> None:
    """A clear error when DeepSpeed is not installed (it is the `deepspeed` extra)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"trainer.data_parallel='deepspeed' needs DeepSpeed ({e}): pip install 'agentrl[deepspeed]'"
        ) from e

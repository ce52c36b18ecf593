"""Model assembly for the torch trainer: what the RL step runs, built once.

`build_models` loads the policy (with LoRA adapters when configured), the
frozen reference (KL only; under LoRA the base with adapters off serves as
the reference), and the critic (GAE only), then wraps them for the parallel
layout: DDP, FSDP (parameters sharded over every process) and/or sequence
parallelism (ring attention over an SP group, data parallel across groups),
or DeepSpeed ZeRO-2/3 (`deepspeed_backend`: the policy in a DeepSpeed engine
with its optimizer; under ZeRO-3 the KL reference partitioned too).

The result, `Models`, answers the two questions the step asks of a model:
per-token logprobs of a packed micro-batch (`logprobs`) and the autocast
context its forwards run under (`autocast`). Nothing here knows about
advantages, losses or optimizers.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.distributed import World, current_world, fully_shard, wrap
from agentrl.trainers.logprobs import (
    PackedLogprobs,
    SequenceParallelLogprobs,
    base_causal_lm,
    packed_logprobs,
    sequence_parallel_logprobs,
)
from agentrl.trainers.packing import PackedBatch, use_packed_attention

if TYPE_CHECKING:
    from agentrl.trainers.critic import Critic
    from agentrl.trainers.deepspeed_backend import ZeroEngine
    from agentrl.trainers.sequence_parallel import SPGroups


class TrainerConfigError(ValueError):
    """A configuration this trainer cannot run (names the key and what is possible)."""


@dataclass(slots=True, eq=False)
class Models:
    """The policy, reference and critic of one trainer process, wrapped for its parallel layout."""

    config: TrainerConfig
    device: str
    policy: nn.Module  # the HF model (peft-wrapped under LoRA): the optimizer's parameters live here
    reference: nn.Module | None  # frozen copy of the initial policy; None without KL, and under LoRA
    critic: Critic | None  # the value model (advantage: gae)
    sp_groups: SPGroups | None  # sequence-parallel process groups; None = no SP
    world: World  # data parallel: the ranks that split each batch
    processes: World  # every process (SP ranks included)
    fsdp: bool  # parameters sharded over `processes`
    zero: ZeroEngine | None  # data_parallel=deepspeed: the policy's DeepSpeed engine (with its optimizer)
    collective: bool  # every forward/backward is a collective: ranks run as many (FSDP, DeepSpeed ZeRO)
    grad_scale: int  # a loss is multiplied by this so that the gradient reduction (a mean) gives the sum
    pad_id: int
    autocast_dtype: torch.dtype | None
    policy_root: nn.Module  # the policy's logprob module a forward runs through (DDP/FSDP/SP/DeepSpeed-wrapped)
    reference_root: nn.Module | None  # the reference's, when sharded (FSDP, ZeRO-3); else it is called directly

    def logprobs(
        self, model: nn.Module, b: PackedBatch, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs (and entropies) of a packed micro-batch under `model`."""
        cfg = self.config
        root = self.policy_root if model is self.policy else self.reference_root if model is self.reference else None
        if self.sp_groups is not None:
            if root is not None:
                sp_out: tuple[torch.Tensor, torch.Tensor | None] = root(
                    b.input_ids, b.position_ids, b.cu_seqlens, with_entropy=with_entropy
                )
                return sp_out
            return sequence_parallel_logprobs(
                model, b.input_ids, b.position_ids, b.cu_seqlens, self.sp_groups,
                pad_token_id=self.pad_id, chunk_tokens=cfg.logprob_chunk_tokens,
                temperature=cfg.temperature, with_entropy=with_entropy,
            )  # fmt: skip
        needed = b.fields["loss_mask"] > 0 if "loss_mask" in b.fields else None  # every use is masked
        shared = (b.cu_seqlens, b.families) if b.families else None
        if root is not None:
            out: tuple[torch.Tensor, torch.Tensor | None] = root(
                b.input_ids, b.position_ids, with_entropy=with_entropy, needed=needed, shared=shared
            )
            return out
        return packed_logprobs(
            model, b.input_ids, b.position_ids, chunk_tokens=cfg.logprob_chunk_tokens,
            temperature=cfg.temperature, with_entropy=with_entropy, needed=needed, shared=shared,
        )  # fmt: skip

    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 autocast where the device supports it natively, else a no-op (fp32)."""
        dev = torch.device(self.device).type
        return torch.autocast(
            dev, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        )

    def trainable(self) -> list[nn.Parameter]:
        """The policy parameters the optimizer updates (LoRA: the adapters)."""
        return [p for p in self.policy.parameters() if p.requires_grad]


def build_models(config: TrainerConfig, model_path: str, device: str, world: World | None = None) -> Models:
    """Load and wrap the policy, reference and critic for `config`'s parallel layout."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise TrainerConfigError(
            f"trainer.device={device}: torch sees no CUDA device here (torch.cuda.is_available() is False)"
        )
    zero = config.zero
    if zero is not None:  # before the world is read: DeepSpeed needs a process group, if only of one rank
        from agentrl.trainers.deepspeed_backend import ensure_process_group, require_deepspeed

        require_deepspeed()
        ensure_process_group(device)
    sp_groups = _sequence_parallel(config.sequence_parallel_size) if config.sequence_parallel_size > 1 else None
    if sp_groups is not None:  # data parallel runs across SP groups
        world = World(sp_groups.dp_rank, sp_groups.dp_size, sp_groups.dp_group)
        # every process, SP ranks included: checkpoints are written by one of them and wait for all
        processes = current_world()
    else:
        world = world if world is not None else current_world()
        processes = world
    autocast_dtype = _autocast_dtype(config.dtype, device)

    policy = _load_policy(config, model_path, device)
    pad_id = int(getattr(policy.config, "pad_token_id", None) or 0)
    reference = _load_reference(config, model_path, device) if config.kl.enabled else None
    critic = None
    if config.advantage == "gae":
        from agentrl.trainers.critic import Critic

        assert config.critic is not None  # TrainerConfig requires it with gae
        critic = Critic(
            config.critic,
            model_path,
            load=lambda auto_cls, path: _from_pretrained(config, auto_cls, path, device),
            device=device,
            autocast_dtype=autocast_dtype,
            world=world,
            shard=config.data_parallel == "fsdp",
            sp_groups=sp_groups,
            processes=processes,
            pad_token_id=pad_id,
            zero=zero,
        )
    if sp_groups is not None:
        from agentrl.trainers.sequence_parallel import patch_model_for_sp

        for m in (policy, reference):
            if m is not None:
                patch_model_for_sp(base_causal_lm(m))

    policy_root = _logprob_root(config, policy, sp_groups, pad_id)
    # FSDP shards over every process, SP ranks included; its reduce-scatter averages gradients over them all
    fsdp = config.data_parallel == "fsdp" and processes.size > 1
    zero_engine = None
    reference_root = None
    if zero is not None:  # the engine wraps the logprob module: its forward gathers what ZeRO-3 partitioned
        from agentrl.trainers.deepspeed_backend import ZeroEngine, frozen_engine

        zero_engine = ZeroEngine(
            policy_root, [p for p in policy.parameters() if p.requires_grad], zero, lr=config.lr,
            betas=config.betas, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm, device=device,
        )  # fmt: skip
        policy_root = zero_engine.engine
        if zero.zero_stage == 3 and reference is not None:  # the frozen reference is partitioned like the policy
            reference_root = frozen_engine(_logprob_root(config, reference, sp_groups, pad_id), zero, device)
    elif fsdp:  # parameters sharded; the root module's forward gathers the rest (distributed.fully_shard)
        policy_root = fully_shard(policy_root, policy, processes, device)
    elif sp_groups is None:  # under SP, gradients are reduced by sequence_parallel.reduce_gradients
        policy_root = wrap(policy_root, world, device)
    if fsdp and reference is not None:  # the frozen reference is sharded like the policy
        reference_root = fully_shard(_logprob_root(config, reference, sp_groups, pad_id), reference, processes, device)
    return Models(
        config=config,
        device=device,
        policy=policy,
        reference=reference,
        critic=critic,
        sp_groups=sp_groups,
        world=world,
        processes=processes,
        fsdp=fsdp,
        zero=zero_engine,
        # ZeRO reduces (ZeRO-2) or gathers (ZeRO-3) in every backward, not only at the accumulation boundary
        collective=fsdp or (zero is not None and processes.size > 1),
        grad_scale=processes.size if fsdp else world.size,
        pad_id=pad_id,
        autocast_dtype=autocast_dtype,
        policy_root=policy_root,
        reference_root=reference_root,
    )


def _load_policy(config: TrainerConfig, model_path: str, device: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(config, AutoModelForCausalLM, model_path, device)  # an HF PreTrainedModel
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if config.lora is not None:
        from peft import LoraConfig, get_peft_model

        lc = config.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lc.r,
                lora_alpha=lc.alpha,  # type: ignore[arg-type]  # typed int, used as a float (alpha / r)
                lora_dropout=lc.dropout,
                target_modules=list(lc.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    model.train()
    policy: nn.Module = model
    return policy


def _from_pretrained(config: TrainerConfig, auto_cls: Any, path: str, device: str) -> Any:
    """Load fp32 weights with the configured attention implementation."""
    attention = config.attention
    kwargs = {} if attention == "packed_sdpa" else {"attn_implementation": attention}
    model = auto_cls.from_pretrained(path, dtype=torch.float32, **kwargs).to(device)
    if attention == "packed_sdpa":
        use_packed_attention(model)
    return model


def _load_reference(config: TrainerConfig, model_path: str, device: str) -> nn.Module | None:
    """A frozen copy of the initial policy; None under LoRA (the base with adapters off is used)."""
    if config.lora is not None:
        return None
    from transformers import AutoModelForCausalLM

    ref: nn.Module = _from_pretrained(config, AutoModelForCausalLM, model_path, device)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _logprob_root(config: TrainerConfig, model: nn.Module, sp_groups: SPGroups | None, pad_id: int) -> nn.Module:
    """`model`'s logprobs as a module: split over the SP group under sequence parallelism, else packed."""
    chunk, temperature = config.logprob_chunk_tokens, config.temperature
    if sp_groups is not None:
        return SequenceParallelLogprobs(
            model, sp_groups, pad_token_id=pad_id, chunk_tokens=chunk, temperature=temperature
        )
    return PackedLogprobs(model, chunk_tokens=chunk, temperature=temperature)


def _sequence_parallel(size: int) -> SPGroups:
    """SP x DP process groups for ring attention (agentrl.trainers.sequence_parallel)."""
    try:
        from agentrl.trainers.sequence_parallel import sp_setup
    except ImportError as e:
        raise TrainerConfigError(
            f"trainer.sequence_parallel_size={size} needs agentrl.trainers.sequence_parallel ({e}); use 1"
        ) from e
    try:
        return sp_setup(size)
    except (RuntimeError, ValueError) as e:
        raise TrainerConfigError(f"trainer.sequence_parallel_size={size}: {e}") from e


def _autocast_dtype(name: str, device: str) -> torch.dtype | None:
    if name != "bf16":
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    if dev.type == "cpu":
        # without native bf16 (AVX512-BF16 / AMX) CPU bf16 matmuls are emulated: measured ~5x
        # slower than fp32 on an AVX2 machine, so "bf16 where supported" means fp32 there
        return torch.bfloat16 if _cpu_has_native_bf16() else None
    return torch.bfloat16 if torch.amp.autocast_mode.is_autocast_available(dev.type) else None


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags

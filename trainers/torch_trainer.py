"""TorchTrainer: GRPO/PPO with off-policy correction on a Hugging Face causal LM.

The RL step (`train_samples`), top to bottom:

  1. samples: per-sample tensors, this rank's shard (data parallel), shared-prefix families
  2. auxiliary no-grad passes as needed: reference logprobs (KL), critic values
     (GAE), proximal logprobs (only when one batch gives several optimizer steps;
     otherwise the step-start policy *is* the current one and its detached
     logprobs are used)
  3. advantages over whole groups
  4. for each epoch and mini-batch: packed micro-batches by token budget ->
     chunked logprobs -> off-policy weights -> PPO loss -> backward (grad
     accumulation; DDP syncs on the last micro-batch) -> clip -> optimizer step
     (and the critic's update under GAE)
  5. metrics, LR schedule, policy_version += 1; the step returns its metrics and
     the token stats of the replay view (`agentrl.trainer.TrainStepResult`)

The models it runs (policy, reference, critic; LoRA, DDP/FSDP/DeepSpeed ZeRO,
sequence parallel) are built by `assembly.build_models`; micro-batches come from
`micro_batches.MicroBatcher`; the optimizer and LR schedule from `optim`; the
advantage inputs (3) and the step's metrics (5) from `step_bookkeeping`. Weights stay fp32; forward passes run under bf16
autocast where the device supports it. `state_for_engines()` hands the weights
over in named buckets.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.engines.base import AdapterSpec
from agentrl.trainer import PolicyTrainer, Trainer, TrainStepResult, group_samples
from agentrl.trainers.assembly import Models, TrainerConfigError, build_models
from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.distributed import (
    World,
    all_gather_dict,
    all_reduce_sum,
    full_tensor,
    maybe_no_sync,
    shard,
)
from agentrl.trainers.losses import (
    PolicyLossInputs,
    aggregation_weights,
    gspo_old_logprobs,
    policy_loss,
)
from agentrl.trainers.micro_batches import (
    Fields,
    MicroBatcher,
    mini_batch_counts,
    mini_batches,
    sample_fields,
    shared_prefix_families,
)
from agentrl.trainers.off_policy import MismatchStats, off_policy_weights
from agentrl.trainers.optim import (
    advance_schedule,
    build_optimizer,
    clipped_step,
    lr_schedule,
    seed_everything,
)
from agentrl.trainers.packing import PackedBatch
from agentrl.trainers.step_bookkeeping import (
    Samples,
    add_sums,
    group_advantages,
    packing_metrics,
    step_metrics,
)
from agentrl.trainers.token_stats import TokenStatsRecorder
from agentrl.types import JSON, Group, TrainSample
from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors
from agentrl.weights.delta import DeltaBuckets, DeltaEncoder

__all__ = ["Samples", "TorchTrainer", "TrainerConfigError"]


class TorchTrainer:
    """Single-process or data-parallel (DDP/FSDP, sequence parallel) trainer; see the module docstring."""

    Config = TrainerConfig

    def __init__(
        self,
        config: TrainerConfig | Mapping[str, Any] | None = None,
        model_path: str = "smollm2-135m-instruct",
        *,
        device: str | None = None,
        world: World | None = None,
    ) -> None:
        from agentrl.engines.models import resolve_model

        self.config = (
            config if isinstance(config, TrainerConfig) else TrainerConfig.model_validate(dict(config or {}))
        )
        self.model_path = resolve_model(model_path)
        self.device = device or self.config.device
        self.policy_version = 0
        self.step = 0
        self.skipped_updates = 0  # optimizer updates dropped for a non-finite gradient norm (run total)
        seed_everything(self.config.seed)
        self.models: Models = build_models(self.config, self.model_path, self.device, world)
        m = self.models
        self.model, self.reference, self.critic = m.policy, m.reference, m.critic
        self.world, self.processes, self.fsdp = m.world, m.processes, m.fsdp
        self.sp_groups, self.pad_id, self.autocast_dtype = m.sp_groups, m.pad_id, m.autocast_dtype
        self.batcher = MicroBatcher(self.config, pad_id=m.pad_id, world=m.world, fsdp=m.collective)
        if m.zero is not None:  # DeepSpeed built the optimizer with its engine; the LR schedule acts on it
            self.optimizer, self.scheduler = m.zero.optimizer, lr_schedule(self.config, m.zero.optimizer)
        else:
            self.optimizer, self.scheduler = build_optimizer(self.config, m.trainable())
        self._delta = DeltaEncoder() if self.config.delta_sync else None  # what the engine holds, bit for bit

    # ------------------------------------------------------------------ the RL step
    def train_step(self, groups: Sequence[Group]) -> TrainStepResult:
        """One RL step on a batch of groups (see `train_samples`)."""
        return self.train_samples(group_samples(groups))

    def train_samples(self, groups: Samples) -> TrainStepResult:
        """One RL step on the samples of a batch's groups; increments `policy_version`."""
        return self._step(groups, apply=True)

    def compute_gradients(self, groups: Sequence[Group]) -> TrainStepResult:
        """The gradient of a full-batch update, left in `.grad`: no optimizer, critic or LR step.

        Needs epochs=1 and mini_batches=1 (one update per batch). For tests and tools.
        """
        if (self.config.epochs, self.config.mini_batches) != (1, 1):
            raise ValueError("compute_gradients needs trainer.epochs=1 and trainer.mini_batches=1")
        if self.models.zero is not None:
            raise ValueError("compute_gradients: under trainer.data_parallel='deepspeed' the gradients live in "
                             "DeepSpeed's partitions, not in .grad")  # fmt: skip
        return self._step(group_samples(groups), apply=False)

    def _step(self, groups: Samples, *, apply: bool) -> TrainStepResult:
        t0 = time.perf_counter()
        cfg = self.config
        skipped_before = self.skipped_updates

        # 1. samples: per-sample tensors once; this rank trains on its shard `mine`
        samples = [s for g in groups for s in g]
        if not samples:
            raise ValueError("train_step got no trajectories")
        ids = [s.input_ids for s in samples]
        base = sample_fields(samples)
        mine = shard(len(samples), self.world)
        families = None  # with trainer.shared_prefix: each group's samples that share a prompt prefix
        if cfg.shared_prefix:
            families = shared_prefix_families(groups, base["loss_mask"], cfg.shared_prefix_min_tokens)
        aux_batches = self.batcher.pack(ids, base, mine, families)

        # 2. auxiliary passes (no grad)
        ref = self._reference_logprobs(aux_batches) if cfg.kl.enabled else {}
        values = self._critic_values(aux_batches, list(base)) if self.critic is not None else {}
        updates = cfg.epochs * cfg.mini_batches
        prox = self._aux_logprobs(self.model, aux_batches) if updates > 1 else {}

        # 3. advantages over whole groups
        adv = group_advantages(cfg, groups, base, ref, values)
        fields: dict[str, Sequence[torch.Tensor]] = dict(base)
        fields["advantages"] = adv.advantages
        if prox:
            fields["prox_logprobs"] = [prox.get(i, torch.zeros(len(ids[i]))) for i in range(len(samples))]
        if ref and not cfg.kl.in_reward:
            fields["ref_logprobs"] = [ref.get(i, torch.zeros(len(ids[i]))) for i in range(len(samples))]
        if values:
            fields["old_values"] = [values[i] for i in range(len(samples))]
            fields["returns"] = adv.returns

        # 4. for each epoch and mini-batch: accumulate gradients, then one optimizer step
        sums: dict[str, float] = {}
        stats = MismatchStats()  # first epoch: the step-start policy against the behaviour policy
        recorder = TokenStatsRecorder() if cfg.record_token_stats else None
        first_epoch_batches: list[PackedBatch] = []
        mine_set = set(mine)
        for epoch in range(cfg.epochs):
            first = epoch == 0
            for part in mini_batches(len(samples), cfg.mini_batches):
                batches = self.batcher.pack(ids, fields, [i for i in part if i in mine_set], families)
                if first:
                    first_epoch_batches.extend(batches)
                counts = mini_batch_counts(fields["loss_mask"], part)
                add_sums(sums, self._accumulate(batches, counts, fields, stats if first else None,
                                            recorder if first else None))  # fmt: skip
                if not apply:
                    self._reduce_sp_gradients()
                    continue
                add_sums(sums, {"grad_norm": self._optimizer_step()})
                if self.critic is not None:
                    add_sums(sums, {"critic/loss": self._critic_update(batches, fields, counts[1])})

        # 5. metrics (`lr`: the rate this step used), LR schedule, version
        lr = float(self.scheduler.get_last_lr()[0])
        metrics = adv.metrics | step_metrics(cfg, self.world, sums, stats, updates, first_epoch_batches, ids, lr)
        metrics["optim/skipped_updates"] = float(self.skipped_updates - skipped_before)
        if apply:
            advance_schedule(self.scheduler)
            self.step += 1
            self.policy_version += 1
        metrics["policy_version"] = float(self.policy_version)
        metrics["autocast_bf16"] = float(self.autocast_dtype is torch.bfloat16)
        metrics["time/train_step_s"] = time.perf_counter() - t0
        metrics["time/tokens_per_s"] = metrics["pack/tokens"] / max(metrics["time/train_step_s"], 1e-9)
        token_stats = recorder.stats(samples, fields["loss_mask"], adv.advantages) if recorder is not None else {}
        return TrainStepResult(metrics, token_stats)

    # ------------------------------------------------------------------ 2. auxiliary passes
    @torch.no_grad()
    def _aux_logprobs(
        self, model: nn.Module, batches: Sequence[PackedBatch], disable_adapter: bool = False
    ) -> dict[int, torch.Tensor]:
        """No-grad logprobs per sample index for `batches` (reference or proximal pass)."""
        out: dict[int, torch.Tensor] = {}
        was_training = model.training
        model.eval()
        real = len(batches)
        if model is self.model or (model is self.reference and self.models.reference_root is not None):
            fields = list(batches[0].fields) if batches else ["loss_mask"]
            batches = self.batcher.forwards(list(batches), fields, at_least_one=False)
        try:
            with model.disable_adapter() if disable_adapter else contextlib.nullcontext():  # type: ignore[operator]
                for k, b in enumerate(batches):
                    b = b.to(self.device)
                    with self.models.autocast():
                        lp, _ = self.models.logprobs(model, b)
                    if k >= real:  # a dummy forward (FSDP): no sample's values
                        continue
                    for i, part in zip(b.sample_indices, b.split(lp.float().cpu()), strict=True):
                        out[i] = part
        finally:
            model.train(was_training)
        return out

    def _reference_logprobs(self, batches: Sequence[PackedBatch]) -> dict[int, torch.Tensor]:
        """The frozen reference's logprobs (LoRA: the base with adapters off); every rank's with KL in reward."""
        if self.reference is not None:
            ref = self._aux_logprobs(self.reference, batches)
        else:
            ref = self._aux_logprobs(self.model, batches, disable_adapter=True)
        return all_gather_dict(ref, self.world) if self.config.kl.in_reward else ref

    def _critic_values(self, batches: Sequence[PackedBatch], fields: Sequence[str]) -> dict[int, torch.Tensor]:
        """Every sample's value estimates (the advantages of a group need all of its samples)."""
        assert self.critic is not None
        forwards = self.batcher.forwards(list(batches), fields, at_least_one=False)
        local = self.critic.values(forwards, extra_forwards=len(forwards) - len(batches))
        return all_gather_dict(local, self.world)

    # ------------------------------------------------------------------ 4. accumulate, optimizer step
    def _accumulate(
        self,
        batches: list[PackedBatch],
        counts: tuple[int, int, dict[int, int]],
        fields: Fields,
        stats: MismatchStats | None,
        recorder: TokenStatsRecorder | None = None,
    ) -> dict[str, float]:
        """Forward/backward over this rank's micro-batches of one mini-batch; grads accumulate.

        `stats` and `recorder` (first epoch only) collect the mismatch diagnostics and the
        per-token values of the replay view from the same forward pass.
        """
        cfg = self.config
        num_seqs, num_tokens, seq_len = counts
        self._zero_grad()
        real = len(batches)
        batches = self.batcher.forwards(batches, list(fields), at_least_one=True)
        sums = torch.zeros(5, dtype=torch.float64)  # loss, pg, kl, entropy_sum, clipped_tokens
        for k, b in enumerate(batches):
            b = b.to(self.device)
            f = b.fields
            lengths = torch.tensor([seq_len.get(i, 0) for i in b.sample_indices] + [1], dtype=torch.float32)
            agg = aggregation_weights(
                f["loss_mask"], b.seq_ids, cfg.loss_agg, num_seqs=num_seqs, num_tokens=num_tokens, seq_lengths=lengths
            )
            with self._micro_batch(last=k == len(batches) - 1):
                with self.models.autocast():
                    logp, entropy = self.models.logprobs(self.model, b, with_entropy=True)
                logp = logp.float()
                prox = f["prox_logprobs"] if "prox_logprobs" in f else logp.detach()
                old, is_w = off_policy_weights(
                    prox,
                    f["behaviour_logprobs"],
                    f["loss_mask"],
                    b.seq_ids,
                    cfg.off_policy.mode,
                    tis_cap=cfg.off_policy.tis_cap,
                    mis_low=cfg.off_policy.mis_low,
                    mis_high=cfg.off_policy.mis_high,
                    decoupled_cap=cfg.off_policy.decoupled_cap,
                )
                if cfg.policy_loss == "gspo":  # one ratio per sequence (losses.gspo_old_logprobs)
                    old = gspo_old_logprobs(logp, old, f["loss_mask"], b.seq_ids)
                loss, parts = policy_loss(
                    PolicyLossInputs(
                        logprobs=logp,
                        old_logprobs=old,
                        advantages=f["advantages"],
                        is_weights=is_w,
                        agg_weights=agg,
                        entropy=entropy.float() if entropy is not None else None,
                        ref_logprobs=f.get("ref_logprobs"),
                    ),
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    dual_clip=cfg.dual_clip,
                    kl_coef=0.0 if cfg.kl.in_reward else cfg.kl.coef,
                    kl_estimator=cfg.kl.estimator,
                    entropy_coef=cfg.entropy_coef,
                )
                self._backward(loss * self.models.grad_scale)
            sums += torch.tensor(
                [
                    float(loss.detach()),
                    float(parts["pg_loss"]),
                    float(parts.get("kl", 0.0)),
                    float(parts.get("entropy_sum", 0.0)),
                    float(parts["clipped_tokens"]),
                ],
                dtype=torch.float64,
            )
            if k >= real:  # a dummy batch is no trajectory
                continue
            if stats is not None:
                stats.add(
                    prox.cpu(),
                    f["behaviour_logprobs"].cpu(),
                    f["loss_mask"].cpu(),
                    f["versions"].cpu(),
                    self.policy_version,
                    is_w.cpu(),
                    mode=cfg.off_policy.mode,
                    tis_cap=cfg.off_policy.tis_cap,
                )
            if recorder is not None:
                recorder.add(b, prox, is_w)
        total = all_reduce_sum(sums, self.world)
        return {
            "loss": float(total[0]),
            "pg_loss": float(total[1]),
            "kl/loss": float(total[2]),
            "entropy": float(total[3]) / max(num_tokens, 1),
            "clip_fraction": float(total[4]) / max(num_tokens, 1),
        }

    def _optimizer_step(self) -> float:
        """`optim.clipped_step` on the policy; a skipped (non-finite) update counts in `skipped_updates`."""
        if self.models.zero is not None:  # DeepSpeed clips, and skips a non-finite update on every rank
            norm = self.models.zero.step()
        else:
            self._reduce_sp_gradients()
            norm = clipped_step(self.optimizer, self.models.trainable(), self.config.max_grad_norm)
        if not math.isfinite(norm):
            self.skipped_updates += 1
        return norm

    def _zero_grad(self) -> None:
        if self.models.zero is None:  # DeepSpeed clears its gradient partitions in its step
            self.optimizer.zero_grad(set_to_none=True)

    def _micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[None]:
        """Around a micro-batch's forward and backward: gradients are reduced only after the `last` one."""
        if self.models.zero is not None:
            self.models.zero.boundary(last)
            return contextlib.nullcontext()
        return maybe_no_sync(self.models.policy_root, sync=last)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.models.zero is not None:
            self.models.zero.backward(loss)
        else:
            torch.autograd.backward(loss)

    def _critic_update(self, batches: list[PackedBatch], fields: Fields, num_tokens: int) -> float:
        """One value-loss step on the mini-batch just trained; the loss summed over ranks."""
        assert self.critic is not None
        crit = self.critic.update(self.batcher.forwards(batches, list(fields), at_least_one=True), num_tokens)
        return float(all_reduce_sum(torch.tensor(crit["critic/loss_local"]), self.world))

    def _reduce_sp_gradients(self) -> None:
        if self.sp_groups is not None and not self.fsdp:  # FSDP reduces them itself
            from agentrl.trainers.sequence_parallel import reduce_gradients

            reduce_gradients(self.models.trainable(), self.sp_groups)

    # ------------------------------------------------------------------ SFT
    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step of masked cross-entropy (token mean over loss-mask tokens)."""
        t0 = time.perf_counter()
        if not samples:
            raise ValueError("sft_step got no samples")
        ids = [s.input_ids for s in samples]
        fields = {"loss_mask": sample_fields(samples)["loss_mask"]}
        mine = shard(len(samples), self.world)
        real = self.batcher.pack(ids, fields, mine)
        batches = self.batcher.forwards(real, ["loss_mask"], at_least_one=True)
        num_tokens = int(sum(float(m.sum()) for m in fields["loss_mask"]))
        self._zero_grad()
        total = torch.zeros(1, dtype=torch.float64)
        for k, b in enumerate(batches):
            b = b.to(self.device)
            with self._micro_batch(last=k == len(batches) - 1):
                with self.models.autocast():
                    logp, _ = self.models.logprobs(self.model, b)
                loss = -(logp.float() * b.fields["loss_mask"]).sum() / max(num_tokens, 1)
                self._backward(loss * self.models.grad_scale)
            total += float(loss.detach())
        lr = float(self.scheduler.get_last_lr()[0])  # the rate this step used, as train_step reports it
        skipped_before = self.skipped_updates
        grad_norm = self._optimizer_step()
        advance_schedule(self.scheduler)
        self.step += 1
        self.policy_version += 1
        return {
            "sft/loss": float(all_reduce_sum(total, self.world)[0]),
            "grad_norm": grad_norm,
            "optim/skipped_updates": float(self.skipped_updates - skipped_before),
            "lr": lr,
            "time/train_step_s": time.perf_counter() - t0,
            "policy_version": float(self.policy_version),
            **packing_metrics(self.world, real, ids),
        }

    # ------------------------------------------------------------------ state
    def state_for_engines(
        self, *, dtype: torch.dtype | None = None, bucket_mb: float | None = None
    ) -> NamedTensorBuckets:
        """The current weights as HF-named tensors in buckets (LoRA merged).

        Under FSDP and ZeRO-3 every rank must read it to the end, in step: each
        tensor (ZeRO-3: each bucket of parameters) is gathered from all ranks as
        it is read (the `ray` trainer does this).
        """
        bucket_mb = bucket_mb or self.config.weight_bucket_mb
        source_device = torch.device(self.device).type
        if self.partitioned:
            from agentrl.trainers.deepspeed_backend import gathered_named_tensors

            bucket_bytes = int(bucket_mb * 1024 * 1024)
            return NamedTensorBuckets(lambda: gathered_named_tensors(self.model, bucket_bytes), bucket_mb=bucket_mb,
                                      dtype=dtype, source_device=source_device)  # fmt: skip
        return NamedTensorBuckets(
            lambda: ((name, full_tensor(t)) for name, t in hf_named_tensors(self.model)),
            bucket_mb=bucket_mb,
            dtype=dtype,
            source_device=source_device,
        )

    def delta_for_engines(self, engine_version: int, dtype: str) -> DeltaBuckets | None:
        """With `delta_sync`: the sync from the engine's `engine_version` to this trainer's version, in the
        engine's `dtype` (a torch dtype name): only the elements whose bits changed, or the whole model when
        the trainer holds no base for that version (`agentrl.weights.delta`). None without `delta_sync`."""
        if self._delta is None:
            return None
        wire = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(wire, torch.dtype):
            raise ValueError(f"delta sync: {dtype!r} is not a torch dtype")
        return self._delta.source(
            lambda: hf_named_tensors(self.model), version=self.policy_version, engine_version=engine_version,
            dtype=wire, bucket_mb=self.config.weight_bucket_mb, source_device=torch.device(self.device).type,
        )  # fmt: skip

    def lora_policy_for_engine(self) -> nn.Module | None:
        """The LoRA policy whose frozen base an hf engine in this process may sample with, else None
        (full fine-tuning, several processes); see `agentrl.engines.hf_shared`."""
        from agentrl.trainers.adapter_sync import shareable_policy

        return shareable_policy(self)

    def adapter_for_engines(self, *, bucket_mb: float | None = None) -> NamedTensorBuckets:
        """The LoRA adapters alone (unmerged, inner HF names): the sync of an engine that shares the base."""
        from agentrl.trainers.adapter_sync import adapter_source

        return adapter_source(self, bucket_mb=bucket_mb)

    def adapter_spec(self) -> AdapterSpec | None:
        """The shape of this trainer's LoRA adapter (None: full fine-tuning), for an `AdapterEngine`."""
        lora = self.config.lora
        return None if lora is None else AdapterSpec(lora.r, lora.alpha, tuple(lora.target_modules))

    def share_base_from(self, other: object) -> bool:
        """Sample and train over `other`'s frozen base tensors (several policies, one base); True when it did."""
        from agentrl.trainers.adapter_sync import share_frozen_base

        return isinstance(other, TorchTrainer) and share_frozen_base(self, other)

    def memory_stats(self) -> dict[str, float]:
        """The trainer's own share of the process's memory (`memory/trainer/<key>`, MiB; `trainers.memory`)."""
        from agentrl.trainers.memory import trainer_memory_mb

        critic = getattr(self.critic, "model", None) if self.critic is not None else None
        return trainer_memory_mb([self.model, self.reference, critic], self.optimizer)

    @property
    def partitioned(self) -> bool:
        """ZeRO-3: the weights are partitions; reading them whole is a collective, bucket by bucket."""
        zero = self.config.zero
        return zero is not None and zero.zero_stage == 3

    def save(self, path: str | Path, extra_state: Mapping[str, JSON] | None = None) -> None:
        """Checkpoint: HF model dir, optimizer, scheduler, RNG, step, `extra_state` (JSON)."""
        from agentrl.trainers.checkpoint import save_checkpoint

        save_checkpoint(self, path, dict(extra_state or {}))

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save`; returns its `extra_state`."""
        from agentrl.trainers.checkpoint import load_checkpoint

        return load_checkpoint(self, path)


_IS_A_TRAINER: type[Trainer] = TorchTrainer  # mypy checks that TorchTrainer fits agentrl.trainer.Trainer
_IS_A_POLICY_TRAINER: type[PolicyTrainer] = TorchTrainer  # ... and agentrl.trainer.PolicyTrainer

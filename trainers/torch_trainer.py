"""TorchTrainer: GRPO/PPO with off-policy correction on a Hugging Face causal LM.

One step, top to bottom (`train_step`):
  1. groups -> TrainSamples; this rank's shard (data parallel)
  2. auxiliary no-grad passes as needed: reference logprobs (KL), critic values
     (GAE), proximal logprobs (only when one batch gives several optimizer steps;
     otherwise the step-start policy *is* the current one and its detached
     logprobs are used)
  3. advantages over whole groups
  4. for each epoch and mini-batch: packed micro-batches by token budget ->
     chunked logprobs -> off-policy weights -> PPO loss -> backward (grad accumulation;
     DDP syncs on the last micro-batch) -> clip -> optimizer step
  5. critic update (GAE), LR schedule, policy_version += 1, metrics

Weights stay fp32; forward passes run under bf16 autocast where the device
supports it. `state_for_engines()` hands the weights over in named buckets.
"""

from __future__ import annotations

import itertools
import math
import random
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.distributed import (
    World,
    all_gather_dict,
    all_reduce_max,
    all_reduce_sum,
    current_world,
    full_tensor,
    fully_shard,
    matched,
    maybe_no_sync,
    shard,
    wrap,
)
from agentrl.trainers.logprobs import (
    PackedLogprobs,
    SequenceParallelLogprobs,
    base_causal_lm,
    packed_logprobs,
    sequence_parallel_logprobs,
)
from agentrl.trainers.losses import (
    PolicyLossInputs,
    aggregation_weights,
    gspo_old_logprobs,
    kl_estimate,
    policy_loss,
)
from agentrl.trainers.off_policy import MismatchStats, off_policy_weights
from agentrl.trainers.packing import PackedBatch, pack, pack_all, padding_stats, use_packed_attention
from agentrl.trainers.shared_prefix import Family, find_families, layout_cost, plan_families
from agentrl.trainers.token_stats import TokenStatsRecorder
from agentrl.trainers.weights import NamedTensorBuckets, hf_named_tensors
from agentrl.types import Group, TrainSample


class TrainerConfigError(ValueError):
    """A configuration this trainer cannot run (names the key and what is possible)."""


class TorchTrainer:
    """Single-process or data-parallel (DDP) trainer; see the module docstring."""

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
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise TrainerConfigError(
                f"trainer.device={self.device}: torch sees no CUDA device here (torch.cuda.is_available() is False)"
            )
        self.sp_groups: Any = self._sequence_parallel() if self.config.sequence_parallel_size > 1 else None
        if self.sp_groups is not None:  # data parallel runs across SP groups
            self.world = World(self.sp_groups.dp_rank, self.sp_groups.dp_size, self.sp_groups.dp_group)
            # every process, SP ranks included: checkpoints are written by one of them and wait for all
            self.processes = current_world()
        else:
            self.world = world if world is not None else current_world()
            self.processes = self.world
        self.policy_version = 0
        self.step = 0
        self.skipped_updates = 0  # optimizer updates dropped for a non-finite gradient norm (run total)
        _seed_everything(self.config.seed)
        self.autocast_dtype = _autocast_dtype(self.config.dtype, self.device)

        self.model = self._load_policy()
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.reference: nn.Module | None = self._load_reference() if self.config.kl.enabled else None
        self.critic = self._load_critic() if self.config.advantage == "gae" else None
        if self.sp_groups is not None:
            from agentrl.trainers.sequence_parallel import patch_model_for_sp

            for m in (self.model, self.reference):
                if m is not None:
                    patch_model_for_sp(base_causal_lm(m))

        self.logprob_module = self._logprob_root(self.model)
        # FSDP shards over every process, SP ranks included; its reduce-scatter averages gradients over them all
        self.fsdp = self.config.data_parallel == "fsdp" and self.processes.size > 1
        if self.fsdp:  # parameters sharded; the root module's forward gathers the rest (distributed.fully_shard)
            self.logprob_module = fully_shard(self.logprob_module, self.model, self.processes, self.device)
        elif self.sp_groups is None:  # under SP, gradients are reduced by sequence_parallel.reduce_gradients
            self.logprob_module = wrap(self.logprob_module, self.world, self.device)
        self.reference_module: nn.Module | None = None  # the frozen reference, sharded like the policy under FSDP
        if self.fsdp and self.reference is not None:
            self.reference_module = fully_shard(
                self._logprob_root(self.reference), self.reference, self.processes, self.device
            )
        # a backward's loss is scaled so that the gradient reduction (a mean) gives the whole batch's sum
        self.grad_scale = self.processes.size if self.fsdp else self.world.size
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=self.config.lr, betas=self.config.betas, weight_decay=self.config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(self.config))

    @classmethod
    def from_config(
        cls, config: TrainerConfig | Mapping[str, Any], *, model_path: str, device: str | None = None
    ) -> TorchTrainer:
        return cls(config, model_path, device=device)

    # ------------------------------------------------------------------ loading
    def _load_policy(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = self._from_pretrained(AutoModelForCausalLM, self.model_path)
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if self.config.lora is not None:
            from peft import LoraConfig, get_peft_model

            lc = self.config.lora
            model = get_peft_model(
                model,
                LoraConfig(
                    r=lc.r,
                    lora_alpha=lc.alpha,
                    lora_dropout=lc.dropout,
                    target_modules=list(lc.target_modules),
                    task_type="CAUSAL_LM",
                ),
            )
        model.train()
        return model  # type: ignore[no-any-return]

    def _from_pretrained(self, auto_cls: Any, path: str) -> Any:
        """Load fp32 weights with the configured attention implementation."""
        attention = self.config.attention
        kwargs = {} if attention == "packed_sdpa" else {"attn_implementation": attention}
        model = auto_cls.from_pretrained(path, dtype=torch.float32, **kwargs).to(self.device)
        if attention == "packed_sdpa":
            use_packed_attention(model)
        return model

    def _load_reference(self) -> nn.Module | None:
        """A frozen copy of the initial policy; None under LoRA (the base with adapters off is used)."""
        if self.config.lora is not None:
            return None
        from transformers import AutoModelForCausalLM

        ref = self._from_pretrained(AutoModelForCausalLM, self.model_path)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref  # type: ignore[no-any-return]

    def _load_critic(self) -> Any:
        from agentrl.trainers.critic import Critic

        assert self.config.critic is not None
        return Critic(
            self.config.critic,
            self.model_path,
            load=self._from_pretrained,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            world=self.world,
            shard=self.config.data_parallel == "fsdp",
            sp_groups=self.sp_groups,
            processes=self.processes,
            pad_token_id=self.pad_id,
        )

    def _logprob_root(self, model: nn.Module) -> nn.Module:
        """`model`'s logprobs as a module: split over the SP group under sequence parallelism, else packed."""
        kwargs = {"chunk_tokens": self.config.logprob_chunk_tokens, "temperature": self.config.temperature}
        if self.sp_groups is not None:
            return SequenceParallelLogprobs(model, self.sp_groups, pad_token_id=self.pad_id, **kwargs)
        return PackedLogprobs(model, **kwargs)

    def _sequence_parallel(self) -> Any:
        """SP x DP process groups for ring attention (agentrl.trainers.sequence_parallel)."""
        size = self.config.sequence_parallel_size
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

    def _logprobs(
        self, model: nn.Module, b: PackedBatch, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token logprobs of a packed micro-batch: plain/DDP, or sharded over the SP group."""
        # the module to run through (FSDP gathers parameters in its forward); None: call the model directly
        root = self.logprob_module if model is self.model else self.reference_module if model is self.reference else None
        if self.sp_groups is not None:
            if root is not None:
                sp_out: tuple[torch.Tensor, torch.Tensor | None] = root(
                    b.input_ids, b.position_ids, b.cu_seqlens, with_entropy=with_entropy
                )
                return sp_out
            return sequence_parallel_logprobs(
                model, b.input_ids, b.position_ids, b.cu_seqlens, self.sp_groups,
                pad_token_id=self.pad_id, chunk_tokens=self.config.logprob_chunk_tokens,
                temperature=self.config.temperature, with_entropy=with_entropy,
            )  # fmt: skip
        needed = b.fields["loss_mask"] > 0 if "loss_mask" in b.fields else None  # every use is masked
        shared = (b.cu_seqlens, b.families) if b.families else None
        if root is not None:
            out: tuple[torch.Tensor, torch.Tensor | None] = root(
                b.input_ids, b.position_ids, with_entropy=with_entropy, needed=needed, shared=shared
            )
            return out
        return packed_logprobs(
            model, b.input_ids, b.position_ids, chunk_tokens=self.config.logprob_chunk_tokens,
            temperature=self.config.temperature, with_entropy=with_entropy, needed=needed, shared=shared,
        )  # fmt: skip

    # ------------------------------------------------------------------ helpers
    def _autocast(self) -> AbstractContextManager[Any]:
        dev = torch.device(self.device).type
        return torch.autocast(
            dev, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        )

    def _pack(
        self,
        input_ids: Sequence[Sequence[int]],
        fields: Mapping[str, Sequence[torch.Tensor]],
        subset: Sequence[int],
        families: Sequence[Family] | None = None,
    ) -> list[PackedBatch]:
        """Micro-batches of `subset`; with shared-prefix `families`, whole families per micro-batch."""
        if not subset:
            return []
        if families is not None:
            return self._pack_families(input_ids, fields, subset, families)
        return pack_all(
            input_ids,
            fields,
            self.config.micro_batch_tokens,
            pad_to_multiple_of=self.config.pad_to_multiple_of,
            pad_id=self.pad_id,
            subset=subset,
        )

    def _pack_families(
        self,
        input_ids: Sequence[Sequence[int]],
        fields: Mapping[str, Sequence[torch.Tensor]],
        subset: Sequence[int],
        families: Sequence[Family],
    ) -> list[PackedBatch]:
        """Families cut to `subset` (a subset shares at least the family's prefix), members contiguous."""
        chosen = set(subset)
        fams = [Family(kept, f.prefix_len) for f in families if (kept := tuple(m for m in f.members if m in chosen))]
        lengths = [len(x) for x in input_ids]
        batches: list[PackedBatch] = []
        for bin_ in plan_families(fams, lengths, self.config.micro_batch_tokens):
            order = [m for f in bin_ for m in f.members]
            b = pack(input_ids, fields, order, pad_to_multiple_of=self.config.pad_to_multiple_of, pad_id=self.pad_id)
            firsts = itertools.accumulate((len(f.members) for f in bin_), initial=0)
            b.families = tuple((k, len(f.members), f.prefix_len) for k, f in zip(firsts, bin_, strict=False))
            batches.append(b)
        return batches

    def _forwards(self, batches: list[PackedBatch], fields: Sequence[str], *, at_least_one: bool) -> list[PackedBatch]:
        """This rank's micro-batches, then loss-free dummies where collectives need them.

        Under FSDP every rank runs as many forwards as the busiest one (each
        gathers parameters from all); with `at_least_one` (a backward follows)
        an idle rank still runs one, for DDP's gradient all-reduce.
        """
        if self.fsdp:
            batches = matched(batches, self.world, lambda: self._dummy_batch(fields))
        if at_least_one and not batches:
            batches = [self._dummy_batch(fields)]
        return batches

    def _dummy_batch(self, fields: Sequence[str]) -> PackedBatch:
        """A 2-token batch with loss mask 0: keeps DDP's collective calls matched on an idle rank."""
        ids = [[self.pad_id, self.pad_id]]
        return pack(
            ids, {f: [torch.zeros(2)] for f in fields}, [0], pad_to_multiple_of=self.config.pad_to_multiple_of
        )

    @torch.no_grad()
    def _aux_logprobs(
        self, model: nn.Module, batches: Sequence[PackedBatch], disable_adapter: bool = False
    ) -> dict[int, torch.Tensor]:
        """No-grad logprobs per sample index for `batches` (reference or proximal pass)."""
        out: dict[int, torch.Tensor] = {}
        was_training = model.training
        model.eval()
        ctx: AbstractContextManager[Any] = model.disable_adapter() if disable_adapter else _null()  # type: ignore[operator]
        real = len(batches)
        if model is self.model or (model is self.reference and self.reference_module is not None):
            batches = self._forwards(list(batches), list(batches[0].fields) if batches else ["loss_mask"],
                                     at_least_one=False)  # fmt: skip
        try:
            with ctx:
                for k, b in enumerate(batches):
                    b = b.to(self.device)
                    with self._autocast():
                        lp, _ = self._logprobs(model, b)
                    if k >= real:  # a dummy forward (FSDP): no sample's values
                        continue
                    for i, part in zip(b.sample_indices, b.split(lp.float().cpu()), strict=True):
                        out[i] = part
        finally:
            model.train(was_training)
        return out

    def _reference_logprobs(self, batches: Sequence[PackedBatch]) -> dict[int, torch.Tensor]:
        if self.reference is not None:
            return self._aux_logprobs(self.reference, batches)
        return self._aux_logprobs(self.model, batches, disable_adapter=True)

    # ------------------------------------------------------------------ training
    def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        """One RL step on a batch of groups; returns metrics. Increments `policy_version`."""
        return self._step(groups, apply=True)

    def compute_gradients(self, groups: Sequence[Group]) -> dict[str, float]:
        """The gradient of a full-batch update, left in `.grad`: no optimizer, critic or LR step.

        Needs epochs=1 and mini_batches=1 (one update per batch). For tests and tools.
        """
        if (self.config.epochs, self.config.mini_batches) != (1, 1):
            raise ValueError("compute_gradients needs trainer.epochs=1 and trainer.mini_batches=1")
        return self._step(groups, apply=False)

    def _step(self, groups: Sequence[Group], *, apply: bool) -> dict[str, float]:
        t0 = time.perf_counter()
        cfg = self.config
        skipped_before = self.skipped_updates
        nested = [[t.tokens() for t in g.trajectories] for g in groups if g.trajectories]
        samples = [s for g in nested for s in g]
        trajectories = [t for g in groups for t in g.trajectories]  # aligned with samples
        if not samples:
            raise ValueError("train_step got no trajectories")
        ids = [s.input_ids for s in samples]
        base = _base_fields(samples)
        mine = shard(len(samples), self.world)
        families = None
        if cfg.shared_prefix:  # once per step: ids and masks are the same for every epoch and mini-batch
            starts = list(itertools.accumulate((len(g) for g in nested), initial=0))
            groups = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
            masks = [m.tolist() for m in base["loss_mask"]]
            families = find_families(groups, ids, masks, min_prefix=cfg.shared_prefix_min_tokens)
        aux_batches = self._pack(ids, base, mine, families)
        metrics: dict[str, float] = {}

        ref: dict[int, torch.Tensor] = {}
        if cfg.kl.enabled:
            ref = self._reference_logprobs(aux_batches)
            if cfg.kl.in_reward:
                ref = all_gather_dict(ref, self.world)
        values: dict[int, torch.Tensor] = {}
        if self.critic is not None:
            critic_batches = self._forwards(list(aux_batches), list(base), at_least_one=False)
            values = all_gather_dict(
                self.critic.values(critic_batches, extra_forwards=len(critic_batches) - len(aux_batches)), self.world
            )
        updates = cfg.epochs * cfg.mini_batches
        prox: dict[int, torch.Tensor] = self._aux_logprobs(self.model, aux_batches) if updates > 1 else {}

        from agentrl.trainers.advantages import compute_advantages

        kl_pen = None
        if cfg.kl.enabled and cfg.kl.in_reward:
            flat_pen = [
                cfg.kl.coef
                * kl_estimate(base["behaviour_logprobs"][i], ref[i], cfg.kl.estimator)
                * base["loss_mask"][i]
                for i in range(len(samples))
            ]
            kl_pen = _nest(flat_pen, nested)
            metrics["kl/in_reward_mean"] = float(
                torch.cat(flat_pen).sum() / max(float(torch.cat(base["loss_mask"]).sum()), 1.0)
            )
        adv = compute_advantages(
            nested,
            cfg.advantage,
            gamma=cfg.gamma,
            lam=cfg.critic.lam if cfg.critic is not None else 1.0,
            eps=cfg.adv_eps,
            kl_penalty=kl_pen,
            values=_nest([values[i] for i in range(len(samples))], nested) if values else None,
            step_weight=cfg.gigpo.step_weight if cfg.gigpo is not None else 1.0,
            step_norm=cfg.gigpo.step_norm if cfg.gigpo is not None else "std",
        )
        metrics |= adv.metrics

        fields = dict(base)
        fields["advantages"] = adv.advantages
        if prox:
            fields["prox_logprobs"] = [prox.get(i, torch.zeros(len(ids[i]))) for i in range(len(samples))]
        if ref and not cfg.kl.in_reward:
            fields["ref_logprobs"] = [ref.get(i, torch.zeros(len(ids[i]))) for i in range(len(samples))]
        if values:
            fields["old_values"] = [values[i] for i in range(len(samples))]
            fields["returns"] = adv.returns

        sums: dict[str, float] = {}
        stats = MismatchStats()
        recorder = TokenStatsRecorder() if cfg.record_token_stats else None
        partition = _split(len(samples), cfg.mini_batches)
        first_epoch_batches: list[PackedBatch] = []
        mine_set = set(mine)
        for _epoch in range(cfg.epochs):
            for part in partition:
                local = [i for i in part if i in mine_set]
                batches = self._pack(ids, fields, local, families)
                first = _epoch == 0
                if first:
                    first_epoch_batches.extend(batches)
                counts = _counts(fields["loss_mask"], part)
                part_sums = self._accumulate(
                    batches, counts, fields, stats if first else None, recorder if first else None
                )
                for k, v in part_sums.items():
                    sums[k] = sums.get(k, 0.0) + v
                if not apply:
                    self._reduce_sp_gradients()
                    continue
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + self._optimizer_step()
                if self.critic is not None:
                    crit = self.critic.update(self._forwards(batches, list(fields), at_least_one=True), counts[1])
                    sums["critic/loss"] = sums.get("critic/loss", 0.0) + float(
                        all_reduce_sum(torch.tensor(crit["critic/loss_local"]), self.world)
                    )
        if recorder is not None:
            recorder.write(trajectories, fields["loss_mask"], fields["advantages"])
        pack_metrics = self._padding_metrics(first_epoch_batches, ids)
        if cfg.shared_prefix and first_epoch_batches:
            real = sum(b.num_tokens - b.num_pad for b in first_epoch_batches)
            run = sum(layout_cost(b.cu_seqlens.tolist(), b.families) for b in first_epoch_batches)
            pack_metrics["pack/shared_prefix_saved"] = 1.0 - run / max(real, 1)
        metrics |= self._finish(sums, stats, updates, len(samples), pack_metrics)
        metrics["optim/skipped_updates"] = float(self.skipped_updates - skipped_before)
        if apply:
            self._advance_schedule()
            self.step += 1
            self.policy_version += 1
        metrics["policy_version"] = float(self.policy_version)
        metrics["autocast_bf16"] = float(self.autocast_dtype is torch.bfloat16)
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["time/tokens_per_s"] = metrics.get("pack/tokens", 0.0) / max(metrics["time/step_s"], 1e-9)
        return metrics

    def _accumulate(
        self,
        batches: list[PackedBatch],
        counts: tuple[int, int, dict[int, int]],
        fields: Mapping[str, Sequence[torch.Tensor]],
        stats: MismatchStats | None,
        recorder: TokenStatsRecorder | None = None,
    ) -> dict[str, float]:
        """Forward/backward over this rank's micro-batches of one mini-batch; grads accumulate.

        `stats` and `recorder` (first epoch only) collect the mismatch diagnostics and the
        per-token values for `info["token_stats"]` from the same forward pass.
        """
        cfg = self.config
        num_seqs, num_tokens, seq_len = counts
        self.optimizer.zero_grad(set_to_none=True)
        real = len(batches)
        batches = self._forwards(batches, list(fields), at_least_one=True)
        sums = torch.zeros(5, dtype=torch.float64)  # loss, pg, kl, entropy_sum, clipped_tokens
        for k, b in enumerate(batches):
            b = b.to(self.device)
            f = b.fields
            lengths = torch.tensor([seq_len.get(i, 0) for i in b.sample_indices] + [1], dtype=torch.float32)
            agg = aggregation_weights(
                f["loss_mask"],
                b.seq_ids,
                cfg.loss_agg,
                num_seqs=num_seqs,
                num_tokens=num_tokens,
                seq_lengths=lengths,
            )
            with maybe_no_sync(self.logprob_module, sync=k == len(batches) - 1):
                with self._autocast():
                    logp, entropy = self._logprobs(self.model, b, with_entropy=True)
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
                (loss * self.grad_scale).backward()
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
        """Clip and apply the accumulated gradients; returns the norm before clipping.

        A non-finite norm (a NaN or inf anywhere in the gradients: a NaN
        reward, an overflow) skips the update and counts it in
        `skipped_updates`: one AdamW step on NaN gradients would make every
        weight NaN, and the engine would serve them. Every rank sees the same
        (all-reduced) norm, so all skip together.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._reduce_sp_gradients()
        norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm or math.inf)))
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            self.skipped_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm  # under FSDP the norm over all shards

    def _advance_schedule(self) -> None:
        """One LR-schedule step per train step, applied or skipped (torch warns when no update ran yet)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()

    def _reduce_sp_gradients(self) -> None:
        if self.sp_groups is not None and not self.fsdp:  # FSDP reduces them itself
            from agentrl.trainers.sequence_parallel import reduce_gradients

            reduce_gradients([p for p in self.model.parameters() if p.requires_grad], self.sp_groups)

    def _padding_metrics(
        self, batches: Sequence[PackedBatch], ids: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        lengths = [len(x) for x in ids]
        local = padding_stats(batches, lengths) if batches else {}
        vec = torch.tensor(
            [
                sum(b.num_pad for b in batches),
                sum(b.num_tokens for b in batches),
                sum(len(b.sample_indices) * max(lengths[i] for i in b.sample_indices) for b in batches),
                local.get("pack/micro_batches", 0.0),
                local.get("pack/tokens", 0.0),
            ],
            dtype=torch.float64,
        )
        pad, total, padded_total, mbs, real = all_reduce_sum(vec, self.world).tolist()
        return {
            "pack/padding_fraction": pad / total if total else 0.0,
            "pack/padded_layout_padding_fraction": 1.0 - real / padded_total if padded_total else 0.0,
            "pack/micro_batches": mbs,
            "pack/tokens": real,
        }

    def _finish(
        self,
        sums: dict[str, float],
        stats: MismatchStats,
        updates: int,
        num_samples: int,
        pack_metrics: dict[str, float],
    ) -> dict[str, float]:
        out = {k: v / updates for k, v in sums.items()}
        merged = all_reduce_sum(stats.as_tensor(), self.world)
        maxes = all_reduce_max(
            torch.tensor([stats.max_abs_dlogp, stats.staleness_max], dtype=torch.float64), self.world
        )
        stats.merge_(merged)
        stats.max_abs_dlogp, stats.staleness_max = (float(x) for x in maxes.tolist())
        out |= stats.metrics()
        out |= pack_metrics
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        out["samples"] = float(num_samples)
        return out

    # ------------------------------------------------------------------ SFT
    def sft_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step of masked cross-entropy (token mean over loss-mask tokens)."""
        t0 = time.perf_counter()
        if not samples:
            raise ValueError("sft_step got no samples")
        ids = [s.input_ids for s in samples]
        fields = {"loss_mask": _base_fields(samples)["loss_mask"]}
        mine = shard(len(samples), self.world)
        batches = self._forwards(self._pack(ids, fields, mine), ["loss_mask"], at_least_one=True)
        num_tokens = int(sum(float(m.sum()) for m in fields["loss_mask"]))
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(1, dtype=torch.float64)
        for k, b in enumerate(batches):
            b = b.to(self.device)
            with maybe_no_sync(self.logprob_module, sync=k == len(batches) - 1):
                with self._autocast():
                    logp, _ = self._logprobs(self.model, b)
                loss = -(logp.float() * b.fields["loss_mask"]).sum() / max(num_tokens, 1)
                (loss * self.grad_scale).backward()
            total += float(loss.detach())
        lr = float(self.scheduler.get_last_lr()[0])  # the rate this step used, as train_step reports it
        skipped_before = self.skipped_updates
        grad_norm = self._optimizer_step()
        self._advance_schedule()
        self.step += 1
        self.policy_version += 1
        pad = self._padding_metrics(batches, ids)
        return {
            "sft/loss": float(all_reduce_sum(total, self.world)[0]),
            "grad_norm": grad_norm,
            "optim/skipped_updates": float(self.skipped_updates - skipped_before),
            "lr": lr,
            "time/step_s": time.perf_counter() - t0,
            "policy_version": float(self.policy_version),
            **pad,
        }

    # ------------------------------------------------------------------ state
    def state_for_engines(
        self, *, dtype: torch.dtype | None = None, bucket_mb: float | None = None
    ) -> NamedTensorBuckets:
        """The current weights as HF-named tensors in buckets (LoRA merged).

        Under FSDP every rank must read it to the end, in step: each tensor is
        gathered from all ranks as it is read (the `ray` trainer does this).
        """
        return NamedTensorBuckets(
            lambda: ((name, full_tensor(t)) for name, t in hf_named_tensors(self.model)),
            bucket_mb=bucket_mb or self.config.weight_bucket_mb,
            dtype=dtype,
        )

    def save(self, path: str, extra_state: Mapping[str, Any] | None = None) -> None:
        """Checkpoint: HF model dir, optimizer, scheduler, RNG, step, `extra_state` (JSON)."""
        from agentrl.trainers.checkpoint import save_checkpoint

        save_checkpoint(self, path, dict(extra_state or {}))

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by `save`; returns its `extra_state`."""
        from agentrl.trainers.checkpoint import load_checkpoint

        return load_checkpoint(self, path)


# ---------------------------------------------------------------------- helpers
class _null(AbstractContextManager[None]):
    def __exit__(self, *exc: object) -> None:
        return None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


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


def _lr_lambda(cfg: TrainerConfig) -> Any:
    warmup, total, floor = cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant" or total is None:
            return 1.0
        progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
        if cfg.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _base_fields(samples: Sequence[TrainSample]) -> dict[str, list[torch.Tensor]]:
    """loss_mask / behaviour_logprobs / versions per sample; the first token is never a loss token."""
    masks, behav, versions = [], [], []
    for s in samples:
        n = len(s.input_ids)
        if not (len(s.loss_mask) == len(s.behaviour_logprobs) == len(s.versions) == n):
            raise ValueError(f"trajectory {s.trajectory_id}: per-token lists differ in length")
        m = torch.tensor(s.loss_mask, dtype=torch.float32)
        if n:
            m[0] = 0.0  # nothing precedes it, so it has no logprob to train
        lp = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if not bool(torch.isfinite(lp[m.bool()]).all()):
            raise ValueError(f"trajectory {s.trajectory_id}: non-finite behaviour logprob on a sampled token")
        masks.append(m)
        behav.append(lp * m)
        versions.append(torch.tensor(s.versions, dtype=torch.float32))
    return {"loss_mask": masks, "behaviour_logprobs": behav, "versions": versions}


def _nest(flat: Sequence[torch.Tensor], nested: Sequence[Sequence[TrainSample]]) -> list[list[torch.Tensor]]:
    out, i = [], 0
    for g in nested:
        out.append(list(flat[i : i + len(g)]))
        i += len(g)
    return out


def _split(n: int, parts: int) -> list[list[int]]:
    """Contiguous, nearly equal mini-batches of sample indices (empty ones dropped)."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(parts) if bounds[k + 1] > bounds[k]]


def _counts(masks: Sequence[torch.Tensor], part: Sequence[int]) -> tuple[int, int, dict[int, int]]:
    """(sequences, loss tokens, loss tokens per sample) of a mini-batch, over all ranks' samples."""
    per = {i: int(masks[i].sum()) for i in part}
    return len(part), sum(per.values()), per

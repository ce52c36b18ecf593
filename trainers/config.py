"""TrainerConfig: every knob of the torch trainer, validated, with no torch import.

One flat-ish pydantic model with a few nested sections (kl, off_policy, lora,
critic, gigpo), each `extra="forbid"`, so a misspelt key is an error that names it.
Defaults are a plain GRPO setup: no KL, no off-policy correction, bf16
autocast, token-mean loss.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae", "turn_rloo", "gigpo"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3"]
OffPolicyMode = Literal["none", "tis", "mis_token", "mis_seq", "decoupled"]
Schedule = Literal["constant", "linear", "cosine"]
StepNorm = Literal["std", "mean"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KLConfig(_Section):
    """KL to a frozen reference policy. `coef=0` (the default) disables it and the
    reference model is never loaded."""

    coef: float = Field(
        0.0,
        ge=0.0,
        description="weight of the KL penalty; 0 disables KL and the reference model is never loaded",
    )
    estimator: KLEstimator = Field(
        "k3",
        description="per-token KL estimator (Schulman): k1 = log(pi/ref), k2 = 0.5*log(pi/ref)^2, "
        "k3 = ref/pi - 1 - log(ref/pi)",
    )
    in_reward: bool = Field(
        False,
        description="subtract coef*KL(behaviour || ref) from token rewards "
        "(group estimators: episode return) instead of a KL loss term",
    )

    @property
    def enabled(self) -> bool:
        return self.coef > 0.0


class OffPolicyConfig(_Section):
    """Correction for the gap between the behaviour policy (engine) and the trainer.

    - none: PPO ratio against the behaviour logprobs, no reweighting.
    - tis: truncated importance weight min(pi_prox/pi_behav, tis_cap).
    - mis_token: token weight pi_prox/pi_behav, zeroed outside [mis_low, mis_high].
    - mis_seq: per-sequence geometric-mean weight, whole sequence zeroed outside the bounds.
    - decoupled: AReaL decoupled PPO, clip around pi_prox, weight pi_prox/pi_behav
      (zeroed above `decoupled_cap` when set).
    """

    mode: OffPolicyMode = Field(
        "none",
        description="none: PPO ratio vs behaviour logprobs, weight 1; else ratio vs proximal logprobs, "
        "weight prox/behav truncated (tis), masked (mis_token/mis_seq) or AReaL (decoupled)",
    )
    tis_cap: float = Field(
        2.0, gt=0.0, description="tis: cap of the truncated importance weight min(prox/behav, cap)"
    )
    mis_low: float = Field(
        0.5,
        ge=0.0,
        description="mis_token/mis_seq: token (or sequence geo-mean) weights below this are zeroed "
        "(must be < mis_high)",
    )
    mis_high: float = Field(
        2.0,
        gt=0.0,
        description="mis_token/mis_seq: token (or sequence geo-mean) weights above this are zeroed",
    )
    decoupled_cap: float | None = Field(
        None,
        gt=0.0,
        description="decoupled: tokens whose weight prox/behav exceeds this get weight 0; None = no cap",
    )

    @model_validator(mode="after")
    def _bounds(self) -> OffPolicyConfig:
        if self.mis_low >= self.mis_high:
            raise ValueError(
                f"off_policy.mis_low ({self.mis_low}) must be < off_policy.mis_high ({self.mis_high})"
            )
        return self


class LoRAConfig(_Section):
    """LoRA adapters via peft; the reference policy is then the base with adapters off."""

    r: int = Field(16, ge=1, description="LoRA rank of the adapter matrices")
    alpha: float = Field(
        32.0, gt=0.0, description="LoRA alpha: the adapter update B@A is scaled by alpha / r"
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability on the LoRA branch's input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="linear modules that get adapters (peft target_modules; default: attention + MLP)",
    )


class CriticConfig(_Section):
    """The PPO value model: a copy of a causal LM backbone plus a scalar head."""

    model_path: str | None = Field(
        None, description="model to initialise the value backbone from; None = the policy's initial weights"
    )
    lr: float = Field(
        1e-5, gt=0.0, description="AdamW learning rate of the critic (constant, no LR schedule)"
    )
    value_clip: float | None = Field(
        0.2,
        gt=0.0,
        description="clip the new value to old value +- this in the PPO value loss; None = unclipped",
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0.0, description="clip the critic's global gradient norm to this; None = no clipping"
    )
    lam: float = Field(
        0.95, ge=0.0, le=1.0, description="GAE lambda (1 = Monte-Carlo returns, 0 = one-step TD)"
    )


class GigpoConfig(_Section):
    """GiGPO's step advantage (advantage: gigpo); see trainers/turn_credit.py."""

    step_weight: float = Field(
        1.0, ge=0.0, description="weight of the step advantage added to the episode advantage (0 = GRPO)"
    )
    step_norm: StepNorm = Field(
        "std", description="step groups: std = z-score within the group, mean = centre only"
    )


class DeepSpeedConfig(_Section):
    """DeepSpeed ZeRO as the data-parallel engine (data_parallel: deepspeed); see trainers/deepspeed_backend.py."""

    zero_stage: Literal[2, 3] = Field(
        2,
        description="2: optimizer state and gradients partitioned over the ranks, a full copy of the weights on "
        "each; 3: the weights partitioned too (gathered per module for each forward, per bucket for the engines "
        "and checkpoints)",
    )
    offload_optimizer: bool = Field(
        False,
        description="keep the optimizer state (and its step) in CPU memory: DeepSpeed's CPU Adam, a C++ op "
        "built on first use (needs g++ and ninja)",
    )
    offload_params: bool = Field(
        False, description="zero_stage 3 only: keep the partitioned weights in CPU memory between uses"
    )
    param_persistence_threshold: int = Field(
        100_000,
        ge=0,
        description="zero_stage 3: parameters with fewer elements stay whole on every rank (norms, biases: "
        "fewer gathers); 0 partitions every parameter",
    )

    @model_validator(mode="after")
    def _offload_needs_stage3(self) -> DeepSpeedConfig:
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(
                f"trainer.deepspeed.offload_params=true needs trainer.deepspeed.zero_stage=3 (got {self.zero_stage})"
            )
        return self


class TrainerConfig(_Section):
    """Configuration of `TorchTrainer` (plugin name `torch`)."""

    # algorithm
    advantage: AdvantageName = Field(
        "grpo",
        description="estimator: grpo (group z-score), dr_grpo (group mean-centred), rloo (leave-one-out), "
        "reinforce_pp (batch-whitened returns), gae (critic), turn_rloo (leave-one-out baseline per turn), "
        "gigpo (episode + same-state step groups)",
    )
    gamma: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="discount factor: per turn for grpo/dr_grpo/rloo/turn_rloo/gigpo, per sampled token for "
        "reinforce_pp/gae",
    )
    adv_eps: float = Field(
        1e-6,
        gt=0.0,
        description="added to the std when normalising advantages (grpo group std, batch whitening)",
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: a clipped ratio per token; gspo: one clipped ratio per sequence (its geometric mean, "
        "GSPO); gspo wants far smaller clip_low/clip_high (the paper: 3e-4 / 4e-4)",
    )
    loss_agg: LossAgg = Field(
        "token_mean",
        description="token_mean: mean over the batch's loss tokens; seq_mean_token_mean: mean of "
        "per-sequence token means; seq_mean_token_sum: mean of per-sequence token sums (Dr. GRPO)",
    )
    clip_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="PPO ratio clip range below 1: the ratio is clipped at 1 - clip_low"
    )
    clip_high: float = Field(
        0.28,
        ge=0.0,
        description="PPO ratio clip range above 1: clipped at 1 + clip_high "
        "(clip-higher/DAPO when > clip_low)",
    )
    dual_clip: float | None = Field(
        None,
        gt=1.0,
        description="dual-clip bound c (Ye et al.): for A < 0 the token loss is capped at -c*A; None = off",
    )
    kl: KLConfig = Field(
        KLConfig.model_validate({}),
        description="KL penalty to a frozen reference policy (off while kl.coef = 0)",
    )
    entropy_coef: float = Field(
        0.0, description="weight of the entropy bonus: loss -= coef * H, aggregated like the loss; 0 = off"
    )
    off_policy: OffPolicyConfig = Field(
        OffPolicyConfig.model_validate({}),
        description="importance-weight correction for the behaviour (engine) vs trainer policy mismatch",
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="the engines' sampling temperature: logits are divided by it before logprobs and entropy; "
        "in a run always rollout.sampling.temperature (set that)",
    )
    critic: CriticConfig | None = Field(
        None, description="PPO value model; required by advantage=gae, an error with the other estimators"
    )
    gigpo: GigpoConfig | None = Field(
        None, description="GiGPO step-advantage settings; only with advantage=gigpo (defaults when absent)"
    )

    # optimisation
    lr: float = Field(1e-6, gt=0.0, description="peak AdamW learning rate of the policy")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW (decoupled) weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2)")
    schedule: Schedule = Field(
        "constant",
        description="LR after warmup: constant, or linear/cosine decay to min_lr_ratio*lr at total_steps",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="linear LR warmup over the first N trainer steps (train_step/sft_step calls); 0 = none",
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        description="trainer step (warmup included) where linear/cosine decay ends; required by them",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="final LR of linear/cosine decay as a fraction of lr"
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0.0, description="clip the policy's global gradient norm to this; None = no clipping"
    )
    epochs: int = Field(
        1, ge=1, description="passes over each batch; >1 (or mini_batches > 1) adds a proximal-logprob pass"
    )
    mini_batches: int = Field(
        1, ge=1, description="optimizer steps per pass: the batch's samples are split into this many parts"
    )

    # efficiency
    micro_batch_tokens: int = Field(
        4096,
        ge=16,
        description="token budget of one packed row (one forward/backward); "
        "a longer sequence gets a row of its own",
    )
    pad_to_multiple_of: int = Field(
        1, ge=1, description="pad each packed row's length up to a multiple of this; 1 = no padding"
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="token positions whose logits (N x vocab) are materialised at once, checkpointed",
    )
    # with bf16 or fp32, master weights and the lm_head/logprobs stay fp32
    dtype: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="bf16: autocast where the device has native bf16 "
        "(CUDA; CPU with AVX512-BF16/AMX), else fp32",
    )
    attention: Literal["packed_sdpa", "sdpa", "eager", "flash_attention_2"] = Field(
        "packed_sdpa",
        description="packed_sdpa: one causal SDPA per packed sequence (cost sum len^2); sdpa/eager: HF "
        "block-diagonal mask (T^2 per row); flash_attention_2: varlen kernel (GPU)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="HF activation checkpointing of the policy: less memory, forward recomputed in backward",
    )
    shared_prefix: bool = Field(
        False,
        description="run each group's common loss-free prompt prefix once, suffixes attend to its KV "
        "(exact); a group over micro_batch_tokens splits into parts, the prefix once per part; "
        "needs packed_sdpa and sequence_parallel_size=1",
    )
    shared_prefix_min_tokens: int = Field(
        16, ge=1, description="groups whose common prefix is shorter than this many tokens run per sample"
    )
    lora: LoRAConfig | None = Field(
        None, description="train LoRA adapters instead of all weights; None = full fine-tuning"
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks that split each packed row with ring attention (world size a multiple of it); "
        "1 = off",
    )
    data_parallel: Literal["ddp", "fsdp", "deepspeed"] = Field(
        "ddp",
        description="how ranks share the model: ddp = a full copy per rank, gradients all-reduced; fsdp = "
        "parameters, gradients and optimizer state sharded over the ranks (FSDP2), for models whose "
        "training state does not fit one device (with lora: the frozen base is sharded too; with gae: the "
        "critic too; with sequence_parallel_size > 1: over every rank, SP ranks included); deepspeed = "
        "DeepSpeed ZeRO-2/3 with optional CPU offload (settings in trainer.deepspeed)",
    )
    deepspeed: DeepSpeedConfig | None = Field(
        None,
        description="DeepSpeed ZeRO settings; only with data_parallel=deepspeed (defaults when absent: ZeRO-2)",
    )
    delta_sync: bool = Field(
        False,
        description="full fine-tuning: a sync sends only the elements whose bits changed in the engine's "
        "dtype since the version it serves (engines that take patches: hf); costs one copy of the model "
        "in that dtype",
    )
    weight_bucket_mb: float = Field(
        256.0, gt=0.0, description="max size in MiB of one bucket of weights sent to the engines"
    )
    record_token_stats: bool = Field(
        True,
        description="store per-token trainer logprobs, advantages, IS weights in info['token_stats'] "
        "for replay (~3x trajectory size)",
    )

    seed: int = Field(
        0,
        description="seed of the python, numpy and torch RNGs, set when the trainer is built; in a run always "
        "run.seed (set that)",
    )
    device: str = Field(
        "cpu",
        description="torch device of the policy, reference and critic (cpu, cuda, cuda:1, ...); "
        "the ray trainer places each rank on its own GPU instead (num_gpus_per_rank)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.advantage == "gae" and self.critic is None:
            raise ValueError("trainer.advantage='gae' needs a trainer.critic section (e.g. critic: {})")
        if self.advantage != "gae" and self.critic is not None:
            raise ValueError(
                f"trainer.critic is only used by trainer.advantage='gae' (got {self.advantage!r}): "
                "remove it or set advantage: gae"
            )
        if self.gigpo is not None and self.advantage != "gigpo":
            raise ValueError(
                f"trainer.gigpo is only used by trainer.advantage='gigpo' (got {self.advantage!r}): "
                "remove it or set advantage: gigpo"
            )
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"trainer.schedule={self.schedule!r} needs trainer.total_steps")
        if self.shared_prefix and (self.attention != "packed_sdpa" or self.sequence_parallel_size != 1):
            raise ValueError(
                "trainer.shared_prefix=true needs trainer.attention='packed_sdpa' and "
                f"trainer.sequence_parallel_size=1 (got {self.attention!r}, {self.sequence_parallel_size})"
            )
        if self.delta_sync and (self.lora is not None or self.data_parallel != "ddp"):
            raise ValueError(
                "trainer.delta_sync=true is for full fine-tuning with data_parallel='ddp' (got "
                f"lora={'set' if self.lora is not None else None}, data_parallel={self.data_parallel!r}): "
                "a LoRA sync already sends the adapter alone"
            )
        if self.deepspeed is not None and self.data_parallel != "deepspeed":
            raise ValueError(
                f"trainer.deepspeed is only used by trainer.data_parallel='deepspeed' (got {self.data_parallel!r}): "
                "remove it or set data_parallel: deepspeed"
            )
        if self.data_parallel == "deepspeed" and self.sequence_parallel_size > 1:
            raise ValueError(
                "trainer.data_parallel='deepspeed' does not combine with trainer.sequence_parallel_size="
                f"{self.sequence_parallel_size} (use data_parallel: fsdp for sharding with sequence parallelism)"
            )
        if self.kl.in_reward and not self.kl.enabled:
            raise ValueError("trainer.kl.in_reward=true needs trainer.kl.coef > 0")
        return self

    @property
    def zero(self) -> DeepSpeedConfig | None:
        """The DeepSpeed settings in effect (defaults without a section); None unless data_parallel=deepspeed."""
        if self.data_parallel != "deepspeed":
            return None
        return self.deepspeed or DeepSpeedConfig.model_validate({})

"""TrainerConfig: every knob of the torch trainer, validated, with no torch import.

One flat-ish pydantic model with a few nested sections (kl, off_policy, lora,
critic), each `extra="forbid"`, so a misspelt key is an error that names it.
Defaults are a plain GRPO setup: no KL, no off-policy correction, bf16
autocast, token-mean loss.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AdvantageName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3"]
OffPolicyMode = Literal["none", "tis", "mis_token", "mis_seq", "decoupled"]
Schedule = Literal["constant", "linear", "cosine"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KLConfig(_Section):
    """KL to a frozen reference policy. `coef=0` (the default) disables it and the
    reference model is never loaded."""

    coef: float = Field(0.0, ge=0.0)
    estimator: KLEstimator = "k3"
    in_reward: bool = False  # True: subtract coef*KL from per-token rewards instead of adding a loss term

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
      (capped at `decoupled_cap` when set).
    """

    mode: OffPolicyMode = "none"
    tis_cap: float = Field(2.0, gt=0.0)
    mis_low: float = Field(0.5, ge=0.0)
    mis_high: float = Field(2.0, gt=0.0)
    decoupled_cap: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _bounds(self) -> OffPolicyConfig:
        if self.mis_low >= self.mis_high:
            raise ValueError(
                f"off_policy.mis_low ({self.mis_low}) must be < off_policy.mis_high ({self.mis_high})"
            )
        return self


class LoRAConfig(_Section):
    """LoRA adapters via peft; the reference policy is then the base with adapters off."""

    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class CriticConfig(_Section):
    """The PPO value model: a copy of a causal LM backbone plus a scalar head."""

    model_path: str | None = None  # None: start from the policy's weights
    lr: float = Field(1e-5, gt=0.0)
    value_clip: float | None = Field(0.2, gt=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)


class TrainerConfig(_Section):
    """Configuration of `TorchTrainer` (plugin name `torch`)."""

    # algorithm
    advantage: AdvantageName = "grpo"
    gamma: float = Field(1.0, ge=0.0, le=1.0)  # discount over turns / tokens (returns, GAE)
    adv_eps: float = Field(1e-6, gt=0.0)  # added to std when normalising
    loss_agg: LossAgg = "token_mean"
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.28, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)  # Ye et al. dual clip bound c for negative advantages
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: float = 0.0
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    temperature: float = Field(1.0, gt=0.0)  # the engines' sampling temperature; logits are divided by it
    critic: CriticConfig | None = None

    # optimisation
    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Schedule = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, ge=1)  # required by linear/cosine
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    epochs: int = Field(1, ge=1)  # passes over each batch
    mini_batches: int = Field(1, ge=1)  # optimizer steps per pass

    # efficiency
    micro_batch_tokens: int = Field(4096, ge=16)  # token budget of one packed forward/backward
    pad_to_multiple_of: int = Field(1, ge=1)  # pad each packed row (e.g. for sequence-parallel splits)
    logprob_chunk_tokens: int = Field(1024, ge=1)  # rows of logits alive at once
    # bf16: autocast where the device has native bf16 (CUDA; CPUs with AVX512-BF16/AMX), else fp32.
    # Master weights and the lm_head/logprobs stay fp32 either way.
    dtype: Literal["bf16", "fp32"] = "bf16"
    # packed_sdpa: one causal SDPA per packed sequence (cost sum len^2, no mask); sdpa/eager: HF's
    # block-diagonal mask from the position ids (cost T^2 per row); flash_attention_2: varlen kernel (GPU)
    attention: Literal["packed_sdpa", "sdpa", "eager", "flash_attention_2"] = "packed_sdpa"
    gradient_checkpointing: bool = False
    # GRPO groups share their prompt: run each group's common loss-free prefix once and let the
    # samples' suffixes attend to its KV (exact logprobs and gradients, far fewer tokens when
    # prompts dominate). Needs attention=packed_sdpa and sequence_parallel_size=1.
    shared_prefix: bool = False
    shared_prefix_min_tokens: int = Field(16, ge=1)  # shorter common prefixes are not worth a family
    lora: LoRAConfig | None = None
    sequence_parallel_size: int = Field(1, ge=1)
    weight_bucket_mb: float = Field(256.0, gt=0.0)
    # per-token trainer logprobs, advantages and importance weights into each trajectory's
    # info["token_stats"] for the replay token view (about triples a stored trajectory's size)
    record_token_stats: bool = True

    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.advantage == "gae" and self.critic is None:
            raise ValueError("trainer.advantage='gae' needs a trainer.critic section (e.g. critic: {})")
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"trainer.schedule={self.schedule!r} needs trainer.total_steps")
        if self.shared_prefix and (self.attention != "packed_sdpa" or self.sequence_parallel_size != 1):
            raise ValueError(
                "trainer.shared_prefix=true needs trainer.attention='packed_sdpa' and "
                f"trainer.sequence_parallel_size=1 (got {self.attention!r}, {self.sequence_parallel_size})"
            )
        if self.kl.in_reward and not self.kl.enabled:
            raise ValueError("trainer.kl.in_reward=true needs trainer.kl.coef > 0")
        return self

"""Configuration of the rollout side: grouping, concurrency, staleness, budgets, failures.

Kept apart from `rollout.py` so the run config can be validated (and the CLI can
explain it) without importing any rollout machinery.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.types import ErrorClass


class FailurePolicy(enum.StrEnum):
    """What to do with an episode that ended in a classified error."""

    DROP_GROUP = "drop_group"  # discard the whole GRPO group it belongs to
    ZERO_REWARD = "zero_reward"  # keep it, reward 0 (the model learns to avoid it)
    RETRY = "retry"  # re-run the episode, up to `max_retries` times, then drop the group


def _default_error_policy() -> dict[ErrorClass, FailurePolicy]:
    return {
        ErrorClass.FORMAT: FailurePolicy.ZERO_REWARD,
        ErrorClass.TOOL: FailurePolicy.ZERO_REWARD,
        ErrorClass.TIMEOUT: FailurePolicy.ZERO_REWARD,
        ErrorClass.ENV: FailurePolicy.RETRY,
        ErrorClass.SANDBOX: FailurePolicy.RETRY,
        ErrorClass.ENGINE: FailurePolicy.RETRY,
        ErrorClass.REWARD: FailurePolicy.RETRY,
        ErrorClass.AGENT: FailurePolicy.RETRY,
    }


class SamplingConfig(BaseModel):
    """Sampling parameters shared by every generate call of a run."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(
        1.0, ge=0.0, description="sampling temperature; a training run needs > 0 (the trainer scores the "
        "sampled distribution); 0 = greedy, for evaluation (run.eval_temperature)"
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the top tokens up to this mass; 1 = off"
    )
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens; 0 = no limit")
    stop_strings: list[str] = Field(
        default_factory=list,
        description="strings that end a reply, besides the eos ids (the stop string is kept in the reply)",
    )


class OverlongConfig(BaseModel):
    """DAPO's soft overlong punishment, per model turn.

    A turn whose reply is longer than `max_new_tokens_per_turn - buffer_tokens`
    loses reward linearly in the excess, up to `penalty` at the full cap; the
    cut goes into that turn's reward (turn-level credit sees where it came
    from) and the episode's `reward_breakdown["overlong"]`.
    """

    model_config = ConfigDict(extra="forbid")

    buffer_tokens: int = Field(ge=1, description="the last tokens before the per-turn cap where the penalty ramps up")
    penalty: float = Field(1.0, gt=0, description="reward taken from a reply that reaches max_new_tokens_per_turn")


class SkipSolvedConfig(BaseModel):
    """When a training task counts as solved for good (docs/rollout.md)."""

    model_config = ConfigDict(extra="forbid")

    times: int = Field(1, ge=1, description="groups with every sample solved, after which the task is skipped")
    reward: float = Field(1.0, description="the reward at which a sample counts as solved")


class RolloutConfig(BaseModel):
    """How episodes are produced and handed to the trainer."""

    model_config = ConfigDict(extra="forbid")

    group_size: int = Field(8, ge=1, description="samples per task (G in GRPO)")
    groups_per_step: int = Field(4, ge=1, description="groups in one optimizer step")
    max_in_flight: int = Field(32, ge=1, description="episodes running concurrently")
    max_staleness: int = Field(
        1, ge=0, description="max policy versions a sample may lag the trainer; 0 = synchronous"
    )
    queue_groups: int = Field(8, ge=1, description="finished groups buffered before back-pressure")
    # budgets
    max_turns: int = Field(8, ge=1, description="model turns per episode; then it ends truncated (max_turns)")
    max_total_tokens: int = Field(
        4096,
        ge=16,
        description="tokens of the whole episode, prompt and env messages included; then it ends truncated",
    )
    max_new_tokens_per_turn: int = Field(
        512, ge=1, description="tokens generated per turn; a longer reply is cut and still goes to the env"
    )
    max_tool_output_tokens: int = Field(
        512, ge=1, description="tool messages are cut to this many tokens (a truncation marker included)"
    )
    tool_output_truncation: str = Field(
        "middle",
        pattern="^(left|right|middle)$",
        description="side cut from long tool output: right keeps the head, left the tail, middle both ends",
    )
    overlong: OverlongConfig | None = Field(
        None, description="DAPO soft overlong punishment of long replies ({buffer_tokens, penalty}); null = off"
    )
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig.model_validate({}), description="sampling of every model turn"
    )
    # deadlines (seconds)
    episode_timeout_s: float = Field(
        600.0, gt=0, description="seconds for a whole episode; then it fails with a timeout error"
    )
    generate_timeout_s: float = Field(300.0, gt=0, description="seconds per engine generate call")
    env_timeout_s: float = Field(60.0, gt=0, description="seconds per env.reset, env.step or env.close call")
    # failures
    on_error: dict[ErrorClass, FailurePolicy] = Field(
        default_factory=_default_error_policy,
        description="error class -> drop_group, zero_reward (keep, reward 0) or retry; "
        "classes left out keep their default",
    )
    max_retries: int = Field(
        2, ge=0, description="reruns of an episode whose error class maps to retry; then the group is dropped"
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal (a new one starts)"
    )
    skip_solved: SkipSolvedConfig | None = Field(
        None,
        description="keep tasks the policy always solves out of later epochs ({times, reward}); null = never",
    )

    @model_validator(mode="after")
    def _complete_error_policy(self) -> RolloutConfig:
        if self.overlong is not None and self.overlong.buffer_tokens > self.max_new_tokens_per_turn:
            raise ValueError(
                f"overlong.buffer_tokens={self.overlong.buffer_tokens} is more than "
                f"max_new_tokens_per_turn={self.max_new_tokens_per_turn}"
            )
        defaults = _default_error_policy()
        for kind, policy in defaults.items():
            self.on_error.setdefault(kind, policy)
        return self

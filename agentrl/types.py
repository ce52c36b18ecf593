"""Core data types that flow from environments through the engine to the trainer.

Everything here is plain Python (dataclasses, lists, floats): no torch, no numpy,
so env authors and the replay UI pay for nothing heavy. Every type serialises to
JSON-able dicts and back without loss; the schema carries a version number so a
store written today can be read (or refused clearly) by tomorrow's code.
"""

from __future__ import annotations

import enum
import hashlib
import math
import os
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Literal

SCHEMA_VERSION = 1

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "abort"]
JSON = Any


def new_id() -> str:
    """A short random identifier for trajectories, groups and tool calls (16 hex digits)."""
    return os.urandom(8).hex()


class ErrorClass(enum.StrEnum):
    """Why an episode failed; the rollout manager applies a per-class policy."""

    ENV = "env"
    TOOL = "tool"
    SANDBOX = "sandbox"
    ENGINE = "engine"
    FORMAT = "format"
    TIMEOUT = "timeout"
    REWARD = "reward"
    AGENT = "agent"  # a remote agent (env agent, mode remote) never claimed the episode in time


@dataclass(slots=True)
class ToolCall:
    """One call the model asked for. `arguments` is the parsed JSON object.

    A call the model attempted but that could not be parsed (broken JSON, no
    name) carries `error`; a ToolEnv answers it with a tool message explaining
    the problem instead of running anything.
    """

    name: str
    arguments: dict[str, JSON]
    id: str = field(default_factory=new_id)
    error: str | None = None

    def to_dict(self) -> dict[str, JSON]:
        d: dict[str, JSON] = {"id": self.id, "name": self.name, "arguments": self.arguments}
        if self.error is not None:
            d["error"] = self.error
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON]) -> ToolCall:
        return cls(name=d["name"], arguments=dict(d["arguments"]), id=d["id"], error=d.get("error"))

    def to_chat(self) -> dict[str, JSON]:
        """The OpenAI/HF chat-template shape of this call."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class Message:
    """One chat message. Tool results carry the id of the call they answer."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, JSON]:
        d: dict[str, JSON] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON]) -> Message:
        return cls(
            role=d["role"],
            content=d.get("content", ""),
            tool_calls=[ToolCall.from_dict(c) for c in d.get("tool_calls", [])],
            tool_call_id=d.get("tool_call_id"),
            name=d.get("name"),
        )

    def to_chat(self) -> dict[str, JSON]:
        """The dict a Hugging Face chat template expects."""
        d: dict[str, JSON] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_chat() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d


@dataclass(slots=True)
class Completion:
    """What an engine returns for one generate call, kept verbatim.

    `logprobs[i]` is the log-probability of `ids[i]` under the distribution the
    engine actually sampled from; `versions[i]` the policy version that produced it.
    """

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if not (len(self.ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"Completion lengths differ: ids={len(self.ids)} "
                f"logprobs={len(self.logprobs)} versions={len(self.versions)}"
            )


@dataclass(slots=True)
class EpisodeError:
    """A classified failure stored on the trajectory it ended."""

    kind: ErrorClass
    message: str
    turn: int | None = None

    def to_dict(self) -> dict[str, JSON]:
        return {"kind": self.kind.value, "message": self.message, "turn": self.turn}

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON]) -> EpisodeError:
        return cls(kind=ErrorClass(d["kind"]), message=d["message"], turn=d.get("turn"))


@dataclass(slots=True)
class Turn:
    """One model turn: its token span in the trajectory and what came of it.

    `start:end` indexes the sampled tokens of this turn in `Trajectory.token_ids`.
    `reward` is the per-turn reward the env gave at the step after it (0.0 if none).
    `policy` names the policy that sampled it in a multi-policy run (`policies:`);
    None in a single-policy run. Each policy trains on its own turns only.
    """

    start: int
    end: int
    reward: float = 0.0
    tool_calls: list[str] = field(default_factory=list)
    info: dict[str, JSON] = field(default_factory=dict)
    policy: str | None = None

    def to_dict(self) -> dict[str, JSON]:
        d: dict[str, JSON] = {
            "start": self.start,
            "end": self.end,
            "reward": _float_to_json(self.reward),
            "tool_calls": list(self.tool_calls),
            "info": self.info,
        }
        if self.policy is not None:
            d["policy"] = self.policy
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON]) -> Turn:
        return cls(
            start=d["start"],
            end=d["end"],
            reward=_float_from_json(d.get("reward", 0.0)),
            tool_calls=list(d.get("tool_calls", [])),
            info=dict(d.get("info", {})),
            policy=d.get("policy"),
        )


@dataclass(slots=True)
class TrainSample:
    """Exactly what the trainer needs from one trajectory (aligned per token).

    `behaviour_logprobs[t]` and `versions[t]` are meaningful only where
    `loss_mask[t] == 1` (they are 0.0 and -1 elsewhere). `turn_states[k]` names
    the state turn k acted on (`Trajectory.turn_states`); turn-level credit
    estimators group turns that share it. Empty when unknown.
    """

    input_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float
    turn_spans: list[tuple[int, int]]
    turn_rewards: list[float]
    group_id: str
    trajectory_id: str
    turn_states: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Trajectory:
    """One finished episode, token-exact.

    The four per-token lists are aligned with `token_ids`: the prompt and every
    env/tool message have mask 0, logprob 0.0 and version -1; every token the
    policy sampled has mask 1 and the engine's logprob and policy version.
    """

    task_id: str
    env: str
    messages: list[Message]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    terminated: bool = False
    truncated: bool = False
    truncation_reason: str | None = None
    error: EpisodeError | None = None
    group_id: str = ""
    sample_index: int = 0
    seed: int | None = None
    task: dict[str, JSON] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, JSON] = field(default_factory=dict)
    id: str = field(default_factory=new_id)
    schema_version: int = SCHEMA_VERSION
    prompt_messages: int | None = None
    """How many leading `messages` were the prompt the episode started from (the env's
    opening: system prompt, few-shot demonstrations, the task); the rest are the episode's
    own turns and replies. None when not recorded (older trajectories): readers infer it
    (`agentrl.store.summary.prompt_length`)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"Trajectory {self.id}: per-token lists differ in length "
                f"(ids={n} mask={len(self.loss_mask)} logprobs={len(self.logprobs)} "
                f"versions={len(self.versions)})"
            )

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def policy_versions(self) -> tuple[int, int] | None:
        """(oldest, newest) policy version among sampled tokens, None if none."""
        vs = list(self._sampled_versions())
        return (min(vs), max(vs)) if vs else None

    @property
    def oldest_version(self) -> int | None:
        """Oldest policy version among sampled tokens, None if none (`policy_versions[0]`)."""
        return min(self._sampled_versions(), default=None)

    def _sampled_versions(self) -> Iterator[int]:
        """The versions of the sampled tokens (mask 1), in order."""
        if len(self.versions) != len(self.loss_mask):
            raise ValueError(
                f"Trajectory {self.id}: versions ({len(self.versions)}) and loss_mask "
                f"({len(self.loss_mask)}) differ in length"
            )
        return compress(self.versions, self.loss_mask)

    @property
    def policies(self) -> list[str]:
        """The policies that sampled this trajectory's turns, in order of first turn (empty: single-policy run)."""
        return list(dict.fromkeys(t.policy for t in self.turns if t.policy is not None))

    def tokens(self, policy: str | None = None) -> TrainSample:
        """The trainer's view of this trajectory: it shares the per-token lists (no copy; readers never write).

        With `policy`, the view of that policy's trainer: the other policies' turns
        are context (loss mask 0), and only its own turns keep their spans and rewards.
        """
        if policy is not None:
            return self._policy_tokens(policy)
        return TrainSample(
            input_ids=self.token_ids,
            loss_mask=self.loss_mask,
            behaviour_logprobs=self.logprobs,
            versions=self.versions,
            reward=self.reward,
            turn_spans=[(t.start, t.end) for t in self.turns],
            turn_rewards=[t.reward for t in self.turns],
            group_id=self.group_id,
            trajectory_id=self.id,
            turn_states=self.turn_states(),
        )

    def _policy_tokens(self, policy: str) -> TrainSample:
        mask = [0] * len(self.loss_mask)
        mine = [i for i, t in enumerate(self.turns) if t.policy == policy]
        for i in mine:
            turn = self.turns[i]
            mask[turn.start : turn.end] = self.loss_mask[turn.start : turn.end]
        states = self.turn_states()
        return TrainSample(
            input_ids=self.token_ids,
            loss_mask=mask,
            behaviour_logprobs=self.logprobs,
            versions=self.versions,
            reward=self.reward,
            turn_spans=[(self.turns[i].start, self.turns[i].end) for i in mine],
            turn_rewards=[self.turns[i].reward for i in mine],
            group_id=self.group_id,
            trajectory_id=self.id,
            turn_states=[states[i] for i in mine],
        )

    def turn_states(self) -> list[str]:
        """A key per turn for the state the policy acted on (GiGPO's anchor state).

        The env's own key when it gave one (`state_key` in the reset or step
        info, stored as `Turn.info["state_key"]`: ``"env:<key>"``); otherwise a
        digest of the tokens the policy read since its previous turn, i.e. the
        observation as rendered (the whole prompt for turn 0: ``"obs:<hex>"``).
        Turns of one group with equal keys faced the same observation.
        """
        keys: list[str] = []
        previous_end = 0
        for turn in self.turns:
            key = turn.info.get("state_key")
            if key is not None:
                keys.append(f"env:{key}")
            else:
                seen = array("q", self.token_ids[previous_end : turn.start]).tobytes()
                keys.append("obs:" + hashlib.blake2b(seen, digest_size=12).hexdigest())
            previous_end = turn.end
        return keys

    def to_dict(self) -> dict[str, JSON]:
        return {
            "schema_version": self.schema_version,
            "id": self.id,
            "task_id": self.task_id,
            "env": self.env,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "seed": self.seed,
            "task": self.task,
            "messages": [m.to_dict() for m in self.messages],
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": [_float_to_json(x) for x in self.logprobs],
            "versions": list(self.versions),
            "turns": [t.to_dict() for t in self.turns],
            "reward": _float_to_json(self.reward),
            "reward_breakdown": {k: _float_to_json(v) for k, v in self.reward_breakdown.items()},
            "terminated": self.terminated,
            "truncated": self.truncated,
            "truncation_reason": self.truncation_reason,
            "error": self.error.to_dict() if self.error else None,
            "metrics": {k: _float_to_json(v) for k, v in self.metrics.items()},
            "info": self.info,
            "prompt_messages": self.prompt_messages,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON]) -> Trajectory:
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"trajectory schema_version {version} is not supported "
                f"(this agentrl reads version {SCHEMA_VERSION})"
            )
        return cls(
            id=d["id"],
            task_id=d["task_id"],
            env=d["env"],
            group_id=d.get("group_id", ""),
            sample_index=d.get("sample_index", 0),
            seed=d.get("seed"),
            task=dict(d.get("task", {})),
            messages=[Message.from_dict(m) for m in d["messages"]],
            token_ids=list(d["token_ids"]),
            loss_mask=list(d["loss_mask"]),
            logprobs=[_float_from_json(x) for x in d["logprobs"]],
            versions=list(d["versions"]),
            turns=[Turn.from_dict(t) for t in d.get("turns", [])],
            reward=_float_from_json(d.get("reward", 0.0)),
            reward_breakdown={k: _float_from_json(v) for k, v in d.get("reward_breakdown", {}).items()},
            terminated=d.get("terminated", False),
            truncated=d.get("truncated", False),
            truncation_reason=d.get("truncation_reason"),
            error=EpisodeError.from_dict(d["error"]) if d.get("error") else None,
            metrics={k: _float_from_json(v) for k, v in d.get("metrics", {}).items()},
            info=dict(d.get("info", {})),
            prompt_messages=d.get("prompt_messages"),
        )


@dataclass(slots=True)
class Group:
    """The G trajectories sampled for one task (a GRPO group)."""

    task_id: str
    trajectories: list[Trajectory]
    id: str = field(default_factory=new_id)
    task: dict[str, JSON] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def oldest_version(self) -> int | None:
        """Oldest policy version any sampled token in the group came from."""
        return min((v for t in self.trajectories if (v := t.oldest_version) is not None), default=None)

    def to_dict(self) -> dict[str, JSON]:
        return {
            "id": self.id,
            "task_id": self.task_id,
            "task": self.task,
            "trajectories": [t.to_dict() for t in self.trajectories],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON]) -> Group:
        return cls(
            id=d["id"],
            task_id=d["task_id"],
            task=dict(d.get("task", {})),
            trajectories=[Trajectory.from_dict(t) for t in d["trajectories"]],
        )


def _float_to_json(x: float) -> JSON:
    """JSON has no inf/nan; encode them as strings so round-trips are lossless."""
    if math.isfinite(x):
        return x
    return repr(x)  # 'inf', '-inf', 'nan'


def _float_from_json(x: JSON) -> float:
    return float(x)

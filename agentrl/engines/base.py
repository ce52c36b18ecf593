"""The inference-engine contract: token ids in, token ids (with logprobs) out.

Engines never see text they must re-tokenise: the rollout loop hands them the
exact prompt ids of the conversation and stores the ids they return verbatim.
The contract is shaped so that vLLM's AsyncLLM fits without an adapter layer
(generate, weight updates tagged with a version, pause/resume via health/close).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from agentrl.types import Completion, FinishReason


@dataclass(frozen=True, slots=True)
class Sampling:
    """Per-request sampling parameters. `top_k=0` and `top_p=1.0` disable them."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    grammar: str | None = None  # constrained decoding (llguidance Lark, agentrl.engines.constrained); only engines
    # with `constrained_decoding = True` serve it, sampling from the masked distribution (exact logprobs)
    adapter: str | None = None  # the named LoRA adapter that samples this request (an `AdapterEngine`'s);
    # None: the engine's own weights (what `update_weights` set)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")

    def for_turn(self, max_tokens: int, seed: int | None) -> Sampling:
        """This sampling with another `max_tokens` and `seed` (one per turn of an episode; validated as any)."""
        return Sampling(max_tokens, self.temperature, self.top_p, self.top_k, self.stop_ids, self.stop_strings, seed,
                        self.grammar, self.adapter)

    def with_adapter(self, adapter: str | None) -> Sampling:
        """This sampling served by another adapter (one policy per agent of a multi-agent episode)."""
        return Sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, self.stop_ids, self.stop_strings,
                        self.seed, self.grammar, adapter)


class EngineClosed(RuntimeError):
    """The engine was closed (or can serve no more) while a request was waiting or running."""


class BusyClock:
    """Seconds during which at least one request was in flight: `enter()`/`leave()` around each request.

    What engines whose model runs elsewhere (another process, other actors)
    report as `busy_seconds()`, the input of `rollout/engine_busy`.
    """

    __slots__ = ("_since", "_total", "active")

    def __init__(self) -> None:
        self.active = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        if self.active == 0:
            self._since = time.monotonic()
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._total += time.monotonic() - self._since

    def seconds(self) -> float:
        return self._total + (time.monotonic() - self._since if self.active else 0.0)


@dataclass(slots=True)
class EngineHealth:
    """A cheap status report; `busy_fraction` is time spent generating / wall time."""

    ok: bool
    policy_version: int
    in_flight: int = 0
    busy_fraction: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class WeightSource(Protocol):
    """Named tensors handed from a trainer to engines, in buckets.

    Buckets bound the memory of one transfer and let a broadcast overlap with the
    next bucket's preparation. A tensor is whatever the engine's framework uses
    (torch.Tensor for hf/vLLM); the core never touches it.
    """

    def buckets(self) -> Iterator[Sequence[tuple[str, Any]]]: ...


@runtime_checkable
class CountedWeightSource(Protocol):
    """A weight source that counts what it handed out (the run logs it as `weight_sync/*`)."""

    sent_bytes: int
    sent_buckets: int


@runtime_checkable
class DeltaWeightSource(Protocol):
    """A delta sync's weight source: `ratio` of the whole model's bytes it sent, `full` when it had no base
    for the engine's version and sent the whole model (the run logs `weight_sync/delta_*`)."""

    full: bool

    @property
    def ratio(self) -> float: ...


@runtime_checkable
class DeltaEngine(Protocol):
    """An engine that applies a delta sync's patches (`agentrl.weights.delta`) to weights of its own.

    `weights_dtype()` is the dtype of its weights (a torch dtype name, e.g. "bfloat16"), the dtype a
    delta is computed in, or None while it cannot take a delta (e.g. it samples with the trainer's base).
    """

    def weights_dtype(self) -> str | None: ...


@runtime_checkable
class BaseSharingEngine(Protocol):
    """An engine that can sample with the trainer's own frozen base tensors (one copy of the base).

    `share_base_with(trainer)` takes the trainer's LoRA policy when it offers one
    (`agentrl.trainer.AdapterTrainer`) and says whether it did; from then on
    `weights_wanted` is "adapter" and a sync hands the engine the adapter alone.
    """

    weights_wanted: str

    def share_base_with(self, trainer: object) -> bool: ...


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """The shape of a LoRA adapter, what an engine needs to hold one: rank, alpha (scale = alpha / rank),
    and the module names it wraps (peft's `target_modules`, e.g. ("q_proj", "v_proj"))."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]


def canonical_adapter_name(name: str, adapter: str = "default") -> str:
    """A LoRA tensor's name without its adapter segment and peft prefix, as engines are handed it.

    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` and
    `model.layers.0.self_attn.q_proj.lora_A.default.weight` both become
    `model.layers.0.self_attn.q_proj.lora_A.weight`: one adapter's tensors carry
    no name of their own, the engine files them under the name it is given.
    """
    name = name.removeprefix("base_model.model.")
    return name.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that holds several named LoRA adapters over one base (several policies, one base copy).

    A request picks its adapter with `Sampling.adapter` (None: the engine's own
    weights). `update_adapter(name, weights, version, spec)` adds adapter `name`
    or replaces its tensors: `weights` yields its LoRA tensors under canonical
    names (`canonical_adapter_name`: `<module>.lora_A.weight`,
    `<module>.lora_B.weight`); afterwards `adapter_versions[name] == version`
    and every token sampled with it carries that version (tokens a running
    request sampled before carry the old one, as with `update_weights`).
    `remove_adapter(name)` frees one. A request naming an adapter the engine
    does not hold fails with `KeyError` naming the adapters it has.
    """

    adapter_versions: Mapping[str, int]

    async def update_adapter(self, name: str, weights: WeightSource, version: int, spec: AdapterSpec) -> None: ...

    async def remove_adapter(self, name: str) -> None: ...


@runtime_checkable
class InferenceEngine(Protocol):
    """Token-in/token-out generation with versioned weights.

    Many concurrent `generate` calls are the normal case; an engine batches them.
    `policy_version` is the version of the weights now serving new tokens.
    An engine may also stream (`StreamingEngine.generate_stream`: tokens as they
    are sampled); the gateway uses it for SSE answers. Two optional methods feed the run's metrics: `busy_seconds() -> float`
    (`rollout/engine_busy`) and `stats() -> Mapping[str, float]` (cheap
    counters, logged as `rollout/engine/<key>`).
    """

    policy_version: int

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion: ...

    async def update_weights(self, weights: WeightSource, version: int) -> None: ...

    async def health(self) -> EngineHealth: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Tokens an engine sampled since its previous delta of the same request (ids, logprobs, versions).

    The last delta of a request carries its `finish_reason` (its ids may be empty); the
    deltas joined are exactly the `Completion` `generate` would have returned.
    """

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None = None


@runtime_checkable
class StreamingEngine(Protocol):
    """The optional streaming half of the engine contract: tokens as they are sampled.

    An engine offers it by having `generate_stream`; callers go through
    `generate_stream`, the function below, which falls back to one delta holding
    `generate`'s whole completion for engines without it.
    """

    def generate_stream(self, prompt_ids: Sequence[int], sampling: Sampling) -> AsyncIterator[TokenDelta]: ...


async def generate_stream(engine: InferenceEngine, prompt_ids: Sequence[int], sampling: Sampling) -> AsyncIterator[TokenDelta]:
    """The engine's tokens as they are sampled (its `generate_stream`), else its whole completion as one delta."""
    if not isinstance(engine, StreamingEngine):
        done = await engine.generate(prompt_ids, sampling)
        yield TokenDelta(list(done.ids), list(done.logprobs), list(done.versions), done.finish_reason)
        return
    deltas: AsyncIterator[TokenDelta] = engine.generate_stream(prompt_ids, sampling)
    try:
        async for delta in deltas:
            yield delta
    finally:
        aclose = getattr(deltas, "aclose", None)
        if aclose is not None:
            await aclose()


def join_deltas(deltas: Sequence[TokenDelta]) -> Completion:
    """The completion a request's deltas make (the finish reason of the last one)."""
    finish = deltas[-1].finish_reason if deltas else None
    if finish is None:
        raise ValueError("join_deltas: the stream ended without a finish reason")
    return Completion([i for d in deltas for i in d.ids], [x for d in deltas for x in d.logprobs],
                      [v for d in deltas for v in d.versions], finish)


class CheckpointConfig(BaseModel):
    """Config fields naming the checkpoint an engine serves; in a run they follow the `model` section."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        default="smollm2-135m-instruct",
        description="local path, alias or hub id; in a run always model.path (set that)",
    )
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        default="auto",
        description="weight dtype; auto = the checkpoint's own (in a run it defaults to model.dtype)",
    )


class ServingConfig(CheckpointConfig):
    """Config fields every engine that runs a model has: weight-update mode, eos, seed, deadlines."""

    update_mode: Literal["finish_old", "continue_new"] = Field(
        default="continue_new",
        description="continue_new: running requests go on with the new weights; "
        "finish_old: they finish on the old ones first",
    )
    stop_on_eos: bool = Field(default=True, description="also stop at the model's eos ids")
    seed: int = Field(default=0, description="seed of the sampler for requests that carry no seed of their own")
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="seconds a generate call may wait for its completion"
    )
    update_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds per update_weights call, finish_old's wait for running requests included",
    )

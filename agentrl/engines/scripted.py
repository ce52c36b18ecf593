"""A scripted inference engine: canned replies with a realistic timing model.

It is a real engine (registered as `scripted`), used by tests, benchmarks and
dry runs of an env: replies come from a list (cycled) or a function of the
prompt text; reply lengths and latencies follow fixed, uniform or long-tailed
lognormal distributions; an optional number of slots models a batched engine
whose throughput is bounded, so the busy fraction means what it means for a
real engine (slot-seconds used / slot-seconds available).

Per-token policy versions are exact under the timing model: token i is
"produced" at `start + ttft + i * per_token_s`, and carries the version that
was serving at that instant, so weight updates during a long reply give mixed
versions just like a real engine with `update_mode="continue_new"`.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.chat.conversation import ChatTokenizer
from agentrl.engines.base import AdapterSpec, EngineHealth, Sampling, TokenDelta, WeightSource
from agentrl.types import Completion, FinishReason


class Distribution(BaseModel):
    """A non-negative random quantity: fixed, uniform(low, high) or lognormal(median, sigma).

    `cap` bounds samples of the long-tailed lognormal (0 = no cap).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["fixed", "uniform", "lognormal"] = Field(
        default="fixed", description="fixed (value), uniform (low, high) or lognormal (median, sigma, cap)"
    )
    value: float = Field(default=0.0, ge=0.0, description="the value of a fixed distribution")
    low: float = Field(default=0.0, ge=0.0, description="lower bound of a uniform distribution")
    high: float = Field(default=0.0, ge=0.0, description="upper bound of a uniform distribution (>= low)")
    median: float = Field(default=1.0, gt=0.0, description="median of a lognormal distribution")
    sigma: float = Field(
        default=1.0, ge=0.0, description="std of the log of a lognormal distribution; larger = longer tail"
    )
    cap: float = Field(default=0.0, ge=0.0, description="upper bound on lognormal samples; 0 = no cap")

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.value
        if self.kind == "uniform":
            if self.high < self.low:
                raise ValueError(f"uniform distribution needs low <= high, got low={self.low} high={self.high}")
            return rng.uniform(self.low, self.high)
        x = rng.lognormvariate(0.0, self.sigma) * self.median
        return min(x, self.cap) if self.cap > 0 else x

    @property
    def is_zero(self) -> bool:
        return self.kind == "fixed" and self.value == 0.0


class ScriptedEngine:
    """Returns scripted replies as token ids, with a configurable timing model.

    An `AdapterEngine` too: named adapters (`Sampling.adapter`) reply as the base
    does and tag their tokens with the adapter's version, for multi-policy dry runs.
    """

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

        replies: list[str] = Field(
            default_factory=lambda: ["OK."],
            min_length=1,
            description="reply texts, used in order and cycled (a reply_fn passed in code replaces them)",
        )
        length: Distribution | None = Field(
            default=None, description="if set, each reply is padded with filler_id / cut to a sampled token count"
        )
        filler_id: int = Field(default=32, ge=0, description="token id used to pad replies to a sampled length")
        append_eos: bool = Field(default=True, description="end each reply with the tokenizer's first eos id")
        ttft_s: Distribution = Field(default_factory=Distribution, description="time to first token")
        per_token_s: float = Field(default=0.0, ge=0.0, description="decode time per token in one slot")
        max_concurrency: int = Field(default=0, ge=0, description="generation slots; 0 = unlimited")
        logprob: float = Field(default=-1.0, le=0.0, description="logprob reported for every sampled token")
        error_rate: float = Field(default=0.0, ge=0.0, le=1.0, description="fraction of generate calls that raise")
        update_latency_s: float = Field(
            default=0.0, ge=0.0, description="seconds each update_weights call sleeps (a simulated copy)"
        )
        seed: int = Field(default=0, description="seed of the sampled lengths, latencies and errors")

    def __init__(
        self,
        config: ScriptedEngine.Config | None = None,
        *,
        tokenizer: ChatTokenizer | None = None,
        reply_fn: Callable[[str], str] | None = None,
    ) -> None:
        self.config = config if config is not None else self.Config()
        self.tokenizer = tokenizer
        self.reply_fn = reply_fn
        self.policy_version = 0
        self._rng = random.Random(self.config.seed)
        self._next_reply = 0
        self._encoded: dict[str, list[int]] = {}
        self._shaped: dict[tuple[str, int, tuple[int, ...], tuple[str, ...]], tuple[list[int], FinishReason]] = {}
        self._slots = asyncio.Semaphore(self.config.max_concurrency) if self.config.max_concurrency else None
        # like the slots, the timing model is read once, here
        self._zero_latency = (
            self.config.per_token_s == 0.0 and self.config.ttft_s.is_zero and self._slots is None
        )
        # (time, version) of every weight update, for per-token version tags
        self._update_times: list[float] = []
        self._update_versions: list[int] = []
        self._initial_version = 0
        self._closed = False
        # busy accounting: integral of (active slots / capacity) over time
        self._t0 = time.monotonic()
        self._active = 0
        self._last_change = self._t0
        self._busy_integral = 0.0
        self.calls = 0
        self.tokens_generated = 0
        self.adapter_versions: dict[str, int] = {}  # AdapterEngine: named adapters reply as the base does

    @classmethod
    def from_config(
        cls, config: ScriptedEngine.Config | dict[str, object], *, tokenizer: ChatTokenizer | None = None
    ) -> ScriptedEngine:
        cfg = config if isinstance(config, cls.Config) else cls.Config.model_validate(config)
        return cls(cfg, tokenizer=tokenizer)

    # -- generation -------------------------------------------------------------------------

    def _begin(self, prompt_ids: Sequence[int], sampling: Sampling) -> tuple[list[int], FinishReason]:
        """What every request does first: refuse when closed, count it, fail at `error_rate`, pick the reply."""
        if self._closed:
            raise RuntimeError("scripted engine is closed")
        if sampling.adapter is not None and sampling.adapter not in self.adapter_versions:
            raise KeyError(f"scripted engine holds no adapter {sampling.adapter!r} (it has {sorted(self.adapter_versions)})")
        self.calls += 1
        if self.config.error_rate and self._rng.random() < self.config.error_rate:
            raise RuntimeError("scripted engine failure (error_rate)")
        return self._reply_ids(prompt_ids, sampling)

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        cfg = self.config
        ids, finish = self._begin(prompt_ids, sampling)
        if sampling.adapter is not None:  # an adapter's tokens carry its version (no timing model per adapter)
            await asyncio.sleep(cfg.ttft_s.sample(self._rng) + len(ids) * cfg.per_token_s)
            self.tokens_generated += len(ids)
            return Completion(ids, [cfg.logprob] * len(ids), [self.adapter_versions[sampling.adapter]] * len(ids), finish)
        if self._zero_latency:  # no awaits at all (the rollout-overhead benchmark)
            n = len(ids)
            self.tokens_generated += n
            return Completion(ids, [cfg.logprob] * n, [self.policy_version] * n, finish)
        if self._slots is not None:
            await self._slots.acquire()
        try:
            self._set_active(+1)
            start = time.monotonic()
            ttft = cfg.ttft_s.sample(self._rng)
            await asyncio.sleep(ttft + len(ids) * cfg.per_token_s)
            versions = [self._version_at(start + ttft + i * cfg.per_token_s) for i in range(len(ids))]
        finally:
            self._set_active(-1)
            if self._slots is not None:
                self._slots.release()
        self.tokens_generated += len(ids)
        return Completion(ids, [cfg.logprob] * len(ids), versions, finish)

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: Sampling) -> AsyncIterator[TokenDelta]:
        """The same reply as `generate`, one token per delta, each at its time under the timing model."""
        cfg = self.config
        ids, finish = self._begin(prompt_ids, sampling)
        if self._slots is not None:
            await self._slots.acquire()
        try:
            self._set_active(+1)
            start = time.monotonic()
            ttft = cfg.ttft_s.sample(self._rng)
            await asyncio.sleep(ttft)
            for i, token in enumerate(ids):
                if i:
                    await asyncio.sleep(cfg.per_token_s)  # sleep(0) still lets the reader run between tokens
                if sampling.adapter is not None:
                    version = self.adapter_versions[sampling.adapter]
                else:
                    version = self.policy_version if self._zero_latency else self._version_at(start + ttft + i * cfg.per_token_s)
                self.tokens_generated += 1
                yield TokenDelta([token], [cfg.logprob], [version], finish if i == len(ids) - 1 else None)
            if not ids:
                yield TokenDelta([], [], [], finish)
        finally:
            self._set_active(-1)
            if self._slots is not None:
                self._slots.release()

    def _reply_ids(self, prompt_ids: Sequence[int], sampling: Sampling) -> tuple[list[int], FinishReason]:
        cfg = self.config
        if self.reply_fn is not None:
            text = self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else ""
            reply = self.reply_fn(text)
        else:
            reply = cfg.replies[self._next_reply % len(cfg.replies)]
            self._next_reply += 1
        if cfg.length is not None:
            return self._shape(reply, sampling)
        key = (reply, sampling.max_tokens, sampling.stop_ids, sampling.stop_strings)
        found = self._shaped.get(key)
        if found is None:
            found = self._shaped[key] = self._shape(reply, sampling)
        return found[0].copy(), found[1]

    def _shape(self, reply: str, sampling: Sampling) -> tuple[list[int], FinishReason]:
        """Reply text -> ids, cut by stop strings, length, stop ids and max_tokens."""
        cfg = self.config
        cut_by_string = False
        for s in sampling.stop_strings:
            at = reply.find(s)
            if at >= 0:
                reply, cut_by_string = reply[: at + len(s)], True
        ids = self._encode(reply)
        if cfg.length is not None:
            n = max(1, round(cfg.length.sample(self._rng)))
            ids = ids[:n] + [cfg.filler_id] * (n - len(ids))
        if cfg.append_eos and not cut_by_string and self.tokenizer is not None and self.tokenizer.eos_ids:
            ids = [*ids, self.tokenizer.eos_ids[0]]
        finish: FinishReason = "stop"
        if sampling.stop_ids:
            stops = set(sampling.stop_ids)
            for i, t in enumerate(ids):
                if t in stops:
                    ids = ids[: i + 1]
                    break
        if len(ids) > sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        return ids, finish

    def _encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self.tokenizer.encode(text) if self.tokenizer is not None else list(text.encode())
            self._encoded[text] = ids
        return ids

    def _version_at(self, t: float) -> int:
        i = bisect.bisect_right(self._update_times, t)
        return self._update_versions[i - 1] if i else self._initial_version

    def _set_active(self, delta: int) -> None:
        now = time.monotonic()
        cap = self.config.max_concurrency
        share = min(self._active, cap) / cap if cap else float(self._active > 0)
        self._busy_integral += share * (now - self._last_change)
        self._last_change = now
        self._active += delta

    # -- weights, health, lifecycle -----------------------------------------------------------

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        """Consume the weight buckets (nothing to copy) and serve `version` from now on."""
        for _bucket in weights.buckets():
            pass
        if self.config.update_latency_s:
            await asyncio.sleep(self.config.update_latency_s)
        self.set_version(version)

    async def update_adapter(self, name: str, weights: WeightSource, version: int, spec: AdapterSpec) -> None:
        """Hold adapter `name` at `version` (its tensors are consumed, not used: it replies as the base)."""
        for _bucket in weights.buckets():
            pass
        self.adapter_versions[name] = version

    async def remove_adapter(self, name: str) -> None:
        del self.adapter_versions[name]

    def set_version(self, version: int) -> None:
        """Serve `version` from now on (tokens produced after this instant carry it)."""
        if not self._update_times:
            self._initial_version = self.policy_version
        self._update_times.append(time.monotonic())
        self._update_versions.append(version)
        self.policy_version = version

    def busy_fraction(self) -> float:
        now = time.monotonic()
        self._set_active(0)
        wall = now - self._t0
        return self._busy_integral / wall if wall > 0 else 0.0

    def busy_seconds(self) -> float:
        """Slot-normalised busy time since creation (for windowed busy fractions)."""
        self._set_active(0)
        return self._busy_integral

    def reset_busy(self) -> None:
        """Start a fresh busy-fraction window (e.g. per training step)."""
        self._set_active(0)
        self._t0 = self._last_change = time.monotonic()
        self._busy_integral = 0.0

    async def health(self) -> EngineHealth:
        return EngineHealth(
            ok=not self._closed,
            policy_version=self.policy_version,
            in_flight=self._active,
            busy_fraction=self.busy_fraction(),
            detail={"calls": self.calls, "tokens": self.tokens_generated},
        )

    async def close(self) -> None:
        self._closed = True

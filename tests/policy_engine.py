"""A test `AdapterEngine`: each adapter (None: the engine's own weights) replies with its own function
of the prompt text, and every request's adapter is recorded (`asked`). For multi-policy tests; no model."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.base import AdapterSpec, EngineHealth, Sampling, WeightSource
from agentrl.types import Completion

Reply = Callable[[str], str]


class PolicyEngine:
    """Replies per adapter; tokens carry the adapter's version (`adapter_versions`), or `policy_version`."""

    def __init__(self, tok: SimpleChatTokenizer, replies: Mapping[str | None, Reply]) -> None:
        self.tok = tok
        self.replies = dict(replies)
        self.policy_version = 0
        self.adapter_versions: dict[str, int] = {}
        self.asked: list[str | None] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        self.asked.append(sampling.adapter)
        if sampling.adapter is not None and sampling.adapter not in self.adapter_versions:
            raise KeyError(f"no adapter {sampling.adapter!r}; have {sorted(self.adapter_versions)}")
        reply = self.replies[sampling.adapter](self.tok.decode(list(prompt_ids)))
        ids = [*self.tok.encode(reply), self.tok.eos_ids[0]]
        version = self.policy_version if sampling.adapter is None else self.adapter_versions[sampling.adapter]
        return Completion(ids, [-0.5] * len(ids), [version] * len(ids), "stop")

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        self.policy_version = version

    async def update_adapter(self, name: str, weights: WeightSource, version: int, spec: AdapterSpec) -> None:
        self.adapter_versions[name] = version

    async def remove_adapter(self, name: str) -> None:
        del self.adapter_versions[name]

    async def health(self) -> EngineHealth:
        return EngineHealth(ok=True, policy_version=self.policy_version)

    async def close(self) -> None:
        return None


def take(n: str) -> Reply:
    """A reply function that always says `n`."""
    return lambda prompt: n

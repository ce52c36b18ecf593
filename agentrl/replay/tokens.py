"""Per-token data for the token view: decoded text and every colouring field.

Token ids are all the store keeps, so showing text needs the run's tokenizer:
`TokenDecoder.for_run` picks it from a `spec` ("simple", "none", a model path
or alias) or else from the run config (`replay.tokenizer`, then `model.path`).
A tokenizer that cannot be loaded is not an error: tokens then show as ids.

Trainer-side per-token values live in the trajectory's optional
`info["token_stats"]`, each list aligned with `token_ids` (see docs/replay.md):
`trainer_logprobs`, `advantages`, `is_weights`, `is_mask`. A scalar
`info["advantage"]` is spread over the sampled tokens. Missing ones are null
and the UI shows them as n/a.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.types import JSON, Trajectory

log = logging.getLogger(__name__)

TOKEN_STAT_FIELDS = ("trainer_logprobs", "advantages", "is_weights", "is_mask")


class TokenDecoder:
    """Turns one token id into the text it stands for (cached per id)."""

    def __init__(self, decode: Callable[[Sequence[int]], str] | None, name: str) -> None:
        self._decode = decode
        self.name = name
        self._cache: dict[int, str] = {}

    @classmethod
    def for_run(cls, config: Mapping[str, Any] | None, spec: str | None = None) -> TokenDecoder:
        """The decoder of a run: `spec` if given, else what the run config says."""
        config = config or {}
        if spec is None:
            replay = config.get("replay")
            spec = replay.get("tokenizer") if isinstance(replay, dict) else None
            if spec in (None, "model"):
                model = config.get("model")
                spec = model.get("path") if isinstance(model, dict) else None
        if spec is None or spec == "none":
            return cls(None, "none")
        if spec == "simple":
            from agentrl.chat.conversation import SimpleChatTokenizer

            return cls(SimpleChatTokenizer().decode, "simple")
        try:
            from agentrl.chat.conversation import HFChatTokenizer
            from agentrl.engines.models import ALIASES, cache_root

            path = Path(spec).expanduser()
            if not path.is_dir():  # only what is on disk: never a hub download or a model conversion
                path = cache_root() / "models" / spec.lower()
                if spec.lower() not in ALIASES or not (path / "config.json").exists():
                    return cls(None, f"none ({spec!r} is not on this machine)")
            return cls(HFChatTokenizer.from_pretrained(str(path)).decode, spec)
        except Exception as e:  # any failure just means "show ids"
            log.warning("replay: cannot load tokenizer %r (%s); showing token ids", spec, e)
            return cls(None, f"none ({spec!r} not loadable)")

    def text(self, token_id: int) -> str | None:
        if self._decode is None:
            return None
        s = self._cache.get(token_id)
        if s is None:
            try:
                s = self._decode([token_id])
            except Exception:
                s = f"<{token_id}>"
            self._cache[token_id] = s
        return s


def token_view(traj: Trajectory, decoder: TokenDecoder) -> dict[str, JSON]:
    """Parallel per-token arrays for the UI; absent fields are None."""
    n = len(traj.token_ids)
    stats = traj.info.get("token_stats")
    stats = stats if isinstance(stats, dict) else {}
    out: dict[str, JSON] = {
        "tokenizer": decoder.name,
        "ids": traj.token_ids,
        "text": [decoder.text(i) for i in traj.token_ids] if decoder.name != "none" else None,
        "loss_mask": traj.loss_mask,
        "logprobs": [finite(x) for x in traj.logprobs],
        "versions": traj.versions,
        "turn": _turn_index(traj),
    }
    for name in TOKEN_STAT_FIELDS:
        values = stats.get(name)
        out[name] = [finite(x) for x in values] if isinstance(values, list) and len(values) == n else None
    advantage = traj.info.get("advantage")
    if out["advantages"] is None and isinstance(advantage, int | float):
        out["advantages"] = [float(advantage) if m else None for m in traj.loss_mask]
    return out


def _turn_index(traj: Trajectory) -> list[int]:
    """For each token: the model turn it belongs to, -1 outside model turns."""
    index = [-1] * len(traj.token_ids)
    for k, turn in enumerate(traj.turns):
        for i in range(max(0, turn.start), min(turn.end, len(index))):
            index[i] = k
    return index


def finite(x: Any) -> float | None:
    """A JSON-safe number: non-finite or non-numeric values become None."""
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, int | float) and math.isfinite(x):
        return float(x)
    return None


def json_safe(obj: Any) -> JSON:
    """Recursively replace NaN/inf floats (invalid JSON) with None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj

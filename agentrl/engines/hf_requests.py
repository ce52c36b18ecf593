"""One request of the embedded engine (`hf.HFEngine`): its state, when it finishes, how it resolves.

The worker thread appends sampled tokens to a `Request`, asks `finish_reason`
after each step and hands the outcome to `resolve`, which delivers it on the
caller's event loop (futures are not thread-safe). Kept apart from the
scheduler so the scheduler reads as admission, decode and retirement.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from agentrl.engines.base import Sampling
from agentrl.engines.constrained import GrammarMatcher
from agentrl.engines.hf_sampling import RowSampling
from agentrl.types import Completion, FinishReason


@dataclass(eq=False)
class Request:
    """A prompt being served: its sampling, the caller's future and the tokens sampled so far."""

    prompt: list[int]
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]
    stop_ids: frozenset[int]
    row: RowSampling
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text_len: int = 0
    cancelled: bool = False
    epoch: int = -1  # weights epoch at admission: its KV is cacheable only while that epoch lasts
    updates: asyncio.Queue[int | None] | None = None  # streamed: tokens sampled so far, then None when resolved
    grammar: GrammarMatcher | None = None  # constrained decoding (`Sampling.grammar`): masks each step's logits


def finish_reason(req: Request, tokenizer: Any) -> FinishReason | None:
    """Why `req` ends after its last sampled token (stop id, stop string, max tokens), or None."""
    if req.ids[-1] in req.stop_ids:
        return "stop"
    stops = req.sampling.stop_strings
    if stops:
        text = tokenizer.decode(req.ids)
        for s in stops:
            if text.find(s, max(0, req.text_len - len(s) + 1)) >= 0:
                return "stop"
        req.text_len = len(text)
    if len(req.ids) >= req.sampling.max_tokens:
        return "length"
    return None


def resolve(req: Request, result: Completion | BaseException) -> None:
    """Deliver `result` to the request's future on its own loop (called from the worker thread)."""

    def deliver() -> None:
        if req.future.done():
            return
        if isinstance(result, BaseException):
            req.future.set_exception(result)
        else:
            req.future.set_result(result)
        if req.updates is not None:
            req.updates.put_nowait(None)

    with contextlib.suppress(RuntimeError):  # the caller's loop is already closed
        req.loop.call_soon_threadsafe(deliver)


def retrieved(future: asyncio.Future[Completion]) -> None:
    """Mark a left stream's outcome as seen (no "exception was never retrieved" warning)."""
    if not future.cancelled():
        future.exception()

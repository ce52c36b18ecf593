"""Streamed answers in the OpenAI chunk format: content as it is decoded, tool calls at the end.

`ContentStream` turns sampled token deltas into text pieces that stop where a
tool call may begin; an `AnswerWriter` (here `ChatWriter` for Chat
Completions; the Responses and Messages APIs have their own) frames the
pieces and the final `ChatResult` as the API's stream events.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from agentrl.gateway.protocol import ChatRequest, ChatResult, GatewayError, chat_logprobs, message_dict, usage

STREAM_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>", "{"),
    "json": ("{", "```"),
}
"""Where a tool call may begin in a reply, per parser: streamed content stops there (the calls come at the end)."""


class ChunkHead:
    """The fields every chunk of one streamed answer shares, and the chunk builder."""

    def __init__(self, model: str) -> None:
        self.id = "chatcmpl-" + os.urandom(12).hex()
        self.created = int(time.time())
        self.model = model

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}]}


class ContentStream:
    """The content deltas of a reply while it is sampled: the decoded text, held back where a tool call may begin.

    `markers` are the strings a tool call of the parser starts with (`STREAM_MARKERS`);
    text from the first one (or from a tail that could begin one) waits for the end, when
    the parsed message is known. None holds everything back (a parser whose calls cannot
    be told early). With `strip`, the text is sent as the parser's content is (stripped),
    so the deltas add up to the non-streamed message's content.
    """

    def __init__(self, decode: Callable[[list[int]], str], eos_ids: Sequence[int],
                 markers: tuple[str, ...] | None, *, strip: bool) -> None:
        self.decode = decode
        self.eos = set(eos_ids)
        self.markers = markers
        self.strip = strip
        self.sent = ""
        self.text = ""  # the reply decoded so far (up to `_read` tokens)
        self._prefix = 0  # decoding restarts this many tokens back, so a token's text is read in context
        self._read = 0

    def feed(self, ids: list[int]) -> str:
        """The new content for the ids sampled so far ("" when nothing can be sent yet)."""
        if self.markers is None:
            return ""
        self._decode_new(ids[:-1] if ids and ids[-1] in self.eos else ids)
        text = self.text
        cut = len(text)
        for marker in self.markers:
            at = text.find(marker)
            if at >= 0:
                cut = min(cut, at)
            for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a tail that may grow into the marker
                if text.endswith(marker[:k]):
                    cut = min(cut, len(text) - k)
                    break
        visible = text[:cut].strip() if self.strip else text[:cut]
        if not visible.startswith(self.sent):
            return ""  # the decoded text changed behind what was sent: the rest comes at the end
        piece, self.sent = visible[len(self.sent) :], visible
        return piece

    def _decode_new(self, ids: list[int]) -> None:
        """Extend `text` by the new tokens' text, decoding only a window (never the whole reply again).

        The text of the tokens since `_read` is the decode of the window from `_prefix` minus the
        decode of its first part; it waits while it ends in an incomplete UTF-8 character.
        """
        if len(ids) <= self._read:
            return
        before = self.decode(ids[self._prefix : self._read])
        now = self.decode(ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before) :]
            self._prefix, self._read = self._read, len(ids)


Event = dict[str, Any] | tuple[str, dict[str, Any]]
"""One SSE event: its data (sent as ``data: ...``), or (name, data) for APIs that name their events."""


class AnswerWriter(Protocol):
    """The events of one streamed answer in one API's shape (`Gateway.stream_answer` drives it).

    `opening` comes before the first content (with the result when the answer came in one piece),
    `content` with each new piece of text, `closing` once the reply is parsed (`sent` is the
    content already streamed), `failure` when the call failed after the stream began.
    """

    trailer: bytes  # written after the last event (``data: [DONE]`` for OpenAI chat, nothing for named-event APIs)

    def opening(self, prompt_len: int, result: ChatResult | None) -> list[Event]: ...

    def content(self, piece: str) -> list[Event]: ...

    def closing(self, result: ChatResult, *, sent: str) -> list[Event]: ...

    def failure(self, error: GatewayError) -> Event: ...


class ChatWriter:
    """Chat-completions chunks: a role chunk, content deltas, the calls, the finish chunk, the usage chunk."""

    trailer = b"data: [DONE]\n\n"

    def __init__(self, model: str, request: ChatRequest, decode: Any) -> None:
        self.head = ChunkHead(model)
        self.request = request
        self.decode = decode

    def opening(self, prompt_len: int, result: ChatResult | None) -> list[Event]:
        if result is not None:  # answered at once: the chunks carry the answer's own id
            self.head.id, self.head.created = result.id, result.created
        return [self.head.chunk({"role": "assistant", "content": ""})]

    def content(self, piece: str) -> list[Event]:
        return [self.head.chunk({"content": piece})]

    def closing(self, result: ChatResult, *, sent: str) -> list[Event]:
        return list(final_chunks(self.head, result, self.request, self.decode, sent=sent))

    def failure(self, error: GatewayError) -> Event:
        return error.body()


def final_chunks(
    head: ChunkHead, result: ChatResult, request: ChatRequest, decode: Any, *, sent: str
) -> Iterator[dict[str, Any]]:
    """The chunks after the streamed content `sent`: the rest of the content, the tool calls, the finish chunk
    (with the sampled ids), the usage chunk."""
    chunk = head.chunk
    content = result.message.content or ""
    rest = content[len(sent) :] if content.startswith(sent) else ""
    for piece in _pieces(rest):
        yield chunk({"content": piece})
    for i, call in enumerate(message_dict(result.message).get("tool_calls", [])):
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"], "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
    last = chunk({}, result.finish_reason, token_ids=list(result.completion.ids),
                 policy_versions=list(result.completion.versions))
    if request.logprobs:
        last["choices"][0]["logprobs"] = chat_logprobs(result, decode)
    if result.prompt_ids is not None:
        last["prompt_token_ids"] = result.prompt_ids
    yield last
    if request.include_usage:
        yield {"id": head.id, "object": "chat.completion.chunk", "created": head.created, "model": head.model,
               "choices": [], "usage": usage(result)}


def _pieces(text: str, size: int = 16) -> Sequence[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]

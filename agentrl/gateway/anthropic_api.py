"""The Anthropic Messages API (``POST /v1/messages``) mapped onto the gateway's chat calls.

A Messages request becomes the same `ChatRequest` a Chat Completions call
would give: `system` the system message, `text` blocks the content,
`tool_use` blocks an assistant turn's calls (matched by their ids, as the
OpenAI `tool_calls` are), each `tool_result` block a tool message, `tools`
(`input_schema`) the OpenAI function tools. So the session, its branches and
the token-exact conversation are shared: the same dialogue through either API
gives the same token ids and masks. Replies come back as content blocks with
a `stop_reason`; streamed, as the Messages API's named SSE events
(message_start, content_block_start/delta/stop, message_delta, message_stop).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.gateway.protocol import (
    ChatRequest,
    ChatResult,
    Constraint,
    GatewayError,
    TrainerSampling,
    bad,
    check_sampling,
    forced_call,
    tool_call,
)
from agentrl.gateway.streaming import Event
from agentrl.types import Message, ToolCall

THREADS_KEPT = 256  # replies held per session for `thread: continue`


def _text(content: Any, where: str) -> str:
    """The text of a `system` or `tool_result` content: a string or a list of text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, block in enumerate(content):
            if not isinstance(block, Mapping) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
                raise bad(f"{where}[{i}]: only text blocks are served here, got {kind!r}", where)
            parts.append(str(block.get("text", "")))
        return "".join(parts)
    raise bad(f"{where} must be a string or a list of text blocks", where)


def _message(raw: Any, index: int) -> list[Message]:
    """One Messages-API message as agentrl messages (a user turn with tool results becomes tool messages)."""
    where = f"messages[{index}]"
    if not isinstance(raw, Mapping) or raw.get("role") not in ("user", "assistant"):
        raise bad(f"{where} must be {{role: user|assistant, content}}", f"{where}.role")
    role = raw["role"]
    content = raw.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    text: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append(tool_call(block.get("name"), block.get("input", {}), block.get("id"), at))
        elif kind == "tool_result" and role == "user":
            results.append(Message(role="tool", content=_text(block.get("content"), f"{at}.content"),
                                   tool_call_id=str(block.get("tool_use_id") or "")))
        else:
            raise bad(f"{at}: block type {kind!r} is not served in a {role} message (served: text, "
                      f"{'tool_use' if role == 'assistant' else 'tool_result'})", at)
    if role == "assistant":
        return [Message(role="assistant", content="".join(text), tool_calls=calls)]
    return [*results, Message(role="user", content="".join(text))] if text else results


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list of {name, description?, input_schema}", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, Mapping) else None
            raise bad(f"tools[{i}] must be a client tool {{name, description?, input_schema}}"
                      + (f" (server tool {kind!r} is not served)" if kind else ""), f"tools[{i}]")
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("input_schema") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, Constraint | None]:
    """(auto | none | required, the constraint of `any` / a named `tool`)."""
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, Mapping) else choice
    if kind in (None, "auto", "none"):
        return str(kind or "auto"), None
    if kind == "any":
        return "required", forced_call(None, tools, "tool_choice={type: any}")
    if kind == "tool" and isinstance(choice, Mapping):
        name = choice.get("name")
        return "required", forced_call(name, tools, f"tool_choice={{type: tool, name: {name!r}}}")
    raise bad(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")


@dataclass(slots=True)
class Thread:
    """What a thread holds after one reply (`thread` requests): the conversation so far and its tools."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None


Threads = OrderedDict[str, Thread]


@dataclass(slots=True)
class MessagesCall:
    """A validated Messages request: the chat call it is, and whether its reply is held as a thread."""

    chat: ChatRequest
    threads: Threads | None  # where the reply is stored (a `thread` request), else None

    def keep(self, message_id: str, result: ChatResult) -> None:
        """Hold the conversation with its reply under the reply's id, for `thread: continue`."""
        if self.threads is not None:
            self.threads[message_id] = Thread([*self.chat.messages, result.message], self.chat.tools)
            while len(self.threads) > THREADS_KEPT:
                self.threads.popitem(last=False)


def _thread(body: Mapping[str, Any], threads: Threads) -> Thread | None:
    """The thread a `thread: {type: continue, previous_message_id}` request continues (None for create or none)."""
    thread = body.get("thread")
    if thread is None or (isinstance(thread, Mapping) and thread.get("type") == "create"):
        return None
    if not isinstance(thread, Mapping) or thread.get("type") != "continue":
        raise bad("thread must be {type: create} or {type: continue, previous_message_id}", "thread")
    previous = thread.get("previous_message_id")
    found = threads.get(previous) if isinstance(previous, str) else None
    if found is None:
        raise GatewayError(404, f"thread.previous_message_id {previous!r} is not a reply held by this session "
                           f"(the latest {THREADS_KEPT} are kept)", param="thread", code="thread_not_found")
    for key in ("system", "tools"):
        if body.get(key):
            raise bad(f"{key} comes from the thread on thread.type=continue; leave it out", key)
    return found


def parse_messages_request(body: Any, trainer: TrainerSampling, threads: Threads) -> MessagesCall:
    """Validate a Messages-API body into a `MessagesCall` (errors name the field); `threads` holds the
    session's replies for `thread: continue`."""
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    check_sampling(body, trainer)
    if body.get("thinking") not in (None, {"type": "disabled"}):
        raise bad("thinking is not served: the model's reply is sampled as it is", "thinking")
    continued = _thread(body, threads)
    messages: list[Message] = list(continued.messages) if continued is not None else []
    system = _text(body.get("system"), "system")
    if system:
        messages.append(Message(role="system", content=system))
    for i, m in enumerate(raw):
        messages.extend(_message(m, i))
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop_sequences must be a list of strings", "stop_sequences")
    tools = continued.tools if continued is not None else _tools(body)
    tool_choice, forced = _tool_choice(body, tools)
    chat = ChatRequest(
        messages=messages, tools=tools, tool_choice=tool_choice, constraint=forced,
        max_tokens=max_tokens, stop=tuple(s for s in stop if s),
        seed=body.get("seed") if isinstance(body.get("seed"), int) else None,
        stream=bool(body.get("stream", False)), include_usage=True, logprobs=False, return_token_ids=False,
        model=str(body.get("model", "")),
    )
    return MessagesCall(chat, threads if body.get("thread") is not None else None)


def stop_reason(result: ChatResult, stop_sequences: Sequence[str] = ()) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`): `tool_use`, `max_tokens`, `stop_sequence` with the one of the
    request's `stop_sequences` that ended the reply, or `end_turn` (EOS, or a stop string of the backend's own).

    The engine stops at the first stop string its text contains, so a request's sequence in the reply is the
    one that ended it (the latest-ending, should two overlap at the end). The reply's text keeps it, as the
    sampled tokens do (token-exact; Anthropic's own API leaves it out of the text).
    """
    if result.message.tool_calls:
        return "tool_use", None
    if result.completion.finish_reason == "length":
        return "max_tokens", None
    text = result.message.content or ""
    ends = [(text.rfind(s) + len(s), s) for s in stop_sequences if s and s in text]
    if ends:
        return "stop_sequence", max(ends)[1]
    return "end_turn", None


def content_blocks(message: Message) -> list[dict[str, Any]]:
    """The reply as content blocks: its text (unless empty beside calls), then one `tool_use` per call."""
    blocks: list[dict[str, Any]] = []
    if message.content or not message.tool_calls:
        blocks.append({"type": "text", "text": message.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in message.tool_calls]
    return blocks


def new_message_id() -> str:
    return "msg_" + os.urandom(12).hex()


def message_response(result: ChatResult, model: str, id: str, stop_sequences: Sequence[str] = ()) -> dict[str, Any]:
    """The non-streamed Message object, with the sampled ids as extra fields (as on chat completions)."""
    reason, sequence = stop_reason(result, stop_sequences)
    return {
        "id": id, "type": "message", "role": "assistant", "model": model,
        "content": content_blocks(result.message), "stop_reason": reason, "stop_sequence": sequence,
        "usage": {"input_tokens": result.prompt_len, "output_tokens": len(result.completion.ids)},
        "token_ids": list(result.completion.ids), "policy_versions": list(result.completion.versions),
    }


def error_body(e: GatewayError) -> dict[str, Any]:
    """An error in the Messages API's shape (``{type: error, error: {type, message}}``)."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
             504: "timeout_error"}
    error: dict[str, Any] = {"type": kinds.get(e.status, "api_error"), "message": str(e), "param": e.param,
                             "code": e.code}
    if e.code:
        error["details"] = {"error_code": e.code}  # where the SDK's thread logic reads it (thread_not_found)
    return {"type": "error", "error": error}


class MessagesWriter:
    """The Messages API's streamed events for one answer (`Gateway.stream_answer` drives it)."""

    trailer = b""

    def __init__(self, model: str, call: MessagesCall) -> None:
        self.model = model
        self.call = call
        self.id = new_message_id()
        self.text_open = False

    def opening(self, prompt_len: int, result: ChatResult | None) -> list[Event]:
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_len, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def _open_text(self) -> list[Event]:
        if self.text_open:
            return []
        self.text_open = True
        return [("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})]

    def content(self, piece: str) -> list[Event]:
        return [*self._open_text(), ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                             "delta": {"type": "text_delta", "text": piece}})]

    def closing(self, result: ChatResult, *, sent: str) -> list[Event]:
        self.call.keep(self.id, result)
        events: list[Event] = []
        message = result.message
        text = message.content or ""
        if text or self.text_open or not message.tool_calls:
            rest = text[len(sent):] if text.startswith(sent) else ""
            events += self._open_text()
            if rest:
                events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                       "delta": {"type": "text_delta", "text": rest}}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
        first = 1 if events else 0
        for i, call in enumerate(message.tool_calls, start=first):
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            events += [
                ("content_block_start", {"type": "content_block_start", "index": i, "content_block": block}),
                ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}}),
                ("content_block_stop", {"type": "content_block_stop", "index": i}),
            ]
        reason, sequence = stop_reason(result, self.call.chat.stop)
        events.append(("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": len(result.completion.ids)},
            "token_ids": list(result.completion.ids), "policy_versions": list(result.completion.versions)}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def failure(self, error: GatewayError) -> Event:
        return ("error", error_body(error))

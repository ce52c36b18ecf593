"""The OpenAI Responses API (``POST /v1/responses``) mapped onto the gateway's chat calls.

A Responses request becomes the same `ChatRequest` a Chat Completions call
would give: `instructions` the system message, `message` items the messages,
`function_call` items an assistant turn's calls (merged into the assistant
message they follow, matched by `call_id` as OpenAI `tool_calls` are by id),
`function_call_output` items tool messages, function `tools` the OpenAI
function tools. So the session, its branches and the token-exact conversation
are shared with the other APIs.

`previous_response_id` continues a stored response: its messages (input and
output, without its instructions, as the API defines) come before the new
`input`. Responses are stored per gateway session (`Session.responses`, the
latest `RESPONSES_KEPT`), unless the request says `store: false`. Streamed,
the answer is the Responses API's named SSE events (response.created,
output_item.added, output_text.delta, function_call_arguments.delta/done,
output_item.done, response.completed).
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentrl.gateway.protocol import (
    ROLES,
    ChatRequest,
    ChatResult,
    Constraint,
    GatewayError,
    TrainerSampling,
    bad,
    check_sampling,
    forced_call,
    json_format,
    one_constraint,
    text_of,
    tool_call,
)
from agentrl.gateway.streaming import Event
from agentrl.types import Message

RESPONSES_KEPT = 256  # stored responses per session, for previous_response_id
Store = OrderedDict[str, list[Message]]
REFUSED_TRUE = ("background",)


@dataclass(slots=True)
class ResponsesCall:
    """A validated Responses request: the chat call it is, and what the response echoes and stores."""

    chat: ChatRequest
    history: list[Message]  # what a later previous_response_id continues (no instructions)
    instructions: str | None
    previous_response_id: str | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    store: Store | None


def input_messages(items: Any, where: str = "input") -> list[Message]:
    """Input items as agentrl messages; a `function_call` joins the assistant turn it follows."""
    if isinstance(items, str):
        return [Message(role="user", content=items)]
    if not isinstance(items, list):
        raise bad(f"{where} must be a string or a list of items", where)
    out: list[Message] = []
    joinable = False  # the last item was an assistant message or call: a function_call joins that turn
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, Mapping):
            raise bad(f"{at} must be an object", at)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(str(item.get("role")))
            if role is None or role == "tool":
                raise bad(f"{at}.role {item.get('role')!r} is not one of user, assistant, system, developer", f"{at}.role")
            out.append(Message(role=role, content=text_of(item.get("content"), at)))  # type: ignore[arg-type]
            joinable = role == "assistant"
        elif kind == "function_call":
            call = tool_call(item.get("name"), item.get("arguments", "{}"), item.get("call_id"), at)
            if joinable:
                out[-1].tool_calls.append(call)
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call]))
            joinable = True
        elif kind == "function_call_output":
            out.append(Message(role="tool", content=text_of(item.get("output"), at),
                               tool_call_id=str(item.get("call_id") or "")))
            joinable = False
        else:
            raise bad(f"{at}: item type {kind!r} is not served (served: message, function_call, "
                      "function_call_output)", at)
    return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list of {type: function, name, parameters}", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, Mapping) else None
            raise bad(f"tools[{i}]: only function tools {{type: function, name, parameters}} are served, got "
                      f"{kind!r} (built-in tools run on OpenAI's servers)", f"tools[{i}]")
        fn: dict[str, Any] = {"name": t["name"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, Constraint | None]:
    """(auto | none | required, the constraint of `required` / a named function)."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return str(choice or "auto"), None
    if choice == "required":
        return "required", forced_call(None, tools, "tool_choice='required'")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = choice.get("name")
        return "required", forced_call(name, tools, f"tool_choice={{type: function, name: {name!r}}}")
    raise bad(f"tool_choice must be 'auto', 'none', 'required' or {{type: function, name}}, got {choice!r} "
              "(hosted tools are not served)", "tool_choice")


def _text_format(body: Mapping[str, Any]) -> Constraint | None:
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if not isinstance(fmt, Mapping):
        return None
    return json_format(fmt.get("type"), fmt.get("schema"), "text.format")


def _check_refused(body: Mapping[str, Any]) -> None:
    for key in REFUSED_TRUE:
        if body.get(key):
            raise bad(f"{key} is not served", key)
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") not in (None, "none", "minimal"):
        raise bad("reasoning effort is not served: the model's reply is sampled as it is", "reasoning")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs is not served (the engine returns the sampled token's logprob only)", "top_logprobs")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation='auto' is not served: a dropped history would start a new branch silently; "
                  "the episode's budgets end it instead", "truncation")


def parse_responses_request(body: Any, trainer: TrainerSampling, stored: Store) -> ResponsesCall:
    """Validate a Responses body into a `ResponsesCall` (errors name the field); `stored` holds the
    session's earlier responses for `previous_response_id`."""
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    check_sampling(body, trainer)
    _check_refused(body)
    history: list[Message] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or previous not in stored:
            raise GatewayError(400, f"previous_response_id {previous!r} is not a stored response of this session "
                               f"(the latest {RESPONSES_KEPT} are kept; store: false keeps none)",
                               param="previous_response_id", code="previous_response_not_found")
        history = list(stored[previous])
    if body.get("input") is None and not history:
        raise bad("input is required", "input")
    history += input_messages(body.get("input") or [])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    messages = ([Message(role="system", content=instructions)] if instructions else []) + history
    if not messages:
        raise bad("input is empty", "input")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad(f"max_output_tokens must be a positive integer, got {max_tokens!r}", "max_output_tokens")
    tools = _tools(body)
    choice, forced = _tool_choice(body, tools)
    chat = ChatRequest(
        messages=messages, tools=tools, tool_choice=choice, constraint=one_constraint(forced, _text_format(body)),
        max_tokens=max_tokens, stop=(),
        seed=body.get("seed") if isinstance(body.get("seed"), int) else None, stream=bool(body.get("stream", False)),
        include_usage=True, logprobs=False, return_token_ids=False, model=str(body.get("model", "")),
    )
    return ResponsesCall(chat=chat, history=history, instructions=instructions, previous_response_id=previous,
                         tools=list(body.get("tools") or []), tool_choice=body.get("tool_choice", "auto"),
                         store=stored if body.get("store", True) is not False else None)


def output_items(result: ChatResult, message_id: str) -> list[dict[str, Any]]:
    """The reply as output items: a message (unless its text is empty beside calls), then one function_call each."""
    message = result.message
    items: list[dict[str, Any]] = []
    if message.content or not message.tool_calls:
        items.append(_message_item(message_id, message.content, "completed"))
    items += [_call_item(c.id, c.name, json.dumps(c.arguments, ensure_ascii=False), "completed")
              for c in message.tool_calls]
    return items


def _message_item(id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": id, "status": status, "role": "assistant", "content": content}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponsesWriter:
    """Builds one call's Response object and, streamed, its events; stores the response for later calls."""

    trailer = b""

    def __init__(self, model: str, call: ResponsesCall) -> None:
        self.model = model
        self.call = call
        self.id = "resp_" + os.urandom(12).hex()
        self.message_id = "msg_" + os.urandom(12).hex()
        self.created = int(time.time())
        self.seq = 0
        self.text_open = False

    def response(self, result: ChatResult | None) -> dict[str, Any]:
        """The Response object: in progress (no result yet) or completed, with the sampled ids as extra fields.

        A completed one is stored for `previous_response_id` (unless the request said store: false)."""
        call = self.call
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": "in_progress", "output": [], "instructions": call.instructions,
            "previous_response_id": call.previous_response_id, "tools": call.tools, "tool_choice": call.tool_choice,
            "parallel_tool_calls": True, "temperature": None, "top_p": None, "error": None,
            "incomplete_details": None, "metadata": {}, "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": None,
        }
        if result is None:
            return out
        length = result.completion.finish_reason == "length" and not result.message.tool_calls
        n = len(result.completion.ids)
        out.update({
            "status": "incomplete" if length else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "output": output_items(result, self.message_id),
            "usage": {"input_tokens": result.prompt_len, "output_tokens": n, "total_tokens": result.prompt_len + n,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
            "token_ids": list(result.completion.ids), "policy_versions": list(result.completion.versions),
        })
        if call.store is not None:
            call.store[self.id] = [*call.history, result.message]
            while len(call.store) > RESPONSES_KEPT:
                call.store.popitem(last=False)
        return out

    def _event(self, kind: str, **fields: Any) -> Event:
        self.seq += 1
        return (kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def opening(self, prompt_len: int, result: ChatResult | None) -> list[Event]:
        started = self.response(None)
        return [self._event("response.created", response=started), self._event("response.in_progress", response=started)]

    def _open_text(self) -> list[Event]:
        if self.text_open:
            return []
        self.text_open = True
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=0,
                            item=_message_item(self.message_id, None, "in_progress")),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                            part=part)]

    def content(self, piece: str) -> list[Event]:
        return [*self._open_text(), self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                                content_index=0, delta=piece, logprobs=[])]

    def closing(self, result: ChatResult, *, sent: str) -> list[Event]:
        final = self.response(result)
        events: list[Event] = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                rest = text[len(sent):] if text.startswith(sent) else ""
                events += self._open_text()
                if rest:
                    events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                              content_index=0, delta=rest, logprobs=[]))
                events += [
                    self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=item["content"][0]),
                ]
            else:
                started = {**item, "arguments": "", "status": "in_progress"}
                events += [
                    self._event("response.output_item.added", output_index=index, item=started),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]),
                ]
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=final))
        return events

    def failure(self, error: GatewayError) -> Event:
        failed = {**self.response(None), "status": "failed",
                  "error": {"code": error.code or "server_error", "message": str(error)}}
        return self._event("response.failed", response=failed)

"""The OpenAI wire format: requests in, responses and stream chunks out.

Requests are checked strictly: a field the gateway cannot honour without
changing the distribution the trainer assumes (another temperature, a
penalty, `n > 1`, constrained output) is a `GatewayError` naming it, never
silently ignored. Messages become agentrl `Message`s; responses are built
from a `ChatResult` (what one generate call gave), so a cached retry and a
fresh call answer with the same bytes, streamed or not.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Completion, Message, ToolCall

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class GatewayError(Exception):
    """A request the gateway refuses: HTTP `status`, the offending `param`, an OpenAI error `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status in (401, 403):
            kind = "authentication_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class TrainerSampling:
    """The behaviour distribution the trainer assumes; requests must not change it."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a call forces the reply to be: one tool call (`kind` tool: of `name`, or of any tool) or JSON
    (`kind` json: following `schema`, any object when None). Served by constrained decoding
    (`agentrl.engines.constrained`); `label` is how the trajectory's turn records it."""

    kind: str
    label: str
    param: str
    name: str | None = None
    schema: dict[str, Any] | None = None


@dataclass(slots=True)
class ChatRequest:
    """A validated chat-completions request."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None
    tool_choice: str
    max_tokens: int | None
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool
    model: str
    constraint: Constraint | None = None
    policy: str | None = None  # the policy (LoRA adapter) that samples this call (`GatewayConfig.model_policies`)


@dataclass(slots=True)
class ChatResult:
    """What one call produced: the message returned to the agent and the completion behind it."""

    message: Message
    completion: Completion
    prompt_len: int
    finish_reason: str
    prompt_ids: list[int] | None = None  # kept only when the request asked for them (`return_token_ids`)
    id: str = field(default_factory=lambda: "chatcmpl-" + os.urandom(12).hex())
    created: int = field(default_factory=lambda: int(time.time()))


# --------------------------------------------------------------------------- requests


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{key} must be a number, got {value!r}", key)
    return float(value)


def check_sampling(body: Mapping[str, Any], trainer: TrainerSampling, *, formats: bool = False) -> None:
    """Refuse any setting that would sample from another distribution than the trainer's."""
    for key, want in (("temperature", trainer.temperature), ("top_p", trainer.top_p)):
        got = _number(body, key)
        if got is not None and abs(got - want) > 1e-6:
            raise bad(
                f"{key}={got:g} differs from the trainer's {key}={want:g}: the trainer needs the behaviour "
                f"distribution, so send {key}={want:g} or leave it out",
                key,
                "sampling_mismatch",
            )
    top_k = body.get("top_k")
    if top_k is not None and top_k != trainer.top_k and not (trainer.top_k == 0 and top_k in (-1, 0)):
        raise bad(f"top_k={top_k!r} differs from the trainer's top_k={trainer.top_k}", "top_k", "sampling_mismatch")
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        got = _number(body, key)
        neutral = 1.0 if key == "repetition_penalty" else 0.0
        if got is not None and got != neutral:
            raise bad(f"{key}={got:g} changes the sampling distribution; the gateway serves none", key, "sampling_mismatch")
    if body.get("logit_bias"):
        raise bad("logit_bias changes the sampling distribution; the gateway serves none", "logit_bias", "sampling_mismatch")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n={n!r}: the gateway samples one choice per call; send n=1 and call again for more", "n")
    fmt = body.get("response_format")
    if not formats and isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        raise bad(
            f"response_format type {fmt.get('type')!r} needs constrained decoding, which would change the "
            "distribution; only 'text' is served",
            "response_format",
        )


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"{key} must be a positive integer, got {value!r}", key)
        return value
    return None


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        return tuple(s for s in stop if s)
    raise bad(f"stop must be a string or a list of up to 4 strings, got {stop!r}", "stop")


def text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise bad(f"{where}.content[{i}]: only text parts are served, got {kind!r}", f"{where}.content")
        return "".join(parts)
    raise bad(f"{where}.content must be a string, null or a list of text parts", f"{where}.content")


def _tool_call(raw: Any, where: str) -> ToolCall:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("function"), Mapping):
        raise bad(f"{where} must be {{id, type: function, function: {{name, arguments}}}}", where)
    fn = raw["function"]
    return tool_call(fn.get("name"), fn.get("arguments", "{}"), raw.get("id"), f"{where}.function")


def tool_call(name: Any, args: Any, id: Any, where: str) -> ToolCall:
    """A call as an agent resent it: `args` a JSON string or object (unparseable text is kept under `_raw`)."""
    if not isinstance(name, str):
        raise bad(f"{where}.name must be a string", where)
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {"_raw": args}
    if not isinstance(args, dict):
        args = {"_raw": args}
    return ToolCall(name=name, arguments=args, id=str(id or ""))


def parse_message(raw: Any, index: int) -> Message:
    """One OpenAI message dict as a `Message` (developer becomes system)."""
    where = f"messages[{index}]"
    if not isinstance(raw, Mapping):
        raise bad(f"{where} must be an object", where)
    role = ROLES.get(str(raw.get("role")))
    if role is None:
        raise bad(f"{where}.role {raw.get('role')!r} is not one of {', '.join(ROLES)}", f"{where}.role")
    calls = raw.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    name = raw.get("name")
    return Message(
        role=role,  # type: ignore[arg-type]
        content=text_of(raw.get("content"), where),
        tool_calls=[_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)],
        tool_call_id=str(raw["tool_call_id"]) if raw.get("tool_call_id") is not None else None,
        name=name if isinstance(name, str) and role != "assistant" else None,
    )


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list of {type: function, function: {...}}", "tools")
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            raise bad(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}", f"tools[{i}]")
    return [dict(t) for t in tools]


def forced_call(name: Any, tools: list[dict[str, Any]] | None, label: str) -> Constraint:
    """The constraint of a call that must use a tool (`name` one of `tools`, or None for any)."""
    if not tools:
        raise bad(f"{label} needs tools to call", "tool_choice")
    if name is not None and name not in [t.get("function", t).get("name") for t in tools]:
        raise bad(f"{label}: {name!r} is not one of the request's tools", "tool_choice")
    return Constraint("tool", label, "tool_choice", name=name)


def json_format(kind: Any, schema: Any, param: str) -> Constraint | None:
    """The constraint of a structured-output request (json_object, or json_schema with its schema)."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json", f"{param}=json_object", param)
    if kind == "json_schema":
        if not isinstance(schema, Mapping):
            raise bad(f"{param} json_schema needs its schema (an object)", param)
        return Constraint("json", f"{param}=json_schema", param, schema=dict(schema))
    raise bad(f"{param} type {kind!r} is not one of text, json_object, json_schema", param)


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, Constraint | None]:
    """(auto | none | required, the constraint a forced call needs)."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return str(choice or "auto"), None
    if choice == "required":
        return "required", forced_call(None, tools, "tool_choice='required'")
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        return "required", forced_call(name, tools, f"tool_choice={{function: {name!r}}}")
    raise bad(f"tool_choice must be 'auto', 'none', 'required' or {{type: function, function: {{name}}}}, "
              f"got {choice!r}", "tool_choice")


def one_constraint(*found: Constraint | None) -> Constraint | None:
    given = [c for c in found if c is not None]
    if len(given) > 1:
        raise bad(f"{given[0].label} and {given[1].label} cannot both constrain one call", given[1].param)
    return given[0] if given else None


def parse_chat_request(body: Any, trainer: TrainerSampling) -> ChatRequest:
    """Validate a chat-completions body (errors name the field)."""
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    check_sampling(body, trainer, formats=True)
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad("top_logprobs is not served (the engine returns the sampled token's logprob only)", "top_logprobs")
    options = body.get("stream_options") or {}
    tools = _tools(body)
    choice, forced = _tool_choice(body, tools)
    fmt = body.get("response_format")
    fmt = fmt if isinstance(fmt, Mapping) else {}
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    return ChatRequest(
        messages=[parse_message(m, i) for i, m in enumerate(messages)],
        tools=tools,
        tool_choice=choice,
        constraint=one_constraint(forced, json_format(fmt.get("type"), schema, "response_format")),
        max_tokens=_max_tokens(body),
        stop=_stop(body),
        seed=body.get("seed") if isinstance(body.get("seed"), int) else None,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, Mapping) and options.get("include_usage")),
        logprobs=bool(body.get("logprobs", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        model=str(body.get("model", "")),
    )


def fingerprint(body: Mapping[str, Any]) -> str:
    """A key for retry detection: the request minus fields that do not change what is asked."""
    kept = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "user", "metadata")}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), default=str)


# --------------------------------------------------------------------------- responses


def message_dict(message: Message) -> dict[str, Any]:
    """An assistant `Message` as the OpenAI response message."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content if message.content or not message.tool_calls else None}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in message.tool_calls
        ]
    return out


def chat_logprobs(result: ChatResult, decode: Any) -> dict[str, Any]:
    content = []
    for tid, lp in zip(result.completion.ids, result.completion.logprobs, strict=True):
        token = decode([tid])
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode("utf-8")), "top_logprobs": []})
    return {"content": content}


def usage(result: ChatResult) -> dict[str, int]:
    n = len(result.completion.ids)
    return {"prompt_tokens": result.prompt_len, "completion_tokens": n, "total_tokens": result.prompt_len + n}


def chat_response(result: ChatResult, request: ChatRequest, model: str, decode: Any) -> dict[str, Any]:
    """The non-streamed chat.completion object, with the sampled ids as extra fields."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": message_dict(result.message),
        "finish_reason": result.finish_reason,
        "logprobs": chat_logprobs(result, decode) if request.logprobs else None,
        "token_ids": list(result.completion.ids),
        "policy_versions": list(result.completion.versions),
    }
    out: dict[str, Any] = {
        "id": result.id, "object": "chat.completion", "created": result.created, "model": model,
        "choices": [choice], "usage": usage(result),
    }
    if result.prompt_ids is not None:
        out["prompt_token_ids"] = result.prompt_ids
    return out


def completion_response(
    completion: Completion, prompt: list[int], text: str, model: str, *, logprobs: bool, decode: Any, echo_ids: bool
) -> dict[str, Any]:
    """The legacy text_completion object for `/v1/completions`."""
    finish = "length" if completion.finish_reason == "length" else "stop"
    choice: dict[str, Any] = {
        "index": 0, "text": text, "finish_reason": finish,
        "logprobs": None, "token_ids": list(completion.ids), "policy_versions": list(completion.versions),
    }
    if logprobs:
        tokens = [decode([t]) for t in completion.ids]
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(completion.logprobs),
                              "top_logprobs": None, "text_offset": []}
    n = len(completion.ids)
    out: dict[str, Any] = {
        "id": "cmpl-" + os.urandom(12).hex(), "object": "text_completion", "created": int(time.time()),
        "model": model, "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n},
    }
    if echo_ids:
        out["prompt_token_ids"] = list(prompt)
    return out

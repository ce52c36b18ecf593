"""Turn a model's reply text into content plus tool calls.

Parsers are small classes with a `name` and `parse(text) -> ParsedReply`; the
built-ins register as entry points (group `agentrl.tool_parsers`) like any
plugin, and `get_parser(name)` resolves the built-in ones without a registry.

A call the model attempted but that cannot be used (broken JSON, no name,
arguments that are not an object) becomes ``ToolCall(name, {}, error=...)``
so the env can answer it with an explanation. Parsers never raise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from agentrl.types import ToolCall


@dataclass(slots=True)
class ParsedReply:
    """The reply's text outside tool calls, and the calls in order."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@runtime_checkable
class ToolCallParser(Protocol):
    name: ClassVar[str]

    def parse(self, text: str) -> ParsedReply: ...


def call_from_json(body: str) -> ToolCall:
    """A ToolCall from the JSON text of one call (``{"name": ..., "arguments"|"parameters": {...}}``)."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        name = _guess_name(body)
        return ToolCall(name=name, arguments={}, error=f"the tool call is not valid JSON ({_json_error(e)})")
    return call_from_object(obj)


def call_from_object(obj: Any) -> ToolCall:
    """A ToolCall from a decoded JSON value, with `error` set when it is not a usable call."""
    if not isinstance(obj, dict):
        return ToolCall(
            name="", arguments={}, error=f"a tool call must be a JSON object, got {type(obj).__name__}"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall(name="", arguments={}, error='the tool call has no "name" string')
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:
            return ToolCall(
                name=name, arguments={}, error=f"the arguments are not valid JSON ({_json_error(e)})"
            )
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(
            name=name, arguments={}, error=f"the arguments must be a JSON object, got {type(args).__name__}"
        )
    return ToolCall(name=name, arguments=args)


def _json_error(e: Exception) -> str:
    return e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__


_NAME_GUESS = re.compile(r'"name"\s*:\s*"([^"\\]{1,100})"')


def _guess_name(body: str) -> str:
    match = _NAME_GUESS.search(body)
    return match.group(1) if match else ""


def _drop_partial_close(body: str) -> str:
    """`body` without a trailing cut-off closing tag ("</tool_c" when generation stopped mid-tag)."""
    at = body.rfind("</")
    if at >= 0 and "</tool_call>".startswith(body[at:].strip()):
        return body[:at].rstrip()
    return body


def _join(parts: list[str]) -> str:
    return "\n".join(p.strip() for p in parts if p.strip())


class HermesParser:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn.

    An unclosed ``<tool_call>`` at the end (the engine stopped on the closing
    tag, or ran out of tokens) is parsed up to the end of the text.
    """

    name: ClassVar[str] = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        calls: list[ToolCall] = []
        outside: list[str] = []
        pos = 0
        for match in self._CALL.finditer(text):
            outside.append(text[pos : match.start()])
            pos = match.end()
            body = match.group(1).strip()
            if not body:
                calls.append(ToolCall(name="", arguments={}, error="empty <tool_call></tool_call>"))
                continue
            closed = match.group(0).endswith("</tool_call>")
            call = call_from_json(body if closed else _drop_partial_close(body))
            if not closed and call.error:
                call.error = f"unterminated <tool_call>: {call.error}"
            calls.append(call)
        outside.append(text[pos:])
        return ParsedReply(content=_join(outside), tool_calls=calls)


class Llama3JsonParser:
    """Llama 3.1: the reply is a JSON call ``{"name": ..., "parameters": {...}}``.

    Optionally prefixed by ``<|python_tag|>``; several calls may be separated by
    ``;``. A reply that does not start with ``{`` (after the tag) is plain content.
    """

    name: ClassVar[str] = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        if tagged:
            body = body[len(self.TAG) :].strip()
        for suffix in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(suffix).rstrip()
        if not body.startswith("{"):
            if tagged:
                return ParsedReply(
                    content=body,
                    tool_calls=[ToolCall("", {}, error="<|python_tag|> is not followed by a JSON call")],
                )
            return ParsedReply(content=text.strip())
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body) and body[pos] == "{":
            try:
                obj, end = decoder.raw_decode(body, pos)
            except (json.JSONDecodeError, RecursionError) as e:
                calls.append(
                    ToolCall(
                        _guess_name(body[pos:]),
                        {},
                        error=f"the tool call is not valid JSON ({_json_error(e)})",
                    )
                )
                return ParsedReply(content="", tool_calls=calls)
            calls.append(call_from_object(obj))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedReply(content=body[pos:].strip(), tool_calls=calls)


class JsonParser:
    """Fallback: the first JSON object (or list of objects) in the text that has a "name" key.

    Finds calls inside prose or code fences; the rest of the text is content.
    Text that looks like a call (``{"name"``) but does not decode is an error call.
    """

    name: ClassVar[str] = "json"
    MAX_ATTEMPTS: ClassVar[int] = 64
    _LOOKS_LIKE_CALL = re.compile(r'[\[{]\s*\{?\s*"name"\s*:')

    def parse(self, text: str) -> ParsedReply:
        decoder = json.JSONDecoder()
        for attempt, match in enumerate(re.finditer(r"[\[{]", text)):
            if attempt >= self.MAX_ATTEMPTS:  # bound the work on brace-heavy text
                break
            start = match.start()
            try:
                obj, end = decoder.raw_decode(text, start)
            except (json.JSONDecodeError, RecursionError):
                continue
            objs = obj if isinstance(obj, list) else [obj]
            if objs and all(isinstance(o, dict) and "name" in o for o in objs):
                content = _join([_strip_fence_end(text[:start]), _strip_fence_start(text[end:])])
                return ParsedReply(content=content, tool_calls=[call_from_object(o) for o in objs])
        found = self._LOOKS_LIKE_CALL.search(text)
        if found:
            error = ToolCall(_guess_name(text[found.start() :]), {}, error="the tool call is not valid JSON")
            return ParsedReply(content=text[: found.start()].strip(), tool_calls=[error])
        return ParsedReply(content=text.strip())


def _strip_fence_end(text: str) -> str:
    return re.sub(r"```(?:json)?\s*$", "", text)


def _strip_fence_start(text: str) -> str:
    return re.sub(r"^\s*```", "", text)


BUILTIN_PARSERS: dict[str, type[ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
    JsonParser.name: JsonParser,
}


def get_parser(name: str, plugins: Any = None) -> ToolCallParser:
    """A parser instance by name: a built-in, else from `plugins.tool_parsers` when given."""
    if name in BUILTIN_PARSERS:
        return BUILTIN_PARSERS[name]()
    registry = getattr(plugins, "tool_parsers", None)
    if registry is not None:
        found = registry.get(name)
        return found() if isinstance(found, type) else found  # type: ignore[no-any-return]
    raise ValueError(f"unknown tool_parser {name!r}; available: {', '.join(sorted(BUILTIN_PARSERS))}")

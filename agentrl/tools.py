"""Tools are plain typed Python functions; `@tool` turns one into a `Tool`.

The OpenAI function schema comes from the type hints (int, float, str, bool,
list[...], dict, Literal, Optional / ``X | None``, Enum, unions) and the
docstring: the text before the first section is the description, and an
``Args:`` (Google) or ``Parameters`` (NumPy) section describes the parameters.

`Tool.call(arguments)` never raises: missing or unexpected arguments, wrong
types, an exception inside the tool and a timeout all come back as a string
starting with ``Error:`` that the model can read. Sync functions run in a
worker thread (a timed-out one keeps running there; only its result is
dropped) unless declared `threaded=False` (cheap, non-blocking functions).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

ToolErrorKind = Literal["arguments", "exception", "timeout"]


@dataclass(slots=True)
class ToolOutcome:
    """What one call produced: the text for the model, and how it went."""

    content: str
    error: ToolErrorKind | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Tool:
    """A callable the model can use: name, description, JSON-schema parameters, timeout."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        description: str,
        parameters: dict[str, Any],
        timeout_s: float = 10.0,
        threaded: bool = True,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"tool {name!r}: timeout_s must be > 0, got {timeout_s}")
        self.fn = fn
        self.name = name
        self.description = description
        self.parameters = parameters
        self.timeout_s = timeout_s
        self.threaded = threaded
        self.is_async = inspect.iscoroutinefunction(fn)
        self._model = _arguments_model(fn, name)
        self.__doc__ = description

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly (no validation, no timeout)."""
        return self.fn(*args, **kwargs)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool dict: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Any) -> dict[str, Any] | str:
        """The validated keyword arguments, or an error message for the model."""
        if not isinstance(arguments, Mapping):
            return f"Error: arguments for tool '{self.name}' must be a JSON object, got {type(arguments).__name__}"
        properties = self.parameters.get("properties", {})
        unexpected = sorted(set(arguments) - set(properties))
        if unexpected:
            allowed = ", ".join(properties) or "(none)"
            return f"Error: unexpected argument(s) {', '.join(unexpected)} for tool '{self.name}'; parameters: {allowed}"
        try:
            model = self._model.model_validate(dict(arguments))
        except ValidationError as e:
            return f"Error: invalid arguments for tool '{self.name}': {_explain(e)}"
        return {k: getattr(model, k) for k in type(model).model_fields}

    async def run(self, arguments: Any, *, timeout_s: float | None = None) -> ToolOutcome:
        """Validate, call under the timeout, and turn the result into text. Never raises."""
        kwargs = self.validate(arguments)
        if isinstance(kwargs, str):
            return ToolOutcome(kwargs, "arguments")
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            async with asyncio.timeout(limit):
                if self.is_async:
                    result = await self.fn(**kwargs)
                elif self.threaded:
                    result = await asyncio.to_thread(self.fn, **kwargs)
                else:
                    result = self.fn(**kwargs)
        except TimeoutError:
            return ToolOutcome(f"Error: tool '{self.name}' timed out after {limit:g}s", "timeout")
        except Exception as e:
            return ToolOutcome(f"Error: tool '{self.name}' raised {type(e).__name__}: {e}", "exception")
        return ToolOutcome(_to_text(result))

    async def call(self, arguments: Any) -> str:
        """The text the model sees: the result, or an ``Error: ...`` explanation."""
        return (await self.run(arguments)).content


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    fn: Callable[..., Any],
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 10.0,
    threaded: bool = True,
) -> Tool: ...


@overload
def tool(
    fn: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 10.0,
    threaded: bool = True,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = 10.0,
    threaded: bool = True,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a `Tool` from a typed function: ``@tool`` or ``@tool(name=..., timeout_s=...)``."""

    def build(f: Callable[..., Any]) -> Tool:
        summary, param_docs = parse_docstring(inspect.getdoc(f) or "")
        tool_name = name or f.__name__
        desc = description if description is not None else summary
        if not desc:
            desc = tool_name.replace("_", " ")
        return Tool(
            f,
            name=tool_name,
            description=desc,
            parameters=parameters_schema(f, param_docs),
            timeout_s=timeout_s,
            threaded=threaded,
        )

    return build(fn) if fn is not None else build


# --------------------------------------------------------------------------- schema from type hints


def parameters_schema(fn: Callable[..., Any], param_docs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The JSON schema (type "object") of a function's parameters."""
    docs = param_docs or {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param, hint in _parameters(fn):
        prop = json_schema(hint, where=f"{_fn_name(fn)}({pname})")
        if pname in docs:
            prop["description"] = docs[pname]
        if param.default is not inspect.Parameter.empty:
            default = param.default.value if isinstance(param.default, enum.Enum) else param.default
            if _json_safe(default):
                prop["default"] = default
        else:
            required.append(pname)
        properties[pname] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def json_schema(tp: Any, *, where: str = "") -> dict[str, Any]:
    """JSON schema of one annotation; TypeError (naming `where`) for unsupported types."""
    if tp is Any or tp is inspect.Parameter.empty:
        return {}
    scalar = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
    if tp in scalar:
        return {"type": scalar[tp]}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        return {"type": _json_type_of(values), "enum": values}
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return {"type": _json_type_of(list(args)), "enum": list(args)}
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        base: dict[str, Any] = (
            json_schema(inner[0], where=where)
            if len(inner) == 1
            else {"anyOf": [json_schema(a, where=where) for a in inner]}
        )
        if len(inner) < len(args):
            base["nullable"] = True
        return base
    if tp in (list, tuple, set, frozenset) or origin in (list, tuple, set, frozenset, Sequence):
        schema: dict[str, Any] = {"type": "array"}
        item_args = [a for a in args if a is not Ellipsis]
        if item_args:
            schema["items"] = json_schema(item_args[0], where=where)
        return schema
    if tp is dict or origin in (dict, Mapping):
        return {"type": "object"}
    raise TypeError(
        f"tool parameter {where}: unsupported type {tp!r}; use str, int, float, bool, list, dict, Literal, Enum"
    )


def _json_type_of(values: Sequence[Any]) -> str:
    kinds = {type(v) for v in values}
    if kinds <= {str}:
        return "string"
    if kinds <= {bool}:
        return "boolean"
    if kinds <= {int}:
        return "integer"
    if kinds <= {int, float}:
        return "number"
    return "string"


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", repr(fn))


def _parameters(fn: Callable[..., Any]) -> list[tuple[str, inspect.Parameter, Any]]:
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    out = []
    for pname, param in sig.parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"tool {_fn_name(fn)}: *args/**kwargs are not supported (parameter {pname!r})")
        out.append((pname, param, hints.get(pname, param.annotation)))
    return out


def _arguments_model(fn: Callable[..., Any], name: str) -> type[BaseModel]:
    """A pydantic model that validates a call's arguments (lax: "3" -> 3 is fine, "x" -> int is not)."""
    fields: dict[str, Any] = {}
    for pname, param, hint in _parameters(fn):
        annotation = Any if hint is inspect.Parameter.empty else hint
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, default)
    model: type[BaseModel] = create_model(
        f"{name}_arguments", __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True), **fields
    )
    return model


def _explain(error: ValidationError) -> str:
    parts = []
    for e in error.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "arguments"
        if e["type"] == "missing":
            parts.append(f"missing required argument '{loc}'")
        else:
            parts.append(f"{loc}: {e['msg']} (got {_short(e.get('input'))})")
    return "; ".join(parts)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _to_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


# --------------------------------------------------------------------------- docstrings

_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns|Return|Yields|Raises|Examples?|Notes?|See Also|Attributes)\s*:?\s*$"
)
_GOOGLE_PARAM = re.compile(r"^(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")
_NUMPY_PARAM = re.compile(r"^(\w+)\s*(?::\s*(.*))?$")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) from a Google- or NumPy-style docstring."""
    lines = inspect.cleandoc(doc).splitlines() if doc else []
    summary: list[str] = []
    params: dict[str, str] = {}
    i = 0
    while i < len(lines) and not _SECTION.match(lines[i].strip()):
        summary.append(lines[i])
        i += 1
    while i < len(lines):
        header = _SECTION.match(lines[i].strip())
        i += 1
        if header is None:
            continue
        is_params = header.group(1) in ("Args", "Arguments", "Parameters", "Params")
        numpy = i < len(lines) and set(lines[i].strip()) == {"-"}  # NumPy underline
        if numpy:
            i += 1
        body: list[str] = []
        while i < len(lines) and not _SECTION.match(lines[i].strip()):
            body.append(lines[i])
            i += 1
        if is_params:
            params.update(_parse_params(body, numpy=numpy))
    return " ".join(" ".join(summary).split()), params


def _parse_params(body: list[str], *, numpy: bool) -> dict[str, str]:
    """Entries of a parameter section: a name line, then more-indented continuation lines.

    Google: ``name (type): description``; NumPy: ``name : type`` with the
    description on the indented lines below.
    """
    out: dict[str, str] = {}
    indents = [len(line) - len(line.lstrip()) for line in body if line.strip()]
    if not indents:
        return out
    base = min(indents)
    current: str | None = None
    for line in body:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        text = line.strip()
        if indent == base:
            match = (_NUMPY_PARAM if numpy else _GOOGLE_PARAM).match(text)
            current = match.group(1).lstrip("*") if match else None
            if current is not None:
                out[current] = "" if numpy or match is None else match.group(3).strip()
        elif current is not None:
            out[current] = f"{out[current]} {text}".strip()
    return out

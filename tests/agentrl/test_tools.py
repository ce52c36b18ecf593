"""@tool: schemas from type hints and docstrings; calls that never raise."""

from __future__ import annotations

import asyncio
import enum
import json
import time
from typing import Literal, Optional

import pytest

from agentrl.tools import Tool, json_schema, parse_docstring, tool


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_schema_from_hints_and_google_docstring() -> None:
    @tool
    def search(
        query: str,
        limit: int = 5,
        score: float = 0.5,
        exact: bool = False,
        tags: list[str] | None = None,
        mode: Literal["fast", "slow"] = "fast",
        color: Color = Color.RED,
        note: Optional[str] = None,  # noqa: UP045 - Optional spelling is what we test
    ) -> list[str]:
        """Search the index for documents.

        Longer explanation that spans
        two lines.

        Args:
            query: The text to look for.
            limit (int): How many results
                to return at most.
            score: Minimum score.
            exact: Only exact matches.
            tags: Restrict to these tags.
            mode: Search mode.
            color: A color.
            note: Free text.

        Returns:
            Matching document ids.
        """
        return []

    schema = search.schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the index for documents. Longer explanation that spans two lines."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "The text to look for."}
    assert props["limit"] == {
        "type": "integer",
        "description": "How many results to return at most.",
        "default": 5,
    }
    assert props["score"]["type"] == "number"
    assert props["exact"]["type"] == "boolean"
    assert props["tags"] == {
        "type": "array",
        "items": {"type": "string"},
        "nullable": True,
        "description": "Restrict to these tags.",
        "default": None,
    }
    assert props["mode"]["enum"] == ["fast", "slow"] and props["mode"]["type"] == "string"
    assert props["color"]["enum"] == ["red", "blue"] and props["color"]["default"] == "red"
    assert props["note"]["nullable"] is True
    json.dumps(schema)  # JSON-able


def test_numpy_docstring_and_overrides() -> None:
    def area(width: float, height: float) -> float:
        """Area of a rectangle.

        Parameters
        ----------
        width : float
            The width,
            in metres.
        height : float
            The height.
        """
        return width * height

    t = tool(area, name="rect_area", description="Rectangle area.", timeout_s=2.0)
    props = t.schema()["function"]["parameters"]["properties"]
    assert props["width"]["description"] == "The width, in metres."
    assert props["height"]["description"] == "The height."
    assert t.name == "rect_area" and t.description == "Rectangle area." and t.timeout_s == 2.0
    assert t(2, 3) == 6  # still callable directly


def test_parse_docstring_plain() -> None:
    assert parse_docstring("Just a summary.") == ("Just a summary.", {})
    assert parse_docstring("") == ("", {})


def test_unsupported_types_are_rejected_clearly() -> None:
    class Custom:
        pass

    def f(x: Custom) -> str:
        return ""

    with pytest.raises(TypeError, match=r"f\(x\): unsupported type"):
        tool(f)

    def g(*args: int) -> int:
        return 0

    with pytest.raises(TypeError, match=r"\*args/\*\*kwargs"):
        tool(g)
    assert json_schema(dict[str, int]) == {"type": "object"}
    assert json_schema(int | str) == {"anyOf": [{"type": "integer"}, {"type": "string"}]}


@tool
def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    return a + b


async def test_call_results_are_strings() -> None:
    assert await add.call({"a": 2, "b": 3}) == "5"
    assert await add.call({"a": 2}) == "3"
    assert await add.call({"a": "4"}) == "5"  # lax numeric strings are accepted

    @tool
    def info(name: str) -> dict[str, object]:
        """Structured result."""
        return {"name": name, "ok": True}

    assert json.loads(await info.call({"name": "x"})) == {"name": "x", "ok": True}


async def test_argument_errors_are_messages() -> None:
    missing = await add.call({})
    assert missing.startswith("Error:") and "missing required argument 'a'" in missing
    wrong = await add.call({"a": "seven"})
    assert (
        wrong.startswith("Error: invalid arguments for tool 'add'") and "a:" in wrong and "'seven'" in wrong
    )
    extra = await add.call({"a": 1, "c": 2})
    assert "unexpected argument(s) c" in extra and "parameters: a, b" in extra
    not_object = await add.call([1, 2])
    assert "must be a JSON object" in not_object
    outcome = await add.run({"a": "x"})
    assert outcome.error == "arguments" and not outcome.ok


async def test_literal_and_enum_validation() -> None:
    @tool
    def paint(color: Color, finish: Literal["matte", "gloss"] = "matte") -> str:
        """Paint."""
        return f"{color.value}/{finish}"

    assert await paint.call({"color": "blue", "finish": "gloss"}) == "blue/gloss"
    bad = await paint.call({"color": "green"})
    assert bad.startswith("Error:") and "color" in bad
    bad_lit = await paint.call({"color": "red", "finish": "shiny"})
    assert bad_lit.startswith("Error:") and "finish" in bad_lit


async def test_exceptions_become_messages() -> None:
    @tool
    def divide(a: float, b: float) -> float:
        """Divide."""
        return a / b

    msg = await divide.call({"a": 1, "b": 0})
    assert msg == "Error: tool 'divide' raised ZeroDivisionError: float division by zero"
    assert (await divide.run({"a": 1, "b": 0})).error == "exception"


async def test_async_tool_and_timeouts() -> None:
    @tool(timeout_s=0.05)
    async def slow(x: int) -> int:
        """Sleeps."""
        await asyncio.sleep(5)
        return x

    @tool
    async def fast(x: int) -> int:
        """Async and quick."""
        await asyncio.sleep(0)
        return x * 2

    assert slow.is_async
    outcome = await slow.run({"x": 1})
    assert outcome.error == "timeout" and outcome.content == "Error: tool 'slow' timed out after 0.05s"
    assert await fast.call({"x": 21}) == "42"

    @tool(timeout_s=5.0)
    def blocking(x: int) -> int:
        """Blocks a thread."""
        time.sleep(0.5)
        return x

    # the caller's (stricter) limit wins over the tool's own
    outcome = await blocking.run({"x": 1}, timeout_s=0.05)
    assert outcome.error == "timeout" and "0.05s" in outcome.content


async def test_inline_tool_runs_on_the_loop() -> None:
    calls: list[int] = []

    @tool(threaded=False)
    def record(x: int) -> str:
        """Record x."""
        calls.append(x)
        return "ok"

    assert isinstance(record, Tool) and not record.threaded
    assert await record.call({"x": 3}) == "ok" and calls == [3]


def test_bad_timeout_rejected() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        tool(add.fn, timeout_s=0)

"""Tool-call parsers: what models emit, including what they get wrong."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.chat.tool_parsers import (
    BUILTIN_PARSERS,
    HermesParser,
    JsonParser,
    Llama3JsonParser,
    get_parser,
)


def test_hermes_several_calls_and_content() -> None:
    text = (
        "Let me compute both.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "5-9"}}</tool_call>\n'
        "Done."
    )
    parsed = HermesParser().parse(text)
    assert [c.name for c in parsed.tool_calls] == ["calculator", "calculator"]
    assert [c.arguments for c in parsed.tool_calls] == [{"expression": "12*7"}, {"expression": "5-9"}]
    assert all(c.error is None for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == 2
    assert parsed.content == "Let me compute both.\nDone."


def test_hermes_no_calls() -> None:
    parsed = HermesParser().parse("  Answer: 87  ")
    assert parsed.tool_calls == [] and parsed.content == "Answer: 87"


def test_hermes_malformed_json_keeps_name_guess() -> None:
    parsed = HermesParser().parse(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>'
    )
    (call,) = parsed.tool_calls
    assert call.name == "calculator" and call.arguments == {}
    assert call.error is not None and "not valid JSON" in call.error


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('{"arguments": {"x": 1}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
        ('{"name": "f", "arguments": "{bad"}', "arguments are not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("", "empty"),
    ],
)
def test_hermes_unusable_calls_have_errors(body: str, fragment: str) -> None:
    (call,) = HermesParser().parse(f"<tool_call>{body}</tool_call>").tool_calls
    assert call.error is not None and fragment in call.error


def test_hermes_string_arguments_and_parameters_key() -> None:
    text = (
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
        '<tool_call>{"name": "g", "parameters": {"y": 3}}</tool_call>'
    )
    f, g = HermesParser().parse(text).tool_calls
    assert f.arguments == {"x": 2} and g.arguments == {"y": 3}


def test_hermes_unterminated_call() -> None:
    ok = HermesParser().parse('Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert ok.tool_calls[0].error is None and ok.tool_calls[0].arguments == {"x": 1}
    assert ok.content == "Sure."
    mid_tag = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_c')
    assert mid_tag.tool_calls[0].error is None and mid_tag.tool_calls[0].arguments == {"x": 1}
    cut = HermesParser().parse('<tool_call>\n{"name": "f", "argum')
    assert cut.tool_calls[0].error is not None and "unterminated" in cut.tool_calls[0].error


def test_llama3_json_calls() -> None:
    p = Llama3JsonParser()
    (call,) = p.parse('{"name": "calculator", "parameters": {"expression": "2+2"}}').tool_calls
    assert call.name == "calculator" and call.arguments == {"expression": "2+2"}
    tagged = p.parse(
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": 1}}<|eom_id|>'
    )
    assert [c.name for c in tagged.tool_calls] == ["f", "g"] and tagged.content == ""
    plain = p.parse("The answer is 4.")
    assert plain.tool_calls == [] and plain.content == "The answer is 4."
    broken = p.parse('{"name": "calculator", "parameters": {"expression": ')
    assert broken.tool_calls[0].error is not None and broken.tool_calls[0].name == "calculator"
    bad_tag = p.parse("<|python_tag|>print(1)")
    assert bad_tag.tool_calls[0].error is not None


def test_json_fallback_finds_calls_in_prose_and_fences() -> None:
    p = JsonParser()
    fenced = p.parse('I will call it.\n```json\n{"name": "f", "arguments": {"x": 1}}\n```\nthanks')
    assert fenced.tool_calls[0].arguments == {"x": 1}
    assert fenced.content == "I will call it.\nthanks"
    many = p.parse('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": 2}}]')
    assert [c.name for c in many.tool_calls] == ["f", "g"]
    none = p.parse('Config is {"a": 1}, no call.')
    assert none.tool_calls == [] and none.content == 'Config is {"a": 1}, no call.'
    broken = p.parse('call: {"name": "f", "arguments": {')
    assert broken.tool_calls[0].error is not None and broken.tool_calls[0].name == "f"


def test_registry_lookup() -> None:
    assert set(BUILTIN_PARSERS) == {"hermes", "llama3_json", "json"}
    assert isinstance(get_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match="unknown tool_parser 'xml'; available: hermes, json, llama3_json"):
        get_parser("xml")

    class Plugins:
        class tool_parsers:
            @staticmethod
            def get(name: str) -> type:
                assert name == "custom"
                return JsonParser

    assert isinstance(get_parser("custom", Plugins()), JsonParser)


_FRAGMENTS = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<|python_tag|>",
        "<|eom_id|>",
        '{"name": ',
        '"calculator"',
        '"arguments": ',
        '"parameters": ',
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ",",
        ";",
        "```json",
        "null",
        "1e999",
        "\n",
        "NaN",
    ]
)
_TEXT = st.lists(st.one_of(_FRAGMENTS, st.text(max_size=8)), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_parsers_never_raise(text: str) -> None:
    for cls in BUILTIN_PARSERS.values():
        parsed = cls().parse(text)
        assert isinstance(parsed.content, str)
        for call in parsed.tool_calls:
            assert isinstance(call.name, str) and isinstance(call.arguments, dict)
            assert call.error is None or call.arguments == {}


def test_deeply_nested_json_does_not_raise() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    for cls in BUILTIN_PARSERS.values():
        cls().parse(f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>')
        cls().parse('{"name": "f", "parameters": ' + deep + "}")

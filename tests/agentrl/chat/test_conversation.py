"""Conversation mechanics on the dependency-free tokenizer (plus HF wrapper basics).

Golden tests against real chat templates live in test_chat_templates.py.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from agentrl.chat.conversation import (
    Budgets,
    Conversation,
    HFChatTokenizer,
    SimpleChatTokenizer,
    closing_remainder,
    hermes_content,
    hermes_tools_prompt,
    token_drift,
    truncate_ids_text,
)
from agentrl.types import Completion, Message, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def opening() -> list[Message]:
    return [Message("system", "Be brief."), Message("user", "What is 12*7+3?")]


def sample(
    conv: Conversation, text: str, *, end: int | None, finish: str = "stop", version: int = 3
) -> Completion:
    """A fake engine completion: `text` encoded, optionally followed by an end-of-turn id."""
    ids = conv.tokenizer.encode(text) + ([end] if end is not None else [])
    n = len(ids)
    return Completion(ids, [-0.1 * (i + 1) for i in range(n)], [version] * n, finish)  # type: ignore[arg-type]


def call_message(expr: str, call_id: str = "c1", content: str = "") -> Message:
    return Message(
        "assistant", content, tool_calls=[ToolCall("calculator", {"expression": expr}, id=call_id)]
    )


@pytest.fixture
def tok() -> SimpleChatTokenizer:
    return SimpleChatTokenizer()


def test_simple_tokenizer_round_trip(tok: SimpleChatTokenizer) -> None:
    text = "<|im_start|>user\nhé 你好 <|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == tok.im_start_id and ids[-1] == 258
    assert tok.encode("plain") == list(b"plain")
    assert tok.eos_ids[0] == tok.im_end_id


def test_prompt_is_rendered_opening_with_mask_zero(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, opening(), tools=TOOLS)
    expected = tok.encode(tok.render(opening(), tools=TOOLS, add_generation_prompt=True))
    assert conv.prompt_ids == expected
    assert conv.loss_mask == [0] * len(expected)
    assert conv.versions == [-1] * len(expected)
    assert tok.decode(conv.prompt_ids).endswith("<|im_start|>assistant\n")
    assert "<tools>" in tok.decode(conv.prompt_ids)


@pytest.mark.parametrize("ending", ["eos", "stop_string", "length", "other_eos"])
def test_multi_turn_is_token_exact(tok: SimpleChatTokenizer, ending: str) -> None:
    conv = Conversation(tok, opening(), tools=TOOLS)
    end = {"eos": tok.im_end_id, "other_eos": 258}.get(ending)
    finish = "length" if ending == "length" else "stop"
    first = call_message("12*7+3", content="Let me compute.")
    c1 = sample(conv, hermes_content(first), end=end, finish=finish, version=3)
    conv.add_completion(c1, first)
    span1 = (conv.turns[0].start, conv.turns[0].end)
    assert conv.token_ids[span1[0] : span1[1]] == c1.ids
    assert conv.logprobs[span1[0] : span1[1]] == c1.logprobs
    assert conv.versions[span1[0] : span1[1]] == [3] * len(c1.ids)
    assert conv.add_messages(
        [Message("tool", "87", tool_call_id="c1"), Message("tool", "ok", tool_call_id="c2")]
    )
    second = Message("assistant", "Answer: 87")
    c2 = sample(conv, second.content, end=tok.im_end_id, version=4)
    conv.add_completion(c2, second)
    assert conv.add_messages([Message("user", "Thanks. And 2+2?")])

    mask_positions = [i for i, m in enumerate(conv.loss_mask) if m]
    sampled_positions = [i for t in conv.turns for i in range(t.start, t.end)]
    assert mask_positions == sampled_positions
    assert [conv.token_ids[i] for i in sampled_positions] == c1.ids + c2.ids
    assert all(v == -1 for v, m in zip(conv.versions, conv.loss_mask, strict=True) if not m)
    full = tok.render(conv.messages, tools=TOOLS, add_generation_prompt=True)
    if ending == "other_eos":
        # the model closed its turn with <|endoftext|>: kept verbatim, so the
        # ids differ from the re-rendered text by exactly that one token
        assert tok.decode(conv.token_ids) == full.replace(
            "</tool_call><|im_end|>\n<|im_start|>tool", "</tool_call><|endoftext|>\n<|im_start|>tool"
        )
        assert 0 < conv.retokenization_drift() < 0.01
    else:
        assert tok.decode(conv.token_ids) == full
        assert conv.token_ids == tok.encode(full)
        assert conv.retokenization_drift() == 0.0


def test_drift_counts_a_final_model_turn_with_its_closing(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, opening())
    reply = Message("assistant", "Answer: 87")
    conv.add_completion(sample(conv, reply.content, end=None, finish="length"), reply)
    assert conv.retokenization_drift() == 0.0
    assert not conv.awaiting_generation


def test_drift_detects_a_message_that_differs_from_the_sampled_text(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, opening())
    # The parser normalised the reply (stripped trailing spaces): training keeps
    # the sampled ids, re-rendering the messages would not give them back.
    conv.add_completion(sample(conv, "Answer: 87   ", end=tok.im_end_id), Message("assistant", "Answer: 87"))
    assert conv.add_messages([Message("user", "ok")])
    assert "Answer: 87   <|im_end|>" in tok.decode(conv.token_ids)
    drift = conv.retokenization_drift()
    assert 0.0 < drift < 0.1
    assert drift == pytest.approx(3 / len(conv.token_ids))


def test_token_drift_definition() -> None:
    assert token_drift([1, 2, 3], [1, 2, 3]) == 0.0
    assert token_drift([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 0, 6, 7, 8, 9, 10]) == pytest.approx(0.1)
    assert token_drift([1, 2], [3, 4]) == 1.0
    assert token_drift([], [1]) == 1.0
    # an extra token at the end is one misaligned position out of the longer length
    assert token_drift([1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.25)


def test_closing_remainder_cases() -> None:
    closing = [257, 10]  # "<|im_end|>\n"
    eos = (257, 258)
    assert closing_remainder([5, 6, 257], closing, eos) == [10]
    assert closing_remainder([5, 6], closing, eos) == [257, 10]
    assert closing_remainder([5, 258], closing, eos) == [10]
    assert closing_remainder([5, 257, 10], closing, eos) == []
    assert closing_remainder([], closing, eos) == [257, 10]
    assert closing_remainder([5, 257], [257], eos) == []


def test_alternation_is_enforced(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, opening())
    with pytest.raises(RuntimeError, match="model turn is due"):
        conv.add_messages([Message("user", "x")])
    reply = Message("assistant", "hi")
    conv.add_completion(sample(conv, "hi", end=tok.im_end_id), reply)
    with pytest.raises(RuntimeError, match="generation prompt"):
        conv.add_completion(sample(conv, "hi", end=tok.im_end_id), reply)


def test_empty_env_messages_give_the_model_another_turn(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, opening())
    reply = Message("assistant", "thinking")
    conv.add_completion(sample(conv, "thinking", end=tok.im_end_id), reply)
    assert conv.add_messages([])
    assert tok.decode(conv.token_ids).endswith("thinking<|im_end|>\n<|im_start|>assistant\n")
    assert conv.retokenization_drift() == 0.0


def test_budgets_max_new_tokens_and_total(tok: SimpleChatTokenizer) -> None:
    prompt_len = len(Conversation(tok, opening()).prompt_ids)
    budgets = Budgets(max_turns=3, max_total_tokens=prompt_len + 60, max_new_tokens_per_turn=30)
    conv = Conversation(tok, opening(), budgets=budgets)
    assert conv.max_new_tokens() == 30
    reply = Message("assistant", "x" * 25)
    conv.add_completion(sample(conv, reply.content, end=tok.im_end_id), reply)
    before = list(conv.token_ids)
    # the delta would cross the total budget: nothing is appended, no exception
    assert conv.add_messages([Message("user", "y" * 50)]) is False
    assert conv.token_ids == before and len(conv.loss_mask) == len(before)
    assert len(conv.messages) == 3
    assert conv.add_messages([Message("user", "")]) is True
    assert conv.max_new_tokens() == budgets.max_total_tokens - len(conv.token_ids)
    assert conv.max_new_tokens() < 30


def test_budgets_max_turns(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, opening(), budgets=Budgets(max_turns=1))
    assert conv.exhausted() is None
    conv.add_completion(sample(conv, "a", end=tok.im_end_id), Message("assistant", "a"))
    assert conv.add_messages([Message("user", "b")])
    assert conv.max_new_tokens() <= 0
    assert conv.exhausted() == "max_turns"


def test_prompt_longer_than_budget_does_not_crash(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, [Message("user", "z" * 100)], budgets=Budgets(max_total_tokens=50))
    assert conv.max_new_tokens() <= 0
    assert conv.exhausted() == "max_total_tokens"


def test_budgets_validate() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        Budgets(max_turns=0)
    with pytest.raises(ValueError, match="tool_output_truncation"):
        Budgets(tool_output_truncation="top")  # type: ignore[arg-type]


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_tool_output_truncation(tok: SimpleChatTokenizer, side: Any) -> None:
    budgets = Budgets(max_tool_output_tokens=60, tool_output_truncation=side)
    conv = Conversation(tok, opening(), budgets=budgets)
    conv.add_completion(sample(conv, "call", end=tok.im_end_id), Message("assistant", "call"))
    long_output = "HEAD" + "." * 500 + "TAIL"
    assert conv.add_messages([Message("tool", long_output, tool_call_id="c1")])
    kept = conv.messages[-1].content
    assert len(tok.encode(kept)) <= 60
    assert "tokens truncated]" in kept
    assert kept.startswith("HEAD") == (side in ("right", "middle"))
    assert kept.endswith("TAIL") == (side in ("left", "middle"))
    # the stored message is what was tokenised: still token-exact
    assert conv.retokenization_drift() == 0.0


def test_short_tool_output_is_untouched(tok: SimpleChatTokenizer) -> None:
    assert truncate_ids_text(tok, "short", 10, "middle") == "short"
    assert len(tok.encode(truncate_ids_text(tok, "x" * 100, 5, "middle"))) <= 40  # marker alone may exceed


def test_tools_fallback_merges_into_system(tok: SimpleChatTokenizer) -> None:
    with_system = tok.render(opening(), tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert hermes_tools_prompt(TOOLS) in with_system
    without_system = tok.render([Message("user", "hi")], tools=TOOLS)
    assert without_system.startswith("<|im_start|>system\n# Tools")
    assert "<|im_start|>user\nhi<|im_end|>" in without_system


def test_hermes_content_formats_calls() -> None:
    msg = Message(
        "assistant",
        "Sure.",
        tool_calls=[ToolCall("f", {"a": 1}, id="1"), ToolCall("g", {}, id="2")],
    )
    assert hermes_content(msg) == (
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )


def test_to_trajectory_carries_tokens_and_drift(tok: SimpleChatTokenizer) -> None:
    conv = Conversation(tok, opening())
    conv.add_completion(sample(conv, "Answer: 87", end=tok.im_end_id), Message("assistant", "Answer: 87"))
    traj = conv.to_trajectory(task_id="t1", env="calc", reward=1.0)
    sample_ = traj.tokens()
    assert sample_.input_ids == conv.token_ids
    assert (
        sum(sample_.loss_mask) == conv.turns[0].end - conv.turns[0].start == len(tok.encode("Answer: 87")) + 1
    )
    assert traj.metrics["retokenization_drift"] == 0.0
    assert traj.reward == 1.0 and traj.turns[0].info["finish_reason"] == "stop"


def test_hf_wrapper_on_smollm2(smol_tokenizer: Any) -> None:
    tok = HFChatTokenizer(smol_tokenizer)
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_ids[0] == im_end
    assert not tok.tools_in_template  # SmolLM2's template knows no tools: documented fallback
    text = tok.render(opening(), tools=TOOLS, add_generation_prompt=True)
    assert "Be brief.\n\n# Tools" in text and "<tools>" in text
    assert tok.decode(tok.encode(text)) == text
    conv = Conversation(tok, opening(), tools=TOOLS)
    msg = call_message("12*7+3")
    conv.add_completion(sample(conv, hermes_content(msg), end=im_end), msg)
    assert conv.add_messages([Message("tool", "87", tool_call_id="c1")])
    assert tok.decode(conv.token_ids) == tok.render(conv.messages, tools=TOOLS, add_generation_prompt=True)
    assert conv.retokenization_drift() == 0.0


def test_chat_module_imports_no_torch_or_transformers() -> None:
    code = "import sys, agentrl.chat.conversation; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]

"""The `calculator` env: tasks, the safe calculator tool, rewards, few-shot prompts, episodes."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest
from pydantic import ValidationError

from agentrl.chat.conversation import Conversation, SimpleChatTokenizer, hermes_content
from agentrl.envs.calculator import (
    CALCULATOR,
    CalculatorConfig,
    CalculatorEnv,
    CalculatorError,
    calculator,
    evaluate,
    extract_answer,
)
from agentrl.types import Completion, Message, ToolCall


def small(**kw: Any) -> CalculatorEnv:
    return CalculatorEnv(CalculatorConfig(**{"n_train": 200, "n_test": 50, **kw}))


def test_tasks_are_deterministic_distinct_and_correct() -> None:
    a, b = small(), small()
    train, test = a.tasks("train"), a.tasks("test")
    assert train == b.tasks("train") and test == b.tasks("test")
    assert len(train) == 200 and len(test) == 50
    ids = [t["id"] for t in train + test]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("calculator/train/") for i in ids[:200])
    assert not {t["expression"] for t in train} & {t["expression"] for t in test}
    for t in train + test:
        assert evaluate(t["expression"]) == t["answer"] and t["answer"] >= 0
        assert isinstance(t["prompt"], str) and t["prompt"]
    assert small(seed=1).tasks("train") != train
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        a.tasks("dev")


@pytest.mark.parametrize(
    ("digits", "operands", "operators"),
    [(1, 2, ["+"]), (3, 4, ["+", "-", "*", "/"]), (2, 3, ["/"]), (4, 2, ["-"])],
)
def test_difficulty_knobs(digits: int, operands: int, operators: list[str]) -> None:
    env = small(
        digits=digits, num_operands=operands, operators=operators, style="plain", n_train=40, n_test=5
    )
    for task in env.tasks("train"):
        numbers = [int(n) for n in re.findall(r"\d+", task["expression"])]
        assert len(numbers) == operands
        assert len(str(numbers[0])) == digits
        assert task["prompt"] == f"What is {task['expression']}?"
        ops = set(re.findall(r"[-+*/]", task["expression"]))
        assert ops <= {*operators, "+"}  # "+" stands in when - or / cannot keep the value whole


def test_word_problems_and_custom_templates() -> None:
    env = small(
        style="word",
        templates={"start": ["{name} owns {n} {item}."], "+": ["Plus {n}."], "question": ["Total {item}?"]},
        operators=["+"],
    )
    task = env.tasks("train")[0]
    a, b = task["expression"].split(" + ")
    assert re.fullmatch(rf"\w+ owns {a} \w+\. Plus {b}\. Total \w+\?", task["prompt"])


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValidationError, match="templates: unknown key 'middle'"):
        CalculatorConfig(templates={"middle": ["x"]})
    with pytest.raises(ValidationError, match="unknown placeholder"):
        CalculatorConfig(templates={"+": ["add {count}"]})
    with pytest.raises(ValidationError, match="operators"):
        CalculatorConfig(operators=["%"])  # type: ignore[list-item]
    with pytest.raises(ValidationError, match="extra"):
        CalculatorConfig(digitz=3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="cannot make 82 distinct train problems"):
        CalculatorEnv(CalculatorConfig(digits=1, operators=["+"], n_train=82, n_test=0)).tasks("train")


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("12 + 7", "19"),
        ("(12 + 7) * 3", "57"),
        ("87 / 3", "29"),
        ("7 / 2", "3.5"),
        ("2 ^ 10", "1024"),
        ("12 x 7", "84"),
        ("1,234 + 1", "1235"),
        ("(3+4)*2 =", "14"),
        ("-(-3) % 2", "1"),
        ("2 ** -2", "0.25"),
        ("10 // 3", "3"),
        ("123456789123456789 * 1000 / 1000", "123456789123456789"),
    ],
)
def test_calculator_evaluates(expression: str, result: str) -> None:
    assert calculator(expression) == result


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("True + 1", "unsupported element Constant"),
        ("(1).__class__", "unsupported element Attribute"),
        ("9 ** 9 ** 9", "exponent larger than 100"),
        ("10 ** 99 * 100", "result too large"),
        ("99 ** 60", "result too large"),
        ("1 / 0", "division by zero"),
        ("1e308 * 10", "result too large"),
        ("1 +", "not an arithmetic expression"),
        ("", "empty expression"),
        ("1+" * 150 + "1", "longer than 200"),
    ],
)
def test_calculator_refuses(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=re.escape(message)):
        evaluate(expression)


async def test_calculator_tool_errors_reach_the_model() -> None:
    assert CALCULATOR.schema()["function"]["parameters"]["required"] == ["expression"]
    assert await CALCULATOR.call({"expression": "6*7"}) == "42"
    assert await CALCULATOR.call({"expression": "1/0"}) == (
        "Error: tool 'calculator' raised CalculatorError: division by zero"
    )
    assert (await CALCULATOR.call({"expr": "1"})).startswith("Error: unexpected argument(s) expr")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("Answer: 87", 87.0),
        ("The result is 12, so the answer is 87.", 87.0),
        ("answer = -4", -4.0),
        ("Answer: **1,235**", 1235.0),
        ("I computed 3 then 5", 5.0),
        ("Answer: 2.5 apples", 2.5),
        ("no idea", None),
    ],
)
def test_extract_answer(text: str, value: float | None) -> None:
    assert extract_answer(text) == value


def call_reply(expression: str) -> str:
    return hermes_content(
        Message("assistant", "", tool_calls=[ToolCall("calculator", {"expression": expression})])
    )


async def play(
    env: CalculatorEnv, task: dict[str, Any], replies: list[str]
) -> tuple[Conversation, list[Any]]:
    """Drive one episode with scripted replies through a token-exact Conversation."""
    tok = SimpleChatTokenizer()
    opening, _ = await env.reset(task)
    conv = Conversation(tok, opening, tools=env.tool_schemas())
    results = []
    for text in replies:
        ids = [*tok.encode(text), tok.im_end_id]
        completion = Completion(ids, [-1.0] * len(ids), [0] * len(ids), "stop")
        action = env.parse_action(text)
        conv.add_completion(completion, action)
        result = await env.step(action)
        results.append(result)
        if result.terminated:
            break
        assert conv.add_messages(result.messages)
    return conv, results


async def test_scripted_episode_solves_with_the_tool() -> None:
    env = small()
    task = env.tasks("train")[3]
    conv, results = await play(env, task, [call_reply(task["expression"]), f"Answer: {task['answer']}"])
    assert results[0].messages[0].content == str(task["answer"]) and not results[0].terminated
    final = results[-1]
    assert final.terminated and final.reward == 1.0
    assert final.reward_breakdown == {"correct": 1.0, "format": 1.0, "used_tool": 1.0}
    assert conv.retokenization_drift() == 0.0
    sampled = [t for t, m in zip(conv.token_ids, conv.loss_mask, strict=True) if m]
    assert SimpleChatTokenizer().decode(sampled) == (
        call_reply(task["expression"]) + f"<|im_end|>Answer: {task['answer']}<|im_end|>"
    )


async def test_wrong_answer_bad_calls_and_shaping() -> None:
    env = small(format_bonus=0.1, tool_bonus=0.2)
    task = env.tasks("train")[0]
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
    _, results = await play(
        env, task, [bad, "<tool_call>{broken</tool_call>", f"Answer: {task['answer'] + 1}"]
    )
    assert results[0].messages[0].content.startswith("Error:") and results[0].tool_errors == 1
    assert results[1].messages[0].content.startswith("Error: could not read the tool call")
    final = results[-1]
    assert final.reward == pytest.approx(0.1)  # wrong, formatted, no successful tool call
    _, results = await play(small(format_bonus=0.1, tool_bonus=0.2), task, [f"It is {task['answer']}."])
    assert results[-1].reward == pytest.approx(1.0)  # right without a tool and without the format


async def test_few_shot_demonstrations_are_prompt_tokens() -> None:
    env = small(few_shot=2)
    demos = env.demonstrations()
    assert len(demos) >= 2
    for demo in demos:
        assert [m.role for m in demo] == ["system", "user", "assistant", "tool", "assistant"]
        expr = demo[2].tool_calls[0].arguments["expression"]
        assert demo[3].content == calculator(expr)
        assert demo[4].content == f"Answer: {evaluate(expr)}"
    task = env.tasks("train")[0]
    opening, _ = await env.reset(task)
    assert [m.role for m in opening] == ["system"] + ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert opening[-1].content == task["prompt"]
    conv = Conversation(SimpleChatTokenizer(), opening, tools=env.tool_schemas())
    assert set(conv.loss_mask) == {0}
    prompt_text = SimpleChatTokenizer().decode(conv.prompt_ids)
    assert prompt_text.count('{"name": "calculator", "arguments": {"expression"') == 2
    zero, _ = await small(few_shot=0).reset(task)
    assert [m.role for m in zero] == ["system", "user"]


async def test_check_env_passes() -> None:
    from agentrl.envkit.check import acheck_env

    # with and without few-shot demonstration turns in the prompt
    for k in (0, 2):
        report = await acheck_env(small(few_shot=k), n_episodes=2)
        assert report.episodes == 2


async def test_run_episode_with_the_scripted_engine() -> None:
    from agentrl.engines.scripted import ScriptedEngine
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.episode import run_episode

    env = small()
    task = env.tasks("test")[0]
    tok = SimpleChatTokenizer()

    def policy(prompt: str) -> str:
        # call the tool once, then report what it returned
        if (
            prompt.rstrip().endswith("<|im_start|>assistant")
            and "<|im_start|>tool\n" in prompt.rsplit("<|im_start|>user", 1)[-1]
        ):
            result = prompt.rsplit("<|im_start|>tool\n", 1)[-1].split("<|im_end|>")[0]
            return f"Answer: {result}"
        return call_reply(task["expression"])

    engine = ScriptedEngine(ScriptedEngine.Config(), tokenizer=tok, reply_fn=policy)
    traj = await run_episode(env, task, engine, tok, RolloutConfig(max_turns=4))
    assert traj.error is None, traj.error
    assert traj.terminated and traj.reward == 1.0 and len(traj.turns) == 2
    assert traj.metrics["retokenization_drift"] == 0.0


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_makes_tool_calls_with_the_default_prompt(smollm2_path: str) -> None:
    """SmolLM2-135M on the default prompt (2 demonstrations): how often is the first reply a
    well-formed calculator call (parsed, right tool, valid arguments)? Sampled at temperature
    0.7; measured here (seed 0): 5/8 well-formed at 0.7 in fp32 and in bf16, 2/8 at 1.0 (3/8 in `plain`
    style; bf16). fp32 because bf16 matmuls are ~5x slower on CPUs without AVX-512-bf16.
    Nearly every reply starts with <tool_call>; failures are broken JSON or invented tool names."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.chat.conversation import HFChatTokenizer

    tok = HFChatTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    env = CalculatorEnv()
    tasks = env.tasks("test")[:8]
    prompts = []
    for task in tasks:
        opening, _ = asyncio.run(env.reset(task))
        prompts.append(Conversation(tok, opening, tools=env.tool_schemas()).prompt_ids)
    width = max(len(p) for p in prompts)
    pad = tok.tokenizer.pad_token_id or 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=40,
            do_sample=True,
            temperature=0.7,
            top_k=0,
            eos_token_id=list(tok.eos_ids),
            pad_token_id=pad,
        )
    well_formed = right_expression = 0
    for task, row in zip(tasks, out[:, width:].tolist(), strict=True):
        action = env.parse_action(tok.decode([t for t in row if t not in tok.eos_ids and t != pad]))
        calls = [c for c in action.tool_calls if c.error is None and c.name == "calculator"]
        if calls and not isinstance(CALCULATOR.validate(calls[0].arguments), str):
            well_formed += 1
            with contextlib.suppress(CalculatorError):
                right_expression += evaluate(str(calls[0].arguments["expression"])) == task["answer"]
    print(
        f"\nsmollm2 calculator tool calls: well_formed={well_formed}/8 right_expression={right_expression}/8"
    )
    assert well_formed > 0

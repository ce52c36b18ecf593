"""code env: bundled problems, sandboxed tests, feedback and retries, partial credit."""

from __future__ import annotations

from typing import Any

import pytest

from agentrl.envs.code_env import CodeEnv, extract_program, load_problems, outputs_match
from agentrl.types import Message


def say(program: str, prose: str = "Here is my program.") -> Message:
    return Message(role="assistant", content=f"{prose}\n```python\n{program}```\n")


def test_bundled_problems_and_splits() -> None:
    problems = load_problems(None)
    assert 10 <= len(problems) <= 20
    env = CodeEnv()
    train, test = list(env.tasks("train")), list(env.tasks("test"))
    assert train and test and not {t["id"] for t in train} & {t["id"] for t in test}
    assert len(train) + len(test) == len(problems)
    assert all(len(p["hidden_tests"]) >= 4 and p["public_tests"] for p in problems)
    assert len(env.demonstrations()) == len(train)


def test_parsing_helpers() -> None:
    assert extract_program("a\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_program("no code here") is None
    assert outputs_match("1 2\n3\n", "1 2  \n3\n\n") and not outputs_match("1 2\n", "12\n")


async def test_every_reference_solution_passes_its_hidden_tests(local_sandbox: Any) -> None:
    """Checks the shipped data itself, through the real sandbox."""
    env = CodeEnv(sandbox=local_sandbox)
    for pid, problem in env.problems().items():
        outcomes = await env.run_tests(problem["solution"], problem["public_tests"] + problem["hidden_tests"])
        assert all(o.passed for o in outcomes), (pid, [o for o in outcomes if not o.passed])


async def test_feedback_then_retry_then_full_reward(local_sandbox: Any) -> None:
    env = CodeEnv(CodeEnv.Config(max_attempts=3), sandbox=local_sandbox)
    messages, _ = await env.reset({"id": "reverse_words"})
    assert "hello world" in messages[0].content and "```python" in messages[0].content
    first = await env.step(say("print(input())\n"))  # echoes instead of reversing
    assert not first.terminated and not first.truncated and first.reward == 0.0
    assert first.info["public_passed"] == 0
    feedback = first.messages[0].content
    assert "2 of 2 examples failed" in feedback and "Expected:\nworld hello" in feedback and "2 attempt(s) left" in feedback
    crash = await env.step(say("print(undefined_name)\n"))
    assert "NameError" in crash.messages[0].content and "1 attempt(s) left" in crash.messages[0].content
    final = await env.step(say("print(' '.join(reversed(input().split())))\n"))
    assert final.terminated and final.reward == 1.0 and final.info["hidden_passed"] == final.info["hidden_total"]


async def test_partial_credit_timeout_and_exhausted_attempts(local_sandbox: Any) -> None:
    env = CodeEnv(CodeEnv.Config(max_attempts=2, test_timeout_s=1.0), sandbox=local_sandbox)
    await env.reset({"id": "palindrome"})
    # passes both examples but ignores punctuation rules: 4 of 6 hidden tests
    naive = "s = input().lower()\nprint('YES' if s == s[::-1] else 'NO')\n"
    result = await env.step(say(naive))
    assert result.terminated and result.reward == pytest.approx(4 / 6)

    await env.reset({"id": "fizzbuzz"})
    spin = await env.step(say("while True:\n    pass\n"))
    assert "timeout" in spin.messages[0].content
    no_code = await env.step(Message(role="assistant", content="I give up."))
    assert no_code.truncated and not no_code.terminated and no_code.reward == 0.0
    assert no_code.truncation_reason == "max_attempts"


async def test_last_attempt_is_graded_even_when_examples_fail(local_sandbox: Any) -> None:
    env = CodeEnv(CodeEnv.Config(max_attempts=1), sandbox=local_sandbox)
    await env.reset({"id": "fibonacci"})
    # right except for n = 0 (public example 1): graded on hidden tests anyway
    result = await env.step(say("n = int(input())\na, b = 1, 1\nfor _ in range(n - 1):\n    a, b = b, a + b\nprint(a)\n"))
    assert result.truncated and not result.terminated
    assert result.info["public_passed"] == 1 and result.reward == 1.0  # all hidden n >= 1


async def test_unknown_problem_and_bad_config() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValueError, match="unknown code problem id 'nope'"):
        await CodeEnv().reset({"id": "nope"})
    with pytest.raises(ValidationError, match="max_attempts"):
        CodeEnv.Config(max_attempts=0)


def test_a_bad_sandbox_spec_fails_when_the_env_is_built_not_in_every_episode() -> None:
    """The run's registry checks the sandbox name and params up front (code and math envs share the spec)."""
    from agentrl.errors import ConfigError
    from agentrl.registry import Plugins

    plugins = Plugins.discover()
    with pytest.raises(ConfigError, match=r"env\.sandbox: .*params\.pool_sise: unknown key; did you mean 'pool_size'"):
        plugins.create_env("code", {"sandbox": {"name": "local", "params": {"pool_sise": 2}}})
    with pytest.raises(ConfigError, match=r"env\.sandbox: .*name: unknown sandbox 'lokal'; did you mean 'local'"):
        plugins.create_env("math", {"sandbox": {"name": "lokal"}})
    env = plugins.create_env("code", {"sandbox": {"name": "local", "params": {"pool_size": 2}}})
    assert isinstance(env, CodeEnv) and env.config.sandbox.params == {"pool_size": 2}

"""The code reward: unit tests and stdin/stdout cases in a real sandbox, partial credit, errors."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from agentrl.envkit.rewards import Reward
from agentrl.sandboxes.local import LocalConfig, LocalSandbox
from agentrl.sandboxes.verifiers.code import CodeConfig, CodeVerifier, extract_code
from agentrl.types import Message

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _msgs(text: str) -> list[Message]:
    return [Message(role="user", content="write add"), Message(role="assistant", content=text)]


@pytest_asyncio.fixture
async def verifier() -> AsyncIterator[CodeVerifier]:
    async with LocalSandbox(LocalConfig(pool_size=2)) as sb:
        yield CodeVerifier(CodeConfig(timeout_s=2), sandbox=sb)


def test_extract_code_prefers_the_last_python_block() -> None:
    text = "```bash\nls\n```\n```python\nx = 1\n```\ntext\n```py\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nplain\n```") == "plain\n"
    assert extract_code("x = 3") == "x = 3"


async def test_unit_tests_partial_credit_and_error_kinds(verifier: CodeVerifier) -> None:
    assert isinstance(verifier, Reward)
    solution = "```python\ndef add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print('main!')\n```"
    task = {"tests": ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "import time\ntime.sleep(30)",
                      "assert add(2, 2) == 4"]}
    r = await verifier.score(task, _msgs(solution))
    assert r.value == 0.5
    statuses = [c["status"] for c in r.info["cases"]]
    assert statuses == ["passed", "runtime_error", "timeout", "passed"]
    assert "AssertionError" in r.info["cases"][1]["stderr"]
    assert r.info["compile_error"] is None


async def test_stdin_stdout_cases(verifier: CodeVerifier) -> None:
    solution = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    task = {"test_cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"},
                           {"input": "2 2\n", "output": "5\n"}, {"input": "x y\n", "output": "0"}]}
    r = await verifier.score(task, _msgs(solution))
    assert [c["status"] for c in r.info["cases"]] == ["passed", "passed", "wrong_answer", "runtime_error"]
    assert r.value == 0.5


async def test_compile_error_is_reported(verifier: CodeVerifier) -> None:
    r = await verifier.score({"tests": "assert f() == 1"}, _msgs("```python\ndef f(:\n    return 1\n```"))
    assert r.value == 0.0 and "SyntaxError" in r.info["compile_error"]
    assert r.breakdown["compiled"] == 0.0


async def test_all_or_nothing_and_bash(verifier: CodeVerifier) -> None:
    strict = CodeVerifier(CodeConfig(partial_credit=False), sandbox=await verifier.sandbox())
    r = await strict.score({"tests": ["assert f() == 1", "assert f() == 2"]}, _msgs("def f():\n    return 1\n"))
    assert r.value == 0.0 and r.breakdown["passed"] == 0.5
    r = await strict.score({"language": "bash", "test_cases": [{"input": "a\n", "output": "A"}]},
                           _msgs("```bash\ntr a-z A-Z\n```"))
    assert r.value == 1.0


async def test_missing_tests_key_is_a_clear_error(verifier: CodeVerifier) -> None:
    with pytest.raises(KeyError, match="tests"):
        await verifier.score({"answer": 1}, _msgs("x"))


async def test_owns_its_sandbox_from_config() -> None:
    v = CodeVerifier(CodeConfig(sandbox={"name": "local", "pool_size": 1}))
    r = await v.score({"tests": "assert f() == 1"}, _msgs("def f():\n    return 1\n"))
    assert r.value == 1.0
    await v.close()

'''``code`` reward: run the model's solution against tests in a sandbox.

Task schema (one of ``tests`` / ``test_cases`` is required)::

    {
      "tests": "assert add(1, 2) == 3" | ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
          # Python test code run with the solution importable as `solution`
          # (`from solution import *` is prepended); a list = one case each
      "test_cases": [{"input": "1 2\\n", "output": "3\\n"}, ...],
          # stdin/stdout cases: the solution runs as the main program, stdout is
          # compared after stripping trailing whitespace on every line
      "language": "python" | "bash",          # optional, for test_cases (default: config.language)
      "timeout_s": 5.0,                       # optional per-case wall timeout
    }

The solution is the last fenced code block of the last assistant message
(```python ... ``` or any fence), else the whole message. Python solutions
are compiled first (``py_compile`` in the sandbox): a compile error scores 0
and is reported. Cases run concurrently (the sandbox's own limit queues them).
Score: passed / total (``partial_credit: true``), else 1 only when all pass.
``info`` reports per-case status (passed, wrong_answer, runtime_error,
timeout, oom, output_limit, sandbox_error) with a stderr tail.
'''

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agentrl.envkit.rewards import RewardResult
from agentrl.registry import check_named_plugin
from agentrl.types import Message

from ..base import ExecRequest, ExecResult, Sandbox

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block (preferring python-tagged ones), else the text itself."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return text.strip()
    tagged = [str(code) for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (tagged or [str(code) for _, code in blocks])[-1].strip() + "\n"


def _normalize(out: str) -> str:
    return "\n".join(line.rstrip() for line in out.strip().splitlines())


def _tail(s: str, n: int = 600) -> str:
    return s if len(s) <= n else "..." + s[-n:]


class CodeConfig(BaseModel):
    """Settings of the ``code`` reward."""

    model_config = ConfigDict(extra="forbid")

    sandbox: dict[str, Any] = Field(
        default_factory=lambda: {"name": "local"},
        description="sandbox spec: {name: local|docker|e2b|sandboxfusion, <its params>}",
    )
    language: str = Field(
        default="python", description="language of the solution unless the task sets `language`"
    )
    timeout_s: float = Field(
        default=5.0, gt=0, description="wall-clock limit of one test run (seconds); a task's `timeout_s` overrides it"
    )
    memory_mb: int = Field(default=512, ge=16, description="memory limit of one test run (MB)")
    max_output_bytes: int = Field(default=1 << 16, ge=1, description="output kept from one test run (bytes)")
    partial_credit: bool = Field(
        default=True, description="reward = fraction of tests passed; false: 1 only when all pass, else 0"
    )

    @field_validator("sandbox")
    @classmethod
    def _known_sandbox(cls, spec: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The backend and its params are checked when the config loads, not at the first scored episode."""
        params = dict(spec)
        check_named_plugin(info.context, "sandboxes", str(params.pop("name", "local")), params)
        return spec


class CodeVerifier:
    """Code: run the solution against unit tests or stdin/stdout cases in a sandbox; partial credit.

    Task schema and scoring: see the module docstring. ``await close()`` when done.

    Pass ``sandbox=`` to share one sandbox between rewards and tools; otherwise
    one is made from ``config.sandbox`` on first use (and closed by :meth:`close`).
    """

    Config = CodeConfig

    def __init__(self, config: CodeConfig | None = None, *, sandbox: Sandbox | None = None) -> None:
        self.config = config or CodeConfig()
        self._sandbox = sandbox
        self._own = sandbox is None
        self._lock = asyncio.Lock()

    @classmethod
    def from_config(cls, config: CodeConfig | dict[str, Any] | None = None) -> CodeVerifier:
        return cls(config if isinstance(config, CodeConfig) else CodeConfig(**(config or {})))

    async def sandbox(self) -> Sandbox:
        async with self._lock:
            if self._sandbox is None:
                from agentrl.registry import Plugins

                spec = dict(self.config.sandbox)
                name = spec.pop("name", "local")
                sandbox = Plugins.discover().create_sandbox(name, spec, prefix="sandbox")
                self._sandbox = await sandbox.__aenter__()
            return self._sandbox

    def _request(self, task: dict[str, Any], **kw: Any) -> ExecRequest:
        return ExecRequest(
            wall_timeout_s=float(task.get("timeout_s", self.config.timeout_s)),
            memory_mb=self.config.memory_mb,
            max_output_bytes=self.config.max_output_bytes,
            **kw,
        )

    @staticmethod
    def _case_status(result: ExecResult, *, expected: str | None = None) -> str:
        if result.status == "ok":
            if expected is None or _normalize(result.stdout) == _normalize(expected):
                return "passed"
            return "wrong_answer"
        return "runtime_error" if result.status == "error" else result.status

    async def score(self, task: dict[str, Any], messages: Sequence[Message]) -> RewardResult:
        if "tests" not in task and "test_cases" not in task:
            raise KeyError(f"code reward: task needs 'tests' or 'test_cases' (keys: {sorted(task)})")
        text = next((m.content for m in reversed(messages) if m.role == "assistant"), "")
        solution = extract_code(text)
        language = task.get("language", self.config.language)
        sb = await self.sandbox()
        info: dict[str, Any] = {"compile_error": None}
        if language == "python":
            check = await sb.run(self._request(task, argv=["python3", "-I", "-S", "-m", "py_compile", "solution.py"],
                                               files={"solution.py": solution}))
            if check.status != "ok":
                info["compile_error"] = _tail(check.stderr or check.message) or check.status
                return RewardResult(0.0, {"passed": 0.0, "compiled": 0.0}, info)

        if "test_cases" in task:
            cases = list(task["test_cases"])
            requests = [self._request(task, code=solution, language=language, stdin=str(c.get("input", "")))
                        for c in cases]
            expected: list[str | None] = [str(c.get("output", "")) for c in cases]
        else:
            tests = task["tests"]
            tests = [tests] if isinstance(tests, str) else list(tests)
            requests = [self._request(task, code="from solution import *\n" + t, files={"solution.py": solution})
                        for t in tests]
            expected = [None] * len(tests)
        results = await asyncio.gather(*(sb.run(r) for r in requests))
        case_info = []
        for result, exp in zip(results, expected, strict=True):
            status = self._case_status(result, expected=exp)
            entry: dict[str, Any] = {"status": status}
            if status != "passed":
                entry["stderr"] = _tail(result.stderr or result.message)
            case_info.append(entry)
        passed = sum(c["status"] == "passed" for c in case_info)
        total = len(case_info)
        info["cases"] = case_info
        info["passed"], info["total"] = passed, total
        fraction = passed / total if total else 0.0
        value = fraction if self.config.partial_credit else float(total > 0 and passed == total)
        return RewardResult(value, {"passed": fraction, "compiled": 1.0}, info)

    async def close(self) -> None:
        if self._own and self._sandbox is not None:
            await self._sandbox.close()
            self._sandbox = None

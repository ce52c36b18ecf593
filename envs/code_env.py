"""`code`: write a stdin/stdout program, see it fail on the examples, fix it, get graded.

Each turn the model sends a complete Python program in a ```python block. The
env runs it in the sandbox on the problem's public examples: if one fails and
attempts remain, the model sees what went wrong (input, expected, got, error)
and tries again. When the examples pass, or attempts run out, the last program
is graded on the hidden tests: reward = fraction passed. The hidden tests are
never shown. The sandbox is shared by the envs of a run. Problems ship in `envs/data/code_problems.jsonl` (written for this
project; `envs/data/build_code_problems.py` rebuilds it) or come from your own
JSONL file of the same shape.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.registry import PluginRef
from agentrl.run.resources import RunResources
from agentrl.types import JSON, Message

from .tool_support import resolve_plugins, run_resources

_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

INSTRUCTIONS = (
    "Write a complete Python 3 program that reads from standard input and writes to standard output. "
    "Put the whole program in one ```python code block. I will run it on the examples and show you "
    "any failures; then the final program is graded on hidden tests."
)


class SandboxSpec(PluginRef):
    """Which sandbox plugin runs the programs, and its params (checked when the config loads)."""

    kind: ClassVar[str] = "sandboxes"
    name: str = Field("local", description="sandbox plugin name, e.g. local, docker, e2b, sandboxfusion")
    params: dict[str, JSON] = Field(default_factory=dict, description="options of that sandbox plugin (its Config)")


class CodeConfig(EnvConfig):
    """Config of the `code` env."""

    problems_path: str | None = Field(None, description="JSONL of problems; default: the bundled set")
    sandbox: SandboxSpec = Field(
        default_factory=lambda: SandboxSpec(name="local"), description="runs the programs; one per distinct spec, shared by the run's envs"
    )
    max_attempts: int = Field(3, ge=1, description="programs the model may submit per episode")
    test_timeout_s: float = Field(5.0, gt=0, le=600, description="wall-clock limit of one program run on one test (seconds)")
    memory_mb: int = Field(256, ge=16, description="memory limit of one program run (MB)")
    max_failures_shown: int = Field(2, ge=1, description="failing examples detailed in the feedback after an attempt")
    max_shown_chars: int = Field(400, ge=20, description="cap on each of input/expected/got/stderr in feedback")


class SandboxFailure(RuntimeError):
    """The sandbox itself failed (not the program): the rollout classifies it as a sandbox error."""

    error_class = "sandbox"


@dataclass(slots=True)
class TestOutcome:
    passed: bool
    status: str
    stdout: str
    stderr: str


def load_problems(path: str | None) -> list[dict[str, Any]]:
    """Problems from a JSONL file, or the bundled set; each needs id, statement and tests."""
    if path is None:
        text = resources.files("agentrl.envs").joinpath("data/code_problems.jsonl").read_text(encoding="utf-8")
        where = "bundled code_problems.jsonl"
    else:
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"problems_path={path!r}: no such file")
        text, where = file.read_text(encoding="utf-8"), path
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {"id", "statement", "public_tests", "hidden_tests"} - set(row)
        if missing:
            raise ValueError(f"{where}:{lineno}: problem lacks {sorted(missing)}")
        problems.append(row)
    return problems


def outputs_match(expected: str, got: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""

    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.rstrip().splitlines()]

    return norm(expected) == norm(got)


def extract_program(text: str) -> str | None:
    """The last fenced code block of the reply (None if there is none)."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


class CodeEnv(Env[CodeConfig]):
    """Programming problems graded by hidden tests in a sandbox, with feedback and retries."""

    name: ClassVar[str] = "code"
    description: ClassVar[str] = "Write a program, see failing examples, retry; reward = hidden tests passed"

    def __init__(
        self,
        config: CodeConfig | None = None,
        *,
        sandbox: Any = None,
        plugins: Any = None,
        resources: RunResources | None = None,
    ) -> None:
        super().__init__(config)
        self._sandbox = sandbox  # given: used as it is; else the run's shared one, fetched on first use
        self._plugins = plugins
        self.resources, self._owns_resources = run_resources(resources)
        self._problems: dict[str, dict[str, Any]] | None = None
        self._problem: dict[str, Any] | None = None
        self._attempts = 0

    def problems(self) -> dict[str, dict[str, Any]]:
        if self._problems is None:
            self._problems = {p["id"]: p for p in load_problems(self.config.problems_path)}
        return self._problems

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r} is not a split of code (allowed: train, test)")
        for pid, p in self.problems().items():
            if p.get("split", "train") == split:
                yield {"id": pid, "split": split, "title": p.get("title", pid)}

    def demonstrations(self) -> list[list[Message]]:
        """One solved episode per train problem that ships a reference solution."""
        out = []
        for task in self.tasks("train"):
            problem = self.problems()[task["id"]]
            if problem.get("solution"):
                out.append([
                    Message(role="user", content=self.prompt(problem)),
                    Message(role="assistant", content=f"```python\n{problem['solution']}```"),
                ])
        return out

    def prompt(self, problem: dict[str, Any]) -> str:
        examples = "\n\n".join(
            f"Example {i}\nInput:\n{t['stdin']}Output:\n{t['stdout']}" for i, t in enumerate(problem["public_tests"], 1)
        )
        return f"{problem.get('title', problem['id'])}\n\n{problem['statement']}\n\n{examples}\n\n{INSTRUCTIONS}"

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        problem = self.problems().get(str(task.get("id")))
        if problem is None:
            raise ValueError(f"unknown code problem id {task.get('id')!r}")
        self._problem = problem
        self._attempts = 0
        return [Message(role="user", content=self.prompt(problem))], {"problem": problem["id"]}

    async def step(self, action: Message) -> StepResult:
        if self._problem is None:
            raise RuntimeError("step() called before reset()")
        self._attempts += 1
        last = self._attempts >= self.config.max_attempts
        program = extract_program(action.content)
        if program is None:
            if last:
                return StepResult(
                    messages=[], reward=0.0, truncated=True,
                    info={"format_error": True}, truncation_reason="max_attempts",
                )
            note = "I found no ```python code block in your reply. Send the whole program in one block."
            return StepResult(messages=[Message(role="user", content=note)], info={"format_error": True})

        public = await self.run_tests(program, self._problem["public_tests"])
        public_passed = sum(o.passed for o in public)
        info: dict[str, JSON] = {"attempt": self._attempts, "public_passed": public_passed, "public_total": len(public)}
        if public_passed == len(public) or last:
            hidden = await self.run_tests(program, self._problem["hidden_tests"])
            passed = sum(o.passed for o in hidden)
            info.update(hidden_passed=passed, hidden_total=len(hidden))
            reward = passed / len(hidden) if hidden else 0.0
            done_ok = public_passed == len(public)
            return StepResult(
                messages=[], reward=reward, terminated=done_ok, truncated=not done_ok, info=info,
                truncation_reason=None if done_ok else "max_attempts",
            )
        return StepResult(messages=[Message(role="user", content=self.feedback(public))], info=info)

    def feedback(self, outcomes: Sequence[TestOutcome]) -> str:
        assert self._problem is not None
        cap = self.config.max_shown_chars
        tests = self._problem["public_tests"]
        failed = [(t, o) for t, o in zip(tests, outcomes, strict=True) if not o.passed]
        parts = [f"{len(failed)} of {len(tests)} examples failed."]
        for test, outcome in failed[: self.config.max_failures_shown]:
            part = f"Input:\n{_cap(test['stdin'], cap)}\nExpected:\n{_cap(test['stdout'], cap)}\n"
            part += f"Got ({outcome.status}):\n{_cap(outcome.stdout, cap)}"
            if outcome.stderr.strip():
                part += f"\nError:\n{_cap(outcome.stderr, cap, keep='end')}"
            parts.append(part)
        attempts_left = self.config.max_attempts - self._attempts
        parts.append(f"Fix the program and send it again ({attempts_left} attempt(s) left).")
        return "\n\n".join(parts)

    async def run_tests(self, program: str, tests: Sequence[dict[str, str]]) -> list[TestOutcome]:
        """Run `program` once per test, concurrently (the sandbox queues beyond its limit)."""
        from agentrl.sandboxes.base import ExecRequest

        sandbox = await self.sandbox()

        async def one(test: dict[str, str]) -> TestOutcome:
            request = ExecRequest(
                code=program,
                stdin=test["stdin"],
                wall_timeout_s=self.config.test_timeout_s,
                memory_mb=self.config.memory_mb,
                max_output_bytes=64 * 1024,
            )
            result = await asyncio.wait_for(sandbox.run(request), self.config.test_timeout_s + 30)
            if result.status == "sandbox_error":
                raise SandboxFailure(f"sandbox failed: {result.message}")  # infrastructure, not the model
            passed = result.status == "ok" and outputs_match(test["stdout"], result.stdout)
            return TestOutcome(passed, result.status, result.stdout, result.stderr or result.message)

        return list(await asyncio.gather(*(one(t) for t in tests)))

    async def sandbox(self) -> Any:
        """The given sandbox, else the run's shared one for `config.sandbox`."""
        return self._sandbox or shared_sandbox(self.config.sandbox, self._plugins, self.resources)

    async def close(self) -> None:
        if self._owns_resources:
            await self.resources.aclose()


def shared_sandbox(spec: SandboxSpec, plugins: Any, resources: RunResources) -> Any:
    """The run's sandbox for `spec`, made on first use (one per distinct spec); the run closes it.

    `plugins` is the run's registry (None: discover, only when the sandbox is made).
    """
    return resources.get(
        "sandbox:" + spec.model_dump_json(),
        lambda: resolve_plugins(plugins).create_sandbox(spec.name, spec.params, prefix="sandbox.params"),
    )


def _cap(text: str, limit: int, keep: str = "start") -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + "...[cut]" if keep == "start" else "[cut]..." + text[-limit:]

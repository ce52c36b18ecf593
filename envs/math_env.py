"""`math`: math word problems scored by the math verifier; optionally with a Python tool.

Problems come from a reasoning-gym math generator (`dataset`, default
`basic_arithmetic`) or from your own JSONL file (`problems_path`, rows with
`question` and `answer`, optional `id`). The model answers in `\\boxed{}`;
the reward plugins in `rewards` score it (default: the `math` verifier, which
compares the extracted answer with `task["answer"]` by math-verify).

`mode: tool` gives the model a `python` tool that runs code in the sandbox
(stdout/stderr come back as the tool message), so it can compute instead of
guessing; the episode ends at the first reply without a tool call. The
sandbox and the reward objects are shared by the envs of a run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from agentrl.env import Task
from agentrl.run.resources import RunResources
from agentrl.tools import Tool, tool
from agentrl.types import JSON, Message

from .code_env import SandboxSpec, shared_sandbox
from .reasoning_gym_env import ReasoningGymConfig, ReasoningGymEnv
from .reward_specs import NamedReward
from .tool_support import ToolCapableConfig, ToolCapableEnv

SINGLE_PROMPT = "Solve the problem. Give the final answer as \\boxed{ANSWER}."
TOOL_PROMPT = (
    "Solve the problem. You may call the `python` tool to run Python code; it returns what the code "
    "prints. When you are done, reply without a tool call and give the final answer as \\boxed{ANSWER}."
)


class MathConfig(ToolCapableConfig):
    """Config of the `math` env."""

    mode: Literal["single", "tool"] = Field(
        "single", description="single: one reply, no tools; tool: adds the sandboxed `python` tool (multi-turn)"
    )
    dataset: str = Field("basic_arithmetic", description="reasoning-gym generator of the problems")
    dataset_params: dict[str, JSON] = Field(
        default_factory=dict, description="keyword arguments of the reasoning-gym dataset's own config"
    )
    problems_path: str | None = Field(None, description="JSONL with question/answer; replaces `dataset`")
    test_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="problems_path only: hashed held-out share")
    seed: int = Field(0, description="reasoning-gym generator seed; ignored with problems_path")
    train_size: int = Field(1000, ge=1, description="generated train problems; ignored with problems_path")
    test_size: int = Field(
        100, ge=0, description="generated test problems (less repeats of train); 0 = none; ignored with problems_path"
    )
    system_prompt: str | None = Field(None, description="default: a prompt matching `mode`")
    sandbox: SandboxSpec = Field(default_factory=lambda: SandboxSpec(name="local"), description="runs the python tool")
    python_timeout_s: float = Field(5.0, gt=0, le=600, description="wall limit of one python run")
    python_memory_mb: int = Field(256, ge=16, description="memory limit of one python run (MB)")

    @model_validator(mode="after")
    def _tools_match_mode(self) -> MathConfig:
        if self.mode == "single" and self.tools:
            raise ValueError("tools: single mode takes no tools (set mode: tool)")
        return self


class MathEnv(ToolCapableEnv[MathConfig]):
    """A math problem per episode; `\\boxed{}` answer checked by the configured verifier."""

    name: ClassVar[str] = "math"
    description: ClassVar[str] = "Math problems, single-turn or with a sandboxed Python tool; math verifier reward"

    def __init__(
        self,
        config: MathConfig | None = None,
        *,
        rewards: Sequence[NamedReward] | None = None,
        sandbox: Any = None,
        plugins: Any = None,
        resources: RunResources | None = None,
    ) -> None:
        cfg = config if config is not None else MathConfig.model_validate({})
        extra = [self._python_tool(cfg)] if cfg.mode == "tool" else []
        super().__init__(cfg, rewards=rewards, extra_tools=extra, plugins=plugins, resources=resources)
        self._sandbox = sandbox  # given: used as it is; else the run's shared one, fetched on first use
        self._generator: ReasoningGymEnv | None = None
        self._file_tasks: list[Task] | None = None

    def _python_tool(self, cfg: MathConfig) -> Tool:
        async def python(code: str) -> str:
            """Run Python code in a sandbox and return what it prints (stdout; errors on failure).

            Args:
                code: a complete Python program; use print() to show results
            """
            return await self.run_python(code)

        # the sandbox enforces python_timeout_s; the tool deadline only backs it up
        return tool(python, timeout_s=cfg.python_timeout_s + 10.0)

    # -- tasks --------------------------------------------------------------

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r} is not a split of math (allowed: train, test)")
        if self.config.problems_path is not None:
            return (t for t in self._load_file() if t["split"] == split)
        if self._generator is None:
            self._generator = ReasoningGymEnv(
                ReasoningGymConfig(
                    dataset=self.config.dataset, dataset_params=self.config.dataset_params, seed=self.config.seed,
                    train_size=self.config.train_size, test_size=self.config.test_size,
                )
            )
        return self._generator.tasks(split)

    def _load_file(self) -> list[Task]:
        if self._file_tasks is None:
            assert self.config.problems_path is not None
            path = Path(self.config.problems_path).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"problems_path={self.config.problems_path!r}: no such file")
            tasks: list[Task] = []
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if "question" not in row or "answer" not in row:
                    raise ValueError(f"{path}:{lineno}: a math problem needs 'question' and 'answer'")
                task_id = str(row.get("id") or hashlib.sha1(row["question"].encode()).hexdigest()[:16])
                bucket = int(hashlib.sha1(task_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
                split = "test" if bucket < self.config.test_fraction else "train"
                tasks.append({"id": task_id, "split": split, "question": row["question"], "answer": str(row["answer"])})
            self._file_tasks = tasks
        return self._file_tasks

    # -- episode ------------------------------------------------------------

    def initial_messages(self, task: Task) -> list[Message]:
        if "question" not in task:
            raise ValueError(f"math task needs a 'question', got keys {sorted(task)}")
        prompt = self.config.system_prompt or (TOOL_PROMPT if self.config.mode == "tool" else SINGLE_PROMPT)
        return [Message(role="system", content=prompt), Message(role="user", content=str(task["question"]))]

    async def run_python(self, code: str) -> str:
        """The `python` tool: run `code` in the sandbox, return what a person would see."""
        from agentrl.sandboxes.base import ExecRequest

        sandbox = self._sandbox or shared_sandbox(self.config.sandbox, self.plugins, self.resources)
        result = await sandbox.run(
            ExecRequest(
                code=code,
                wall_timeout_s=self.config.python_timeout_s,
                memory_mb=self.config.python_memory_mb,
                max_output_bytes=16 * 1024,
            )
        )
        return format_exec_result(result)



def format_exec_result(result: Any) -> str:
    """stdout, then stderr and the status when something went wrong."""
    out = result.stdout
    if result.stdout_truncated:
        out += "\n[output truncated]"
    if result.status != "ok":
        detail = result.stderr.strip() or result.message
        out += f"\n[{result.status}" + (f", exit code {result.exit_code}" if result.exit_code else "") + "]"
        if detail:
            out += f"\n{detail[-2000:]}"
    return out.strip() or "(no output; use print() to see values)"

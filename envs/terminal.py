"""`terminal` and `harbor`: an agent in a shell workspace, graded by the task's own tests.

Each episode gets one workspace (agentrl.sandboxes.workspace) of its task,
forked copy-on-write from the task's prepared state (the set-up runs once per
task, not once per episode). The prompt is the task's instruction; the tools
are `bash`, `read_file`, `write_file` and `submit`. After `submit`, a reply
without tool calls, or `max_turns` tool turns, the task's tests are copied
into the same workspace (never earlier: the model never sees them) and run;
the reward is what they write (`/logs/verifier/reward.txt` or `.json`).

A workspace that dies or a backend that fails is an infrastructure failure:
the episode ends with an error of class `sandbox` (retried by the rollout
manager, its group dropped when retries run out), never a zero reward in the
group's statistics.

`terminal` runs the bundled tasks (envs/data/terminal-tasks, Harbor format);
`harbor` runs a directory of your own Harbor tasks (`tasks: DIR`). See
docs/terminal.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from importlib import resources as importlib_resources
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from agentrl.env import EnvConfig, StepResult, Task
from agentrl.envkit.tool_env import ToolEnv, ToolEnvConfig
from agentrl.run.resources import RunResources
from agentrl.sandboxes.workspace import (
    CommandResult,
    PreparedState,
    Workspace,
    WorkspaceError,
    WorkspaceFileError,
    WorkspaceSpec,
)
from agentrl.tools import tool
from agentrl.types import Message, ToolCall

from .code_env import SandboxSpec, shared_sandbox
from .harbor import (
    LOGS_DIR,
    REWARD_JSON,
    REWARD_TXT,
    SOLUTION_DIR,
    TESTS_DIR,
    HarborFormatError,
    HarborTask,
    load_tasks,
    parse_reward,
)
from .tool_support import run_resources

GUIDE = (
    "You are working in a Linux shell workspace. Use the tools: `bash` runs a command (in the working "
    "directory {workdir}), `read_file` and `write_file` read and write files, `submit` ends your work; "
    "then hidden tests check the result."
)


class TerminalConfig(ToolEnvConfig):
    """Config of the `terminal` env (and of `harbor`, which needs `tasks`)."""

    tasks: str | None = Field(default=None, description="directory of Harbor task dirs; default: the bundled set")
    sandbox: SandboxSpec = Field(
        default_factory=lambda: SandboxSpec(name="local"),
        description="where workspaces run: local (bubblewrap) or docker (task images built from their Dockerfile)",
    )
    max_turns: int = Field(default=10, ge=1, description="tool turns before the tests run anyway")
    command_timeout_s: float = Field(default=30.0, gt=0, le=3600, description="limit of one bash command (seconds)")
    max_output_chars: int = Field(default=4000, ge=100, description="command output shown to the model, at most")
    fork: bool = Field(default=True, description="set up each task once and fork it per episode (copy-on-write)")
    disk_mb: int = Field(default=512, ge=16, description="writable space of one workspace on local (MB)")
    tool_timeout_s: float = Field(default=120.0, gt=0, description="per-call limit of a tool")
    few_shot: int = Field(default=0, ge=0, le=8, description=(
        "worked train tasks put in every prompt before the task (instruction -> bash with the oracle's "
        "solve.sh -> its result -> submit); the shortest oracles, never the task itself"))


class TaskStates:
    """Per task: its built image (docker) and prepared state, made once and shared by a run's episodes."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self.prepared: dict[str, tuple[WorkspaceSpec, PreparedState | None]] = {}

    async def get(self, task: HarborTask, sandbox: Any, cfg: TerminalConfig) -> tuple[WorkspaceSpec,
                                                                                     PreparedState | None]:
        lock = self._locks.setdefault(task.name, asyncio.Lock())
        async with lock:
            if task.name not in self.prepared:
                self.prepared[task.name] = await self._make(task, sandbox, cfg)
            return self.prepared[task.name]

    async def _make(self, task: HarborTask, sandbox: Any, cfg: TerminalConfig) -> tuple[WorkspaceSpec,
                                                                                       PreparedState | None]:
        if hasattr(sandbox, "client"):  # docker: the task's own image
            image, workdir = await build_image(sandbox, task)
            return task.docker_spec(image, workdir), None
        spec = task.local_spec(disk_mb=cfg.disk_mb)
        if not cfg.fork:
            return spec, None
        return spec, await sandbox.prepare(spec)

    async def close(self) -> None:
        states, self.prepared = list(self.prepared.values()), {}
        for _, prepared in states:
            if prepared is not None:
                with contextlib.suppress(Exception):
                    await prepared.close()


async def build_image(sandbox: Any, task: HarborTask) -> tuple[str, str]:
    """Build the task's Dockerfile on the local daemon (never pulls); the tag and its working dir."""
    tag = task.image_tag()
    timeout = float(task.config.get("environment", {}).get("build_timeout_sec", 600.0))

    def build() -> tuple[str, str]:
        import docker.errors

        try:
            image = sandbox.client.images.get(tag)
        except docker.errors.ImageNotFound:
            image, _ = sandbox.client.images.build(path=str(task.path / "environment"), tag=tag, pull=False,
                                                   rm=True, forcerm=True, network_mode="none",
                                                   labels={"org.agentrl.harbor": task.name})
        workdir = (image.attrs.get("Config") or {}).get("WorkingDir") or "/app"
        return tag, workdir

    async with asyncio.timeout(timeout):
        return await asyncio.to_thread(build)


class WorkspaceDied(RuntimeError):
    """The episode's workspace or its backend failed: an infrastructure failure, not the model's."""

    error_class = "sandbox"


class TerminalEnv(ToolEnv[TerminalConfig]):
    """A shell workspace per episode; reward from the task's tests run in it afterwards."""

    name: ClassVar[str] = "terminal"
    description: ClassVar[str] = "Shell tasks in a workspace (Harbor format), graded by the task's own tests"

    def __init__(self, config: TerminalConfig | None = None, *, sandbox: Any = None, plugins: Any = None,
                 resources: RunResources | None = None) -> None:
        cfg = config if config is not None else self.Config.model_validate({})
        assert isinstance(cfg, TerminalConfig)
        tools = [
            tool(self.bash, timeout_s=cfg.command_timeout_s + 30),
            tool(self.read_file, timeout_s=60),
            tool(self.write_file, timeout_s=60),
            tool(self.submit, timeout_s=5),
        ]
        super().__init__(cfg, tools=tools)
        self._sandbox = sandbox
        self._plugins = plugins
        self.resources, self._owns_resources = run_resources(resources)
        self._tasks: dict[str, HarborTask] | None = None
        self._shot_tasks: list[Task] | None = None
        self.ws: Workspace | None = None
        self.task: HarborTask | None = None
        self._turns = 0
        self._submitted = False
        self._failure: BaseException | None = None

    # -- tasks
    def tasks_dir(self) -> Path:
        if self.config.tasks is not None:
            return Path(self.config.tasks).expanduser()
        return Path(str(importlib_resources.files("agentrl.envs").joinpath("data/terminal-tasks")))

    def harbor_tasks(self) -> dict[str, HarborTask]:
        if self._tasks is None:
            self._tasks = {t.name: t for t in load_tasks(self.tasks_dir())}
        return self._tasks

    def tasks(self, split: str = "train") -> Iterable[Task]:
        for name, t in self.harbor_tasks().items():
            if t.split in (None, split):
                yield {"id": name, "split": split}

    def demonstrations(self) -> list[list[Message]]:
        """One conversation per train task with an oracle: its solve.sh as one bash call, then submit."""
        return [d for task in self.tasks("train") if (d := self._solved(task, self.initial_messages(task)))]

    def _solved(self, task: Task, opening: list[Message]) -> list[Message] | None:
        """`opening`, then the task's oracle as the assistant's turns with their tool results."""
        replies = self.oracle(task)
        if replies is None:
            return None
        bash, submit = replies
        return [
            *opening,
            bash, Message(role="tool", content="[exit code 0]", tool_call_id="call_0", name="bash"),
            submit, Message(role="tool", content="submitted", tool_call_id="call_1", name="submit"),
        ]

    def _shots(self, task: Task) -> list[Message]:
        """`few_shot` solved train tasks (the shortest oracles but `task`), as prior exchanges of the prompt."""
        if self.config.few_shot == 0:
            return []
        if self._shot_tasks is None:
            scripts = {str(t["id"]): self._oracle_script(t) for t in self.tasks("train")}
            self._shot_tasks = sorted((t for t in self.tasks("train") if scripts[str(t["id"])] is not None),
                                      key=lambda t: (len(scripts[str(t["id"])] or ""), str(t["id"])))
        picked = [t for t in self._shot_tasks if t["id"] != task.get("id")][: self.config.few_shot]
        out: list[Message] = []
        for t in picked:
            out += self._solved(t, [Message(role="user", content=self._harbor_task(t).instruction.strip())]) or []
        return out

    def oracle(self, task: Task) -> list[Message] | None:
        """The task's solution/solve.sh as one `bash` call, then `submit`; None for a task without one."""
        script = self._oracle_script(task)
        if script is None:
            return None
        return [
            Message(role="assistant", content="", tool_calls=[
                ToolCall(id="call_0", name="bash", arguments={"command": script})]),
            Message(role="assistant", content="", tool_calls=[ToolCall(id="call_1", name="submit", arguments={})]),
        ]

    def _oracle_script(self, task: Task) -> str | None:
        solve = self._harbor_task(task).path / "solution" / "solve.sh"
        return solve.read_text().strip() if solve.is_file() else None

    def _harbor_task(self, task: Task) -> HarborTask:
        found = self.harbor_tasks().get(str(task.get("id")))
        if found is None:
            raise ValueError(f"unknown terminal task id {task.get('id')!r} (tasks dir {self.tasks_dir()})")
        return found

    def initial_messages(self, task: Task) -> list[Message]:
        t = self._harbor_task(task)
        try:
            workdir = t.recipe().workdir
        except HarborFormatError:  # a Dockerfile only docker can build
            workdir = "the image's working directory"
        return [Message(role="system", content=GUIDE.format(workdir=workdir)), *self._shots(task),
                Message(role="user", content=t.instruction.strip())]

    # -- workspace lifecycle
    async def sandbox(self) -> Any:
        return self._sandbox or shared_sandbox(self.config.sandbox, self._plugins, self.resources)

    def states(self) -> TaskStates:
        return self.resources.get("terminal-tasks:" + self.config.sandbox.model_dump_json() + str(self.tasks_dir()),
                                  TaskStates)

    async def open_workspace(self, t: HarborTask) -> Workspace:
        try:
            sb = await self.sandbox()
            spec, prepared = await self.states().get(t, sb, self.config)
            ws: Workspace = sb.workspace(spec, prepared=prepared)
            return await ws.start()
        except WorkspaceError as e:
            if getattr(e, "error_class", "sandbox") == "env":
                raise
            raise WorkspaceDied(f"could not start the workspace of {t.name}: {e}") from e

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        await self._close_ws()
        self.task = self._harbor_task(task)
        self._turns, self._submitted, self._failure = 0, False, None
        self.ws = await self.open_workspace(self.task)
        messages, info = await super().reset(task, seed=seed)
        return messages, {**info, "task": self.task.name}

    # -- tools (the model's)
    async def bash(self, command: str) -> str:
        """Run a shell command in the workspace; returns its output and exit code.

        Args:
            command: the bash command line to run
        """
        r = await self._ws_call(self._ws().exec(command, timeout_s=self.config.command_timeout_s,
                                                 max_output_bytes=self.config.max_output_chars * 4))
        assert isinstance(r, CommandResult)
        return r.as_text(self.config.max_output_chars)

    async def read_file(self, path: str) -> str:
        """Read a text file of the workspace.

        Args:
            path: the file's path (relative to the working directory, or absolute)
        """
        data = await self._ws_call(self._ws().read_file(path, max_bytes=self.config.max_output_chars * 4))
        assert isinstance(data, bytes)
        text = data.decode("utf-8", "replace")
        return text if len(text) <= self.config.max_output_chars else text[: self.config.max_output_chars] + "\n[cut]"

    async def write_file(self, path: str, content: str) -> str:
        """Write a text file in the workspace (parent directories are made).

        Args:
            path: the file's path (relative to the working directory, or absolute)
            content: the whole new content of the file
        """
        await self._ws_call(self._ws().write_file(path, content))
        return f"wrote {len(content.encode())} bytes to {path}"

    async def submit(self) -> str:
        """Finish: the hidden tests check the workspace now."""
        self._submitted = True
        return "submitted"

    def _ws(self) -> Workspace:
        if self.ws is None:
            raise RuntimeError("no workspace: call reset() first")
        return self.ws

    async def _ws_call(self, aw: Any) -> Any:
        """Await a workspace call; a dead workspace is remembered as the episode's failure."""
        try:
            return await aw
        except WorkspaceFileError:
            raise  # the model's mistake: it reads as a tool error
        except WorkspaceError as e:
            if getattr(e, "error_class", "sandbox") == "timeout":
                self._failure = e
            else:
                self._failure = WorkspaceDied(f"the workspace died: {e}")
            raise

    # -- episode flow
    async def step(self, action: Message) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() called before reset()")
        if action.tool_calls:
            result = await super().step(action)
            if self._failure is not None:
                raise self._failure
            self._turns += 1
            if not self._submitted and self._turns < self.config.max_turns:
                return result
            reward, info = await self.verify()
            done = self._submitted
            return StepResult(messages=result.messages, reward=reward, terminated=done, truncated=not done,
                              truncation_reason=None if done else "max_turns",
                              info={**result.info, **info}, tool_errors=result.tool_errors,
                              tool_timeouts=result.tool_timeouts, reward_breakdown=verdict(reward, info))
        self.history.append(action)
        reward, info = await self.verify()
        return StepResult(messages=[], reward=reward, terminated=True, info=info,
                          reward_breakdown=verdict(reward, info))

    async def verify(self) -> tuple[float, dict[str, Any]]:
        """Copy the tests in, run them, read the reward they wrote (0.0 if none)."""
        assert self.task is not None
        return await run_tests(self._ws(), self.task)

    async def close(self) -> None:
        await self._close_ws()
        if self._owns_resources:
            await self.resources.aclose()

    async def _close_ws(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close()


def verdict(reward: float, info: dict[str, Any]) -> dict[str, float]:
    """The tests' verdict as the trajectory's reward breakdown (the replay shows it with the reward)."""
    code = info.get("tests_exit_code")
    return {"tests": reward, "tests_exit_code": float(code if code is not None else -1),
            "tests_timed_out": float(bool(info.get("tests_timed_out")))}


async def run_tests(ws: Workspace, task: HarborTask) -> tuple[float, dict[str, Any]]:
    """Run ``task``'s tests in ``ws`` (tests copied in now); the reward and what the verifier said.

    A workspace failure raises WorkspaceDied (infrastructure); a verifier that writes no reward gives 0.0.
    """
    try:
        for rel, data in task.files_of("tests").items():
            await ws.write_file(f"{TESTS_DIR}/{rel}", data, mode=0o755 if rel.endswith(".sh") else 0o644)
        r = await ws.exec(f"mkdir -p {LOGS_DIR}/verifier {LOGS_DIR}/agent; bash {TESTS_DIR}/test.sh",
                          timeout_s=task.verifier_timeout_s, env=task.verifier_env, max_output_bytes=16384)
        txt = js = None
        with contextlib.suppress(WorkspaceFileError):
            txt = (await ws.read_file(REWARD_TXT)).decode(errors="replace")
        if txt is None:
            with contextlib.suppress(WorkspaceFileError):
                js = (await ws.read_file(REWARD_JSON)).decode(errors="replace")
    except WorkspaceFileError as e:
        raise WorkspaceDied(f"could not copy the tests in: {e}") from e
    except WorkspaceError as e:
        if getattr(e, "error_class", "sandbox") == "timeout":
            raise
        raise WorkspaceDied(f"the workspace died while the tests ran: {e}") from e
    reward = parse_reward(txt, js)
    info: dict[str, Any] = {"tests_exit_code": r.exit_code, "tests_timed_out": r.timed_out,
                            "tests_output": (r.stdout + r.stderr)[-2000:]}
    if reward is None:
        info["reward_missing"] = True
    return (reward or 0.0), info


async def run_oracle(ws: Workspace, task: HarborTask) -> tuple[float, dict[str, Any]]:
    """The task's solution/solve.sh in ``ws``, then its tests: the oracle's reward."""
    for rel, data in task.files_of("solution").items():
        await ws.write_file(f"{SOLUTION_DIR}/{rel}", data, mode=0o755 if rel.endswith(".sh") else 0o644)
    solved = await ws.exec(f"bash {SOLUTION_DIR}/solve.sh", timeout_s=task.agent_timeout_s, max_output_bytes=16384)
    reward, info = await run_tests(ws, task)
    return reward, {**info, "solve_exit_code": solved.exit_code, "solve_output": (solved.stdout + solved.stderr)[-2000:]}


class HarborConfig(TerminalConfig):
    """Config of the `harbor` env: your own Harbor task directories."""

    tasks: str | None = Field(default=..., description="directory of Harbor task dirs (or one task dir)")


class HarborEnv(TerminalEnv):
    """Harbor task directories, unmodified (task.toml, instruction.md, environment/, tests/, solution/)."""

    name: ClassVar[str] = "harbor"
    description: ClassVar[str] = "Harbor-format task directories in a shell workspace, graded by their tests"
    Config: ClassVar[type[EnvConfig]] = HarborConfig

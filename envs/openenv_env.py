"""`openenv`: drive an OpenEnv environment server over its own client protocol.

    env: {name: openenv, app: "server.app:app", app_dir: path/to/my_env, action_field: message}
    env: {name: openenv, url: "http://127.0.0.1:8000", action_format: json}

An OpenEnv environment (`openenv-core`, https://github.com/meta-pytorch/OpenEnv)
is a server with ``reset``/``step``/``state`` over a WebSocket session
(``/ws``); each episode here is one session of the package's own
`GenericEnvClient`. The server is either started by the run as a local
process (``app``: uvicorn serving that ASGI app on a free loopback port, one
process per run, shared by its episodes, stopped at the run's end) or reached
at ``url`` (a container you started, e.g. ``docker run -p 8000:8000 IMAGE``,
or any host).

The model's reply becomes the action: ``{action_field: reply}``
(``action_format: text``) or the reply parsed as a JSON object
(``action_format: json``; a reply that is no JSON object is told so and costs
a turn, the server is not stepped). The observation comes back as the next
user message: its ``observation_field`` or, when that is not set, its fields
as JSON. Reward and done are the server's; ``max_turns`` steps truncate.
A server that cannot be started, refuses the session or fails a step is an
env failure (class `env`: retried, its group dropped when retries run out),
never a zero reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.rollout.episode import EpisodeFailure
from agentrl.run.resources import RunResources
from agentrl.types import JSON, ErrorClass, Message

from .tool_support import run_resources

_SPLIT_OFFSET = {"train": 0, "test": 1_000_000}
_LISTENING = re.compile(r"Uvicorn running on https?://[^:\s]+:(\d+)")


class OpenEnvConfig(EnvConfig):
    """Config of the `openenv` env."""

    url: str | None = Field(default=None, description="an OpenEnv server already running (http:// or ws://)")
    app: str | None = Field(
        default=None, description='an ASGI app "module:attr" (e.g. "server.app:app") the run serves with uvicorn '
        "on a free loopback port"
    )
    app_dir: str | None = Field(default=None, description="the app's directory (its cwd and on its PYTHONPATH)")
    server_env: dict[str, str] = Field(default_factory=dict, description="extra environment of the server process")
    start_timeout_s: float = Field(default=60.0, gt=0, description="seconds the server has to start listening")
    message_timeout_s: float = Field(default=60.0, gt=0, description="seconds one reset/step may take")
    action_field: str = Field(default="message", min_length=1, description="text mode: the action's field")
    action_format: Literal["text", "json"] = Field(
        default="text", description="text: the reply is the action's `action_field`; json: the reply is the action"
    )
    observation_field: str | None = Field(
        default=None, description="the observation's field shown to the model (default: all its fields as JSON)"
    )
    system_prompt: str = Field(default="", description="a system message before the first observation")
    instruction: str = Field(default="", description="text put before the first observation")
    max_turns: int = Field(default=10, ge=1, description="steps before the episode is truncated")
    max_sessions: int | None = Field(
        default=None, ge=1, description="sessions the run holds open on the server at once (set it to the server's "
        "max_concurrent_envs: episodes past it wait for a free session instead of being refused); None: no limit",
    )
    num_tasks: int = Field(default=64, ge=1, description="tasks per split; a task is a seed passed to reset")
    seed: int = Field(default=0, description="first train seed (test seeds are a disjoint range)")

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvConfig:
        if (self.url is None) == (self.app is None):
            raise ValueError("openenv: set exactly one of url (a running server) or app ('module:attr' the run "
                             f"starts); got url={self.url!r}, app={self.app!r}")
        if self.app is not None and (":" not in self.app or not self.app.rsplit(":", 1)[1].isidentifier()):
            raise ValueError(f"app={self.app!r}: write it as 'module:attr', e.g. 'server.app:app'")
        return self


class OpenEnvServer:
    """One uvicorn process serving an OpenEnv app on 127.0.0.1 (port 0: the OS picks a free one)."""

    def __init__(self, config: OpenEnvConfig) -> None:
        self.config = config
        self._lock = asyncio.Lock()
        self._proc: asyncio.subprocess.Process | None = None
        self._log: Any = None
        self.url: str | None = None

    async def start(self) -> str:
        """The server's base URL, starting it on first use."""
        async with self._lock:
            if self.url is None:
                self.url = await self._start()
            return self.url

    async def _start(self) -> str:
        cfg = self.config
        cwd = Path(cfg.app_dir).expanduser().resolve() if cfg.app_dir else Path.cwd()
        env = {**os.environ, **cfg.server_env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH", "")) if p)
        self._log = tempfile.NamedTemporaryFile(prefix="agentrl-openenv-", suffix=".log", delete=False)  # noqa: SIM115
        assert cfg.app is not None
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "uvicorn", cfg.app, "--host", "127.0.0.1", "--port", "0", "--no-access-log",
            cwd=str(cwd), env=env, stdin=asyncio.subprocess.DEVNULL, stdout=self._log, stderr=self._log,
            preexec_fn=_die_with_parent,
        )
        log = Path(self._log.name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.start_timeout_s
        while loop.time() < deadline:
            text = log.read_text(errors="replace")
            found = _LISTENING.search(text)
            if found:  # serving: the log file goes now (the server keeps its open file), so a killed run leaves none
                self._drop_log()
                return f"http://127.0.0.1:{found.group(1)}"
            if self._proc.returncode is not None:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._proc.wait()
        tail = log.read_text(errors="replace")[-2000:]
        state = "exited" if self._proc.returncode is not None else "timed out"
        await self.close()
        raise EpisodeFailure(ErrorClass.ENV, f"the OpenEnv server app={cfg.app!r} (in {cwd}) did not start "
                             f"({state} within start_timeout_s={cfg.start_timeout_s:g}); its log:\n{tail}")

    async def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its start-up log."""
        proc, self._proc, self.url = self._proc, None, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(5.0):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                async with asyncio.timeout(5.0):
                    await proc.wait()
        self._drop_log()

    def _drop_log(self) -> None:
        if self._log is not None:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
            self._log = None


def _die_with_parent() -> None:
    """In the server's child process: SIGKILL it when the run's process dies (a killed run leaves no server)."""
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def observation_text(observation: dict[str, Any], field: str | None) -> str:
    """What the model reads of an observation: one field, or all of them as JSON."""
    if field is not None:
        if field not in observation:
            raise EpisodeFailure(ErrorClass.ENV, f"observation_field={field!r}: the server's observation has no such "
                                 f"field (it has {sorted(observation)})")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(observation, ensure_ascii=False)


class OpenEnvEnv(Env[OpenEnvConfig]):
    """One OpenEnv WebSocket session per episode: the reply is the action, the observation the next message."""

    name: ClassVar[str] = "openenv"
    description: ClassVar[str] = "an OpenEnv environment server, driven over its own client protocol"

    def __init__(self, config: OpenEnvConfig | None = None, *, resources: RunResources | None = None,
                 plugins: Any = None) -> None:
        super().__init__(config)
        self.resources, self._owns_resources = run_resources(resources)
        self._client: Any = None
        self._slot: asyncio.Semaphore | None = None
        self._turns = 0

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"env openenv has no {split!r} split (allowed: {sorted(_SPLIT_OFFSET)})")
        first = self.config.seed + _SPLIT_OFFSET[split]
        return [{"id": f"{split}-{i}", "seed": first + i} for i in range(self.config.num_tasks)]

    async def base_url(self) -> str:
        if self.config.url is not None:
            return self.config.url
        where = self.config.model_dump_json(include={"app", "app_dir", "server_env"})  # one server per app
        server = self.resources.get("openenv-server:" + where, lambda: OpenEnvServer(self.config))
        return await server.start()

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        from openenv.core.generic_client import GenericEnvClient

        await self._close_client()
        self._turns = 0
        url = await self.base_url()
        if self.config.max_sessions is not None:
            slots = self.resources.get("openenv-sessions:" + url, lambda: asyncio.Semaphore(self.config.max_sessions or 1))
            await slots.acquire()  # bounded by the rollout's episode deadline
            self._slot = slots
        self._client = GenericEnvClient(base_url=url, connect_timeout_s=self.config.message_timeout_s,
                                        message_timeout_s=self.config.message_timeout_s)
        task_seed = task.get("seed")
        result = await self._call(self._client.reset(**({"seed": task_seed} if task_seed is not None else {})),
                                  "reset")
        text = observation_text(result.observation, self.config.observation_field)
        messages = [Message(role="system", content=self.config.system_prompt)] if self.config.system_prompt else []
        messages.append(Message(role="user", content=f"{self.config.instruction}\n\n{text}".strip()))
        return messages, {"server": url}

    async def step(self, action: Message) -> StepResult:
        if self._client is None:
            raise RuntimeError("step() called before reset()")
        self._turns += 1
        out_of_turns = self._turns >= self.config.max_turns
        payload = self.action_of(action.content or "")
        if isinstance(payload, str):  # not an action: say why, the server is not stepped
            return StepResult(messages=[Message(role="user", content=payload)], truncated=out_of_turns,
                              truncation_reason="max_turns" if out_of_turns else None, info={"invalid_action": True})
        result = await self._call(self._client.step(payload), "step")
        done = bool(result.done)
        info: dict[str, JSON] = {"server_reward": result.reward}
        return StepResult(
            messages=[] if done else [Message(role="user", content=observation_text(
                result.observation, self.config.observation_field))],
            reward=float(result.reward or 0.0), terminated=done, truncated=out_of_turns and not done,
            truncation_reason="max_turns" if out_of_turns and not done else None, info=info,
        )

    def action_of(self, reply: str) -> dict[str, Any] | str:
        """The OpenEnv action of a reply, or (a str) the message telling the model why it is none."""
        if self.config.action_format == "text":
            return {self.config.action_field: reply}
        text = reply.strip()
        fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
        if fenced:
            text = fenced.group(1).strip()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return f"Your reply is not a JSON action ({e}). Reply with one JSON object."
        if not isinstance(value, dict):
            return f"Your reply is JSON {type(value).__name__}, not an object. Reply with one JSON object."
        return value

    async def _call(self, aw: Any, what: str) -> Any:
        """Await a client call under the message deadline; failures are the env's (infrastructure), not rewards."""
        try:
            async with asyncio.timeout(self.config.message_timeout_s + 5):
                return await aw
        except EpisodeFailure:
            raise
        except TimeoutError as e:
            raise EpisodeFailure(ErrorClass.TIMEOUT, f"the OpenEnv server's {what} took over "
                                 f"message_timeout_s={self.config.message_timeout_s:g}") from e
        except Exception as e:
            # a server at capacity either says so (CAPACITY_REACHED) or just closes the socket: which one is a race
            at_capacity = "ConnectionClosed" in type(e).__name__ or "CAPACITY_REACHED" in str(e)
            hint = (" (a server at its max_concurrent_envs refuses new sessions: set env.max_sessions to it)"
                    if what == "reset" and at_capacity else "")
            raise EpisodeFailure(ErrorClass.ENV, f"the OpenEnv server's {what} failed: {type(e).__name__}: {e}"
                                 f"{hint}") from e

    async def close(self) -> None:
        await self._close_client()
        if self._owns_resources:
            await self.resources.aclose()

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        slot, self._slot = self._slot, None
        try:
            if client is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(10):
                        await client.close()
        finally:
            if slot is not None:
                slot.release()

"""`agent`: train agent code written against the OpenAI API, unmodified but for its base URL.

    env: {name: agent, agent: "my_pkg.my_agent:solve", tasks: tasks.jsonl}
    env: {name: agent, mode: remote, tasks: tasks.jsonl, gateway: {port: 8400}}

In-process mode: for every episode the rollout manager calls the user's
``async def solve(task, client)`` (an `openai.AsyncOpenAI` bound to a fresh
gateway session) or ``async def solve(task, base_url, api_key)``. With
``workspace: {sandbox: {name: local}, spec: {...}}`` each episode also gets
its own persistent sandbox workspace (agentrl.sandboxes.workspace), handed to
a solve that takes a ``workspace`` argument: an agent written for a shell
(mini-swe-agent style) runs its commands with ``await workspace.exec(cmd)``
and its files with ``workspace.read_file``/``write_file``, unmodified but for
where its commands run. The workspace is closed when solve returns.

Remote mode: the run serves one gateway (`agentrl.gateway.episodes`) and each
episode waits there for an agent in another process or container to claim it
(``POST /episodes``: the task, a session base URL and key), make its calls,
post its reward and close it. No claim within `claim_timeout_s` fails the
episode with class `agent`; no close within `rollout.episode_timeout_s` after
the claim fails it with class `timeout`.

Either way the model calls go through the gateway (`agentrl.gateway`), which
keeps them token-exact: one trajectory per branch of the conversation, the
main one first. Groups, slots, staleness, deadlines, failure classes and
cancellation apply as for any env.

The reward, first found wins: what `solve` returns (a number, a
`{name: number}` breakdown summed, or a `RewardResult`); else the last
``POST /s/{session}/reward`` without a turn; else the `rewards` plugins
scoring the final messages (of the branch that answered last); else 0.0 when
a budget (`rollout.max_turns`, `max_total_tokens`) cut the agent off (its
call got a 400 `context_length_exceeded`; the episode counts as truncated,
not failed). Per-turn rewards (``POST`` with ``turn``) land on the turns.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from agentrl.chat.conversation import Budgets, ChatTokenizer
from agentrl.chat.tool_parsers import get_parser
from agentrl.engines.base import InferenceEngine
from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envkit.rewards import ClosableReward, RewardResult
from agentrl.gateway import Backend, Gateway, GatewayConfig, Session, TrainerSampling
from agentrl.gateway.episodes import RemoteAgents
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import classify
from agentrl.run.resources import RunResources
from agentrl.sandboxes.workspace import Workspace, WorkspaceSpec
from agentrl.types import JSON, EpisodeError, ErrorClass, Message, Trajectory

from .code_env import SandboxSpec, shared_sandbox
from .reward_specs import NamedReward, RewardSpec, build_rewards, score_all

Solve = Callable[..., Awaitable[Any]]


class TasksFromEnv(EnvConfig):
    """Take the tasks of another env (e.g. `calculator`): its splits, its task dicts."""

    env: str = Field(..., min_length=1, description="a registered env whose tasks(split) to use")
    params: dict[str, JSON] = Field(default_factory=dict, description="that env's config")


class AgentWorkspace(EnvConfig):
    """The workspace each in-process episode's solve gets (its `workspace` argument)."""

    sandbox: SandboxSpec = Field(default_factory=lambda: SandboxSpec(name="local"),
                                 description="the sandbox holding the workspaces: local, docker or e2b")
    spec: WorkspaceSpec = Field(default_factory=WorkspaceSpec,
                                description="files, set-up, work dir and limits of every episode's workspace")


class AgentEnvConfig(EnvConfig):
    """Config of the `agent` env."""

    mode: Literal["in_process", "remote"] = Field(
        default="in_process",
        description="in_process: the run calls `agent` per episode; remote: agents in other processes or "
        "containers claim the episodes from the run's gateway (POST /episodes)",
    )
    agent: str | None = Field(
        default=None, description='the agent (in_process mode): "pkg.module:solve" or "path/to/file.py:solve"'
    )
    claim_timeout_s: float = Field(
        default=300.0, gt=0, description="remote mode: seconds an episode waits for an agent to claim it (then "
        "it fails with class `agent`); rollout.episode_timeout_s counts from the claim",
    )
    claim_give_up_after: int = Field(
        default=3, ge=0, description="remote mode: the run stops with an error when no agent claimed any episode "
        "for this many claim_timeout_s windows in a row (no agent connected); 0 = wait forever",
    )
    tasks: list[dict[str, JSON]] | str | TasksFromEnv = Field(
        ..., description="tasks: a list of dicts, a .jsonl/.json file, or {env, params} to borrow an env's splits"
    )
    test_tasks: list[dict[str, JSON]] | str | None = Field(
        None, description="the test split when `tasks` is a list or file (default: none)"
    )
    rewards: list[RewardSpec] = Field(
        default_factory=list, description="reward plugins scoring the final messages when solve returns None"
    )
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="the gateway each episode's agent calls")
    client_timeout_s: float = Field(default=600.0, gt=0, description="the openai client's per-request timeout")
    workspace: AgentWorkspace | None = Field(
        default=None, description="in_process mode: a persistent sandbox workspace per episode, passed to a solve "
        "that takes a `workspace` argument",
    )

    @field_validator("agent")
    @classmethod
    def _agent_form(cls, value: str | None) -> str | None:
        if value is not None and (":" not in value or not value.rsplit(":", 1)[1].isidentifier()):
            raise ValueError(f"agent={value!r}: write it as 'pkg.module:function' or 'path/file.py:function'")
        return value

    @model_validator(mode="after")
    def _agent_per_mode(self) -> AgentEnvConfig:
        if self.mode == "in_process" and self.agent is None:
            raise ValueError("agent: required in mode in_process ('pkg.module:solve' or 'path/file.py:solve'); "
                             "set mode: remote for agents that claim episodes over HTTP")
        if self.mode == "remote" and self.agent is not None:
            raise ValueError(f"agent={self.agent!r}: remote mode runs no agent code in the run; drop it, "
                             "or use mode: in_process")
        if self.mode == "remote" and self.workspace is not None:
            raise ValueError("workspace: only in mode in_process (the run hands it to solve); a remote agent "
                             "runs where its own process runs")
        return self


def load_agent(spec: str) -> Solve:
    """The `solve` coroutine function named by ``module:attr`` (a dotted module or a .py path)."""
    where, attr = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where).resolve()
        name = f"agentrl_user_agent_{abs(hash(str(path)))}"
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.util.spec_from_file_location(name, path)
            if loader is None or loader.loader is None or not path.exists():
                raise ValueError(f"env.agent: no Python file at {path}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, attr, None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ValueError(f"env.agent: {spec!r} must name an `async def solve(task, client)` function")
    return fn  # type: ignore[no-any-return]


def _read_tasks(source: list[dict[str, JSON]] | str) -> list[Task]:
    if isinstance(source, list):
        tasks = [dict(t) for t in source]
    else:
        text = Path(source).read_text()
        tasks = [json.loads(line) for line in text.splitlines() if line.strip()] if source.endswith(".jsonl") else json.loads(text)
    for i, task in enumerate(tasks):
        task.setdefault("id", str(i))
    return tasks


def reward_of(value: Any) -> RewardResult | None:
    """What solve returned, as a reward (None when it returned none)."""
    if value is None or isinstance(value, RewardResult):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | Mapping):
        raise TypeError(f"solve returned {type(value).__name__}; return a number, a {{name: number}} dict or None")
    if isinstance(value, Mapping):
        parts = {str(k): float(v) for k, v in value.items()}
        return RewardResult(value=sum(parts.values()), breakdown=parts)
    return RewardResult(value=float(value))


class AgentEnv(Env[AgentEnvConfig]):
    """Runs the user's agent per episode against a gateway session (an `EpisodeDriver`)."""

    name: ClassVar[str] = "agent"
    description: ClassVar[str] = "unmodified OpenAI-API agent code, trained through the gateway"

    def __init__(
        self, config: AgentEnvConfig | None = None, *, plugins: Any = None, resources: RunResources | None = None
    ) -> None:
        super().__init__(config)
        self.plugins = plugins
        self._owned = resources is None  # built outside a run: its remote gateway is its own, closed with it
        self.resources = resources if resources is not None else RunResources()
        self._solve: Solve | None = None
        self._rewards: list[NamedReward] | None = None

    async def close(self) -> None:
        """Close the reward plugins this env built (verifier worker pools), and its own resources if it owns them.

        The remote gateway of a run outlives its envs (one per episode): the run's resources close it.
        """
        rewards, self._rewards = self._rewards or [], None
        try:
            for _, _, reward in rewards:
                if isinstance(reward, ClosableReward):
                    await reward.close()
        finally:
            if self._owned:
                await self.resources.aclose()

    def remote_agents(self) -> RemoteAgents:
        """The run's gateway for remote agents (one per gateway config, shared by the run's envs)."""
        key = "agent-gateway:" + self.config.gateway.model_dump_json()
        return self.resources.get(key, lambda: RemoteAgents(self.config.gateway))

    def tasks(self, split: str = "train") -> Iterable[Task]:
        source = self.config.tasks
        if isinstance(source, TasksFromEnv):
            from agentrl.registry import Plugins

            plugins = self.plugins or Plugins.discover()
            return plugins.create_env(source.env, source.params).tasks(split)
        if split == "train":
            return _read_tasks(source)
        if split == "test" and self.config.test_tasks is not None:
            return _read_tasks(self.config.test_tasks)
        raise ValueError(f"env agent has no {split!r} split (set test_tasks, or take tasks from an env)")

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        raise NotImplementedError("the agent env drives its own episodes (drive_episode); it is not stepped")

    async def step(self, action: Message) -> StepResult:
        raise NotImplementedError("the agent env drives its own episodes (drive_episode); it is not stepped")

    def backend(self, engine: InferenceEngine, tokenizer: ChatTokenizer, config: RolloutConfig) -> Backend:
        """The gateway backend for a run's engine, template and rollout settings."""
        s = config.sampling
        return Backend(
            engine=engine, tokenizer=tokenizer, parser=get_parser(self.config.gateway.tool_parser, self.plugins),
            sampling=TrainerSampling(s.temperature, s.top_p, s.top_k), budgets=Budgets.from_rollout_config(config),
            stop_strings=tuple(s.stop_strings), generate_timeout_s=config.generate_timeout_s,
            tools_in_prompt=self.config.gateway.tools_in_prompt,
        )

    async def drive_episode(
        self, task: Task, engine: Any, tokenizer: Any, config: Any, *, seed: int | None, group_id: str, sample_index: int
    ) -> list[Trajectory]:
        """Serve one session, let the agent (in process, or a remote one) run in it, and turn its calls into
        trajectories."""
        backend = self.backend(engine, tokenizer, config)
        if self.config.mode == "remote":
            session, error, value = await self._drive_remote(task, backend, config.episode_timeout_s)
        else:
            session, error, value = await self._drive_in_process(task, backend, config.episode_timeout_s)
        result: RewardResult | None = None
        if error is None:
            try:
                result = await self._reward(task, session, value)
            except Exception as e:
                error = EpisodeError(classify(e, ErrorClass.REWARD), f"reward failed: {type(e).__name__}: {e}")
        reward = result.value if result is not None and error is None else 0.0
        trajs = session.trajectories(task=dict(task), env=self.name, group_id=group_id, sample_index=sample_index,
                                     reward=reward, breakdown=result.breakdown if result is not None else None)
        if not trajs:  # nothing to train on: an env failure (retried or dropped), never a kept empty sample
            trajs = [Trajectory(task_id=str(task.get("id", "")), env=self.name, messages=[], token_ids=[], loss_mask=[],
                                logprobs=[], versions=[], group_id=group_id, sample_index=sample_index, task=dict(task))]
            why = f" ({error.kind.value}: {error.message})" if error is not None else ""
            kind = ErrorClass.AGENT if error is not None and error.kind is ErrorClass.AGENT else ErrorClass.ENV
            error = EpisodeError(kind, f"the agent made no model call{why}")
        for traj in trajs:
            traj.seed = seed
            if error is not None:
                traj.error = EpisodeError(error.kind, error.message, turn=len(traj.turns))
                traj.terminated = False
        return trajs

    async def _drive_in_process(
        self, task: Task, backend: Backend, timeout_s: float
    ) -> tuple[Session, EpisodeError | None, Any]:
        """Run `solve` against a gateway of its own: (the session, the episode's error, what solve returned)."""
        assert self.config.agent is not None  # the config's validator: in_process mode names an agent
        if self._solve is None:
            self._solve = load_agent(self.config.agent)
            if self.config.workspace is not None and "workspace" not in inspect.signature(self._solve).parameters:
                raise ValueError(f"env.workspace is set but {self.config.agent!r} takes no `workspace` argument; "
                                 "add one (async def solve(task, client, workspace)) or drop env.workspace")
        async with Gateway(self.config.gateway, backend) as gateway:
            session = gateway.open_session()
            error: EpisodeError | None = None
            value: Any = None
            try:
                async with asyncio.timeout(timeout_s):
                    value = await self._call_solve(task, gateway, session)
            except TimeoutError:
                error = EpisodeError(ErrorClass.TIMEOUT, f"episode exceeded episode_timeout_s={timeout_s}")
            except Exception as e:
                if session.truncation_reason is None:  # a spent budget ends the episode truncated, not failed
                    error = EpisodeError(_agent_error_class(e), f"the agent failed: {type(e).__name__}: {e}")
            finally:
                gateway.close_session(session)
        return session, error, value

    async def _drive_remote(
        self, task: Task, backend: Backend, timeout_s: float
    ) -> tuple[Session, EpisodeError | None, Any]:
        """Offer the episode on the run's gateway; wait for a remote agent to claim it, then to close it."""
        hub = self.remote_agents()
        gateway = await hub.start(backend)
        session = gateway.open_session(backend=backend)
        session.task = dict(task)
        offer = hub.board.offer(session, dict(task))
        error: EpisodeError | None = None
        try:
            try:
                async with asyncio.timeout(self.config.claim_timeout_s):
                    await offer.claimed.wait()
            except TimeoutError:
                hub.note_unclaimed()
                stop = hub.give_up(self.config.claim_timeout_s, self.config.claim_give_up_after)
                if stop is not None:
                    raise stop from None
                error = EpisodeError(ErrorClass.AGENT, f"no remote agent claimed the episode within "
                                     f"env.claim_timeout_s={self.config.claim_timeout_s:g}s (agents claim episodes "
                                     f"with POST {gateway.url}/episodes; {hub.board.waiting} unclaimed now)")
                return session, error, None
            try:
                async with asyncio.timeout(timeout_s):
                    await offer.ended.wait()
            except TimeoutError:
                error = EpisodeError(ErrorClass.TIMEOUT, f"the remote agent did not close the episode within "
                                     f"rollout.episode_timeout_s={timeout_s:g}s of claiming it")
            if error is None and session.agent_error and session.truncation_reason is None:
                error = EpisodeError(ErrorClass.ENV, f"the remote agent gave up: {session.agent_error}")
        finally:
            hub.board.withdraw(offer)
            if not session.closed:  # cancelled or timed out: the agent's next call gets a 409
                gateway.close_session(session)
        return session, error, None

    async def _call_solve(self, task: Task, gateway: Gateway, session: Session) -> Any:
        assert self._solve is not None
        if self.config.workspace is None:
            return await self._call_solve_with(task, gateway, session, {})
        sandbox = shared_sandbox(self.config.workspace.sandbox, self.plugins, self.resources)
        async with sandbox.workspace(self.config.workspace.spec) as ws:
            return await self._call_solve_with(task, gateway, session, {"workspace": ws})

    async def _call_solve_with(self, task: Task, gateway: Gateway, session: Session,
                               extra: dict[str, Workspace]) -> Any:
        assert self._solve is not None
        params = list(inspect.signature(self._solve).parameters)
        if len(params) >= 2 and params[1] == "base_url":
            kwargs = {"api_key": session.key} if "api_key" in params else {}
            return await self._solve(dict(task), gateway.base_url(session), **kwargs, **extra)
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=gateway.base_url(session), api_key=session.key,
                             timeout=self.config.client_timeout_s, max_retries=0)
        try:
            return await self._solve(dict(task), client, **extra)
        finally:
            await client.close()

    async def _reward(self, task: Task, session: Session, value: Any) -> RewardResult | None:
        result = reward_of(value)
        if result is None and session.reward is not None:
            result = RewardResult(value=session.reward, breakdown=dict(session.breakdown))
        if result is None and self.config.rewards:
            if self._rewards is None:
                self._rewards = build_rewards(self.config.rewards, plugins=self.plugins, prefix="env.rewards")
            result = await score_all(self._rewards, task, session.final_messages())
        if result is None and session.truncation_reason is not None:  # cut off by a budget before it could answer
            result = RewardResult(value=0.0)
        if result is None:
            raise ValueError("no reward: solve returned None, nothing was POSTed to /reward and env.rewards is empty")
        return result


def _agent_error_class(e: BaseException) -> ErrorClass:
    """An agent's exception: the engine's failures (the gateway's 5xx) are engine errors, the rest the env's."""
    status = getattr(e, "status_code", None)
    if isinstance(status, int) and status >= 500:
        return ErrorClass.TIMEOUT if status == 504 else ErrorClass.ENGINE
    return classify(e, ErrorClass.ENV)

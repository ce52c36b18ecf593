"""run_episode and RolloutManager with scripted engines and a small tool env."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.env import StepResult, Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envkit.tool_env import ToolEnv
from agentrl.rollout.config import FailurePolicy, RolloutConfig
from agentrl.rollout.manager import EpisodeFailure, RolloutManager, RolloutStalled, run_episode
from agentrl.types import ErrorClass, Group, Message


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def boom() -> str:
    """Always fails."""
    raise ValueError("kaboom")


class CalcEnv(ToolEnv):
    """Tasks ask for a sum; `task["fail"]` injects a failure of one class at one point."""

    name: ClassVar[str] = "calc"
    open_envs: ClassVar[int] = 0
    attempts: ClassVar[dict[str, int]] = {}

    def __init__(self) -> None:
        super().__init__(tools=[add, boom])
        CalcEnv.open_envs += 1
        self.closed = False
        self.seed: int | None = None

    def tasks(self, split: str = "train") -> Iterable[Task]:
        return [{"id": f"t{i}", "prompt": f"{i} + 1", "answer": i + 1} for i in range(4)]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self.seed = seed
        key = f"{task['id']}"
        CalcEnv.attempts[key] = CalcEnv.attempts.get(key, 0) + 1
        fail = task.get("fail")
        if fail == "env" and self._should_fail(task):
            raise RuntimeError("env crashed on reset")
        return await super().reset(task, seed=seed)

    def _should_fail(self, task: Task) -> bool:
        """Fail always, or only on the first `fail_times` attempts of the task."""
        times = task.get("fail_times")
        return times is None or CalcEnv.attempts[str(task["id"])] <= times

    def parse_action(self, text: str) -> Message:
        if "GARBLED" in text:
            raise ValueError("cannot read this reply")
        return super().parse_action(text)

    async def step(self, action: Message) -> StepResult:
        fail = self._task.get("fail") if self._task else None
        if fail in ("tool", "sandbox") and self._should_fail(self._task or {}):
            raise EpisodeFailure(fail, f"{fail} backend unavailable")
        if fail == "timeout" and self._should_fail(self._task or {}):
            await asyncio.sleep(3600)
        return await super().step(action)

    async def score(self, task: Task, messages: Sequence[Message]) -> float | RewardResult:
        if task.get("fail") == "reward" and self._should_fail(task):
            raise EpisodeFailure(ErrorClass.REWARD, "verifier crashed")
        if task.get("fail") in ("nan", "inf", "-inf"):  # a verifier that returns garbage instead of raising
            return float(task["fail"])
        if task.get("coin"):
            return float((self.seed or 0) % 2)
        answer = re.findall(r"-?\d+", messages[-1].content)
        ok = bool(answer) and int(answer[-1]) == task["answer"]
        return RewardResult(1.0 if ok else 0.0, breakdown={"correct": 1.0 if ok else 0.0})

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            CalcEnv.open_envs -= 1


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def calc_policy(prompt: str) -> str:
    """Call `add` once, then answer with the tool's result; special prompts misbehave."""
    if "GARBLE" in prompt:
        return "GARBLED"
    if "BOOM" in prompt and "kaboom" not in prompt:
        return call("boom")
    if "LOOP" in prompt:
        return call("add", a=1, b=1)
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", prompt, re.DOTALL)
    if results:
        return f"The answer is {results[-1].strip()}."
    a = int(re.findall(r"(\d+) \+ 1", prompt)[-1])
    return call("add", a=a, b=1)


@pytest.fixture(autouse=True)
def _reset_counters() -> Any:
    CalcEnv.attempts = {}
    CalcEnv.open_envs = 0
    yield
    assert CalcEnv.open_envs == 0, "an env was not closed"


@pytest.fixture
def tok() -> SimpleChatTokenizer:
    return SimpleChatTokenizer()


def engine(tok: SimpleChatTokenizer, **cfg: Any) -> ScriptedEngine:
    return ScriptedEngine(ScriptedEngine.Config(**cfg), tokenizer=tok, reply_fn=calc_policy)


def config(**kw: Any) -> RolloutConfig:
    base: dict[str, Any] = dict(group_size=2, groups_per_step=2, max_in_flight=8, max_staleness=1, queue_groups=4,
                                env_timeout_s=5.0, generate_timeout_s=5.0, episode_timeout_s=20.0)
    base.update(kw)
    return RolloutConfig(**base)


def tasks(n: int, **extra: Any) -> list[Task]:
    return [{"id": f"t{i}", "prompt": f"{i} + 1", "answer": i + 1, **extra} for i in range(n)]


async def run_single(env: CalcEnv, task: Task, tok: SimpleChatTokenizer, cfg: RolloutConfig, **eng: Any) -> Any:
    try:
        return await run_episode(env, task, engine(tok, **eng), tok, cfg, seed=3, group_id="g", sample_index=1)
    finally:
        await env.close()


# -- run_episode ----------------------------------------------------------------------------


async def test_multi_turn_episode_is_token_exact(tok: SimpleChatTokenizer) -> None:
    traj = await run_single(CalcEnv(), tasks(1)[0], tok, config())
    assert traj.error is None and traj.terminated and not traj.truncated
    assert traj.reward == 1.0 and traj.reward_breakdown == {"correct": 1.0}
    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2].content == "1"
    assert [t.tool_calls for t in traj.turns] == [["add"], []]
    assert [t.reward for t in traj.turns] == [0.0, 1.0]
    for turn in traj.turns:  # sampled spans are mask 1, carry the engine's logprob and version
        assert set(traj.loss_mask[turn.start : turn.end]) == {1}
        assert set(traj.logprobs[turn.start : turn.end]) == {-1.0}
        assert set(traj.versions[turn.start : turn.end]) == {0}
    assert sum(traj.loss_mask) == sum(t.end - t.start for t in traj.turns)
    assert traj.metrics["retokenization_drift"] == 0.0
    assert traj.metrics["turns"] == 2.0
    assert traj.group_id == "g" and traj.sample_index == 1 and traj.seed == 3 and traj.task_id == "t0"


async def test_tool_errors_become_messages_not_failures(tok: SimpleChatTokenizer) -> None:
    traj = await run_single(CalcEnv(), {"id": "b", "prompt": "BOOM 4 + 1", "answer": 5}, tok, config())
    assert traj.error is None and traj.terminated
    assert "kaboom" in traj.messages[2].content and traj.messages[2].content.startswith("Error")
    assert traj.turns[0].info["tool_errors"] == 1


async def test_max_turns_budget_truncates(tok: SimpleChatTokenizer) -> None:
    traj = await run_single(CalcEnv(), {"id": "l", "prompt": "LOOP", "answer": 0}, tok, config(max_turns=3))
    assert traj.error is None and traj.truncated and not traj.terminated
    assert traj.truncation_reason == "max_turns" and len(traj.turns) == 3


async def test_total_token_budget_truncates(tok: SimpleChatTokenizer) -> None:
    loop = {"id": "l", "prompt": "LOOP", "answer": 0}
    prompt_len = (await run_single(CalcEnv(), loop, tok, config(max_turns=1))).turns[0].start
    cfg = config(max_total_tokens=prompt_len + 150, max_turns=50)
    traj = await run_single(CalcEnv(), loop, tok, cfg)
    assert traj.error is None and traj.truncated and traj.truncation_reason == "max_total_tokens"
    assert len(traj.turns) >= 1 and len(traj.token_ids) <= prompt_len + 150


async def test_per_turn_token_budget_cuts_the_reply(tok: SimpleChatTokenizer) -> None:
    traj = await run_single(CalcEnv(), tasks(1)[0], tok, config(max_new_tokens_per_turn=10, max_turns=1))
    assert traj.turns[0].end - traj.turns[0].start == 10
    assert traj.turns[0].info["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("task_extra", "kind"),
    [
        ({"fail": "env"}, ErrorClass.ENV),
        ({"fail": "tool"}, ErrorClass.TOOL),
        ({"fail": "sandbox"}, ErrorClass.SANDBOX),
        ({"fail": "timeout"}, ErrorClass.TIMEOUT),
        ({"fail": "reward"}, ErrorClass.REWARD),
        ({"fail": "nan"}, ErrorClass.REWARD),  # a NaN reward would poison its group's advantages
        ({"fail": "-inf"}, ErrorClass.REWARD),
        ({"prompt": "GARBLE"}, ErrorClass.FORMAT),
    ],
)
async def test_failures_are_classified_on_the_trajectory(
    tok: SimpleChatTokenizer, task_extra: dict[str, Any], kind: ErrorClass
) -> None:
    task = {**tasks(1)[0], **task_extra}
    traj = await run_single(CalcEnv(), task, tok, config(env_timeout_s=1.0 if kind is ErrorClass.TIMEOUT else 5.0))
    assert traj.error is not None and traj.error.kind is kind, traj.error
    assert traj.reward == 0.0
    if task.get("fail") in ("nan", "-inf"):
        assert f"non-finite reward {float(task['fail'])!r}" in traj.error.message
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.versions)


async def test_engine_failures_and_episode_deadline(tok: SimpleChatTokenizer) -> None:
    traj = await run_single(CalcEnv(), tasks(1)[0], tok, config(), error_rate=1.0)
    assert traj.error is not None and traj.error.kind is ErrorClass.ENGINE and "scripted engine failure" in traj.error.message
    slow = await run_single(CalcEnv(), tasks(1)[0], tok, config(generate_timeout_s=0.02), per_token_s=0.01)
    assert slow.error is not None and slow.error.kind is ErrorClass.TIMEOUT and "engine.generate" in slow.error.message
    whole = await run_single(CalcEnv(), tasks(1)[0], tok, config(episode_timeout_s=0.05), per_token_s=0.002)
    assert whole.error is not None and whole.error.kind is ErrorClass.TIMEOUT and "episode_timeout_s" in whole.error.message


# -- RolloutManager -------------------------------------------------------------------------


async def collect(manager: RolloutManager, n: int | None = None) -> list[Group]:
    out: list[Group] = []
    async with asyncio.timeout(30):
        async for group in manager.groups():
            out.append(group)
            if n is not None and len(out) == n:
                break
    return out


async def test_manager_emits_groups_with_metrics(tok: SimpleChatTokenizer) -> None:
    eng = engine(tok)
    async with RolloutManager(CalcEnv, tasks(6), eng, tok, config(max_staleness=10)) as manager:
        groups = await collect(manager)
        metrics = manager.metrics()
        state = manager.state()
    assert sorted(g.task_id for g in groups) == [f"t{i}" for i in range(6)]
    for g in groups:
        assert len(g.trajectories) == 2 and g.rewards == [1.0, 1.0]
        assert {t.group_id for t in g.trajectories} == {g.id}
        assert [t.sample_index for t in g.trajectories] == [0, 1]
        assert g.trajectories[0].seed != g.trajectories[1].seed
    assert metrics["rollout/episodes"] == 12 and metrics["rollout/groups"] == 6
    assert metrics["rollout/tool_calls/add"] == 12 and metrics["rollout/turns_mean"] == 2.0
    assert metrics["rollout/staleness/0"] == 6 and metrics["rollout/episodes_per_s"] > 0
    assert metrics["rollout/tokens_per_s"] > 0 and 0.0 <= metrics["rollout/engine_busy"] <= 1.0
    assert state["done"] == list(range(6)) and state["in_flight"] == [] and state["issued"] == 6


@pytest.mark.parametrize("kind", ["env", "tool", "sandbox", "timeout", "reward", "format", "engine"])
@pytest.mark.parametrize("policy", list(FailurePolicy))
async def test_failure_policy_per_class(tok: SimpleChatTokenizer, kind: str, policy: FailurePolicy) -> None:
    """The bad episode's class decides: zero reward keeps the group, drop/exhausted retries drop it."""
    bad: dict[str, Any] = {"prompt": "GARBLE"} if kind == "format" else {"fail": kind}
    work = [*tasks(2), {**tasks(3)[2], **bad}]
    cfg = config(on_error={ErrorClass(kind): policy}, max_retries=1, env_timeout_s=1.0 if kind == "timeout" else 5.0)
    eng = engine(tok)
    if kind == "engine":
        def policy_fn(prompt: str) -> str:
            if "2 + 1" in prompt:
                raise RuntimeError("engine fell over")
            return calc_policy(prompt)
        eng.reply_fn = policy_fn
    async with RolloutManager(CalcEnv, work, eng, tok, cfg) as manager:
        groups = await collect(manager)
        dropped = manager.drain_dropped()
        metrics = manager.metrics()
        state = manager.state()
    kept = {g.task_id: g for g in groups}
    assert {"t0", "t1"} <= set(kept), "good groups must not suffer from a bad one"
    assert metrics[f"rollout/errors/{kind}"] >= (1 if policy is FailurePolicy.DROP_GROUP else 2)
    assert state["done"] == [0, 1, 2] and state["in_flight"] == []
    if policy is FailurePolicy.ZERO_REWARD:
        bad_group = kept["t2"]
        assert all(t.error is not None and t.error.kind.value == kind and t.reward == 0.0 for t in bad_group.trajectories)
        assert dropped == []
    else:
        assert "t2" not in kept
        assert [(g.task_id, why) for g, why in dropped] == [("t2", f"error:{kind}")]
        if policy is FailurePolicy.RETRY:
            assert metrics["rollout/retries"] >= 1


async def test_retry_recovers_a_transient_failure(tok: SimpleChatTokenizer) -> None:
    work = [{**tasks(1)[0], "fail": "sandbox", "fail_times": 1}]
    cfg = config(group_size=1, on_error={ErrorClass.SANDBOX: FailurePolicy.RETRY}, max_retries=2)
    async with RolloutManager(CalcEnv, work, engine(tok), tok, cfg) as manager:
        groups = await collect(manager)
        metrics = manager.metrics()
    assert len(groups) == 1 and groups[0].trajectories[0].error is None and groups[0].rewards == [1.0]
    assert metrics["rollout/retries"] == 1 and metrics["rollout/errors/sandbox"] == 1


async def test_env_factory_failure_is_an_env_error(tok: SimpleChatTokenizer) -> None:
    def factory() -> CalcEnv:
        raise OSError("no sandbox slots")

    cfg = config(group_size=1, on_error={ErrorClass.ENV: FailurePolicy.DROP_GROUP})
    async with RolloutManager(factory, tasks(2), engine(tok), tok, cfg) as manager:
        groups = await collect(manager)
        dropped = manager.drain_dropped()
    assert groups == [] and [why for _, why in dropped] == ["error:env", "error:env"]
    assert "no sandbox slots" in (dropped[0][0].trajectories[0].error.message)  # type: ignore[union-attr]


async def test_dynamic_sampling_drops_uniform_groups(tok: SimpleChatTokenizer) -> None:
    work = [*tasks(3), *({**t, "id": f"c{i}", "coin": True} for i, t in enumerate(tasks(3)))]
    cfg = config(group_size=4, dynamic_sampling=True, max_staleness=10)
    async with RolloutManager(CalcEnv, work, engine(tok), tok, cfg) as manager:
        groups = await collect(manager)
        dropped = manager.drain_dropped()
    assert all(len(set(g.rewards)) > 1 for g in groups)
    assert {g.task_id for g, why in dropped if why == "dynamic_sampling"} >= {"t0", "t1", "t2"}
    assert len(groups) + len(dropped) == 6


async def test_staleness_zero_is_synchronous(tok: SimpleChatTokenizer) -> None:
    eng = engine(tok)
    cfg = config(group_size=2, groups_per_step=2, max_staleness=0)
    async with RolloutManager(CalcEnv, tasks(8), eng, tok, cfg) as manager:
        stream = manager.groups()
        for step in range(3):
            batch = [await asyncio.wait_for(anext(stream), 10) for _ in range(2)]
            assert all(g.oldest_version == step for g in batch)
            await asyncio.sleep(0.05)  # give the producer every chance to start more
            assert manager.state()["issued"] == 2 * (step + 1), "an episode started beyond the step's batch"
            eng.set_version(step + 1)  # the weights reach the engine: the staleness gate moves by itself
        assert manager.metrics()["rollout/staleness/0"] == 6
        await stream.aclose()


async def test_the_staleness_gate_reads_any_version_source(tok: SimpleChatTokenizer) -> None:
    """`trainer_version=` replaces the engine's version: the gate opens when the source moves, nobody calls in."""
    version = [0]
    cfg = config(group_size=1, groups_per_step=1, max_staleness=0)
    async with RolloutManager(CalcEnv, tasks(4), engine(tok), tok, cfg, trainer_version=lambda: version[0]) as manager:
        stream = manager.groups()
        await asyncio.wait_for(anext(stream), 10)
        await asyncio.sleep(0.05)
        assert manager.state()["issued"] == 1  # gate closed at version 0
        version[0] = 1  # e.g. a trainer's policy_version after its step
        async with asyncio.timeout(10):
            while manager.state()["issued"] < 2:
                await asyncio.sleep(0.01)
        assert manager.trainer_version == 1 and manager.state()["trainer_version"] == 1
        await stream.aclose()


async def test_a_consumer_that_never_moves_the_version_gets_a_stall_that_says_why(tok: SimpleChatTokenizer) -> None:
    """A version that never moves must not be a silent hang: the stall error names the closed gate."""
    cfg = config(group_size=1, groups_per_step=1, max_staleness=0)
    async with RolloutManager(CalcEnv, tasks(5), engine(tok), tok, cfg, stall_timeout_s=0.3) as manager:
        stream = manager.groups()
        first = await asyncio.wait_for(anext(stream), 10)
        assert first.task_id == "t0"
        with pytest.raises(RolloutStalled) as stalled:
            await asyncio.wait_for(anext(stream), 10)
    message = str(stalled.value)
    assert message.startswith("rollouts made no progress for 0.3s; staleness gate closed: 1 groups handed over")
    assert "max_staleness=0 and groups_per_step=1 allow 1" in message and "weights reach the engine" in message
    assert isinstance(stalled.value, TimeoutError)  # what callers caught before still catches it


async def test_staleness_budget_allows_k_steps_ahead(tok: SimpleChatTokenizer) -> None:
    eng = engine(tok)
    cfg = config(group_size=1, groups_per_step=2, max_staleness=2, queue_groups=100, max_in_flight=100)
    async with RolloutManager(CalcEnv, tasks(20), eng, tok, cfg) as manager:
        async with asyncio.timeout(10):
            while manager.state()["issued"] < 6 or manager._episodes:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert manager.state()["issued"] == 6  # (0 + 2 + 1) steps x 2 groups, and not one more
        eng.set_version(1)  # a step's weights reached the engine
        async with asyncio.timeout(10):
            while manager.state()["issued"] < 8:
                await asyncio.sleep(0.01)


async def test_stale_groups_are_rerun_not_handed_over(tok: SimpleChatTokenizer) -> None:
    eng = engine(tok)
    cfg = config(group_size=1, groups_per_step=2, max_staleness=1, queue_groups=4, max_in_flight=4)
    async with RolloutManager(CalcEnv, tasks(6), eng, tok, cfg) as manager:
        async with asyncio.timeout(10):
            while len(manager._ready) < 2:
                await asyncio.sleep(0.01)
        eng.set_version(3)  # the buffered groups (version 0) are now 3 behind
        groups = await collect(manager)
        dropped = manager.drain_dropped()
    assert sorted(g.task_id for g in groups) == [f"t{i}" for i in range(6)], "a stale task was skipped"
    assert all(3 - (g.oldest_version or 0) <= 1 for g in groups)
    assert len([d for d in dropped if d[1] == "stale"]) >= 2


async def test_back_pressure_stops_starting_groups(tok: SimpleChatTokenizer) -> None:
    eng = engine(tok)
    cfg = config(group_size=1, queue_groups=2, max_in_flight=2, max_staleness=100)
    async with RolloutManager(CalcEnv, tasks(20), eng, tok, cfg) as manager:
        async with asyncio.timeout(10):
            while len(manager._ready) < 2 or manager._episodes:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert manager.state()["issued"] <= 4 and len(manager._ready) == 2
        assert manager.metrics()["rollout/queue_depth"] == 2
        groups = await collect(manager)
    assert len(groups) == 20


async def test_cancellation_leaks_no_tasks_and_closes_envs(tok: SimpleChatTokenizer) -> None:
    eng = engine(tok, per_token_s=0.005)
    before = asyncio.all_tasks()
    manager = RolloutManager(CalcEnv, tasks(50), eng, tok, config(group_size=4, max_in_flight=16, max_staleness=5))
    async with manager:
        first = await collect(manager, 1)
        async with asyncio.timeout(10):  # taking a group made room: the next episodes open their envs
            while CalcEnv.open_envs == 0:  # (a loaded machine may have finished every earlier one)
                await asyncio.sleep(0.001)
    assert len(first) == 1
    assert asyncio.all_tasks() == before
    assert CalcEnv.open_envs == 0
    state = manager.state()
    assert not set(state["done"]) & set(state["in_flight"])
    # resume cursor: every issued task is either done or to be re-run
    assert set(state["done"]) | set(state["in_flight"]) == set(range(state["issued"]))
    assert len(state["done"]) == 1 and state["in_flight"]


async def test_ctrl_c_style_cancel_of_the_consumer(tok: SimpleChatTokenizer) -> None:
    eng = engine(tok, per_token_s=0.005)
    before = asyncio.all_tasks()

    async def train_loop() -> None:
        async with RolloutManager(CalcEnv, tasks(50), eng, tok, config(max_in_flight=8)) as manager:
            async for _ in manager.groups():
                await asyncio.sleep(3600)  # a long "train step" that gets interrupted

    loop_task = asyncio.create_task(train_loop())
    async with asyncio.timeout(10):
        while CalcEnv.open_envs == 0:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    loop_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop_task
    for _ in range(3):  # let the abandoned async generator's finaliser run
        await asyncio.sleep(0)
    assert asyncio.all_tasks() == before and CalcEnv.open_envs == 0


async def test_task_iterator_errors_surface_to_the_consumer(tok: SimpleChatTokenizer) -> None:
    def broken() -> Iterable[Task]:
        yield tasks(1)[0]
        raise RuntimeError("dataset file vanished")

    with pytest.raises(RuntimeError, match="dataset file vanished"):
        async with RolloutManager(CalcEnv, broken(), engine(tok), tok, config()) as manager:
            await collect(manager)


async def test_cursor_positions_come_from_the_task_stream(tok: SimpleChatTokenizer) -> None:
    from agentrl.rollout.task_stream import TaskStream

    stream = TaskStream(tasks(4), seed=0)
    work = stream.iterate(done=[0, 2])
    first = [next(work) for _ in range(3)]
    cfg = config(group_size=1)
    async with RolloutManager(CalcEnv, first, engine(tok), tok, cfg) as manager:
        await collect(manager)
        state = manager.state()
    assert state["done"] == [1, 3, 4]


async def test_overlong_replies_lose_reward_on_their_own_turn(tok: SimpleChatTokenizer) -> None:
    """DAPO soft overlong punishment: cap 10, buffer 4 -> free up to 6 tokens, then -0.25 per token."""
    from agentrl.envkit.testing import TrivialEnv, TrivialEnvConfig
    from agentrl.rollout.config import OverlongConfig

    cfg = config(max_new_tokens_per_turn=10, max_turns=3, overlong=OverlongConfig(buffer_tokens=4, penalty=1.0))
    # replies of 3 chars (+ eos = 4 tokens), 7 (+ eos = 8) and 30 (cut at 10, no eos)
    eng = ScriptedEngine(ScriptedEngine.Config(replies=["abc", "abcdefg", "x" * 30]), tokenizer=tok)
    traj = await run_episode(TrivialEnv(TrivialEnvConfig(turns=3)), {"id": "t", "prompt": "go"}, eng, tok, cfg)
    assert traj.error is None
    assert [t.end - t.start for t in traj.turns] == [4, 8, 10]
    assert [t.reward for t in traj.turns] == pytest.approx([0.0, -0.5, 1.0 - 1.0])  # the env pays 1 at the end
    assert traj.reward == pytest.approx(-0.5) and traj.reward_breakdown["overlong"] == pytest.approx(-1.5)
    plain = await run_episode(TrivialEnv(TrivialEnvConfig(turns=3)), {"id": "t", "prompt": "go"}, eng, tok,
                              config(max_new_tokens_per_turn=10, max_turns=3))  # fmt: skip
    assert plain.reward == 1.0 and "overlong" not in plain.reward_breakdown
    with pytest.raises(ValueError, match=r"overlong\.buffer_tokens=20 is more than max_new_tokens_per_turn=10"):
        config(max_new_tokens_per_turn=10, overlong={"buffer_tokens": 20})


async def test_a_nonfinite_logprob_from_the_engine_is_an_engine_error(tok: SimpleChatTokenizer) -> None:
    class Broken(ScriptedEngine):
        async def generate(self, prompt_ids: Any, sampling: Any) -> Any:
            completion = await super().generate(prompt_ids, sampling)
            completion.logprobs[0] = float("nan")
            return completion

    eng = Broken(ScriptedEngine.Config(replies=["hi"]), tokenizer=tok)
    env = CalcEnv()
    try:
        traj = await run_episode(env, tasks(1)[0], eng, tok, config())
    finally:
        await env.close()
    assert traj.error is not None and traj.error.kind is ErrorClass.ENGINE
    assert "non-finite logprob" in traj.error.message and traj.reward == 0.0

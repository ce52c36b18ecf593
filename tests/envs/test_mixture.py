"""`mix`: tasks drawn by weight from member envs, each episode run by its own member."""

from __future__ import annotations

from collections import Counter

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envs.mixture import MixEnv, interleave
from agentrl.errors import ConfigError
from agentrl.registry import Plugins
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import run_episode
from agentrl.run.evaluation import EvalResult, reward_by_env
from agentrl.run.wiring import batch_metrics
from agentrl.types import Group

CALC = {"name": "calculator", "params": {"n_train": 20, "n_test": 6}, "weight": 1}
LAKE = {"name": "gym_text", "params": {"game": "frozenlake", "train_size": 5, "test_size": 3}, "weight": 3,
        "label": "lake"}  # fmt: skip


@pytest.fixture(scope="module")
def plugins() -> Plugins:
    return Plugins.discover()


def mix(plugins: Plugins, *members: dict[str, object]) -> MixEnv:
    env = plugins.create_env("mix", {"envs": list(members)})
    assert isinstance(env, MixEnv)
    return env


def test_interleave_keeps_every_prefix_near_the_weights() -> None:
    order = interleave({"a": 2.0, "b": 1.0}, {"a": 20, "b": 10})
    for n in range(3, 31, 3):
        assert Counter(k for k, _ in order[:n]) == {"a": 2 * n // 3, "b": n // 3}
    assert [i for k, i in order if k == "a"] == list(range(20))  # each member's items in order
    # a member that runs out leaves the rest to the others
    short = interleave({"a": 1.0, "b": 1.0}, {"a": 2, "b": 5})
    assert [k for k, _ in short] == ["a", "b", "a", "b", "b", "b", "b"]


async def test_train_split_follows_the_weights_and_covers_every_task(plugins: Plugins) -> None:
    env = mix(plugins, CALC, LAKE)
    try:
        train = list(env.tasks("train"))
        counts = Counter(t["_env"] for t in train)
        # lake: 5 tasks at weight 3 against calculator's 20 at weight 1: lake repeats to 60
        assert counts == {"calculator": 20, "lake": 60}
        assert {t["id"] for t in train if t["_env"] == "lake"} == {
            t["id"] for t in plugins.create_env("gym_text", LAKE["params"]).tasks("train")  # type: ignore[arg-type]
        }
        test = list(env.tasks("test"))
        assert Counter(t["_env"] for t in test) == {"calculator": 6, "lake": 3}  # each once
        assert Counter(t["_env"] for t in test[:4]) == {"lake": 3, "calculator": 1}  # the weights, from the start
        assert [t["id"] for t in env.tasks("train")] == [t["id"] for t in train]  # deterministic
    finally:
        await env.close()


def test_member_configs_are_checked_when_the_config_loads(plugins: Plugins) -> None:
    with pytest.raises(ConfigError, match=r"env\.envs\.0: .*params\.game: got 'chess'"):
        plugins.env_config("mix", {"envs": [{"name": "gym_text", "params": {"game": "chess"}}]})
    with pytest.raises(ConfigError, match=r"env\.envs\.0: .*no_such_env"):
        plugins.env_config("mix", {"envs": [{"name": "no_such_env"}]})
    with pytest.raises(ConfigError, match="label 'gym_text' is used twice"):
        plugins.env_config("mix", {"envs": [{"name": "gym_text"}, {"name": "gym_text", "params": {"game": "taxi"}}]})
    with pytest.raises(ConfigError, match="cannot contain a mix"):
        plugins.env_config("mix", {"envs": [{"name": "mix", "params": {"envs": [CALC]}}]})
    with pytest.raises(ConfigError, match=r"env\.envs\.0\.weight"):
        plugins.env_config("mix", {"envs": [{"name": "gym_text", "weight": 0}]})


async def test_each_episode_runs_in_its_member_with_its_own_tools(plugins: Plugins) -> None:
    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["<action>right</action>"]), tokenizer=tok)
    cfg = RolloutConfig(max_turns=2, max_total_tokens=8192, max_new_tokens_per_turn=64)
    probe = mix(plugins, CALC, LAKE)
    tasks = list(probe.tasks("test"))
    await probe.close()
    lake_task = next(t for t in tasks if t["_env"] == "lake")
    calc_task = next(t for t in tasks if t["_env"] == "calculator")
    env = mix(plugins, CALC, LAKE)  # one env instance, two episodes: it switches members
    try:
        lake = await run_episode(env, lake_task, engine, tok, cfg, seed=0)
        calc = await run_episode(env, calc_task, engine, tok, cfg, seed=0)
    finally:
        await env.close()
    assert lake.error is None and calc.error is None
    assert (lake.env, calc.env) == ("lake", "calculator")
    assert lake.turns[0].info["state_key"] is not None  # gym_text's own info came through
    lake_text, calc_text = tok.decode(lake.token_ids), tok.decode(calc.token_ids)
    assert "Reach G to win" in lake_text and "<tools>" not in lake_text
    assert '"name": "calculator"' in calc_text  # the calculator's tool schema in its prompt only
    assert calc.task["_env"] == "calculator"
    assert env._current is None and not env._listing  # closed: no member left open


async def test_unknown_member_is_an_episode_error_not_a_crash(plugins: Plugins) -> None:
    env = mix(plugins, LAKE)
    with pytest.raises(ValueError, match=r"names member env 'chess'.*\['lake'\]"):
        await env.reset({"id": "x", "_env": "chess"})
    await env.close()


async def test_demonstrations_keep_each_members_tools(plugins: Plugins) -> None:
    env = mix(plugins, CALC, LAKE)
    try:
        sets = env.demonstration_sets()
    finally:
        await env.close()
    tools = [t for t, demos in sets if demos]
    assert len(tools) == 1 and tools[0] is not None and tools[0][0]["function"]["name"] == "calculator"


def test_rewards_break_down_by_member_only_for_mixtures() -> None:
    from agentrl.types import Trajectory

    def traj(env: str, reward: float, tagged: bool) -> Trajectory:
        return Trajectory(task_id="t", env=env, messages=[], token_ids=[], loss_mask=[], logprobs=[], versions=[],
                          reward=reward, task={"id": "t", "_env": env} if tagged else {"id": "t"})  # fmt: skip

    mixed = [traj("lake", 1.0, True), traj("lake", 0.0, True), traj("calculator", 1.0, True)]
    assert reward_by_env(mixed) == {"calculator": 1.0, "lake": 0.5}
    assert reward_by_env([traj("gym_text", 1.0, False)]) == {}
    metrics = batch_metrics([Group("t", mixed)])
    assert metrics["reward/mean/lake"] == 0.5 and metrics["reward/mean/calculator"] == 1.0
    result = EvalResult(reward_mean=2 / 3, pass_at={1: 2 / 3}, n_tasks=3, n_samples=1, errors=0, trajectories=mixed)
    assert result.metrics()["eval/lake/reward_mean"] == 0.5

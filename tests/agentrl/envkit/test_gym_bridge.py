"""Gymnasium bridge: agentrl envs inside gymnasium.make, gymnasium envs as agentrl envs."""

from __future__ import annotations

from typing import Any

import gymnasium
import pytest
from gymnasium.spaces import Text
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envkit.check import check_env
from agentrl.envkit.gym_bridge import GymnasiumEnv, GymnasiumEnvConfig, strip_ansi
from agentrl.envkit.gym_export import register_gymnasium, render_messages
from agentrl.registry import Plugins
from agentrl.types import Message

FROZEN = ["left", "down", "right", "up"]


class Countdown(Env):
    """Say the numbers from `start` down to 1, one per turn."""

    class Config(EnvConfig):
        start: int = 3

    def tasks(self, split: str = "train") -> list[Task]:
        return [{"id": f"{split}-{i}", "start": self.config.start + i} for i in range(3)]  # type: ignore[attr-defined]

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self.expected, self.wrong = task["start"], 0
        return [Message(role="user", content=f"Count down from {self.expected}.")], {"start": self.expected}

    async def step(self, action: Message) -> StepResult:
        if action.content.strip() != str(self.expected):
            self.wrong += 1  # the second wrong answer ends the episode
            return StepResult(messages=[Message(role="user", content="Wrong.")], reward=-1.0, truncated=self.wrong > 1)
        self.expected -= 1
        if self.expected == 0:
            return StepResult(messages=[], reward=1.0, terminated=True, info={"done": True})
        return StepResult(messages=[Message(role="user", content="Next.")], reward=0.1)


@pytest.fixture
def env_id() -> str:
    plugins = Plugins()
    plugins.envs.add("countdown_test", Countdown, source="test")
    ids = register_gymnasium(plugins)
    assert ids == ["agentrl/countdown_test-v0"]
    return ids[0]


def test_agentrl_env_through_gymnasium_make(env_id: str) -> None:
    env = gymnasium.make(env_id, start=2, render_mode="ansi")
    obs, info = env.reset(seed=0, options={"task_id": "train-0"})
    assert obs == "user: Count down from 2."
    assert info["start"] == 2 and info["messages"] == [{"role": "user", "content": "Count down from 2."}]
    obs, reward, terminated, truncated, info = env.step("2")
    assert (obs, reward, terminated, truncated) == ("user: Next.", pytest.approx(0.1), False, False)
    obs, reward, terminated, truncated, info = env.step("1")
    assert (obs, reward, terminated, truncated, info["done"]) == ("", 1.0, True, False, True)
    assert env.render() == "user: Count down from 2.\n\nassistant: 2\n\nuser: Next.\n\nassistant: 1"
    env.close()
    env.close()


def test_truncation_and_params_are_validated(env_id: str) -> None:
    env = gymnasium.make(env_id)
    env.reset(seed=1, options={"task": {"id": "custom", "start": 5}})
    assert env.step("4")[1:4] == (-1.0, False, False)
    _, reward, terminated, truncated, _ = env.step("4")
    assert (reward, terminated, truncated) == (-1.0, False, True)
    env.close()
    with pytest.raises(Exception, match=r"env\.start"):
        gymnasium.make(env_id, start="many")


def test_passes_gymnasiums_own_env_checker(env_id: str) -> None:
    env = gymnasium.make(env_id).unwrapped
    gymnasium_check_env(env, skip_render_check=True)
    # Same seed, same task (the RNG picks it), same observation.
    first = env.reset(seed=7)[0]
    assert env.reset(seed=7)[0] == first
    env.close()


async def test_sync_gym_env_works_inside_a_running_event_loop(env_id: str) -> None:
    env = gymnasium.make(env_id, start=1)
    env.reset(seed=0, options={"task_id": "train-0"})
    assert env.step("1")[2] is True
    env.close()


def test_render_messages_shows_tool_calls() -> None:
    from agentrl.types import ToolCall

    text = render_messages(
        [
            Message(role="assistant", content="", tool_calls=[ToolCall(name="add", arguments={"a": 1})]),
            Message(role="tool", content="3", name="add"),
        ]
    )
    assert text == "assistant: \n[tool call add({'a': 1})]\n\ntool (add): 3"


# --------------------------------------------------------------------------- gymnasium -> agentrl


def frozen(**kwargs: Any) -> GymnasiumEnv:
    make_kwargs = {"is_slippery": False, **kwargs.pop("make_kwargs", {})}
    return GymnasiumEnv(
        GymnasiumEnvConfig(gym_id="FrozenLake-v1", action_names=FROZEN, make_kwargs=make_kwargs, **kwargs)
    )


async def test_frozenlake_played_in_text_reaches_the_goal() -> None:
    env = frozen(instructions="Reach G.")
    messages, _ = await env.reset({"id": "t", "seed": 0}, seed=0)
    assert [m.role for m in messages] == ["system", "user"]
    assert messages[0].content == "Reach G."
    assert messages[1].content.startswith("[S]FFF\nFHFH\nFFFH\nHFFG")
    assert "left (0), down (1), right (2), up (3)" in messages[1].content
    assert "\x1b" not in messages[1].content
    replies = ["<action>down</action>", "DOWN", "I'll go right.", "2", "<action>1</action>"]
    for reply in replies:
        result = await env.step(Message(role="assistant", content=reply))
        assert (result.reward, result.terminated, result.truncated) == (0.0, False, False)
    result = await env.step(Message(role="assistant", content="<action>right</action>"))
    assert (result.reward, result.terminated, result.truncated) == (1.0, True, False)
    assert result.info["action"] == 2
    assert "[G]" in result.messages[0].content or "G" in result.messages[0].content
    await env.close()
    await env.close()


async def test_hole_terminates_and_time_limit_truncates() -> None:
    env = frozen()
    await env.reset({"id": "t", "seed": 0})
    await env.step(Message(role="assistant", content="right"))
    result = await env.step(Message(role="assistant", content="down"))  # (1,1) is a hole
    assert (result.reward, result.terminated, result.truncated) == (0.0, True, False)

    env = frozen(make_kwargs={"max_episode_steps": 2})
    await env.reset({"id": "t", "seed": 0})
    assert not (await env.step(Message(role="assistant", content="left"))).truncated
    result = await env.step(Message(role="assistant", content="left"))
    assert (result.terminated, result.truncated) == (False, True)


async def test_invalid_actions_cost_and_eventually_truncate() -> None:
    env = frozen(max_invalid_actions=1, invalid_action_reward=-0.5)
    await env.reset({"id": "t", "seed": 0})
    first = await env.step(Message(role="assistant", content="jump!"))
    assert (first.reward, first.truncated, first.info) == (-0.5, False, {"invalid_action": True})
    assert first.messages[0].content.startswith("Invalid action.")
    assert (await env.step(Message(role="assistant", content="<action>fly</action> left"))).truncated


def test_gymnasium_env_passes_check_env_and_has_disjoint_splits() -> None:
    env = frozen()
    assert check_env(env, n_episodes=2).warnings == []
    train = {t["id"] for t in env.tasks("train")}
    test = {t["id"] for t in env.tasks("test")}
    assert len(train) == 1000 and not train & test
    with pytest.raises(ValueError, match="allowed: train, test"):
        env.tasks("dev")


async def test_sample_seed_varies_slippery_dynamics_reproducibly() -> None:
    async def walk(seed: int) -> list[int]:
        env = GymnasiumEnv(GymnasiumEnvConfig(gym_id="FrozenLake-v1", action_names=FROZEN, observation="value"))
        await env.reset({"id": "t", "seed": 3}, seed=seed)
        states = []
        for _ in range(6):
            result = await env.step(Message(role="assistant", content="right"))
            states.append(result.messages[0].content)
            if result.terminated or result.truncated:
                break
        return [hash(s) for s in states]

    assert await walk(1) == await walk(1)
    assert len({tuple(await walk(s)) for s in range(6)}) > 1


class EchoWord(gymnasium.Env[str, str]):
    """A gymnasium env with Text spaces: repeat the shown word."""

    def __init__(self) -> None:
        self.observation_space = Text(16)
        self.action_space = Text(16)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.word = ["apple", "pear", "plum"][int(self.np_random.integers(3))]
        return self.word, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "done", float(action == self.word), True, False, {}


async def test_text_space_gymnasium_env() -> None:
    gymnasium.register(id="agentrl_test/EchoWord-v0", entry_point=EchoWord)
    try:
        env = GymnasiumEnv(GymnasiumEnvConfig(gym_id="agentrl_test/EchoWord-v0"))
        messages, _ = await env.reset({"id": "x", "seed": 5})
        word = messages[-1].content.split("\n")[0]
        assert word in ("apple", "pear", "plum")
        result = await env.step(Message(role="assistant", content=f"<action>{word}</action>"))
        assert (result.reward, result.terminated) == (1.0, True)
        await env.reset({"id": "x", "seed": 5})
        bad = await env.step(Message(role="assistant", content="not a word!"))  # outside Text's charset
        assert bad.info == {"invalid_action": True}
    finally:
        gymnasium.registry.pop("agentrl_test/EchoWord-v0")


async def test_unsupported_action_space_and_name_count() -> None:
    env = GymnasiumEnv(GymnasiumEnvConfig(gym_id="Pendulum-v1"))
    with pytest.raises(ValueError, match="supports Text or Discrete action spaces"):
        await env.reset({"id": "x", "seed": 0})
    env = GymnasiumEnv(GymnasiumEnvConfig(gym_id="FrozenLake-v1", action_names=["a", "b"]))
    with pytest.raises(ValueError, match="action_names has 2 names but 'FrozenLake-v1' has 4 actions"):
        await env.reset({"id": "x", "seed": 0})


def test_strip_ansi() -> None:
    assert strip_ansi("S\x1b[41mF\x1b[0mF\n\x1b[1mbold") == "S[F]F\nbold"

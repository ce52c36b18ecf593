"""The `openenv` env against real OpenEnv servers (openenv-core's own server code, uvicorn in a subprocess).

Two servers: the echo environment that `openenv init` generates (the package's own template, unmodified) and
a small guessing game written against openenv's `Environment` + `create_app` (it ends episodes with done and
rewards them). No network: both are local processes on loopback ports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv")
pytestmark = pytest.mark.slow  # real server processes: ~5-15 s each on 2 busy cores

from agentrl.envkit.check import acheck_env  # noqa: E402
from agentrl.envs.openenv_env import OpenEnvConfig, OpenEnvEnv, OpenEnvServer  # noqa: E402
from agentrl.rollout.episode import EpisodeFailure  # noqa: E402
from agentrl.run.resources import RunResources  # noqa: E402
from agentrl.types import ErrorClass, Message  # noqa: E402

GUESS_APP = '''
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    """Guess a number in 1..10 drawn from the reset seed; 'higher'/'lower' hints; reward 1 when found."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._target = 1
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._target = (seed or 0) % 10 + 1
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback="Guess my number (1-10).", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.guess == self._target:
            return GuessObservation(feedback="correct", done=True, reward=1.0)
        hint = "higher" if action.guess < self._target else "lower"
        return GuessObservation(feedback=hint, done=False, reward=0.0)

    @property
    def state(self):
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=4)
'''


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The echo environment exactly as `openenv init echo_env` writes it."""
    root = tmp_path_factory.mktemp("openenv")
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env"], cwd=root, check=True,
                   capture_output=True, timeout=120)
    assert (root / "echo_env" / "server" / "app.py").is_file()
    return root / "echo_env"


@pytest.fixture(scope="module")
def guess_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guess")
    (root / "guess_app.py").write_text(GUESS_APP)
    return root


def _reply(text: str) -> Message:
    return Message(role="assistant", content=text)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def echo_checks(echo_dir: Path, resources: RunResources) -> None:
    """The reply is the action, the reward is the server's (each server start costs ~10 s: tests share them)."""
    env = OpenEnvEnv(OpenEnvConfig(app="server.app:app", app_dir=str(echo_dir), action_field="message",
                                   observation_field="echoed_message", max_turns=2, instruction="Say something."),
                     resources=resources)
    try:
        messages, info = await env.reset({"id": "train-0", "seed": 0})
        assert info["server"].startswith("http://127.0.0.1:")
        assert [m.role for m in messages] == ["user"]
        assert messages[0].content.startswith("Say something.")
        assert "environment ready" in messages[0].content
        first = await env.step(_reply("hello"))
        assert first.messages[0].content == "hello"  # the server echoed the action's `message`
        assert first.reward == pytest.approx(0.5)  # the echo env's own reward: 0.1 per character
        assert not first.terminated and not first.truncated
        second = await env.step(_reply("hi!"))
        assert second.reward == pytest.approx(0.3)
        assert second.truncated and second.truncation_reason == "max_turns"
        # a new episode of the same env is a fresh session of the same server
        again, _ = await env.reset({"id": "train-1", "seed": 1})
        assert "environment ready" in again[0].content
    finally:
        await env.close()


async def test_sessions_past_the_servers_limit_wait_with_max_sessions(echo_dir: Path) -> None:
    """The echo app serves max_concurrent_envs=1: a second session is refused, unless max_sessions makes it wait."""
    import asyncio

    resources = RunResources()
    config = OpenEnvConfig(app="server.app:app", app_dir=str(echo_dir), observation_field="echoed_message")
    first, refused = OpenEnvEnv(config, resources=resources), OpenEnvEnv(config, resources=resources)
    limited = OpenEnvConfig(**{**config.model_dump(), "max_sessions": 1})
    a, b = OpenEnvEnv(limited, resources=resources), OpenEnvEnv(limited, resources=resources)
    try:
        await echo_checks(echo_dir, resources)
        await first.reset({"id": "train-0", "seed": 0})
        with pytest.raises(EpisodeFailure, match="max_sessions"):
            await refused.reset({"id": "train-1", "seed": 1})
        await first.close()
        await a.reset({"id": "train-0", "seed": 0})
        waiting = asyncio.ensure_future(b.reset({"id": "train-1", "seed": 1}))
        assert (await a.step(_reply("abc"))).messages[0].content == "abc"  # a's session works while b waits
        assert not waiting.done()
        await a.close()  # frees the session: b gets it
        messages, _ = await asyncio.wait_for(waiting, 60)
        assert "environment ready" in messages[0].content
        assert (await b.step(_reply("xy"))).reward == pytest.approx(0.2)
    finally:
        for env in (first, refused, a, b):
            await env.close()
        await resources.aclose()


async def json_checks(guess_dir: Path, resources: RunResources) -> None:
    """JSON actions, hints, done with the server's reward, a malformed reply, an action the server rejects."""
    env = OpenEnvEnv(OpenEnvConfig(app="guess_app:app", app_dir=str(guess_dir), action_format="json",
                                   system_prompt="Reply with JSON like {\"guess\": 5}."), resources=resources)
    try:
        messages, _ = await env.reset({"id": "train-3", "seed": 3})  # target 4
        assert [m.role for m in messages] == ["system", "user"]
        assert '"feedback": "Guess my number (1-10)."' in messages[1].content  # all fields as JSON
        bad = await env.step(_reply("five"))
        assert bad.info["invalid_action"] and "not a JSON action" in bad.messages[0].content
        assert bad.reward == 0.0 and not bad.terminated
        low = await env.step(_reply('{"guess": 2}'))
        assert '"higher"' in low.messages[0].content and not low.terminated
        high = await env.step(_reply('```json\n{"guess": 7}\n```'))
        assert '"lower"' in high.messages[0].content
        won = await env.step(_reply('{"guess": 4}'))
        assert won.terminated and won.reward == 1.0 and won.messages == []
        # the server validates the action: a wrong field is the server's error, an env failure (never a 0 reward)
        await env.reset({"id": "train-3", "seed": 3})
        with pytest.raises(EpisodeFailure) as failed:
            await env.step(_reply('{"guessed": 4}'))
        assert failed.value.error_class is ErrorClass.ENV
    finally:
        await env.close()


async def test_env_contract_and_one_server_for_the_run(guess_dir: Path) -> None:
    """Two envs of one run (as the rollout manager builds one per episode) share one server process."""
    resources = RunResources()
    config = OpenEnvConfig(app="guess_app:app", app_dir=str(guess_dir), action_format="json", num_tasks=3)
    other = OpenEnvEnv(config, resources=resources)
    env = OpenEnvEnv(config, resources=resources)
    try:
        assert [t["seed"] for t in env.tasks("test")] == [1_000_000, 1_000_001, 1_000_002]
        url = await env.base_url()
        assert await other.base_url() == url  # one server per config, shared by the run's episodes
        await other.reset({"id": "train-0", "seed": 0})  # two sessions at once, each its own game
        await env.reset({"id": "train-1", "seed": 1})
        assert (await other.step(_reply('{"guess": 1}'))).terminated
        assert not (await env.step(_reply('{"guess": 1}'))).terminated
        await other.close()
        assert len(resources) == 1  # an env's close leaves the run's server to the run
        await json_checks(guess_dir, resources)
        assert len(resources) == 1  # another config of the same app (a system prompt): the same server
        server = next(iter(env.resources._objects.values()))
        assert isinstance(server, OpenEnvServer) and server._proc is not None
        pid = server._proc.pid
        assert _alive(pid)
        # the env contract (reset, steps to the end, close twice); the check closes the env at its end
        report = await acheck_env(env, n_episodes=2, policy=lambda messages: '{"guess": 1}', max_steps=12)
        assert report is not None
    finally:
        await env.close()
        assert _alive(pid)
        await resources.aclose()
    assert not _alive(pid)  # the run's end stops the server process


async def test_a_server_that_does_not_start_is_an_env_failure(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise RuntimeError('no env here')\n")
    env = OpenEnvEnv(OpenEnvConfig(app="broken:app", app_dir=str(tmp_path), start_timeout_s=30))
    try:
        with pytest.raises(EpisodeFailure) as failed:
            await env.reset({"id": "train-0", "seed": 0})
        assert failed.value.error_class is ErrorClass.ENV
        assert "did not start" in str(failed.value) and "no env here" in str(failed.value)
    finally:
        await env.close()


async def test_an_unreachable_url_is_an_env_failure() -> None:
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = OpenEnvEnv(OpenEnvConfig(url=f"http://127.0.0.1:{port}", message_timeout_s=5))
    try:
        with pytest.raises(EpisodeFailure) as failed:
            await env.reset({"id": "train-0", "seed": 0})
        assert failed.value.error_class is ErrorClass.ENV
    finally:
        await env.close()


def test_config_needs_exactly_one_server() -> None:
    with pytest.raises(ValueError, match="exactly one of url"):
        OpenEnvConfig()
    with pytest.raises(ValueError, match="exactly one of url"):
        OpenEnvConfig(url="http://127.0.0.1:1", app="a:app")
    with pytest.raises(ValueError, match="module:attr"):
        OpenEnvConfig(app="server.app")


KILLED_RUN = '''
import asyncio, sys
from agentrl.envs.openenv_env import OpenEnvConfig, OpenEnvServer

async def main():
    server = OpenEnvServer(OpenEnvConfig(app="guess_app:app", app_dir=sys.argv[1]))
    await server.start()
    print(server._proc.pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
'''


def test_a_killed_run_leaves_no_server(guess_dir: Path) -> None:
    import glob
    import tempfile

    logs = set(glob.glob(f"{tempfile.gettempdir()}/agentrl-openenv-*.log"))
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(guess_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None
        pid = int(run.stdout.readline())
        assert _alive(pid)
    finally:
        run.kill()
        run.wait(timeout=30)
    for _ in range(200):  # the kernel delivers the parent-death signal; the server is reaped by init
        if not _alive(pid) or _zombie(pid):
            break
        import time

        time.sleep(0.05)
    assert not _alive(pid) or _zombie(pid)
    assert set(glob.glob(f"{tempfile.gettempdir()}/agentrl-openenv-*.log")) <= logs  # nor its start-up log


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return True


def _count_up(prompt: str) -> str:
    """The scripted model: guess 1, 2, 3, ... (one more than the guesses already in the conversation)."""
    return json.dumps({"guess": prompt.count('{"guess"') + 1})


@pytest.mark.model
async def test_groups_under_the_rollout_manager(guess_dir: Path, smollm2_path: str) -> None:
    """A run's episodes (groups of 2, 4 in flight, max_sessions 2) are OpenEnv sessions; reward and done the server's."""
    from agentrl.chat.conversation import HFChatTokenizer
    from agentrl.engines.scripted import ScriptedEngine
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.manager import RolloutManager

    tokenizer = HFChatTokenizer.from_pretrained(smollm2_path)
    engine = ScriptedEngine(ScriptedEngine.Config(logprob=-0.5), tokenizer=tokenizer, reply_fn=_count_up)
    config = OpenEnvConfig(app="guess_app:app", app_dir=str(guess_dir), action_format="json", num_tasks=3,
                           max_sessions=2)
    rollout = RolloutConfig(group_size=2, groups_per_step=3, max_in_flight=4, max_staleness=4, max_turns=12,
                            max_new_tokens_per_turn=16, max_total_tokens=2048)
    resources = RunResources()
    env = OpenEnvEnv(config, resources=resources)
    try:
        async with RolloutManager(lambda: OpenEnvEnv(config, resources=resources), list(env.tasks("train")), engine,
                                  tokenizer, rollout) as manager:
            groups = [g async for g in manager.groups()]
    finally:
        await resources.aclose()
    assert sorted(g.task_id for g in groups) == ["train-0", "train-1", "train-2"]
    for group in groups:
        target = int(group.task_id.split("-")[1]) % 10 + 1  # the game's number for seed i
        for traj in group.trajectories:
            assert traj.error is None and traj.terminated and traj.reward == 1.0
            assert len(traj.turns) == target  # guessed 1..target: the server ended the episode on the right one

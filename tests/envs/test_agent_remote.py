"""The `agent` env in remote mode: agents outside the run claim its episodes over HTTP.

The agents here are asyncio tasks speaking plain HTTP and the openai SDK to the
run's gateway, as a process or container would (tests/envs/test_agent_remote_train.py
runs them as separate processes and in docker, under `agentrl train`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "agentrl" / "gateway"))

from gateway_helpers import assert_token_exact, calculator_reply, openai_agent

from agentrl.chat.conversation import HFChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envs.agent import AgentEnv, AgentEnvConfig
from agentrl.gateway.episodes import NoRemoteAgents
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import RolloutManager
from agentrl.run.resources import RunResources
from agentrl.types import ErrorClass, Trajectory

pytestmark = pytest.mark.model

TASKS = [{"id": f"q{i}", "question": f"What is {a} + {b}?", "answer": a + b} for i, (a, b) in enumerate([(12, 30), (7, 8)])]
TOKEN = "remote-agents-token-0123"
REPO = Path(__file__).resolve().parents[2]
ROLLOUT = dict(max_turns=4, max_new_tokens_per_turn=64, max_total_tokens=2048)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> HFChatTokenizer:
    return HFChatTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def engine(tokenizer: HFChatTokenizer) -> ScriptedEngine:
    return ScriptedEngine(ScriptedEngine.Config(logprob=-0.25), tokenizer=tokenizer, reply_fn=calculator_reply)


@pytest.fixture
async def resources() -> AsyncIterator[RunResources]:
    """The run's shared resources: the remote gateway lives here, across the per-episode envs."""
    res = RunResources()
    yield res
    await res.aclose()


def remote_config(**kw: Any) -> AgentEnvConfig:
    return AgentEnvConfig(mode="remote", tasks=TASKS, gateway={"token": TOKEN}, **kw)


async def gateway_url(resources: RunResources, config: AgentEnvConfig) -> str:
    """The run gateway's root URL, once the first episode has started it."""
    hub = AgentEnv(config, resources=resources).remote_agents()
    async with asyncio.timeout(30):
        while hub.gateway is None:
            await asyncio.sleep(0.01)
    return hub.gateway.url


async def claim(http: httpx.AsyncClient, url: str, wait_s: float = 5.0) -> httpx.Response:
    return await http.post(f"{url}/episodes", json={"wait_s": wait_s}, headers={"Authorization": f"Bearer {TOKEN}"})


async def remote_agent(url: str, played: list[dict[str, Any]], *, reward_from_answer: bool = True) -> None:
    """Claim episodes until the run stops offering them; each one: the openai-SDK tool loop, reward, close."""
    admin = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            try:
                got = await claim(http, url, wait_s=0.5)
            except httpx.TransportError:  # the run's gateway is gone
                return
            if got.status_code in (204,):
                continue
            if got.status_code == 410:
                return
            episode = got.json()
            client = openai.AsyncOpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
            answer, sampled = await openai_agent(client, episode["task"]["question"])
            await client.close()
            reward = float(answer == f"Answer: {episode['task']['answer']}")
            played.append({"id": episode["id"], "sampled": sampled, "task": episode["task"]})
            assert (await http.post(f"{episode['session_url']}/reward", json={"reward": reward}, headers=admin)).status_code == 200
            assert (await http.post(f"{episode['session_url']}/close", headers=admin)).status_code == 200


async def test_remote_agents_play_the_runs_episodes_in_groups(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, resources: RunResources
) -> None:
    config = remote_config()
    rollout = RolloutConfig(group_size=2, groups_per_step=2, max_in_flight=4, max_staleness=4, **ROLLOUT)
    played: list[dict[str, Any]] = []
    async with RolloutManager(lambda: AgentEnv(config, resources=resources), TASKS, engine, tokenizer, rollout) as manager:
        collect = asyncio.ensure_future(_collect(manager))
        url = await gateway_url(resources, config)
        agents = [asyncio.create_task(remote_agent(url, played)) for _ in range(3)]
        groups = await collect
    await resources.aclose()  # the run ends: the gateway stops, the agents see it and stop
    await asyncio.wait_for(asyncio.gather(*agents), 30)
    assert sorted(g.task_id for g in groups) == ["q0", "q1"]
    by_session = {p["id"]: p for p in played}
    for group in groups:
        assert [t.sample_index for t in group.trajectories] == [0, 1]
        for traj in group.trajectories:
            assert traj.error is None and traj.reward == 1.0 and traj.env == "agent"
            session = traj.info["gateway"]["session"]  # type: ignore[index,call-overload]
            assert by_session[session]["task"]["id"] == traj.task_id == group.task_id
            assert_token_exact(traj, by_session[session]["sampled"])
            assert [m.role for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]


async def _collect(manager: RolloutManager) -> list[Any]:
    return [g async for g in manager.groups()]


async def _drive(env: AgentEnv, engine: Any, tokenizer: Any, **kw: Any) -> list[Trajectory]:
    rollout = RolloutConfig(group_size=1, groups_per_step=1, **ROLLOUT, **kw)
    return await env.drive_episode(TASKS[0], engine, tokenizer, rollout, seed=0, group_id="g", sample_index=0)


async def test_an_episode_no_agent_claims_fails_with_class_agent(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, resources: RunResources
) -> None:
    env = AgentEnv(remote_config(claim_timeout_s=0.3), resources=resources)
    [traj] = await _drive(env, engine, tokenizer)
    assert traj.error is not None and traj.error.kind is ErrorClass.AGENT
    assert "no remote agent claimed the episode within env.claim_timeout_s=0.3s" in traj.error.message
    assert traj.token_ids == [] and engine.calls == 0 and env.remote_agents().unclaimed == 1
    assert RolloutConfig().on_error[ErrorClass.AGENT].value == "retry"
    async with httpx.AsyncClient() as http:  # the offer was withdrawn: nothing left to claim
        assert (await claim(http, env.remote_agents().gateway.url, wait_s=0)).status_code == 204  # type: ignore[union-attr]


async def test_a_claimed_episode_not_closed_in_time_times_out_and_its_session_ends(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, resources: RunResources
) -> None:
    env = AgentEnv(remote_config(), resources=resources)
    drive = asyncio.create_task(_drive(env, engine, tokenizer, episode_timeout_s=1.0))
    url = await gateway_url(resources, env.config)
    async with httpx.AsyncClient(timeout=30) as http:
        episode = (await claim(http, url)).json()
        client = openai.AsyncOpenAI(base_url=episode["base_url"], api_key=episode["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        [traj] = await drive
        with pytest.raises(openai.ConflictError, match="has ended"):
            await client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
        await client.close()
    assert traj.error is not None and traj.error.kind is ErrorClass.TIMEOUT
    assert "did not close the episode within rollout.episode_timeout_s=1s" in traj.error.message
    assert len(traj.turns) == 1  # what it sampled is kept (the failure policy decides: zero reward by default)


async def test_an_agent_that_gives_up_fails_the_episode_with_its_reason(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, resources: RunResources
) -> None:
    env = AgentEnv(remote_config(), resources=resources)
    drive = asyncio.create_task(_drive(env, engine, tokenizer))
    url = await gateway_url(resources, env.config)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(timeout=30) as http:
        episode = (await claim(http, url)).json()
        assert episode["task"] == TASKS[0]
        body = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}
        assert (await http.post(f"{episode['base_url']}/chat/completions", json=body, headers=admin)).status_code == 200
        assert (await http.post(f"{episode['session_url']}/close", json={"error": 7}, headers=admin)).status_code == 400
        assert (await http.post(f"{episode['session_url']}/close", json={"error": "tool crashed"}, headers=admin)).status_code == 200
    [traj] = await drive
    assert traj.error is not None and traj.error.kind is ErrorClass.ENV
    assert traj.error.message == "the remote agent gave up: tool crashed"


async def test_cancelling_an_episode_withdraws_its_offer_and_ends_its_session(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, resources: RunResources
) -> None:
    env = AgentEnv(remote_config(), resources=resources)
    waiting = asyncio.create_task(_drive(env, engine, tokenizer))
    url = await gateway_url(resources, env.config)
    hub = env.remote_agents()
    async with asyncio.timeout(10):
        while hub.board.waiting == 0:
            await asyncio.sleep(0.01)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    assert hub.board.waiting == 0
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await claim(http, url, wait_s=0)).status_code == 204
        running = asyncio.create_task(_drive(env, engine, tokenizer))  # claimed, then cancelled mid-episode
        episode = (await claim(http, url)).json()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        late = await http.post(f"{episode['base_url']}/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {episode['api_key']}"})
        assert late.status_code == 409 and late.json()["error"]["code"] == "session_closed"


async def test_the_run_gateway_hands_out_episodes_only_and_says_when_the_run_is_over(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, resources: RunResources
) -> None:
    env = AgentEnv(remote_config(claim_timeout_s=0.2), resources=resources)
    await _drive(env, engine, tokenizer)
    url = env.remote_agents().gateway.url  # type: ignore[union-attr]
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.post(f"{url}/episodes", json={"wait_s": 0})).status_code == 401  # no token
        own = await http.post(f"{url}/sessions", json={}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert own.status_code == 403 and "POST /episodes" in own.json()["error"]["message"]
        bad = await http.post(f"{url}/episodes", json={"wait_s": 1e6}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "wait_s"
        pending = asyncio.create_task(claim(http, url, wait_s=30))
        await asyncio.sleep(0.2)
        env.remote_agents().board.close()  # the run ends while an agent waits
        assert (await pending).status_code == 410
        assert (await claim(http, url, wait_s=0)).status_code == 410


async def test_a_taken_port_is_a_config_error_naming_it(
    engine: ScriptedEngine, tokenizer: HFChatTokenizer, resources: RunResources
) -> None:
    import socket

    from agentrl.errors import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = AgentEnv(AgentEnvConfig(mode="remote", tasks=TASKS, gateway={"port": port}), resources=resources)
        with pytest.raises(ConfigError, match=f"env.gateway: cannot serve remote agents on 127.0.0.1:{port}"):
            await _drive(env, engine, tokenizer)


def test_remote_mode_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="agent: required in mode in_process"):
        AgentEnvConfig(tasks=TASKS)
    with pytest.raises(ValueError, match="remote mode runs no agent code"):
        AgentEnvConfig(mode="remote", agent="m:solve", tasks=TASKS)
    with pytest.raises(ValueError, match="is not a loopback address"):
        AgentEnvConfig(mode="remote", tasks=TASKS, gateway={"host": "0.0.0.0"})


async def test_a_run_nobody_claims_stops_saying_where_to_connect(engine: Any, tokenizer: Any, resources: RunResources) -> None:
    config = remote_config(claim_timeout_s=0.2, claim_give_up_after=3)
    rollout = RolloutConfig(group_size=1, groups_per_step=1, max_in_flight=2, max_retries=10, **ROLLOUT)
    async with RolloutManager(lambda: AgentEnv(config, resources=resources), TASKS, engine, tokenizer, rollout) as m:
        with pytest.raises(NoRemoteAgents) as raised:
            async with asyncio.timeout(60):
                async for _ in m.groups():
                    pass
    hub = AgentEnv(config, resources=resources).remote_agents()
    message = str(raised.value)
    assert hub.gateway is not None and f"POST {hub.gateway.url}/episodes" in message
    assert message.startswith("no remote agent connected") and "env.gateway.token" in message
    assert "3 claim windows of env.claim_timeout_s=0.2s" in message and hub.unclaimed >= 3
    assert TOKEN not in message  # the setting is named, the secret is not printed
    assert engine.calls == 0


async def test_claims_keep_the_run_waiting_and_zero_never_gives_up(resources: RunResources) -> None:
    hub = AgentEnv(remote_config(), resources=resources).remote_agents()
    hub.board.last_claim_at -= 10.0  # ten seconds without a claim
    assert hub.give_up(claim_timeout_s=2.0, windows=3) is not None
    assert hub.give_up(claim_timeout_s=2.0, windows=0) is None  # 0 = wait forever
    assert hub.give_up(claim_timeout_s=5.0, windows=3) is None  # 10 s < 3 windows of 5 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_agentrl_eval_with_remote_agents(smollm2_path: str, tmp_path: Path) -> None:
    """`agentrl eval` on a remote-mode config offers its held-out episodes on the gateway; agents play them."""
    import json

    from agentrl.run.commands import eval_command

    port = _free_port()
    overrides = [f"model.path={smollm2_path}", "engine={name: scripted, replies: ['Answer: 1']}",
                 f"env.gateway.port={port}", f"env.gateway.token={TOKEN}", "env.claim_timeout_s=30"]
    url = f"http://127.0.0.1:{port}"
    played: list[str] = []

    async def agent() -> None:
        admin = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(timeout=30) as http:
            while True:
                try:
                    got = await claim(http, url, wait_s=0.5)
                except httpx.TransportError:  # not started yet, or the eval is over
                    if len(played) >= 3:
                        return
                    await asyncio.sleep(0.05)
                    continue
                if got.status_code == 410:
                    return
                if got.status_code == 204:
                    continue
                episode = got.json()
                r = await http.post(f"{episode['base_url']}/chat/completions", headers={
                    "Authorization": f"Bearer {episode['api_key']}"},
                    json={"model": "m", "messages": [{"role": "user", "content": str(episode["task"])}]})
                played.append(r.json()["choices"][0]["message"]["content"])
                await http.post(f"{episode['session_url']}/reward", json={"reward": 1.0}, headers=admin)
                await http.post(f"{episode['session_url']}/close", headers=admin)

    agents = asyncio.ensure_future(agent())
    async with asyncio.timeout(120):
        await asyncio.to_thread(eval_command, REPO / "examples" / "openai-agent" / "remote.yaml", tasks=3,
                                out=tmp_path, overrides=overrides)  # the `agentrl eval` command itself
        await agents
    [summary] = json.loads((tmp_path / "eval.json").read_text())
    assert summary["tasks"] == 3 and summary["reward_mean"] == 1.0, summary
    assert played == ["Answer: 1"] * 3

"""The `agent` env hands a shell agent its episode's workspace (env.workspace): commands run there, not on the host.

`solve_shell` is a mini-swe-agent-style loop written against an OpenAI client and a `workspace` with exec/read/write;
the model (scripted) answers with a bash block, the agent runs it in the workspace and shows the output, the reward
is what the agent finds in the workspace afterwards. It runs under the rollout manager on the real local
(bubblewrap) sandbox.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from agentrl.chat.conversation import HFChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envs.agent import AgentEnv, AgentEnvConfig, load_agent
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.manager import RolloutManager
from agentrl.types import ErrorClass

TASKS = [{"id": "t0", "a": 12, "b": 30}, {"id": "t1", "a": 7, "b": 8}]
SPEC = {"workdir": "/work", "files": {"numbers.txt": "placeholder"}, "setup": ("echo ready > state.txt",)}
SEEN: list[dict[str, Any]] = []  # what each episode's agent saw in its workspace


def shell_reply(prompt: str) -> str:
    """The scripted model: a bash block that adds the two numbers it was shown; then 'DONE' after the output."""
    if "exit code" in prompt.rsplit("<|im_start|>", 2)[-2]:
        return "DONE"
    a, b = re.findall(r"Add (\d+) and (\d+)", prompt)[-1]
    return f"```bash\necho $(({a} + {b})) > answer.txt; cat state.txt\n```"


async def solve_shell(task: dict[str, Any], client: Any, workspace: Any) -> float:
    """A shell agent: ask for a command, run it where the episode's workspace is, until the model says DONE."""
    before = await workspace.exec("test -e answer.txt && echo leaked || echo fresh; hostname; id -u")
    await workspace.write_file("numbers.txt", f"{task['a']} {task['b']}")
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Add {task['a']} and {task['b']}; "
                                       f"write the sum to answer.txt. ({(await workspace.read_file('numbers.txt')).decode()})"}]
    for _ in range(4):
        r = await client.chat.completions.create(model="m", messages=messages)
        text = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
        if block is None:
            break
        out = await workspace.exec(block.group(1), timeout_s=10)
        messages.append({"role": "user", "content": f"{out.stdout}[exit code {out.exit_code}]"})
    answer = (await workspace.read_file("answer.txt")).decode().strip()
    SEEN.append({"task": task["id"], "before": before.stdout.split(), "answer": answer, "ws": workspace})
    return 1.0 if answer == str(task["a"] + task["b"]) else 0.0


async def solve_plain(task: dict[str, Any], client: Any) -> float:
    return 0.0


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> HFChatTokenizer:
    return HFChatTokenizer.from_pretrained(smollm2_path)


def test_workspace_config_errors() -> None:
    with pytest.raises(ValueError, match="workspace: only in mode in_process"):
        AgentEnvConfig(mode="remote", tasks=TASKS, workspace={"spec": SPEC})
    with pytest.raises(ValueError, match="workdir="):
        AgentEnvConfig(agent=f"{__file__}:solve_shell", tasks=TASKS, workspace={"spec": {"workdir": "rel"}})


@pytest.mark.model
async def test_a_shell_agent_runs_its_commands_in_the_episode_workspace(tokenizer: HFChatTokenizer) -> None:
    seen_by_agent = load_agent(f"{__file__}:solve_shell").__globals__["SEEN"]  # the env loads this file by path
    seen_by_agent.clear()
    engine = ScriptedEngine(ScriptedEngine.Config(logprob=-0.25), tokenizer=tokenizer, reply_fn=shell_reply)
    config = RolloutConfig(group_size=2, groups_per_step=2, max_in_flight=2, max_staleness=4, max_turns=6,
                           max_new_tokens_per_turn=64, max_total_tokens=2048)

    def make() -> AgentEnv:
        return AgentEnv(AgentEnvConfig(agent=f"{__file__}:solve_shell", tasks=TASKS,
                                       workspace={"sandbox": {"name": "local"}, "spec": SPEC}))

    async with RolloutManager(make, TASKS, engine, tokenizer, config) as manager:
        groups = [g async for g in manager.groups()]
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 4
    for traj in trajs:
        assert traj.error is None and traj.reward == 1.0
        assert "ready" in next(m.content for m in traj.messages if m.role == "user" and "exit code" in m.content)
    assert sorted(s["task"] for s in seen_by_agent) == ["t0", "t0", "t1", "t1"]
    for seen in seen_by_agent:
        assert seen["before"][0] == "fresh"  # no episode sees another's answer.txt
        assert seen["before"][2] == "65534"  # the command ran inside the sandbox (nobody), not as the host user
        with pytest.raises(Exception):  # noqa: B017  the workspace is closed once solve returned
            await seen["ws"].exec("true")
    assert {s["answer"] for s in seen_by_agent} == {"42", "15"}


@pytest.mark.model
async def test_a_solve_without_a_workspace_argument_is_a_config_error(tokenizer: HFChatTokenizer) -> None:
    engine = ScriptedEngine(ScriptedEngine.Config(logprob=-0.25), tokenizer=tokenizer, reply_fn=shell_reply)
    env = AgentEnv(AgentEnvConfig(agent=f"{__file__}:solve_plain", tasks=TASKS, workspace={"spec": SPEC}))
    config = RolloutConfig(group_size=1, groups_per_step=1, max_turns=2, max_new_tokens_per_turn=16,
                           max_total_tokens=512)
    try:
        with pytest.raises(ValueError, match="takes no `workspace` argument"):
            await env.drive_episode(TASKS[0], engine, tokenizer, config, seed=0, group_id="g", sample_index=0)
    finally:
        await env.close()


@pytest.mark.model
async def test_a_workspace_whose_setup_fails_fails_the_episode(tokenizer: HFChatTokenizer) -> None:
    engine = ScriptedEngine(ScriptedEngine.Config(logprob=-0.25), tokenizer=tokenizer, reply_fn=shell_reply)
    spec = {**SPEC, "setup": ("exit 3",)}  # the set-up fails: class env (a failed episode), never a zero reward
    env = AgentEnv(AgentEnvConfig(agent=f"{__file__}:solve_shell", tasks=TASKS, workspace={"spec": spec}))
    config = RolloutConfig(group_size=1, groups_per_step=1, max_turns=2, max_new_tokens_per_turn=16,
                           max_total_tokens=512)
    try:
        trajs = await env.drive_episode(TASKS[0], engine, tokenizer, config, seed=0, group_id="g", sample_index=0)
    finally:
        await env.close()
    assert trajs[0].error is not None and trajs[0].error.kind is ErrorClass.ENV
    assert "exit 3" in trajs[0].error.message

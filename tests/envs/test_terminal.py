"""The `terminal` env: bundled tasks, oracle through the env, hidden tests, infrastructure failures."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentrl.envs.terminal import TerminalConfig, TerminalEnv, WorkspaceDied
from agentrl.rollout.episode import classify
from agentrl.types import ErrorClass, Message, ToolCall

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
async def sandbox() -> AsyncIterator[Any]:
    from agentrl.sandboxes.local import LocalConfig, LocalSandbox

    async with LocalSandbox(LocalConfig(pool_size=1)) as sb:
        yield sb


def call(name: str, i: int = 0, **arguments: Any) -> Message:
    return Message(role="assistant", content="", tool_calls=[ToolCall(id=f"c{i}", name=name, arguments=arguments)])


def test_bundled_tasks_and_splits() -> None:
    env = TerminalEnv()
    train, test = list(env.tasks("train")), list(env.tasks("test"))
    assert len(train) + len(test) >= 30 and len(test) >= 8
    assert not {t["id"] for t in train} & {t["id"] for t in test}
    assert [t.name for t in env.tools] == ["bash", "read_file", "write_file", "submit"]
    demos = env.demonstrations()
    assert len(demos) == len(train) and demos[0][2].tool_calls[0].name == "bash"  # type: ignore[index]


def test_few_shot_prompts_show_solved_train_tasks_never_the_task_itself() -> None:
    env = TerminalEnv(TerminalConfig(few_shot=2))
    test_task = next(iter(env.tasks("test")))
    prompt = env.initial_messages(test_task)
    assert [m.role for m in prompt] == ["system", *(["user", "assistant", "tool", "assistant", "tool"] * 2), "user"]
    shots = [prompt[1], prompt[6]]
    shortest = sorted(env.tasks("train"), key=lambda t: (len(env.oracle(t)[0].tool_calls[0].arguments["command"]),  # type: ignore[index]
                                                          t["id"]))
    assert [m.content for m in shots] == [env.harbor_tasks()[t["id"]].instruction.strip() for t in shortest[:2]]
    assert prompt[2].tool_calls == env.oracle(shortest[0])[0].tool_calls  # type: ignore[index]
    assert prompt[-1].content == env.harbor_tasks()[test_task["id"]].instruction.strip()
    first = shortest[0]
    own = env.initial_messages(first)  # a shot task's own prompt shows the next ones instead
    assert own[1].content == env.harbor_tasks()[shortest[1]["id"]].instruction.strip()
    assert own[6].content == env.harbor_tasks()[shortest[2]["id"]].instruction.strip()
    assert len(TerminalEnv().initial_messages(test_task)) == 2  # few_shot defaults to 0


async def test_every_oracle_solves_its_task_through_the_env(sandbox: Any) -> None:
    """reset -> bash(solve.sh) -> submit gives reward 1.0 on every task; doing nothing gives 0.0."""
    env0 = TerminalEnv(sandbox=sandbox)
    tasks = [*env0.tasks("train"), *env0.tasks("test")]
    gate = asyncio.Semaphore(4)

    async def episode(task: dict[str, Any], solve: bool) -> float:
        async with gate:
            env = TerminalEnv(TerminalConfig(tool_timeout_s=120), sandbox=sandbox, resources=env0.resources)
            try:
                messages, _ = await env.reset(task)
                assert messages[-1].content == env.harbor_tasks()[task["id"]].instruction.strip()
                if solve:
                    script = (env.harbor_tasks()[task["id"]].path / "solution" / "solve.sh").read_text()
                    r = await env.step(call("bash", command=script))
                    assert not r.terminated and "[exit code 0]" in r.messages[0].content, r.messages[0].content
                r = await env.step(call("submit", 1))
                assert r.terminated
                return r.reward
            finally:
                await env.close()

    try:
        solved = await asyncio.gather(*(episode(t, True) for t in tasks))
        unsolved = await asyncio.gather(*(episode(t, False) for t in tasks))
    finally:
        await env0.resources.aclose()
    assert dict(zip([t["id"] for t in tasks], solved, strict=True)) == {t["id"]: 1.0 for t in tasks}
    assert set(unsolved) == {0.0}


async def test_tests_are_hidden_and_turns_run_out(sandbox: Any) -> None:
    env = TerminalEnv(TerminalConfig(max_turns=2), sandbox=sandbox)
    try:
        await env.reset({"id": "hello-file"})
        r = await env.step(call("bash", command="ls -A /tests /solution; cat /tests/test.sh; echo done"))
        assert r.messages[0].content.startswith("/solution:\n\n/tests:\ndone\ncat: /tests/test.sh: No such file")
        assert not r.terminated and not r.truncated
        r = await env.step(call("write_file", path="/app/hello.txt", content="Hello, world!\n"))
        assert r.truncated and r.truncation_reason == "max_turns" and r.reward == 1.0  # tests ran anyway
        r2 = await env.read_file("hello.txt")
        assert r2 == "Hello, world!\n"
        # a reply without tool calls also ends the episode with the tests' verdict
        await env.reset({"id": "hello-file"})
        r = await env.step(Message(role="assistant", content="I am done."))
        assert r.terminated and r.reward == 0.0 and r.info["tests_exit_code"] == 0
        out = await env.run_call(ToolCall(id="x", name="read_file", arguments={"path": "/etc/passwd"}))
        assert out.error == "exception" and "outside the workspace" in out.content  # the model's mistake
    finally:
        await env.close()


async def test_a_dead_workspace_is_an_infrastructure_failure(sandbox: Any) -> None:
    env = TerminalEnv(sandbox=sandbox)
    try:
        await env.reset({"id": "hello-file"})
        assert env.ws is not None
        os.killpg(env.ws.pid(), signal.SIGKILL)  # type: ignore[attr-defined]
        with pytest.raises(WorkspaceDied) as info:
            await env.step(call("bash", command="echo hi"))
        assert classify(info.value, ErrorClass.ENV) == ErrorClass.SANDBOX  # retried / group dropped, not a 0
    finally:
        await env.close()
    from agentrl.sandboxes.local_workspace import leftover_dirs

    assert [d for d in leftover_dirs() if not (d / "layer").exists()] == []


async def test_rollout_oracle_and_dead_workspace_through_run_episode(sandbox: Any) -> None:
    """Through the rollout loop: the oracle's episode scores 1.0; a workspace killed mid-episode ends the
    episode with a `sandbox` error (retried / group dropped by the manager), not a scored zero."""
    from agentrl.chat.conversation import SimpleChatTokenizer, hermes_content
    from agentrl.engines.scripted import ScriptedEngine
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.episode import run_episode

    tok = SimpleChatTokenizer()
    env = TerminalEnv(sandbox=sandbox)
    task = {"id": "sum-numbers", "split": "train"}
    script = (env.harbor_tasks()["sum-numbers"].path / "solution" / "solve.sh").read_text()
    kill = {"on": False}

    def policy(prompt: str) -> str:
        if "<|im_start|>tool\n" in prompt:
            if kill["on"]:
                os.killpg(env.ws.pid(), signal.SIGKILL)  # type: ignore[union-attr]
                return hermes_content(call("bash", command="echo hi"))
            return hermes_content(call("submit"))
        return hermes_content(call("bash", command=script))

    engine = ScriptedEngine(ScriptedEngine.Config(), tokenizer=tok, reply_fn=policy)
    try:
        traj = await run_episode(env, task, engine, tok, RolloutConfig(max_turns=6))
        assert traj.error is None, traj.error
        assert traj.terminated and traj.reward == 1.0 and len(traj.turns) == 2
        assert traj.reward_breakdown == {"tests": 1.0, "tests_exit_code": 0.0, "tests_timed_out": 0.0}
        assert "[exit code 0]" in traj.messages[-2].content  # each command's output and exit code, as the tool result
        kill["on"] = True
        traj = await run_episode(env, task, engine, tok, RolloutConfig(max_turns=6))
        assert traj.error is not None and traj.error.kind == ErrorClass.SANDBOX, traj.error
    finally:
        await env.close()


def test_agentrl_eval_oracle_solves_every_held_out_task(tmp_path: Any, tiny_llama_path: str) -> None:
    """`agentrl eval examples/terminal.yaml --oracle`: the tasks' own solve.sh, played as tool calls through the
    env (workspace, hidden tests), scores 1.0 (4 test tasks here; every task's oracle is checked through the env
    above); no model is loaded."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from agentrl.cli import build_app
    from agentrl.store.trajectory_store import TrajectoryStore

    config = Path(__file__).parents[2] / "examples" / "terminal.yaml"
    out = tmp_path / "oracle"
    result = CliRunner().invoke(build_app(), ["eval", str(config), "--oracle", "--tasks", "4", "--out", str(out),
                                              f"model.path={tiny_llama_path}"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["model"] == "oracle" and summary["tasks"] == 4
    assert summary["reward_mean"] == 1.0 and summary["pass@1"] == 1.0 and summary["errors"] == 0.0
    with TrajectoryStore(out / "trajectories.sqlite", readonly=True) as store:
        rows = store.read("SELECT reward, status FROM trajectories")
    assert rows == [(1.0, "eval")] * 4

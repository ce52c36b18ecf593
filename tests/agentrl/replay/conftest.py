"""Fixtures for the replay tests: a realistic synthetic run plus hostile and re-executable trajectories.

`replay_run` is a run directory whose store holds:
- a synthetic multi-turn tool-calling run (3 envs, tool calls, sandbox
  stdout/stderr, errors, truncations, groups of 4, per-step metrics, token stats);
- group "xss-group": a trajectory whose every model-controlled string is HTML
  meant to run script (`XSS_ID`);
- "mul-ok" / "mul-bad": episodes of the `mul_env` plugin (tests/agentrl/replay/
  mul_env_plugin.py) recorded by actually stepping the env; "mul-bad" has a tool
  output and reward tampered with, so re-execution must flag it.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

from agentrl.chat import SimpleChatTokenizer
from agentrl.replay.synthetic import fill_store
from agentrl.store import TrajectoryStore
from agentrl.types import EpisodeError, ErrorClass, Group, Message, ToolCall, Trajectory

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from mul_env_plugin import record_mul_episode, tokenise  # noqa: E402

sys.path.remove(str(HERE))
XSS_ID = "xss-traj"
SCRIPT = "<script>window.__pwned = 1; alert('script')</script>"
IMG = "<img src=x onerror=\"window.__pwned = 2; alert('img')\">"
HOSTILE = f"{SCRIPT} and {IMG} and <svg onload=alert(3)></svg> <a href=javascript:alert(4)>x</a>"


def xss_trajectory(tok: SimpleChatTokenizer) -> Trajectory:
    messages = [
        Message("system", HOSTILE),
        Message("user", f"What is 2+2? {HOSTILE}"),
        Message(
            "assistant", f"Let me try {HOSTILE}", tool_calls=[ToolCall(IMG, {SCRIPT: IMG}, id="<b>id</b>")]
        ),
        Message("tool", HOSTILE, tool_call_id="<b>id</b>", name=SCRIPT),
        Message("assistant", f"Answer: {HOSTILE}"),
    ]
    ids, mask, logprobs, versions, turns = tokenise(tok, messages)
    turns[0].info = {"sandbox": {"stdout": HOSTILE, "stderr": IMG, "exit_code": 1}}
    turns[0].tool_calls = [IMG]
    return Trajectory(
        id=XSS_ID, task_id=f"task {IMG}", env="calculator", group_id="xss-group", messages=messages,
        token_ids=ids, loss_mask=mask, logprobs=logprobs, versions=versions, turns=turns,
        reward=0.5, reward_breakdown={SCRIPT: 0.5}, terminated=True,
        error=EpisodeError(ErrorClass.TOOL, f"tool failed: {HOSTILE}", turn=0),
        task={"question": HOSTILE}, info={"note": HOSTILE},
    )  # fmt: skip


def build_run(run_dir: Path) -> dict[str, object]:
    tok = SimpleChatTokenizer()
    with TrajectoryStore(run_dir) as store:
        groups = fill_store(store, steps=6, groups_per_step=5, group_size=4, seed=3)
        store.set_run_config(
            {
                "run": {"name": "replay-test", "steps": 6},
                "model": {"path": "synthetic"},
                "env": {"name": "mul", "bonus": 0.5},
                "plugins": ["mul_env_plugin"],
                "replay": {"tokenizer": "simple"},
            }
        )
        xss = xss_trajectory(tok)
        store.add_group(
            Group(task_id=xss.task_id, trajectories=[xss], id="xss-group"), step=6, status="trained"
        )
        ok = asyncio.run(record_mul_episode("mul-ok", 6, 7))
        bad = asyncio.run(record_mul_episode("mul-bad", 6, 7))
        bad.messages[2].content = "41"  # the tool said 42
        bad.reward = 2.0
        store.add_group(
            Group(task_id=ok.task_id, trajectories=[ok, bad], id="mul-group"), step=6, status="eval"
        )
        # strip the trainer stats from one synthetic trajectory: its token view must say n/a
        bare = groups[0].trajectories[1]
        bare_copy = Trajectory.from_dict({**bare.to_dict(), "id": "no-stats", "info": {}, "group_id": "bare"})
        store.add_trajectory(bare_copy, step=1, status="dropped")
    return {"groups": groups}


@pytest.fixture(scope="session")
def replay_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("replay-run")
    build_run(run_dir)
    shutil.copy(HERE / "mul_env_plugin.py", run_dir / "mul_env_plugin.py")
    return run_dir


@pytest.fixture(scope="session")
def mul_plugin_dir() -> Path:
    """A directory holding the `mul_env_plugin` module (put it on sys.path / cwd to use it)."""
    return HERE

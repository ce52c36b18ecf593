"""Fixtures for the replay tests: a realistic synthetic run plus hostile and re-executable trajectories.

`replay_run` is a run directory whose store holds:
- a synthetic multi-turn tool-calling run (3 envs, tool calls, sandbox
  stdout/stderr, errors, truncations, groups of 4, per-step metrics, token stats);
- group "xss-group": a trajectory whose every model-controlled string is HTML
  meant to run script (`XSS_ID`);
- "mul-ok" / "mul-bad": episodes of the `mul_env` plugin (tests/agentrl/replay/
  mul_env_plugin.py) recorded by actually stepping the env; "mul-bad" has a tool
  output and reward tampered with, so re-execution must flag it.

`calculator_run` is a real run: a few steps of the README's main job (SmolLM2-135M
on examples/calculator.yaml), trained once per session.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.replay.server import serve_in_thread
from agentrl.replay.synthetic import fill_store
from agentrl.store.trajectory_store import TrajectoryStore
from agentrl.types import EpisodeError, ErrorClass, Group, Message, ToolCall, Trajectory

HERE = Path(__file__).parent
REPO = HERE.parents[2]
CALCULATOR_CI = (
    "run.steps=2", "run.eval_every=2", "run.eval_tasks=4", "run.save_every=2", "run.loggers=[jsonl]",
    "rollout.group_size=4", "rollout.groups_per_step=2",
)  # fmt: skip
"""The CI variant of the README's main job: the example as it is (SmolLM2-135M, two few-shot
demonstrations in every prompt, the calculator tool), with fewer and smaller steps."""
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


@pytest.fixture(scope="session")
def calculator_run(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> Path:
    """A real run directory, made once per session: `agentrl train examples/calculator.yaml` + `CALCULATOR_CI`."""
    out = tmp_path_factory.mktemp("calculator-run")
    cmd = [
        sys.executable, "-m", "agentrl.cli", "train", str(REPO / "examples" / "calculator.yaml"),
        f"model.path={smollm2_path}", f"run.output_dir={out}", "run.name=calculator", *CALCULATOR_CI,
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=out, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "calculator"


# --------------------------------------------------------------------------- browser

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


@pytest.fixture(scope="session")
def serve_store() -> Callable[[Path], AbstractContextManager[str]]:
    """`with serve_store(path) as url:` the replay server over a store, in a thread."""
    return serve_in_thread


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed: run .ci/setup_browser.sh")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 820})
    pg = context.new_page()
    pg.dialogs = []  # type: ignore[attr-defined]
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))  # type: ignore[attr-defined]
    pg.console_errors = []  # type: ignore[attr-defined]
    pg.on("console", lambda m: pg.console_errors.append(m.text) if m.type == "error" else None)  # type: ignore[attr-defined]
    pg.on("pageerror", lambda e: pg.console_errors.append(str(e)))  # type: ignore[attr-defined]
    yield pg
    context.close()

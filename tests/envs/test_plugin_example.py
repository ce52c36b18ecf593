"""examples/plugin-example: installed as a real package, found through its entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "plugin-example"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """`pip install` the example into a private target dir; the env to run with it."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(EXAMPLE)],
        check=True, capture_output=True, text=True, timeout=300, cwd=build,
    )
    assert any(p.name.startswith("agentrl_guess-") and p.suffix == ".dist-info" for p in target.iterdir())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")])
    return env


def run(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_cli_lists_the_plugin_env_and_tool(installed: dict[str, str]) -> None:
    envs = run(installed, sys.executable, "-m", "agentrl.cli", "list", "envs")
    assert "guess_number" in envs and "higher/lower" in envs
    tools = run(installed, sys.executable, "-m", "agentrl.cli", "list", "tools")
    assert "midpoint" in tools


def test_plugin_env_and_tool_work_through_the_registry(installed: dict[str, str]) -> None:
    script = """
import asyncio
from agentrl import Plugins, Message
from agentrl.envkit.check import check_env

plugins = Plugins.discover()
env = plugins.create_env("guess_number", {"high": 16, "max_guesses": 4})
report = check_env(env)
midpoint = plugins.tools.get("midpoint")

async def play():
    task = next(iter(env.tasks("test")))
    await env.reset(task)
    low, high = 1, 16
    for turn in range(4):
        guess = int(await midpoint.call({"low": low, "high": high}))
        result = await env.step(Message(role="assistant", content=str(guess)))
        if result.terminated:
            return result.reward
        if result.info["hint"] == "higher":
            low = guess + 1
        else:
            high = guess - 1
    return -1.0

print("episodes", report.episodes, "reward", asyncio.run(play()))
try:
    plugins.create_env("guess_number", {"hihg": 3})
except Exception as e:
    print("error", e)
"""
    out = run(installed, sys.executable, "-c", script)
    assert "episodes 2" in out
    reward = float(out.split("reward ")[1].split()[0])
    assert reward >= 0.25  # binary search over 16 numbers finds it within 4 guesses
    assert "hihg" in out.split("error", 1)[1]


def test_agentrl_train_runs_steps_on_the_plugin_env(
    installed: dict[str, str], tiny_llama_path: str, tmp_path: Path
) -> None:
    """The README's `agentrl train` on the plugin's YAML, shrunk: tiny random model, 2 steps."""
    out = run(
        installed, sys.executable, "-m", "agentrl.cli", "train", str(EXAMPLE / "guess.yaml"),
        f"model.path={tiny_llama_path}", f"run.output_dir={tmp_path}", "run.steps=2", "run.eval_every=0",
        "rollout.group_size=2", "rollout.groups_per_step=1", "rollout.max_turns=2",
        "rollout.max_new_tokens_per_turn=8",
    )
    run_dir = tmp_path / "guess-number"
    assert str(run_dir) in out and (run_dir / "checkpoints" / "step-000002").is_dir()
    metrics = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) >= 2

    from agentrl.replay.queries import TrajectoryQueries

    with TrajectoryQueries.open(run_dir / "trajectories.sqlite") as queries:
        rows = queries.query(limit=100)
        assert rows and {r["env"] for r in rows} == {"guess_number"}
        trajectory = queries.store.get_trajectory(str(rows[0]["id"]))
        assert trajectory.messages[0].content.startswith("I picked an integer between 1 and 20")
        assert trajectory.num_sampled_tokens > 0

"""The `agentrl` command: help everywhere, list, check-env, config show, train, clean errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from agentrl.cli import build_app
from agentrl.store.trajectory_store import TrajectoryStore

PLUGIN_SOURCE = '''
import agentrl
from typing import Literal
from agentrl.env import Env, EnvConfig, StepResult
from agentrl.types import Message


@agentrl.env("cli_echo")
class CliEcho(Env):
    """Echo env used by the CLI tests."""

    class Config(EnvConfig):
        mode: Literal["upper", "lower"] = "upper"

    def tasks(self, split="train"):
        return [{"id": str(i)} for i in range(3)]

    async def reset(self, task, *, seed=None):
        return [Message(role="user", content="say " + task["id"])], {}

    async def step(self, action):
        return StepResult(messages=[], reward=1.0, terminated=True)


@agentrl.env("cli_broken")
class CliBroken(CliEcho):
    """Returns an int as `terminated`."""

    async def step(self, action):
        return StepResult(messages=[], reward=1.0, terminated=1)


@agentrl.plugin("engines", "cli_engine")
class CliEngine:
    """An engine without parameters."""
'''


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"cli_plugins_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(build_app(), list(args))
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_help_everywhere() -> None:
    for args in ([], ["--help"], ["list", "--help"], ["check-env", "--help"], ["config", "--help"],
                 ["config", "show", "--help"], ["config", "explain", "--help"], ["config", "diff", "--help"],
                 ["train", "--help"]):
        code, out = invoke(*args)
        assert code in (0, 2) and "Usage" in out, args
    code, out = invoke("--help")
    for command in ("list", "check-env", "config", "train"):
        assert command in out


def test_real_console_script_help() -> None:
    script = Path(sys.executable).parent / "agentrl"
    assert script.exists(), "the `agentrl` console script is not installed in this environment"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, check=True)
    assert "Usage: agentrl" in out.stdout and "check-env" in out.stdout


def test_list_shows_decorated_and_entry_point_plugins(plugin_module: str) -> None:
    code, out = invoke("list", "envs", "--plugin", plugin_module)
    assert code == 0
    assert "cli_echo" in out and "Echo env used by the CLI tests." in out
    code, out = invoke("list", "engine", "-p", plugin_module, "--sources")  # singular works too
    assert code == 0 and "cli_engine" in out and f"module {plugin_module}" in out
    code, out = invoke("list", "-p", plugin_module)
    assert code == 0
    for kind in ("envs", "tools", "rewards", "sandboxes", "engines", "trainers", "tool_parsers"):
        assert kind in out


def test_list_unknown_kind_is_one_red_line() -> None:
    code, out = invoke("list", "widgets")
    assert code == 2
    assert out.strip() == (
        "error: unknown plugin kind 'widgets' (kinds: envs, tools, rewards, sandboxes, engines, "
        "trainers, tool_parsers)"
    )


def test_check_env_ok_bad_params_and_failures(plugin_module: str) -> None:
    code, out = invoke("check-env", "cli_echo", "-p", plugin_module, "--param", "mode=lower")
    assert code == 0 and "ok: env 'cli_echo' passed" in out
    code, out = invoke("check-env", "cli_echo", "-p", plugin_module, "-P", "mode=shout")
    assert code == 2 and out.strip() == "error: env.mode: got 'shout'; Input should be 'upper' or 'lower'"
    code, out = invoke("check-env", "cli_ecoh", "-p", plugin_module)
    assert code == 2 and "did you mean 'cli_echo'?" in out
    code, out = invoke("check-env", "cli_broken", "-p", plugin_module)
    assert code == 1 and "terminated must be a bool, got int 1" in out


def write_config(tmp_path: Path, plugin_module: str, **extra: object) -> Path:
    path = tmp_path / "run.yaml"
    config = {
        "plugins": [plugin_module],
        "env": {"name": "cli_echo"},
        "engine": {"name": "cli_engine"},
        "trainer": {"name": "agentrl.trainers.torch_trainer:TorchTrainer"},
        **extra,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_config_show_resolves_everything(tmp_path: Path, plugin_module: str) -> None:
    path = write_config(tmp_path, plugin_module)
    code, out = invoke("config", "show", str(path), "rollout.group_size=3", "env.mode=lower")
    assert code == 0, out
    shown = yaml.safe_load(out)
    assert shown["env"] == {"name": "cli_echo", "mode": "lower"}
    assert shown["rollout"]["group_size"] == 3
    assert shown["rollout"]["max_staleness"] == 1  # defaults are filled in
    assert shown["trainer"]["advantage"] == "grpo"
    (tmp_path / "shown.yaml").write_text(out)
    code, again = invoke("config", "show", str(tmp_path / "shown.yaml"))
    assert code == 0 and again == out


def test_config_errors_are_clean(tmp_path: Path, plugin_module: str) -> None:
    path = write_config(tmp_path, plugin_module)
    code, out = invoke("config", "show", str(path), "rollout.max_staleness=-2")
    assert code == 2
    assert out.strip() == "error: rollout.max_staleness: got -2; Input should be greater than or equal to 0"
    code, out = invoke("config", "show", str(tmp_path / "nope.yaml"))
    assert code == 2 and out.startswith("error: cannot read config")


def test_train_validates_before_starting(tmp_path: Path, plugin_module: str) -> None:
    path = write_config(tmp_path, plugin_module)
    code, out = invoke("train", str(path), "run.steps=0")
    assert code == 2
    assert out.strip() == "error: run.steps: got 0; Input should be greater than or equal to 1"


def test_train_with_a_model_that_cannot_be_had_is_one_line_and_leaves_no_run(
    tmp_path: Path, plugin_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_config(tmp_path, plugin_module, run={"output_dir": str(tmp_path / "runs")})
    code, out = invoke("train", str(path), f"model.path={tmp_path / 'no-such-model'}")
    assert code == 2
    assert out.startswith("error: model ") and "neither a local directory nor a built-in alias" in out
    assert not (tmp_path / "runs").exists()  # nothing was made before the model failed


def test_train_calls_the_loop_with_config_and_resume(
    tmp_path: Path, plugin_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    calls = []

    async def fake_train(config: object, *, resume: Path | None = None) -> Path:
        calls.append((config, resume))
        return tmp_path / "runs" / "r1"

    monkeypatch.setitem(sys.modules, "agentrl.run.loop", types.SimpleNamespace(train=fake_train))
    path = write_config(tmp_path, plugin_module)
    code, out = invoke("train", str(path), "run.steps=3", "--resume", str(tmp_path / "runs" / "r0"))
    assert code == 0, out
    assert f"run directory: {tmp_path / 'runs' / 'r1'}" in out
    (config, resume), = calls
    assert config.run.steps == 3 and config.env.name == "cli_echo"  # type: ignore[attr-defined]
    assert resume == tmp_path / "runs" / "r0"


def test_train_without_a_loop_says_so(tmp_path: Path, plugin_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "agentrl.run.loop", None)
    code, out = invoke("train", str(write_config(tmp_path, plugin_module)))
    assert code == 2 and out.startswith("error: agentrl train is not available in this install")


def test_contributed_commands_get_clean_errors_too(tmp_path: Path) -> None:
    """`plot`, `eval`, `show`, `sandbox ...` come from other modules; their user errors are one line too."""
    code, out = invoke("plot", str(tmp_path))
    assert code == 2 and out.strip() == f"error: no metrics in {tmp_path / 'metrics.jsonl'}"
    config = tmp_path / "run.yaml"
    config.write_text("env: calculator\n")
    code, out = invoke("eval", str(config), "--checkpoint", str(tmp_path))
    assert code == 2 and out.strip() == f"error: --checkpoint {tmp_path}: neither a checkpoint nor a model directory"


def test_eval_with_a_scripted_engine_stores_episodes_to_look_at(tmp_path: Path, tiny_llama_path: str) -> None:
    """The model-free dev loop: canned replies through the real env and reward, then `agentrl show`."""
    config = tmp_path / "run.yaml"
    config.write_text(f"env: calculator\nmodel: {{path: {tiny_llama_path}}}\n")
    out = tmp_path / "dev"
    code, text = invoke("eval", str(config), "engine={name: scripted, replies: ['Answer: 42']}",
                        "--tasks", "2", "--out", str(out))
    assert code == 0, text
    summary = json.loads(text)
    assert summary["tasks"] == 2 and summary["errors"] == 0.0
    with TrajectoryStore(out / "trajectories.sqlite", readonly=True) as store:
        assert store.count() == 2
    code, text = invoke("show", str(out), "--no-tokens")
    assert code == 0 and "Answer: 42" in text and "eval" in text


def test_eval_on_a_split_the_env_does_not_have_is_one_line(tmp_path: Path, tiny_llama_path: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"env: calculator\nmodel: {{path: {tiny_llama_path}}}\nengine: scripted\n")
    code, text = invoke("eval", str(config), "run.eval_split=tset")
    assert code == 2
    assert text.strip() == "error: run.eval_split: split 'tset': calculator: unknown split 'tset'; available: train, test"
    config.write_text(f"env: {{name: math, test_size: 0}}\nmodel: {{path: {tiny_llama_path}}}\nengine: scripted\n")
    code, text = invoke("eval", str(config))
    assert code == 2 and text.strip() == "error: run.eval_split: env 'math' has no tasks in split 'test'"

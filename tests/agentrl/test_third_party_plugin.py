"""A third-party package (tests/plugins/agentrl_hello) installed with pip is found by `agentrl list`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "agentrl_hello"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """pip-install the plugin (a real wheel build) into a target dir; return the env to see it."""
    tmp = tmp_path_factory.mktemp("hello")
    source, target = tmp / "src", tmp / "site"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--target", str(target), str(source)],
        cwd=tmp,
    )
    assert list(target.glob("agentrl_hello-*.dist-info"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["COLUMNS"] = "200"
    return env


def _agentrl(*args: str, env: dict[str, str], cwd: Path) -> str:
    script = Path(sys.executable).parent / "agentrl"
    return _run([str(script), *args], cwd=cwd, env=env)


@pytest.mark.slow
def test_list_shows_the_plugins_env_and_tool(installed: dict[str, str], tmp_path: Path) -> None:
    envs = _agentrl("list", "envs", "--sources", env=installed, cwd=tmp_path)
    assert "hello" in envs and "Greet the person by name" in envs and "agentrl-hello" in envs
    tools = _agentrl("list", "tools", env=installed, cwd=tmp_path)
    assert "greet" in tools and "Return a friendly greeting" in tools
    # Without the install, neither is there.
    plain = _agentrl("list", "envs", env={k: v for k, v in installed.items() if k != "PYTHONPATH"}, cwd=tmp_path)
    assert "hello" not in plain


@pytest.mark.slow
def test_the_plugins_env_passes_check_env_and_its_tool_loads(installed: dict[str, str], tmp_path: Path) -> None:
    out = _agentrl("check-env", "hello", "--param", "names=[Ada, Linus]", env=installed, cwd=tmp_path)
    assert "ok: env 'hello' passed: 2 tasks" in out
    if importlib.util.find_spec("agentrl.tools") is None:
        pytest.skip("agentrl.tools is not there yet: the tool cannot be loaded")
    code = (
        "import asyncio\n"
        "from agentrl.registry import Plugins\n"
        "tool = Plugins.discover().tools.get('greet')\n"
        "print(tool.schema()['function']['name'], asyncio.run(tool.call({'name': 'Ada'})))\n"
    )
    assert _run([sys.executable, "-c", code], cwd=tmp_path, env=installed).strip() == "greet Hello, Ada!"

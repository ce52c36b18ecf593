"""Importing agentrl and its core modules, or discovering plugins, never imports torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

CORE = [
    "agentrl",
    "agentrl.types",
    "agentrl.registry",
    "agentrl.env",
    "agentrl.tools",
    "agentrl.chat.conversation",
    "agentrl.store.trajectory_store",
    "agentrl.config",
    "agentrl.errors",
    "agentrl.envkit.rewards",
    "agentrl.rollout.config",
    "agentrl.envkit.check",
    "agentrl.envkit.gym_bridge",
    "agentrl.envkit.gym_export",
    "agentrl.chat.tokenizers",
    "agentrl.run.resources",
    "agentrl.plugin_entry",
    "agentrl.cli",
    "agentrl.trainers.config",
]


def _existing(modules: list[str]) -> list[str]:
    """Modules that exist today (others are listed above and checked once they do)."""
    out = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is not None:
                out.append(name)
        except ModuleNotFoundError:
            pass
    return out


def _run(code: str) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


def test_core_modules_do_not_import_torch() -> None:
    modules = _existing(CORE)
    assert "agentrl.registry" in modules and "agentrl.config" in modules
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}))"
    )
    assert _run(code) == {"torch": False, "transformers": False}


def test_discovering_plugins_and_building_the_cli_do_not_import_torch() -> None:
    code = (
        "import json, sys\n"
        "from agentrl.registry import Plugins, KINDS\n"
        "from agentrl.cli import build_app\n"
        "plugins = Plugins.discover()\n"
        "names = {k: plugins.registry(k).names() for k in KINDS}\n"
        "build_app()\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'engines': names['engines']}))"
    )
    result = _run(code)
    assert result["torch"] is False
    if not result["engines"]:
        pytest.skip("no engine entry points installed")

"""The gateway, its CLI and the agent env are core: importing them never imports torch or transformers."""

from __future__ import annotations

import json
import subprocess
import sys


def test_gateway_modules_do_not_import_torch() -> None:
    modules = ["agentrl.gateway", "agentrl.gateway.cli", "agentrl.envs.agent"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"torch": False, "transformers": False}

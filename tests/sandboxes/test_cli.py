"""`agentrl sandbox run` / `build-image` through typer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agentrl.sandboxes.cli import register


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_run_prints_output_and_exit_status(app: typer.Typer, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint(sys.stdin.read().upper())\n")
    result = CliRunner().invoke(app, ["sandbox", "run", str(script), "--stdin", "abc"])
    assert result.exit_code == 0, result.output
    assert "ABC" in result.output

    result = CliRunner().invoke(app, ["sandbox", "run", "-", "--json", "--timeout", "0.5",
                                      "--set", "pool_size=1"], input="import time\ntime.sleep(5)\n")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["status"] == "timeout"


def test_bad_options_are_named(app: typer.Typer, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print(1)")
    result = CliRunner().invoke(app, ["sandbox", "run", str(script), "--set", "novalue"])
    assert result.exit_code != 0 and "key=value" in result.output
    result = CliRunner().invoke(app, ["sandbox", "build-image", "--method", "magic"])
    assert result.exit_code != 0 and "magic" in result.output


def test_bad_input_is_one_error_line_through_agentrl(tmp_path: Path) -> None:
    """Through the real `agentrl` app: a bad backend, param or file is one red line, exit code 2."""
    from agentrl.cli import build_app

    script = tmp_path / "s.py"
    script.write_text("print(1)")
    cases = {
        ("--backend", "lokal"): "error: unknown sandbox 'lokal'; did you mean 'local'?",
        ("--set", "pool_sise=2"): "error: sandbox.pool_sise: unknown key; did you mean 'pool_size'?",
    }
    for options, error in cases.items():
        result = CliRunner().invoke(build_app(), ["sandbox", "run", str(script), *options])
        assert result.exit_code == 2 and result.output.startswith(error), result.output
        assert "Traceback" not in result.output
    result = CliRunner().invoke(build_app(), ["sandbox", "run", str(tmp_path / "missing.py")])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: cannot read {tmp_path / 'missing.py'}: No such file or directory"

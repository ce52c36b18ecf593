"""`agentrl show` and `agentrl replay --check` from the terminal."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agentrl.replay.cli import register

HOSTILE_MARKUP = "[bold red]not markup[/bold red]"


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps typer in multi-command mode
        """Nothing."""

    return app


def test_show_prints_conversation_and_masked_tokens(app: typer.Typer, replay_run: Path) -> None:
    result = CliRunner().invoke(app, ["show", str(replay_run), "--id", "mul-ok"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "What is 6 times 7? (seed 7)" in out and "multiply" in out and "Answer: 42" in out
    assert "tokens (" in out and "tokenizer simple" in out
    assert "<|im_start|>assistant" in out  # decoded token text


def test_show_colours_sampled_tokens_only(app: typer.Typer, replay_run: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["show", str(replay_run), "--id", "mul-ok"],
        env={"COLUMNS": "200", "FORCE_COLOR": "1", "TERM": "xterm"},
    )
    assert result.exit_code == 0, result.output
    out = result.output
    tokens = out[out.index("tokens (") :]
    sampled, env = "\x1b[1;30;42m", "\x1b[2m"  # bold on green / dim
    assert sampled + "A" + "\x1b[0m" + sampled + "n" in tokens  # the model's "Answer"
    assert env + "W" + "\x1b[0m" + env + "h" in tokens  # the user's "What"
    assert sampled + "a" + "\x1b[0m" + sampled + "s" not in tokens  # "<|im_start|>assistant" is prompt


def test_show_defaults_to_newest_and_lists(app: typer.Typer, replay_run: Path) -> None:
    newest = CliRunner().invoke(app, ["show", str(replay_run), "--no-tokens"], env={"COLUMNS": "200"})
    assert newest.exit_code == 0 and "no-stats" in newest.output
    listed = CliRunner().invoke(app, ["show", str(replay_run), "--list", "5"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and "no-stats" in listed.output and "mul-bad" in listed.output


def test_show_prints_model_text_literally(app: typer.Typer, replay_run: Path) -> None:
    result = CliRunner().invoke(app, ["show", str(replay_run), "--id", "xss-traj", "--no-tokens"])
    assert result.exit_code == 0, result.output
    assert "<script>window.__pwned = 1;" in result.output.replace("\n", "")


def test_show_errors(app: typer.Typer, replay_run: Path, tmp_path: Path) -> None:
    missing = CliRunner().invoke(app, ["show", str(replay_run), "--id", "nope"])
    assert missing.exit_code == 2 and "nope" in missing.output
    nostore = CliRunner().invoke(app, ["show", str(tmp_path)])
    assert nostore.exit_code == 2 and "no trajectory store" in nostore.output
    colour = CliRunner().invoke(app, ["show", str(replay_run), "--colour", "rainbow"])
    assert colour.exit_code == 2 and "rainbow" in colour.output


def test_check_from_the_terminal(
    app: typer.Typer, replay_run: Path, mul_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(mul_plugin_dir)
    ok = CliRunner().invoke(
        app, ["replay", str(replay_run), "--check", "--id", "mul-ok"], env={"COLUMNS": "200"}
    )
    assert ok.exit_code == 0, ok.output
    assert "mul-ok: reproduces" in ok.output
    bad = CliRunner().invoke(
        app, ["replay", str(replay_run), "--check", "--id", "mul-bad"], env={"COLUMNS": "200"}
    )
    assert bad.exit_code == 1, bad.output
    assert "does NOT reproduce" in bad.output and "'41'" in bad.output and "'42'" in bad.output
    noid = CliRunner().invoke(app, ["replay", str(replay_run), "--check"])
    assert noid.exit_code == 2 and "--id" in noid.output


def test_show_upgrades_an_older_store_and_prints_the_prompt_as_the_prompt(
    app: typer.Typer, tmp_path: Path
) -> None:
    store = tmp_path / "trajectories.sqlite"
    store.write_bytes((Path(__file__).parents[1] / "data" / "store_v1.sqlite").read_bytes())  # schema 1
    listed = CliRunner().invoke(app, ["show", str(tmp_path), "--list", "20"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0, listed.output
    assert "upgraded" in listed.output and "from store schema 1" in listed.output
    rows = [line for line in listed.output.splitlines() if "calculator" in line and "│" in line]
    assert len(rows) == 10
    assert all(line.split("│")[7].strip() == "2" and line.split("│")[8].strip() == "1" for line in rows), rows
    assert not any("Eli has 76" in line for line in rows)  # the first demonstration is no preview

    one = CliRunner().invoke(app, ["show", str(tmp_path), "--no-tokens"], env={"COLUMNS": "200"})
    assert one.exit_code == 0, one.output
    assert "prompt: 8 few-shot demonstration messages" in one.output and "Eli has 76" not in one.output
    assert "prompt (task)" in one.output and "turn 0" in one.output and "turn 1" in one.output
    full = CliRunner().invoke(app, ["show", str(tmp_path), "--no-tokens", "--demos"], env={"COLUMNS": "200"})
    assert "Eli has 76" in full.output and "prompt (demonstration)" in full.output

"""`agentrl eval`: its episodes and metrics land in the store under the step of the policy evaluated."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from agentrl.cli import build_app
from agentrl.store.trajectory_store import TrajectoryStore

SCRIPTED = "engine={name: scripted, replies: ['Answer: 42']}"


def _eval(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(build_app(), ["eval", *args])
    assert result.exit_code == 0, result.output
    summary: dict[str, object] = json.loads(result.output)
    return summary


def _checkpoint(run: Path, step: int, model: str) -> Path:
    """RUN/checkpoints/step-N as the loop writes it: the HF model dir and the loop's step in extra_state.json."""
    ckpt = run / "checkpoints" / f"step-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "model").symlink_to(model)
    (ckpt / "extra_state.json").write_text(json.dumps({"step": step}))
    return ckpt


def test_eval_of_a_checkpoint_stores_its_episodes_and_metrics_at_the_checkpoints_step(
    tmp_path: Path, tiny_llama_path: str
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"env: calculator\nmodel: {{path: {tiny_llama_path}}}\n")
    run = tmp_path / "run"
    ckpt = _checkpoint(run, 3, tiny_llama_path)
    summary = _eval(str(config), SCRIPTED, "--checkpoint", str(ckpt), "--tasks", "2")
    assert summary["step"] == 3
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        rows = store.read("SELECT step, status FROM trajectories")
        assert rows == [(3, "eval"), (3, "eval")]
        metrics = dict(store.metrics())
    assert set(metrics) == {3}
    assert metrics[3]["eval/reward_mean"] == summary["reward_mean"]
    assert metrics[3]["eval/pass@1"] == summary["pass@1"]  # what the replay overview's held-out curve reads


def test_eval_of_a_model_without_a_checkpoint_is_the_policy_before_training(
    tmp_path: Path, tiny_llama_path: str
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"env: calculator\nmodel: {{path: {tiny_llama_path}}}\n")
    out = tmp_path / "dev"
    summary = _eval(str(config), SCRIPTED, "--tasks", "2", "--out", str(out))
    assert summary["step"] == 0
    with TrajectoryStore(out / "trajectories.sqlite", readonly=True) as store:
        assert store.read("SELECT DISTINCT step, status FROM trajectories") == [(0, "eval")]
        assert dict(store.metrics())[0]["eval/errors"] == 0.0


def test_eval_oracle_of_an_env_without_one_names_the_env(tmp_path: Path, tiny_llama_path: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"env: calculator\nmodel: {{path: {tiny_llama_path}}}\n")
    result = CliRunner().invoke(build_app(), ["eval", str(config), "--oracle", "--tasks", "2"])
    assert result.exit_code == 2, result.output
    assert "env 'calculator' has no oracle for task" in result.output

"""End-to-end `agentrl train` on the example configs with a tiny random model.

These are the CI variants of the examples: the full pipeline (env, hf engine,
rollout manager, torch trainer, weight sync, store, metrics, checkpoints) runs
for a few steps. A random 2-layer model never earns a task reward, so a small
entropy bonus supplies the gradient that shows the trainer really updates the
parameters the engine then serves.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agentrl.store.trajectory_store import TrajectoryStore

pytestmark = [pytest.mark.slow, pytest.mark.model]

REPO = Path(__file__).resolve().parents[3]


def _train_cmd(config: str, run_dir: Path, model: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "agentrl.cli", "train", str(REPO / "examples" / config),
        f"model.path={model}", f"run.output_dir={run_dir}", "run.name=ci",
        "engine.dtype=fp32", "trainer.dtype=fp32", *extra,
    ]  # fmt: skip


CALCULATOR_FAST = (
    "run.steps=3", "run.eval_every=3", "run.eval_tasks=4", "run.save_every=3", "run.loggers=[jsonl]",
    "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=12",
    "rollout.max_turns=2", "warm_start.steps=2", "warm_start.batch_size=2", "trainer.entropy_coef=0.01",
)


def _undocumented(rows: list[dict[str, float]]) -> list[str]:
    """Metric keys of a run that docs/metrics.md does not list (`<...>` in a key there matches any name)."""
    documented = re.findall(r"^\| `([^`]+)`", (REPO / "docs" / "metrics.md").read_text(), re.MULTILINE)
    patterns = [re.compile(".+".join(map(re.escape, re.split(r"<[^>]+>", key))) + "$") for key in documented]
    keys = {key for row in rows for key in row} - {"step", "time"}
    return sorted(key for key in keys if not any(p.match(key) for p in patterns))


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _train(config: str, tmp_path: Path, model: str, *extra: str) -> tuple[Path, list[dict[str, float]]]:
    """`agentrl train` on an example with overrides; it must succeed. The run directory and its metric rows."""
    proc = subprocess.run(
        _train_cmd(config, tmp_path, model, *extra), capture_output=True, text=True, timeout=900, env=_env(), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "ci"
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_calculator_fast_variant_trains(tmp_path: Path, tiny_llama_path: str) -> None:
    run, rows = _train("calculator.yaml", tmp_path, tiny_llama_path, *CALCULATOR_FAST)
    rl_rows = [r for r in rows if r["step"] >= 1 and "grad_norm" in r]
    assert [r["step"] for r in rl_rows] == [1, 2, 3]
    assert all(0 < r["time/weight_sync_s"] < r["time/step_s"] for r in rl_rows)
    # LoRA in one process: the engine samples with the trainer's frozen base, a sync sends the adapter alone
    # (the tiny model's r=16 adapter: 0.125 MiB, not its ~12 MiB merged weights), one bucket, every step
    assert 0 < rl_rows[0]["weight_sync/mb"] < 1
    assert all(r["memory/engine/weights_mb"] < 0.1 * r["memory/trainer/weights_mb"] for r in rl_rows)
    assert all(0 < r["memory/rss_mb"] <= r["memory/peak_rss_mb"] for r in rl_rows)
    assert all(r["weight_sync/mb"] == pytest.approx(rl_rows[0]["weight_sync/mb"]) for r in rl_rows)
    assert all(r["weight_sync/buckets"] == 1 and r["weight_sync/mb_per_s"] > 0 for r in rl_rows)
    assert _undocumented(rows) == [], "metric keys missing from docs/metrics.md"
    prefilled = [r["rollout/engine/prefill_tokens"] for r in rl_rows]  # the hf engine's stats(), run-long
    assert 0 < prefilled[0] < prefilled[1] < prefilled[2]
    assert all(0 <= r["rollout/engine/prefix_cache_hit_share"] <= 1 for r in rl_rows)
    assert any(r["grad_norm"] > 0 for r in rl_rows), "no RL step had a non-zero gradient"
    assert all(
        0 <= r["rollout/retokenization_drift_mean"] <= r["rollout/retokenization_drift_max"] <= 1
        and 0 <= r["rollout/retokenization_drift_share"] <= 1
        for r in rl_rows
    )
    assert any(r["step"] == 0 and "eval/reward_mean" in r for r in rows)
    sft = [r for r in rows if "sft/loss" in r]
    assert len(sft) == 2 and all(r["sft/loss"] > 0 and r["sft/grad_norm"] > 0 for r in sft)
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = [r for r in store.iter_records() if r.status == "trained"]
        assert len(trained) == 3 * 2 * 4
        assert all(sum(r.trajectory.loss_mask) > 0 for r in trained)
        # recorded on every episode; a random model samples non-canonical token sequences,
        # so here (unlike in the golden template tests) it need not be 0
        assert all(0.0 <= r.trajectory.metrics["retokenization_drift"] <= 1.0 for r in trained)
    checkpoint = run / "checkpoints" / "step-000003"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    assert model.config.num_hidden_layers == 2
    asyncio.run(_replay_serves_the_run(run))
    _plot_and_eval_the_run(run, checkpoint)


def _plot_and_eval_the_run(run: Path, checkpoint: Path) -> None:
    """`agentrl plot` draws the curves; `agentrl eval --checkpoint` scores and records into the run."""
    plotted = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "plot", str(run)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        before = sum(r.status == "eval" and r.step == 3 for r in store.iter_records())  # the loop's own eval
    evaluated = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "eval", str(REPO / "examples" / "calculator.yaml"),
         "--checkpoint", str(checkpoint), "--samples", "2", "--tasks", "3",
         "engine.dtype=fp32", "rollout.max_new_tokens_per_turn=8", "rollout.max_turns=2"],
        capture_output=True, text=True, timeout=600, env=_env(),
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    summary = json.loads(evaluated.stdout)
    assert summary["tasks"] == 3 and summary["samples"] == 2
    assert 0.0 <= summary["reward_mean"] <= 1.0 and {"pass@1", "pass@2"} <= summary.keys()
    assert json.loads((run / "eval.json").read_text())[-1] == summary
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        at_3 = sum(r.status == "eval" and r.step == 3 for r in store.iter_records())
        assert at_3 - before == 3 * 2  # agentrl eval's episodes, under the evaluated checkpoint's step
        assert not [r for r in store.iter_records() if r.status == "eval" and r.step is None]
    assert summary["step"] == 3


async def _replay_serves_the_run(run: Path) -> None:
    """The inspector reads a real training run: list, filter, open, token view, group view."""
    from aiohttp.test_utils import TestClient, TestServer

    from agentrl.replay.server import ReplaySettings, create_app

    app = create_app(ReplaySettings(run / "trajectories.sqlite"))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        listed = await (await client.get("/api/trajectories", params={"status": "trained", "limit": "100"})).json()
        assert len(listed["items"]) == 3 * 2 * 4
        first = listed["items"][0]
        detail = await (await client.get(f"/api/trajectories/{first['id']}")).json()
        tokens = detail["tokens"]
        assert len(tokens["ids"]) == len(tokens["loss_mask"]) == len(tokens["logprobs"]) == len(tokens["versions"])
        assert tokens["text"] is not None and any(tokens["loss_mask"])
        assert detail["status"] == "trained" and detail["step"] in (1, 2, 3)
        group = await client.get(f"/api/groups/{detail['trajectory']['group_id']}")
        assert group.status == 200
        metrics = await (await client.get("/api/metrics")).json()
        assert [m["step"] for m in metrics["metrics"] if m["step"] >= 1] == [1, 2, 3]


def test_frozenlake_gigpo_fast_variant_trains(tmp_path: Path, tiny_llama_path: str) -> None:
    """Multi-turn gym_text with GiGPO: state keys reach the trainer, step groups form, metrics are documented."""
    run, rows = _train(
        "frozenlake.yaml", tmp_path, tiny_llama_path,
        "run.steps=2", "run.eval_every=0", "run.save_every=2", "run.loggers=[jsonl]",
        "rollout.group_size=3", "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=6",
        "rollout.max_turns=3", "trainer.entropy_coef=0.01",
    )  # fmt: skip
    rl_rows = [r for r in rows if "grad_norm" in r]
    assert [r["step"] for r in rl_rows] == [1, 2]
    assert _undocumented(rows) == [], "metric keys missing from docs/metrics.md"
    # every group's turn 0 stands on its task's start square: at least those turns are grouped
    assert all(0 < r["adv/step_grouped_fraction"] <= 1 and r["adv/step_groups"] >= 2 for r in rl_rows)
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = [r.trajectory for r in store.iter_records() if r.status == "trained"]
    assert len(trained) == 2 * 2 * 3
    for traj in trained:
        assert traj.turns and all(str(t.info["state_key"]).isdigit() for t in traj.turns)  # the lake square
        assert traj.tokens().turn_states[0] == f"env:{traj.turns[0].info['state_key']}"
        assert len(traj.info["token_stats"]["advantages"]) == len(traj.token_ids)


def test_mix_fast_variant_trains_every_member_and_logs_each(tmp_path: Path, tiny_llama_path: str) -> None:
    """Two envs in one run: warm start on the calculator's demos, episodes of both, rewards per env."""
    run, rows = _train(
        "mix.yaml", tmp_path, tiny_llama_path,
        "run.steps=2", "run.eval_every=2", "run.eval_tasks=4", "run.save_every=2", "run.loggers=[jsonl]",
        "rollout.group_size=2", "rollout.groups_per_step=4", "rollout.max_new_tokens_per_turn=6",
        "rollout.max_turns=2", "warm_start.steps=1", "warm_start.batch_size=2", "trainer.entropy_coef=0.01",
    )  # fmt: skip
    assert _undocumented(rows) == [], "metric keys missing from docs/metrics.md"
    assert [r["step"] for r in rows if "grad_norm" in r] == [1, 2]
    assert any("sft/loss" in r for r in rows)  # the calculator's demonstrations, with its tools
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert evals and all({"eval/calculator/reward_mean", "eval/lake/reward_mean"} <= r.keys() for r in evals)
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        records = list(store.iter_records())
    trained = [r.trajectory for r in records if r.status == "trained"]
    assert len(trained) == 2 * 4 * 2 and {t.env for t in trained} <= {"calculator", "lake"}
    by_env = Counter(t.env for t in trained)
    logged = {k.removeprefix("reward/mean/") for r in rows for k in r if k.startswith("reward/mean/")}
    assert logged == set(by_env)
    for t in trained:  # each member opened its own episodes
        opening = t.messages[0].content
        assert ("<tool_call>" in opening) == (t.env == "calculator") and ("frozen lake" in opening) == (t.env == "lake")


def test_math_fast_variant_trains(tmp_path: Path, tiny_llama_path: str) -> None:
    """Single-turn RLVR on reasoning-gym arithmetic with the math verifier."""
    run, rows = _train(
        "math.yaml", tmp_path, tiny_llama_path,
        "run.steps=2", "run.eval_every=0", "run.save_every=2", "run.loggers=[jsonl]",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=8",
        "trainer.entropy_coef=0.01",
    )  # fmt: skip
    assert [r["step"] for r in rows if "grad_norm" in r] == [1, 2]
    assert _undocumented(rows) == [], "metric keys missing from docs/metrics.md"
    assert all(r["grad_norm"] > 0 for r in rows if "grad_norm" in r)
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = [r for r in store.iter_records() if r.status == "trained"]
        assert len(trained) == 2 * 2 * 2
        assert all(r.trajectory.env == "math" and len(r.trajectory.turns) == 1 for r in trained)
        assert all(r.trajectory.reward in (0.0, 1.0) for r in trained)
    assert (run / "checkpoints" / "step-000002" / "model" / "config.json").exists()


def _drifting_run(run_dir: Path, model: str, action: str) -> subprocess.CompletedProcess[str]:
    """Two steps with the engine left in bf16 under an fp32 trainer, and an engine_drift threshold for that gap."""
    return subprocess.run(
        [*_train_cmd("calculator.yaml", run_dir, model,
                     "run.steps=2", "run.eval_every=0", "run.save_every=10", "run.loggers=[jsonl]",
                     "rollout.group_size=4", "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=12",
                     "rollout.max_turns=2", "rollout.max_staleness=0", "warm_start.steps=0",
                     f"alerts.action={action}", "alerts.patience=1", "alerts.fresh_mismatch_kl=1e-8"),
         "engine.dtype=bf16"],
        capture_output=True, text=True, timeout=900, env=_env(), cwd=run_dir,
    )  # fmt: skip


def test_an_engine_drift_alert_stops_the_run_with_a_checkpoint(tmp_path: Path, tiny_llama_path: str) -> None:
    """The engine's bf16 logprobs no longer match the fp32 trainer on the same weights; alerts.action=stop ends the run.

    The threshold is set for this tiny model, whose bf16/fp32 gap is ~2e-6 (fp32 on both sides: ~3e-13).
    """
    proc = _drifting_run(tmp_path, tiny_llama_path, "stop")
    assert proc.returncode == 2, proc.stderr[-3000:]
    run = tmp_path / "ci"
    assert "run stopped at step 1 by alert engine_drift (alerts.action=stop)" in proc.stderr
    assert f"agentrl train --resume {run}" in proc.stderr.replace("\n", "")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in rows if "grad_norm" in r]
    assert step["step"] == 1 and step["alerts/engine_drift"] == 1.0
    assert step["off_policy/fresh_fraction"] == 1.0 and step["off_policy/fresh_mismatch_kl"] > 1e-8
    assert _undocumented(rows) == []
    assert (run / "checkpoints" / "step-000001" / "model" / "config.json").exists()
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        assert len([r for r in store.iter_records() if r.status == "trained"]) == 2 * 4


def test_an_engine_drift_alert_that_warns_lets_the_run_finish(tmp_path: Path, tiny_llama_path: str) -> None:
    proc = _drifting_run(tmp_path, tiny_llama_path, "warn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("alert engine_drift") == 2
    rows = [json.loads(line) for line in (tmp_path / "ci" / "metrics.jsonl").read_text().splitlines()]
    assert [r["alerts/engine_drift"] for r in rows if "grad_norm" in r] == [1.0, 1.0]


def test_kill_and_resume_loses_and_repeats_nothing(tmp_path: Path, tiny_llama_path: str) -> None:
    """kill -9 mid-run, `--resume`: every task position trained exactly once, nothing lost."""
    fast = (
        "run.steps=6", "run.eval_every=0", "run.save_every=2", "run.loggers=[jsonl]",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.max_new_tokens_per_turn=8",
        "rollout.max_turns=2", "rollout.max_in_flight=2",
    )  # fmt: skip
    cmd = _train_cmd("calculator.yaml", tmp_path, tiny_llama_path, *fast)
    proc = subprocess.Popen(cmd, env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = tmp_path / "ci"
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()] if metrics.exists() else []
        if steps and max(steps) >= 3:
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        time.sleep(0.5)
    else:
        pytest.fail("training never reached step 3")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        before = {r.trajectory.id for r in store.iter_records()}
    assert before, "nothing was stored before the kill"

    resumed = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--resume", str(run)],
        capture_output=True, text=True, timeout=900, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        records = list(store.iter_records())
        after = {r.trajectory.id for r in records}
        assert before <= after, "a stored trajectory was lost"
        trained_cursors = Counter(r.trajectory.task["_cursor"] for r in records if r.status == "trained")
        steps = Counter(r.step for r in records if r.status == "trained")
    # 6 steps x 2 groups x 2 samples; each task position trained by exactly one group
    assert sorted(trained_cursors) == list(range(12)), trained_cursors
    assert set(trained_cursors.values()) == {2}
    assert steps == {s: 4 for s in range(1, 7)}
    assert (run / "checkpoints" / "step-000006").is_dir()


def test_a_run_whose_tasks_are_all_solved_ends_early_and_resumes_to_the_same_end(
    tmp_path: Path, tiny_llama_path: str
) -> None:
    """rollout.skip_solved: every episode of the trivial env earns 1, so each task is solved by its first group;
    after one pass over the 4 tasks (2 steps of 2 groups) nothing is left, and the run ends with a checkpoint."""
    config = tmp_path / "solved.yaml"
    config.write_text(
        "run: {name: ci, steps: 6, save_every: 10, loggers: [jsonl]}\n"
        "env: {name: 'agentrl.envkit.testing:TrivialEnv', turns: 1, num_tasks: 4}\n"
        "engine: {name: scripted, replies: ['ok']}\n"
        "trainer: {name: torch, dtype: fp32, lr: 1.0e-4}\n"
        "alerts: {fresh_mismatch_kl: null}\n"  # the scripted engine's logprobs are not the model's
        "rollout: {group_size: 2, groups_per_step: 2, max_staleness: 0, max_new_tokens_per_turn: 8, skip_solved: {times: 1}}\n"
    )
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config), f"model.path={tiny_llama_path}",
           f"run.output_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all 4 training tasks were solved 1 time(s)" in proc.stderr.replace("\n", " ")
    run = tmp_path / "ci"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tasks/solved"]) for r in rows] == [(1, 2.0), (2, 4.0)]
    assert _undocumented(rows) == [], "metric keys missing from docs/metrics.md"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        assert sorted(r.trajectory.task_id for r in store.iter_records()) == sorted(
            [f"train-{i}" for i in range(4)] * 2
        )  # each task once, both samples
    again = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "--resume", str(run)],
                           capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run ends at step 2" in again.stderr.replace("\n", " ")
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2  # nothing trained again


def test_a_skyrl_gym_dataset_trains(tmp_path: Path, tiny_llama_path: str) -> None:
    """SkyRL-format rows and a SkyRL-Gym env (multi-turn gsm8k) through the whole loop, as they are."""
    pytest.importorskip("skyrl_gym")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(
        json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "env_class": "gsm8k_multi_turn",
                    "reward_spec": {"method": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i, "max_turns": 2}})
        + "\n" for i in range(6)
    ))  # fmt: skip
    config = tmp_path / "skyrl.yaml"
    config.write_text(
        "run: {name: ci, steps: 2, save_every: 2, loggers: [jsonl]}\n"
        f"env: {{name: skyrl_gym, train: {{path: '{data}'}}}}\n"
        "trainer: {name: torch, dtype: fp32, entropy_coef: 0.01}\n"
        "engine: {name: hf, dtype: fp32}\n"
        "rollout: {group_size: 2, groups_per_step: 2, max_turns: 2, max_new_tokens_per_turn: 6}\n"
    )
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config), f"model.path={tiny_llama_path}",
           f"run.output_dir={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "ci"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "grad_norm" in r] == [1, 2]
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = [r.trajectory for r in store.iter_records() if r.status == "trained"]
    assert len(trained) == 2 * 2 * 2 and all(t.error is None and t.env == "skyrl_gym" for t in trained)
    # a random model never answers "#### N": the env asks again, the episode runs both turns
    assert all(len(t.turns) == 2 and t.task["env_class"] == "gsm8k_multi_turn" for t in trained)

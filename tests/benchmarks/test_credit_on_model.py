"""benchmarks/credit_on_model.py: the harness runs every estimator and reports them all.

The reduced variant: a tiny random model plays FrozenLake for one step per
estimator. It asserts that the harness trained and evaluated each run and
printed the summary with all three estimators, never that anything learned
(machines are noisy, and a random model learns nothing in one step).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("credit_on_model")


def test_each_run_differs_only_in_estimator_seed_and_folder(bench: ModuleType, tmp_path: Path) -> None:
    args = bench.parse_args(["--out", str(tmp_path), "--seeds", "0,1", "trainer.lr=3e-4"])
    runs = bench.specs(args)
    assert [r.name for r in runs] == ["grpo-s0", "turn_rloo-s0", "gigpo-s0", "grpo-s1", "turn_rloo-s1", "gigpo-s1"]
    cmd = bench.train_command(args, runs[4])
    assert cmd[3:6] == ["train", args.config, "trainer.lr=3e-4"]
    assert cmd[6:] == ["trainer.advantage=turn_rloo", "run.seed=1", f"run.output_dir={tmp_path}", "run.name=turn_rloo-s1"]
    with pytest.raises(SystemExit, match=r"trainer\.advantage"):
        bench.parse_args(["trainer.advantage=rloo"])


def test_report_compares_at_the_last_common_step_and_within_the_wall_budget(bench: ModuleType, tmp_path: Path) -> None:
    args = bench.parse_args(["--out", str(tmp_path), "--estimators", "grpo,gigpo"])
    curves = {"grpo": [(0, 0.25, 30.0), (5, 0.5, 300.0), (10, 0.5, 600.0)], "gigpo": [(0, 0.25, 30.0), (5, 0.75, 400.0)]}
    for spec in bench.specs(args):
        spec.path.mkdir(parents=True)
        rows = [{"step": s, "eval/reward_mean": r, "time/wall_s": w} for s, r, w in curves[spec.estimator]]
        rows.insert(1, {"step": 1, "reward/mean": 0.1})  # training rows carry no eval
        (spec.path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    text = bench.report([bench.read_run(s) for s in bench.specs(args)], 350.0)
    summary = text.splitlines()[-1]
    assert "heldout_grpo=0.500 start_grpo=0.250 heldout_grpo_within_350s=0.500" in summary
    assert "heldout_gigpo=0.750 start_gigpo=0.250 heldout_gigpo_within_350s=0.250" in summary
    assert "steps=5 seeds=1" in summary


@pytest.mark.slow
@pytest.mark.model
def test_reduced_comparison_runs_all_three_estimators(
    bench: ModuleType, tiny_llama_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "credit"
    tiny = [
        f"model.path={tiny_llama_path}", "run.steps=1", "run.eval_every=1", "run.eval_tasks=2", "run.save_every=1",
        "rollout.group_size=2", "rollout.groups_per_step=1", "rollout.max_turns=2", "env.max_steps=2",
        "rollout.max_new_tokens_per_turn=4", "run.loggers=[jsonl]",
    ]  # fmt: skip
    code = bench.main(["--out", str(out), "--timeout-s", "900", "--threads", "1", *tiny])
    text = capsys.readouterr().out
    logs = {p.name: p.read_text()[-2000:] for p in out.glob("*.log")}
    assert code == 0, (text, logs)
    summary = text.strip().splitlines()[-1]
    for estimator in ("grpo", "turn_rloo", "gigpo"):
        assert re.search(rf"heldout_{estimator}=\d\.\d{{3}} start_{estimator}=\d\.\d{{3}}", summary), summary
        record = json.loads((out / f"{estimator}-s0.credit_run.json").read_text())
        assert record["returncode"] == 0 and record["wall_s"] > 0 and record["cpu_s"] > 0
    assert "steps=1 seeds=1" in summary

"""benchmarks/train_step_memory.py runs its variants end to end (tiny model, real training steps) and reports each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.model
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step_memory.py"


def test_checkpointed_variants_train_the_same_steps_and_the_summary_names_each(
    tiny_llama_path: str, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    trainer = {"name": "torch", "lora": {"r": 4, "alpha": 8}, "lr": 1e-4, "shared_prefix": True, "dtype": "fp32"}
    config.write_text(yaml.safe_dump({"model": {"path": tiny_llama_path}, "trainer": trainer}))
    variants = ["micro_batch_tokens=512 gradient_checkpointing=false", "micro_batch_tokens=512 gradient_checkpointing=true"]
    cmd = [sys.executable, str(BENCH), "--config", str(config), "--steps", "2", "--groups", "2", "--group-size", "3",
           "--prompt", "40", "--completion", "5", "20", *[a for v in variants for a in ("--variant", v)]]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    losses = [line.split("losses ")[1] for line in lines if "losses " in line]
    assert len(losses) == 2 and losses[0] == losses[1]  # checkpointing is exact: the same batches, the same losses
    fields = dict(part.split("=") for part in lines[-1].split())
    assert set(fields) == {f"v{i}_{k}" for i in (0, 1) for k in ("peak_mb", "step_peak_mb", "step_s", "vs_v0_s")} | {
        "steps"}  # fmt: skip
    assert fields["v0_vs_v0_s"] == "1.00" and fields["steps"] == "2"
    assert float(fields["v1_peak_mb"]) >= float(fields["v1_step_peak_mb"]) > 0


def test_overrides_are_yaml_scalars_merged_into_the_trainer_section(load_benchmark, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from agentrl.config import ConfigError

    bench = load_benchmark("train_step_memory")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "/m"}, "trainer": {"name": "torch", "lora": {"r": 4, "alpha": 8}}}))
    trainer, model = bench.trainer_config(config, "micro_batch_tokens=1024 gradient_checkpointing=true lora.r=8")
    assert model == "/m" and trainer == {
        "micro_batch_tokens": 1024, "gradient_checkpointing": True, "lora": {"r": 8, "alpha": 8}}  # fmt: skip
    with pytest.raises(ConfigError, match="not of the form"):
        bench.trainer_config(config, "micro_batch_tokens")

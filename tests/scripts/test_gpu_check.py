"""scripts/gpu_check.sh: its CPU dry run (`--cpu`) runs every part, the gpu-marked tests really run, and the
summary line carries the numbers; a failing part does not stop the others. The real run needs a GPU
(docs/gpu.md); this keeps the script from rotting where there is none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GPU_TESTS = 8  # gpu-marked tests in tests/trainers/test_gpu.py and tests/agentrl/engines/test_gpu.py


def _run(out: Path, work: Path, *args: str, python: str = sys.executable, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=python, GPU_CHECK_WORK=str(work))
    env.pop("AGENTRL_TEST_DEVICE", None)
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)  # fmt: skip


def _summary(out: Path) -> dict[str, str]:
    lines = (out / "summary.txt").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check "), lines
    return dict(item.split("=", 1) for item in lines[0].split()[1:])


@pytest.mark.slow
@pytest.mark.model
def test_the_cpu_dry_run_runs_every_part_and_reports_the_numbers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run(out, tmp_path / "work", "--cpu")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    s = _summary(out)
    assert proc.stdout.strip().splitlines()[-1] == (out / "summary.txt").read_text().strip()  # printed last too
    assert s["device"] == "cpu" and s["model"] == "synthetic:llama-tiny"
    for part in ("install", "tests", "lora", "full"):
        assert s[part] == "passed", (part, s)
    # the gpu-marked tests ran on the CPU (AGENTRL_TEST_DEVICE=cpu), none skipped
    assert (int(s["tests_passed"]), s["tests_failed"], s["tests_skipped"]) == (GPU_TESTS, "0", "0"), s
    for mode in ("lora", "full"):
        for key in ("gen_tok_s", "train_tok_s", "step_s", "first_step_s", "peak_mem_mib"):
            assert float(s[f"{mode}_{key}"]) > 0, (mode, key, s)
        assert s[f"{mode}_mem_kind"] == "cpu_peak_rss"
    assert s["deepspeed"].startswith("skipped:") and "incomplete" not in s
    assert int(s["wall_s"]) > 0
    # what comes back from a device run: at most 8 plain files, no folders
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.log", "summary.txt", "tests.log", "train-full.log", "train-lora.log"], files
    assert "gpu_train mode=lora device=cpu" in (out / "train-lora.log").read_text()


def test_a_failing_part_does_not_stop_the_others_and_the_summary_is_written(tmp_path: Path) -> None:
    """With a Python that cannot run anything every part fails, each is still tried, and summary.txt says so."""
    out = tmp_path / "out"
    proc = _run(out, tmp_path / "work", "--cpu", python="/bin/false", timeout=120)
    assert proc.returncode == 1  # a failed part fails the script
    s = _summary(out)
    assert "incomplete" not in s  # the final line, not a snapshot taken between parts
    for part in ("install", "tests", "lora", "full"):
        assert s[part].startswith("failed_rc"), (part, s)
    assert s["tests_passed"] == "na" and s["lora_gen_tok_s"] == "na"
    assert proc.stdout.count("== lora") == 2 and proc.stdout.count("== full") == 2


def test_bad_arguments_are_refused_with_the_allowed_options(tmp_path: Path) -> None:
    proc = _run(tmp_path / "out", tmp_path / "work", "--gpu", timeout=30)
    assert proc.returncode == 2
    assert "unknown option --gpu (allowed: --cpu, --deepspeed)" in proc.stderr
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage:" in proc.stderr

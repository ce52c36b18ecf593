"""benchmarks/delta_sync.py runs end to end (tiny model, two real optimizer steps) and its summary says what it sent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "delta_sync.py"


def test_delta_sync_benchmark_prints_its_summary(tiny_llama_path: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--model", tiny_llama_path, "--steps", "2", "--group-size", "2"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("same_bits=True") == 4  # each step, each dtype: the delta engine equals the full one
    fields = dict(part.split("=") for part in out.stdout.strip().splitlines()[-1].split())
    assert set(fields) == {"fp32_delta_ratio", "bf16_delta_ratio", "fp32_delta_vs_full_s", "bf16_delta_vs_full_s",
                           "fp32_tensors_touched", "bf16_tensors_touched", "steps"}  # fmt: skip
    assert 0 < float(fields["bf16_tensors_touched"]) <= float(fields["fp32_tensors_touched"]) <= 1.0
    # Adam moves every fp32 element by ~lr; in bf16 most of those moves are below one step of the format
    assert 0 < float(fields["bf16_delta_ratio"]) < float(fields["fp32_delta_ratio"]) <= 1.0

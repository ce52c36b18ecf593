"""benchmarks/gateway_overhead.py runs end to end (tiny model, one short round) and prints its summary line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "gateway_overhead.py"


def test_overhead_benchmark_prints_its_summary(tiny_llama_path: str) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--model", tiny_llama_path, "--sessions", "3", "--turns", "2",
         "--max-tokens", "8", "--rounds", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    fields = dict(part.split("=") for part in last.split())
    assert set(fields) == {"direct_tok_s", "gateway_tok_s", "gateway_vs_direct"}
    assert float(fields["direct_tok_s"]) > 0 and float(fields["gateway_tok_s"]) > 0
    assert "round 0 gateway" in out.stdout and "round 0 direct" in out.stdout

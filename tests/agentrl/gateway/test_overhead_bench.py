"""benchmarks/gateway_overhead.py runs end to end (tiny model, one short round) and prints its summary line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "gateway_overhead.py"


@pytest.mark.parametrize("stream", [False, True])
def test_overhead_benchmark_prints_its_summary(tiny_llama_path: str, stream: bool) -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--model", tiny_llama_path, "--sessions", "3", "--turns", "2",
         "--max-tokens", "8", "--rounds", "1", *(["--stream"] if stream else [])],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    fields = dict(part.split("=") for part in last.split())
    assert set(fields) == {"direct_tok_s", "gateway_tok_s", "gateway_vs_direct"} | ({"first_content_share"} if stream else set())
    if stream:
        assert 0 < float(fields["first_content_share"]) <= 1
    assert float(fields["direct_tok_s"]) > 0 and float(fields["gateway_tok_s"]) > 0
    assert "round 0 gateway" in out.stdout and "round 0 direct" in out.stdout

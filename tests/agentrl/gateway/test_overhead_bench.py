"""benchmarks/gateway_overhead.py runs end to end (tiny model, one short round) for every API and prints its
summary line: tokens/s per API against direct, the added latency per call, the constrained-decoding cost."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "gateway_overhead.py"


@pytest.mark.parametrize("stream", [False, True])
def test_overhead_benchmark_prints_its_summary(tiny_llama_path: str, stream: bool) -> None:
    # temperature 1: greedy on a random tiny model can end every reply at once (no content to stream)
    extra = ["--stream", "--api", "chat"] if stream else ["--constrained"]
    out = subprocess.run(
        [sys.executable, str(BENCH), "--model", tiny_llama_path, "--sessions", "3", "--turns", "2",
         "--max-tokens", "8", "--rounds", "1", "--latency-calls", "2", "--temperature", "1", *extra],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    fields = dict(part.split("=") for part in last.split())
    apis = ["chat"] if stream else ["chat", "responses", "messages"]
    want = {"direct_tok_s", "gateway_vs_direct"} | {f"{a}_{k}" for a in apis for k in ("tok_s", "vs_direct", "call_ms_p50", "bare_ms_p50", "added_ms_p50")}
    assert set(fields) == want | ({"first_content_share"} if stream else {"constrained_cost"})
    if stream:
        assert 0 < float(fields["first_content_share"]) <= 1
    else:
        assert float(fields["constrained_cost"]) > 0
    assert float(fields["direct_tok_s"]) > 0
    for a in apis:  # added latency is the gateway's call less the bare server's (its sign is timing: not asserted)
        call, bare, added = (float(fields[f"{a}_{k}_ms_p50"]) for k in ("call", "bare", "added"))
        assert call > 0 and bare > 0 and added == pytest.approx(call - bare, abs=0.011)
    assert float(fields["gateway_vs_direct"]) == min(float(fields[f"{a}_vs_direct"]) for a in apis)
    assert all(f"round 0 {a}" in out.stdout for a in ["direct", *apis])

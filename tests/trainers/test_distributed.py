"""Data parallel (DDP and FSDP) and sequence parallel (alone and sharded) over 2 gloo ranks give the same
loss and gradients as one process on the same data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("dist_worker.py")
CONFIG: dict[str, Any] = {
    "dtype": "fp32",
    "lr": 1e-3,
    "micro_batch_tokens": 48,
    "loss_agg": "seq_mean_token_mean",
}
# one spawn runs them all in the same process group: DP over 2 ranks (DDP), SP=2 (ring attention, DP=1),
# DP with parameters, gradients and optimizer state sharded (FSDP), GSPO under SP=2 (its per-sequence
# ratio needs the whole sequence, which every SP rank's loss sees after the logprobs are gathered), and
# SP=2 with the parameters sharded over both SP ranks (FSDP's mean of their gradients, scaled to a sum)
GSPO = dict(CONFIG, policy_loss="gspo", off_policy={"mode": "none"})  # ratios vs the behaviour logprobs: not 1
RUNS = [CONFIG, dict(CONFIG, sequence_parallel_size=2), dict(CONFIG, data_parallel="fsdp"),
        dict(GSPO, sequence_parallel_size=2),
        dict(CONFIG, data_parallel="fsdp", sequence_parallel_size=2)]  # fmt: skip
SP_RUNS = (1, 3, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_gloo_ranks_ddp_sp_and_fsdp_match_one_process(tiny_llama_path: str, tmp_path: Path, build: Any) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(WORKER), tiny_llama_path, str(tmp_path), json.dumps(RUNS)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]

    from agentrl.trainers.torch_trainer import TorchTrainer

    one_process = {}
    for name, config in (("ppo", CONFIG), ("gspo", GSPO)):
        single = TorchTrainer(config, tiny_llama_path)
        groups = build.groups(3, 3, seed=7)
        result = single.compute_gradients(groups)
        grads = {n: p.grad for n, p in single.model.named_parameters() if p.grad is not None}
        one_process[name] = (result.metrics, grads, [result.token_stats[tr.id] for g in groups for tr in g.trajectories])
    # the made-up behaviour logprobs put the ratios far from 1: GSPO's gradients are not PPO's here,
    # and not all zero (some sequences are inside the clip range)
    ppo_grads, gspo_grads = one_process["ppo"][1], one_process["gspo"][1]
    assert max(float(g.abs().max()) for g in gspo_grads.values()) > 0
    assert any(not torch.allclose(gspo_grads[n], ppo_grads[n], rtol=1e-2, atol=0) for n in ppo_grads)
    for k, rank in [(k, r) for k in range(len(RUNS)) for r in range(2)]:
        m1, g1, stats1 = one_process[RUNS[k].get("policy_loss", "ppo")]
        got = torch.load(tmp_path / f"{k}_rank{rank}.pt", weights_only=False)
        assert got["metrics"]["loss"] == pytest.approx(m1["loss"], rel=1e-5)
        assert got["metrics"]["samples"] == m1["samples"] == 9
        assert got["metrics"]["pack/tokens"] == m1["pack/tokens"]
        assert got["metrics"]["off_policy/mismatch_kl"] == pytest.approx(
            m1["off_policy/mismatch_kl"], rel=1e-5
        )
        assert set(got["grads"]) == set(g1)
        for n, g in g1.items():
            torch.testing.assert_close(
                got["grads"][n],
                g,
                rtol=1e-5,
                atol=1e-5 * float(g.abs().max()),
                msg=f"run {k} rank {rank}: {n}",
            )
    # token stats: under DP each rank fills the trajectories it trained on, under SP every rank all
    for k in range(len(RUNS)):
        stats1 = one_process[RUNS[k].get("policy_loss", "ppo")][2]
        ranks = [torch.load(tmp_path / f"{k}_rank{r}.pt", weights_only=False)["token_stats"] for r in (0, 1)]
        filled = [[s for s in pair if s is not None] for pair in zip(*ranks, strict=True)]
        assert [len(f) for f in filled] == [2 if k in SP_RUNS else 1] * len(stats1), f"run {k}"
        for got, want in zip(filled, stats1, strict=True):
            for s in got:
                assert s["advantages"] == want["advantages"] and s["is_mask"] == want["is_mask"]
                for a, b in zip(s["trainer_logprobs"], want["trainer_logprobs"], strict=True):
                    assert (a is None and b is None) or a == pytest.approx(b, abs=1e-4)

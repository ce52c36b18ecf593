"""`agentrl train` with two policies end to end: per-policy metrics, checkpoints, stored turns, resume.

The scripted engine holds the adapters (its replies do not depend on them), the
torch trainer trains two LoRA adapters over one tiny random model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agentrl.config import resolve_config
from agentrl.run.loop import train
from agentrl.store.trajectory_store import TrajectoryStore


def _config(tiny_llama_path: str, out: Path, steps: int) -> object:
    return resolve_config({
        "run": {"name": "duo", "steps": steps, "save_every": 1, "eval_every": 2, "eval_tasks": 4,
                "loggers": ["jsonl"], "output_dir": str(out)},
        "model": {"path": tiny_llama_path},
        "env": {"name": "propose_check", "n_train": 16, "n_test": 4},
        "engine": {"name": "scripted", "replies": ["Answer: 3", "Answer: 7", "Answer: 12", "Answer: 5"]},
        "trainer": {"name": "torch", "dtype": "fp32", "lr": 1e-3, "lora": {"r": 4, "target_modules": ["q_proj"]}},
        "policies": {"alice": {}, "bob": {"trainer": {"lr": 1e-4}}},
        "agents": {"proposer": "alice", "checker": "bob"},
        "alerts": {"fresh_mismatch_kl": None},  # the scripted engine's logprobs are not the model's
        "rollout": {"group_size": 4, "groups_per_step": 2, "max_turns": 1, "max_new_tokens_per_turn": 8,
                    "max_total_tokens": 256},
    })


def test_two_policies_train_checkpoint_and_resume(tmp_path: Path, tiny_llama_path: str) -> None:
    run = asyncio.run(train(_config(tiny_llama_path, tmp_path, steps=2)))  # type: ignore[arg-type]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows}
    for name in ("alice", "bob"):
        assert f"policy/{name}/loss" in steps[1] and steps[1][f"policy/{name}/policy_version"] == 1.0
    assert steps[2]["policies/stepped"] == 2.0
    assert "eval/policy/alice/reward_mean" in steps[2] and "eval/policy/bob/reward_mean" in steps[0]
    checkpoint = run / "checkpoints" / "step-000002"
    assert sorted(p.name for p in (checkpoint / "policies").iterdir()) == ["alice", "bob"]
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = [r.trajectory for r in store.iter_records() if r.status == "trained"]
    assert len(trained) == 2 * 2 * 4 * 2  # steps x groups x samples x agents
    for traj in trained:
        agent, policies = traj.info["agent"], traj.policies
        assert policies == (["alice"] if agent == "proposer" else ["bob"])
    # resume to step 3: both policies continue from their own checkpoints
    again = asyncio.run(train(_config(tiny_llama_path, tmp_path, steps=3), resume=run))  # type: ignore[arg-type]
    rows = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["step"] == 3][-1]
    assert last["policy/alice/policy_version"] == 3.0 and last["policy/bob/policy_version"] == 3.0

"""`agentrl train` with two policies end to end: per-policy metrics, checkpoints, stored turns, resume.

The scripted engine holds the adapters (its replies do not depend on them), the
torch trainer trains two LoRA adapters over one tiny random model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from agentrl.config import resolve_config
from agentrl.run.loop import train
from agentrl.store.trajectory_store import TrajectoryStore


def _config(tiny_llama_path: str, out: Path, steps: int, **sections: dict[str, Any]) -> Any:
    """Two policies on propose_check; each of `sections` is merged into that section (an engine replaces it)."""
    raw: dict[str, Any] = {
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
    }
    for key, section in sections.items():
        raw[key] = section if key == "engine" else {**raw[key], **section}
    return resolve_config(raw)


def test_two_policies_train_checkpoint_and_resume(tmp_path: Path, tiny_llama_path: str) -> None:
    run = asyncio.run(train(_config(tiny_llama_path, tmp_path, steps=2)))
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
    again = asyncio.run(train(_config(tiny_llama_path, tmp_path, steps=3), resume=run))
    rows = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["step"] == 3][-1]
    assert last["policy/alice/policy_version"] == 3.0 and last["policy/bob/policy_version"] == 3.0


def test_two_policies_on_the_hf_engine_sync_and_tag_their_own_adapters(tmp_path: Path, tiny_llama_path: str) -> None:
    """The embedded hf engine holds both adapters over the trainer's base: every sync moves each policy's
    adapter to its new version, so each policy's turns carry its own versions (0, 1, 2 in a synchronous
    3-step run) and the engine's logprobs agree with each trainer's. (Whether a row is sampled with the
    right adapter's tensors is checked against a peft reference in tests/agentrl/engines/test_hf_adapters.py:
    here the tiny random model's rewards are all equal, so the adapters do not move.)"""
    hf = {"name": "hf", "dtype": "fp32", "max_batch_size": 16}
    config = _config(tiny_llama_path, tmp_path, steps=3, engine=hf, run={"name": "duo_hf", "eval_every": 0},
                     rollout={"max_staleness": 0}, alerts={"fresh_mismatch_kl": 1e-3})  # fmt: skip
    run = asyncio.run(train(config))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "time/step_s" in r}
    for step in (1, 2, 3):
        for name in ("alice", "bob"):
            assert steps[step][f"policy/{name}/policy_version"] == step
            assert steps[step][f"policy/{name}/off_policy/fresh_mismatch_kl"] < 1e-6, (step, name)
    with TrajectoryStore(run / "trajectories.sqlite", readonly=True) as store:
        trained = [r.trajectory for r in store.iter_records() if r.status == "trained"]
    for traj in trained:  # synchronous: each trajectory was sampled at one version
        (turn,) = traj.turns
        versions = {v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m}
        assert turn.policy == ("alice" if traj.info["agent"] == "proposer" else "bob")
        assert len(versions) == 1
    for name in ("alice", "bob"):
        mine = [t for t in trained if t.turns[0].policy == name]
        assert {v for t in mine for v, m in zip(t.versions, t.loss_mask, strict=True) if m} == {0, 1, 2}

"""Several LoRA policies over one base (agentrl.run.policies with the torch trainer, tiny random model).

Each policy's gradient comes only from its own turns; advantages are normalised
per role; the base is one copy; a resumed two-policy run continues exactly as
an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import resolve_config
from agentrl.run.policies import PolicyTrainers, build_policy_trainers, policy_groups
from agentrl.trainers.torch_trainer import TorchTrainer
from agentrl.types import Group, Message, Trajectory, Turn

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def _config(tiny_llama_path: str, **policies: dict[str, Any]) -> Any:
    return resolve_config({
        "env": "calculator", "model": {"path": tiny_llama_path},
        "trainer": {"lora": LORA, "lr": 1e-2, "dtype": "fp32", "record_token_stats": True},
        "policies": policies or {"alice": {}, "bob": {}}, "agents": {"player_0": "alice", "*": "bob"},
    })


def _traj(seed: int, turns: list[tuple[int, int, str]], reward: float, agent: str = "") -> Trajectory:
    """24 tokens; each (start, end, policy) turn is sampled with random behaviour logprobs."""
    g = torch.Generator().manual_seed(seed)
    n = 24
    ids = torch.randint(10, 200, (n,), generator=g).tolist()
    mask, logprobs, versions = [0] * n, [0.0] * n, [-1] * n
    for start, end, _ in turns:
        for i in range(start, end):
            mask[i], versions[i] = 1, 0
            logprobs[i] = float(-torch.rand((), generator=g) * 3)
    return Trajectory(
        task_id="t", env="e", messages=[Message("user", "x")], token_ids=ids, loss_mask=mask, logprobs=logprobs,
        versions=versions, turns=[Turn(s, e, policy=p) for s, e, p in turns], reward=reward, group_id="g",
        info={"agent": agent} if agent else {},
    )


def _shared_groups(bob_seed: int = 0) -> list[Group]:
    """Conversations where alice and bob take turns in one token stream."""
    trajs = [_traj(i, [(3, 7, "alice"), (10, 14, "bob"), (17, 21, "alice")], reward=float(i % 2)) for i in range(4)]
    if bob_seed:  # bob's turns sampled otherwise: other behaviour logprobs, versions, turn rewards
        g = torch.Generator().manual_seed(bob_seed)
        for t in trajs:
            for i in range(10, 14):
                t.logprobs[i] = float(-torch.rand((), generator=g) * 3)
                t.versions[i] = 0
            t.turns[1].reward = float(torch.rand((), generator=g))
    return [Group(task_id="t", trajectories=trajs, id="g")]


def _randomise_adapters(trainer: TorchTrainer, seed: int) -> None:
    """Non-zero LoRA B (peft starts it at 0, which would zero every A gradient)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _grads(trainer: TorchTrainer, groups: list[Group]) -> dict[str, torch.Tensor]:
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.compute_gradients(groups)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def pair(tiny_llama_path: str) -> PolicyTrainers:
    trainers = build_policy_trainers(_config(tiny_llama_path), TorchTrainer, tiny_llama_path)
    for i, t in enumerate(trainers.trainers.values()):
        assert isinstance(t, TorchTrainer)
        _randomise_adapters(t, seed=i + 1)
    return trainers


def test_the_policies_share_one_base_and_keep_their_own_adapters(pair: PolicyTrainers) -> None:
    alice, bob = (pair.trainers[n] for n in ("alice", "bob"))
    assert isinstance(alice, TorchTrainer) and isinstance(bob, TorchTrainer)
    frozen_a = {n: p for n, p in alice.model.named_parameters() if not p.requires_grad}
    frozen_b = {n: p for n, p in bob.model.named_parameters() if not p.requires_grad}
    assert frozen_a.keys() == frozen_b.keys() and frozen_a
    assert all(frozen_a[n].data_ptr() == frozen_b[n].data_ptr() for n in frozen_a)
    trainable_a = {n: p for n, p in alice.model.named_parameters() if p.requires_grad}
    trainable_b = {n: p for n, p in bob.model.named_parameters() if p.requires_grad}
    assert all(trainable_a[n].data_ptr() != trainable_b[n].data_ptr() for n in trainable_a)
    assert not all(torch.equal(trainable_a[n], trainable_b[n]) for n in trainable_a)
    spec = alice.adapter_spec()
    assert spec is not None and (spec.rank, spec.alpha, spec.target_modules) == (4, 8.0, ("q_proj", "v_proj"))


def test_a_policys_gradient_comes_only_from_its_own_turns(pair: PolicyTrainers) -> None:
    alice = pair.trainers["alice"]
    assert isinstance(alice, TorchTrainer)
    base = _grads(alice, policy_groups(_shared_groups(), "alice"))
    assert any(float(g.abs().max()) > 0 for g in base.values())
    perturbed = _grads(alice, policy_groups(_shared_groups(bob_seed=7), "alice"))
    assert base.keys() == perturbed.keys()
    for name, g in base.items():
        torch.testing.assert_close(perturbed[name], g, rtol=0, atol=0, msg=name)
    # the check can fail: alice's own behaviour logprobs do move her gradient
    mine = _shared_groups()
    for t in mine[0].trajectories:
        t.logprobs[4] -= 1.0
    moved = _grads(alice, policy_groups(mine, "alice"))
    assert any(not torch.equal(moved[n], base[n]) for n in base)
    # and bob's own view does see his turns
    bob = pair.trainers["bob"]
    assert isinstance(bob, TorchTrainer)
    assert _grads(bob, policy_groups(_shared_groups(), "bob")).keys()


def test_advantages_are_normalised_per_role(pair: PolicyTrainers) -> None:
    """Self-play: one policy plays both seats; each seat's rewards are z-scored among that seat's episodes."""
    rewards = {"player_0": [1.0, 1.0, -1.0], "player_1": [-1.0, -1.0, 1.0, 0.5]}
    trajs = [_traj(10 + i, [(3, 7, "alice")], r, agent) for agent, rs in rewards.items() for i, r in enumerate(rs)]
    solo = PolicyTrainers(pair.trainers, ["alice"])
    result = solo.train_step([Group(task_id="t", trajectories=trajs, id="g")])
    assert result.metrics["policies/stepped"] == 1.0 and "policy/alice/loss" in result.metrics
    for agent, rs in rewards.items():
        r = torch.tensor(rs)
        expected = (r - r.mean()) / (r.std(correction=1) + 1e-6)
        got = [next(a for a in result.token_stats[t.id]["advantages"] if a is not None)
               for t in trajs if t.info["agent"] == agent]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), expected, rtol=1e-5, atol=1e-6)


def test_a_resumed_two_policy_run_continues_as_an_uninterrupted_one(tiny_llama_path: str, tmp_path: Path) -> None:
    config = _config(tiny_llama_path)
    batches = [_shared_groups(), _shared_groups(bob_seed=3)]
    for b in batches:  # rewards with signal for bob too
        for i, t in enumerate(b[0].trajectories):
            t.reward = float(i)

    def adapters(trainers: PolicyTrainers) -> dict[str, torch.Tensor]:
        return {f"{name}/{n}": p.detach().clone() for name, t in trainers.trainers.items()
                for n, p in t.model.named_parameters() if p.requires_grad}  # type: ignore[attr-defined]

    straight = build_policy_trainers(config, TorchTrainer, tiny_llama_path)
    for b in batches:
        straight.train_step(b)
    expected = adapters(straight)
    assert straight.versions() == {"alice": 2, "bob": 2}

    first = build_policy_trainers(config, TorchTrainer, tiny_llama_path)
    first.train_step(batches[0])
    first.save(tmp_path / "ckpt", {"step": 1})
    assert sorted(p.name for p in (tmp_path / "ckpt" / "policies").iterdir()) == ["alice", "bob"]
    resumed = build_policy_trainers(config, TorchTrainer, tiny_llama_path)
    assert resumed.load(tmp_path / "ckpt")["step"] == 1 and resumed.versions() == {"alice": 1, "bob": 1}
    resumed.train_step(batches[1])
    got = adapters(resumed)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.equal(v, adapters(first)[k]) for k, v in expected.items()), "step 2 changed something"


def test_a_fixed_policy_starts_from_a_checkpoint_and_never_trains(tiny_llama_path: str, tmp_path: Path) -> None:
    trainers = build_policy_trainers(_config(tiny_llama_path), TorchTrainer, tiny_llama_path)
    trainers.train_step(_shared_groups())
    trainers.save(tmp_path / "past", {"step": 1})
    config = _config(tiny_llama_path, alice={}, bob={"train": False, "init": str(tmp_path / "past")})
    league = build_policy_trainers(config, TorchTrainer, tiny_llama_path)
    assert league.trained == ["alice"] and league.versions() == {"alice": 0}
    bob = league.trainers["bob"]
    old_bob = trainers.trainers["bob"]
    for (n, p), (_, q) in zip(bob.model.named_parameters(), old_bob.model.named_parameters(), strict=True):  # type: ignore[attr-defined]
        if p.requires_grad:
            torch.testing.assert_close(p, q, msg=n)
    before = {n: p.clone() for n, p in bob.model.named_parameters() if p.requires_grad}  # type: ignore[attr-defined]
    league.train_step(_shared_groups())
    assert all(torch.equal(p, before[n]) for n, p in bob.model.named_parameters() if p.requires_grad)  # type: ignore[attr-defined]

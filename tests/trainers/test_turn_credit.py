"""Turn-level credit (turn_rloo, gigpo) and the grpo zero-spread guard against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from agentrl.trainers.advantages import compute_advantages
from agentrl.trainers.config import TrainerConfig
from agentrl.types import Message, TrainSample, Trajectory, Turn


def episode(turn_rewards: list[float], states: list[str] | None = None, extra: float = 0.0) -> TrainSample:
    """A prompt token, then per turn one sampled token followed by one env token.

    `extra` is episode reward on top of the turn rewards (a final score).
    """
    ids, mask, spans = [0], [0], []
    for _ in turn_rewards:
        spans.append((len(ids), len(ids) + 1))
        ids += [1, 2]
        mask += [1, 0]
    n = len(ids)
    return TrainSample(
        ids, mask, [0.0] * n, [0] * n, sum(turn_rewards) + extra, spans, list(turn_rewards), "g", "t",
        states if states is not None else [f"s{k}" for k in range(len(turn_rewards))],
    )


def per_turn(adv: torch.Tensor, s: TrainSample) -> list[float]:
    return [float(adv[start]) for start, _ in s.turn_spans]


def test_turn_rloo_baseline_is_the_other_samples_return_from_the_same_turn() -> None:
    group = [episode([1.0, 2.0]), episode([0.0]), episode([3.0, 0.0, 1.0])]
    # returns-to-go per turn (0 past the end): [3, 2, 0], [0, 0, 0], [4, 1, 1]
    out = compute_advantages([group], "turn_rloo")
    assert per_turn(out.advantages[0], group[0]) == pytest.approx([3 - 2.0, 2 - 0.5])
    assert per_turn(out.advantages[1], group[1]) == pytest.approx([0 - 3.5])
    assert per_turn(out.advantages[2], group[2]) == pytest.approx([4 - 1.5, 1 - 1.0, 1 - 0.0])
    assert out.advantages[0][[0, 2, 4]].tolist() == [0.0, 0.0, 0.0]  # env tokens carry nothing
    assert per_turn(out.returns[2], group[2]) == pytest.approx([4.0, 1.0, 1.0])


def test_turn_rloo_discounts_per_turn_and_places_the_final_score_on_the_last_turn() -> None:
    group = [episode([1.0, 0.0], extra=2.0), episode([0.0, 0.0])]
    out = compute_advantages([group], "turn_rloo", gamma=0.5)
    # sample 0: rho = [1, 2] -> G = [1 + 0.5 * 2, 2] = [2, 2]; sample 1: G = [0, 0]
    assert per_turn(out.advantages[0], group[0]) == pytest.approx([2.0, 2.0])
    assert per_turn(out.advantages[1], group[1]) == pytest.approx([-2.0, -2.0])


def test_turn_rloo_takes_the_kl_penalty_from_the_turn_it_fell_in() -> None:
    group = [episode([1.0, 1.0]), episode([1.0, 1.0])]
    kl = [[torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0]), torch.zeros(5)]]
    out = compute_advantages([group], "turn_rloo", kl_penalty=kl)
    # sample 0 pays 0.5 in turn 0: G = [1.5, 1]; sample 1: G = [2, 1]
    assert per_turn(out.advantages[0], group[0]) == pytest.approx([-0.5, 0.0])
    assert per_turn(out.advantages[1], group[1]) == pytest.approx([0.5, 0.0])


def test_turn_rloo_needs_two_samples() -> None:
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_advantages([[episode([1.0])]], "turn_rloo")


def test_gigpo_adds_step_advantages_of_turns_that_shared_a_state() -> None:
    group = [
        episode([0.0, 1.0], ["start", "hall"]),
        episode([0.0, 0.0], ["start", "hall"]),
        episode([0.0, 0.0, 0.0], ["start", "cellar", "hall"]),
        episode([0.0], ["start"]),
    ]
    out = compute_advantages([group], "gigpo", eps=0.0, step_weight=0.5, step_norm="mean")
    # episode returns [1, 0, 0, 0]: mean 0.25, std 0.5 -> episode advantages [1.5, -0.5, -0.5, -0.5]
    # step groups: start = all four turn 0s (returns 1, 0, 0, 0), hall = (0,1) (1,1) (2,2) (returns 1, 0, 0);
    # cellar has one member: step advantage 0
    assert per_turn(out.advantages[0], group[0]) == pytest.approx([1.5 + 0.5 * 0.75, 1.5 + 0.5 * (1 - 1 / 3)])
    assert per_turn(out.advantages[1], group[1]) == pytest.approx([-0.5 - 0.5 * 0.25, -0.5 - 0.5 / 3])
    assert per_turn(out.advantages[2], group[2]) == pytest.approx([-0.5 - 0.5 * 0.25, -0.5, -0.5 - 0.5 / 3])
    assert per_turn(out.advantages[3], group[3]) == pytest.approx([-0.5 - 0.5 * 0.25])
    assert out.metrics["adv/step_groups"] == 2.0
    assert out.metrics["adv/step_grouped_fraction"] == pytest.approx(7 / 8)


def test_gigpo_std_normalises_each_step_group() -> None:
    group = [episode([0.0, 1.0], ["a", "b"]), episode([0.0, 0.0], ["a", "b"])]
    out = compute_advantages([group], "gigpo", eps=0.0)
    e = 0.5 / (0.5**0.5)  # episode z-score of returns [1, 0]
    assert per_turn(out.advantages[0], group[0]) == pytest.approx([2 * e, 2 * e])
    assert per_turn(out.advantages[1], group[1]) == pytest.approx([-2 * e, -2 * e])


def test_gigpo_without_step_weight_is_grpo_for_final_rewards() -> None:
    group = [episode([0.0, 0.0], extra=1.0), episode([0.0]), episode([0.0, 0.0, 0.0], extra=1.0), episode([0.0])]
    gigpo = compute_advantages([group], "gigpo", step_weight=0.0)
    grpo = compute_advantages([group], "grpo")
    for a, b in zip(gigpo.advantages, grpo.advantages, strict=True):
        assert torch.allclose(a, b)


def test_gigpo_needs_a_state_per_turn() -> None:
    broken = episode([1.0, 0.0], ["only one"])
    with pytest.raises(ValueError, match="2 turns and 1 turn_states"):
        compute_advantages([[broken, episode([0.0])]], "gigpo")


def test_grpo_group_with_equal_returns_gets_no_advantage_even_with_turn_rewards() -> None:
    # return-to-go of turn 1 (2) differs from the episode mean (3); the std is 0: this used to divide by eps
    group = [episode([1.0, 2.0]), episode([1.0, 2.0])]
    out = compute_advantages([group], "grpo")
    assert all(float(a.abs().max()) == 0.0 for a in out.advantages)
    single = compute_advantages([[episode([-1.0, -1.0, -1.0])]], "grpo")
    assert float(single.advantages[0].abs().max()) == 0.0


def test_gigpo_section_only_with_gigpo() -> None:
    assert TrainerConfig(advantage="gigpo", gigpo={"step_weight": 0.3}).gigpo.step_weight == 0.3  # type: ignore[union-attr]
    assert TrainerConfig(advantage="turn_rloo").gigpo is None
    with pytest.raises(ValidationError, match=r"trainer\.gigpo is only used by trainer\.advantage=.gigpo."):
        TrainerConfig(advantage="grpo", gigpo={})
    with pytest.raises(ValidationError, match="step_norm"):
        TrainerConfig(advantage="gigpo", gigpo={"step_norm": "max"})


def test_turn_states_digest_what_the_policy_read_before_each_turn() -> None:
    # prompt [5, 6], turn [1], env [7], turn [1], env [5, 6], turn [1]
    traj = Trajectory(
        task_id="t", env="e", messages=[Message(role="user", content="x")],
        token_ids=[5, 6, 1, 7, 1, 5, 6, 1], loss_mask=[0, 0, 1, 0, 1, 0, 0, 1],
        logprobs=[0.0] * 8, versions=[0] * 8,
        turns=[Turn(2, 3), Turn(4, 5, info={"state_key": 42}), Turn(7, 8)],
    )
    states = traj.tokens().turn_states
    assert states[1] == "env:42"
    assert states[0] == states[2] != traj.turn_states()[1]  # both read [5, 6]
    assert states[0].startswith("obs:")

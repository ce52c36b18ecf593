"""Turn-level credit: exact bias and variance of each advantage estimator's policy gradient.

A two-turn toy task where the policy decides whether to take a second turn,
so the number of turns depends on the policy (as it does for every tool-use
agent):

- turn 0: *stop* (reward `R_STOP`, the episode ends) or *go on* (an
  intermediate reward `R_GO`), with P(go on) = p0 = sigmoid(theta0);
- turn 1: *good* (reward 1) or *bad* (reward 0), P(good) = p1 = sigmoid(theta1).

One action is one sampled token, so the loss's score-function gradient of a
group of n samples is g = (1/n) sum_i sum_k d/dtheta log pi(a_ik) * A_ik. All
3^n outcomes of a group are enumerated with their probabilities, and every
estimator's advantages come from agentrl's own `compute_advantages`, so E[g]
and the variance of g are exact (no Monte Carlo noise). The true gradient of
J = E[sum of rewards] is known in closed form; the baseline in the same run is
episode-level `rloo`, whose expectation is also exactly the true gradient.

Also measured: the per-turn-index baseline summed over the sample's own turns
(MT-GRPO style, `naive_turn` below, a reference that agentrl does not offer).
Its baseline has as many terms as the sample has turns, so it depends on the
sample's choice to stop, and its expected gradient is off (verl RFC #7244).

Summary line: rel_bias_turn_rloo=... rel_bias_rloo=... rel_bias_naive_turn=...
var_turn_rloo_over_rloo=... cos_gigpo=... cos_grpo=...
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass

import torch

from agentrl.trainers.advantages import compute_advantages
from agentrl.types import TrainSample

R_STOP = 0.3
R_GO = 0.5
OUTCOMES = ("stop", "good", "bad")  # "good"/"bad": went on, then the second action


@dataclass(frozen=True)
class Toy:
    """The toy task's policy: P(go on) and P(good)."""

    p0: float
    p1: float

    def prob(self, outcome: str) -> float:
        if outcome == "stop":
            return 1.0 - self.p0
        return self.p0 * (self.p1 if outcome == "good" else 1.0 - self.p1)

    def true_gradient(self) -> torch.Tensor:
        """dJ/d(theta0, theta1) for J = (1 - p0) R_STOP + p0 (R_GO + p1)."""
        p0, p1 = self.p0, self.p1
        return torch.tensor([p0 * (1 - p0) * (R_GO + p1 - R_STOP), p0 * p1 * (1 - p1)], dtype=torch.float64)

    def scores(self, outcome: str) -> list[torch.Tensor]:
        """d/dtheta log pi of each action taken, one per turn."""
        p0, p1 = self.p0, self.p1
        if outcome == "stop":
            return [torch.tensor([-p0, 0.0], dtype=torch.float64)]
        second = 1 - p1 if outcome == "good" else -p1
        return [torch.tensor([1 - p0, 0.0], dtype=torch.float64), torch.tensor([0.0, second], dtype=torch.float64)]


def sample(outcome: str, i: int) -> TrainSample:
    """The trajectory of one outcome: prompt, turn 0's token [, env token, turn 1's token]."""
    if outcome == "stop":
        return TrainSample([0, 1], [0, 1], [0.0] * 2, [0] * 2, R_STOP, [(1, 2)], [R_STOP], "g", f"t{i}", ["s0"])
    second = 1.0 if outcome == "good" else 0.0
    return TrainSample(
        [0, 1, 2, 3], [0, 1, 0, 1], [0.0] * 4, [0] * 4, R_GO + second, [(1, 2), (3, 4)], [R_GO, second], "g",
        f"t{i}", ["s0", "s1"],
    )


def naive_turn(group: list[TrainSample]) -> list[torch.Tensor]:
    """Per-turn-index mean-centred rewards summed over the sample's own remaining turns (the biased reference)."""
    depth = max(len(s.turn_spans) for s in group)
    means = [
        sum(s.turn_rewards[k] for s in group if len(s.turn_spans) > k) / sum(len(s.turn_spans) > k for s in group)
        for k in range(depth)
    ]
    out = []
    for s in group:
        adv = torch.zeros(len(s.input_ids))
        for k, (start, end) in enumerate(s.turn_spans):
            adv[start:end] = sum(s.turn_rewards[j] - means[j] for j in range(k, len(s.turn_spans)))
        out.append(adv)
    return out


def advantages(estimator: str, group: list[TrainSample]) -> list[torch.Tensor]:
    if estimator == "naive_turn":
        return naive_turn(group)
    return compute_advantages([group], estimator, eps=1e-6).advantages


def gradient_moments(toy: Toy, estimator: str, n: int) -> tuple[torch.Tensor, float]:
    """E[g] and E|g - E[g]|^2 over every outcome of a group of n, exactly."""
    mean = torch.zeros(2, dtype=torch.float64)
    second = 0.0
    for outcomes in itertools.product(OUTCOMES, repeat=n):
        prob = math.prod(toy.prob(o) for o in outcomes)
        group = [sample(o, i) for i, o in enumerate(outcomes)]
        g = torch.zeros(2, dtype=torch.float64)
        for o, s, adv in zip(outcomes, group, advantages(estimator, group), strict=True):
            for score, (start, _end) in zip(toy.scores(o), s.turn_spans, strict=True):
                g += score * float(adv[start])
        g /= n
        mean += prob * g
        second += prob * float(g @ g)
    return mean, second - float(mean @ mean)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--p0", type=float, default=0.6, help="P(go on) at turn 0")
    parser.add_argument("--p1", type=float, default=0.7, help="P(good) at turn 1")
    args = parser.parse_args()
    toy = Toy(args.p0, args.p1)
    truth = toy.true_gradient()
    print(f"true gradient {truth.tolist()} (group size {args.group_size}, {3 ** args.group_size} outcomes)")
    rel_bias: dict[str, float] = {}
    cos: dict[str, float] = {}
    var: dict[str, float] = {}
    for estimator in ("rloo", "turn_rloo", "naive_turn", "grpo", "gigpo"):
        mean, variance = gradient_moments(toy, estimator, args.group_size)
        rel_bias[estimator] = float((mean - truth).norm() / truth.norm())
        cos[estimator] = float(mean @ truth / (mean.norm() * truth.norm()))
        var[estimator] = variance
        print(
            f"{estimator:>10}: E[g]={[round(x, 5) for x in mean.tolist()]} relative bias {rel_bias[estimator]:.4f} "
            f"cos(E[g], true) {cos[estimator]:.4f} variance {variance:.5f}"
        )
    print(
        f"rel_bias_turn_rloo={rel_bias['turn_rloo']:.4f} rel_bias_rloo={rel_bias['rloo']:.4f} "
        f"rel_bias_naive_turn={rel_bias['naive_turn']:.4f} "
        f"var_turn_rloo_over_rloo={var['turn_rloo'] / var['rloo']:.3f} "
        f"cos_gigpo={cos['gigpo']:.4f} cos_grpo={cos['grpo']:.4f}"
    )


if __name__ == "__main__":
    main()

"""benchmarks/credit_assignment.py: the exact expectations behind its numbers.

Every estimator's advantages come from `compute_advantages`, and the group's
outcomes are enumerated exactly, so these are properties of the estimators,
not of sampling noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("credit_assignment")


@pytest.mark.parametrize("p0,p1", [(0.6, 0.7), (0.2, 0.5), (0.9, 0.1)])
def test_leave_one_out_estimators_are_unbiased_when_the_policy_decides_to_stop(
    bench: ModuleType, p0: float, p1: float
) -> None:
    toy = bench.Toy(p0, p1)
    truth = toy.true_gradient()
    for estimator in ("turn_rloo", "rloo"):
        mean, _ = bench.gradient_moments(toy, estimator, 4)
        assert torch.allclose(mean, truth, atol=1e-9), (estimator, mean, truth)
    naive, _ = bench.gradient_moments(toy, "naive_turn", 4)
    assert float((naive - truth).norm()) > 0.05 * float(truth.norm())  # the per-turn-index reference is not


def test_turn_baseline_lowers_the_variance_of_rloo_here(bench: ModuleType) -> None:
    toy = bench.Toy(0.6, 0.7)
    _, turn_var = bench.gradient_moments(toy, "turn_rloo", 4)
    _, episode_var = bench.gradient_moments(toy, "rloo", 4)
    assert turn_var < 0.9 * episode_var


def test_true_gradient_matches_finite_differences(bench: ModuleType) -> None:
    def toy_at(theta0: float, theta1: float) -> object:
        return bench.Toy(1 / (1 + math.exp(-theta0)), 1 / (1 + math.exp(-theta1)))

    def objective(theta0: float, theta1: float) -> float:
        t = toy_at(theta0, theta1)
        return sum(t.prob(o) * sum(bench.sample(o, 0).turn_rewards) for o in bench.OUTCOMES)

    theta0, theta1, h = 0.3, -0.4, 1e-5
    toy = toy_at(theta0, theta1)
    numeric = [
        (objective(theta0 + h, theta1) - objective(theta0 - h, theta1)) / (2 * h),
        (objective(theta0, theta1 + h) - objective(theta0, theta1 - h)) / (2 * h),
    ]
    assert toy.true_gradient().tolist() == pytest.approx(numeric, rel=1e-5)

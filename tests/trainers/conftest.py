"""Helpers for trainer tests: Groups/Trajectories built directly, no engine."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from agentrl.types import Group, Trajectory, Turn

REPO = Path(__file__).resolve().parents[2]


def make_trajectory(
    prompt: Sequence[int],
    completion: Sequence[int],
    *,
    reward: float,
    logprobs: Sequence[float] | None = None,
    version: int = 0,
    group_id: str = "",
) -> Trajectory:
    """A one-turn trajectory: prompt (mask 0) then sampled completion (mask 1)."""
    n_p, n_c = len(prompt), len(completion)
    lps = list(logprobs) if logprobs is not None else [-1.0] * n_c
    return Trajectory(
        task_id="t",
        env="test",
        messages=[],
        token_ids=list(prompt) + list(completion),
        loss_mask=[0] * n_p + [1] * n_c,
        logprobs=[0.0] * n_p + lps,
        versions=[-1] * n_p + [version] * n_c,
        turns=[Turn(start=n_p, end=n_p + n_c)],
        reward=reward,
        group_id=group_id,
    )


def random_groups(
    num_groups: int,
    group_size: int,
    *,
    seed: int = 0,
    vocab: int = 2000,
    prompt_len: tuple[int, int] = (4, 12),
    completion_len: tuple[int, int] = (3, 20),
    version: int = 0,
) -> list[Group]:
    """Groups with random ids/lengths/rewards; behaviour logprobs are made up (-1.5 +- noise)."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))]
        trajs = []
        for _ in range(group_size):
            comp = [rng.randrange(1, vocab) for _ in range(rng.randint(*completion_len))]
            lps = [-1.5 + rng.uniform(-0.5, 0.5) for _ in comp]
            trajs.append(
                make_trajectory(
                    prompt,
                    comp,
                    reward=float(rng.random() < 0.5),
                    logprobs=lps,
                    version=version,
                    group_id=f"g{g}",
                )
            )
        groups.append(Group(task_id=f"task{g}", trajectories=trajs, id=f"g{g}"))
    return groups


class Builders:
    """Handed to tests by the `build` fixture (conftest modules cannot be imported directly)."""

    trajectory = staticmethod(make_trajectory)
    groups = staticmethod(random_groups)


@pytest.fixture
def build() -> type[Builders]:
    return Builders


@pytest.fixture
def ray_train_cmd(tiny_llama_path: str) -> Callable[..., list[str]]:
    """`ray_train_cmd(out_dir, *overrides)`: `agentrl train` on the calculator example with the tiny model and
    the `ray` trainer (2 gloo ranks of half a CPU each), run `ci` under `out_dir`."""

    def command(out_dir: Path, *overrides: str) -> list[str]:
        return [
            sys.executable, "-m", "agentrl.cli", "train", str(REPO / "examples" / "calculator.yaml"),
            f"model.path={tiny_llama_path}", f"run.output_dir={out_dir}", "run.name=ci", "engine.dtype=fp32",
            "trainer.name=ray", "trainer.world_size=2", "trainer.num_cpus_per_rank=0.5", "trainer.dtype=fp32",
            "trainer.entropy_coef=0.01", "run.eval_every=0", "run.loggers=[jsonl]", *overrides,
        ]  # fmt: skip

    return command

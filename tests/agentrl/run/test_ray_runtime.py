"""Custom Ray resources in the `ray` engine pool's and the `ray` trainer's configs: validated, naming the key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.run.ray_runtime import check_resources


def test_custom_resources_are_kept_as_floats() -> None:
    assert check_resources({"trainer_node": 1, "big_mem": 0.5}, key="trainer.resources") == {
        "trainer_node": 1.0, "big_mem": 0.5,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"CPU": 1}, r"trainer.resources.CPU: set CPUs/GPUs with their own keys"),
        ({"GPU": 1}, r"trainer.resources.GPU: set CPUs/GPUs with their own keys"),
        ({"node_a": 0}, r"trainer.resources.node_a=0: a resource amount must be > 0"),
        ({"node_a": -1}, r"trainer.resources.node_a=-1: a resource amount must be > 0"),
    ],
)
def test_bad_resources_name_the_key(value: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_resources(value, key="trainer.resources")


def test_the_engine_pool_and_the_trainer_group_validate_their_resources() -> None:
    from agentrl.engines.ray_pool import RayEnginePool
    from agentrl.trainers.ray_group import RayTrainerConfig

    assert RayEnginePool.Config(resources={"engine_node": 1}).resources == {"engine_node": 1.0}
    assert RayTrainerConfig(resources={"trainer_node": 2}).resources == {"trainer_node": 2.0}
    with pytest.raises(ValidationError, match=r"engine.resources.GPU: set CPUs/GPUs with their own keys"):
        RayEnginePool.Config(resources={"GPU": 1})
    with pytest.raises(ValidationError, match=r"trainer.resources.x=0"):
        RayTrainerConfig(resources={"x": 0})

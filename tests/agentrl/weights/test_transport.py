"""The collective transport's group backend: nccl only when both ends hold their weights on GPUs."""

from __future__ import annotations

import pytest

from agentrl.weights.transport import GroupSpec, group_backend


@pytest.mark.parametrize(
    ("sender", "engines_on_gpu", "backend"),
    [("cuda", True, "nccl"), ("cuda", False, "gloo"), ("cpu", True, "gloo"), ("cpu", False, "gloo")],
)
def test_the_backend_follows_where_both_ends_hold_weights(sender: str, engines_on_gpu: bool, backend: str) -> None:
    assert group_backend(sender, engines_on_gpu) == backend


def test_the_workers_are_told_the_backend() -> None:
    spec = GroupSpec("10.0.0.1", 29500, 5, 30.0, backend=group_backend("cuda", True))
    assert spec.worker_init(3) == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5,
        "timeout_s": 30.0, "group_backend": "nccl",
    }  # fmt: skip


def test_a_trainer_in_this_process_reports_where_its_weights_are() -> None:
    import torch

    from agentrl.weights.buckets import NamedTensorBuckets

    def tensors() -> list[tuple[str, torch.Tensor]]:
        return [("w", torch.zeros(2))]

    assert NamedTensorBuckets(tensors).weight_sender().device == "cpu"
    assert NamedTensorBuckets(tensors, source_device="cuda").weight_sender().device == "cuda"

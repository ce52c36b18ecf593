"""Delta weight sync: only the elements whose bits changed travel, and the engine ends up bit-equal to a full sync."""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from agentrl.weights.buckets import copy_buckets_into  # noqa: E402
from agentrl.weights.delta import MARK, DeltaEncoder, Patch, apply_patch, decoded  # noqa: E402


def _sync(encoder: DeltaEncoder, tensors: dict[str, Any], mirror: dict[str, Any], *, version: int,
          engine_version: int, dtype: Any = torch.bfloat16) -> Any:  # fmt: skip
    source = encoder.source(lambda: iter(tensors.items()), version=version, engine_version=engine_version,
                            dtype=dtype, bucket_mb=0.01)  # fmt: skip
    copy_buckets_into(mirror, source.buckets())
    return source


def test_a_delta_sends_only_changed_bits_and_the_receiver_ends_bit_equal() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(64, 32, generator=gen), "b": torch.randn(128, generator=gen),
               "frozen": torch.randn(16, 16, generator=gen), "steps": torch.tensor([3])}  # fmt: skip
    mirror = {k: torch.zeros_like(v, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype)
              for k, v in weights.items()}  # fmt: skip
    encoder = DeltaEncoder()
    first = _sync(encoder, weights, mirror, version=1, engine_version=0)
    assert first.full and first.ratio == pytest.approx(1.0)  # no base yet: the whole model
    assert encoder.version == 1

    with torch.no_grad():
        weights["a"].view(-1)[[5, 700, 2047]] += 1.0  # three elements move past a bf16 step
        weights["a"].view(-1)[9] += 1e-7  # below bf16's resolution: its bits in bf16 do not change
        weights["b"].mul_(-1)  # every element changes: the whole tensor is cheaper than a patch
    second = _sync(encoder, weights, mirror, version=2, engine_version=1)
    assert not second.full and second.patched_tensors == 1
    assert (second.touched_tensors, second.tensors) == (3, 4)  # a patched, b and the int buffer whole, frozen not sent
    dense = 64 * 32 * 2 + 128 * 2 + 16 * 16 * 2 + 8
    assert second.dense_bytes == dense
    assert second.sent_bytes == 3 * (4 + 2) + 8 * 2 + 128 * 2 + 8  # a's patch (+ shape), b whole, the int buffer
    assert second.ratio == pytest.approx(second.sent_bytes / dense)
    for name, t in weights.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert torch.equal(mirror[name].view(-1).view(torch.int16 if t.is_floating_point() else torch.int64),
                           want.reshape(-1).view(torch.int16 if t.is_floating_point() else torch.int64)), name

    # an engine at another version than the encoder's base gets the whole model again
    stale = {k: torch.zeros_like(v) for k, v in mirror.items()}
    third = _sync(encoder, weights, stale, version=3, engine_version=1)
    assert third.full and all(torch.equal(stale[k], mirror[k]) for k in mirror)


def test_a_sync_that_does_not_finish_leaves_no_base() -> None:
    weights = {"a": torch.ones(8), "b": torch.ones(8)}
    encoder = DeltaEncoder()
    source = encoder.source(lambda: iter(weights.items()), version=1, engine_version=0, dtype=torch.float32,
                            bucket_mb=1e-5)  # fmt: skip
    next(iter(source.buckets()))  # the transport failed after the first bucket
    assert encoder.version is None
    again = encoder.source(lambda: iter(weights.items()), version=1, engine_version=0, dtype=torch.float32)
    assert again.full
    with pytest.raises(RuntimeError, match="read once"):
        list(source.buckets())


def test_patches_are_checked_before_they_are_written() -> None:
    target = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="shape"):
        apply_patch(target, Patch("w", (16,), torch.tensor([1]), torch.tensor([1.0])))
    with pytest.raises(ValueError, match="outside"):
        apply_patch(target, Patch("w", (4, 4), torch.tensor([16]), torch.tensor([1.0])))
    assert not target.any()
    with pytest.raises(ValueError, match="incomplete patch for w"):
        list(decoded([("w" + MARK + "idx", torch.tensor([1])), ("w" + MARK + "val", torch.tensor([1.0]))]))
    with pytest.raises(KeyError, match="unknown parameter 'x'"):
        copy_buckets_into({"w": target}, [[("x" + MARK + "idx", torch.tensor([0])), ("x" + MARK + "val", torch.ones(1)),
                                           ("x" + MARK + "shape", torch.tensor([4, 4]))]])  # fmt: skip


def _groups(seed: int) -> list[Any]:
    from agentrl.types import Group, Trajectory, Turn

    rng = random.Random(seed)
    prompt = [rng.randrange(10, 2000) for _ in range(6)]
    trajs = []
    for i in range(4):
        comp = [rng.randrange(10, 2000) for _ in range(8)]
        trajs.append(Trajectory(task_id="t", env="test", messages=[], token_ids=prompt + comp,
                                loss_mask=[0] * 6 + [1] * 8, logprobs=[0.0] * 6 + [-1.5] * 8,
                                versions=[-1] * 6 + [0] * 8, turns=[Turn(start=6, end=14)],
                                reward=float(i % 2), group_id="g"))  # fmt: skip
    return [Group(task_id="t", trajectories=trajs, id="g")]


@pytest.mark.model
@pytest.mark.parametrize(("dtype", "lr"), [("bf16", 1e-5), ("fp32", 1e-5)])
async def test_full_fine_tuning_syncs_deltas_into_the_hf_engine(tiny_llama_path: str, dtype: str, lr: float) -> None:
    from agentrl.engines.hf import HFEngine
    from agentrl.run.wiring import sync_weights
    from agentrl.trainers.torch_trainer import TorchTrainer
    from agentrl.weights.buckets import hf_named_tensors

    trainer = TorchTrainer({"delta_sync": True, "lr": lr, "dtype": "fp32"}, tiny_llama_path)
    engine = HFEngine(HFEngine.Config(model=tiny_llama_path, dtype=dtype, max_batch_size=2, seed=1))
    wire = torch.bfloat16 if dtype == "bf16" else torch.float32
    bits = torch.int16 if dtype == "bf16" else torch.int32
    try:
        assert engine.weights_dtype() == str(wire).removeprefix("torch.")
        ratios = []
        for step in range(3):
            trainer.train_step(_groups(step))
            metrics = await sync_weights(engine, trainer)
            assert engine.policy_version == trainer.policy_version == step + 1
            assert metrics["weight_sync/delta_full"] == float(step == 0)  # the first sync has no base
            ratios.append(metrics["weight_sync/delta_ratio"])
            theirs = dict(engine.model.named_parameters())
            for name, t in hf_named_tensors(trainer.model):
                assert torch.equal(theirs[name].detach().reshape(-1).view(bits),
                                   t.detach().to(wire).reshape(-1).view(bits)), (step, name)  # fmt: skip
        assert ratios[0] == pytest.approx(1.0)
        if dtype == "bf16":
            assert ratios[1] < 0.5 and ratios[2] < 0.5, ratios  # most bf16 bits stay put after a small step
        else:
            assert ratios[1] > 0.5, ratios  # Adam moves nearly every fp32 element: mostly whole tensors
    finally:
        await engine.close()


def test_delta_sync_is_for_full_fine_tuning() -> None:
    from agentrl.trainers.config import TrainerConfig

    with pytest.raises(ValueError, match="delta_sync=true is for full fine-tuning"):
        TrainerConfig(delta_sync=True, lora={"r": 4})


def test_the_ray_trainer_says_it_does_not_send_deltas() -> None:
    from agentrl.trainers.ray_group import RayTrainerConfig

    with pytest.raises(ValueError, match="delta_sync=true is not built for the ray trainer"):
        RayTrainerConfig(delta_sync=True)

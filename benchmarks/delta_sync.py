"""Full fine-tuning's delta sync against the whole-model sync, on real optimizer steps of SmolLM2-135M.

A `torch` trainer (full fine-tuning, fp32 master weights, AdamW at `--lr`) takes
`--steps` GRPO steps on groups of real text (the model's own tokenizer). After each
step, for each engine dtype (fp32 and bf16), two embedded hf engines of that dtype
receive the new weights: one the whole model (the baseline, today's sync), one a
delta (`agentrl.weights.delta`: only the elements whose bits changed in that dtype;
the first sync has no base and sends everything). Per step it prints the bytes each
sent and the time each took, and checks that the two engines hold the same bits.

Summary line: fp32_delta_ratio=<bytes sent / whole model, mean over steps 2..N>
bf16_delta_ratio=<same> fp32_delta_vs_full_s=<delta sync time / full sync time, steps 2..N>
bf16_delta_vs_full_s=<same> fp32_tensors_touched=<share of tensors with any element sent, steps 2..N>
bf16_tensors_touched=<same> steps=<N>. A receiver that re-packs each tensor it loads (vLLM) reloads the touched
share whatever the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEXTS = [
    "What is 17 times 23? Use the calculator tool and answer with the number.",
    "Compute (48 + 19) * 3 and reply with only the result.",
    "A train leaves at 3 pm and travels 120 km at 60 km/h. When does it arrive?",
    "What is the square root of 1764? Show one tool call, then the answer.",
]


def groups(tokenizer: Any, seed: int, group_size: int) -> list[Any]:
    """One group per text: the prompt, then `group_size` continuations of real text with 0/1 rewards."""
    from agentrl.types import Group, Trajectory, Turn

    rng = random.Random(seed)
    out = []
    for g, text in enumerate(TEXTS):
        prompt = tokenizer.encode(text)
        trajs = []
        for i in range(group_size):
            answer = tokenizer.encode(" " + " ".join(rng.sample(TEXTS, 2)))[:48]
            n_p, n_c = len(prompt), len(answer)
            trajs.append(Trajectory(
                task_id=f"t{g}", env="bench", messages=[], token_ids=prompt + answer,
                loss_mask=[0] * n_p + [1] * n_c, logprobs=[0.0] * n_p + [-2.0] * n_c,
                versions=[-1] * n_p + [0] * n_c, turns=[Turn(start=n_p, end=n_p + n_c)],
                reward=float(i % 2), group_id=f"g{g}",
            ))  # fmt: skip
        out.append(Group(task_id=f"t{g}", trajectories=trajs, id=f"g{g}"))
    return out


async def timed(engine: Any, source: Any, version: int) -> float:
    started = time.perf_counter()
    await engine.update_weights(source, version)
    return time.perf_counter() - started


async def main(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer

    from agentrl.engines.hf import HFEngine
    from agentrl.engines.models import resolve_model
    from agentrl.trainers.torch_trainer import TorchTrainer
    from agentrl.weights.buckets import hf_named_tensors
    from agentrl.weights.delta import DeltaEncoder

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = TorchTrainer({"lr": args.lr, "dtype": "fp32", "micro_batch_tokens": 2048}, path)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    engines = {(d, kind): HFEngine(HFEngine.Config(model=path, dtype=d, max_batch_size=1))
               for d in dtypes for kind in ("full", "delta")}  # fmt: skip
    encoders = {d: DeltaEncoder() for d in dtypes}
    ratios: dict[str, list[float]] = {d: [] for d in dtypes}
    speed: dict[str, list[float]] = {d: [] for d in dtypes}
    touched: dict[str, list[float]] = {d: [] for d in dtypes}
    print(f"model={args.model} lr={args.lr} steps={args.steps} threads={torch.get_num_threads()}")
    try:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            trainer.train_step(groups(tokenizer, step, args.group_size))
            train_s = time.perf_counter() - t0
            for d, dtype in dtypes.items():
                full = trainer.state_for_engines(dtype=dtype)
                full_s = await timed(engines[(d, "full")], full, step)
                delta = encoders[d].source(lambda: hf_named_tensors(trainer.model), version=step,
                                           engine_version=step - 1, dtype=dtype)  # fmt: skip
                delta_s = await timed(engines[(d, "delta")], delta, step)
                a = dict(engines[(d, "full")].model.named_parameters())
                b = dict(engines[(d, "delta")].model.named_parameters())
                same = all(torch.equal(a[n], b[n]) for n in a)
                print(f"step {step} {d}: train {train_s:.1f}s  full {full.sent_bytes / 2**20:.1f} MiB {full_s:.3f}s  "
                      f"delta {delta.sent_bytes / 2**20:.2f} MiB ({delta.ratio:.4f}, {delta.patched_tensors} tensors "
                      f"patched, {delta.touched_tensors}/{delta.tensors} touched, full={delta.full}) {delta_s:.3f}s  "
                      f"same_bits={same}")  # fmt: skip
                if not same:
                    raise SystemExit(f"the delta-synced {d} engine differs from the fully synced one at step {step}")
                if step > 1:
                    ratios[d].append(delta.ratio)
                    speed[d].append(delta_s / full_s)
                    touched[d].append(delta.touched_tensors / max(delta.tensors, 1))
    finally:
        for engine in engines.values():
            await engine.close()
    parts = [f"{d}_delta_ratio={statistics.mean(ratios[d]):.4f}" for d in dtypes]
    parts += [f"{d}_delta_vs_full_s={statistics.mean(speed[d]):.2f}" for d in dtypes]
    parts += [f"{d}_tensors_touched={statistics.mean(touched[d]):.3f}" for d in dtypes]
    print(" ".join([*parts, f"steps={args.steps}"]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or path (no hub download)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (the first sync has no base)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (RL fine-tuning scale)")
    parser.add_argument("--group-size", type=int, default=4)
    asyncio.run(main(parser.parse_args()))

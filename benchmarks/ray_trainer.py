"""The `ray` trainer against the in-process `torch` trainer: step time and the weights' trip to the engine.

Both train SmolLM2-135M-Instruct with the README example's trainer settings
(LoRA r=16, fp32, shared prefix, TIS) on the same batch: `--groups` GRPO groups
of `--group-size` samples, a `--prompt-tokens` prompt shared by each group and
completions of `--completion-tokens` (random ids, random rewards; measured
after one warm-up step). In the same run:

- baseline: one `TorchTrainer` in this process, `--threads` torch threads;
- ray: `--world-size` ranks as Ray actors (gloo), the machine's threads split
  between them, each rank training its shard of every batch.

Also timed: `state_for_engines()` read to the end, in-process (a copy of each
bucket) and streamed from rank 0 through Ray's object store (what an engine
pays per weight sync with the `ray` trainer).

Then memory under DeepSpeed ZeRO-3 (`data_parallel: deepspeed`): the same
model fully fine-tuned (no LoRA: the optimizer state is the point) for one
small step in this process and on `--world-size` ZeRO-3 ranks; each side
reports the bytes of parameters and optimizer state it holds (ZeRO: its
partitions, its fp32 master copy included). `zero3_mem_ratio` is the largest
rank's total over one process's: about 1/N, plus ZeRO's master copy, which
fp32 training does not need (one process: 3 copies of the weights, each
ZeRO-3 rank 4/N; 0.67 for N=2, where mixed precision would give 1/N).

Summary line: step_s_ray=... step_s_local=... speedup=<local / ray> weights_s_ray=... weights_s_local=...
zero3_mem_ratio=... (`--memory-only`: only the last)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agentrl.types import Group, Trajectory, Turn

TRAINER: dict[str, Any] = {
    "advantage": "grpo", "lora": {"r": 16, "alpha": 32}, "lr": 1e-4, "temperature": 0.7,
    "micro_batch_tokens": 4096, "shared_prefix": True, "dtype": "fp32", "off_policy": {"mode": "tis", "tis_cap": 2.0},
}  # fmt: skip


def batch(groups: int, size: int, prompt_tokens: int, completion_tokens: int, seed: int) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(10, 40000) for _ in range(prompt_tokens)]
        trajs = []
        for _ in range(size):
            comp = [rng.randrange(10, 40000) for _ in range(completion_tokens)]
            n_p = len(prompt)
            trajs.append(Trajectory(
                task_id=f"t{g}", env="bench", messages=[], token_ids=prompt + comp,
                loss_mask=[0] * n_p + [1] * len(comp), logprobs=[0.0] * n_p + [-2.0] * len(comp),
                versions=[-1] * n_p + [0] * len(comp), turns=[Turn(start=n_p, end=n_p + len(comp))],
                reward=float(rng.random() < 0.5), group_id=f"g{g}",
            ))  # fmt: skip
        out.append(Group(task_id=f"t{g}", trajectories=trajs, id=f"g{g}"))
    return out


def timed(trainer: Any, args: argparse.Namespace) -> tuple[float, float]:
    """Median step seconds over `--steps` steps (after one warm-up) and seconds to read the engine weights."""
    make = lambda i: batch(args.groups, args.group_size, args.prompt_tokens, args.completion_tokens, seed=i)  # noqa: E731
    trainer.train_step(make(0))
    steps = []
    for i in range(args.steps):
        start = time.perf_counter()
        trainer.train_step(make(i + 1))
        steps.append(time.perf_counter() - start)
    start = time.perf_counter()
    tensors = sum(len(bucket) for bucket in trainer.state_for_engines().buckets())
    weights = time.perf_counter() - start
    assert tensors > 0
    return statistics.median(steps), weights


def state_memory(args: argparse.Namespace) -> float:
    """Parameter + optimizer bytes per ZeRO-3 rank over one process's, after one full fine-tuning step each."""
    from agentrl.trainers.deepspeed_backend import model_state_bytes
    from agentrl.trainers.ray_group import RayTrainerGroup
    from agentrl.trainers.torch_trainer import TorchTrainer

    full = {k: v for k, v in TRAINER.items() if k != "lora"}
    small = batch(1, 2, 16, 16, seed=0)
    single = TorchTrainer(full, args.model)
    single.train_step(small)
    one = model_state_bytes(single.model, single.optimizer)
    del single
    zero3 = {"data_parallel": "deepspeed", "deepspeed": {"zero_stage": 3}}
    per_rank = max(1, args.threads // args.world_size)
    group = RayTrainerGroup(dict(full, **zero3, world_size=args.world_size, num_cpus_per_rank=per_rank), args.model)
    try:
        group.train_step(small)
        ranks = group.state_bytes()
    finally:
        group.close()
    mb = 1024 * 1024
    print(f"one process: params {one['params'] / mb:.0f} MiB + optimizer {one['optimizer'] / mb:.0f} MiB")
    for i, r in enumerate(ranks):
        print(f"ZeRO-3 rank {i}/{args.world_size}: params {r['params'] / mb:.0f} MiB + optimizer "
              f"{r['optimizer'] / mb:.0f} MiB (Adam's moments and the fp32 master partition)")  # fmt: skip
    return max(r["params"] + r["optimizer"] for r in ranks) / (one["params"] + one["optimizer"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--completion-tokens", type=int, default=40)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory-only", action="store_true", help="only the ZeRO-3 memory comparison")
    args = parser.parse_args()

    import torch

    from agentrl.trainers.ray_group import RayTrainerGroup
    from agentrl.trainers.torch_trainer import TorchTrainer

    torch.set_num_threads(args.threads)
    if args.memory_only:
        print(f"zero3_mem_ratio={state_memory(args):.3f}")
        return
    local_step, local_weights = timed(TorchTrainer(TRAINER, args.model), args)
    print(f"torch trainer in this process ({args.threads} threads): {local_step:.2f}s/step, "
          f"weights read in {local_weights:.2f}s")  # fmt: skip
    per_rank = max(1, args.threads // args.world_size)
    group = RayTrainerGroup(dict(TRAINER, world_size=args.world_size, num_cpus_per_rank=per_rank), args.model)
    try:
        ray_step, ray_weights = timed(group, args)
    finally:
        group.close()
    print(f"ray trainer, {args.world_size} ranks x {per_rank} threads: {ray_step:.2f}s/step, "
          f"weights streamed from rank 0 in {ray_weights:.2f}s")  # fmt: skip
    mem_ratio = state_memory(args)
    print(f"step_s_ray={ray_step:.3f} step_s_local={local_step:.3f} speedup={local_step / ray_step:.2f} "
          f"weights_s_ray={ray_weights:.3f} weights_s_local={local_weights:.3f} zero3_mem_ratio={mem_ratio:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""One rank of the data-parallel equivalence test (run as a script by test_distributed.py).

argv: model_path out_dir configs_json (a list). Rank/world come from torchrun-style env vars.
For each config writes the metrics and the gradients this rank ends up with after
the gradient all-reduce (DDP, or sequence-parallel reduction), and the token stats it
wrote into the trajectories (None where it did not), to `{index}_rank{rank}.pt`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import random_groups

from agentrl.trainers.distributed import full_tensor, init_from_env
from agentrl.trainers.torch_trainer import TorchTrainer


def main() -> None:
    model_path, out, configs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    world = init_from_env("gloo")
    torch.set_num_threads(1)
    for k, config in enumerate(configs):
        trainer = TorchTrainer(config, model_path)
        groups = random_groups(3, 3, seed=7)
        result = trainer.compute_gradients(groups)
        metrics = result.metrics
        # under FSDP a grad is this rank's shard: gathered whole (every rank, same order)
        grads = {n: full_tensor(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
        token_stats = [result.token_stats.get(tr.id) for g in groups for tr in g.trajectories]
        torch.save(
            {"metrics": metrics, "grads": grads, "token_stats": token_stats}, out / f"{k}_rank{world.rank}.pt"
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

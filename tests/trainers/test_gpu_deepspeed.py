"""DeepSpeed ZeRO-3 as a group of one on the device (pytest -m gpu; scripts/gpu_check.sh's DeepSpeed part).

`trainer.name=torch` with `data_parallel: deepspeed` makes a process group of
one (nccl on CUDA, gloo on the CPU), so it runs in a subprocess. Skips where
deepspeed does not import (the GPU check installs its wheel when it can).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gpu_device import gpu_test_device

pytestmark = [pytest.mark.gpu, pytest.mark.model, pytest.mark.distributed, pytest.mark.slow]


def test_zero3_in_a_group_of_one_trains_like_the_plain_trainer_on_the_device() -> None:
    """Two RL steps under ZeRO-3 give the plain trainer's losses and weights (gathered for the engines,
    in buckets), with every parameter held as a DeepSpeed partition on the device."""
    device = gpu_test_device()
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (scripts/gpu_check.sh installs its wheel)")
    from agentrl.engines.models import resolve_model

    model = resolve_model("synthetic:llama-tiny")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from conftest import random_groups
        from agentrl.trainers.torch_trainer import TorchTrainer

        cfg = dict(dtype="fp32", lr=1e-3, micro_batch_tokens=96, device={device!r})
        plain = TorchTrainer(cfg, {model!r})
        ds = TorchTrainer(dict(cfg, data_parallel="deepspeed", deepspeed={{"zero_stage": 3}}), {model!r})
        assert ds.partitioned
        for p in ds.model.parameters():
            assert hasattr(p, "ds_tensor") and p.ds_tensor.device.type == {device!r}, p.ds_tensor.device
        for seed in (7, 8):
            a = plain.train_step(random_groups(3, 3, seed=seed)).metrics["loss"]
            b = ds.train_step(random_groups(3, 3, seed=seed)).metrics["loss"]
            assert abs(a - b) <= 1e-4 * abs(a) + 1e-6, (a, b)
        weights = lambda t: {{n: x.clone() for bucket in t.state_for_engines(bucket_mb=0.5).buckets() for n, x in bucket}}
        want, got = weights(plain), weights(ds)
        assert set(want) == set(got)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5)
        print("OK")
    """)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]

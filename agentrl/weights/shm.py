"""The `shm` transport's files: the trainer's buckets as safetensors files for a colocated `vllm` engine.

The engine writes each bucket, cast to its serving dtype, into a fresh folder
(`bucket_folder`, under /dev/shm where it can: memory, not disk) and its
workers read them back (`agentrl.engines.vllm_worker`). The folder is named
after the writing process, so a folder whose writer was killed mid-sync is
found and removed by the next sync on the machine (`remove_orphaned_buckets`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.engines.base import WeightSource

BUCKETS_PREFIX = "agentrl-weights-"  # + the writing process's pid: a folder whose writer is gone is an orphan


def weights_dir(configured: str | None) -> str | None:
    """Where bucket folders go: `configured`, else /dev/shm when writable, else None (the temp dir)."""
    if configured is not None:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@contextlib.contextmanager
def bucket_folder(parent: str | None) -> Iterator[Path]:
    """A fresh folder for one sync's buckets under `parent` (orphans removed first), deleted afterwards."""
    remove_orphaned_buckets(Path(parent or tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=f"{BUCKETS_PREFIX}{os.getpid()}-", dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_buckets(weights: WeightSource, folder: Path, dtype: Any) -> list[str]:
    """Each bucket as a safetensors file in `folder`, floating tensors cast to `dtype` (blocking: off the loop)."""
    from safetensors.torch import save_file

    paths = []
    for i, bucket in enumerate(weights.buckets()):
        tensors = {}
        for name, tensor in bucket:
            t = tensor.detach().to("cpu")
            if t.is_floating_point() and dtype is not None:
                t = t.to(dtype)
            tensors[name] = t.contiguous()
        path = folder / f"bucket-{i:05d}.safetensors"
        save_file(tensors, str(path))
        paths.append(str(path))
    return paths


def remove_orphaned_buckets(parent: Path) -> list[Path]:
    """Delete bucket folders under `parent` whose writing process is gone (killed mid-sync); return them.

    Such a folder holds a whole model's weights in RAM (/dev/shm) until the
    machine reboots; the next sync on the machine removes it.
    """
    removed = []
    for folder in parent.glob(f"{BUCKETS_PREFIX}*-*"):
        pid = folder.name.removeprefix(BUCKETS_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed

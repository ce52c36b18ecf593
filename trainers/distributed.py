"""Data parallelism over torch.distributed (gloo on CPU, nccl on GPU) via DDP.

The trainer runs identically in one process and in N: every rank receives the
same groups (advantages need whole groups), takes its shard of the samples, and
scales its loss by the world size so that DDP's gradient *average* equals the
gradient of the whole batch's loss. Gradient accumulation syncs only on the
last micro-batch (`no_sync` before).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the data-parallel group (rank 0 of 1 when not distributed)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current_world(group: dist.ProcessGroup | None = None) -> World:
    """The data-parallel world: the default process group if one is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)


def init_from_env(backend: str | None = None) -> World:
    """Initialise the default process group from torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR…)."""
    if dist.is_initialized():
        return current_world()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return World()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    return current_world()


def wrap(module: nn.Module, world: World, device: str | torch.device) -> nn.Module:
    """DDP-wrap `module` when the world has more than one rank."""
    if world.size <= 1:
        return module
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device(device)
    device_ids = (
        [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else None
    )
    return DDP(module, device_ids=device_ids, process_group=world.group, broadcast_buffers=False)


def fully_shard(root: nn.Module, model: nn.Module, world: World, device: str | torch.device) -> nn.Module:
    """Shard `model`'s parameters over the world with FSDP2: one unit per transformer block, `root` the outer one.

    The blocks are the classes the HF model names in `_no_split_modules`; what
    is left (embeddings, final norm, a tied lm_head) belongs to `root`, which
    must be the module whose forward runs the whole model (`PackedLogprobs`):
    the decoder and the lm_head are called inside it, so their parameters are
    gathered for its forward and backward. Returns `root`, now an FSDP module.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as shard_module

    group = world.group or dist.group.WORLD
    assert group is not None, "fully_shard needs an initialised process group"
    mesh = DeviceMesh.from_group(group, torch.device(device).type)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer blocks (_no_split_modules) to shard")
    for module in model.modules():
        if type(module).__name__ in blocks:
            shard_module(module, mesh=mesh)
    shard_module(root, mesh=mesh)
    return root


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded) parameter: a collective for a DTensor, so every rank calls it."""
    gather = getattr(t, "full_tensor", None)
    return gather() if gather is not None else t


def whole_model_state(model: nn.Module) -> dict[str, Any]:
    """FSDP: `model`'s state gathered whole on CPU, complete on rank 0 only (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """FSDP: the optimizer state by parameter name, gathered like `whole_model_state`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_whole_model_state(model: nn.Module, state: dict[str, Any], *, strict: bool = True) -> Any:
    """FSDP: every rank passes the whole state and keeps its shard; returns (missing, unexpected) keys."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def load_whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """FSDP: restore what `whole_optimizer_state` gave; every rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def matched(batches: list[Any], world: World, dummy: Callable[[], Any]) -> list[Any]:
    """`batches` padded with `dummy()` batches to the largest count on any rank.

    Under FSDP every forward gathers parameters from every rank, so the ranks
    must run as many forwards as each other; under DDP only the last backward
    syncs, and the list is returned as it is.
    """
    if world.size <= 1:
        return batches
    most = int(all_reduce_max(torch.tensor([len(batches)]), world)[0])
    return batches + [dummy() for _ in range(most - len(batches))]


@contextlib.contextmanager
def maybe_no_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce unless `sync` (the last accumulation micro-batch)."""
    no_sync = getattr(module, "no_sync", None)
    if sync or no_sync is None:
        yield
    else:
        with no_sync():
            yield


def all_reduce_sum(values: torch.Tensor, world: World) -> torch.Tensor:
    """Sum a tensor over ranks (identity in one process)."""
    if world.size <= 1:
        return values
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=world.group)
    return out


def all_reduce_max(values: torch.Tensor, world: World) -> torch.Tensor:
    if world.size <= 1:
        return values
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=world.group)
    return out


def all_reduce_grads(params: list[nn.Parameter], world: World) -> None:
    """Average gradients of `params` over ranks (for modules not wrapped in DDP)."""
    if world.size <= 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=world.group)
    flat /= world.size
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def shard(n: int, world: World) -> list[int]:
    """Indices of the `n` items this rank trains on (strided, so lengths spread evenly)."""
    return list(range(world.rank, n, world.size))


def all_gather_dict(local: dict[int, torch.Tensor], world: World) -> dict[int, torch.Tensor]:
    """Merge per-sample tensors computed on each rank's shard into one dict on every rank."""
    if world.size <= 1:
        return local
    parts: list[dict[int, torch.Tensor] | None] = [None] * world.size
    dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()}, group=world.group)
    merged: dict[int, torch.Tensor] = {}
    for p in parts:
        if p:
            merged.update(p)
    return merged

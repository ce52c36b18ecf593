"""vLLM's weight-transfer engine `agentrl_gloo`: the worker side of a weight-transfer group on CPUs.

Built by vLLM's `WeightTransferEngineFactory` inside each worker (registered
by `weight_transfer.register_vllm_backend` through this package's
`vllm.general_plugins` entry point) and driven through `AsyncLLM`'s
weight-transfer API, like vLLM's own nccl engine:

- `init_weight_transfer_engine` joins the group as rank `rank_offset` + this
  worker's rank (the trainer's rank 0 hosts the rendezvous);
- `start_weight_update` begins vLLM's layerwise in-place reload;
- `update_weights` receives the buckets rank 0 broadcasts until it ends the
  stream, each into the model's `load_weights` (HF names; vLLM maps them
  onto its fused layers); a thread receives the next bucket while one loads;
- `finish_weight_update` ends the reload and ties again the parameters that
  shared storage before it (a tied lm_head would otherwise keep serving the
  old embedding; see `vllm_worker.retie`).

Every collective has the group's deadline (`timeout_s`): a trainer that dies
or hangs mid-stream makes `update_weights` fail instead of blocking the worker.
Runs only inside vLLM's worker processes (imports vLLM and torch).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from agentrl.engines.vllm_worker import retie
from agentrl.weights import wire

T = TypeVar("T")


def prefetched(items: Iterator[T], timeout_s: float) -> Iterator[T]:
    """`items`, produced one ahead by a thread: receiving bucket k+1 overlaps loading bucket k.

    The producer's errors are raised here; a consumer that stops early stops it.
    Each wait is bounded (the group's own deadline already bounds each bucket).
    """
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def put(message: tuple[str, Any]) -> None:
        while not stop.is_set():
            try:
                q.put(message, timeout=0.1)
                return
            except queue.Full:
                continue

    def produce() -> None:
        try:
            for item in items:
                put(("item", item))
                if stop.is_set():
                    return
            put(("end", None))
        except BaseException as e:  # handed to the consumer
            put(("error", e))

    thread = threading.Thread(target=produce, name="agentrl-weights-receive", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = q.get(timeout=timeout_s + 10)
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM is untyped for mypy
    """Where the group meets; this engine's first worker is group rank `rank_offset`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0
    group_backend: str = "gloo"


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One update: receive the broadcast stream (or, as a baseline, `bare_bytes` raw bytes in `bare_chunk` pieces)."""

    bare_bytes: int = 0
    bare_chunk: int = 1 << 28


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):  # type: ignore[misc]
    """Receives bucket broadcasts from the trainer's rank 0 and loads them in place."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._store: Any = None
        self._group: Any = None
        self._timeout_s = 600.0
        self._device = torch.device("cpu")
        self._tied: dict[str, int] = {}
        self.received = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.shutdown()  # a rebuilt group replaces the old one
        self._timeout_s = init_info.timeout_s
        self._device = self.device if init_info.group_backend == "nccl" else torch.device("cpu")
        self._store, self._group = wire.open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size,
            init_info.timeout_s, init_info.group_backend,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._tied = {name: p.data_ptr() for name, p in self.model.named_parameters(remove_duplicate=False)}
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one update (no device sync: the CPU has none, and nccl's broadcast waits itself)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self._group is None:
            raise RuntimeError("agentrl_gloo: init_weight_transfer_engine was not called (no group to receive on)")
        if update_info.bare_bytes:
            wire.receive_raw(self._group, update_info.bare_bytes, update_info.bare_chunk, self._device, self._timeout_s)
            return
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        try:
            with disable_mtp_completeness_check():
                received = wire.receive_buckets(self._group, self._device, self._timeout_s)
                for bucket in prefetched(received, self._timeout_s):  # the next bucket arrives while this one loads
                    self.model.load_weights([(name, t.to(self.device)) for name, t in bucket])
                    self.received += len(bucket)
        except BaseException:
            # end the reload (layers still waiting get their old tensors back) so the worker can take the next
            # update; the model now mixes old and new layers: the engine must not serve it until a sync succeeds
            self.finish_weight_update()
            self.shutdown()  # the group is broken for every member: the next sync forms a new one
            raise

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        retie(self.model, self._tied)

    def shutdown(self) -> None:
        group, self._group, self._store = self._group, None, None
        if group is not None and hasattr(group, "abort"):
            group.abort()

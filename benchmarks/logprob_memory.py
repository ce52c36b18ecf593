"""Peak memory of token logprobs + entropy (forward and backward): chunked vs naive.

Setting: T tokens of hidden states [T, H] and an lm_head [V, H] (defaults: 8192
tokens, SmolLM2's 49152 vocabulary and 576 hidden size), fp32 on CPU. The loss is
sum(logp * w) + sum(entropy * w), backpropagated to the hidden states and the head.

- naive: logits = head(h) for all T at once, log_softmax, gather, entropy.
- chunked: agentrl.trainers.logprobs.chunked_logprobs (chunks of --chunk rows under
  activation checkpointing, so backward recomputes one chunk's logits at a time).

Method (honest about it): each variant runs in a fresh Python subprocess. After
building the inputs the child records its resident set size (RSS), resets the
kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs resets VmHWM), runs
forward+backward, and reads VmHWM from /proc/self/status. Peak = VmHWM - RSS
before the step, i.e. the extra memory the step needed at its worst moment. This
counts everything the process touched (allocator slack included), not just
tensors. Where clear_refs cannot be written, a 1 ms RSS-sampling thread is used
instead (it can miss very short peaks; the output says which method ran).

Run: python benchmarks/logprob_memory.py [--tokens 8192 --vocab 49152 --hidden 576 --chunk 1024]
Last line: key=value summary with peak_ratio = chunked peak / naive peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _hwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(variant: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict[str, float | str]:
    import torch
    from torch import nn

    from agentrl.trainers.logprobs import chunked_logprobs

    torch.manual_seed(0)
    torch.set_num_threads(2)
    head = nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    w = torch.rand(tokens)

    def step(h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor) -> float:
        if variant == "naive":
            logits = head(h)
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, targets[:, None])[:, 0]
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        else:
            logp, ent = chunked_logprobs(h, targets, head, chunk_tokens=chunk, with_entropy=True)
            assert ent is not None
            entropy = ent
        loss = (logp * w).sum() + (entropy * w).sum()
        loss.backward()
        return float(loss.detach())

    # warm-up on a few rows: kernel/thread-pool/first-touch costs are not the step's memory
    warm = min(chunk, tokens) // 4 or 1
    step(h.detach()[:warm].clone().requires_grad_(True), targets[:warm], w[:warm])
    head.weight.grad = None
    base = _rss_kb()
    method = "vmhwm"
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        method = "rss_sampling_1ms"
    peak_sampled = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak_sampled[0] = max(peak_sampled[0], _rss_kb())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True) if method != "vmhwm" else None
    if sampler:
        sampler.start()
    t0 = time.perf_counter()
    loss = step(h, targets, w)
    seconds = time.perf_counter() - t0
    stop.set()
    if sampler:
        sampler.join()
    peak = _hwm_kb() if method == "vmhwm" else peak_sampled[0]
    return {
        "variant": variant,
        "peak_mb": (peak - base) / 1024,
        "seconds": seconds,
        "loss": loss,
        "method": method,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--child", choices=["naive", "chunked"])
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden, args.chunk)))
        return
    results = {}
    for variant in ("chunked", "naive"):
        cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
               "--hidden", str(args.hidden), "--chunk", str(args.chunk)]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
        r = results[variant]
        print(
            f"{variant:8s} peak {r['peak_mb']:9.1f} MB  time {r['seconds']:6.2f} s  loss {r['loss']:.6g}  ({r['method']})"
        )
    c, n = results["chunked"], results["naive"]
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    rel = abs(c["loss"] - n["loss"]) / max(abs(n["loss"]), 1e-12)
    print(f"(one fp32 copy of the full logits is {logits_mb:.0f} MB; losses agree to {rel:.1e} relative)")
    print(
        f"tokens={args.tokens} vocab={args.vocab} hidden={args.hidden} chunk={args.chunk} "
        f"naive_peak_mb={n['peak_mb']:.0f} chunked_peak_mb={c['peak_mb']:.0f} "
        f"peak_ratio={c['peak_mb'] / n['peak_mb']:.3f} naive_s={n['seconds']:.2f} chunked_s={c['seconds']:.2f} "
        f"method={c['method']}"
    )


if __name__ == "__main__":
    main()

"""The trainer's CUDA paths (pytest -m gpu): placement, bf16 against fp32, chunked log-probs, packed attention.

Every test runs on `gpu_test_device()` (tests/gpu_device.py): CUDA, or the CPU
when AGENTRL_TEST_DEVICE=cpu (the dry run of scripts/gpu_check.sh), else it
skips. The model is `synthetic:llama-tiny` (a random Llama with SmolLM2's
tokenizer), which a GPU machine without PyPI can build from a carried tokenizer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gpu_device import gpu_test_device

pytestmark = [pytest.mark.gpu, pytest.mark.model]

BASE: dict[str, Any] = {"dtype": "fp32", "lr": 1e-3, "micro_batch_tokens": 256, "loss_agg": "seq_mean_token_mean"}


@pytest.fixture
def device() -> str:
    return gpu_test_device()


@pytest.fixture(scope="module")
def model_path() -> str:
    from agentrl.engines.models import resolve_model

    return resolve_model("synthetic:llama-tiny")


def _trainer(model_path: str, device: str, **config: Any) -> Any:
    from agentrl.trainers.torch_trainer import TorchTrainer

    return TorchTrainer(dict(BASE, device=device, **config), model_path)


def _logprobs(result: Any) -> list[float]:
    """The trainer's per-token logprobs of every loss token, in trajectory order."""
    return [x for tid in sorted(result.token_stats) for x in result.token_stats[tid]["trainer_logprobs"] if x is not None]


def test_the_trainer_places_its_models_on_the_device_and_steps_there(model_path: str, device: str, build: Any) -> None:
    """trainer.device puts the policy and the KL reference on the device; a step changes the weights there and
    the weights for the engines come out of it."""
    trainer = _trainer(model_path, device, kl={"coef": 0.1, "estimator": "k3"})
    params = list(trainer.model.parameters())
    assert {p.device.type for p in params} == {device}
    assert trainer.reference is not None and {p.device.type for p in trainer.reference.parameters()} == {device}
    before = {n: t.detach().clone() for n, t in trainer.model.named_parameters()}
    metrics = trainer.train_step(build.groups(2, 3, seed=1)).metrics
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    moved = [n for n, t in trainer.model.named_parameters() if not torch.equal(t.detach(), before[n])]
    assert moved, "the optimizer step changed no weight"
    weights = dict(t for bucket in trainer.state_for_engines(bucket_mb=0.5).buckets() for t in bucket)
    assert trainer.state_for_engines().source_device == device
    assert set(weights) == set(before) and all(w.dtype == torch.float32 for w in weights.values())


def test_bf16_autocast_gives_the_fp32_loss_and_logprobs_within_bf16_rounding(
    model_path: str, device: str, build: Any
) -> None:
    """The same batch through dtype=bf16 and dtype=fp32: on CUDA bf16 autocast is on (the numbers differ, by
    bf16 rounding only); on a CPU without native bf16 both are fp32 (autocast_bf16 = 0)."""
    groups = build.groups(3, 3, seed=2, prompt_len=(8, 16), completion_len=(8, 24))
    bf16 = _trainer(model_path, device, dtype="bf16").compute_gradients(groups)
    fp32 = _trainer(model_path, device, dtype="fp32").compute_gradients(groups)
    assert fp32.metrics["autocast_bf16"] == 0.0
    if device == "cuda":
        assert bf16.metrics["autocast_bf16"] == 1.0, "bf16 autocast is off on CUDA"
    got, want = torch.tensor(_logprobs(bf16)), torch.tensor(_logprobs(fp32))
    assert got.shape == want.shape and got.numel() > 50
    # logprobs near -log(49k) = -10.8: bf16 matmuls (8 mantissa bits) with an fp32 lm_head move them ~1e-2
    torch.testing.assert_close(got, want, rtol=0, atol=0.1)
    assert bf16.metrics["loss"] == pytest.approx(fp32.metrics["loss"], rel=2e-2, abs=2e-3)
    if bf16.metrics["autocast_bf16"] == 1.0:
        assert not torch.equal(got, want), "bf16 and fp32 gave bit-identical logprobs: autocast did nothing"


def test_chunked_logprobs_and_their_gradient_match_the_full_softmax_on_the_device(device: str) -> None:
    """chunked_logprobs (checkpointed chunks of 7 positions) against log_softmax of the whole [N, V] logits."""
    from agentrl.trainers.logprobs import chunked_logprobs, token_logprobs_from_logits

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 64, generator=gen).to(device).requires_grad_(True)
    targets = torch.randint(0, 1000, (50,), generator=gen).to(device)
    head = torch.nn.Linear(64, 1000, bias=False).to(device)
    logp, entropy = chunked_logprobs(hidden, targets, head, chunk_tokens=7, temperature=0.7, with_entropy=True)
    assert logp.device.type == device and entropy is not None
    (grad,) = torch.autograd.grad(logp.sum(), hidden)
    want = token_logprobs_from_logits(head(hidden), targets, temperature=0.7)
    (want_grad,) = torch.autograd.grad(want.sum(), hidden)
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)
    probs = torch.softmax(head(hidden).detach() / 0.7, dim=-1)
    torch.testing.assert_close(entropy, -(probs * probs.clamp_min(1e-30).log()).sum(-1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["packed", "packed_shared_prefix"])
def test_the_packed_attention_path_gives_the_block_diagonal_mask_results_on_the_device(
    model_path: str, device: str, build: Any, shared_prefix: bool
) -> None:
    """attention=packed_sdpa (one causal SDPA per packed sequence; with shared_prefix each group's prompt once)
    against HF's sdpa with a block-diagonal mask: the same loss, logprobs and gradient norm, several sequences
    to a row."""
    groups = build.groups(3, 3, seed=3, prompt_len=(20, 28), completion_len=(4, 16))
    extra = {"shared_prefix": True, "shared_prefix_min_tokens": 16} if shared_prefix else {}
    packed_trainer = _trainer(model_path, device, attention="packed_sdpa", **extra)
    masked_trainer = _trainer(model_path, device, attention="sdpa")
    packed, masked = packed_trainer.compute_gradients(groups), masked_trainer.compute_gradients(groups)
    assert packed.metrics["pack/micro_batches"] < 9, "every sequence got a row of its own: nothing was packed"
    if shared_prefix:
        assert packed.metrics.get("pack/shared_prefix_saved", 0.0) > 0.2, "no prompt ran once for its group"
    torch.testing.assert_close(torch.tensor(_logprobs(packed)), torch.tensor(_logprobs(masked)), rtol=0, atol=1e-4)
    assert packed.metrics["loss"] == pytest.approx(masked.metrics["loss"], rel=1e-4, abs=1e-6)
    for (name, p), q in zip(packed_trainer.model.named_parameters(), masked_trainer.model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6, msg=lambda d, name=name: f"{name}: {d}")

"""TorchTrainer end to end on a tiny random Llama (CPU)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from agentrl.trainer import Trainer
from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.torch_trainer import TorchTrainer
from agentrl.types import Group


def trainer(path: str, **cfg: Any) -> TorchTrainer:
    base: dict[str, Any] = {"dtype": "fp32", "lr": 1e-3}
    base.update(cfg)
    return TorchTrainer(base, path)


def grads(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def test_train_step_updates_weights_and_reports_metrics(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, micro_batch_tokens=64)
    assert isinstance(t, Trainer)  # the contract agentrl train drives (mypy checks the signatures)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    m = t.train_step(build.groups(3, 4, seed=0)).metrics
    assert t.policy_version == 1 and m["policy_version"] == 1.0
    for key in ("loss", "pg_loss", "entropy", "clip_fraction", "grad_norm", "lr", "off_policy/mismatch_kl",
                "off_policy/max_abs_dlogp", "off_policy/ess", "off_policy/masked_fraction",
                "staleness/mean", "pack/padding_fraction", "pack/micro_batches", "time/train_step_s"):  # fmt: skip
        assert key in m and math.isfinite(m[key]), key
    assert m["pack/micro_batches"] > 1  # 64-token budget splits the batch
    assert m["pack/padding_fraction"] == 0.0
    changed = sum(not torch.equal(before[n], p) for n, p in t.model.named_parameters())
    assert changed > 0
    m2 = t.train_step(build.groups(2, 2, seed=1, version=0)).metrics
    assert m2["staleness/mean"] == 1.0  # tokens from version 0, trainer now at 1


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batching_does_not_change_loss_or_gradients(
    tiny_llama_path: str, loss_agg: str, build: Any
) -> None:
    groups = build.groups(2, 3, seed=3)
    whole = trainer(tiny_llama_path, loss_agg=loss_agg, micro_batch_tokens=4096)
    m1 = whole.compute_gradients(groups).metrics
    split = trainer(tiny_llama_path, loss_agg=loss_agg, micro_batch_tokens=16)
    m2 = split.compute_gradients(groups).metrics
    assert m1["pack/micro_batches"] == 1 and m2["pack/micro_batches"] == 6
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    g1, g2 = grads(whole), grads(split)
    for n, g in g1.items():
        torch.testing.assert_close(g2[n], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=n)


@pytest.mark.parametrize("extra", [{}, {"lora": {"r": 4}, "off_policy": {"mode": "decoupled"}, "epochs": 2},
                                   {"lora": {"r": 4}, "gradient_checkpointing": True}])  # fmt: skip
def test_shared_prefix_gives_the_same_loss_and_gradients(
    tiny_llama_path: str, build: Any, extra: dict[str, Any]
) -> None:
    """Groups share their prompt; running it once per group (with checkpointed layers too) must not change
    the update."""
    groups = build.groups(3, 4, seed=5, prompt_len=(20, 30))
    if extra.get("epochs"):  # compute_gradients needs one update: compare full train steps instead
        plain, shared = trainer(tiny_llama_path, **extra), trainer(tiny_llama_path, shared_prefix=True, **extra)
        m1, m2 = plain.train_step(groups).metrics, shared.train_step(groups).metrics
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-4)
        for (n, p1), (_, p2) in zip(plain.model.named_parameters(), shared.model.named_parameters(), strict=True):
            torch.testing.assert_close(p2, p1, rtol=1e-4, atol=1e-5, msg=n)
    else:
        unchecked = {k: v for k, v in extra.items() if k != "gradient_checkpointing"}
        plain = trainer(tiny_llama_path, micro_batch_tokens=4096, **unchecked)
        m1 = plain.compute_gradients(groups).metrics
        shared = trainer(tiny_llama_path, micro_batch_tokens=90, shared_prefix=True, shared_prefix_min_tokens=8,
                         **extra)  # fmt: skip
        m2 = shared.compute_gradients(groups).metrics
        assert m2["pack/micro_batches"] > 1  # families are split across micro-batches, never members
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
        g1, g2 = grads(plain), grads(shared)
        for n, g in g1.items():
            torch.testing.assert_close(g2[n], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=n)
    assert m2["pack/shared_prefix_saved"] > 0.3  # 4 samples per 20-30 token prompt
    with pytest.raises(ValueError, match="shared_prefix"):
        TrainerConfig.model_validate({"shared_prefix": True, "attention": "sdpa"})


def test_a_group_over_the_micro_batch_budget_splits_with_the_same_gradients(tiny_llama_path: str, build: Any) -> None:
    """A family bigger than micro_batch_tokens runs as several (the prompt once per part): same update."""
    groups = build.groups(3, 4, seed=5, prompt_len=(20, 30))
    plain = trainer(tiny_llama_path, micro_batch_tokens=4096)
    m1 = plain.compute_gradients(groups).metrics
    split = trainer(tiny_llama_path, micro_batch_tokens=60, shared_prefix=True, shared_prefix_min_tokens=8)
    m2 = split.compute_gradients(groups).metrics
    assert m2["pack/micro_batches"] > 3  # 3 groups: more micro-batches means groups were split
    assert m2["pack/shared_prefix_saved"] > 0.1  # the parts still share their prompt
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    g1, g2 = grads(plain), grads(split)
    for n, g in g1.items():
        torch.testing.assert_close(g2[n], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=n)


def test_on_policy_data_has_no_mismatch(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, off_policy={"mode": "decoupled"})
    prompt, comps = [5, 6, 7, 8], [[9, 10, 11], [12, 13]]
    trajs = []
    for c in comps:
        ids = torch.tensor([prompt + c])
        with torch.no_grad():
            logits = t.model(input_ids=ids).logits[0, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        trajs.append(
            build.trajectory(prompt, c, reward=float(len(c)), logprobs=lp[len(prompt) - 1 :].tolist())
        )
    m = t.train_step([Group(task_id="x", trajectories=trajs)]).metrics
    assert m["off_policy/mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["off_policy/max_abs_dlogp"] < 1e-4
    assert m["off_policy/ess"] == pytest.approx(1.0, abs=1e-6)
    assert m["clip_fraction"] == 0.0


def test_weights_for_engines_are_hf_named_buckets(tiny_llama_path: str, build: Any) -> None:
    from transformers import AutoModelForCausalLM

    t = trainer(tiny_llama_path)
    t.train_step(build.groups(1, 2, seed=0))
    source = t.state_for_engines(bucket_mb=0.05)
    buckets = list(source.buckets())
    assert len(buckets) > 1
    for b in buckets:
        size = sum(x.numel() * x.element_size() for _, x in b)
        assert size <= 0.05 * 1024 * 1024 or len(b) == 1
    # what the run logs as weight_sync/mb and /buckets: exactly what was handed out
    assert source.sent_buckets == len(buckets)
    assert source.sent_bytes == sum(x.numel() * x.element_size() for b in buckets for _, x in b)
    engine = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    state = dict(kv for b in buckets for kv in b)
    missing, unexpected = engine.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, t.model(input_ids=ids).logits)
    bf16 = next(iter(t.state_for_engines(dtype=torch.bfloat16).buckets()))
    assert bf16[0][1].dtype == torch.bfloat16


def test_lora_merged_weights_and_adapter_disabled_reference(tiny_llama_path: str, build: Any) -> None:
    from transformers import AutoModelForCausalLM

    t = trainer(tiny_llama_path, lora={"r": 4, "alpha": 8}, kl={"coef": 0.1}, lr=1e-2)
    assert t.reference is None  # the base model with the adapter off is the reference
    m = t.train_step(build.groups(2, 2, seed=0)).metrics
    assert m["kl/loss"] == pytest.approx(0.0, abs=1e-10)  # LoRA B starts at 0: policy == base
    t.train_step(build.groups(2, 2, seed=1))
    m = t.train_step(build.groups(2, 2, seed=2)).metrics
    assert m["kl/loss"] > 0.0
    state = {n: x for b in t.state_for_engines().buckets() for n, x in b}
    assert not any("lora" in n or "base_layer" in n for n in state)
    engine = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    engine.load_state_dict(state, strict=False)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(
            engine(input_ids=ids).logits, t.model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_kl_to_frozen_reference(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, kl={"coef": 0.5, "estimator": "k3"}, lr=1e-2)
    assert t.reference is not None
    assert not any(p.requires_grad for p in t.reference.parameters())
    first = t.train_step(build.groups(2, 2, seed=0)).metrics
    assert first["kl/loss"] == pytest.approx(0.0, abs=1e-10)
    t.train_step(build.groups(2, 2, seed=1))
    assert t.train_step(build.groups(2, 2, seed=2)).metrics["kl/loss"] > 0.0
    no_kl = trainer(tiny_llama_path)
    assert no_kl.reference is None  # never loaded unless KL is used


def test_kl_in_reward_and_entropy_bonus_run(tiny_llama_path: str, build: Any) -> None:
    t = trainer(
        tiny_llama_path, advantage="reinforce_pp", kl={"coef": 0.1, "in_reward": True}, entropy_coef=0.01
    )
    m = t.train_step(build.groups(2, 2, seed=0)).metrics
    assert "kl/in_reward_mean" in m and m["entropy"] > 0


def test_gae_with_critic(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, advantage="gae", critic={"lr": 1e-2}, mini_batches=2, epochs=2)
    assert t.critic is not None
    head = t.critic.model.head.weight.detach().clone()
    m = t.train_step(build.groups(2, 2, seed=0)).metrics
    assert "critic/loss" in m and math.isfinite(m["critic/loss"])
    assert not torch.equal(head, t.critic.model.head.weight)
    assert t.policy_version == 1


def test_sft_step_lowers_loss(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, lr=1e-2)
    samples = [tr.tokens() for g in build.groups(1, 2, seed=0) for tr in g.trajectories]
    first = t.sft_step(samples)["sft/loss"]
    for _ in range(4):
        last = t.sft_step(samples)["sft/loss"]
    assert last < first


def test_sft_step_reports_the_rate_it_used(tiny_llama_path: str, build: Any) -> None:
    """Like train_step: `lr` is the step's own rate (warmup 0.5, 1.0), not the next step's."""
    t = trainer(tiny_llama_path, lr=1.0, warmup_steps=2)
    samples = [tr.tokens() for g in build.groups(1, 2, seed=0) for tr in g.trajectories]
    assert [t.sft_step(samples)["lr"] for _ in range(3)] == pytest.approx([0.5, 1.0, 1.0])


def test_train_step_reports_the_rate_it_used(tiny_llama_path: str, build: Any) -> None:
    t = trainer(tiny_llama_path, lr=1e-3, warmup_steps=2)
    rates = [t.train_step(build.groups(1, 2, seed=k)).metrics["lr"] for k in range(3)]
    assert rates == pytest.approx([0.5e-3, 1e-3, 1e-3])


def test_lr_schedule_warmup_then_cosine(tiny_llama_path: str) -> None:
    t = trainer(tiny_llama_path, lr=1.0, warmup_steps=2, schedule="cosine", total_steps=4, min_lr_ratio=0.1)
    lrs = []
    for _ in range(5):
        lrs.append(t.scheduler.get_last_lr()[0])
        t.scheduler.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1])


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="critic"):
        TrainerConfig(advantage="gae")
    with pytest.raises(ValueError, match="total_steps"):
        TrainerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="clip_hgh"):
        TrainerConfig.model_validate({"clip_hgh": 0.3})
    with pytest.raises(ValueError, match="mis_low"):
        TrainerConfig.model_validate({"off_policy": {"mode": "mis_token", "mis_low": 3.0}})


def test_sequence_parallel_without_process_group_is_a_clear_error(tiny_llama_path: str) -> None:
    from agentrl.trainers.torch_trainer import TrainerConfigError

    with pytest.raises(TrainerConfigError, match="sequence_parallel_size=2"):
        TorchTrainer({"sequence_parallel_size": 2}, tiny_llama_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_a_config_error(tiny_llama_path: str) -> None:
    from agentrl.trainers.torch_trainer import TrainerConfigError

    with pytest.raises(TrainerConfigError, match=r"trainer.device=cuda:1: torch sees no CUDA device"):
        TorchTrainer({"device": "cuda:1"}, tiny_llama_path)
    assert TorchTrainer({"dtype": "fp32"}, tiny_llama_path).device == "cpu"  # the default




def test_a_nonfinite_gradient_skips_the_update_and_leaves_the_weights(tiny_llama_path: str, build: Any) -> None:
    """A NaN reward (from a store, a plugin trainer's input, ...) makes every gradient NaN: no update is applied."""
    t = trainer(tiny_llama_path, micro_batch_tokens=64)
    assert isinstance(t, Trainer)  # the contract agentrl train drives (mypy checks the signatures)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    poisoned = build.groups(2, 3, seed=0)
    poisoned[0].trajectories[1].reward = float("nan")
    m = t.train_step(poisoned).metrics
    assert m["optim/skipped_updates"] == 1.0 and math.isnan(m["grad_norm"]) and t.skipped_updates == 1
    assert all(torch.equal(before[n], p) for n, p in t.model.named_parameters())  # not one weight moved
    assert t.policy_version == 1  # the step still counts: the engine syncs (unchanged) weights as usual
    m = t.train_step(build.groups(2, 3, seed=1)).metrics  # the next good batch trains normally
    assert m["optim/skipped_updates"] == 0.0 and math.isfinite(m["grad_norm"])
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in t.model.named_parameters())
    assert all(torch.isfinite(s).all() for st in t.optimizer.state.values() for s in st.values())  # Adam clean
    samples = [tr.tokens() for tr in build.groups(1, 2, seed=2)[0].trajectories]
    assert t.sft_step(samples)["optim/skipped_updates"] == 0.0


def test_gspo_on_fresh_data_takes_the_same_first_step_as_ppo(tiny_llama_path: str, build: Any) -> None:
    """At the first update every sequence ratio is 1, where GSPO's gradient is PPO's: the same gradients."""
    groups = build.groups(2, 3, seed=4)
    ppo = trainer(tiny_llama_path, off_policy={"mode": "tis"})
    gspo = trainer(tiny_llama_path, off_policy={"mode": "tis"}, policy_loss="gspo", clip_low=3e-4, clip_high=4e-4)
    m1, m2 = ppo.compute_gradients(groups).metrics, gspo.compute_gradients(build.groups(2, 3, seed=4)).metrics
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6) and m2["clip_fraction"] == 0.0
    g1, g2 = grads(ppo), grads(gspo)
    for name, g in g1.items():
        torch.testing.assert_close(g2[name], g, rtol=1e-5, atol=1e-7, msg=name)
    # later updates of the same batch (epochs=2) move off ratio 1; the tiny clip range then clips sequences
    again = trainer(tiny_llama_path, off_policy={"mode": "tis"}, policy_loss="gspo", clip_low=1e-6, clip_high=1e-6,
                    epochs=2, lr=1e-2)  # fmt: skip
    assert again.train_step(build.groups(2, 3, seed=4)).metrics["clip_fraction"] > 0.0

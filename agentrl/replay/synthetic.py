"""Realistic synthetic runs: multi-turn tool-calling groups for tests, benchmarks, demos.

Shapes follow what `run_episode` stores: a system + user opening (calculator
episodes also carry a few-shot demonstration in it, all prompt), assistant
turns with Hermes tool calls, tool outputs (a python tool with sandbox
stdout/stderr in the turn info), a final answer, token arrays with masks,
float32 behaviour logprobs and policy versions, rewards with a breakdown, and
some errors and truncations. Tokens come from a `ChatTokenizer`
(`SimpleChatTokenizer` by default, so ids decode back to the text).
Deterministic for a given seed.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Sequence
from typing import Any

from agentrl.chat.conversation import ChatTokenizer, SimpleChatTokenizer
from agentrl.store.trajectory_store import TrajectoryStore
from agentrl.types import EpisodeError, ErrorClass, Group, Message, ToolCall, Trajectory, Turn

ENVS = ("calculator", "python_sandbox", "search_qa")
CALCULATOR_DEMO = (
    Message("user", "Demo question: what is 6 times 7?"),
    Message("assistant", "", tool_calls=[ToolCall("calculator", {"expression": "6 * 7"}, id="demo_0")]),
    Message("tool", "42", tool_call_id="demo_0", name="calculator"),
    Message("assistant", "Answer: 42"),
)
"""A worked demonstration in the prompt of every calculator episode (like `few_shot` in the real env)."""
_WORDS = (
    "the", "value", "of", "compute", "result", "first", "then", "check", "answer", "step", "number",
    "total", "we", "need", "sum", "product", "carefully", "so", "that", "next", "use", "tool",
    "final", "because", "given", "each", "list", "over", "into", "about", "result",
)  # fmt: skip


def f32(x: float) -> float:
    """Round to the nearest float32 (what engines report)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def _text(rng: random.Random, words: int) -> str:
    out = []
    while words > 0:
        k = min(words, rng.randint(6, 16))
        out.append(_sentence(rng, k))
        words -= k
    return " ".join(out)


def synthetic_trajectory(
    rng: random.Random,
    *,
    env: str,
    task: dict[str, Any],
    group_id: str,
    sample_index: int,
    version: int,
    tokenizer: ChatTokenizer,
    words: int = 40,
    token_stats: bool = True,
) -> Trajectory:
    """One episode of `env` on `task`, tokenised with `tokenizer` (+ trainer token stats if asked)."""
    a, b = task["a"], task["b"]
    answer = a * b if env == "calculator" else a + b
    messages = [
        Message("system", "You are a careful assistant. Use the tools; answer as `Answer: N`."),
        *(CALCULATOR_DEMO if env == "calculator" else []),
        Message("user", f"{task['question']} {_text(random.Random(str(task['id'])), words // 4)}"),
    ]
    prompt = len(messages)
    turns_info: list[tuple[float, list[str], dict[str, Any]]] = []
    n_turns = rng.randint(1, 4)
    error: EpisodeError | None = None
    truncated = rng.random() < 0.08
    for turn in range(n_turns):
        last = turn == n_turns - 1
        if last and not truncated:
            correct = rng.random() < 0.55
            final = answer if correct else answer + rng.randint(1, 9)
            messages.append(Message("assistant", f"{_text(rng, words // 3)}\nAnswer: {final}"))
            turns_info.append((0.0, [], {}))
            break
        calls, outputs, info = _tool_turn(rng, env, a, b, turn)
        messages.append(Message("assistant", _text(rng, words // 2), tool_calls=calls))
        messages.extend(outputs)
        turns_info.append((0.0, [c.name for c in calls], info))
        if rng.random() < 0.05:
            kind = rng.choice([ErrorClass.TOOL, ErrorClass.TIMEOUT, ErrorClass.SANDBOX])
            error = EpisodeError(kind=kind, message=f"{kind.value} failed at turn {turn}", turn=turn)
            break
    correct_final = (
        error is None
        and not truncated
        and messages[-1].role == "assistant"
        and messages[-1].content.endswith(f"Answer: {answer}")
    )
    breakdown = {
        "correct": 1.0 if correct_final else 0.0,
        "format": 0.1 if messages[-1].role == "assistant" else 0.0,
    }
    reward = breakdown["correct"] + breakdown["format"]
    token_ids, mask, logprobs, versions, turns = _tokenise(rng, tokenizer, messages, version, prompt)
    turns = [
        Turn(start=t.start, end=t.end, reward=r, tool_calls=names, info=info)
        for t, (r, names, info) in zip(turns, turns_info, strict=False)
    ]
    if turns:
        turns[-1].reward = reward
    return Trajectory(
        task_id=str(task["id"]),
        env=env,
        messages=messages,
        token_ids=token_ids,
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        turns=turns,
        reward=reward,
        reward_breakdown=breakdown,
        terminated=error is None and not truncated,
        truncated=truncated,
        truncation_reason="max_total_tokens" if truncated else None,
        error=error,
        group_id=group_id,
        sample_index=sample_index,
        seed=1000 * version + sample_index,
        task=task,
        prompt_messages=prompt,
        metrics={"retokenization_drift": 0.0},
        info={"token_stats": _token_stats(rng, mask, logprobs, reward)} if token_stats else {},
    )


def _tool_turn(
    rng: random.Random, env: str, a: int, b: int, turn: int
) -> tuple[list[ToolCall], list[Message], dict[str, Any]]:
    """The calls of one assistant turn and the tool messages that answer them."""
    calls: list[ToolCall] = []
    outputs: list[Message] = []
    info: dict[str, Any] = {}
    if env == "calculator":
        calls = [ToolCall("calculator", {"expression": f"{a} * {b}"}, id=f"call_{turn}_0")]
        outputs = [Message("tool", str(a * b), tool_call_id=calls[0].id, name="calculator")]
    elif env == "python_sandbox":
        code = f"x = {a} + {b}\nprint(x)"
        failed = rng.random() < 0.2
        stderr = "Traceback (most recent call last):\n  ZeroDivisionError: division by zero" if failed else ""
        stdout = "" if failed else str(a + b)
        calls = [ToolCall("python", {"code": code}, id=f"call_{turn}_0")]
        body = json.dumps({"stdout": stdout, "stderr": stderr, "exit_code": 1 if failed else 0})
        outputs = [Message("tool", body, tool_call_id=calls[0].id, name="python")]
        info = {
            "sandbox": {"stdout": stdout, "stderr": stderr, "exit_code": 1 if failed else 0, "wall_s": 0.013}
        }
    else:
        calls = [
            ToolCall("search", {"query": f"{a} plus {b}"}, id=f"call_{turn}_0"),
            ToolCall("lookup", {"key": str(a)}, id=f"call_{turn}_1"),
        ]
        outputs = [
            Message("tool", _text(rng, 30), tool_call_id=calls[0].id, name="search"),
            Message("tool", f"{a}: {_text(rng, 8)}", tool_call_id=calls[1].id, name="lookup"),
        ]
    return calls, outputs, info


def _tokenise(
    rng: random.Random, tokenizer: ChatTokenizer, messages: Sequence[Message], version: int, prompt: int
) -> tuple[list[int], list[int], list[float], list[int], list[Turn]]:
    """Render message by message; the episode's assistant tokens (after the first `prompt`
    messages) get mask 1, a logprob and the version."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        text = tokenizer.render([m])
        if m.role == "assistant" and i >= prompt:
            head = tokenizer.encode("<|im_start|>assistant\n")
            body = tokenizer.encode(text)[len(head) :]
            ids += head
            mask += [0] * len(head)
            logprobs += [0.0] * len(head)
            versions += [-1] * len(head)
            start = len(ids)
            ids += body
            mask += [1] * len(body)
            logprobs += [f32(-rng.expovariate(3.0)) for _ in body]
            v = max(0, version - (1 if rng.random() < 0.3 else 0))
            versions += [v] * len(body)
            turns.append(Turn(start=start, end=len(ids)))
        else:
            part = tokenizer.encode(text)
            ids += part
            mask += [0] * len(part)
            logprobs += [0.0] * len(part)
            versions += [-1] * len(part)
    return ids, mask, logprobs, versions, turns


def _token_stats(
    rng: random.Random, mask: Sequence[int], logprobs: Sequence[float], reward: float
) -> dict[str, Any]:
    """Per-token trainer-side arrays (see docs/replay.md, `info["token_stats"]`)."""
    trainer = [f32(lp + rng.gauss(0.0, 0.05)) if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)]
    weights = [
        f32(min(2.0, 2.718281828 ** (t - lp))) if m else 0.0
        for t, lp, m in zip(trainer, logprobs, mask, strict=True)
    ]
    advantage = f32(reward - 0.6)
    return {
        "trainer_logprobs": trainer,
        "advantages": [advantage if m else 0.0 for m in mask],
        "is_weights": weights,
        "is_mask": [1 if (m and w < 1.8) else 0 for m, w in zip(mask, weights, strict=True)],
    }


def synthetic_group(
    rng: random.Random,
    *,
    step: int,
    index: int,
    group_size: int,
    tokenizer: ChatTokenizer,
    words: int = 40,
    token_stats: bool = True,
) -> Group:
    """G siblings answering one task."""
    env = ENVS[index % len(ENVS)]
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op = "times" if env == "calculator" else "plus"
    task = {
        "id": f"{env}-{step}-{index}",
        "question": f"What is {a} {op} {b}?",
        "a": a,
        "b": b,
        "_cursor": index,
    }
    group = Group(task_id=str(task["id"]), trajectories=[], task=task)
    group.trajectories = [
        synthetic_trajectory(
            rng,
            env=env,
            task=task,
            group_id=group.id,
            sample_index=i,
            version=step,
            tokenizer=tokenizer,
            words=words,
            token_stats=token_stats,
        )
        for i in range(group_size)
    ]
    return group


def fill_store(
    store: TrajectoryStore,
    *,
    steps: int,
    groups_per_step: int,
    group_size: int,
    seed: int = 0,
    tokenizer: ChatTokenizer | None = None,
    words: int = 40,
    token_stats: bool = True,
) -> list[Group]:
    """Write a synthetic run (config, groups, per-step metrics) into `store`; return the groups."""
    tok = tokenizer or SimpleChatTokenizer()
    rng = random.Random(seed)
    store.set_run_config(
        {
            "run": {"name": "synthetic", "seed": seed, "steps": steps},
            "model": {"path": "synthetic"},
            "env": {"name": "calculator"},
            "replay": {"tokenizer": "simple" if isinstance(tok, SimpleChatTokenizer) else "model"},
        }
    )
    groups: list[Group] = []
    index = 0
    for step in range(1, steps + 1):
        rewards = []
        for _ in range(groups_per_step):
            group = synthetic_group(
                rng, step=step, index=index, group_size=group_size, tokenizer=tok, words=words
            )
            index += 1
            store.add_group(group, step=step, status="trained" if rng.random() > 0.1 else "dropped")
            groups.append(group)
            rewards += group.rewards
        store.add_metrics(
            step,
            {
                "reward/mean": sum(rewards) / len(rewards),
                "loss/policy": rng.gauss(0.0, 0.1),
                "offpolicy/kl": abs(rng.gauss(0.001, 0.0005)),
                "time/step_s": rng.uniform(5.0, 12.0),
            },
        )
        store.commit()
    return groups

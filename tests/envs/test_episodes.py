"""Each env driven end to end by the scripted engine through run_episode (token-exact trajectories)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.env import Env, Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envs.code_env import CodeEnv
from agentrl.envs.gym_text import GymTextEnv
from agentrl.envs.math_env import MathEnv
from agentrl.envs.reasoning_gym_env import ReasoningGymEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import run_episode
from agentrl.types import Message, Trajectory

CONFIG = RolloutConfig(max_turns=12, max_total_tokens=8192, max_new_tokens_per_turn=512)


async def episode(env: Env, task: Task, reply: Callable[[str], str] | list[str], seed: int = 0) -> Trajectory:
    tokenizer = SimpleChatTokenizer()
    if callable(reply):
        engine = ScriptedEngine(tokenizer=tokenizer, reply_fn=reply)
    else:
        engine = ScriptedEngine(ScriptedEngine.Config(replies=reply), tokenizer=tokenizer)
    try:
        traj = await run_episode(env, task, engine, tokenizer, CONFIG, seed=seed)
    finally:
        await engine.close()
        await env.close()
    assert traj.error is None, traj.error
    # the trainer's view: only what the engine sampled is in the loss
    sampled = [tokenizer.decode(traj.token_ids[t.start : t.end]) for t in traj.turns]
    assert sum(traj.loss_mask) == sum(t.end - t.start for t in traj.turns)
    assert [s.replace("<|im_end|>", "") for s in sampled] == [m.content for m in traj.messages if m.role == "assistant"]
    return traj


def last_user_text(prompt: str) -> str:
    return prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


async def test_reasoning_gym_episode() -> None:
    env = ReasoningGymEnv(ReasoningGymEnv.Config(train_size=4, test_size=0))
    tasks = list(env.tasks())
    answers = {t["question"]: t["answer"] for t in tasks}
    traj = await episode(env, tasks[2], lambda p: f"Thinking... <answer>{answers[last_user_text(p)]}</answer>")
    assert traj.terminated and traj.reward == 1.0 and len(traj.turns) == 1


async def test_gym_text_frozenlake_episode_follows_the_board(shortest_lake_path: Any) -> None:
    def policy(prompt: str) -> str:
        board = [line for line in last_user_text(prompt).splitlines() if re.fullmatch(r"[SFHGP]+", line)]
        return f"<action>{shortest_lake_path(board)[0]}</action>"

    env = GymTextEnv(GymTextEnv.Config(game="frozenlake", max_steps=20))
    traj = await episode(env, next(iter(env.tasks())), policy)
    assert traj.terminated and traj.reward == 1.0 and len(traj.turns) >= 6  # a 4x4 map needs >= 6 moves
    assert [t.reward for t in traj.turns][-1] == 1.0 and sum(t.reward for t in traj.turns) == 1.0


async def test_code_episode_with_feedback_and_retry(local_sandbox: Any) -> None:
    env = CodeEnv(CodeEnv.Config(max_attempts=3), sandbox=local_sandbox)
    replies = ["```python\nprint(input())\n```", "```python\nprint(' '.join(input().split()[::-1]))\n```"]
    traj = await episode(env, {"id": "reverse_words"}, replies)
    assert traj.terminated and traj.reward == 1.0 and len(traj.turns) == 2
    feedback = traj.messages[2]
    assert feedback.role == "user" and "examples failed" in feedback.content


class Boxed:
    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        found = re.findall(r"\\boxed\{([^}]*)\}", messages[-1].content)
        return RewardResult(value=float(bool(found) and found[-1] == task["answer"]))


async def test_math_single_turn_episode_keeps_the_breakdown() -> None:
    env = MathEnv(MathEnv.Config(train_size=3, test_size=0), rewards=[("boxed", 1.0, Boxed())])
    task = next(iter(env.tasks()))
    traj = await episode(env, task, [f"\\boxed{{{task['answer']}}}"])
    assert traj.reward == 1.0 and traj.reward_breakdown == {"boxed": 1.0}


async def test_gym_text_state_keys_name_the_board_each_turn_acted_on() -> None:
    env = GymTextEnv(GymTextEnv.Config(game="taxi", max_steps=3))
    task = next(iter(env.tasks()))
    await env.reset(task)
    start = env.state_key()
    # turn 0: no action (the board stays), turn 1: a move, turn 2: acts on the new board
    traj = await episode(env, task, ["hmm", "<action>north</action>", "<action>south</action>"])
    keys = [t.info.get("state_key") for t in traj.turns]
    assert keys[0] == keys[1] == start and keys[2] != start
    states = traj.tokens().turn_states
    assert states == [f"env:{k}" for k in keys]
    # without the env's keys the rendered observations differ (turn 1 reads an invalid-action note)
    for turn in traj.turns:
        del turn.info["state_key"]
    digests = traj.turn_states()
    assert all(d.startswith("obs:") for d in digests) and len(set(digests)) == 3

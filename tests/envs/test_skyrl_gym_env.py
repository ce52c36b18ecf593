"""skyrl_gym: SkyRL-Gym envs run episode by episode from SkyRL-format rows, rewards per turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("skyrl_gym")

from agentrl.chat.conversation import SimpleChatTokenizer
from agentrl.engines.scripted import ScriptedEngine
from agentrl.envkit.check import check_env
from agentrl.envs.skyrl_gym_env import SkyRLGymEnv
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.episode import run_episode


def rows(path: Path, items: list[dict[str, object]]) -> dict[str, str]:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return {"path": str(path)}


def gsm8k_rows(n: int) -> list[dict[str, object]]:
    """Rows as SkyRL's gsm8k preprocessing writes them (prompt messages, reward_spec, extra_info)."""
    return [
        {"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
         "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": str(2 * i)},
         "extra_info": {"index": i, "max_turns": 2}}
        for i in range(n)
    ]  # fmt: skip


async def test_a_multi_turn_skyrl_env_runs_with_its_turn_rewards(tmp_path: Path) -> None:
    env = SkyRLGymEnv(SkyRLGymEnv.Config(train=rows(tmp_path / "train.jsonl", gsm8k_rows(3))))
    tasks = list(env.tasks("train"))
    assert [t["id"] for t in tasks] == ["train/0", "train/1", "train/2"] and list(env.tasks("test")) == []
    tok = SimpleChatTokenizer()
    engine = ScriptedEngine(ScriptedEngine.Config(replies=["#### 5", "#### 4"]), tokenizer=tok)
    cfg = RolloutConfig(max_turns=4, max_total_tokens=4096, max_new_tokens_per_turn=32)
    try:
        traj = await run_episode(env, tasks[2], engine, tok, cfg)
    finally:
        await env.close()
    assert traj.error is None and traj.terminated
    # SkyRL's gsm8k_multi_turn: a well-formatted wrong answer earns 0.2 / max_turns, the right one 1
    assert [t.reward for t in traj.turns] == pytest.approx([0.1, 1.0]) and traj.reward == pytest.approx(1.1)
    assert traj.messages[0].content == "What is 2 + 2?" and "final numeric answer" in traj.messages[2].content


async def test_user_envs_get_their_config_and_metadata_comes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # where skyrl_probe.py lives
    source = rows(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "Guess."}]}] * 2)
    env = SkyRLGymEnv(SkyRLGymEnv.Config(train=source, env_class="agentrl_countdown", env_config={"target": 3},
                                         modules=["skyrl_probe"]))  # fmt: skip
    task = next(iter(env.tasks()))
    assert task["env_class"] == "agentrl_countdown"
    opening, _ = await env.reset(task)
    assert [m.content for m in opening] == ["Guess."]
    off = await env.step(env.parse_action("1"))
    assert off.reward == -0.1 and not off.terminated and off.messages[0].content == "off by 2"
    assert off.info == {"guess": 1}
    hit = await env.step(env.parse_action("3"))
    assert hit.terminated and hit.reward == 1.0 and hit.messages == []
    inner = env._env
    await env.close()
    assert env._env is None and inner is not None


def test_rows_without_an_env_class_need_the_default(tmp_path: Path) -> None:
    env = SkyRLGymEnv(SkyRLGymEnv.Config(train=rows(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "x"}]}])))
    with pytest.raises(ValueError, match=r"train row 0 has no env_class and env\.env_class is not set"):
        list(env.tasks())
    bad = SkyRLGymEnv(SkyRLGymEnv.Config(train=rows(tmp_path / "b.jsonl", [{"prompt": "x", "env_class": "gsm8k"}])))
    with pytest.raises(ValueError, match="prompt must be a list of chat messages"):
        list(bad.tasks())


def test_the_adapter_passes_the_env_contract(tmp_path: Path) -> None:
    data = gsm8k_rows(4)
    env = SkyRLGymEnv(SkyRLGymEnv.Config(train=rows(tmp_path / "tr.jsonl", data), test=rows(tmp_path / "te.jsonl", data)))
    report = check_env(env, n_episodes=2)  # raises EnvCheckError on a contract violation
    assert report.episodes == 2 and report.steps >= 2 and not report.warnings

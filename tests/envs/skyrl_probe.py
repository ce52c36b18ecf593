"""A SkyRL-Gym env registered from user code (the adapter imports this module via `modules`)."""

from __future__ import annotations

from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class CountdownEnv(BaseTextEnv):
    """Say a number; the env answers with how far off it was until it is hit. env_config.target sets it."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.target = int(env_config.target)  # attribute access, as SkyRL's OmegaConf configs allow
        self.closed = False

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        guess = int(action.strip() or 0)
        done = guess == self.target
        obs = [] if done else [{"role": "user", "content": f"off by {self.target - guess}"}]
        return BaseTextEnvStepOutput(observations=obs, reward=1.0 if done else -0.1, done=done,
                                     metadata={"guess": guess})  # fmt: skip


skyrl_gym.register(id="agentrl_countdown", entry_point=CountdownEnv)

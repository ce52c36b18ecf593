"""`guess_number`: find a secret integer with "higher"/"lower" hints, in as few guesses as possible."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import Field

from agentrl import Env, EnvConfig, Message, StepResult, Task


class GuessNumberConfig(EnvConfig):
    """Config of `guess_number` (unknown keys are errors: EnvConfig forbids them)."""

    low: int = 1
    high: int = Field(100, description="the secret lies in [low, high]")
    max_guesses: int = Field(8, ge=1)
    train_size: int = Field(500, ge=1)
    test_size: int = Field(50, ge=0)


class GuessNumberEnv(Env[GuessNumberConfig]):
    """Multi-turn: the model guesses, the env answers higher/lower; reward shrinks with each guess."""

    name: ClassVar[str] = "guess_number"
    description: ClassVar[str] = "Guess a secret number from higher/lower hints (example plugin)"

    def __init__(self, config: GuessNumberConfig | None = None) -> None:
        super().__init__(config)
        self._secret: int | None = None
        self._guesses = 0

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: guess_number has train and test")
        rng = random.Random(f"guess-{split}")  # fixed per split: same ids and secrets every run
        size = self.config.train_size if split == "train" else self.config.test_size
        for i in range(size):
            yield {"id": f"{split}-{i}", "secret": rng.randint(self.config.low, self.config.high)}

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self._secret = int(task["secret"])
        self._guesses = 0
        prompt = (
            f"I picked an integer between {self.config.low} and {self.config.high}. Guess it; after each guess "
            f"I say higher or lower. You have {self.config.max_guesses} guesses. Reply with just the number."
        )
        return [Message(role="user", content=prompt)], {}

    async def step(self, action: Message) -> StepResult:
        if self._secret is None:
            raise RuntimeError("step() called before reset()")
        self._guesses += 1
        numbers = re.findall(r"-?\d+", action.content)
        out_of_guesses = self._guesses >= self.config.max_guesses
        if not numbers:
            return StepResult([] if out_of_guesses else [Message(role="user", content="Reply with a number.")],
                              truncated=out_of_guesses)
        guess = int(numbers[-1])
        if guess == self._secret:
            reward = 1.0 - (self._guesses - 1) / self.config.max_guesses
            return StepResult([], reward=reward, terminated=True, info={"guesses": self._guesses})
        hint = "higher" if guess < self._secret else "lower"
        return StepResult([] if out_of_guesses else [Message(role="user", content=f"{guess} is wrong: go {hint}.")],
                          truncated=out_of_guesses, info={"hint": hint})

"""`textarena`: TextArena's multi-player text games (TicTacToe-v0, Nim-v0, KuhnPoker-v0, ...) as `TurnTaking` envs.

TextArena (pip `textarena`, offline) already speaks text: each game keeps, per
player, the messages that player has not yet read (its prompt, the board, the
other players' moves, the game's verdicts). This env plays the game's
unwrapped ("-raw") version and hands those messages out as they are:
`observe(agent)` returns an agent's unread ones (joined into one user message,
without the echo of its own moves), so each is seen once. Agents are
`player_0` ... `player_{n-1}` (TextArena's player ids 0..n-1).

Moves are TextArena's own ("[4]", "[bet]", "[0 3]"); a reply without a "[" is
wrapped in brackets first (TextArena's ActionFormattingWrapper does the same).
An invalid move is the game's own verdict: the agent gets the game's
correction (and the board) as the step's messages, `illegal_move_penalty`,
and another try; `max_illegal_moves` becomes the game's error allowance, so
one more invalid move loses the game (TextArena's rule). At the end the
game's rewards (+1/-1/0 in two-player games) are `StepResult.agent_rewards`;
`info["winner"]` is the agent with the highest reward or "draw",
`info["reason"]` the game's.

TextArena games draw chance (cards, piles) from Python's global `random`,
seeded at reset. This env keeps each episode's `random` state to itself
(swapped in around every call into the game), so an episode replays exactly
from its task seed however many episodes run at once.

`opponent_move(agent, "random", seed)` plays a uniformly random valid move
among those the agent's view names (the "[...]" moves its messages list, or
Nim's piles), each checked on a copy of the game. TextArena has no scripted
players, so "scripted" is refused.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envkit.gym_bridge import _jsonable
from agentrl.types import JSON, Message

_BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")
_PILE = re.compile(r"pile (\d+): (\d+)")
_TAGS = re.compile(r"^\[(GAME|Player \d+)\]$")


class TextArenaConfig(EnvConfig):
    """Config of the `textarena` env."""

    game: str = Field("TicTacToe-v0", description="TextArena env id, e.g. TicTacToe-v0, Nim-v0, KuhnPoker-v0")
    num_players: int = Field(2, ge=1, description="players of the game")
    max_illegal_moves: int = Field(
        2, ge=0, description="invalid moves retried per turn (the game's error allowance); the next one loses"
    )
    illegal_move_penalty: float = Field(-0.1, le=0.0, description="reward (0 or negative) of each invalid move")
    instructions: str = Field("", description="system message every agent sees first (the game's prompt follows)")
    format_actions: bool = Field(True, description="wrap a reply that has no '[' in brackets, as TextArena does")
    num_tasks: int = Field(1000, ge=1, description="tasks (= game seeds) per split")
    test_offset: int = Field(1_000_000, ge=0, description="first seed of the test split")


class TextArenaEnv(Env[TextArenaConfig]):
    """A TextArena game between `num_players` agents, in turns (`TurnTaking`, `OpponentMoves` random)."""

    name: ClassVar[str] = "textarena"
    description: ClassVar[str] = "TextArena text games (TicTacToe, Nim, Kuhn poker, ...) between agents in turns"

    def __init__(self, config: TextArenaConfig | None = None) -> None:
        super().__init__(config)
        self._game: Any = None
        self._random: Any = None  # this episode's `random` state
        self._seen: dict[str, str] = {}  # the last text each agent was shown (opponent move candidates)
        self._done = True

    # ---------------------------------------------------------------- helpers

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        """Run game code with this episode's global `random` state, keeping the caller's."""
        outer = random.getstate()
        if self._random is not None:
            random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outer)

    def _make(self) -> Any:
        import textarena

        game_id = self.config.game if self.config.game.endswith("-raw") else f"{self.config.game}-raw"
        return textarena.make(game_id)

    @property
    def _state(self) -> Any:
        if self._game is None:
            raise RuntimeError("reset() first")
        return self._game.state

    def _agent(self, pid: int) -> str:
        return f"player_{pid}"

    def _pid(self, agent: str) -> int:
        if agent not in self.agents():
            raise ValueError(f"unknown agent {agent!r}; agents: {', '.join(self.agents())}")
        return int(agent.removeprefix("player_"))

    def _render(self, pid: int, pending: list[tuple[int, str, Any]]) -> str:
        from textarena.core import ObservationType

        lines = []
        for sender, text, kind in pending:
            if sender == pid and kind == ObservationType.PLAYER_ACTION:
                continue  # the agent's own move: it is already in its conversation
            text = text.strip("\n")
            lines.append(text if sender < 0 else f"[Player {sender}] {text}")
        return "\n".join(lines)

    def _take(self, pid: int) -> str:
        pending = self._state.observations[pid]
        self._state.observations[pid] = []
        return self._render(pid, pending)

    # ---------------------------------------------------------------- TurnTaking

    def agents(self) -> list[str]:
        return [self._agent(p) for p in range(self.config.num_players)]

    def current_agent(self) -> str | None:
        if self._game is None or self._done:
            return None
        return self._agent(int(self._state.current_player_id))

    def observe(self, agent: str) -> list[Message]:
        pid = self._pid(agent)
        if self._game is None:
            return []
        text = self._take(pid)
        if not text:
            return []
        self._seen[agent] = text
        return [Message(role="user", content=text)]

    # ---------------------------------------------------------------- Env

    def tasks(self, split: str = "train") -> Iterable[Task]:
        offsets = {"train": 0, "test": self.config.test_offset}
        if split not in offsets:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(offsets)}")
        first, seats = offsets[split], self.agents()
        return (
            {"id": f"{self.config.game}/seed-{s}", "seed": s, "agent": seats[s % len(seats)]}
            for s in range(first, first + self.config.num_tasks)
        )

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        """Start the game with the task's seed (it deals every card and pile; `seed` is not used)."""
        self._game, self._random, self._seen, self._done = self._make(), None, {}, False
        with self._own_random():
            self._game.reset(num_players=self.config.num_players, seed=int(task["seed"]))
        self._state.error_allowance = self.config.max_illegal_moves
        messages = [Message(role="system", content=self.config.instructions)] if self.config.instructions else []
        return messages, {"agents": self.agents(), "first": self.current_agent()}

    async def step(self, action: Message) -> StepResult:
        agent = self.current_agent()
        if agent is None:
            raise RuntimeError("step() before reset() or after the game ended")
        pid = self._pid(agent)
        text = self._move_text(action.content or "")
        state = self._state
        turn = state.turn
        with self._own_random():
            done, _ = self._game.step(action=text)
        invalid = bool(state.game_info[pid].get("invalid_move")) or (not done and state.turn == turn)
        info: dict[str, JSON] = {"agent": agent, "action": text, "illegal": invalid}
        penalty = self.config.illegal_move_penalty if invalid else 0.0
        if not done:
            if not invalid:
                return StepResult(messages=[], info=info)
            correction = self._take(pid)
            self._seen[agent] = correction
            return StepResult(
                messages=[Message(role="user", content=correction)] if correction else [],
                reward=penalty,
                info=info,
                reward_breakdown={"illegal_move": penalty},
            )
        self._done = True
        with self._own_random():
            rewards_by_pid, game_info = self._game.close()
        rewards = {a: 0.0 for a in self.agents()}
        for p, value in (rewards_by_pid or {}).items():
            rewards[self._agent(int(p))] = float(value)
        best = max(rewards.values())
        leaders = [a for a, r in rewards.items() if r == best]
        outcome = dict(rewards)
        rewards[agent] += penalty
        reason = game_info.get(pid, {}).get("reason") if isinstance(game_info, dict) else None
        info.update(
            {
                "winner": leaders[0] if len(leaders) == 1 else "draw",
                "reason": str(reason) if reason is not None else "game over",
                "outcome": dict(outcome),
                "game_info": _jsonable(game_info),
            }
        )
        return StepResult(messages=[], reward=rewards[agent], terminated=True, info=info, agent_rewards=rewards)

    def _move_text(self, reply: str) -> str:
        if self.config.format_actions and "[" not in reply:
            return f"[{reply.strip()}]"
        return reply

    # ---------------------------------------------------------------- OpponentMoves

    def candidate_moves(self, agent: str) -> list[str]:
        """The moves the agent's last view names: its "[...]" options, or Nim's "[pile count]" moves."""
        seen = self._seen.get(agent, "")
        found = [m for m in dict.fromkeys(_BRACKETED.findall(seen)) if not _TAGS.match(m)]
        piles = _PILE.findall(seen.rsplit("Current Pile:", 1)[-1]) if "Current Pile:" in seen else []
        if piles:
            found = [f"[{p} {k}]" for p, n in piles for k in range(1, int(n) + 1)]
        return found

    def _valid_on_copy(self, pid: int, move: str) -> bool:
        trial = copy.deepcopy(self._game)
        outer = random.getstate()
        try:
            if self._random is not None:
                random.setstate(self._random)
            turn = trial.state.turn
            done, _ = trial.step(action=move)
        finally:
            random.setstate(outer)
        if trial.state.game_info[pid].get("invalid_move"):
            return False
        return bool(done) or trial.state.turn != turn

    def opponent_move(self, agent: str, kind: str, seed: int) -> Message:
        """A fixed opponent's move: "random" (a random valid move from the agent's view); no "scripted" here."""
        if agent != self.current_agent():
            raise ValueError(f"opponent_move for {agent!r}, but {self.current_agent()} is to move")
        if kind != "random":
            raise ValueError(f"textarena offers only kind 'random' (its games have no scripted players), not {kind!r}")
        pid = self._pid(agent)
        if self._state.observations[pid]:  # the runner observes first; keep its view current if it did not
            self._seen[agent] = "\n".join(x for x in (self._seen.get(agent, ""), self._render(pid, self._state.observations[pid])) if x)
        valid = [m for m in self.candidate_moves(agent) if self._valid_on_copy(pid, m)]
        if not valid:
            raise ValueError(f"{self.config.game}: found no valid move in {agent}'s view to play at random")
        turn = int(self._state.turn)
        return Message(role="assistant", content=random.Random(f"{seed}/{turn}").choice(valid))

    async def close(self) -> None:
        self._game = None
        self._done = True

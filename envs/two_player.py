"""`two_player`: small two-player text games for self-play (tic-tac-toe, Nim), as `TurnTaking` envs.

Two agents, `player_0` (moves first) and `player_1`, take turns. The env
speaks to each in its own messages: `reset` returns the rules (every agent's
opening), `observe(agent)` the agent's turn prompt (the opponent's last move,
the board, the legal moves), and a step's messages go to the agent that acted:
nothing after a legal move, a corrective message after an illegal one.

Moves are one number, which a small model can learn to emit: a cell 1-9 in
tic-tac-toe, a count of stones in Nim. The first number in the reply is the
move. An illegal reply (no number, off the board, a taken cell, too many
stones) costs `illegal_move_penalty` and the agent tries again; after
`max_illegal_moves` retries in one turn the next illegal reply forfeits the
game, so an untrained model cannot stall it.

Rewards come at the end, in `StepResult.agent_rewards`: `win_reward` to the
winner, `loss_reward` to the loser, `draw_reward` to both on a draw (zero-sum
with the defaults; the illegal-move penalties are the only non-zero-sum part).
The last step's `info["winner"]` is the winner's agent id or "draw", and
`info["reason"]` says why the game ended.

Tasks are seeds. A seed fixes the start: in tic-tac-toe `opening_moves`
random moves already on the board, in Nim the pile size. `task["agent"]` is the
seat the trained policy takes against a fixed opponent (alternating with the
seed, so an evaluation covers both seats); in self-play both seats are the
policy. Train and test seeds are disjoint ranges (the test split is held out).

A fixed opponent comes from `OpponentMoves.opponent_move(agent, kind, seed)`:
"random" (a uniformly random legal move), "scripted" (tic-tac-toe: win, else
block, else centre, corner, side; Nim: the optimal move, leaving the opponent a
multiple of `max_take + 1`, when there is one) or "optimal" (perfect play:
minimax for tic-tac-toe). The move depends only on `seed` and the position.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from functools import cache
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import JSON, Message

AGENTS = ("player_0", "player_1")
"""The agent ids of every game here; `player_0` moves first."""

OPPONENT_KINDS = ("random", "scripted", "optimal")

_SPLIT_OFFSET = {"train": 0, "test": 500_000}
_NUMBER = re.compile(r"\d+")
_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


class TwoPlayerConfig(EnvConfig):
    """Config of the `two_player` env."""

    game: Literal["tictactoe", "nim"] = Field("tictactoe", description="the game: tictactoe or nim")
    max_illegal_moves: int = Field(
        2, ge=0, description="illegal replies retried per turn; the next one forfeits the game (a loss)"
    )
    illegal_move_penalty: float = Field(-0.1, le=0.0, description="reward (0 or negative) of each illegal reply")
    win_reward: float = Field(1.0, description="the winner's reward at the end of the game")
    loss_reward: float = Field(-1.0, description="the loser's reward (a forfeit too)")
    draw_reward: float = Field(0.0, description="both players' reward on a draw")
    opening_moves: int = Field(
        0, ge=0, le=6, description="tictactoe: random moves on the board when the game starts (drawn from the seed)"
    )
    min_stones: int = Field(5, ge=1, description="nim: the smallest starting pile")
    max_stones: int = Field(20, ge=1, description="nim: the largest starting pile")
    max_take: int = Field(3, ge=1, le=9, description="nim: a move takes 1..max_take stones")
    instructions: str | None = Field(None, description="the opening system message; None: the game's rules")
    seed: int = Field(0, ge=0, description="base of the task seeds")
    train_size: int = Field(1000, ge=1, le=_SPLIT_OFFSET["test"], description="tasks (seeds) in the train split")
    test_size: int = Field(200, ge=0, le=_SPLIT_OFFSET["test"], description="tasks in the held-out test split")

    @model_validator(mode="after")
    def _piles(self) -> TwoPlayerConfig:
        if self.min_stones > self.max_stones:
            raise ValueError(f"min_stones={self.min_stones} is above max_stones={self.max_stones}")
        return self


class Game(ABC):
    """One game's rules and state; the env wraps it in turns, messages and rewards."""

    def __init__(self) -> None:
        self.to_move = 0  # index into AGENTS
        self.history: list[int] = []

    @abstractmethod
    def rules(self) -> str:
        """The rules, as the opening system message says them."""

    @abstractmethod
    def legal(self) -> list[int]:
        """The legal moves of the player to move, ascending."""

    @abstractmethod
    def _apply(self, move: int) -> None:
        """Change the position by `move` (already checked legal)."""

    @abstractmethod
    def winner(self) -> int | None:
        """The winner's index, -1 for a draw, None while the game goes on."""

    @abstractmethod
    def board(self, player: int) -> str:
        """The position as `player` sees it, with the legal moves and how to answer."""

    @abstractmethod
    def describe(self, player: int, move: int) -> str:
        """One line saying that `player` made `move`."""

    @abstractmethod
    def why_illegal(self, move: int | None) -> str:
        """Why `move` (None: the reply held no number) is not legal now."""

    @abstractmethod
    def scripted(self, rng: random.Random) -> int:
        """The built-in strategy's move."""

    @abstractmethod
    def optimal(self, rng: random.Random) -> int:
        """A move of perfect play (ties broken by `rng`)."""

    @abstractmethod
    def key(self) -> str:
        """The position, as a short string (the env's `state_key`)."""

    def play(self, move: int) -> None:
        if move not in self.legal():
            raise ValueError(f"illegal move {move}: {self.why_illegal(move)}")
        self._apply(move)
        self.history.append(move)
        self.to_move = 1 - self.to_move

    def end_reason(self) -> str:
        return "game over"


class TicTacToe(Game):
    """Tic-tac-toe: cells 1-9 row by row; player_0 is X and moves first."""

    RULES: ClassVar[str] = (
        "Tic-tac-toe. Two players, X and O, take turns marking a free cell of a 3x3 board. "
        "The cells are numbered 1-9: 1 2 3 on the top row, 4 5 6 in the middle, 7 8 9 at the bottom. "
        "Three of your marks in a row, a column or a diagonal win; a full board without a line is a draw. "
        "On your turn reply with the number of a free cell, nothing else."
    )
    marks = ("X", "O")

    def __init__(self) -> None:
        super().__init__()
        self.cells = [""] * 9

    def rules(self) -> str:
        return self.RULES

    def legal(self) -> list[int]:
        if self.winner() is not None:
            return []
        return [i + 1 for i, c in enumerate(self.cells) if not c]

    def _apply(self, move: int) -> None:
        self.cells[move - 1] = self.marks[self.to_move]

    def winner(self) -> int | None:
        return _ttt_winner(tuple(self.cells))

    def end_reason(self) -> str:
        return "draw: the board is full" if self.winner() == -1 else "three in a row"

    def board(self, player: int) -> str:
        rows = [" ".join(self.cells[r * 3 + c] or str(r * 3 + c + 1) for c in range(3)) for r in range(3)]
        free = " ".join(str(m) for m in self.legal())
        return "\n".join([*rows, f"You are {self.marks[player]}. Free cells: {free}. Reply with one number."])

    def describe(self, player: int, move: int) -> str:
        return f"{self.marks[player]} marked {move}."

    def why_illegal(self, move: int | None) -> str:
        if move is None:
            return "your reply has no cell number"
        if not 1 <= move <= 9:
            return f"there is no cell {move}"
        return f"cell {move} is taken"

    def scripted(self, rng: random.Random) -> int:
        me, them = self.marks[self.to_move], self.marks[1 - self.to_move]
        legal = self.legal()
        for mark in (me, them):  # win now, else block the opponent's win
            for move in legal:
                trial = list(self.cells)
                trial[move - 1] = mark
                if _ttt_winner(tuple(trial)) is not None and _ttt_winner(tuple(trial)) != -1:
                    return move
        for preference in ([5], [1, 3, 7, 9], [2, 4, 6, 8]):
            options = [m for m in preference if m in legal]
            if options:
                return rng.choice(options)
        raise ValueError("no legal move: the game is over")

    def optimal(self, rng: random.Random) -> int:
        legal = self.legal()
        if not legal:
            raise ValueError("no legal move: the game is over")
        scores = {m: _ttt_value(_ttt_after(tuple(self.cells), m - 1, self.marks[self.to_move]), self.to_move) for m in legal}
        best = max(scores.values())
        return rng.choice([m for m in legal if scores[m] == best])

    def key(self) -> str:
        return "".join(c or "." for c in self.cells)


def _ttt_winner(cells: tuple[str, ...]) -> int | None:
    for a, b, c in _LINES:
        if cells[a] and cells[a] == cells[b] == cells[c]:
            return TicTacToe.marks.index(cells[a])
    return -1 if all(cells) else None


def _ttt_after(cells: tuple[str, ...], index: int, mark: str) -> tuple[str, ...]:
    return (*cells[:index], mark, *cells[index + 1 :])


@cache
def _ttt_value(cells: tuple[str, ...], mover: int) -> int:
    """The value of `cells` for the player who just moved (`mover`) under perfect play: 1 win, 0 draw, -1 loss."""
    winner = _ttt_winner(cells)
    if winner is not None:
        return 0 if winner == -1 else (1 if winner == mover else -1)
    nxt = 1 - mover
    mark = TicTacToe.marks[nxt]
    return -max(_ttt_value(_ttt_after(cells, i, mark), nxt) for i, c in enumerate(cells) if not c)


class Nim(Game):
    """The subtraction game: one pile, take 1..max_take stones; whoever takes the last stone wins."""

    def __init__(self, stones: int, max_take: int) -> None:
        super().__init__()
        self.stones = stones
        self.max_take = max_take
        self.last_mover: int | None = None

    def rules(self) -> str:
        return (
            f"Nim. There is one pile of stones. Two players take turns; on your turn you take 1 to {self.max_take} "
            "stones from the pile. Whoever takes the last stone wins. "
            "On your turn reply with how many stones you take, nothing else."
        )

    def legal(self) -> list[int]:
        return list(range(1, min(self.max_take, self.stones) + 1))

    def _apply(self, move: int) -> None:
        self.stones -= move
        self.last_mover = self.to_move

    def winner(self) -> int | None:
        return self.last_mover if self.stones == 0 else None

    def end_reason(self) -> str:
        return "took the last stone"

    def board(self, player: int) -> str:
        takes = ", ".join(str(m) for m in self.legal())
        return f"Stones left: {self.stones}. You may take {takes}. Reply with one number."

    def describe(self, player: int, move: int) -> str:
        return f"Your opponent took {move}."

    def why_illegal(self, move: int | None) -> str:
        if move is None:
            return "your reply has no number of stones"
        return f"you cannot take {move}; take 1 to {min(self.max_take, self.stones)}"

    def scripted(self, rng: random.Random) -> int:
        return self.optimal(rng)

    def optimal(self, rng: random.Random) -> int:
        winning = self.stones % (self.max_take + 1)
        return winning if winning else rng.choice(self.legal())

    def key(self) -> str:
        return str(self.stones)


class TwoPlayerEnv(Env[TwoPlayerConfig]):
    """Tic-tac-toe or Nim between `player_0` and `player_1`, in turns (`TurnTaking`, `OpponentMoves`)."""

    name: ClassVar[str] = "two_player"
    description: ClassVar[str] = "Two-player text games (tic-tac-toe, Nim) for self-play; moves are one number"

    def __init__(self, config: TwoPlayerConfig | None = None) -> None:
        super().__init__(config)
        self._game: Game | None = None
        self._outbox: dict[str, list[str]] = {a: [] for a in AGENTS}
        self._illegal = 0  # illegal replies in the current turn
        self._over = False

    # ---------------------------------------------------------------- tasks

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"split={split!r} is not a split of two_player (allowed: train, test)")
        size = self.config.train_size if split == "train" else self.config.test_size
        first = self.config.seed + _SPLIT_OFFSET[split]
        game = self.config.game
        for seed in range(first, first + size):
            task: Task = {"id": f"{game}/{split}-{seed}", "game": game, "seed": seed, "agent": AGENTS[seed % 2]}
            if game == "tictactoe":
                task["opening"] = list(self._opening(seed))
            else:
                task["stones"] = random.Random(f"nim/{seed}").randint(self.config.min_stones, self.config.max_stones)
            yield task

    def _opening(self, seed: int) -> list[int]:
        """`opening_moves` random moves from the seed, stopping before one would end the game."""
        rng, game, moves = random.Random(f"tictactoe/{seed}"), TicTacToe(), []
        for _ in range(self.config.opening_moves):
            safe = [m for m in game.legal() if _ttt_winner(_ttt_after(tuple(game.cells), m - 1, "X")) is None]
            if not safe:
                break
            move = rng.choice(safe)
            game.play(move)
            moves.append(move)
        return moves

    def _new_game(self, task: Task) -> Game:
        if task.get("game", self.config.game) != self.config.game:
            raise ValueError(f"task {task.get('id')!r} is a {task.get('game')} task; this env plays {self.config.game}")
        if self.config.game == "nim":
            stones = task.get("stones")
            if not isinstance(stones, int) or stones < 1:
                raise ValueError(f"nim task {task.get('id')!r} needs 'stones', a positive int")
            return Nim(stones, self.config.max_take)
        game = TicTacToe()
        opening = task.get("opening", [])
        if not isinstance(opening, list):
            raise ValueError(f"task {task.get('id')!r}: 'opening' must be a list of cells")
        for move in opening:
            if not isinstance(move, int):
                raise ValueError(f"task {task.get('id')!r}: opening move {move!r} is not a cell number")
            game.play(move)
        if game.winner() is not None:
            raise ValueError(f"task {task.get('id')!r}: the opening already ends the game")
        return game

    # ---------------------------------------------------------------- TurnTaking

    def agents(self) -> list[str]:
        return list(AGENTS)

    def current_agent(self) -> str | None:
        if self._game is None or self._over:
            return None
        return AGENTS[self._game.to_move]

    def observe(self, agent: str) -> list[Message]:
        if agent not in self._outbox:
            raise ValueError(f"unknown agent {agent!r}; agents: {', '.join(AGENTS)}")
        parts, self._outbox[agent] = self._outbox[agent], []
        return [Message(role="user", content="\n".join(parts))] if parts else []

    # ---------------------------------------------------------------- Env

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        """Set up the task's start; `seed` is not used: the games have no chance moves (opponents take theirs)."""
        self._game = self._new_game(task)
        self._outbox = {a: [] for a in AGENTS}
        self._illegal, self._over = 0, False
        me = self._game.to_move
        opening = ""
        if self._game.history:
            opening = "The game starts from this position. "
        self._outbox[AGENTS[me]].append(f"{opening}Your turn.\n{self._game.board(me)}")
        instructions = self.config.instructions if self.config.instructions is not None else self._game.rules()
        messages = [Message(role="system", content=instructions)] if instructions else []
        return messages, {"agents": list(AGENTS), "first": AGENTS[me]}

    async def step(self, action: Message) -> StepResult:
        game = self._require_game()
        actor = game.to_move
        actor_id, other_id = AGENTS[actor], AGENTS[1 - actor]
        found = _NUMBER.search(action.content or "")
        move = int(found.group()) if found else None
        if move is None or move not in game.legal():
            return self._illegal_move(game, actor, move)
        self._illegal = 0
        game.play(move)
        info: dict[str, JSON] = {"agent": actor_id, "move": move, "illegal": False}
        result = game.winner()
        if result is None:
            self._outbox[other_id].append(f"{game.describe(actor, move)}\n{game.board(1 - actor)}")
            return StepResult(messages=[], info=info)
        if result == -1:
            rewards = {a: self.config.draw_reward for a in AGENTS}
            winner = "draw"
        else:
            rewards = {AGENTS[result]: self.config.win_reward, AGENTS[1 - result]: self.config.loss_reward}
            winner = AGENTS[result]
        return self._end(game, rewards, winner, game.end_reason(), info, last_move=(actor, move))

    def _illegal_move(self, game: Game, actor: int, move: int | None) -> StepResult:
        actor_id, other_id = AGENTS[actor], AGENTS[1 - actor]
        self._illegal += 1
        info: dict[str, JSON] = {"agent": actor_id, "move": move, "illegal": True}
        penalty = self.config.illegal_move_penalty
        reason = game.why_illegal(move)
        if self._illegal > self.config.max_illegal_moves:
            rewards = {actor_id: self.config.loss_reward + penalty, other_id: self.config.win_reward}
            return self._end(game, rewards, other_id, f"forfeit: {actor_id} made {self._illegal} illegal moves", info)
        left = self.config.max_illegal_moves - self._illegal
        tries = (
            f"Try again ({left} more illegal {'reply' if left == 1 else 'replies'} allowed)."
            if left
            else "Try again: another illegal reply loses the game."
        )
        text = f"Illegal move: {reason}. {tries}\n{game.board(actor)}"
        return StepResult(
            messages=[Message(role="user", content=text)],
            reward=penalty,
            info=info,
            reward_breakdown={"illegal_move": penalty},
        )

    def _end(
        self,
        game: Game,
        rewards: dict[str, float],
        winner: str,
        reason: str,
        info: dict[str, JSON],
        last_move: tuple[int, int] | None = None,
    ) -> StepResult:
        self._over = True
        actor_id = AGENTS[game.to_move if last_move is None else last_move[0]]
        verdict = "It is a draw." if winner == "draw" else f"{winner} wins ({reason})."
        for agent in AGENTS:
            said = ""
            if last_move is not None and agent != actor_id:
                said = game.describe(*last_move) + " "
            self._outbox[agent].append(f"{said}Game over: {verdict}")
        info.update({"winner": winner, "reason": reason, "moves": list(game.history)})
        return StepResult(
            messages=[], reward=rewards[actor_id], terminated=True, info=info, agent_rewards=rewards
        )

    def _require_game(self) -> Game:
        if self._game is None:
            raise RuntimeError("step() before reset()")
        if self._over:
            raise RuntimeError("step() after the game ended; reset() first")
        return self._game

    def state_key(self) -> str | None:
        if self._game is None:
            return None
        return f"{self.config.game}:{self._game.key()}:{AGENTS[self._game.to_move]}"

    # ---------------------------------------------------------------- OpponentMoves

    def opponent_move(self, agent: str, kind: str, seed: int) -> Message:
        """The move of a fixed opponent playing `agent` now: "random", "scripted" or "optimal"."""
        game = self._require_game()
        if agent != AGENTS[game.to_move]:
            raise ValueError(f"opponent_move for {agent!r}, but {AGENTS[game.to_move]} is to move")
        rng = random.Random(f"{seed}/{self.state_key()}")
        if kind == "random":
            move = rng.choice(game.legal())
        elif kind == "scripted":
            move = game.scripted(rng)
        elif kind == "optimal":
            move = game.optimal(rng)
        else:
            raise ValueError(f"unknown opponent kind {kind!r}; allowed: {', '.join(OPPONENT_KINDS)}")
        return Message(role="assistant", content=str(move))

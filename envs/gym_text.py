"""`gym_text`: Gymnasium toy-text games (FrozenLake, Taxi, Blackjack) played in chat.

Each turn the env shows the board as plain text and the legal actions; the
model replies with `<action>NAME</action>` (a bare action word is accepted as a
fallback: the last one in the reply wins). The game's own reward is the
per-turn reward; `terminated`/`truncated` are the game's (truncated also when
`max_steps` turns are used up). A reply naming no legal action does not move
the game, costs `invalid_action_penalty` and counts as a turn; more than
`max_invalid_actions` of them truncate the episode.

Tasks are seeds. FrozenLake draws a fresh random map per seed; Taxi and
Blackjack use the seed for the start state / the first cards. The episode seed
(one per GRPO sample) only varies what happens later (slippery moves, cards
drawn), so the samples of a group play the same start. Train and test seeds
are disjoint ranges derived from `seed`, so ids are stable across runs.

Unlike the generic `gymnasium` adapter (agentrl.envkit.gym_bridge), this env knows
its three games: readable boards and legends, named actions, per-seed maps.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.types import JSON, Message

Game = Literal["frozenlake", "taxi", "blackjack"]

ACTIONS: dict[str, tuple[str, ...]] = {
    "frozenlake": ("left", "down", "right", "up"),
    "taxi": ("south", "north", "east", "west", "pickup", "dropoff"),
    "blackjack": ("stick", "hit"),
}

RULES: dict[str, str] = {
    "frozenlake": (
        "You are on a frozen lake grid. S is the start, F is frozen ice (safe), H is a hole "
        "(falling in ends the game), G is the goal, P is you. Reach G to win (reward 1)."
    ),
    "taxi": (
        "You drive a taxi on a 5x5 grid. Walls are '|'; ':' can be crossed. R, G, Y and B are "
        "stops. T is the taxi. Pick the passenger up at their stop and drop them off at the "
        "destination. Each move costs 1, a delivery earns 20, an illegal pickup/dropoff costs 10."
    ),
    "blackjack": (
        "You play blackjack against the dealer. Get closer to 21 than the dealer without going "
        "over. Aces count 1 or 11, face cards 10. Win +1, lose -1, draw 0."
    ),
}

_TAG = re.compile(r"<action>\s*(.*?)\s*</action>", re.IGNORECASE | re.DOTALL)
_SPLIT_OFFSET = {"train": 0, "test": 500_000}
_TAXI_STOPS = "RGYB"


class GymTextConfig(EnvConfig):
    """Config of the `gym_text` env."""

    game: Game = Field("frozenlake", description="game to play: frozenlake, taxi or blackjack")
    game_params: dict[str, JSON] = Field(
        default_factory=dict,
        description="extra gymnasium.make kwargs (e.g. is_slippery for frozenlake, natural for blackjack)",
    )
    map_size: int = Field(4, ge=2, le=12, description="frozenlake: side of the random map")
    frozen_prob: float = Field(0.8, gt=0.0, le=1.0, description="frozenlake: probability a tile is frozen")
    max_steps: int = Field(20, ge=1, description="turns before the episode is truncated")
    invalid_action_penalty: float = Field(
        0.0, le=0.0, description="reward (0 or negative) of a turn whose reply names no legal action"
    )
    max_invalid_actions: int = Field(3, ge=0, description="replies naming no action allowed before truncation")
    seed: int = Field(0, ge=0, description="base of the task seeds")
    train_size: int = Field(1000, ge=1, le=_SPLIT_OFFSET["test"], description="tasks (= game seeds) in the train split")
    test_size: int = Field(
        100, ge=0, le=_SPLIT_OFFSET["test"], description="tasks in the test split (seeds disjoint from train); 0 = none"
    )
    show_neighbours: bool = Field(
        False,
        description="frozenlake: add a line naming what each move leads to (ice, hole, goal or wall) under the board",
    )
    few_shot: int = Field(
        0,
        ge=0,
        le=8,
        description="frozenlake: solved train games shown before the task as earlier turns (prompt tokens, no loss)",
    )
    demonstrations: int = Field(
        0,
        ge=0,
        le=_SPLIT_OFFSET["test"],
        description="frozenlake: solved games on the first N train boards (shortest path) for an SFT warm start",
    )


class GymTextEnv(Env[GymTextConfig]):
    """A toy-text Gymnasium game as a multi-turn chat env."""

    name: ClassVar[str] = "gym_text"
    description: ClassVar[str] = "FrozenLake, Taxi or Blackjack as text; actions parsed from the reply"

    def __init__(self, config: GymTextConfig | None = None) -> None:
        super().__init__(config)
        self._game: Any = None
        self._obs: Any = None
        self._steps = 0
        self._invalid = 0
        self._return = 0.0

    @property
    def actions(self) -> tuple[str, ...]:
        return ACTIONS[self.config.game]

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"split={split!r} is not a split of gym_text (allowed: train, test)")
        size = self.config.train_size if split == "train" else self.config.test_size
        base = self.config.seed * 1_000_000 + _SPLIT_OFFSET[split]
        for i in range(size):
            yield {"id": f"{self.config.game}/{split}/{base + i}", "game": self.config.game, "seed": base + i}

    def _make(self, task_seed: int) -> Any:
        import gymnasium as gym

        params = dict(self.config.game_params)
        if self.config.game == "frozenlake":
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map

            params.setdefault("is_slippery", False)
            params.setdefault("desc", generate_random_map(self.config.map_size, self.config.frozen_prob, task_seed))
            return gym.make("FrozenLake-v1", **params)
        if self.config.game == "taxi":
            return gym.make("Taxi-v4", **params)
        return gym.make("Blackjack-v1", **params)

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        if task.get("game", self.config.game) != self.config.game:
            raise ValueError(f"task {task.get('id')!r} is for game {task['game']!r}, env plays {self.config.game!r}")
        task_seed = int(task["seed"])
        if self._game is not None:
            self._game.close()
        self._game = self._make(task_seed)
        self._obs, _ = self._game.reset(seed=task_seed)  # the task fixes the start state
        if seed is not None:  # the sample seed varies later randomness (slips, cards drawn), reproducibly
            import numpy as np

            self._game.unwrapped.np_random = np.random.default_rng([task_seed, seed])
        self._steps = 0
        self._invalid = 0
        self._return = 0.0
        if self.config.game == "frozenlake" and self.config.few_shot:
            shots = [m for demo in self._solved_games(self.config.few_shot) for m in demo]
            return [*shots, Message(role="user", content="New board.\n" + self.render())], {"game": self.config.game}
        return [Message(role="user", content=self._intro() + self.render())], {"game": self.config.game}

    def _intro(self) -> str:
        return (
            f"{RULES[self.config.game]}\nActions: {', '.join(self.actions)}. "
            "Reply with exactly one action as <action>NAME</action>.\n\n"
        )

    def demonstrations(self) -> list[list[Message]]:
        """FrozenLake games played perfectly on the first `demonstrations` train boards (for an SFT warm start).

        Each is the conversation an episode would have (same opening, same boards) with a
        shortest path's moves as the replies, found by breadth-first search around the
        holes. Boards come from the train split only, so held-out boards stay unseen.
        Other games have no demonstrations.
        """
        if self.config.game != "frozenlake":
            return []
        return self._solved_games(self.config.demonstrations)

    def _solved_games(self, count: int) -> list[list[Message]]:
        """Shortest-path games on the first `count` train boards, as conversations."""
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        demos = []
        for task in list(self.tasks("train"))[:count]:
            desc = generate_random_map(self.config.map_size, self.config.frozen_prob, int(task["seed"]))
            pos = (0, 0)
            board = lake_text(desc, pos, neighbours=self.config.show_neighbours)
            messages = [Message(role="user", content=self._intro() + board)]
            for move in shortest_lake_path(desc)[: self.config.max_steps]:
                if messages[-1].role == "assistant":
                    board = lake_text(desc, pos, neighbours=self.config.show_neighbours)
                    messages.append(Message(role="user", content=board))
                messages.append(Message(role="assistant", content=f"<action>{move}</action>"))
                pos = (pos[0] + _MOVES[move][0], pos[1] + _MOVES[move][1])
            demos.append(messages)
        return demos

    def state_key(self) -> str:
        """The game's own state (Gymnasium's observation) as a key: equal keys, equal boards.

        The rollout reads it after every reset and step, so turn-level credit (GiGPO) groups
        turns that faced the same board however the text around it differed
        (an invalid-action note, say).
        """
        return str(self._obs)

    def render(self) -> str:
        """The current game state as text."""
        if self._game is None:
            raise RuntimeError("render() called before reset()")
        return {"frozenlake": self._render_lake, "taxi": self._render_taxi, "blackjack": self._render_blackjack}[
            self.config.game
        ]()

    def _render_lake(self) -> str:
        game = self._game.unwrapped
        desc = ["".join(c.decode() for c in row) for row in game.desc]
        return lake_text(desc, divmod(int(self._obs), game.ncol), neighbours=self.config.show_neighbours)

    def _render_taxi(self) -> str:
        game = self._game.unwrapped
        taxi_r, taxi_c, passenger, dest = game.decode(int(self._obs))
        rows = [[c.decode() for c in row] for row in game.desc]
        rows[1 + taxi_r][2 * taxi_c + 1] = "T"
        where = "in the taxi" if passenger == 4 else f"waiting at {_TAXI_STOPS[passenger]}"
        return "\n".join(
            ["".join(row) for row in rows]
            + [f"Taxi at row {taxi_r}, column {taxi_c}. Passenger {where}. Destination: {_TAXI_STOPS[dest]}."]
        )

    def _render_blackjack(self) -> str:
        game = self._game.unwrapped
        player_sum, dealer_card, usable_ace = self._obs
        cards = ", ".join(_card(c) for c in game.player)
        ace = " (one ace counts 11)" if usable_ace else ""
        return f"Your cards: {cards} = {player_sum}{ace}. Dealer shows: {_card(dealer_card)}."

    def parse_choice(self, text: str) -> str | None:
        """The action the reply names, or None. Tags win; else the last bare action word."""
        tagged = _TAG.findall(text)
        if tagged:
            choice = tagged[-1].strip().lower()
            return choice if choice in self.actions else None
        words = re.findall(r"[a-z]+", text.lower())
        found = [w for w in words if w in self.actions]
        return found[-1] if found else None

    async def step(self, action: Message) -> StepResult:
        if self._game is None:
            raise RuntimeError("step() called before reset()")
        self._steps += 1
        choice = self.parse_choice(action.content)
        out_of_turns = self._steps >= self.config.max_steps
        if choice is None:
            self._invalid += 1
            out_of_turns = out_of_turns or self._invalid > self.config.max_invalid_actions
            reward = self.config.invalid_action_penalty
            self._return += reward
            note = f"Invalid action. Choose one of: {', '.join(self.actions)}, as <action>NAME</action>.\n"
            return StepResult(
                messages=[] if out_of_turns else [Message(role="user", content=note + self.render())],
                reward=reward,
                truncated=out_of_turns,
                info={"invalid_action": True, "return": self._return},
                truncation_reason=(
                    ("invalid_actions" if self._steps < self.config.max_steps else "max_steps") if out_of_turns else None
                ),
            )
        self._obs, game_reward, terminated, truncated, _ = self._game.step(self.actions.index(choice))
        reward = float(game_reward)
        self._return += reward
        info: dict[str, JSON] = {"action": choice, "return": self._return}
        reason = None
        if truncated or (out_of_turns and not terminated):
            reason = "game_time_limit" if truncated else "max_steps"
        truncated = bool(truncated) or (out_of_turns and not terminated)
        done = bool(terminated) or truncated
        if done:
            info["final_state"] = self.render()
        return StepResult(
            messages=[] if done else [Message(role="user", content=self.render())],
            reward=reward,
            terminated=bool(terminated),
            truncated=truncated,
            info=info,
            truncation_reason=reason,
        )

    async def close(self) -> None:
        if self._game is not None:
            self._game.close()
            self._game = None


_MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
_TILE_NAMES = {"S": "ice", "F": "ice", "H": "hole", "G": "goal"}


def lake_text(desc: list[str], at: tuple[int, int], *, neighbours: bool = False) -> str:
    """A FrozenLake board with the player (P) at `at` = (row, column); optionally what each move leads to."""
    rows = [list(row) for row in desc]
    r, c = at
    rows[r][c] = "P"
    lines = ["".join(row) for row in rows]
    if neighbours:
        around = []
        for move, (dr, dc) in _MOVES.items():
            nr, nc = r + dr, c + dc
            inside = 0 <= nr < len(desc) and 0 <= nc < len(desc[0])
            around.append(f"{move}={_TILE_NAMES[desc[nr][nc]] if inside else 'wall'}")
        lines.append("Moves: " + " ".join(around))
    return "\n".join(lines)


def shortest_lake_path(desc: list[str]) -> list[str]:
    """The moves of a shortest path from S (top left) to G around the holes (breadth-first search)."""
    start = (0, 0)
    queue: deque[tuple[tuple[int, int], list[str]]] = deque([(start, [])])
    seen = {start}
    while queue:
        (r, c), path = queue.popleft()
        if desc[r][c] == "G":
            return path
        for move, (dr, dc) in _MOVES.items():
            nxt = (r + dr, c + dc)
            inside = 0 <= nxt[0] < len(desc) and 0 <= nxt[1] < len(desc[0])
            if inside and desc[nxt[0]][nxt[1]] != "H" and nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, [*path, move]))
    raise ValueError("the board has no path from S to G")


def _card(value: int) -> str:
    return "A" if value == 1 else str(value)

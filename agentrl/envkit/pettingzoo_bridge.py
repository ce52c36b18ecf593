"""PettingZoo AEC env -> agentrl: `PettingZooEnv` plays any AEC env in turns, in chat (the `pettingzoo` env plugin).

PettingZoo's AEC cycle (`agent_iter()`, `last()`, `step(action)`, `observe(agent)`)
is the same shape as agentrl's `TurnTaking`: one agent acts at a time. This
bridge maps it onto messages, as `agentrl.envkit.gym_bridge` does for
single-agent Gymnasium envs:

- `current_agent()` is the env's `agent_selection` (None once every agent is
  done); agents that terminated or were truncated are stepped with `None`
  and removed, as the AEC loop does, without asking anybody.
- When the turn comes to an agent, its observation is rendered to text
  (`render`, a user function `(agent, observation) -> str`; by default the
  raw values) with the legal actions from the action mask, and waits in that
  agent's `observe()`; with `announce_moves` the other agents also hear each
  move (`describe_move`).
- `step(action)` parses the acting agent's reply into an env action (`parse`,
  a user function `(agent, text, mask) -> action | None`; by default an index
  or an `action_names` name, tagged `<action>...</action>` or bare). An
  unparseable or masked-out action never reaches the env: the agent gets a
  corrective message and `illegal_move_penalty`, and after
  `max_illegal_moves` retries in one turn the next illegal reply forfeits the
  game (`forfeit_reward` to it, `forfeit_win_reward` to the others).
- Rewards are PettingZoo's `env.rewards` after every step (the instantaneous
  rewards of all agents, per the AEC API), summed over the step and the
  dead-agent steps after it, and returned as `StepResult.agent_rewards`
  (non-zero entries only; None when nobody was rewarded). When the game ends,
  `info["winner"]` is the agent with the highest game return, or "draw", and
  `info["returns"]` every agent's game return (illegal-move penalties aside).

Render, parse and a scripted opponent are given as "module:function" strings in
the config (YAML runs), as constructor arguments, or by overriding the
methods of the same names in a subclass. `OpponentMoves.opponent_move` plays
"random" (a uniformly random legal action) and "scripted" (the user's
`scripted` function `(agent, observation, mask, rng) -> action`).

Tasks are seeds (`env.reset(seed=...)`); `task["agent"]` names the seat the
trained policy takes against a fixed opponent, cycling through the agents.
PettingZoo is imported lazily: importing this module does not import it.
"""

from __future__ import annotations

import importlib
import random
import re
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envkit.gym_bridge import _jsonable
from agentrl.types import JSON, Message

RenderFn = Callable[[str, Any], str]
"""(agent, observation) -> the text the agent reads."""

ParseFn = Callable[[str, str, Any], Any]
"""(agent, reply text, action mask or None) -> the env action, or None when the reply names none."""

ScriptedFn = Callable[[str, Any, Any, random.Random], Any]
"""(agent, observation, action mask or None, rng) -> the scripted opponent's env action."""

_TAG = re.compile(r"<action>\s*(.*?)\s*</action>", re.IGNORECASE | re.DOTALL)


def load_callable(path: str) -> Any:
    """"package.module:function" -> the function (config strings name user hooks this way)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{path!r} is not 'module:function'")
    found: Any = importlib.import_module(module)
    for part in attr.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise ValueError(f"{path!r} is {found!r}, not callable")
    return found


class PettingZooEnvConfig(EnvConfig):
    """Config of `PettingZooEnv` (plugin name `pettingzoo`)."""

    make: str = Field(
        description="the AEC env: a module with env() (e.g. 'pettingzoo.classic.tictactoe_v3') or 'module:factory'"
    )
    make_kwargs: dict[str, JSON] = Field(default_factory=dict, description="keyword arguments of the env factory")
    render: str | None = Field(None, description="'module:function' (agent, observation) -> text; None: raw values")
    parse: str | None = Field(
        None, description="'module:function' (agent, text, mask) -> action or None; None: index or action name"
    )
    scripted: str | None = Field(
        None, description="'module:function' (agent, observation, mask, rng) -> action: the 'scripted' opponent"
    )
    action_names: list[str] | None = Field(None, description="names of the Discrete actions, in index order")
    instructions: str = Field("", description="system prompt every agent sees first: the rules of the game")
    announce_moves: bool = Field(True, description="tell the other agents each move (describe_move)")
    num_tasks: int = Field(1000, ge=1, description="tasks (= reset seeds) per split")
    test_offset: int = Field(1_000_000, ge=0, description="first seed of the test split")
    max_illegal_moves: int = Field(2, ge=0, description="illegal replies retried per turn; the next one forfeits")
    illegal_move_penalty: float = Field(-0.1, le=0.0, description="reward (0 or negative) of each illegal reply")
    forfeit_reward: float = Field(-1.0, description="reward of the agent that forfeits (on top of the penalty)")
    forfeit_win_reward: float = Field(1.0, description="reward of every other agent when one forfeits")
    max_steps: int | None = Field(None, ge=1, description="env steps before the episode is truncated (None: no limit)")


class PettingZooEnv(Env[PettingZooEnvConfig]):
    """Plays a PettingZoo AEC env in turns: `TurnTaking` and `OpponentMoves` over messages."""

    name: ClassVar[str] = "pettingzoo"
    description: ClassVar[str] = "Any PettingZoo AEC env (turn-based, multi-agent), played as text"

    def __init__(
        self,
        config: PettingZooEnvConfig | None = None,
        *,
        make: Callable[..., Any] | None = None,
        render: RenderFn | None = None,
        parse: ParseFn | None = None,
        scripted: ScriptedFn | None = None,
    ) -> None:
        super().__init__(config)
        cfg = self.config
        self._make = make
        self._render = render or (load_callable(cfg.render) if cfg.render else None)
        self._parse = parse or (load_callable(cfg.parse) if cfg.parse else None)
        self._scripted = scripted or (load_callable(cfg.scripted) if cfg.scripted else None)
        self._aec: Any = None
        self._outbox: dict[str, list[str]] = {}
        self._game_returns: dict[str, float] = {}
        self._illegal = 0
        self._steps = 0
        self._over = True
        self._started = False

    # ---------------------------------------------------------------- overridable hooks

    def make_env(self) -> Any:
        """Build the AEC env: the constructor's `make`, else the config's module `env()` / 'module:factory'."""
        kwargs: dict[str, Any] = dict(self.config.make_kwargs)
        if self._make is not None:
            return self._make(**kwargs)
        target = self.config.make
        factory = load_callable(target) if ":" in target else importlib.import_module(target).env
        return factory(**kwargs)

    def render_observation(self, agent: str, observation: Any) -> str:
        """The agent's observation as text: the user's `render`, else the raw values."""
        if self._render is not None:
            return self._render(agent, observation)
        if isinstance(observation, dict) and "observation" in observation:
            observation = observation["observation"]
        return f"Observation: {_jsonable(observation)}"

    def action_help(self, agent: str, mask: Any) -> str:
        """The legal actions and how to answer (appended to every turn prompt and correction)."""
        legal = self.legal_actions(agent, mask)
        if legal is None:
            return "Reply with <action>YOUR ACTION</action>."
        return f"Legal actions: {', '.join(self.format_move(agent, a) for a in legal)}. Reply with one of them."

    def parse_move(self, agent: str, text: str, mask: Any) -> Any | None:
        """The env action the reply names (legal or not), or None: the user's `parse`, else an index or name."""
        if self._parse is not None:
            return self._parse(agent, text, mask)
        n = self._discrete_n(agent)
        if n is None:
            raise ValueError(f"{self.config.make}: action space {self.aec.action_space(agent)} is not Discrete; give a parse")
        names = [name.lower() for name in self.config.action_names or []]
        tagged = _TAG.findall(text)
        words = [tagged[-1]] if tagged else list(reversed(re.findall(r"[\w-]+", text)))
        for word in words:
            word = word.strip().strip(".!\"'`").lower()
            if word in names:
                return names.index(word)
            if re.fullmatch(r"-?\d+", word):
                return int(word)
        return None

    def format_move(self, agent: str, action: Any) -> str:
        """An action as the agent would write it (what `parse_move` reads back): its name, else its value."""
        names = self.config.action_names
        if names is not None and isinstance(action, int) and 0 <= action < len(names):
            return names[action]
        return str(_jsonable(action))

    def describe_move(self, agent: str, action: Any) -> str:
        """One line telling the other agents what `agent` did."""
        return f"{agent} played {self.format_move(agent, action)}."

    def scripted_move(self, agent: str, observation: Any, mask: Any, rng: random.Random) -> Any:
        """The "scripted" opponent's action: the user's `scripted` function."""
        if self._scripted is None:
            raise ValueError(f"{self.config.make} has no scripted opponent: give env.scripted ('module:function')")
        return self._scripted(agent, observation, mask, rng)

    # ---------------------------------------------------------------- masks and legality

    @property
    def aec(self) -> Any:
        if self._aec is None:
            self._aec = self.make_env()
        return self._aec

    def _discrete_n(self, agent: str) -> int | None:
        from gymnasium.spaces import Discrete

        space = self.aec.action_space(agent)
        return int(space.n) if isinstance(space, Discrete) else None

    def action_mask(self, agent: str, observation: Any = None) -> Any | None:
        """The agent's legal-action mask: `observation["action_mask"]`, else `infos[agent]["action_mask"]`, else None."""
        if observation is None:
            observation = self.aec.observe(agent)
        if isinstance(observation, dict) and "action_mask" in observation:
            return observation["action_mask"]
        info = self.aec.infos.get(agent, {})
        return info.get("action_mask") if isinstance(info, dict) else None

    def legal_actions(self, agent: str, mask: Any) -> list[int] | None:
        """The legal Discrete actions (from the mask, else the whole space); None for other spaces."""
        n = self._discrete_n(agent)
        if n is None:
            return None
        if mask is None:
            return list(range(n))
        return [i for i in range(n) if bool(mask[i])]

    def is_legal(self, agent: str, action: Any, mask: Any) -> bool:
        legal = self.legal_actions(agent, mask)
        if legal is not None:
            return isinstance(action, int) and not isinstance(action, bool) and action in legal
        try:
            return bool(self.aec.action_space(agent).contains(action))
        except Exception:  # a space that cannot even compare the value: not legal
            return False

    # ---------------------------------------------------------------- TurnTaking

    def agents(self) -> list[str]:
        return [str(a) for a in self.aec.possible_agents]

    def current_agent(self) -> str | None:
        if self._over:
            return None
        return str(self.aec.agent_selection)

    def observe(self, agent: str) -> list[Message]:
        if agent not in self._outbox:
            raise ValueError(f"unknown agent {agent!r}; agents: {', '.join(self._outbox) or 'none (reset first)'}")
        parts, self._outbox[agent] = self._outbox[agent], []
        return [Message(role="user", content="\n".join(parts))] if parts else []

    # ---------------------------------------------------------------- Env

    def tasks(self, split: str = "train") -> Iterable[Task]:
        offsets = {"train": 0, "test": self.config.test_offset}
        if split not in offsets:
            raise ValueError(f"unknown split {split!r}; allowed: {', '.join(offsets)}")
        seats = self.agents()
        first = offsets[split]
        return (
            {"id": f"{self.config.make}/seed-{s}", "seed": s, "agent": seats[s % len(seats)]}
            for s in range(first, first + self.config.num_tasks)
        )

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        """Reset the AEC env with the task's seed (which fixes any chance in the game; `seed` is not used)."""
        self.aec.reset(seed=int(task["seed"]))
        self._outbox = {a: [] for a in self.agents()}
        self._game_returns = dict.fromkeys(self.agents(), 0.0)
        self._illegal, self._steps, self._over, self._started = 0, 0, False, True
        rewards = self._remove_dead()
        if not self.aec.agents:
            raise RuntimeError(f"{self.config.make}: no agent is left to act right after reset")
        for agent, value in rewards.items():
            self._game_returns[agent] += value
        self._prompt_turn()
        messages = [Message(role="system", content=self.config.instructions)] if self.config.instructions else []
        return messages, {"agents": self.agents(), "first": self.current_agent()}

    async def step(self, action: Message) -> StepResult:
        agent = self.current_agent()
        if agent is None:
            raise RuntimeError("step() before reset() or after the episode ended")
        observation = self.aec.observe(agent)
        mask = self.action_mask(agent, observation)
        move = self.parse_move(agent, action.content or "", mask)
        if move is None or not self.is_legal(agent, move, mask):
            return self._illegal_move(agent, move, mask)
        self._illegal = 0
        self.aec.step(move)
        self._steps += 1
        rewards = {str(a): float(r) for a, r in self.aec.rewards.items()}
        ended = {str(a): (bool(self.aec.terminations[a]), bool(self.aec.truncations[a])) for a in self.aec.agents}
        for who, value in self._remove_dead().items():
            rewards[who] = rewards.get(who, 0.0) + value
        rewards = {a: r for a, r in rewards.items() if r != 0.0}
        for who, value in rewards.items():
            self._game_returns[who] = self._game_returns.get(who, 0.0) + value
        info: dict[str, JSON] = {"agent": agent, "action": _jsonable(move), "illegal": False}
        if self.config.announce_moves:
            for other in self._outbox:
                if other != agent:
                    self._outbox[other].append(self.describe_move(agent, move))
        terminated = truncated = False
        if not self.aec.agents:
            truncated = any(tr for _, tr in ended.values()) and not all(te for te, _ in ended.values())
            terminated = not truncated
        elif self.config.max_steps is not None and self._steps >= self.config.max_steps:
            truncated = True
        if terminated or truncated:
            self._finish(info, reason="truncated" if truncated else "game over")
        else:
            self._prompt_turn()
        return StepResult(
            messages=[],
            reward=rewards.get(agent, 0.0),
            terminated=terminated,
            truncated=truncated,
            info=info,
            agent_rewards=rewards or None,
            truncation_reason=("max_steps" if self.aec.agents else "env") if truncated else None,
        )

    def _illegal_move(self, agent: str, move: Any, mask: Any) -> StepResult:
        self._illegal += 1
        penalty = self.config.illegal_move_penalty
        shown = "no action" if move is None else f"{self.format_move(agent, move)} is not a legal action"
        info: dict[str, JSON] = {"agent": agent, "action": _jsonable(move), "illegal": True}
        if self._illegal > self.config.max_illegal_moves:
            rewards = {a: self.config.forfeit_win_reward for a in self._game_returns if a != agent}
            rewards[agent] = self.config.forfeit_reward
            for who, value in rewards.items():
                self._game_returns[who] += value
            rewards[agent] += penalty
            info["forfeit"] = agent
            others = [a for a in rewards if a != agent]
            winner = others[0] if len(others) == 1 else "draw"
            self._finish(info, reason=f"forfeit: {agent} made {self._illegal} illegal moves", winner=winner)
            return StepResult(messages=[], reward=rewards[agent], terminated=True, info=info, agent_rewards=rewards)
        left = self.config.max_illegal_moves - self._illegal
        tries = f"{left} more illegal {'reply' if left == 1 else 'replies'} allowed" if left else "another illegal reply loses"
        text = f"Illegal move: {shown} ({tries}). {self.action_help(agent, mask)}"
        return StepResult(
            messages=[Message(role="user", content=text)],
            reward=penalty,
            info=info,
            reward_breakdown={"illegal_move": penalty},
        )

    def _remove_dead(self) -> dict[str, float]:
        """Step the selected dead agents with None (the AEC loop's rule) and sum what that rewards."""
        rewards: dict[str, float] = {}
        aec = self.aec
        while aec.agents and (aec.terminations[aec.agent_selection] or aec.truncations[aec.agent_selection]):
            aec.step(None)
            for who, value in aec.rewards.items():
                rewards[str(who)] = rewards.get(str(who), 0.0) + float(value)
        return rewards

    def _prompt_turn(self) -> None:
        agent = str(self.aec.agent_selection)
        observation = self.aec.observe(agent)
        mask = self.action_mask(agent, observation)
        self._outbox[agent].append(f"{self.render_observation(agent, observation)}\n{self.action_help(agent, mask)}")

    def _finish(self, info: dict[str, JSON], reason: str | None = None, winner: str | None = None) -> None:
        """End the episode: the winner (given, else the one highest game return, else "draw") to info and all."""
        self._over = True
        returns = dict(self._game_returns)
        if winner is None:
            best = max(returns.values())
            leaders = [a for a, r in returns.items() if r == best]
            winner = leaders[0] if len(leaders) == 1 else "draw"
        info.update({"winner": winner, "returns": dict(returns), "reason": reason or "game over"})
        verdict = "draw" if winner == "draw" else f"{winner} wins"
        for agent in self._outbox:
            self._outbox[agent].append(f"Game over: {verdict}.")

    # ---------------------------------------------------------------- OpponentMoves

    def opponent_move(self, agent: str, kind: str, seed: int) -> Message:
        """A fixed opponent's move for the agent to act: "random" (a legal action) or "scripted" (the user's)."""
        if agent != self.current_agent():
            raise ValueError(f"opponent_move for {agent!r}, but {self.current_agent()} is to act")
        observation = self.aec.observe(agent)
        mask = self.action_mask(agent, observation)
        rng = random.Random(f"{seed}/{self._steps}")
        if kind == "random":
            legal = self.legal_actions(agent, mask)
            if legal is None:
                space = self.aec.action_space(agent)
                space.seed(rng.randrange(2**31))
                move = space.sample()
            elif not legal:
                raise ValueError(f"{agent} has no legal action")
            else:
                move = rng.choice(legal)
        elif kind == "scripted":
            move = self.scripted_move(agent, observation, mask, rng)
        else:
            raise ValueError(f"unknown opponent kind {kind!r}; allowed: random, scripted")
        return Message(role="assistant", content=self.format_move(agent, move))

    async def close(self) -> None:
        if self._aec is not None:
            aec, self._aec = self._aec, None
            aec.close()

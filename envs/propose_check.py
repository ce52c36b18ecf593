"""`propose_check`: two cooperating agents on the calculator's arithmetic problems.

The `proposer` reads the problem and proposes an answer; the `checker` reads
the problem and the proposal and gives the final answer (it confirms or
corrects). Both share the reward: `reward` when the checker's final answer is
right, plus `proposer_bonus` to the proposer when its own proposal was right
(so it learns even when the checker rescues it). No tools: each agent answers
in one turn, as "Answer: <number>".

A multi-agent env (`TurnTaking`): a multi-policy run maps the two agents to two
policies (`agents: {proposer: alice, checker: bob}`, examples/propose_check.yaml),
each trained on its own turns; both seats can also be one policy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import Field

from agentrl.env import Env, EnvConfig, StepResult, Task
from agentrl.envs.calculator import CalculatorConfig, CalculatorEnv, extract_answer
from agentrl.types import JSON, Message

AGENTS = ("proposer", "checker")


class ProposeCheckConfig(EnvConfig):
    """Config of the `propose_check` env."""

    digits: int = Field(1, ge=1, le=6, description="digits of each operand")
    num_operands: int = Field(2, ge=2, le=6, description="numbers in each problem")
    style: Literal["word", "plain", "mixed"] = Field("plain", description="word problems, bare expressions, or both")
    seed: int = Field(0, description="seed of the problems (the calculator's generator)")
    n_train: int = Field(1000, ge=1, description="problems in the train split")
    n_test: int = Field(200, ge=0, description="problems in the held-out test split")
    reward: float = Field(1.0, description="both agents' reward when the checker's final answer is right")
    proposer_bonus: float = Field(0.5, ge=0.0, description="the proposer's extra reward when its proposal is right")


class ProposeCheckEnv(Env[ProposeCheckConfig]):
    """A proposer and a checker answer arithmetic problems together (see the module docstring)."""

    name: ClassVar[str] = "propose_check"
    description: ClassVar[str] = "two cooperating agents: a proposer answers, a checker confirms or corrects"

    def __init__(self, config: ProposeCheckConfig | None = None) -> None:
        super().__init__(config)
        c = self.config
        problems = CalculatorConfig.model_validate(
            {"digits": c.digits, "num_operands": c.num_operands, "style": c.style, "seed": c.seed,
             "n_train": c.n_train, "n_test": c.n_test}
        )
        self.problems = CalculatorEnv(problems)
        self.task: Task = {}
        self.next: str | None = None
        self.proposal: float | None = None
        self.unseen: dict[str, list[Message]] = {}
        self._problem = ""

    def tasks(self, split: str = "train") -> Iterable[Task]:
        return self.problems.tasks(split)

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[list[Message], dict[str, Any]]:
        self.task, self.next, self.proposal = task, AGENTS[0], None
        problem = str(task["prompt"])
        self.unseen = {
            "proposer": [Message("user", f"Problem: {problem}\nPropose the answer as: Answer: <number>")],
            "checker": [],
        }
        self._problem = problem
        return [Message("system", "Two assistants solve arithmetic together. Reply with: Answer: <number>")], {}

    def agents(self) -> list[str]:
        return list(AGENTS)

    def current_agent(self) -> str | None:
        return self.next

    def observe(self, agent: str) -> list[Message]:
        seen, self.unseen[agent] = self.unseen.get(agent, []), []
        return seen

    async def step(self, action: Message) -> StepResult:
        answer = extract_answer(action.content)
        if self.next == "proposer":
            self.proposal, self.next = answer, "checker"
            shown = "no answer" if answer is None else f"Answer: {_number(answer)}"
            self.unseen["checker"].append(Message(
                "user", f"Problem: {self._problem}\nThe proposer says: {shown}\n"
                        "Check it and give the final answer as: Answer: <number>",
            ))  # fmt: skip
            return StepResult([])
        self.next = None
        truth = float(str(self.task["answer"]))
        right = answer is not None and math.isclose(answer, truth, abs_tol=1e-6)
        proposed_right = self.proposal is not None and math.isclose(self.proposal, truth, abs_tol=1e-6)
        shared = self.config.reward if right else 0.0
        info: dict[str, JSON] = {"final_correct": right, "proposal_correct": proposed_right}
        return StepResult(
            [], terminated=True, info=info,
            agent_rewards={"proposer": shared + (self.config.proposer_bonus if proposed_right else 0.0),
                           "checker": shared},
        )  # fmt: skip


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)

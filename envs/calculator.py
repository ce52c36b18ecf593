"""`calculator`: arithmetic word problems solved with a calculator tool.

Each task is a chain of operations on whole numbers (`num_operands` numbers
of `digits` digits, `operators` applied left to right), phrased as a word
problem (`style: word`), a bare expression (`plain`) or either (`mixed`).
The model may call `calculator(expression)`, which evaluates arithmetic with
an AST walker (never `eval`; bounded sizes and exponents), and ends with a
reply without a tool call. Reward: 1.0 when the final answer (the number after
``Answer:``, else the last number in the reply) equals the truth; optional
shaping bonuses are off by default.

Small models need to see the protocol: `few_shot: k` puts k worked
demonstrations (question -> ``<tool_call>`` -> result -> ``Answer: N``) into
the prompt as earlier turns, so they are prompt tokens (loss mask 0).
"""

from __future__ import annotations

import ast
import hashlib
import math
import operator
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from agentrl.env import Task
from agentrl.envkit.rewards import RewardResult
from agentrl.envkit.tool_env import ToolEnv, ToolEnvConfig
from agentrl.tools import tool
from agentrl.types import Message, ToolCall

Op = Literal["+", "-", "*", "/"]

SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the calculator tool to compute. "
    "Then give the final answer as: Answer: <number>"
)

DEFAULT_TEMPLATES: dict[str, list[str]] = {
    "start": [
        "{name} has {n} {item}.",
        "{name} starts with {n} {item}.",
        "There are {n} {item} in {name}'s box.",
    ],
    "+": ["{name} gets {n} more.", "Then {n} more {item} are added.", "{name} buys {n} more {item}."],
    "-": ["{name} gives away {n}.", "Then {n} {item} are lost.", "{name} uses {n} of them."],
    "*": ["Then the number of {item} becomes {n} times as many.", "{name} multiplies the {item} by {n}."],
    "/": [
        "{name} shares them equally among {n} friends, keeping one share.",
        "They are split into {n} equal groups; one group stays.",
    ],
    "question": ["How many {item} are there now?", "How many {item} does {name} have at the end?"],
}
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo"]
ITEMS = ["apples", "books", "coins", "marbles", "pens", "stamps", "cards", "shells"]
_PLACEHOLDERS = {"name": "Ana", "n": 1, "item": "apples"}


def _default_operators() -> list[Op]:
    return ["+", "-", "*"]


class CalculatorConfig(ToolEnvConfig):
    """Config of the `calculator` env."""

    digits: int = Field(2, ge=1, le=9, description="digits of each operand")
    num_operands: int = Field(2, ge=2, le=8, description="numbers in each problem")
    operators: list[Op] = Field(
        default_factory=lambda: _default_operators(),
        min_length=1,
        description="operators to draw from (+ - * /); chains stay whole and non-negative",
    )
    style: Literal["word", "plain", "mixed"] = Field(
        "word", description="word problems, bare expressions, or both"
    )
    templates: dict[str, list[str]] | None = Field(
        None,
        description="override word templates: keys start, +, -, *, /, question; placeholders {name} {n} {item}",
    )
    seed: int = Field(0, description="seed of the problem and demonstration generators; same seed -> same tasks")
    n_train: int = Field(1000, ge=1, description="problems in the train split")
    n_test: int = Field(200, ge=0, description="problems in the test split (none repeats a train expression); 0 = none")
    system_prompt: str = Field(SYSTEM_PROMPT, description="system message of every episode and demonstration")
    few_shot: int = Field(2, ge=0, le=8, description="worked demonstrations put in the prompt")
    format_bonus: float = Field(
        0.0, ge=0.0, le=1.0, description="shaping: added when the reply has 'Answer: <number>'"
    )
    tool_bonus: float = Field(
        0.0, ge=0.0, le=1.0, description="shaping: added when a calculator call succeeded"
    )

    @field_validator("templates")
    @classmethod
    def _check_templates(cls, value: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        if value is None:
            return value
        for key, options in value.items():
            if key not in DEFAULT_TEMPLATES:
                raise ValueError(f"templates: unknown key {key!r}; allowed: {', '.join(DEFAULT_TEMPLATES)}")
            if not options:
                raise ValueError(f"templates.{key}: give at least one template")
            for text in options:
                try:
                    text.format(**_PLACEHOLDERS)
                except (KeyError, IndexError, ValueError) as e:
                    raise ValueError(
                        f"templates.{key}: {text!r} uses an unknown placeholder ({e}); allowed: {{name}} {{n}} {{item}}"
                    ) from e
        return value


# --------------------------------------------------------------------------- safe arithmetic

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**100
MAX_EXPONENT = 100

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


def evaluate(expression: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses on numbers, without eval.

    Also accepts ``x``/``×`` for multiply, ``÷`` for divide, ``^`` for power,
    thousands separators and a trailing ``=``. Refuses names, calls, huge
    numbers (|x| > 1e100), big exponents and long input.
    """
    text = _normalise(expression)
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression.strip()[:80]!r}") from None
    return _eval(tree.body)


def _normalise(expression: str) -> str:
    text = expression.strip().rstrip("=").strip()
    text = text.replace("×", "*").replace("÷", "/").replace("^", "**").replace("−", "-")
    text = re.sub(r"(?<=\d)\s*[xX]\s*(?=[\d(])", "*", text)
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        exact_division = isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int)
        if exact_division and right and left % right == 0:
            return left // right  # whole quotients of big numbers stay exact
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"unsupported element {type(node).__name__}; use numbers, + - * / // % ** and ( )")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > 100:
        raise CalculatorError("result too large")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("complex result")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value  # type: ignore[no-any-return]


def format_number(value: int | float) -> str:
    """Integers as integers (29.0 -> "29"); other floats to 10 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".10g")
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: The arithmetic expression, e.g. "(12 + 7) * 3".
    """
    return format_number(evaluate(expression))


CALCULATOR = tool(calculator, threaded=False, timeout_s=2.0)


# --------------------------------------------------------------------------- problems


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    expression: str
    answer: int


def generate_problem(rng: random.Random, config: CalculatorConfig) -> Problem:
    """One chain of operations, evaluated left to right (whole, non-negative intermediate values)."""
    low, high = (1 if config.digits == 1 else 10 ** (config.digits - 1)), 10**config.digits - 1
    value = rng.randint(low, high)
    numbers, ops = [value], []
    for _ in range(config.num_operands - 1):
        op, n = _next_step(rng, value, config.operators, low, high)
        value = _apply(value, op, n)
        ops.append(op)
        numbers.append(n)
    expression = str(numbers[0])
    previous = ""
    for op, n in zip(ops, numbers[1:], strict=True):
        if op in "*/" and previous in ("+", "-"):
            expression = f"({expression})"
        expression = f"{expression} {op} {n}"
        previous = op
    style = config.style if config.style != "mixed" else rng.choice(["word", "plain"])
    question = f"What is {expression}?" if style == "plain" else _word_question(rng, config, numbers, ops)
    return Problem(question=question, expression=expression, answer=value)


def _next_step(
    rng: random.Random, value: int, operators: Sequence[str], low: int, high: int
) -> tuple[str, int]:
    """An operator and operand that keep the running value a non-negative whole number."""
    choices = list(operators)
    rng.shuffle(choices)
    for op in choices:
        if op == "-":
            if value >= 1:
                return op, rng.randint(min(low, value), min(high, value))
        elif op == "/":
            divisor = _divisor(rng, value, low, high)
            if divisor is not None:
                return op, divisor
        else:
            return op, rng.randint(low, high)
    # only - or / were allowed and neither fits (value 0 or 1, or prime): add instead
    return "+", rng.randint(low, high)


def _divisor(rng: random.Random, value: int, low: int, high: int) -> int | None:
    """A divisor of `value` in [max(2, low), high] (a smaller one if none), searching a bounded range."""
    for start, stop in ((max(2, low), min(high, value, max(2, low) + 2000)), (2, min(high, value, 1000))):
        found = [d for d in range(start, stop + 1) if value % d == 0]
        if found:
            return rng.choice(found)
    return None


def _apply(value: int, op: str, n: int) -> int:
    if op == "+":
        return value + n
    if op == "-":
        return value - n
    if op == "*":
        return value * n
    return value // n


def _word_question(rng: random.Random, config: CalculatorConfig, numbers: list[int], ops: list[str]) -> str:
    templates = {**DEFAULT_TEMPLATES, **(config.templates or {})}
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    parts = [rng.choice(templates["start"]).format(name=name, n=numbers[0], item=item)]
    for op, n in zip(ops, numbers[1:], strict=True):
        parts.append(rng.choice(templates[op]).format(name=name, n=n, item=item))
    parts.append(rng.choice(templates["question"]).format(name=name, n="", item=item))
    return " ".join(parts)


def _task_id(split: str, index: int, problem: Problem) -> str:
    digest = hashlib.sha1(f"{problem.question}|{problem.expression}".encode()).hexdigest()[:8]
    return f"calculator/{split}/{index:05d}-{digest}"


# --------------------------------------------------------------------------- answers

_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\**\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> float | None:
    """The number after the last "Answer:", else the last number in the text."""
    found = _ANSWER.findall(text)
    raw = found[-1] if found else (_NUMBER.findall(text) or [None])[-1]
    if raw is None:
        return None
    try:
        return float(raw.replace(",", ""))
    except ValueError:
        return None


def has_answer_format(text: str) -> bool:
    return bool(_ANSWER.search(text))


# --------------------------------------------------------------------------- the env


class CalculatorEnv(ToolEnv[CalculatorConfig]):
    """Arithmetic word problems with a calculator tool; reward 1 for the right final answer."""

    name: ClassVar[str] = "calculator"
    description: ClassVar[str] = (
        "Arithmetic word problems with a calculator tool; reward 1 for the right answer"
    )
    tools = (CALCULATOR,)

    def __init__(self, config: CalculatorConfig | None = None) -> None:
        super().__init__(config)
        self._splits: dict[str, list[Task]] | None = None
        self._demos: list[list[Message]] | None = None

    # -- tasks

    def tasks(self, split: str = "train") -> Iterable[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"calculator: unknown split {split!r}; available: train, test")
        return list(self._all_splits()[split])

    def _all_splits(self) -> dict[str, list[Task]]:
        """Train then test, each from its own seeded stream; test never repeats a train expression."""
        if self._splits is None:
            seen: set[str] = set()
            self._splits = {}
            for split, size in (("train", self.config.n_train), ("test", self.config.n_test)):
                rng = random.Random(f"calculator:{self.config.seed}:{split}")
                tasks: list[Task] = []
                attempts = 0
                while len(tasks) < size:
                    attempts += 1
                    if attempts > 50 * size + 1000:
                        raise ValueError(
                            f"calculator: cannot make {size} distinct {split} problems with digits={self.config.digits}, "
                            f"num_operands={self.config.num_operands}, operators={self.config.operators}; "
                            "lower n_train/n_test or raise digits/num_operands"
                        )
                    problem = generate_problem(rng, self.config)
                    if problem.expression in seen:
                        continue
                    seen.add(problem.expression)
                    tasks.append(
                        {
                            "id": _task_id(split, len(tasks), problem),
                            "prompt": problem.question,
                            "expression": problem.expression,
                            "answer": problem.answer,
                        }
                    )
                self._splits[split] = tasks
        return self._splits

    # -- prompt

    def demonstrations(self) -> list[list[Message]]:
        """Worked conversations: question -> calculator call -> result -> "Answer: N"."""
        if self._demos is None:
            self._demos = self._make_demonstrations()
        return [list(d) for d in self._demos]

    def _make_demonstrations(self) -> list[list[Message]]:
        rng = random.Random(f"calculator:{self.config.seed}:demonstrations")
        demos = []
        for i in range(max(self.config.few_shot, 2) + 1):
            problem = generate_problem(rng, self.config)
            call = ToolCall("calculator", {"expression": problem.expression}, id=f"demo-{i}")
            demos.append(
                [
                    Message("system", self.config.system_prompt),
                    Message("user", problem.question),
                    Message("assistant", "", tool_calls=[call]),
                    Message("tool", calculator(problem.expression), tool_call_id=call.id, name="calculator"),
                    Message("assistant", f"Answer: {problem.answer}"),
                ]
            )
        return demos

    def initial_messages(self, task: Task) -> list[Message]:
        messages = [Message("system", self.config.system_prompt)]
        shots = [d for d in self.demonstrations() if d[1].content != task["prompt"]][: self.config.few_shot]
        for demo in shots:
            messages.extend(demo[1:])
        messages.append(Message("user", str(task["prompt"])))
        return messages

    # -- reward

    async def score(self, task: Task, messages: Sequence[Message]) -> RewardResult:
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        episode = messages[last_user + 1 :]
        final = episode[-1].content if episode and episode[-1].role == "assistant" else ""
        answer = extract_answer(final)
        correct = answer is not None and math.isclose(answer, float(task["answer"]), abs_tol=1e-6)
        formatted = has_answer_format(final)
        used_tool = any(m.role == "tool" and not m.content.startswith("Error") for m in episode)
        value = float(correct) + self.config.format_bonus * formatted + self.config.tool_bonus * used_tool
        return RewardResult(
            value=value,
            breakdown={"correct": float(correct), "format": float(formatted), "used_tool": float(used_tool)},
            info={"parsed_answer": answer},
        )

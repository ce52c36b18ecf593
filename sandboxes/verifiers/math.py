r"""``math`` reward: extract the final answer and check it against the task's.

Task schema::

    {"answer": "3/4" | 0.75 | "\\frac{3}{4}", ...}   # the gold answer (required)

Extraction from the last assistant message, first that applies: the last
``\boxed{...}`` (nested braces handled), the text after the last
``answer:``/``Answer:`` on its line, the last number. Equivalence: exact or
numeric match first (in-process, microseconds); otherwise math-verify (sympy
as a fallback when math-verify is missing or fails) in a worker *process*
under a hard timeout: a hung check is killed and scores 0 with
``info.error = "timeout"``, never a silent 0 from a broken signal timer.

Breakdown: ``correct`` (0/1) and ``formatted`` (1 when a ``\boxed{}`` or
``answer:`` was found, 0 when only a bare number was).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.envkit.rewards import RewardResult
from agentrl.types import Message

from .workers import ProcessPool, WorkerError

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:：]\s*(.+)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None


def extract_answer(text: str) -> tuple[str | None, str]:
    """(answer, how): how is ``boxed``, ``answer_line``, ``last_number`` or ``none``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    matches = list(_ANSWER.finditer(text))
    if matches:
        ans = matches[-1].group(1).strip().rstrip(".").strip()
        ans = ans.strip("$ ").strip()
        if ans:
            return ans, "answer_line"
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1], "last_number"
    return None, "none"


def _as_number(s: str) -> float | None:
    t = s.strip().strip("$").replace(",", "").replace("\\!", "").replace(" ", "")
    t = t.removesuffix("\\%").removesuffix("%")
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?\d+)\}\{(-?\d+)\}", t)
    try:
        if frac:
            sign = -1.0 if frac.group(1) else 1.0
            return sign * float(frac.group(2)) / float(frac.group(3))
        if re.fullmatch(r"-?\d+/\d+", t):
            a, b = t.split("/")
            return float(a) / float(b)
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


def quick_equal(pred: str, gold: str) -> bool | None:
    """Cheap decision when both sides are plain numbers or identical strings; else None."""
    if pred.strip() == gold.strip():
        return True
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    return None


def check_equivalence(pred: str, gold: str) -> tuple[bool, str]:
    """Runs in a worker process (main thread): math-verify, then sympy."""
    try:
        from math_verify import parse, verify

        def wrap(s: str) -> str:
            return s if "\\boxed" in s or s.startswith("$") else f"${s}$"

        gold_p = parse(wrap(gold))
        pred_p = parse(wrap(pred))
        if gold_p and pred_p:
            return bool(verify(gold_p, pred_p)), "math_verify"
    except ImportError:
        pass
    except Exception:  # math-verify gave up: try sympy
        pass
    import sympy

    def to_expr(s: str) -> Any:
        s = s.strip().strip("$")
        try:
            from sympy.parsing.latex import parse_latex

            if "\\" in s:
                return parse_latex(s)
        except Exception:
            pass
        return sympy.sympify(s.replace("^", "**"))

    try:
        return bool(sympy.simplify(to_expr(pred) - to_expr(gold)) == 0), "sympy"
    except Exception:
        return False, "sympy"


class MathConfig(BaseModel):
    """Settings of the ``math`` reward."""

    model_config = ConfigDict(extra="forbid")

    answer_key: str = Field(default="answer", description="task key holding the gold answer")
    timeout_s: float = Field(
        default=10.0, gt=0, description="deadline of one equivalence check in a worker process (seconds); overrun scores 0"
    )
    workers: int = Field(default=1, ge=1, le=64, description="worker processes that run equivalence checks")
    unformatted_credit: float = Field(
        default=1.0, ge=0, le=1,
        description="score of a correct answer given only as a bare last number (no \\boxed{} or 'Answer:')",
    )


class MathVerifier:
    """Math answers: extract (boxed / answer: / last number), check equivalence in a worker process.

    Task schema and scoring: see the module docstring. ``await close()`` when done.
    """

    Config = MathConfig

    def __init__(self, config: MathConfig | None = None) -> None:
        self.config = config or MathConfig()
        self.pool = ProcessPool(self.config.workers, preload=("math_verify", "sympy"))

    @classmethod
    def from_config(cls, config: MathConfig | dict[str, Any] | None = None) -> MathVerifier:
        return cls(config if isinstance(config, MathConfig) else MathConfig(**(config or {})))

    async def equivalent(self, pred: str, gold: str) -> tuple[bool, str]:
        """(equal, method); raises TimeoutError when the check overran its deadline."""
        quick = quick_equal(pred, gold)
        if quick is not None:
            return quick, "numeric"
        result: tuple[bool, str] = await self.pool.call(check_equivalence, pred, gold, timeout=self.config.timeout_s)
        return result

    async def score(self, task: dict[str, Any], messages: Sequence[Message]) -> RewardResult:
        if self.config.answer_key not in task:
            raise KeyError(f"math reward: task has no {self.config.answer_key!r} key (keys: {sorted(task)})")
        gold = str(task[self.config.answer_key])
        text = next((m.content for m in reversed(messages) if m.role == "assistant"), "")
        pred, how = extract_answer(text)
        info: dict[str, Any] = {"extracted": pred, "extraction": how, "gold": gold}
        if pred is None:
            return RewardResult(0.0, {"correct": 0.0, "formatted": 0.0}, info)
        try:
            correct, method = await self.equivalent(pred, gold)
            info["method"] = method
        except TimeoutError:
            correct, info["error"] = False, "timeout"
        except WorkerError as e:
            correct, info["error"] = False, str(e)
        formatted = how != "last_number"
        value = float(correct) * (1.0 if formatted else self.config.unformatted_credit)
        return RewardResult(value, {"correct": float(correct), "formatted": float(formatted)}, info)

    async def close(self) -> None:
        """Stop the worker processes."""
        await self.pool.close()

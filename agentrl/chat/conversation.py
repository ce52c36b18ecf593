"""Token-exact conversations: what the policy sampled is what the trainer sees.

A `Conversation` holds the token ids of a whole episode. Model turns are
appended exactly as the engine sampled them (ids, logprobs, policy versions;
never re-tokenised, loss mask 1). Everything else (the opening prompt, tool
results, env messages and the generation prompt) is appended as a *chat-template
delta* with loss mask 0: a fixed dummy conversation ``[user, assistant]`` is
rendered with and without the new messages and only the text suffix is
tokenised. The delta therefore never depends on how the template would
re-render earlier turns (Qwen3-style think stripping, date headers, ...).

Between a model turn and the next delta the template usually emits some
turn-closing text (``<|im_end|>\\n`` for ChatML, ``<|eot_id|>`` for Llama-3).
The model may have sampled part of it (its end-of-turn token) or none of it
(stopped by a stop string or the length limit); the missing remainder is
inserted with mask 0 (see `closing_remainder`).

`retokenization_drift()` measures how far the episode's ids are from
``encode(render(all messages))``; see docs/chat.md. The tokenizer adapters and
tool formatting live in `agentrl.chat.tokenizers` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agentrl.chat.tokenizers import (
    DUMMY_PREFIX,
    HERMES_TOOLS_FOOTER,
    HERMES_TOOLS_HEADER,
    MARKER,
    BoundaryCaching,
    ChatTokenizer,
    HFChatTokenizer,
    SimpleChatTokenizer,
    ToolSchemas,
    closing_text,
    hermes_content,
    hermes_tools_prompt,
    with_calls_in_content,
    with_tools_system_prompt,
)
from agentrl.types import Completion, Message, Trajectory, Turn

__all__ = [  # the tokenizer names are re-exported: `from agentrl.chat.conversation import ChatTokenizer` keeps working
    "HERMES_TOOLS_FOOTER",
    "HERMES_TOOLS_HEADER",
    "Budgets",
    "ChatTokenizer",
    "Conversation",
    "HFChatTokenizer",
    "SimpleChatTokenizer",
    "ToolSchemas",
    "closing_remainder",
    "closing_text",
    "hermes_content",
    "hermes_tools_prompt",
    "token_drift",
    "truncate_ids_text",
    "with_calls_in_content",
    "with_tools_system_prompt",
]


TruncationSide = Literal["left", "right", "middle"]
"""The side cut from a long tool output: right keeps the head, left the tail, middle both ends."""

# --------------------------------------------------------------------------- token helpers


def closing_remainder(sampled: Sequence[int], closing: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """The part of the turn-closing ids the model did not sample itself.

    The longest suffix of `sampled` that is a prefix of `closing` counts as
    already emitted (normally the end-of-turn token). If there is none but the
    model ended on another end-of-turn id (e.g. ``<|eom_id|>`` where the
    template writes ``<|eot_id|>``) that id stands in for the closing's first
    token. Otherwise (stop string, length limit) the whole closing is missing.
    """
    owed = list(closing)
    tail = list(sampled[-len(owed) :]) if owed else []
    for k in range(len(tail), 0, -1):
        if tail[-k:] == owed[:k]:
            return owed[k:]
    if sampled and closing and sampled[-1] in eos_ids and closing[0] in eos_ids:
        return list(closing[1:])
    return list(closing)


def truncate_ids_text(
    tokenizer: ChatTokenizer, text: str, max_tokens: int, side: TruncationSide
) -> str:
    """`text` cut to at most `max_tokens` tokens, with a marker saying how much went.

    `side` is the side that is cut: "right" keeps the head, "left" keeps the
    tail, "middle" keeps both ends. The marker counts toward the limit.
    """
    ids = tokenizer.encode(text)
    if len(ids) <= max_tokens:
        return text
    keep = max_tokens
    while True:
        dropped = len(ids) - keep
        marker = f"\n...[{dropped} tokens truncated]...\n"
        body = max(0, keep - len(tokenizer.encode(marker)))
        if side == "right":
            out = tokenizer.decode(ids[:body]) + marker
        elif side == "left":
            out = marker + tokenizer.decode(ids[len(ids) - body :] if body else [])
        else:
            head = (body + 1) // 2
            tail = body - head
            out = (
                tokenizer.decode(ids[:head])
                + marker
                + tokenizer.decode(ids[len(ids) - tail :] if tail else [])
            )
        if len(tokenizer.encode(out)) <= max_tokens or body == 0:
            return out
        keep -= max(1, (len(tokenizer.encode(out)) - max_tokens))


def token_drift(actual: Sequence[int], reference: Sequence[int]) -> float:
    """Fraction of positions that differ after aligning two id sequences.

    ``1 - matched / max(len)``, where `matched` counts ids in the matching
    blocks of a longest-common-subsequence style alignment (difflib). 0.0 iff
    the sequences are equal; 1.0 when nothing lines up.
    """
    actual = actual if isinstance(actual, list) else list(actual)
    reference = reference if isinstance(reference, list) else list(reference)
    if actual == reference:
        return 0.0
    longest = max(len(actual), len(reference))
    matcher = difflib.SequenceMatcher(None, actual, reference, autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return 1.0 - matched / longest


# --------------------------------------------------------------------------- conversation


@dataclass(frozen=True)
class Budgets:
    """Per-episode limits. Hitting one truncates the episode; it never raises."""

    max_turns: int = 8
    max_total_tokens: int = 4096
    max_new_tokens_per_turn: int = 512
    max_tool_output_tokens: int = 512
    tool_output_truncation: TruncationSide = "middle"

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_total_tokens", "max_new_tokens_per_turn", "max_tool_output_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"Budgets.{key} must be >= 1, got {getattr(self, key)}")
        if self.tool_output_truncation not in ("left", "right", "middle"):
            raise ValueError(
                f"Budgets.tool_output_truncation must be left|right|middle, got {self.tool_output_truncation!r}"
            )

    @classmethod
    def from_rollout_config(cls, config: Any) -> Budgets:
        """Budgets from a `RolloutConfig` (or anything with the same fields).

        Equal settings share one (frozen) instance: every episode calls this, and a
        cache lookup is cheaper than re-validating.
        """
        return _shared_budgets(
            config.max_turns, config.max_total_tokens, config.max_new_tokens_per_turn,
            config.max_tool_output_tokens, config.tool_output_truncation,
        )


@functools.lru_cache(maxsize=64)
def _shared_budgets(*fields: Any) -> Budgets:
    return Budgets(*fields)


class _TemplateFacts:
    """What conversations need to know about one (tokenizer, tools) template, worked out once.

    `prefix` is the rendered dummy conversation that deltas are taken against
    and `closing` the ids that close a model turn. `remainders` and `deltas`
    memoise, for this template, `closing_remainder` (keyed by the last ids of
    a turn) and the ids of an env-message delta (keyed by the messages'
    fields): both are pure functions of their keys, and turn endings and env
    replies repeat across turns and episodes. The memos are bounded.
    """

    __slots__ = ("closing", "deltas", "prefix", "remainders")

    MAX_ENTRIES = 4096
    MAX_TEXT_CHARS = 512  # longer messages (tool outputs) are rarely repeated: not memoised

    def __init__(self, prefix: str, closing: list[int]) -> None:
        self.prefix = prefix
        self.closing = closing
        self.remainders: dict[tuple[int, ...], list[int]] = {}
        # keys: (role, content, tool_call_id, name) for one message, a tuple of those for several
        self.deltas: dict[tuple[Any, ...], list[int]] = {}


class Conversation:
    """The token ids of one episode, with loss mask, behaviour logprobs and versions.

    Usage per turn: send `prompt_ids` (with `max_new_tokens()`) to the engine,
    `add_completion(completion, parsed_message)`, then
    `add_messages(env_messages)` (False when the total budget is spent).
    The conversation alternates strictly: a completion must follow a prompt
    that ends with the generation prompt, and messages must follow a completion.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        messages: list[Message],
        *,
        tools: list[dict[str, Any]] | None = None,
        budgets: Budgets = Budgets(),
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.budgets = budgets
        self.messages: list[Message] = list(messages)
        self.prompt_messages = len(self.messages)  # the opening: system prompt, demonstrations, task
        ids = tokenizer.encode(tokenizer.render(self.messages, tools=self.tools, add_generation_prompt=True))
        self.token_ids: list[int] = ids
        self.loss_mask: list[int] = [0] * len(ids)
        self.logprobs: list[float] = [0.0] * len(ids)
        self.versions: list[int] = [-1] * len(ids)
        self.turns: list[Turn] = []
        self.num_sampled = 0  # tokens with mask 1 (sum of loss_mask)
        self._awaiting_generation = True
        self._pending_close: list[int] = []  # closing ids owed after the last model turn (never mutated)
        self._facts: _TemplateFacts | None = None

    # -- reading

    @property
    def prompt_ids(self) -> list[int]:
        """All ids so far; ends with the generation prompt when a turn is due."""
        return self.token_ids

    @property
    def awaiting_generation(self) -> bool:
        return self._awaiting_generation

    def exhausted(self) -> str | None:
        """Which budget stops the next model turn ("max_turns", "max_total_tokens"), or None."""
        if len(self.turns) >= self.budgets.max_turns:
            return "max_turns"
        if len(self.token_ids) >= self.budgets.max_total_tokens:
            return "max_total_tokens"
        return None

    def max_new_tokens(self) -> int:
        """Token limit for the next turn: min(per-turn, total left); <= 0 means no turn is allowed."""
        b = self.budgets
        if len(self.turns) >= b.max_turns:
            return 0
        left = b.max_total_tokens - len(self.token_ids)
        return left if left < b.max_new_tokens_per_turn else b.max_new_tokens_per_turn

    # -- writing

    def add_completion(self, completion: Completion, message: Message) -> None:
        """Append the sampled ids verbatim (mask 1, the engine's logprobs and versions)."""
        if not self._awaiting_generation:
            raise RuntimeError("add_completion: the conversation does not end with a generation prompt")
        ids = completion.ids
        n = len(ids)
        start = len(self.token_ids)
        self.token_ids += ids
        self.loss_mask += [1] * n
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.num_sampled += n
        calls = [c.name for c in message.tool_calls] if message.tool_calls else []
        self.turns.append(Turn(start, start + n, 0.0, calls, {"finish_reason": completion.finish_reason}))
        self.messages.append(message)
        facts = self._facts or self._template_facts()
        closing = facts.closing
        tail = tuple(ids[-len(closing) :]) if closing else ()
        owed = facts.remainders.get(tail)
        if owed is None:
            owed = closing_remainder(ids, closing, self.tokenizer.eos_ids)
            if len(facts.remainders) >= facts.MAX_ENTRIES:
                facts.remainders.clear()
            facts.remainders[tail] = owed
        self._pending_close = owed
        self._awaiting_generation = False

    def add_messages(self, messages: Sequence[Message]) -> bool:
        """Append env/tool messages and the next generation prompt (mask 0).

        Tool outputs are cut to `max_tool_output_tokens` first. Returns False,
        appending nothing, when the result would exceed `max_total_tokens`.
        """
        if self._awaiting_generation:
            raise RuntimeError(
                "add_messages: a model turn is due first (the conversation ends with a prompt)"
            )
        new = list(messages)
        for i, m in enumerate(new):  # a plain loop: no comprehension frame on this hot path
            if m.role == "tool":
                new[i] = self._fit_tool_output(m)
        facts = self._facts or self._template_facts()
        key = _delta_key(new)
        encoded = facts.deltas.get(key) if key is not None else None
        if encoded is None:
            encoded = self._delta_ids(new, facts.prefix)
            if key is not None:
                if len(facts.deltas) >= facts.MAX_ENTRIES:
                    facts.deltas.clear()
                facts.deltas[key] = encoded
        pending = self._pending_close
        n = len(pending) + len(encoded)
        if len(self.token_ids) + n > self.budgets.max_total_tokens:
            return False
        if pending:
            self.token_ids += pending
        self.token_ids += encoded
        self.loss_mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.messages += new
        self._pending_close = []
        self._awaiting_generation = True
        return True

    def _delta_ids(self, new: list[Message], prefix: str) -> list[int]:
        """The ids the template adds after the dummy prefix for `new` (and the next generation prompt)."""
        full = self.tokenizer.render([*DUMMY_PREFIX, *new], tools=self.tools, add_generation_prompt=True)
        if not full.startswith(prefix):
            raise ValueError(
                "the chat template re-renders earlier messages when new ones are appended; "
                "the delta of these messages cannot be taken: "
                f"{[m.role for m in new]}"
            )
        return self.tokenizer.encode(full[len(prefix) :])

    def _fit_tool_output(self, message: Message) -> Message:
        if message.role != "tool":
            return message
        b = self.budgets
        text = truncate_ids_text(
            self.tokenizer, message.content, b.max_tool_output_tokens, b.tool_output_truncation
        )
        return message if text is message.content else dataclasses.replace(message, content=text)

    def _template_facts(self) -> _TemplateFacts:
        """This template's `_TemplateFacts`, shared through the tokenizer's `boundary_cache` if it has one."""
        cache = self.tokenizer.boundary_cache if isinstance(self.tokenizer, BoundaryCaching) else None
        key = json.dumps(self.tools) if self.tools else ""  # key order renders differently: not sorted
        found = cache.get(key) if cache is not None else None
        if not isinstance(found, _TemplateFacts):
            prefix = self.tokenizer.render(list(DUMMY_PREFIX), tools=self.tools)
            at = prefix.rfind(MARKER)
            if at < 0:
                raise ValueError("the chat template drops assistant content; cannot find where a turn ends")
            found = _TemplateFacts(prefix, self.tokenizer.encode(prefix[at + len(MARKER) :]))
            if cache is not None:
                cache[key] = found
        self._facts = found
        return found

    # -- metrics and export

    def reference_ids(self) -> list[int]:
        """``encode(render(all messages))``: what re-tokenising the episode would give."""
        text = self.tokenizer.render(
            self.messages, tools=self.tools, add_generation_prompt=self._awaiting_generation
        )
        return self.tokenizer.encode(text)

    def retokenization_drift(self) -> float:
        """0.0 when the ids equal `reference_ids()`; else the fraction of misaligned positions.

        The ids compared are the episode's ids plus any turn-closing ids still
        owed after a final model turn. A template that cannot render the whole
        conversation counts as complete drift (1.0).
        """
        try:
            reference = self.reference_ids()
        except Exception:
            return 1.0
        return token_drift(self.token_ids + self._pending_close, reference)

    def to_trajectory(self, *, task_id: str, env: str, **fields: Any) -> Trajectory:
        """The episode as a `Trajectory`: this conversation's tokens, messages, turns, prompt length
        and drift metric, plus `fields` (reward, error, ids, ...). `run_episode` ends every episode here."""
        metrics = dict(fields.pop("metrics", {}))
        metrics.setdefault("retokenization_drift", self.retokenization_drift())
        fields.setdefault("prompt_messages", self.prompt_messages)
        return Trajectory(
            task_id=task_id,
            env=env,
            messages=list(self.messages),
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            turns=list(self.turns),
            metrics=metrics,
            **fields,
        )


# The memo keys below hold every Message field but `tool_calls` (messages with calls are not memoised).
_MEMO_KEYS_COMPLETE = tuple(f.name for f in dataclasses.fields(Message)) == (
    "role", "content", "tool_calls", "tool_call_id", "name"
)


def _delta_key(messages: Sequence[Message]) -> tuple[Any, ...] | None:
    """The memo key of an env-message delta: every field the template sees; None when not memoised.

    One message (the common case) is keyed by its flat field tuple, several by a tuple of those.
    """
    if not _MEMO_KEYS_COMPLETE:
        return None
    key = []
    for m in messages:
        if m.tool_calls or len(m.content) > _TemplateFacts.MAX_TEXT_CHARS:
            return None
        key.append((m.role, m.content, m.tool_call_id, m.name))
    return key[0] if len(key) == 1 else tuple(key)

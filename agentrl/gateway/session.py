"""One agent episode as seen through the gateway: its calls, made token-exact trajectories.

Each chat call's messages are matched against the session's branches (the
conversations so far, newest first). A call *extends* a branch when it resends
that branch's messages (assistant turns matched by their tool-call ids or
text, never re-tokenised) followed by new ones: only the new messages go in,
as a chat-template delta (`agentrl.chat.conversation.Conversation`). Any other call (history
rewritten, dropped or summarised, other tools) starts a new branch from its own
messages. A retried identical request gets the first answer again and adds no
tokens (it waits for the first when that is still running).

Token-id calls (`/v1/completions`) are kept the same way on token branches:
a prompt that starts with a branch's ids extends it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentrl.chat.conversation import Budgets, ChatTokenizer, Conversation
from agentrl.chat.tool_parsers import ToolCallParser
from agentrl.engines.base import InferenceEngine, Sampling, TokenDelta, generate_stream, join_deltas
from agentrl.engines.constrained import json_grammar, tool_call_grammar
from agentrl.gateway.anthropic_api import Thread
from agentrl.gateway.protocol import ChatRequest, ChatResult, GatewayError, TrainerSampling, bad
from agentrl.types import JSON, Completion, Message, ToolCall, Trajectory, Turn, new_id

RETRY_CACHE = 16  # answers kept per session for retried requests
T = TypeVar("T")
OnTokens = Callable[[list[int]], None]
"""Called with the ids sampled so far, as a streamed call's tokens arrive (the gateway's SSE answer)."""


@dataclass(slots=True)
class Backend:
    """What every session of a gateway shares: the engine, the template and the trainer's settings."""

    engine: InferenceEngine
    tokenizer: ChatTokenizer
    parser: ToolCallParser
    sampling: TrainerSampling = field(default_factory=TrainerSampling)
    budgets: Budgets = field(default_factory=Budgets)
    stop_strings: tuple[str, ...] = ()
    generate_timeout_s: float = 300.0
    tools_in_prompt: bool = True


@dataclass(slots=True)
class Branch:
    """One token-exact conversation of a session; `seen` is what the agent sent and got back."""

    index: int
    conv: Conversation
    seen: list[Message]
    tools_key: str
    parent: int | None
    reason: str
    calls: list[int] = field(default_factory=list)  # the session call index of each turn
    busy: bool = False
    prompt_messages: int = 0  # messages of the call that opened the branch (its prompt)


@dataclass(slots=True)
class TokenBranch:
    """A conversation of raw token-id calls (`/v1/completions`)."""

    index: int
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    turns: list[Turn] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)


def _same(stored: Message, sent: Message) -> bool:
    """Does a resent message stand for the stored one? Assistant turns match by call ids, else by text."""
    if stored.role != sent.role:
        return False
    if stored.role == "assistant":
        if stored.tool_calls or sent.tool_calls:
            return [c.id for c in stored.tool_calls] == [c.id for c in sent.tool_calls]
        return stored.content.strip() == sent.content.strip()
    return stored.content == sent.content and stored.tool_call_id == sent.tool_call_id


def extension(branch: Branch, messages: Sequence[Message], tools_key: str) -> list[Message] | None:
    """The messages `messages` adds to `branch`, or None when it does not extend it."""
    seen = branch.seen
    if branch.busy or tools_key != branch.tools_key or len(messages) < len(seen):
        return None
    for old, new in zip(seen, messages, strict=False):
        if not _same(old, new):
            return None
    added = list(messages[len(seen) :])
    if branch.conv.awaiting_generation and added:
        return None  # a prompt without its reply (a failed call): only the same request continues it
    return added


def divergence(branch: Branch, messages: Sequence[Message], tools_key: str) -> str:
    """Why `messages` does not extend `branch`, in words (stored on the new branch)."""
    if tools_key != branch.tools_key:
        return "tools changed"
    for i, (old, new) in enumerate(zip(branch.seen, messages, strict=False)):
        if not _same(old, new):
            return f"message {i} ({old.role}) rewritten"
    if len(messages) < len(branch.seen):
        return f"history cut from {len(branch.seen)} to {len(messages)} messages"
    return "parallel call on a busy branch" if branch.busy else "prompt resent with new messages after a failed call"


async def _streamed(engine: InferenceEngine, prompt: list[int], sampling: Sampling, on_tokens: OnTokens) -> Completion:
    """One generate call streamed: `on_tokens` after every delta; the completion is the deltas joined."""
    deltas: list[TokenDelta] = []
    ids: list[int] = []
    async for delta in generate_stream(engine, prompt, sampling):
        deltas.append(delta)
        if delta.ids:
            ids.extend(delta.ids)
            on_tokens(list(ids))
    return join_deltas(deltas)


def _template(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call into the chat template; a template that cannot render the messages is the request's fault (400)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise bad(f"the chat template cannot render these messages: {type(e).__name__}: {e}", "messages") from e


class Session:
    """One episode's calls and the trajectories they make; safe under concurrent calls."""

    def __init__(self, backend: Backend, *, id: str | None = None, key: str | None = None) -> None:
        self.backend = backend
        self.id = id or new_id()
        self.key = key or "sk-agentrl-" + os.urandom(16).hex()
        self.branches: list[Branch] = []
        self.token_branches: list[TokenBranch] = []
        self.calls = 0
        self.last_branch: Branch | TokenBranch | None = None
        self.closed = False
        self.truncation_reason: str | None = None
        self.agent_error: str | None = None  # why a remote agent gave up (POST /s/{id}/close {"error": ...})
        self.reward: float | None = None
        self.breakdown: dict[str, float] = {}
        self.turn_rewards: dict[int, float] = {}
        self.task: dict[str, JSON] = {}  # what the episode is about (stored on its trajectories by `agentrl gateway`)
        self._lock = asyncio.Lock()
        self._answers: OrderedDict[str, asyncio.Future[ChatResult]] = OrderedDict()
        self.responses: OrderedDict[str, list[Message]] = OrderedDict()  # Responses API: id -> messages (previous_response_id)
        self.threads: OrderedDict[str, Thread] = OrderedDict()  # Messages API: reply id -> its thread (`thread: continue`)

    # -- chat calls

    async def chat(self, request: ChatRequest, fingerprint: str, on_tokens: OnTokens | None = None,
                   on_prompt: Callable[[int], None] | None = None) -> ChatResult:
        """Answer one chat call: match it to a branch, generate, record the turn.

        With `on_tokens` the engine streams (when it can) and `on_tokens` sees the ids sampled so
        far after each delta; the recorded turn is the same either way (the deltas joined).
        `on_prompt` hears the prompt's length once the call is matched (a stream's opening event).
        """
        grammar = self._grammar(request)
        async with self._lock:
            self._check_open()
            found = self._answers.get(fingerprint)
            if found is None:
                branch, prompt_len = self._prepare(request)
                if on_prompt is not None:
                    on_prompt(prompt_len)
                found = asyncio.get_running_loop().create_future()
                self._answers[fingerprint] = found
                while len(self._answers) > RETRY_CACHE:
                    self._answers.popitem(last=False)
                owner = True
            else:
                owner = False
        if not owner:  # a retry: the first request's answer (awaited while it runs)
            return await asyncio.shield(found)
        try:
            result = await self._generate(branch, request, prompt_len, on_tokens, grammar)
        except BaseException as e:
            self._answers.pop(fingerprint, None)
            branch.busy = False
            if not found.done():
                found.set_exception(e if isinstance(e, Exception) else GatewayError(499, "request cancelled"))
                found.exception()  # retrieved: no "never retrieved" warning when nobody retries
            raise
        found.set_result(result)
        return result

    def _grammar(self, request: ChatRequest) -> str | None:
        """The grammar a constrained call samples under (None when unconstrained); a 400 when the engine
        cannot constrain or the tool parser's format cannot be forced."""
        c = request.constraint
        if c is None:
            return None
        engine = self.backend.engine
        if not getattr(engine, "constrained_decoding", False):
            raise bad(f"{c.label} needs constrained decoding, which the {type(engine).__name__} does not serve (the "
                      "hf engine does); without it the reply would not come from the distribution the trainer "
                      "learns from", c.param, "constrained_decoding_unavailable")
        try:
            if c.kind == "tool":
                return tool_call_grammar(request.tools or [], self.backend.parser.name, c.name)
            return json_grammar(c.schema)
        except ValueError as e:
            raise bad(f"{c.label}: {e}", c.param) from None

    def _prepare(self, request: ChatRequest) -> tuple[Branch, int]:
        """The branch this call continues (or a new one) with the new messages appended."""
        # tools matter only when rendered into the prompt: otherwise a call that drops them still extends
        rendered = request.tools and self.backend.tools_in_prompt
        tools_key = json.dumps(request.tools, sort_keys=True) if rendered else ""
        for branch in reversed(self.branches):
            added = extension(branch, request.messages, tools_key)
            if added is None:
                continue
            if not branch.conv.awaiting_generation and not _template(branch.conv.add_messages, added):
                self.truncation_reason = "max_total_tokens"
                raise bad(
                    f"the conversation would exceed max_total_tokens={branch.conv.budgets.max_total_tokens}",
                    "messages", "context_length_exceeded",
                )
            branch.seen.extend(added)
            return self._claim(branch)
        parent = self.last_branch if isinstance(self.last_branch, Branch) else None
        reason = divergence(parent, request.messages, tools_key) if parent else "first call"
        tools = request.tools if self.backend.tools_in_prompt else None
        conv = _template(Conversation, self.backend.tokenizer, list(request.messages), tools=tools,
                         budgets=self.backend.budgets)
        if len(conv.token_ids) >= self.backend.budgets.max_total_tokens:
            self.truncation_reason = "max_total_tokens"
            raise bad(f"the prompt has {len(conv.token_ids)} tokens, max_total_tokens="
                      f"{self.backend.budgets.max_total_tokens}", "messages", "context_length_exceeded")
        branch = Branch(len(self.branches), conv, list(request.messages), tools_key,
                        parent.index if parent else None, reason, prompt_messages=len(request.messages))
        self.branches.append(branch)
        return self._claim(branch)

    def _claim(self, branch: Branch) -> tuple[Branch, int]:
        left = branch.conv.max_new_tokens()
        if left <= 0:
            self.truncation_reason = branch.conv.exhausted() or "max_total_tokens"
            raise bad(f"the episode's {self.truncation_reason} budget is spent", "messages", "context_length_exceeded")
        branch.busy = True
        return branch, len(branch.conv.token_ids)

    async def _generate(
        self, branch: Branch, request: ChatRequest, prompt_len: int, on_tokens: OnTokens | None = None,
        grammar: str | None = None,
    ) -> ChatResult:
        b = self.backend
        conv = branch.conv
        limit = conv.max_new_tokens()
        max_tokens = min(limit, request.max_tokens) if request.max_tokens else limit
        prompt_ids = list(conv.token_ids) if request.return_token_ids else None
        completion = await self._sample(conv.token_ids, max_tokens, request.stop, request.seed, on_tokens, grammar,
                                        request.policy)
        eos = b.tokenizer.eos_ids
        ids = completion.ids
        text = b.tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids)
        message = self._message(text, request)
        async with self._lock:
            conv.add_completion(completion, message)
            if request.constraint is not None:  # sampled from the masked distribution: the logprobs are of that one
                conv.turns[-1].info["constrained"] = request.constraint.label
            conv.turns[-1].policy = request.policy
            branch.seen.append(message)
            branch.calls.append(self.calls)
            self.calls += 1
            branch.busy = False
            self.last_branch = branch
        finish = "tool_calls" if message.tool_calls else ("length" if completion.finish_reason == "length" else "stop")
        return ChatResult(message=message, completion=completion, prompt_len=prompt_len, finish_reason=finish,
                          prompt_ids=prompt_ids)

    def _message(self, text: str, request: ChatRequest) -> Message:
        """The assistant message returned: parsed tool calls with fresh ids, or the text as is."""
        if request.tool_choice == "none" or (request.constraint is not None and request.constraint.kind == "json"):
            return Message(role="assistant", content=text)
        parsed = self.backend.parser.parse(text)
        if not parsed.tool_calls or any(c.error for c in parsed.tool_calls):
            return Message(role="assistant", content=text if parsed.tool_calls else parsed.content)
        calls = [ToolCall(name=c.name, arguments=c.arguments, id="call_" + new_id()) for c in parsed.tool_calls]
        return Message(role="assistant", content=parsed.content, tool_calls=calls)

    async def _sample(
        self, prompt: list[int], max_tokens: int, stop: Sequence[str], seed: int | None,
        on_tokens: OnTokens | None = None, grammar: str | None = None, policy: str | None = None,
    ) -> Completion:
        b = self.backend
        sampling = Sampling(
            max_tokens=max_tokens, temperature=b.sampling.temperature, top_p=b.sampling.top_p,
            top_k=b.sampling.top_k, stop_ids=tuple(b.tokenizer.eos_ids),
            stop_strings=tuple(dict.fromkeys((*b.stop_strings, *stop))), seed=seed, grammar=grammar, adapter=policy,
        )
        try:
            async with asyncio.timeout(b.generate_timeout_s):
                if on_tokens is None:
                    completion = await b.engine.generate(list(prompt), sampling)
                else:
                    completion = await _streamed(b.engine, list(prompt), sampling, on_tokens)
        except TimeoutError:
            raise GatewayError(504, f"the engine did not answer within {b.generate_timeout_s}s", code="engine_timeout") from None
        except (asyncio.CancelledError, GatewayError):
            raise
        except Exception as e:
            raise GatewayError(502, f"the engine failed: {type(e).__name__}: {e}", code="engine_error") from e
        if not all(math.isfinite(x) for x in completion.logprobs):
            raise GatewayError(502, "the engine returned a non-finite logprob", code="engine_error")
        return completion

    # -- token-id calls

    async def complete(self, prompt: list[int], max_tokens: int | None, stop: Sequence[str], seed: int | None,
                       policy: str | None = None) -> Completion:
        """Answer one `/v1/completions` call on the token branch whose ids the prompt extends (sampled by
        `policy`'s adapter when given)."""
        async with self._lock:
            self._check_open()
            budget = self.backend.budgets
            branch = next((t for t in reversed(self.token_branches) if prompt[: len(t.ids)] == t.ids), None)
            if branch is None:
                branch = TokenBranch(len(self.token_branches), [], [], [], [])
                self.token_branches.append(branch)
            if len(prompt) >= budget.max_total_tokens:
                self.truncation_reason = "max_total_tokens"
                raise bad(f"the prompt has {len(prompt)} tokens, max_total_tokens={budget.max_total_tokens}",
                          "prompt", "context_length_exceeded")
        limit = min(budget.max_new_tokens_per_turn, budget.max_total_tokens - len(prompt))
        completion = await self._sample(prompt, min(limit, max_tokens) if max_tokens else limit, stop, seed,
                                        policy=policy)
        async with self._lock:
            if prompt[: len(branch.ids)] != branch.ids:  # another call moved the branch meanwhile: fork
                branch = TokenBranch(len(self.token_branches), [], [], [], [])
                self.token_branches.append(branch)
            extra = prompt[len(branch.ids) :]
            n = len(completion.ids)
            branch.ids += extra + completion.ids
            branch.mask += [0] * len(extra) + [1] * n
            branch.logprobs += [0.0] * len(extra) + completion.logprobs
            branch.versions += [-1] * len(extra) + completion.versions
            end = len(branch.ids)
            branch.turns.append(Turn(end - n, end, 0.0, [], {"finish_reason": completion.finish_reason}, policy=policy))
            branch.calls.append(self.calls)
            self.calls += 1
            self.last_branch = branch
        return completion

    # -- rewards, end, trajectories

    def set_reward(self, value: float, *, turn: int | None = None, breakdown: dict[str, float] | None = None) -> None:
        """The episode's reward, or (with `turn`, a call index) the reward of one turn."""
        self._check_open()
        if not math.isfinite(value):
            raise bad(f"reward must be finite, got {value!r}", "reward")
        if turn is None:
            self.reward = value
        else:
            if not 0 <= turn < self.calls:
                raise bad(f"turn={turn} is not a call of this session (0..{self.calls - 1})", "turn")
            self.turn_rewards[turn] = value
        if breakdown:
            self.breakdown.update(breakdown)

    def close(self) -> None:
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise GatewayError(409, f"session {self.id} has ended; open a new one", code="session_closed")

    def final_messages(self) -> list[Message]:
        """The messages of the branch that answered last (what a reward plugin scores)."""
        return list(self.last_branch.conv.messages) if isinstance(self.last_branch, Branch) else []

    def trajectories(self, *, task: dict[str, JSON], env: str, group_id: str = "", sample_index: int = 0,
                     reward: float = 0.0, breakdown: dict[str, float] | None = None) -> list[Trajectory]:
        """One trajectory per branch that sampled tokens; the one that answered last comes first.

        When no call was answered, the last branch's prompt alone (no turns); none when no call came.
        """
        out: list[Trajectory] = []
        task_id = str(task.get("id", ""))
        every: list[Branch | TokenBranch] = [*self.branches, *self.token_branches]
        sampled = [b for b in every if (b.turns if isinstance(b, TokenBranch) else b.conv.turns)]
        if not sampled and self.branches:  # no call was answered: the prompt alone, as a native episode would give
            sampled = [self.branches[-1]]
        main = (self.last_branch or sampled[-1]) if sampled else None
        ids = {id(b): new_id() for b in every}
        for branch in sampled:
            turns = branch.turns if isinstance(branch, TokenBranch) else branch.conv.turns
            for turn, call in zip(turns, branch.calls, strict=True):
                turn.reward = self.turn_rewards.get(call, 0.0)
                turn.info["call"] = call
            info: dict[str, JSON] = {"gateway": {
                "session": self.id, "branch": branch.index, "kind": "tokens" if isinstance(branch, TokenBranch) else "chat",
                "branches": len(self.branches) + len(self.token_branches),
                "main": branch is main,
            }}
            if isinstance(branch, Branch) and branch.index > 0:
                parent = self.branches[branch.parent] if branch.parent is not None else None
                info["branch"] = {"parent": ids[id(parent)] if parent is not None else None, "reason": branch.reason}
            common: dict[str, Any] = {
                "id": ids[id(branch)], "group_id": group_id, "sample_index": sample_index, "task": dict(task),
                "reward": reward, "reward_breakdown": dict(breakdown or {}), "info": info,
                "truncated": self.truncation_reason is not None, "truncation_reason": self.truncation_reason,
                "terminated": self.truncation_reason is None,
            }
            if isinstance(branch, TokenBranch):
                traj = Trajectory(task_id=task_id, env=env, messages=[], token_ids=branch.ids, loss_mask=branch.mask,
                                  logprobs=branch.logprobs, versions=branch.versions, turns=branch.turns,
                                  metrics={"retokenization_drift": 0.0}, **common)
            else:
                traj = branch.conv.to_trajectory(task_id=task_id, env=env, **common)
                traj.prompt_messages = branch.prompt_messages
            traj.metrics.update({"turns": float(len(turns)), "sampled_tokens": float(traj.num_sampled_tokens),
                                 "constrained_turns": float(sum("constrained" in t.info for t in turns))})
            out.append(traj)
        out.sort(key=lambda t: not t.info["gateway"]["main"])
        return out

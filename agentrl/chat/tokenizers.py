"""Tokenizer adapters behind the `ChatTokenizer` protocol, and how tools reach the prompt.

`ChatTokenizer` renders chat messages to text and maps text to ids and back;
`SimpleChatTokenizer` is a dependency-free byte-level one with a ChatML template
(tests, benchmarks, scripted runs) and `HFChatTokenizer` wraps a Hugging Face
tokenizer and its chat template. Templates that know no tools get the Hermes
tool description in the system prompt (`with_tools_system_prompt`), templates
that do not render `tool_calls` get them written into the content in Hermes
format (`with_calls_in_content`). `closing_text` finds the text a template
writes after an assistant turn. The token-exact conversation built on top of
these is `agentrl.chat.conversation.Conversation`.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from agentrl.types import Message

ToolSchemas = Sequence[Mapping[str, Any]]

MARKER = "AGENTRLTURNMARKER"
"""A plain word that templates leave alone (no whitespace to trim, no markup): marks where a turn's content ends."""

DUMMY_PREFIX = (Message(role="user", content="U"), Message(role="assistant", content=MARKER))
"""The fixed conversation that chat-template deltas are taken against (never mutated)."""


@runtime_checkable
class ChatTokenizer(Protocol):
    """Renders chat messages to text and maps text to ids and back.

    `encode` adds no BOS/special tokens of its own: whatever the template
    renders (a BOS string included) is all there is. `eos_ids` are the ids that
    end an assistant turn; engines use them as stop ids. A tokenizer may carry
    a `boundary_cache` dict (`BoundaryCaching`), where conversations cache
    template facts that do not change between episodes.
    """

    eos_ids: tuple[int, ...]

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: ToolSchemas | None = None,
        add_generation_prompt: bool = False,
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class BoundaryCaching(Protocol):
    """A `ChatTokenizer` with a dict where conversations cache its template's turn-boundary facts.

    They do not change between episodes, so every conversation on this tokenizer
    reuses them instead of rendering the probe conversation again.
    """

    boundary_cache: dict[str, Any]


# --------------------------------------------------------------------------- tools in the prompt

HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def hermes_tools_prompt(tools: ToolSchemas) -> str:
    """The Hermes/Qwen tool description, used when a template has no `tools=` support."""
    lines = "".join("\n" + json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return HERMES_TOOLS_HEADER + lines + HERMES_TOOLS_FOOTER


def with_tools_system_prompt(messages: Sequence[Message], tools: ToolSchemas) -> list[Message]:
    """The documented fallback: merge the Hermes tool description into the system message.

    An existing first system message keeps its text, followed by a blank line
    and the tool description; without one, a system message is prepended.
    """
    prompt = hermes_tools_prompt(tools)
    out = list(messages)
    if out and out[0].role == "system":
        first = out[0]
        text = f"{first.content}\n\n{prompt}" if first.content else prompt
        out[0] = dataclasses.replace(first, content=text)
    else:
        out.insert(0, Message(role="system", content=prompt))
    return out


def hermes_content(message: Message) -> str:
    """An assistant message's content with its tool calls written in Hermes format.

    For templates that do not render `tool_calls` themselves: the text outside
    the calls, a newline, then one ``<tool_call>\\n{json}\\n</tool_call>`` block
    per call (newline-separated), as Hermes/Qwen models emit them.
    """
    if not message.tool_calls:
        return message.content
    calls = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in message.tool_calls
    )
    return f"{message.content}\n{calls}" if message.content else calls


def with_calls_in_content(messages: Sequence[Message]) -> list[Message]:
    """Messages whose tool calls are moved into the content (`hermes_content`)."""
    return [
        dataclasses.replace(m, content=hermes_content(m), tool_calls=[]) if m.tool_calls else m
        for m in messages
    ]


# --------------------------------------------------------------------------- tokenizers


class SimpleChatTokenizer:
    """A dependency-free byte-level tokenizer with a ChatML template.

    Ids 0-255 are bytes; three special tokens follow. Tool calls render in
    Hermes format inside the assistant content and tools go into the system
    message (`with_tools_system_prompt`). Deterministic and cheap: encode is
    one `str.encode` when the text holds no special token. For scripted
    engines, tests and benchmarks.
    """

    SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    CACHE_ENTRIES = 4096
    CACHE_TEXT_CHARS = 512
    _UTF16 = staticmethod(codecs.getencoder("utf-16-le" if sys.byteorder == "little" else "utf-16-be"))

    def __init__(self) -> None:
        self.special_ids = {s: 256 + i for i, s in enumerate(self.SPECIAL_TOKENS)}
        self._special_text = {i: s for s, i in self.special_ids.items()}
        self.im_start_id = self.special_ids["<|im_start|>"]
        self.im_end_id = self.special_ids["<|im_end|>"]
        self.eos_ids: tuple[int, ...] = (self.im_end_id, self.special_ids["<|endoftext|>"])
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS)
        self.boundary_cache: dict[str, Any] = {}  # used by Conversation
        self._cache: dict[str, list[int]] = {}
        # encode() swaps each special token for a byte that valid UTF-8 never contains (0xF8 + i),
        # then for the char 256 + i: the UTF-16 code units of the result are the ids. Each special
        # token holds "<|" only at its start and none is a prefix of another, so their occurrences
        # never overlap and replacing them one kind after another finds the left-to-right split.
        specials = self.SPECIAL_TOKENS
        if len(specials) > 8 or any(
            not s.startswith("<|") or "<|" in s[1:] or any(o != s and o.startswith(s) for o in specials)
            for s in specials
        ):
            raise ValueError(f"SimpleChatTokenizer: unsupported special tokens {specials!r}")
        self._marks = tuple(
            (s.encode("utf-8"), bytes([0xF8 + i]), chr(0xF8 + i), chr(256 + i)) for i, s in enumerate(specials)
        )

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: ToolSchemas | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        if tools:
            messages = with_tools_system_prompt(messages, tools)
        parts = [
            f"<|im_start|>{m.role}\n{hermes_content(m) if m.tool_calls else m.content}<|im_end|>\n"
            for m in messages
        ]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode(self, text: str) -> list[int]:
        if "<|" not in text:
            return list(text.encode("utf-8"))
        cached = self._cache.get(text)
        if cached is not None:  # chat deltas repeat: headers, generation prompts
            return cached.copy()
        marked = text.encode("utf-8")
        for special, mark, _, _ in self._marks:
            marked = marked.replace(special, mark)
        chars = marked.decode("latin-1")  # one char per byte, marks included
        for _, _, mark_char, id_char in self._marks:
            chars = chars.replace(mark_char, id_char)
        out = array("H", self._UTF16(chars)[0]).tolist()
        if len(text) <= self.CACHE_TEXT_CHARS:
            if len(self._cache) >= self.CACHE_ENTRIES:
                self._cache.clear()
            self._cache[text] = out.copy()
        return out

    def decode(self, ids: Sequence[int]) -> str:
        try:  # the common case, bytes only
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError:  # special (or unknown) ids among them
            pass
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            out.append(self._special_text.get(i, ""))
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFChatTokenizer:
    """A Hugging Face tokenizer and its chat template behind the `ChatTokenizer` protocol.

    transformers is imported only by `from_pretrained`; `__init__` accepts any
    tokenizer object with `apply_chat_template`, `encode` and `decode`.
    Tools go through the template's `tools=` argument when the template uses
    them (it mentions `tools`), else through `with_tools_system_prompt`; a
    template that does not render `tool_calls` gets them written into the
    assistant content in Hermes format (`with_calls_in_content`).
    `template_kwargs` are passed to every render (e.g. ``enable_thinking``).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_ids: Sequence[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        tools_in_template: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("HFChatTokenizer: the tokenizer has no chat_template; set one first")
        self.tools_in_template = (
            ("tools" in str(template)) if tools_in_template is None else tools_in_template
        )
        self.calls_in_template = "tool_calls" in str(template)
        self.boundary_cache: dict[str, Any] = {}  # used by Conversation
        self.eos_ids: tuple[int, ...] = tuple(eos_ids) if eos_ids is not None else self._find_eos_ids()

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFChatTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), **kwargs)

    def _find_eos_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS plus the special token that closes an assistant turn."""
        ids: list[int] = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            ids.append(eos)
        try:
            closing = closing_text(self)
        except Exception:  # a template that cannot render [user, assistant]: keep the EOS only
            closing = ""
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        if closing:
            first = self.encode(closing)[0]
            if (first in special or first in added) and first not in ids:
                ids.insert(0, first)
        return tuple(ids)

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: ToolSchemas | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        template_tools: list[dict[str, Any]] | None = None
        if tools:
            if self.tools_in_template:
                template_tools = [dict(t) for t in tools]
            else:
                messages = with_tools_system_prompt(messages, tools)
        if not self.calls_in_template:
            messages = with_calls_in_content(messages)
        text = self.tokenizer.apply_chat_template(
            [m.to_chat() for m in messages],
            tools=template_tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )


# --------------------------------------------------------------------------- template boundary


def closing_text(tokenizer: ChatTokenizer, tools: ToolSchemas | None = None) -> str:
    """The text the template emits after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
    text = tokenizer.render(list(DUMMY_PREFIX), tools=tools)
    at = text.rfind(MARKER)
    if at < 0:
        raise ValueError("the chat template drops assistant content; cannot find where a turn ends")
    return text[at + len(MARKER) :]

"""Constrained decoding with exact behaviour logprobs (llguidance grammars).

A request that must call a tool (`tool_choice: "required"` or a named
function) or answer in JSON (`response_format` json_object / json_schema)
carries a grammar (`Sampling.grammar`, llguidance's Lark dialect). An engine
that serves grammars (``constrained_decoding = True``) masks, at every step,
the tokens that cannot continue a reply the grammar accepts, *before*
temperature, top-k and top-p, and samples from what is left: the logprob it
records for a token is its log-probability under that masked, renormalised
distribution, the one it was actually drawn from, so the trainer's off-policy
correction stays exact (the trajectory records that the turn was constrained).

Two halves: grammar builders (pure Python, used by the gateway) and
`GrammarMatcher` (llguidance, used in the engine's sampler; imported lazily so
the gateway needs neither llguidance nor torch to build a grammar).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

TOOL_CALL_FORMATS = ("hermes", "json", "llama3_json")
"""The tool parsers whose call format a grammar can force (the rest are refused)."""
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How forced JSON is laid out (llguidance's `x-guidance`): as `json.dumps` writes it, so a reply cannot
run into unbounded whitespace and reads as models were trained to write calls."""


def _laid_out(schema: dict[str, Any]) -> dict[str, Any]:
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_LAYOUT}


def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    fn = tool.get("function", tool)
    parameters = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: parameters},
            "required": ["name", args_key], "additionalProperties": False}


def tool_call_grammar(tools: Sequence[dict[str, Any]], parser: str, name: str | None = None) -> str:
    """A grammar for exactly one call, in `parser`'s format, of the named tool (or of any of `tools`).

    hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; json: the bare object;
    llama3_json: the bare object with ``parameters``. The arguments follow the tool's JSON schema.
    """
    if parser not in TOOL_CALL_FORMATS:
        raise ValueError(f"forced tool calls are served for the {', '.join(TOOL_CALL_FORMATS)} tool parsers, "
                         f"not {parser!r}")
    chosen = [t for t in tools if name is None or t.get("function", t).get("name") == name]
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the request's tools")
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    schemas = [_call_schema(t, args_key) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = "%json " + json.dumps(_laid_out(schema))
    if parser == "hermes":
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {body}\n'
    return f"start: call\ncall: {body}\n"


def json_grammar(schema: dict[str, Any] | None = None) -> str:
    """A grammar for one JSON value following `schema` (any JSON object when None: json_object)."""
    return "start: value\nvalue: %json " + json.dumps(_laid_out(schema if schema is not None else {"type": "object"})) + "\n"


class Grammars:
    """One engine's grammar compiler over its tokenizer: validates grammars and makes per-request matchers.

    The llguidance tokenizer is built on first use, once per end-of-sequence id (an engine holds one
    `Grammars`): a complete reply may end only with that id.
    """

    def __init__(self, hf_tokenizer: Any, eos_ids: Sequence[int], vocab_size: int) -> None:
        self.hf_tokenizer = getattr(hf_tokenizer, "tokenizer", hf_tokenizer)  # an agentrl chat tokenizer's own
        self.eos_ids = list(eos_ids)
        self.vocab_size = vocab_size
        self._tokenizers: dict[int, Any] = {}

    def _ll_tokenizer(self, eos: int) -> Any:
        if eos not in self._tokenizers:
            import llguidance.hf

            self._tokenizers[eos] = llguidance.hf.from_tokenizer(self.hf_tokenizer, eos_token=eos)
        return self._tokenizers[eos]

    def matcher(self, grammar: str, stop_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for one request (ending with its first stop id, else the model's end of sequence);
        a grammar llguidance cannot compile is a ValueError naming why."""
        import llguidance

        eos = [*stop_ids, *self.eos_ids]
        if not eos:
            raise ValueError("a constrained request needs an end-of-sequence id (sampling.stop_ids)")
        tokenizer = self._ll_tokenizer(eos[0])
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        error = llguidance.LLMatcher.validate_grammar(compiled, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"the grammar does not compile: {error}")
        return GrammarMatcher(llguidance.LLMatcher(tokenizer, compiled), tokenizer.vocab_size, self.vocab_size,
                              eos[:1])


class GrammarMatcher:
    """Where one request stands in its grammar: the tokens allowed next, advanced by each sampled token."""

    def __init__(self, matcher: Any, grammar_vocab: int, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._grammar_vocab = grammar_vocab
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)

    def allowed(self) -> Any:
        """A numpy bool array over the model's vocabulary: True where a token may come next.

        Ids past the tokenizer's vocabulary (padding rows of the embedding) are never allowed; once
        the grammar is complete only the end-of-sequence ids are.
        """
        import numpy as np

        out = np.zeros(self.vocab_size, dtype=bool)
        if self._matcher.is_stopped():
            out[[i for i in self.eos_ids if i < self.vocab_size]] = True
            return out
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        n = min(self._grammar_vocab, self.vocab_size)
        out[:n] = bits[:n].astype(bool)
        if not out.any():  # the grammar can go no further (a bug or a dead end): end the reply
            out[[i for i in self.eos_ids if i < self.vocab_size]] = True
        return out

    def consume(self, token: int) -> None:
        """Advance past the sampled `token` (an id the mask allowed)."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token)

    @property
    def error(self) -> str:
        return str(self._matcher.get_error() or "")


def mask_logits(logits: Any, grammars: Sequence[GrammarMatcher | None]) -> Any:
    """`logits` [B, V] with every token a row's grammar forbids set to -inf (rows without one unchanged).

    Applied before temperature, top-k and top-p, so what is sampled, and the logprob recorded for
    it, are those of the masked distribution. Returns `logits` itself when no row is constrained.
    """
    if all(g is None for g in grammars):
        return logits
    import torch

    out = logits.float().clone()
    for i, grammar in enumerate(grammars):
        if grammar is not None:
            allowed = torch.from_numpy(grammar.allowed()).to(out.device)
            out[i].masked_fill_(~allowed[: out.shape[1]], float("-inf"))
    return out

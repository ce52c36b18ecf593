"""Checkpoint and resume for TorchTrainer.

Layout of a checkpoint directory:
  model/               HF safetensors model (+ tokenizer): `from_pretrained(path/"model")` works.
                       With LoRA the adapters are merged in (what engines and evals want). With
                       LoRA and under FSDP/DeepSpeed written bucket by bucket (sharded files + index),
                       so no whole second copy of the model is held while saving.
  adapter/             LoRA only: the peft adapter, which is what resume loads.
  trainer_state.pt     optimizer, scheduler, step, policy_version, critic (if any)
  deepspeed/           data_parallel=deepspeed only: DeepSpeed's own checkpoint, each rank's partition of
                       the optimizer state and master weights (what resume loads, with as many ranks)
  critic_deepspeed/    the same for the critic (advantage: gae under data_parallel=deepspeed)
  rng_rank{R}.pt       python / numpy / torch (and CUDA) RNG states of process R (SP ranks included)
  extra_state.json     the caller's JSON state (data cursor, rollout state, …)
The directory is written under a temporary name and renamed, so a crash never
leaves a half checkpoint under the final name.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.trainers.distributed import (
    full_tensor,
    load_whole_model_state,
    load_whole_optimizer_state,
    whole_optimizer_state,
)

if TYPE_CHECKING:
    from agentrl.trainers.torch_trainer import TorchTrainer


def save_checkpoint(trainer: TorchTrainer, path: str | Path, extra_state: dict[str, Any]) -> None:
    """Write a checkpoint of `trainer` to `path` (replacing an existing one)."""
    path = Path(path)
    world = trainer.processes  # under SP the data-parallel rank 0 is several processes: one writes
    tmp = path.with_name(path.name + ".tmp")
    zero = trainer.models.zero
    # FSDP, ZeRO-3: gathering the weights (and FSDP's optimizer state) are collectives, so every rank takes part
    collective = trainer.fsdp or trainer.partitioned
    # written from the engines' bucket stream: FSDP and ZeRO-3 gather bucket by bucket, and DeepSpeed keeps the
    # weights as views of flat buffers, which save_pretrained refuses (shared storage)
    streamed = collective or zero is not None
    if world.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if collective or (streamed and world.is_main):
        _write_streamed_model(trainer, tmp / "model", write=world.is_main)
    adapter = _full_adapter_state(trainer) if streamed and trainer.config.lora is not None else None
    optimizer: Any = None  # DeepSpeed: each rank's partition, written by the engine below
    if zero is None:
        optimizer = whole_optimizer_state(trainer.model, trainer.optimizer) if trainer.fsdp else trainer.optimizer.state_dict()
    critic_zero = trainer.critic.zero if trainer.critic is not None else None
    # sharded: gathered, every rank; DeepSpeed: its engine writes each rank's partition below
    critic = trainer.critic.state_dict() if trainer.critic is not None and critic_zero is None else None
    if world.is_main:
        if streamed:
            _copy_tokenizer(trainer.model_path, tmp / "model")
            if adapter is not None:
                peft_model: Any = trainer.model
                peft_model.save_pretrained(tmp / "adapter", state_dict=adapter)
        else:
            _save_model(trainer, tmp)
        torch.save(
            {
                "optimizer": optimizer,
                "scheduler": trainer.scheduler.state_dict(),
                "step": trainer.step,
                "policy_version": trainer.policy_version,
                "critic": critic,
                "config": trainer.config.model_dump(mode="json"),
                "world_size": world.size,
            },
            tmp / "trainer_state.pt",
        )
        (tmp / "extra_state.json").write_text(json.dumps(extra_state, indent=1, sort_keys=True))
    _barrier(trainer)
    if zero is not None:
        zero.save(tmp / "deepspeed")
    if critic_zero is not None:
        critic_zero.save(tmp / "critic_deepspeed")
    torch.save(_rng_state(), tmp / f"rng_rank{world.rank}.pt")
    _barrier(trainer)
    if world.is_main:
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    _barrier(trainer)


def load_checkpoint(trainer: TorchTrainer, path: str | Path) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler, RNG, step and version; return extra_state."""
    path = Path(path)
    if not (path / "trainer_state.pt").exists():
        raise FileNotFoundError(f"{path} is not a trainer checkpoint (no trainer_state.pt)")
    state = torch.load(path / "trainer_state.pt", map_location=trainer.device, weights_only=False)
    saved_mode = state.get("config", {}).get("data_parallel", "ddp")
    if saved_mode != trainer.config.data_parallel:
        raise ValueError(
            f"{path} was written with trainer.data_parallel={saved_mode}; "
            f"resume it with the same (this trainer has {trainer.config.data_parallel})"
        )
    if trainer.models.zero is not None:  # DeepSpeed's partitions: as many ranks, the same stage
        _check_zero_layout(trainer, path, state)
        trainer.models.zero.load(path / "deepspeed")  # the weights (master copy) and the optimizer state
    elif trainer.fsdp:  # a full (unsharded) optimizer state: each rank keeps its shard
        _load_model(trainer, path)
        load_whole_optimizer_state(trainer.model, trainer.optimizer, state["optimizer"])
    else:
        _load_model(trainer, path)
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.step = int(state["step"])
    trainer.policy_version = int(state["policy_version"])
    if trainer.critic is not None and trainer.critic.zero is not None:
        trainer.critic.zero.load(path / "critic_deepspeed")
    elif trainer.critic is not None:
        if state.get("critic") is None:
            raise ValueError(f"{path}: checkpoint has no critic state but trainer.advantage='gae' needs one")
        trainer.critic.load_state_dict(state["critic"])
    rng_file = path / f"rng_rank{trainer.processes.rank}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    extra: dict[str, Any] = json.loads((path / "extra_state.json").read_text())
    return extra


def _check_zero_layout(trainer: TorchTrainer, path: Path, state: dict[str, Any]) -> None:
    saved_stage = ((state.get("config") or {}).get("deepspeed") or {}).get("zero_stage", 2)
    zero = trainer.config.zero
    assert zero is not None
    saved_size = state.get("world_size")
    if saved_stage != zero.zero_stage or saved_size != trainer.processes.size:
        raise ValueError(
            f"{path} was written by {saved_size} DeepSpeed ranks with trainer.deepspeed.zero_stage={saved_stage}; "
            f"resume it with the same (this trainer: {trainer.processes.size} ranks, zero_stage={zero.zero_stage})"
        )


def _save_model(trainer: TorchTrainer, out: Path) -> None:
    from agentrl.trainers.deepspeed_backend import deepspeed_left_unimported

    model: Any = trainer.model  # an HF PreTrainedModel, or a peft PeftModel under LoRA
    with deepspeed_left_unimported():  # this path is never DeepSpeed's: save_pretrained would import it
        if trainer.config.lora is not None:
            model.save_pretrained(out / "adapter")
            # merged one bucket at a time: a whole merged copy (or a second model to load it into) is not held
            _write_streamed_model(trainer, out / "model", write=True)
        else:
            model.save_pretrained(out / "model", safe_serialization=True)
    _copy_tokenizer(trainer.model_path, out / "model")


def _hf_config(trainer: TorchTrainer) -> Any:
    """The HF config of the policy (under LoRA, of the base model the adapters sit on)."""
    model: Any = trainer.model
    return model.get_base_model().config if trainer.config.lora is not None else model.config


def _full_adapter_state(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """LoRA: the adapter parameters (copies), by FQN. FSDP, ZeRO-3: gathered whole (a collective: every rank calls it)."""
    if trainer.partitioned:
        from deepspeed.runtime.zero import GatheredParameters

        lora = {name: p for name, p in trainer.model.named_parameters() if ".lora_" in name}
        with GatheredParameters(list(lora.values()), modifier_rank=None):
            return {name: p.data.detach().cpu().clone() for name, p in lora.items()}
    return {
        name: full_tensor(t).detach().cpu().clone()
        for name, t in trainer.model.state_dict().items()
        if ".lora_" in name
    }


def _write_streamed_model(trainer: TorchTrainer, out: Path, *, write: bool) -> None:
    """A plain HF model dir written one bucket of the engines' weights at a time (a sharded safetensors model).

    Under FSDP and ZeRO-3 every rank reads the stream (each bucket is gathered
    from all); only `write` (the writing rank) keeps and writes each bucket,
    and no rank ever holds more than one.
    """
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for i, bucket in enumerate(trainer.state_for_engines().buckets()):
        if not write:
            continue
        out.mkdir(parents=True, exist_ok=True)
        file = f"model-{i + 1:05d}.safetensors"
        tensors = {name: t.contiguous() for name, t in bucket}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if write:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
        _hf_config(trainer).save_pretrained(out)


def _copy_tokenizer(src: str, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "vocab.json", "merges.txt", "generation_config.json"):  # fmt: skip
        f = Path(src) / name
        if f.exists() and not (out / name).exists():
            shutil.copy2(f, out / name)


def _load_model(trainer: TorchTrainer, path: Path) -> None:
    from agentrl.weights.buckets import tied_aliases

    if trainer.config.lora is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = path / "adapter"
        files = list(adapter.glob("adapter_model.safetensors"))
        if not files:
            raise FileNotFoundError(f"{adapter}: no adapter_model.safetensors to resume LoRA from")
        saved = load_file(str(files[0]), device=str(trainer.device))
        if not trainer.fsdp:
            set_peft_model_state_dict(trainer.model, saved)
            return
        # the file names parameters without the adapter's name; every rank keeps its shard of each
        by_plain_name = {name.replace(".default.", "."): name for name in trainer.model.state_dict() if ".lora_" in name}
        if set(saved) != set(by_plain_name):
            raise RuntimeError(f"{adapter} does not match the model's LoRA parameters")
        load_whole_model_state(trainer.model, {by_plain_name[k]: v for k, v in saved.items()}, strict=False)
        return
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted((path / "model").glob("*.safetensors")):
        state.update(load_file(str(f), device=str(trainer.device)))
    if trainer.fsdp:  # every rank read the full weights; each keeps its shard
        missing, unexpected = load_whole_model_state(trainer.model, state, strict=False)
    else:
        missing, unexpected = trainer.model.load_state_dict(state, strict=False)
    tied = tied_aliases(trainer.model)
    bad_missing = [m for m in missing if m not in tied]
    if bad_missing or unexpected:
        raise RuntimeError(
            f"{path}/model does not match the model: missing={bad_missing} unexpected={unexpected}"
        )


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier(trainer: TorchTrainer) -> None:
    if trainer.processes.size > 1:
        import torch.distributed as dist

        dist.barrier(group=trainer.processes.group)

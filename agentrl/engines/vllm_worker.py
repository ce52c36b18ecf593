"""Runs inside vLLM's worker processes: loads the weights the `vllm` engine hands over.

vLLM mixes this class into its worker (`worker_extension_cls`), so its methods
can be called by name through `AsyncLLM.collective_rpc`. Tensors do not travel
through that RPC: the engine writes each bucket of the trainer's weights to a
safetensors file (in /dev/shm where there is one) and passes the paths; the
worker streams them from there into vLLM's own in-place reload, which maps HF
names onto vLLM's fused layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
That reload swaps in new parameter tensors layer by layer, which unties tied
weights (the lm_head of a model with tied embeddings kept serving the old
embedding matrix: sampled logprobs were off by up to 0.2 after an update), so
parameters that shared a tensor before the reload are tied again after it.

With LoRA (`enable_lora`), `agentrl_load_adapter` / `agentrl_receive_adapter`
take one adapter's tensors (canonical names, `<module>.lora_A.weight`; from
bucket files, or straight from the weight-transfer group's broadcast) and
file them in vLLM's LoRA manager under an adapter id, replacing the adapter
that had the id: the base weights are not touched, and requests naming that
id sample with the new tensors from their next step on.
Kept free of imports at module level: vLLM imports it in every worker.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


class WeightLoader:
    """Worker extension: `agentrl_load_weights(paths)` reloads the model from bucket files."""

    def agentrl_load_weights(self, paths: Sequence[str]) -> int:
        """Load every tensor of the safetensors files at `paths` into the model; returns their number."""
        from safetensors import safe_open

        loaded = 0

        def tensors() -> Iterator[tuple[str, Any]]:
            nonlocal loaded
            for path in paths:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        loaded += 1
                        yield name, f.get_tensor(name)

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        before = {name: p.data_ptr() for name, p in model.named_parameters(remove_duplicate=False)}
        # vLLM's Worker.reload_weights: in place, under the worker's own vllm config
        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        retie(model, before)
        return loaded

    def agentrl_load_adapter(self, paths: Sequence[str], lora_id: int, spec: dict[str, Any]) -> int:
        """File the LoRA tensors of the safetensors files at `paths` as adapter `lora_id`; returns their number."""
        from safetensors.torch import load_file

        tensors: dict[str, Any] = {}
        for path in paths:
            tensors.update(load_file(path))
        return self._agentrl_set_adapter(lora_id, tensors, spec)

    def agentrl_receive_adapter(self, lora_id: int, spec: dict[str, Any]) -> int:
        """Receive one broadcast of LoRA tensors over the weight-transfer group and file them as `lora_id`.

        The group is the one `init_weight_transfer_engine` joined (the `agentrl_gloo` engine's); each bucket
        has the group's deadline. Nothing is filed unless the whole stream arrived.
        """
        from agentrl.weights import wire

        engine = self.weight_transfer_engine  # type: ignore[attr-defined]
        group = getattr(engine, "_group", None)
        if group is None:
            raise RuntimeError("agentrl_gloo: init_weight_transfer_engine was not called (no group to receive on)")
        tensors: dict[str, Any] = {}
        try:
            for bucket in wire.receive_buckets(group, engine._device, engine._timeout_s):
                tensors.update((name, t.cpu().clone()) for name, t in bucket)  # off the bucket buffer
        except BaseException:
            engine.shutdown()  # the group is broken for every member: the next sync forms a new one
            raise
        return self._agentrl_set_adapter(lora_id, tensors, spec)

    def _agentrl_set_adapter(self, lora_id: int, tensors: dict[str, Any], spec: dict[str, Any]) -> int:
        """Build vLLM's LoRAModel from `tensors` and put it in the LoRA manager as `lora_id` (replacing one)."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        from agentrl.engines.base import canonical_adapter_name

        tensors = {canonical_adapter_name(name): t for name, t in tensors.items()}  # peft's names as well

        workers = getattr(self.model_runner, "lora_manager", None)  # type: ignore[attr-defined]
        if workers is None:
            raise RuntimeError("this vLLM engine was started without enable_lora: it cannot hold an adapter")
        peft = PEFTHelper.from_dict({"r": int(spec["rank"]), "lora_alpha": float(spec["alpha"]),
                                     "target_modules": list(spec["target_modules"])})  # fmt: skip
        peft.validate_legal(workers.lora_config)
        model = workers._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = LoRAModel.from_lora_tensors(
            lora_id, tensors, peft, device="cpu", dtype=workers.lora_config.lora_dtype,
            model_vocab_size=workers.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
        )  # fmt: skip
        manager = workers._adapter_manager
        manager.remove_adapter(lora_id)  # frees its slot; the next step's mapping activates the new one
        if len(manager) >= manager.capacity:
            raise RuntimeError(f"vLLM holds {len(manager)} adapters, its most (max_cpu_loras); remove one first")
        manager.add_adapter(lora)
        manager.activate_adapter(lora_id)
        return len(tensors)

    def agentrl_remove_adapter(self, lora_id: int) -> bool:
        """Drop adapter `lora_id` from vLLM's LoRA manager (True when it was there)."""
        workers = getattr(self.model_runner, "lora_manager", None)  # type: ignore[attr-defined]
        return bool(workers is not None and workers._adapter_manager.remove_adapter(lora_id))


def retie(model: Any, before: dict[str, int]) -> list[str]:
    """Tie again the parameters that shared storage in `before` (name -> data_ptr); returns the re-tied names.

    Within each group, the parameter that was reloaded (its storage changed;
    else the first) is set on the modules of the others, and those modules
    redo their post-load processing: on a CPU that re-packs the weight the
    matmul kernel reads (a tied lm_head keeps a packed copy of its own).
    """
    groups: dict[int, list[str]] = {}
    for name, ptr in before.items():
        groups.setdefault(ptr, []).append(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    retied = []
    for names in groups.values():
        if len(names) < 2:
            continue
        fresh = [n for n in names if params[n].data_ptr() != before[n]]
        source_name = fresh[0] if fresh else names[0]
        source = params[source_name]
        for name in names:
            if name == source_name:
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if params[name] is not source:
                setattr(owner, attr, source)
            method = getattr(owner, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(owner)
            retied.append(name)
    return retied

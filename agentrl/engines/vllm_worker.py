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

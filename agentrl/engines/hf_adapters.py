"""Named LoRA adapters over the hf engine's base model, applied per batch row.

The engine (`hf.HFEngine`) holds any number of adapters, each a pair of small
matrices (A: [rank, in], B: [out, rank], scale alpha / rank) per wrapped
linear layer. They are never merged into the base: a request names its
adapter (`Sampling.adapter`) and only its rows get `x @ A^T @ B^T * scale`
added to the layer's output, so requests of different adapters and of the
base (adapter None) share one prefill and one decode step.

Per layer the adapters are stacked along the rank: `a` is [sum of ranks, in]
and `b` is [out, sum of ranks]. A step computes `(x @ a^T * mask) @ b^T` for
the whole batch, where row i of `mask` holds its adapter's scale on that
adapter's slice of the rank and zeros elsewhere: two small matmuls per layer
whatever the number of adapters (rather than one gather/scatter per adapter
and layer, as peft's mixed-batch forward does). A row of the base gets an
exact zero added. The hooks that add the deltas are registered for the
duration of a step that has adapter rows only: a step of base rows alone runs
the model exactly as an engine without adapters does.

When the engine samples with the trainer's frozen base (`hf_shared`), its
model carries peft's own LoRA layers (the trainer's adapter, served for
adapter None). Named adapters sit on the frozen base, not on that adapter:
for their rows the peft adapter's output is zeroed (an exact zero added).

Worker-thread state: `install`/`remove` run under the engine's step lock,
`applied` inside a step. Imports torch: only the hf engine imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from agentrl.engines.base import AdapterSpec, WeightSource, canonical_adapter_name

if TYPE_CHECKING:
    from agentrl.engines.hf import HFEngine

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
_PEFT_CHILDREN = frozenset({"base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A",
                            "lora_embedding_B", "lora_magnitude_vector"})  # fmt: skip


@dataclass(eq=False)
class HeldAdapter:
    """One adapter the engine holds: its shape, the version its tokens carry, the KV epoch of its rows."""

    name: str
    spec: AdapterSpec
    version: int
    epoch: int  # prefix-cache key of KV computed with it (unique across adapters and weight copies)
    paths: tuple[str, ...]  # the modules it wraps
    removing: bool = False  # remove_adapter is waiting for its requests: refuse new ones


@dataclass(eq=False)
class _Slot:
    start: int
    rank: int
    scale: float


@dataclass(eq=False)
class _Stack:
    """The adapters of one linear layer, stacked along the rank."""

    linear: nn.Module
    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [out, sum of ranks]
    slots: dict[str, _Slot] = field(default_factory=dict)

    def layout(self) -> tuple[tuple[str, int, int], ...]:
        return tuple((n, s.start, s.rank) for n, s in self.slots.items())


def _is_peft_lora(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)


def _linear_of(module: nn.Module) -> nn.Module:
    """The plain linear layer a module computes with (peft's LoRA layer wraps it as `base_layer`)."""
    inner = module.base_layer if _is_peft_lora(module) else module
    assert isinstance(inner, nn.Module)
    return inner


def _add_delta(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, module: nn.Module, args: Any, out: Any) -> None:
    """Forward hook: each row's adapter delta added to the layer's output in place."""
    out.add_(F.linear(F.linear(args[0], a) * mask, b))


def _keep_rows(keep: torch.Tensor, module: nn.Module, args: Any, out: Any) -> None:
    """Forward hook on peft's own lora_B: zero the rows of named adapters (they sit on the bare base)."""
    out.mul_(keep)


class Adapters:
    """The named adapters of one model: validated staging, installation, per-row application."""

    def __init__(self, model: nn.Module) -> None:
        self.held: dict[str, HeldAdapter] = {}
        self._stacks: dict[str, _Stack] = {}  # module path -> its adapters
        self.rebind(model)

    def rebind(self, model: nn.Module) -> None:
        """Serve over `model` (the engine swapped its model for one sharing the trainer's base)."""
        self.model = model
        lora_bs: list[Any] = [m.lora_B for m in model.modules() if _is_peft_lora(m)]
        self._peft_lora_b: list[nn.Module] = [lora_b[k] for lora_b in lora_bs for k in lora_b]
        for path, stack in self._stacks.items():
            stack.linear = _linear_of(model.get_submodule(path))

    @property
    def versions(self) -> dict[str, int]:
        return {n: h.version for n, h in self.held.items()}

    def check(self, name: str) -> None:
        """KeyError unless adapter `name` is held (and not being removed)."""
        held = self.held.get(name)
        if held is None or held.removing:
            have = sorted(n for n, h in self.held.items() if not h.removing)
            raise KeyError(f"adapter {name!r} is not held by this hf engine; it holds: {have or 'none'}")

    # -- what an adapter of a spec looks like ----------------------------------------------

    def target_paths(self, spec: AdapterSpec) -> list[str]:
        """The linear modules `spec.target_modules` names (peft's matching: the name or its dotted tail;
        "all-linear": every linear layer but the output head)."""
        get_head: Any = getattr(self.model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        paths = []
        for path, module in self.model.named_modules():
            parts = path.split(".")
            if not path or _PEFT_CHILDREN & set(parts):
                continue
            linear = _linear_of(module)
            if "all-linear" in spec.target_modules:
                if isinstance(linear, nn.Linear) and module is not head:
                    paths.append(path)
            elif any(path == t or path.endswith("." + t) for t in spec.target_modules):
                if not isinstance(linear, nn.Linear):
                    raise ValueError(f"adapter target {path} is a {type(linear).__name__}: only linear layers "
                                     "take adapters in the hf engine")  # fmt: skip
                paths.append(path)
        if not paths:
            raise ValueError(f"adapter target_modules {list(spec.target_modules)} match no linear layer of the model")
        return paths

    def expected(self, spec: AdapterSpec) -> dict[str, tuple[int, int]]:
        """Canonical tensor name -> shape, for every tensor an adapter of `spec` has."""
        if spec.rank < 1:
            raise ValueError(f"adapter rank must be >= 1, got {spec.rank}")
        out: dict[str, tuple[int, int]] = {}
        for path in self.target_paths(spec):
            linear = _linear_of(self.model.get_submodule(path))
            assert isinstance(linear, nn.Linear)
            out[path + LORA_A] = (spec.rank, linear.in_features)
            out[path + LORA_B] = (linear.out_features, spec.rank)
        return out

    def stage(self, weights: WeightSource, spec: AdapterSpec) -> dict[str, torch.Tensor]:
        """Copies of an adapter's tensors (the layers' dtype and device), checked against `spec`.

        Names are canonical (`canonical_adapter_name`; peft's own names are accepted
        too). A missing, unexpected or mis-shaped tensor is a ValueError naming them all,
        raised before anything the engine serves changes.
        """
        expected = self.expected(spec)
        staged: dict[str, torch.Tensor] = {}
        unexpected: list[str] = []
        misshaped: list[str] = []
        for bucket in weights.buckets():
            for raw, tensor in bucket:
                name = canonical_adapter_name(raw)
                shape = expected.get(name)
                if shape is None:
                    unexpected.append(raw)
                elif tuple(tensor.shape) != shape:
                    misshaped.append(f"{raw} {list(tensor.shape)} (spec wants {list(shape)})")
                else:
                    like = _linear_of(self.model.get_submodule(name.rsplit(".", 2)[0])).weight
                    staged[name] = tensor.detach().to(device=like.device, dtype=like.dtype, copy=True)
        missing = sorted(set(expected) - set(staged))
        problems = [f"{what} ({len(names)}): {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}"
                    for what, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
                    if names]  # fmt: skip
        if problems:
            raise ValueError(f"adapter tensors do not fit {spec}: " + "; ".join(problems))
        return staged

    # -- under the engine's step lock ---------------------------------------------------------

    def install(self, name: str, staged: Mapping[str, torch.Tensor], spec: AdapterSpec, version: int,
                epoch: int) -> None:  # fmt: skip
        """Add adapter `name` or replace its tensors (in place when the spec is unchanged)."""
        old = self.held.get(name)
        paths = tuple(sorted({n.rsplit(".", 2)[0] for n in staged}))
        if old is not None and old.spec == spec and old.paths == paths:
            for path in paths:
                stack, slot = self._stacks[path], self._stacks[path].slots[name]
                stack.a[slot.start : slot.start + slot.rank].copy_(staged[path + LORA_A])
                stack.b[:, slot.start : slot.start + slot.rank].copy_(staged[path + LORA_B])
        else:
            if old is not None:
                self._unstack(old)
            for path in paths:
                a, b = staged[path + LORA_A], staged[path + LORA_B]
                if path not in self._stacks:
                    self._stacks[path] = _Stack(_linear_of(self.model.get_submodule(path)), a[:0], b[:, :0])
                stack = self._stacks[path]
                stack.slots[name] = _Slot(stack.a.shape[0], spec.rank, spec.alpha / spec.rank)
                stack.a = torch.cat([stack.a, a])
                stack.b = torch.cat([stack.b, b], dim=1)
        self.held[name] = HeldAdapter(name, spec, version, epoch, paths)

    def remove(self, name: str) -> HeldAdapter:
        """Drop adapter `name` and free its tensors."""
        held = self.held.pop(name)
        self._unstack(held)
        return held

    def _unstack(self, held: HeldAdapter) -> None:
        for path in held.paths:
            stack = self._stacks[path]
            slots = [(n, s) for n, s in stack.slots.items() if n != held.name]
            if not slots:
                del self._stacks[path]
                continue
            a = [stack.a[s.start : s.start + s.rank] for _, s in slots]
            b = [stack.b[:, s.start : s.start + s.rank] for _, s in slots]
            stack.a, stack.b = torch.cat(a), torch.cat(b, dim=1)
            stack.slots, start = {}, 0
            for n, s in slots:
                stack.slots[n] = _Slot(start, s.rank, s.scale)
                start += s.rank

    def nbytes(self) -> int:
        return sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size() for s in self._stacks.values())

    # -- inside a step ------------------------------------------------------------------------

    @contextlib.contextmanager
    def applied(self, rows: Sequence[str | None]) -> Iterator[None]:
        """While the model runs one step over `rows` (each row's adapter, None: the base): add each
        row's adapter delta. A step without adapter rows registers nothing."""
        present = {n for n in rows if n is not None}
        if not present:
            yield
            return
        handles = []
        try:
            masks: dict[tuple[tuple[str, int, int], ...], torch.Tensor] = {}
            for stack in self._stacks.values():
                if present.isdisjoint(stack.slots):
                    continue
                layout = stack.layout()
                mask = masks.get(layout)
                if mask is None:
                    mask = torch.zeros((len(rows), 1, stack.a.shape[0]), dtype=stack.a.dtype)
                    for i, n in enumerate(rows):
                        slot = stack.slots.get(n) if n is not None else None
                        if slot is not None:
                            mask[i, 0, slot.start : slot.start + slot.rank] = slot.scale
                    mask = masks[layout] = mask.to(stack.a.device)
                handles.append(stack.linear.register_forward_hook(functools.partial(_add_delta, stack.a, stack.b, mask)))
            if self._peft_lora_b:
                keep: torch.Tensor | None = None
                for lora_b in self._peft_lora_b:
                    w: Any = lora_b.weight
                    if keep is None or keep.device != w.device:
                        keep = torch.tensor([n is None for n in rows], dtype=w.dtype).view(-1, 1, 1).to(w.device)
                    handles.append(lora_b.register_forward_hook(functools.partial(_keep_rows, keep)))
            yield
        finally:
            for h in handles:
                h.remove()


# -- the engine's AdapterEngine methods (`HFEngine.update_adapter` / `remove_adapter`) -----------


async def update_engine_adapter(engine: HFEngine, name: str, weights: WeightSource, version: int,
                                spec: AdapterSpec) -> None:  # fmt: skip
    """Stage and check the tensors off the step (the engine keeps decoding), then install them under
    the step lock between two steps. `finish_old`: the adapter's running rows finish on its old tensors
    first (admission paused meanwhile); `continue_new`: their later tokens carry the new version."""
    async with engine._exclusive_update():
        staged = await asyncio.to_thread(engine._adapters.stage, weights, spec)
        if engine.config.update_mode == "finish_old" and name in engine._adapters.held:
            with engine._cv:
                engine._paused = True
            try:
                while name in engine._adapter_rows:
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(engine.between_steps, _install, engine, name, staged, spec, version)
            finally:
                with engine._cv:
                    engine._paused = False
                    engine._cv.notify()
        else:
            await asyncio.to_thread(engine.between_steps, _install, engine, name, staged, spec, version)


async def remove_engine_adapter(engine: HFEngine, name: str) -> None:
    """Refuse new requests for `name` at once, wait for its queued and running ones, then free it."""
    with engine._cv:  # the lock `_submit` checks adapters under: no request for it is queued after this
        engine._adapters.check(name)
        engine._adapters.held[name].removing = True
    try:
        async with engine._exclusive_update():
            while _in_flight(engine, name):
                await asyncio.sleep(0.005)
            await asyncio.to_thread(engine.between_steps, _drop, engine, name)
    except BaseException:
        if (held := engine._adapters.held.get(name)) is not None:
            held.removing = False
        raise


def _in_flight(engine: HFEngine, name: str) -> bool:
    with engine._cv:
        return name in engine._adapter_rows or any(r.sampling.adapter == name for r in engine._waiting)


def _install(engine: HFEngine, name: str, staged: Mapping[str, torch.Tensor], spec: AdapterSpec, version: int) -> None:
    old = engine._adapters.held.get(name)
    if old is not None:
        engine._prefix.drop_epoch(old.epoch)  # KV computed with its old tensors
    engine._adapters.install(name, staged, spec, version, next(engine._epochs))


def _drop(engine: HFEngine, name: str) -> None:
    engine._prefix.drop_epoch(engine._adapters.remove(name).epoch)

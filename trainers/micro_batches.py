"""From `TrainSample`s to the packed micro-batches one trainer rank runs.

A step's samples become per-sample tensors once (`sample_fields`: loss mask,
behaviour logprobs, versions; the step adds advantages and the auxiliary
passes' values as further fields), then each mini-batch is packed into
micro-batches by token budget (`MicroBatcher.pack`, shared-prefix families
per micro-batch when `trainer.shared_prefix` is on, one over the budget split
into parts: `shared_prefix.split_family`).
`MicroBatcher.forwards` adds loss-free dummy batches where the ranks'
collectives must stay matched (DDP's gradient all-reduce, FSDP's gathers).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from agentrl.trainers.config import TrainerConfig
from agentrl.trainers.distributed import World, matched
from agentrl.trainers.packing import PackedBatch, pack, pack_all
from agentrl.trainers.shared_prefix import Family, find_families, plan_families
from agentrl.types import TrainSample

Fields = Mapping[str, Sequence[torch.Tensor]]
"""Per-sample tensors by name (each aligned with the sample's input ids), as `pack` takes them."""


def sample_fields(samples: Sequence[TrainSample]) -> dict[str, list[torch.Tensor]]:
    """loss_mask / behaviour_logprobs / versions per sample; the first token is never a loss token."""
    masks, behav, versions = [], [], []
    for s in samples:
        n = len(s.input_ids)
        if not (len(s.loss_mask) == len(s.behaviour_logprobs) == len(s.versions) == n):
            raise ValueError(f"trajectory {s.trajectory_id}: per-token lists differ in length")
        m = torch.tensor(s.loss_mask, dtype=torch.float32)
        if n:
            m[0] = 0.0  # nothing precedes it, so it has no logprob to train
        lp = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if not bool(torch.isfinite(lp[m.bool()]).all()):
            raise ValueError(f"trajectory {s.trajectory_id}: non-finite behaviour logprob on a sampled token")
        masks.append(m)
        behav.append(lp * m)
        versions.append(torch.tensor(s.versions, dtype=torch.float32))
    return {"loss_mask": masks, "behaviour_logprobs": behav, "versions": versions}


def mini_batches(n: int, parts: int) -> list[list[int]]:
    """Contiguous, nearly equal mini-batches of sample indices (empty ones dropped)."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(parts) if bounds[k + 1] > bounds[k]]


def mini_batch_counts(masks: Sequence[torch.Tensor], part: Sequence[int]) -> tuple[int, int, dict[int, int]]:
    """(sequences, loss tokens, loss tokens per sample) of a mini-batch, over all ranks' samples."""
    per = {i: int(masks[i].sum()) for i in part}
    return len(part), sum(per.values()), per


def shared_prefix_families(
    groups: Sequence[Sequence[TrainSample]], masks: Sequence[torch.Tensor], min_prefix: int
) -> list[Family]:
    """Each group's samples that share a loss-free prompt prefix (`trainer.shared_prefix`), by flat index."""
    starts = list(itertools.accumulate((len(g) for g in groups), initial=0))
    members = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    ids = [s.input_ids for g in groups for s in g]
    return find_families(members, ids, [m.tolist() for m in masks], min_prefix=min_prefix)


class MicroBatcher:
    """Packs this rank's samples by token budget and keeps the ranks' forward counts matched."""

    def __init__(self, config: TrainerConfig, *, pad_id: int, world: World, fsdp: bool) -> None:
        self.config, self.pad_id, self.world, self.fsdp = config, pad_id, world, fsdp

    def pack(
        self,
        input_ids: Sequence[Sequence[int]],
        fields: Fields,
        subset: Sequence[int],
        families: Sequence[Family] | None = None,
    ) -> list[PackedBatch]:
        """Micro-batches of `subset`; with shared-prefix `families`, families (or their parts) per micro-batch."""
        if not subset:
            return []
        if families is not None:
            return self._pack_families(input_ids, fields, subset, families)
        return pack_all(
            input_ids,
            fields,
            self.config.micro_batch_tokens,
            pad_to_multiple_of=self.config.pad_to_multiple_of,
            pad_id=self.pad_id,
            subset=subset,
        )

    def _pack_families(
        self,
        input_ids: Sequence[Sequence[int]],
        fields: Fields,
        subset: Sequence[int],
        families: Sequence[Family],
    ) -> list[PackedBatch]:
        """Families cut to `subset` (a subset shares at least the family's prefix), members contiguous."""
        chosen = set(subset)
        fams = [Family(kept, f.prefix_len) for f in families if (kept := tuple(m for m in f.members if m in chosen))]
        lengths = [len(x) for x in input_ids]
        batches: list[PackedBatch] = []
        for bin_ in plan_families(fams, lengths, self.config.micro_batch_tokens):
            order = [m for f in bin_ for m in f.members]
            b = pack(input_ids, fields, order, pad_to_multiple_of=self.config.pad_to_multiple_of, pad_id=self.pad_id)
            firsts = itertools.accumulate((len(f.members) for f in bin_), initial=0)
            b.families = tuple((k, len(f.members), f.prefix_len) for k, f in zip(firsts, bin_, strict=False))
            batches.append(b)
        return batches

    def forwards(self, batches: list[PackedBatch], fields: Sequence[str], *, at_least_one: bool) -> list[PackedBatch]:
        """This rank's micro-batches, then loss-free dummies where collectives need them.

        Under FSDP every rank runs as many forwards as the busiest one (each
        gathers parameters from all); with `at_least_one` (a backward follows)
        an idle rank still runs one, for DDP's gradient all-reduce. The real
        batches come first: index >= len(batches) is a dummy.
        """
        if self.fsdp:
            batches = matched(batches, self.world, lambda: self.dummy(fields))
        if at_least_one and not batches:
            batches = [self.dummy(fields)]
        return batches

    def dummy(self, fields: Sequence[str]) -> PackedBatch:
        """A 2-token batch with loss mask 0: keeps DDP's collective calls matched on an idle rank."""
        ids = [[self.pad_id, self.pad_id]]
        return pack(
            ids, {f: [torch.zeros(2)] for f in fields}, [0], pad_to_multiple_of=self.config.pad_to_multiple_of
        )

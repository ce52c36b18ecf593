"""Ring attention: causal attention over a sequence split across a process group.

Every rank of a sequence-parallel (SP) group of size P holds a zigzag shard of a
packed batch: each sequence is padded to a multiple of 2P, cut into 2P equal
chunks, and rank r keeps chunks r and 2P-1-r (in that order). With causal
attention an early chunk is cheap and a late one expensive, so the pair gives
every rank the same amount of work. `ZigzagLayout` owns that bookkeeping.

`ring_attention(q, k, v, cu_seqlens, group=...)` computes exact attention for
the local queries against the keys/values of the whole group: K/V blocks travel
around the ring with point-to-point messages (the send of the next block
overlaps the compute of the current one), block results are merged with the
online-softmax / log-sum-exp rule, and backward sends K/V around once more
together with their dK/dV accumulators, which end up back at their owners.
Memory per rank is O(local tokens): scores are recomputed in backward and only
a `q_chunk` x local-keys tile is materialised at a time.

On CUDA tensors with `ring_flash_attn` installed the same call dispatches to
its `zigzag_ring_flash_attn_varlen_func` (same layout, same arguments);
everywhere else the pure-torch path below runs (gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ZigzagLayout", "flash_backend_available", "reference_attention", "ring_attention"]

Backend = Literal["auto", "torch", "flash"]


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ZigzagLayout:
    """How a packed batch (sequences of `seqlens` tokens) is split over `sp_size` ranks.

    Sequence i is padded at its end to `padded[i]` (a multiple of 2P; no padding
    when P == 1) and cut into 2P chunks of `chunk[i]` tokens. Every rank holds
    `local_len` tokens: for each sequence in order, its chunk r then chunk
    2P-1-r. Padding is a suffix of each sequence, so under causal attention no
    real token ever attends to a pad token.
    """

    seqlens: tuple[int, ...]
    sp_size: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor | Sequence[int], sp_size: int) -> ZigzagLayout:
        cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
        if len(cu) < 2 or cu[0] != 0:
            raise ValueError(f"cu_seqlens must start with 0 and hold at least 2 entries, got {cu[:8]}")
        seqlens = tuple(b - a for a, b in itertools.pairwise(cu))
        if any(n <= 0 for n in seqlens):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {cu[:8]}...")
        if sp_size < 1:
            raise ValueError(f"sp_size must be >= 1, got {sp_size}")
        return cls(seqlens=seqlens, sp_size=sp_size)

    @property
    def total(self) -> int:
        """Real (unpadded) tokens in the packed batch."""
        return sum(self.seqlens)

    @property
    def chunk(self) -> tuple[int, ...]:
        if self.sp_size == 1:
            return self.seqlens
        return tuple(math.ceil(n / (2 * self.sp_size)) for n in self.seqlens)

    @property
    def padded(self) -> tuple[int, ...]:
        if self.sp_size == 1:
            return self.seqlens
        return tuple(c * 2 * self.sp_size for c in self.chunk)

    @property
    def local_len(self) -> int:
        return sum(self.local_seqlens)

    @property
    def local_seqlens(self) -> tuple[int, ...]:
        return self.chunk if self.sp_size == 1 else tuple(2 * c for c in self.chunk)

    def local_cu_seqlens(self, device: torch.device | str = "cpu") -> Tensor:
        """cu_seqlens of one rank's shard (identical on every rank), int32."""
        cu = [0]
        for n in self.local_seqlens:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=device)

    def positions(self, rank: int) -> Tensor:
        """Position inside its (padded) sequence of every token of `rank`'s shard."""
        return self._index(rank)[1]

    def global_index(self, rank: int) -> Tensor:
        """Index into the unpadded packed batch of every token of `rank`'s shard; -1 for padding."""
        return self._index(rank)[0]

    @functools.lru_cache(maxsize=16)  # noqa: B019 - the layout is a small frozen value; callers never mutate
    def _index(self, rank: int) -> tuple[Tensor, Tensor]:
        if not 0 <= rank < self.sp_size:
            raise ValueError(f"rank must be in [0, {self.sp_size}), got {rank}")
        p = self.sp_size
        glob: list[Tensor] = []
        pos: list[Tensor] = []
        start = 0
        for n, c in zip(self.seqlens, self.chunk, strict=True):
            parts = [0] if p == 1 else [rank, 2 * p - 1 - rank]
            for j in parts:
                within = torch.arange(j * c, (j + 1) * c)
                pos.append(within)
                glob.append(torch.where(within < n, within + start, torch.full_like(within, -1)))
            start += n
        return torch.cat(glob), torch.cat(pos)

    def shard(self, x: Tensor, rank: int, fill: float | int = 0) -> Tensor:
        """Take `rank`'s zigzag shard of a per-token tensor `x` (dim 0 = the packed batch)."""
        if x.shape[0] != self.total:
            raise ValueError(f"tensor has {x.shape[0]} tokens along dim 0, layout has {self.total}")
        idx = self.global_index(rank).to(x.device)
        out = x[idx.clamp(min=0)]
        pad = (idx < 0).view(-1, *([1] * (x.dim() - 1)))
        return out.masked_fill(pad, fill)

    def unshard(self, parts: Sequence[Tensor]) -> Tensor:
        """Inverse of `shard`: put every rank's local tensor back in packed order, dropping padding."""
        if len(parts) != self.sp_size:
            raise ValueError(f"expected {self.sp_size} shards, got {len(parts)}")
        stacked = torch.cat(list(parts))
        idx = torch.cat([self.global_index(r) for r in range(self.sp_size)]).to(stacked.device)
        keep = idx >= 0
        out = stacked.new_empty((self.total, *stacked.shape[1:]))
        out[idx[keep]] = stacked[keep]
        return out


# --------------------------------------------------------------------------- block kernels


@dataclass(frozen=True)
class _Side:
    """Tokens of one side (queries or keys) of a block: contiguous per sequence, in sequence order."""

    cu: list[int]
    seq_id: Tensor  # (L,) sequence number of every token

    @classmethod
    def from_lens(cls, lens: Sequence[int], device: torch.device) -> _Side:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        seq_id = torch.repeat_interleave(
            torch.arange(len(lens), device=device), torch.tensor(list(lens), device=device)
        )
        return cls(cu=cu, seq_id=seq_id)


def _tiles(qs: _Side, ks: _Side, causal: bool, q_chunk: int) -> list[tuple[int, int, int, int]]:
    """Query row ranges [a, b) with the key range [ka, kb) they can see (same sequences, causal cap)."""
    total = qs.cu[-1]
    tiles = []
    for a in range(0, total, q_chunk):
        b = min(a + q_chunk, total)
        s0 = int(qs.seq_id[a])
        s1 = int(qs.seq_id[b - 1])
        ka, kb = ks.cu[s0], ks.cu[s1 + 1]
        if causal:
            kb = min(kb, b)
        tiles.append((a, b, ka, kb))
    return tiles


def _tile_mask(qs: _Side, ks: _Side, a: int, b: int, ka: int, kb: int, causal: bool) -> Tensor:
    mask = qs.seq_id[a:b, None] == ks.seq_id[None, ka:kb]
    if causal:
        qi = torch.arange(a, b, device=mask.device)
        ki = torch.arange(ka, kb, device=mask.device)
        mask &= ki[None, :] <= qi[:, None]
    return mask


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, qs: _Side, ks: _Side, causal: bool, scale: float, q_chunk: int
) -> tuple[Tensor, Tensor]:
    """Masked attention of q (H, Lq, D) over k/v (Hkv, Lk, D), fp32. Returns out (H, Lq, D), lse (H, Lq)."""
    h, lq, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    out = q.new_zeros(h, lq, d)
    lse = q.new_full((h, lq), -math.inf)
    for a, b, ka, kb in _tiles(qs, ks, causal, q_chunk):
        if kb <= ka:
            continue
        qt = q[:, a:b].view(hkv, g, b - a, d)
        s = torch.matmul(qt, k[:, None, ka:kb].transpose(-1, -2)) * scale  # (Hkv, G, Lt, Lk)
        s.masked_fill_(~_tile_mask(qs, ks, a, b, ka, kb, causal), -math.inf)
        tile_lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(tile_lse), torch.zeros_like(tile_lse), tile_lse)
        s.sub_(safe[..., None]).exp_()
        out[:, a:b] = torch.matmul(s, v[:, None, ka:kb]).view(h, b - a, d)
        lse[:, a:b] = tile_lse.view(h, b - a)
    return out, lse


def _block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    dout: Tensor,
    delta: Tensor,
    qs: _Side,
    ks: _Side,
    causal: bool,
    scale: float,
    q_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the FINAL (merged) lse and delta = rowsum(dout * out)."""
    h, _, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for a, b, ka, kb in _tiles(qs, ks, causal, q_chunk):
        if kb <= ka:
            continue
        n = b - a
        qt = q[:, a:b].view(hkv, g, n, d)
        kt, vt = k[:, None, ka:kb], v[:, None, ka:kb]
        s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
        s.masked_fill_(~_tile_mask(qs, ks, a, b, ka, kb, causal), -math.inf)
        row_lse = lse[:, a:b].view(hkv, g, n, 1)
        p = s.sub_(torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)).exp_()
        dot = dout[:, a:b].view(hkv, g, n, d)
        dv[:, ka:kb] += torch.matmul(p.transpose(-1, -2), dot).sum(1)
        dp = torch.matmul(dot, vt.transpose(-1, -2))
        ds = p.mul_(dp.sub_(delta[:, a:b].view(hkv, g, n, 1))).mul_(scale)
        dq[:, a:b] = torch.matmul(ds, kt).view(h, n, d)
        dk[:, ka:kb] += torch.matmul(ds.transpose(-1, -2), qt).sum(1)
    return dq, dk, dv


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, rows: Tensor | None) -> None:
    """Online-softmax merge of a block result into the running (out, lse), in place, optionally on `rows`."""
    old_out = out if rows is None else out[:, rows]
    old_lse = lse if rows is None else lse[:, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    merged = (
        old_out * torch.exp(old_lse - safe)[..., None] + block_out * torch.exp(block_lse - safe)[..., None]
    )
    if rows is None:
        out.copy_(merged)
        lse.copy_(new_lse)
    else:
        out[:, rows] = merged
        lse[:, rows] = new_lse


# --------------------------------------------------------------------------- ring communication


class _Ring:
    """Point-to-point exchange with the next/previous rank of a group (send to r+1, receive from r-1)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if group is not None:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor: Tensor) -> tuple[Tensor, list[Any]]:
        """Begin sending `tensor` forward and receiving the previous rank's; returns (buffer, requests)."""
        buf = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, buf, self.prev, self.group),
        ]
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(reqs: list[Any]) -> None:
        for req in reqs:
            req.wait()


# --------------------------------------------------------------------------- autograd function


@dataclass(frozen=True)
class _Plan:
    """Index sets for the three kinds of ring step (own block, earlier rank, later rank)."""

    full: _Side
    half: _Side
    first: Tensor  # local rows holding chunk r of every sequence
    second: Tensor  # local rows holding chunk 2P-1-r of every sequence

    @classmethod
    def build(cls, cu_seqlens: Tensor, size: int, device: torch.device) -> _Plan:
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        full = _Side.from_lens(lens, device)
        if size == 1:
            empty = torch.empty(0, dtype=torch.long, device=device)
            return cls(full=full, half=full, first=empty, second=empty)
        if any(n % 2 for n in lens):
            raise ValueError(
                f"with sp_size {size} every local sequence length must be even (zigzag), got {lens}"
            )
        first, second = [], []
        for start, n in zip(full.cu[:-1], lens, strict=True):
            first.append(torch.arange(start, start + n // 2, device=device))
            second.append(torch.arange(start + n // 2, start + n, device=device))
        half = _Side.from_lens([n // 2 for n in lens], device)
        return cls(full=full, half=half, first=torch.cat(first), second=torch.cat(second))


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(0, 1).to(torch.float32).contiguous()


def _ring_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    group: dist.ProcessGroup | None,
    scale: float,
    q_chunk: int,
) -> tuple[Tensor, Tensor]:
    """Forward ring: returns the output (L, H, D) in q's dtype and the fp32 log-sum-exp (H, L)."""
    ring = _Ring(group)
    plan = _Plan.build(cu_seqlens, ring.size, q.device)
    qf = _heads_first(q)
    kv = torch.stack([k.transpose(0, 1), v.transpose(0, 1)]).contiguous()  # travels in the input dtype
    out = lse = None
    for step in range(ring.size):
        pending = ring.start(kv) if step + 1 < ring.size else None
        src = (ring.rank - step) % ring.size
        kf, vf = kv[0].float(), kv[1].float()
        if step == 0:
            out, lse = _block_forward(qf, kf, vf, plan.full, plan.full, True, scale, q_chunk)
        elif src < ring.rank:  # their chunk src precedes both of ours: all queries, their first halves
            o, s = _block_forward(
                qf, kf[:, plan.first], vf[:, plan.first], plan.full, plan.half, False, scale, q_chunk
            )
            _merge(out, lse, o, s, None)  # type: ignore[arg-type]
        else:  # both their chunks precede our second chunk only
            o, s = _block_forward(qf[:, plan.second], kf, vf, plan.half, plan.full, False, scale, q_chunk)
            _merge(out, lse, o, s, plan.second)  # type: ignore[arg-type]
        if pending is not None:
            kv, reqs = pending
            ring.wait(reqs)
    assert out is not None and lse is not None
    return out.transpose(0, 1).to(q.dtype), lse


def _ring_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    group: dist.ProcessGroup | None,
    scale: float,
    q_chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward ring: K/V go around again with their dK/dV accumulators, which end at their owners."""
    ring = _Ring(group)
    plan = _Plan.build(cu_seqlens, ring.size, q.device)
    qf, dof = _heads_first(q), _heads_first(grad_out)
    delta = (dof * _heads_first(out)).sum(-1)  # (H, L)
    kv = torch.stack([k.transpose(0, 1), v.transpose(0, 1)]).contiguous()
    dq = torch.zeros_like(qf)
    dkv: Tensor | None = None
    dkv_pending: tuple[Tensor, list[Any]] | None = None
    for step in range(ring.size):
        kv_pending = ring.start(kv) if step + 1 < ring.size else None
        src = (ring.rank - step) % ring.size
        kf, vf = kv[0].float(), kv[1].float()
        part = torch.zeros(2, *kf.shape, dtype=torch.float32, device=q.device)
        if step == 0:
            dq_b, dk_b, dv_b = _block_backward(
                qf, kf, vf, lse, dof, delta, plan.full, plan.full, True, scale, q_chunk
            )
            dq += dq_b
            part[0], part[1] = dk_b, dv_b
        elif src < ring.rank:
            f = plan.first
            dq_b, dk_b, dv_b = _block_backward(
                qf, kf[:, f], vf[:, f], lse, dof, delta, plan.full, plan.half, False, scale, q_chunk
            )
            dq += dq_b
            part[0][:, f], part[1][:, f] = dk_b, dv_b
        else:
            sec = plan.second
            dq_b, dk_b, dv_b = _block_backward(
                qf[:, sec], kf, vf, lse[:, sec], dof[:, sec], delta[:, sec],
                plan.half, plan.full, False, scale, q_chunk,
            )  # fmt: skip
            dq[:, sec] += dq_b
            part[0], part[1] = dk_b, dv_b
        # The accumulator for the block we just processed arrives from the previous rank.
        if dkv_pending is not None:
            acc, reqs = dkv_pending
            ring.wait(reqs)
            part += acc
        dkv = part
        if ring.size > 1:  # pass it on; after the last step it lands on the block's owner
            dkv_pending = ring.start(dkv)
        if kv_pending is not None:
            kv, reqs = kv_pending
            ring.wait(reqs)
    if dkv_pending is not None:
        dkv, reqs = dkv_pending
        ring.wait(reqs)
    assert dkv is not None
    return (
        dq.transpose(0, 1).to(q.dtype),
        dkv[0].transpose(0, 1).to(k.dtype),
        dkv[1].transpose(0, 1).to(v.dtype),
    )


class _RingAttention(torch.autograd.Function):
    """Autograd wrapper; autocast is switched off inside so blocks and merges stay in fp32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens: Tensor,
        group: dist.ProcessGroup | None,
        scale: float,
        q_chunk: int,
    ) -> Tensor:
        with torch.autocast(q.device.type, enabled=False):
            out, lse = _ring_forward(q, k, v, cu_seqlens, group, scale, q_chunk)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.group, ctx.scale, ctx.q_chunk = group, scale, q_chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(
                grad_out, q, k, v, out, lse, cu_seqlens, ctx.group, ctx.scale, ctx.q_chunk
            )
        return dq, dk, dv, None, None, None, None


# --------------------------------------------------------------------------- public API


def flash_backend_available() -> bool:
    """True when `ring_flash_attn` (and therefore flash-attn) can be imported."""
    return importlib.util.find_spec("ring_flash_attn") is not None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    causal: bool = True,
    backend: Backend = "auto",
    q_chunk: int = 1024,
) -> Tensor:
    """Causal attention of this rank's zigzag shard against the whole SP group.

    Args:
        q: (L, H, D) local queries; k, v: (L, Hkv, D) local keys/values (H % Hkv == 0, GQA allowed).
        cu_seqlens: LOCAL cu_seqlens of the shard (`ZigzagLayout.local_cu_seqlens()`); with a group of
            size P > 1 every local sequence holds its two zigzag chunks, so every length is even.
        group: the SP process group; None (or size 1) means plain single-process attention.
        scale: softmax scale, default 1/sqrt(D).
        backend: "auto" uses ring-flash-attn for fp16/bf16 CUDA tensors when it is installed and the
            pure-torch ring otherwise; "torch" / "flash" force one.
        q_chunk: query rows per score tile of the torch path (bounds its transient memory).

    Returns (L, H, D) in q's dtype. Differentiable in q, k and v. All ranks of `group` must call
    it together (forward and backward).
    """
    if not causal:
        raise ValueError("ring_attention supports causal=True only (decoder LMs)")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"expected q (L,H,D), k/v (L,Hkv,D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if int(cu_seqlens[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but q holds {q.shape[0]} tokens")
    if q_chunk < 1:
        raise ValueError(f"q_chunk must be >= 1, got {q_chunk}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    half = q.dtype in (torch.float16, torch.bfloat16)  # flash kernels take 16-bit inputs only
    use_flash = backend == "flash" or (backend == "auto" and q.is_cuda and half and flash_backend_available())
    if backend not in ("auto", "torch", "flash"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'flash', got {backend!r}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    if use_flash:
        return _flash_ring_attention(q, k, v, cu_seqlens, group, scale)
    out: Tensor = _RingAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, cu_seqlens.to(torch.long), group, scale, q_chunk
    )
    return out


def _flash_ring_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, group: dist.ProcessGroup | None, scale: float
) -> Tensor:
    """ring-flash-attn's zigzag varlen ring (same layout); plain flash-attn varlen without a group."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    try:
        if group is None:
            from flash_attn import flash_attn_varlen_func

            single: Tensor = flash_attn_varlen_func(
                q, k, v, cu, cu, max_len, max_len, dropout_p=0.0, softmax_scale=scale, causal=True
            )
            return single
        from ring_flash_attn import zigzag_ring_flash_attn_varlen_func
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "backend='flash' needs the ring-flash-attn package (and flash-attn) on CUDA"
        ) from exc
    out: Tensor = zigzag_ring_flash_attn_varlen_func(
        q, k, v, cu, max_len, dropout_p=0.0, softmax_scale=scale, causal=True, group=group
    )
    return out


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float | None = None
) -> Tensor:
    """Plain causal attention over a whole packed batch (L, H, D) with a block-diagonal mask. For tests."""
    n, h, d = q.shape
    g = h // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    idx = torch.arange(n)
    mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    kk = k.repeat_interleave(g, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(q.transpose(0, 1), kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), vv).transpose(0, 1)

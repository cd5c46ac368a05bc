"""Ring attention: exact causal attention over a sequence split zig-zag over the cp ranks.

Each rank holds the queries, keys and values of its two chunks (`zigzag`), q [B, H, 2L, D] and
k, v [B, Hk, 2L, D] (Hk divides H: grouped-query attention). Over cp steps every rank's keys and
values travel once around the ring; at each step a rank attends its queries to the block it
holds while the next block is on its way (`comm.ring_pass`, waited on only after the compute).
Chunk pairs are whole: key chunk b is invisible to query chunk a when b > a, causal when
b = a, fully visible when b < a, so no mask beyond the diagonal block's is ever built.

The partial results of the blocks are merged exactly by their log-sum-exp:

    lse = logaddexp(lse₁, lse₂);   out = out₁·exp(lse₁ − lse) + out₂·exp(lse₂ − lse)

Backward runs the ring again with the final (out, lse): for each block the probabilities are
exp(s − lse), so dq accumulates locally, and each block's dk, dv accumulate into a buffer that
travels with the block and reaches its owner after the last step. Written here because torch
has no ring attention for gloo and the CPU (`torch.distributed.tensor.experimental.
context_parallel` needs CUDA's SDPA kernels and DTensor-sharded buffers).

Each chunk pair runs through a fused attention kernel of torch's that returns the log-sum-exp
and takes the final (out, lse) in its backward, so no [L, L] score matrix is ever held: on the
CPU the flash kernel, in float32; on CUDA the memory-efficient kernel (any head width, float32
or the inputs' bf16 / fp16), its partial outputs merged in float32 all the same. Elsewhere the
plain softmax (`pair_forward`, `pair_backward`) holds one pair's scores at a time.
"""

from __future__ import annotations

import math

import torch

from interlace import comm
from interlace.comm import Group
from interlace.parallel.context.zigzag import zigzag_chunks

_KV_TAG, _GRAD_TAG = 1, 2


def visibility(query_chunk: int, key_chunk: int) -> str:
    """How query chunk a sees key chunk b under causal attention: "none", "causal", "full"."""
    if key_chunk > query_chunk:
        return "none"
    return "causal" if key_chunk == query_chunk else "full"


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hk, L, D] → [B, H, L, D], each key/value head repeated for its H / Hk query heads."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1) if kv.shape[1] != heads else kv


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, L, D] → [B, Hk, L, D]: the gradient of `_expand`, summed over each head's group."""
    B, H, L, D = grad.shape
    return grad.view(B, kv_heads, H // kv_heads, L, D).sum(2) if kv_heads != H else grad


def _scores(q: torch.Tensor, k: torch.Tensor, how: str, scale: float) -> torch.Tensor:
    """Scaled scores [B, H, L, L] in float32, the diagonal block's future masked to −inf."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if how == "causal":
        length = s.shape[-1]
        future = torch.ones(length, length, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def pair_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, how: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query chunk q [B, H, L, D] to one key/value chunk k, v [B, H, L, D] seen as
    `how` ("causal" or "full"): (out [B, H, L, D] float32, lse [B, H, L] float32)."""
    s = _scores(q, k, how, scale)
    lse = s.logsumexp(-1)
    return (s - lse.unsqueeze(-1)).exp() @ v.float(), lse


def pair_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    how: str,
    scale: float,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) [B, H, L, D] float32 of one chunk pair, from the query chunk's final
    log-sum-exp `lse` [B, H, L], its output gradient `dout` and delta = Σ_d dout·out [B, H, L]."""
    p = (_scores(q, k, how, scale) - lse.unsqueeze(-1)).exp()
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.float().transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, dv


def _cpu_pair_forward(q, k, v, how: str, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float(), k.float(), v.float(), 0.0, how == "causal", scale=scale
    )


def _cpu_pair_backward(q, k, v, how: str, scale: float, lse, dout, delta, out):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q.float(), k.float(), v.float(), out, lse, 0.0, how == "causal", scale=scale
    )


def _cuda_pair_forward(q, k, v, how: str, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, how == "causal", scale=scale
    )
    return out.float(), lse[..., : q.shape[2]].float()


def _cuda_pair_backward(q, k, v, how: str, scale: float, lse, dout, delta, out):
    seed = q.new_empty(0, dtype=torch.int64)  # the kernel's random state: unused without dropout
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype),
        q,
        k,
        v,
        None,
        out.to(q.dtype),
        lse.contiguous(),
        seed,
        seed,
        0.0,
        [True, True, True, False],
        how == "causal",
        scale=scale,
    )
    return tuple(g.float() for g in grads[:3])


def _math_pair_backward(q, k, v, how: str, scale: float, lse, dout, delta, out):
    return pair_backward(q, k, v, how, scale, lse, dout, delta)


def pair_kernels(device: torch.device) -> tuple:
    """(forward, backward) of one chunk pair on `device`: torch's fused flash kernels on the
    CPU, its memory-efficient kernels on CUDA, `pair_forward` and `pair_backward` elsewhere.
    The forward gives (out [B, H, L, D], lse [B, H, L]) in float32; the backward also takes
    the query chunk's final output and gives float32 (dq, dk, dv)."""
    if device.type == "cpu":
        return _cpu_pair_forward, _cpu_pair_backward
    if device.type == "cuda":
        return _cuda_pair_forward, _cuda_pair_backward
    return pair_forward, _math_pair_backward


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the attention `part` [B, H, L, D] over some keys (log-sum-exp `part_lse` [B, H, L])
    into `out` over others (None: nothing yet): the attention over both, exactly."""
    if out is None:
        return part, part_lse
    total = torch.logaddexp(lse, part_lse)
    merged = out * (lse - total).exp().unsqueeze(-1) + part * (part_lse - total).exp().unsqueeze(-1)
    return merged, total


def _pairs(group: Group, step: int) -> list[tuple[int, int, str]]:
    """(query half, key half, visibility) of every chunk pair to compute at `step`, when this
    rank holds the block of rank (index − step) mod cp; halves are 0 and 1 of each side."""
    cp = group.size
    mine = zigzag_chunks(cp, group.rank)
    theirs = zigzag_chunks(cp, (group.rank - step) % cp)
    pairs = []
    for qi, a in enumerate(mine):
        for ki, b in enumerate(theirs):
            how = visibility(a, b)
            if how != "none":
                pairs.append((qi, ki, how))
    return pairs


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's zig-zag queries to the whole sequence's keys and values
    (module docstring); q [B, H, 2L, D], k, v [B, Hk, 2L, D] → [B, H, 2L, D] in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, group: Group):
        with torch.autocast(q.device.type, enabled=False):  # the block math is float32
            return RingAttention._forward(ctx, q, k, v, group)

    @staticmethod
    def _forward(ctx, q, k, v, group: Group):
        scale = 1.0 / math.sqrt(q.shape[-1])
        heads = q.shape[1]
        forward, _ = pair_kernels(q.device)
        q_halves = q.chunk(2, dim=2)
        outs: list[torch.Tensor | None] = [None, None]
        lses: list[torch.Tensor | None] = [None, None]
        block = torch.stack([k, v])  # travels whole: [2, B, Hk, 2L, D]
        for step in range(group.size):
            incoming = None
            if step < group.size - 1:
                incoming, works = comm.ring_pass(block, group, _KV_TAG)
            k_halves = _expand(block[0], heads).chunk(2, dim=2)
            v_halves = _expand(block[1], heads).chunk(2, dim=2)
            for qi, ki, how in _pairs(group, step):
                part, part_lse = forward(q_halves[qi], k_halves[ki], v_halves[ki], how, scale)
                outs[qi], lses[qi] = merge(outs[qi], lses[qi], part, part_lse)
            if incoming is not None:
                for work in works:
                    work.wait()
                block = incoming
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, heads = ctx.group, ctx.scale, q.shape[1]
        _, backward = pair_kernels(q.device)
        dout = dout.float()
        delta = (dout * out).sum(-1)
        q_halves, dout_halves, out_halves = q.chunk(2, dim=2), dout.chunk(2, dim=2), out.chunk(2, 2)
        lse_halves, delta_halves = lse.chunk(2, dim=2), delta.chunk(2, dim=2)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dq_halves = dq.chunk(2, dim=2)
        block = torch.stack([k, v])
        grads = torch.zeros_like(block, dtype=torch.float32)  # this block's dk, dv so far
        pending = None  # the gradient buffer on its way here, with its works
        for step in range(group.size):
            incoming = None
            if step < group.size - 1:
                incoming, works = comm.ring_pass(block, group, _KV_TAG)
            k_full, v_full = _expand(block[0], heads), _expand(block[1], heads)
            dk_full = torch.zeros_like(k_full, dtype=torch.float32)
            dv_full = torch.zeros_like(v_full, dtype=torch.float32)
            k_halves, v_halves = k_full.chunk(2, dim=2), v_full.chunk(2, dim=2)
            dk_halves, dv_halves = dk_full.chunk(2, dim=2), dv_full.chunk(2, dim=2)
            for qi, ki, how in _pairs(group, step):
                dq_part, dk_part, dv_part = backward(
                    q_halves[qi],
                    k_halves[ki],
                    v_halves[ki],
                    how,
                    scale,
                    lse_halves[qi],
                    dout_halves[qi],
                    delta_halves[qi],
                    out_halves[qi],
                )
                dq_halves[qi].add_(dq_part)
                dk_halves[ki].add_(dk_part)
                dv_halves[ki].add_(dv_part)
            if pending is not None:
                grads, grad_works = pending
                for work in grad_works:
                    work.wait()
            grads[0].add_(_fold(dk_full, k.shape[1]))
            grads[1].add_(_fold(dv_full, v.shape[1]))
            pending = comm.ring_pass(grads, group, _GRAD_TAG)  # on to the block's next holder
            if incoming is not None:
                for work in works:
                    work.wait()
                block = incoming
        grads, grad_works = pending
        for work in grad_works:
            work.wait()
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group) -> torch.Tensor:
    """Exact causal attention of this rank's zig-zag share of a sequence split over `group`:
    q [B, H, 2L, D], k, v [B, Hk, 2L, D] (this rank's chunks, `zigzag.shard_sequence`) →
    [B, H, 2L, D]. One rank: plain causal attention."""
    if group.size == 1:
        return torch.nn.functional.scaled_dot_product_attention(
            q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), is_causal=True
        )
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs two equal chunks per rank, got {q.shape[2]} tokens")
    return RingAttention.apply(q, k, v, group)

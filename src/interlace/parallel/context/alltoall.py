"""All-to-all context parallelism (`cp_mode=alltoall`, DeepSpeed-Ulysses' scheme): heads ↔
sequence.

Each rank holds q, k, v of its zig-zag share of the sequence for every head. One all-to-all
over the cp group hands rank j the whole sequence of head group j (H / cp heads): attention is
then plain causal attention over the whole sequence, and a second all-to-all hands every rank
its share back for every head. Per attention and rank that moves q, k, v and the output once
each way, (cp − 1)/cp of them; unlike the ring it needs cp to divide the heads (the key/value
heads too), and it holds a whole sequence of H / cp heads at once.

`heads_to_sequence` is its own adjoint with equal splits (block j of rank i goes to block i of
rank j), so the backward of each exchange is the other exchange of the gradient; written as a
small autograd function over `comm.all_to_all` so that the meter counts every byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from interlace import comm
from interlace.comm import Group
from interlace.parallel.context.zigzag import zigzag_positions


def _exchange(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Block j of x [cp, ...] to rank j; block i of the result [cp, ...] came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x: all-to-all splits the memory along dim 0
    comm.all_to_all(out, x, group)
    return out


class _Exchange(torch.autograd.Function):
    """`_exchange` with its gradient exchanged back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _global_order(length: int, group: Group, device: torch.device) -> torch.Tensor:
    """[T] global position of each token of the ranks' shares laid end to end in rank order."""
    return torch.cat([zigzag_positions(length, group.size, r, device) for r in range(group.size)])


def heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's share of every head, x [B, H, T/cp, hd] → the whole sequence, in global
    order, of head group `group.rank`: [B, H/cp, T, hd]."""
    B, H, share, hd = x.shape
    cp = group.size
    blocks = x.view(B, cp, H // cp, share, hd).transpose(0, 1)  # [cp, B, H/cp, T/cp, hd]
    received = _Exchange.apply(blocks, group)  # block r: rank r's share
    joined = received.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * share, hd)
    order = _global_order(cp * share, group, x.device)
    return joined.index_select(2, order.argsort())


def sequence_to_heads(y: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of `heads_to_sequence`: [B, H/cp, T, hd] → [B, H, T/cp, hd]."""
    B, heads, length, hd = y.shape
    cp = group.size
    joined = y.index_select(2, _global_order(length, group, y.device))
    blocks = joined.view(B, heads, cp, length // cp, hd).permute(2, 0, 1, 3, 4)
    received = _Exchange.apply(blocks, group)  # block r: head group r of my share
    return received.transpose(0, 1).reshape(B, cp * heads, length // cp, hd)


def alltoall_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group
) -> torch.Tensor:
    """Exact causal attention of this rank's zig-zag share by heads ↔ sequence exchanges:
    q [B, H, T/cp, hd], k, v [B, Hk, T/cp, hd] with cp dividing H and Hk → [B, H, T/cp, hd]."""
    for name, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
        if heads % group.size:
            raise ValueError(
                f"cp_mode=alltoall splits the {heads} {name} heads over cp={group.size} ranks; "
                "use cp dividing them, or cp_mode=ring"
            )
    q, k, v = (heads_to_sequence(t, group) for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    return sequence_to_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True), group)

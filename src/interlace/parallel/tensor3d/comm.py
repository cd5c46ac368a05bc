"""The communication of 3D tensor parallelism (AxoNN-style), as autograd functions.

A 3D grid of x·y·z ranks, groups "tp_x", "tp_y", "tp_z". A 3D linear layer splits its input
features over one of the X / Y groups (its `in_group`) and its output features over the other
(`out_group`); each rank's [out/|out_group|, in/|in_group|] block is cut again over Z by rows
(the row-major flattened block cut into z contiguous pieces). Its function:

    forward   W = all-gather over Z;  O = all-reduce over in_group of (X_local · Wᵀ)
    backward  W = all-gather over Z again (not cached: the formula's two all-gathers);
              dX = dO · W, all-reduce over out_group, issued async and waited after the dW matmul;
              dW = dOᵀ · X (through `block_grad_hook` if given: a kv head's block summed over
              the Y ranks holding it), reduce-scatter over Z, issued async: the gradient is
              added to the weight's `.grad` by a callback queued to run when the whole backward
              pass ends (`torch.autograd`'s `queue_callback`), so it never blocks the next
              layer's backward. Under FSDP2 (`z_grad_in_backward`), which reduces what
              autograd accumulates when a block's backward ends, the reduce-scatter is waited
              on and its result returned to autograd as the weight's gradient instead.

The other conjugate pairs of the layout:

    split_last_dim    forward: this rank's slice of the last dim   backward: all-gather
    mean_over         forward: all-reduce / p                       backward: gradient / p

Under overlapped sub-batches (`tp_subbatches`, `parallel.tensor.overlap`) the output's
all-reduce and the input gradient's are the hand-over points: issued async, the turn passes to
the other sub-batches, then the result is waited on (`tensor.reduction`).

(`gather_last_dim` of `parallel.tensor.comm` is the inverse of `split_last_dim`.) Every
collective passes the comm meter (`interlace.comm`); a group of one rank issues none.

Each all-gather of W is synchronous here, unless the layer passes its own `gather`: a
`prefetch.WeightPrefetcher` then hands over a block it all-gathered asynchronously one
layer ahead, and `start_gather` is the async all-gather it issues.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._python_dispatch import _disable_current_modes

from interlace import comm
from interlace.comm import Group
from interlace.matmul import PLAIN, Matmul
from interlace.parallel.tensor.comm import gather_last_dim
from interlace.parallel.tensor.reduction import hand_over, yielding_reduce
from interlace.precision import autocast_in_force, compute_dtype

ALONE = Group("alone", None, 1, 0)  # type: ignore[arg-type]
"""A group of one rank, which issues no collective: a 3D linear takes it in place of a group
whose sum sequence parallelism does elsewhere (the block entry's reduce-scatter of the input
gradient; the transposed layer's reduce-scatter of its output)."""


def _reduce_scattered(
    grad: torch.Tensor, param: torch.Tensor, z: Group, async_op: bool = False
) -> tuple[torch.Tensor, dist.Work | None]:
    """A full block gradient `grad` [rows, cols] summed over Z: this rank's piece [rows/z,
    cols] in `param`'s dtype (valid once the returned work, if `async_op`, is waited on)."""
    shard = torch.empty_like(param)
    work = comm.reduce_scatter(shard, grad.to(param.dtype).contiguous(), z, async_op=async_op)
    return shard, work


def _reduce_scatter_weight_grad(grad: torch.Tensor, param: torch.nn.Parameter, z: Group) -> None:
    """Start the async reduce-scatter of a full block gradient `grad` [rows, cols] over Z into
    the gradient of `param` [rows/z, cols], added to it when this backward pass ends."""
    shard, work = _reduce_scattered(grad, param, z, async_op=True)
    assert work is not None
    finish = functools.partial(_add_reduced_gradient, work, shard, param)
    torch.autograd.Variable._execution_engine.queue_callback(finish)


def weight_grad_over_z(
    grad: torch.Tensor,
    weight: torch.nn.Parameter,
    z: Group,
    block_grad_hook: Callable[[torch.Tensor], torch.Tensor] | None,
    in_backward: bool,
) -> torch.Tensor | None:
    """The gradient of a whole block `grad` [rows, cols] (through `block_grad_hook` first, if
    given) → what autograd receives for `weight`, this rank's piece [rows/z, cols]: with z = 1
    the block's gradient itself; else its reduce-scatter over Z, returned when `in_backward`
    (FSDP2), otherwise added to `weight.grad` when the backward pass ends (None returned)."""
    if block_grad_hook is not None:
        grad = block_grad_hook(grad)
    if z.size == 1:
        return grad
    if in_backward:
        return _reduce_scattered(grad, weight, z)[0]
    _reduce_scatter_weight_grad(grad, weight, z)
    return None


def _add_reduced_gradient(work: dist.Work, shard: torch.Tensor, param: torch.nn.Parameter) -> None:
    """Wait for a Z reduce-scatter and add its result `shard` to `param`'s `.grad`."""
    work.wait()
    param.grad = shard if param.grad is None else param.grad.add_(shard)


def _gathered(shard: torch.Tensor, z: Group, async_op: bool):
    """All-gather over Z of a weight piece [rows, cols] into a block [z·rows, cols], in the
    dtype the matmul computes in (under bf16 autocast the wire carries bf16). Its ops run
    outside the dispatch modes (torch's private `_disable_current_modes`, as no public call
    does it): selective recomputation's cache (torch's selective checkpoint policy) numbers
    every op of a checkpointed block and needs the same ones in its recomputation, while the
    weight prefetch gathers a layer's block during another layer, in the forward and not in
    the recomputation."""
    with _disable_current_modes():
        piece = shard.detach().to(compute_dtype(shard)).contiguous()
        block = piece.new_empty((z.size * piece.shape[0], piece.shape[1]))
        return block, comm.all_gather(block, piece, z, async_op=async_op)


def start_gather(shard: torch.Tensor, z: Group) -> tuple[torch.Tensor, dist.Work]:
    """Issue the async all-gather over Z (z.size > 1) of this rank's piece [rows/z, cols] of a
    weight block: (the block [rows, cols], valid once the returned work is waited on)."""
    block, work = _gathered(shard, z, async_op=True)
    assert work is not None
    return block, work


def gather_weight(shard: torch.Tensor, z: Group) -> torch.Tensor:
    """This rank's Z piece [rows/z, cols] of a weight block → the block [rows, cols]."""
    if z.size == 1:
        return shard
    return _gathered(shard, z, async_op=False)[0]


def summed(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Σ of x over `group`, a new tensor (x itself for one rank); not differentiable: the
    callers' backward passes reduce their gradients themselves."""
    if group.size == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def accumulates(weight_edge: GradientEdge | None) -> bool:
    """Whether the running backward accumulates the weight's gradient (None: returned to
    autograd, which decides). Not when it computes only other inputs' gradients, as
    `torch.autograd.grad` over a pipeline stage's inputs does when torch's pipelining infers
    gradient shapes: the Z reduce-scatter adds to `.grad` itself, so it must ask the engine
    (`torch._C._will_engine_execute_node`, which torch's own multi-grad hooks ask too)."""
    return weight_edge is None or torch._C._will_engine_execute_node(weight_edge.node)


class _Linear3D(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, in_group, out_group, z, block_grad_hook, gather, matmul, z_in_backward
    ):
        ctx.save_for_backward(x)
        ctx.z_in_backward = z_in_backward
        # the parameter itself, not a saved tensor: activation checkpointing hands back saved
        # tensors detached, and the Z reduce-scatter adds dW to this parameter's `.grad`
        ctx.weight = weight
        ctx.weight_edge = get_gradient_edge(weight) if weight.requires_grad and z.size > 1 else None
        ctx.groups = (in_group, out_group, z)
        ctx.block_grad_hook = block_grad_hook
        ctx.gather = gather
        ctx.matmul = matmul
        ctx.autocast = autocast_in_force(x.device.type)
        block = gather_weight(weight, z) if gather is None else gather()
        out = matmul.output(x, block)
        return out if in_group.size == 1 else yielding_reduce(out, in_group)

    @staticmethod
    def backward(ctx, grad_out):
        with ctx.autocast:  # the forward's precision
            return _Linear3D.backward_in_precision(ctx, grad_out)

    @staticmethod
    def backward_in_precision(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        _, out_group, z = ctx.groups
        block = gather_weight(weight, z) if ctx.gather is None else ctx.gather()
        grad_x = ctx.matmul.input_grad(grad_out, block)
        work = None
        if out_group.size > 1:
            work = comm.all_reduce(grad_x, out_group, async_op=True)
        grad_w = None
        if weight.requires_grad and accumulates(ctx.weight_edge):  # overlaps the dX all-reduce
            grad_w = ctx.matmul.weight_grad(grad_out, x)
            grad_w = weight_grad_over_z(grad_w, weight, z, ctx.block_grad_hook, ctx.z_in_backward)
        if work is not None:
            hand_over()  # other sub-batches compute while it flies (`tp_subbatches`)
            work.wait()
        return grad_x, grad_w, None, None, None, None, None, None, None


def linear3d(
    x: torch.Tensor,
    weight: torch.nn.Parameter,
    in_group: Group,
    out_group: Group,
    z: Group,
    block_grad_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gather: Callable[[], torch.Tensor] | None = None,
    matmul: Matmul = PLAIN,
    z_grad_in_backward: bool = False,
) -> torch.Tensor:
    """x [..., in/|in_group|] (this rank's input features and tokens) and this rank's weight
        piece [out/(|out_group|·z), in/|in_group|] → O [..., out/|out_group|], summed over
        `in_group` (no bias). `block_grad_hook` maps the gradient of the whole block
        [out/|out_group|, in/|in_group|] before its Z reduce-scatter. `gather` returns the whole
        block [out/|out_group|, in/|in_group|] each time forward or backward needs it (default: a
        synchronous all-gather of `weight` over Z). `matmul` computes the three products
    (`interlace.matmul`). `z_grad_in_backward`: the weight's Z-reduced gradient returned to
    autograd in the backward (FSDP2) rather than added to `.grad` when it ends. See the module
    docstring."""
    return _Linear3D.apply(
        x, weight, in_group, out_group, z, block_grad_hook, gather, matmul, z_grad_in_backward
    )


class _SplitLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = x.shape[-1] // group.size
        return x.narrow(-1, group.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_last_dim(grad, ctx.group), None


def split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Replicated x [..., n] → this rank's slice [..., n/p]; backward all-gathers the gradient
    (every rank's consumers see only their slice)."""
    return x if group.size == 1 else _SplitLastDim.apply(x, group)


def gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Slices [..., n/p] → [..., n] in rank order; backward keeps this rank's slice."""
    return x if group.size == 1 else gather_last_dim(x, group)


class _MeanOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.size = group.size
        return summed(x, group) / group.size

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None


def mean_over(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Mean of x (a loss of this rank's batch slice) over `group`; each rank back-propagates
    1/p of the gradient through its own slice, so gradients summed over the group are those of
    the mean."""
    return x if group.size == 1 else _MeanOver.apply(x, group)

"""Every expert of an MoE layer in one grouped call: no Python loop over experts, no host sync.

An expert is a two-layer feed-forward, y = down_e · act(up_e · x + b_up_e) + b_down_e, its
weights stacked over the E experts in nn.Linear's layout (up [E, f_up, d], down [E, d, f]).
Token rows arrive sorted by expert, `counts[e]` rows for expert e, and both matmuls run for all
experts at once:

- `F.grouped_mm` (one GEMM over the jagged row groups) where it applies (`grouped_mm_applies`);
- otherwise `torch.bmm` over the rows scattered into a padded [E, rows, d] buffer, `rows` a
  bound on every count: the caller's (an MoE layer's capacity) or the largest count, which
  costs one host sync (on the CPU, nothing).

Hand-written because torch has no public grouped GEMM that runs everywhere: `F.grouped_mm` takes
only bfloat16 on CUDA (sm90+ here) and under torch.compile, needs 16-byte aligned widths, adds
no per-group bias and leaves the rows past the last group unset (forward and backward). Without a
loop over experts, torch.compile traces one graph whatever the routing.

An MoE layer holds its experts stacked already (`interlace.moe.experts`); experts held one
module each (expert parallelism's) are stacked in every forward by `stack_parameters`, cast to
the compute dtype as they are copied (the backward hands each expert its own gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from interlace.matmul import PLAIN, Matmul
from interlace.precision import compute_dtype


def stack_parameters(
    experts: Sequence[nn.Module], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """{name: [E, *shape]}: each parameter of the alike modules `experts` cast to `dtype` (the
    dtype the experts compute in; None: their own) and stacked over them in order
    (differentiable: each expert's parameter receives its own slice of the gradient, in its own
    dtype), by `stack_as`."""
    named = [dict(e.named_parameters()) for e in experts]
    return {
        name: stack_as([params[name] for params in named], dtype or named[0][name].dtype)
        for name in named[0]
    }


@torch.library.custom_op("interlace::stack_as", mutates_args=())
def stack_as(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """tensors (n alike [*shape]) → [n, *shape] in `dtype`: one multi-tensor copy that casts as it
    writes, and in backward one that casts the gradient's n slices back to the tensors' dtype.

    Hand-written because `torch.stack` of casts launches a cast per tensor and a concatenation
    that writes every weight a second time, and torch.compile does no better: on an H100, 16
    fp32 experts of 4096 x 1024 stacked in bf16 in a compiled graph took 0.62 ms forward and
    1.02 ms with the backward, this op 0.27 and 0.65 ms (eager: 0.28 and 0.64 ms against 0.26
    and 0.61). An opaque op, so the compiler keeps it whole."""
    out = tensors[0].new_empty((len(tensors), *tensors[0].shape), dtype=dtype)
    torch._foreach_copy_(list(out.unbind(0)), tensors)
    return out


@stack_as.register_fake
def _stack_as_shape(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return tensors[0].new_empty((len(tensors), *tensors[0].shape), dtype=dtype)


def _stack_as_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dtype = inputs[0][0].dtype


def _stack_as_backward(ctx, grad: torch.Tensor) -> tuple[list[torch.Tensor], None]:
    # separate tensors, not views of one cast: autograd would copy each view into `.grad` again
    grads = [grad.new_empty(grad.shape[1:], dtype=ctx.dtype) for _ in range(grad.shape[0])]
    torch._foreach_copy_(grads, list(grad.unbind(0)))
    return grads, None


stack_as.register_autograd(_stack_as_backward, setup_context=_stack_as_context)


@torch.library.custom_op("interlace::cast_weight", mutates_args=())
def cast_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight (any shape) → one copy of it in `dtype`, in the weight's own layout; backward
    casts the gradient back to the weight's dtype.

    Hand-written because torch.compile may give a cast one buffer per reader: a stacked
    expert weight read (transposed) by the forward's grouped GEMM and saved for the backward's
    got two bf16 copies of the same bytes, written by one kernel at the device's bandwidth
    (178 µs for each of the 24 expert weights of `moe-gpt-12l` on an H100, a third of its
    bytes the second copy). An opaque op is one buffer, and both read views of it."""
    return weight.to(dtype)


@cast_weight.register_fake
def _cast_weight_shape(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_like(weight, dtype=dtype)


def _cast_weight_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.dtype = inputs[0].dtype


def _cast_weight_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad.to(ctx.dtype), None


cast_weight.register_autograd(_cast_weight_backward, setup_context=_cast_weight_context)


def grouped_mm_applies(*operands: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` runs on `operands` (rows [M, d] and stacked weights, one dtype):
    bfloat16 on CUDA sm90+; float32, float16 or bfloat16 on the CPU, bfloat16 only under
    torch.compile (its shape rule admits nothing else); every stride but the unit one and every
    storage offset a multiple of 16 bytes."""
    x = operands[0]
    if x.device.type == "cuda":
        fits = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    elif x.device.type == "cpu":
        fits = x.dtype == torch.bfloat16 or (
            x.dtype in (torch.float32, torch.float16) and not torch.compiler.is_compiling()
        )
    else:
        fits = False
    return fits and all(_aligned(t) for t in operands)


def _aligned(t: torch.Tensor) -> bool:
    unit = 16 // t.element_size()
    # a compiled graph allocates its operands itself, aligned (and torch.compile cannot trace
    # storage_offset(): asking would break the graph)
    offset = torch.compiler.is_compiling() or t.storage_offset() % unit == 0
    return offset and all(s % unit == 0 for s in t.stride() if s != 1)


def grouped_mlp(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    w_down: torch.Tensor,
    b_down: torch.Tensor | None,
    act: Callable[[torch.Tensor], torch.Tensor],
    rows: int | None = None,
    matmul: Matmul = PLAIN,
) -> torch.Tensor:
    """Each expert's feed-forward on its rows: x [M, d] sorted by expert, `counts` [E] rows each
    (Σ counts ≤ M: the rows past it come back zero, with zero gradient), w_up [E, f_up, d],
    b_up [E, f_up], `act` [n, f_up] → [n, f], w_down [E, d, f], b_down [E, d] → [M, d].

    Computes in autocast's dtype when it is on, as nn.Linear would. `rows`: a bound on every
    count known without looking (the capacity), for the padded fallback; None: it syncs once
    for the largest count. `matmul` computes the products
    (`interlace.matmul`)."""
    dtype = compute_dtype(x)
    x = x.to(dtype)
    w_up, w_down = [w if w.dtype == dtype else cast_weight(w, dtype) for w in (w_up, w_down)]
    b_up, b_down = [None if b is None else b.to(dtype) for b in (b_up, b_down)]
    n_experts = counts.shape[0]
    ends = torch.cumsum(counts, dim=0)
    position = torch.arange(x.shape[0], device=x.device)
    expert = torch.searchsorted(ends, position, right=True)  # E past Σ counts
    valid = (expert < n_experts).unsqueeze(1)
    if grouped_mm_applies(x, w_up, w_down):
        offs = ends.to(torch.int32)
        # F.grouped_mm leaves the rows past the last group unset, and their gradient: cut both
        # (the bias's one-hot matmul would carry that garbage into every expert's gradient)
        up = _grouped_linear(matmul, torch.where(valid, x, 0), w_up, b_up, offs, expert)
        h = act(torch.where(valid, up, 0))
        return torch.where(valid, _grouped_linear(matmul, h, w_down, b_down, offs, expert), 0)

    if rows is None:
        rows = int(counts.max())  # the one host sync
    trash = n_experts * rows  # one spare row takes the rows past Σ counts
    first = F.pad(ends - counts, (0, 1))  # each group's first row
    flat = torch.where(valid.squeeze(1), expert * rows + position - first[expert], trash)
    padded = x.new_zeros(trash + 1, x.shape[1]).index_copy(0, flat, x)
    h = act(_padded_linear(matmul, padded[:trash].view(n_experts, rows, x.shape[1]), w_up, b_up))
    y = _padded_linear(matmul, h, w_down, b_down).reshape(trash, w_down.shape[1])
    return F.pad(y, (0, 0, 0, 1)).index_select(0, flat)


def _grouped_linear(
    matmul: Matmul,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    offs: torch.Tensor,
    expert: torch.Tensor,
) -> torch.Tensor:
    """x [M, n] · w[e]ᵀ + b[e] [M, m] for the rows of each group e (`expert` [M]); the rows past
    the last group (expert E) are unset, and b's gradient from them falls on a spare zero row."""
    y = matmul.grouped(x, w, offs)
    return y if b is None else _BiasPerRow.apply(y, F.pad(b, (0, 0, 0, 1)), expert)


class _BiasPerRow(torch.autograd.Function):
    """y [M, m] + b[index] (b [R, m], index [M] in 0..R-1), gathered where the sum is made;
    backward: b's gradient as the matmul one-hot(index)ᵀ [R, M] · grad, not a scatter into R
    rows (atomics all contending for them). The one-hot is widened to a multiple of 8 columns:
    at R = 17 cuBLAS ran the 16-expert layer's bias products with its kernels for unaligned
    operands, 3.3 ms of an 81.5 ms `moe-gpt-12l` step on an H100, forward and backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = b.shape[0]
        return y + b.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        one_hot = F.one_hot(index, -(-ctx.rows // 8) * 8).to(grad.dtype)
        return grad, (one_hot.mT @ grad)[: ctx.rows], None


def _padded_linear(
    matmul: Matmul, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    y = matmul.batched(x, w)
    return y if b is None else y + b.unsqueeze(1)


def mlp_experts(
    template: nn.Module,
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    counts: torch.Tensor,
    rows: int | None = None,
) -> torch.Tensor:
    """`MLP` experts, their parameters stacked in `params` ({name in an `MLP`: [E, *shape]}),
    on x [M, d] sorted by expert, `counts` [E] → [M, d], as `grouped_mlp` (`rows` too);
    `template` (an `MLP`, or the `GroupedExperts`) gives the activation and the dropout,
    applied where each MLP applies them."""
    y = grouped_mlp(
        x,
        counts,
        params["up.weight"],
        params.get("up.bias"),
        params["down.weight"],
        params.get("down.bias"),
        template.act,
        rows,
    )
    return template.dropout(y)


def run_by_expert(
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Rows x [M, d] that arrive by source, then expert (`counts` [S, n]: rows from source s
    for expert e) → `run`(rows sorted by expert, rows per expert [n]) [M, d'], returned in
    arrival order."""
    n = counts.shape[1]
    labels = torch.arange(n, device=x.device).repeat(counts.shape[0])
    labels = labels.repeat_interleave(counts.reshape(-1).to(x.device), output_size=x.shape[0])
    order = torch.argsort(labels, stable=True)
    y = run(x.index_select(0, order), counts.sum(dim=0).to(x.device))
    return torch.empty_like(y).index_copy(0, order, y)

"""Overlapped 1D tensor parallelism: sub-batches take turns so one's all-reduce hides under
another's compute (`plan.overlap.tp_subbatches = k >= 2`).

Every transformer layer of the layer list (found by `detect`) is made to split its input along
the batch dimension into k sub-batches and run its own, unchanged forward once per sub-batch,
the k runs interleaved (`interleave`): each run executes on its own thread, but only one
thread computes at a time; a baton passes round-robin, and the only place it is handed over is
the forward all-reduce of a row-parallel layer (`comm.reduce_from_tp`), which, while a
baton is held, issues the all-reduce asynchronously (c10d `async_op=True`), passes the baton,
and waits on its result only when the baton comes back. With k = 2 in a pre-norm block:

    attn(1) ─ all-reduce(1) issued ─► attn(2) ─ all-reduce(2) issued ─► wait(1), MLP(1) ─
    all-reduce(1) issued ─► wait(2), MLP(2) ─ all-reduce(2) issued ─► park

which is the block-level schedule (attention of every sub-batch, then each one's MLP while the
others' reductions fly). At the block boundary, inside the model's forward, the last
sub-batch parks with its reduction in flight and the layer returns outputs whose last rows
are pending; the next layer adopts the parked thread just before its own last sub-batch, so
that reduction flies under the next layer's first compute (`interleave`'s tail). Because
the hand-over points are the same on every rank, all ranks issue their collectives in the same
order. The all-reduced bytes are those of plain TP, in k times as many calls.

Backward mirrors it. Each sub-batch's graph is recorded on its own thread, ending at leaves
of its own: fresh copies of its inputs and detached aliases of the layer's parameters
(`_ParameterAliases`). The layer's output joins the outer graph through one
autograd function whose backward differentiates the k graphs on k threads under the same
baton; the hand-over point there is the input-gradient all-reduce of `copy_to_tp`, issued
async. With k = 2: MLP-backward(2) runs while the MLP input-gradient all-reduce of sub-batch 1
flies, and so on down the block. The summed parameter gradients are returned to the real
parameters by the outer graph, so their hooks (DDP buckets, replica sums) fire once per
parameter per backward, as without sub-batches. Without autograd recording (evaluation) only
the forward is interleaved.

A weight the layer gathers before using it (a 3D linear's block over Z, z > 1) is gathered
once for all the sub-batches in each half of the pass, and their summed gradient is reduced
once: the module answers `shared_block()` with an object the sub-batches share
(`tensor3d.shared.SharedBlock`, `_shared_blocks`), so the gathers and reduce-scatters are
those of an unsplit run.

A layer holding a Mixture-of-Experts layer runs whole, between the sub-batched ones: routing
(capacity, the aux loss) takes the whole batch, and the expert-parallel layer's collectives
stay out of the threads. Its all-reduces are then not overlapped.

Threads rather than a rewritten forward: the layer's own code (built-in GPT, Hugging Face GPT-2,
Llama, any model `detect` understands) runs untouched, with no per-model schedule. Not
overlapped: the last sub-batch's input-gradient reduction of each layer, at the block
boundary in backward (see `interleave`); and on CUDA the backward's hand-over only happens
where the autograd engine runs the backward on the calling thread (CPU), elsewhere the
reductions run synchronously.

Splitting rule: a tensor argument whose first dimension equals the hidden state's batch size B
is split along it (tuples, lists and dicts are walked), anything else (None, numbers, strings,
broadcast tensors such as rotary tables [1, T, d]) is handed to every sub-batch as is. A call
with another kind of argument (a KV cache object) or B < 2 runs unsplit. Outputs are
concatenated along the batch dimension.

Activation checkpointing: a layer called inside torch's checkpoint (`recompute=full` or
`stage-aware` in a pipeline) still runs in sub-batches, each under a checkpoint of its own
(`_checkpointed`): torch recomputes once per autograd graph task, and each sub-batch's
backward is one, so the caller's checkpoint could not serve them; it is left with nothing
saved. Each sub-batch's recomputation runs inside its backward, on its thread, while the
other sub-batches' input-gradient all-reduces fly, and replays its forward's all-reduced
outputs instead of communicating (`replay.ReductionReplay`, Oases). Each sub-batch draws
random numbers (dropout) from a stream of its own (`interleave`), so its recomputation
draws the same masks as its forward whatever order the sub-batches took turns in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from interlace.errors import PlanError
from interlace.parallel.detect import Structure
from interlace.parallel.tensor.interleave import (
    Pending,
    Seat,
    Tail,
    deferral_allowed,
    enter_deferral,
    finish_seat,
    finish_tail,
    interleave,
    leave_deferral,
    run_interleaved,
    saved_tensor_hooks,
    set_pending,
    take_pending,
)
from interlace.recompute import checkpointed
from interlace.tensors import is_under

_PASSED = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _under_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are torch's activation checkpoint's."""
    hooks = saved_tensor_hooks()
    return hooks is not None and hooks[0].__module__ == "torch.utils.checkpoint"


def _checkpointed(forward: Callable) -> Callable:
    """`forward` under torch's activation checkpoint of its own, recomputation replaying its
    all-reduces (`replay.ReductionReplay`): how each sub-batch of a layer called inside a
    checkpoint keeps only its inputs. torch recomputes once per autograd graph task, and each
    sub-batch's backward is one, so the caller's checkpoint cannot serve the sub-batches; it
    is left with nothing saved (and recomputes nothing), as the layer's outer graph node saves
    no tensor."""

    return functools.partial(checkpointed, forward, "full")


def _batch_size(args: tuple, kwargs: dict, width: int) -> int | None:
    for value in (*args, *kwargs.values()):
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dim() >= 2
            and value.shape[-1] == width
        ):
            return value.shape[0]
    return None


def _splittable(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, *_PASSED)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_splittable(v) for v in value)
    if isinstance(value, dict):
        return all(_splittable(v) for v in value.values())
    return False


def _split(value: Any, batch: int, k: int) -> list[Any]:
    """k values: `value` cut along dim 0 where that is the batch, else `value` k times."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 0 and value.shape[0] == batch:
            return list(value.tensor_split(k))
        return [value] * k
    if isinstance(value, (tuple, list)):
        parts = [_split(v, batch, k) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(k)]
    if isinstance(value, dict):
        parts = {key: _split(v, batch, k) for key, v in value.items()}
        return [{key: p[i] for key, p in parts.items()} for i in range(k)]
    return [value] * k


def _merge(outputs: list[Any]) -> Any:
    """Concatenate per-sub-batch outputs along the batch dimension (recursing into tuples)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise PlanError(
                "tp_subbatches: a layer returned a scalar tensor, which cannot be merged over "
                "sub-batches; use tp_subbatches=1 for this model"
            )
        return torch.cat(outputs, 0)
    if isinstance(first, (tuple, list)):
        return type(first)(_merge(list(parts)) for parts in zip(*outputs, strict=True))
    if isinstance(first, dict):
        return {key: _merge([o[key] for o in outputs]) for key in first}
    return first


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside `value` (tuples, lists and dicts walked), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _with_tensors(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """`value` with its tensors replaced, in `_tensors` order, by the next of `tensors`."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(_with_tensors(v, tensors) for v in value)
    if isinstance(value, dict):
        return {key: _with_tensors(v, tensors) for key, v in value.items()}
    return value


class _SubBatchRun:
    """One interleaved forward of a layer over k sub-batches, kept for its interleaved backward.

    Each sub-batch's differentiable inputs are fresh leaves and the layer's parameters are
    replaced by detached aliases (`_ParameterAliases`), so every sub-batch's graph ends at
    leaves of its own: `backward` differentiates the k graphs on k threads that take turns
    like the forward's (one sub-batch's input-gradient all-reduce of `copy_to_tp` flies while
    the next computes), and returns the summed parameter gradients to the real parameters
    through the outer graph — whose hooks (DDP buckets, replica sums) then fire exactly once
    per parameter, as without sub-batches. `tail` is the previous layer's pending tail, adopted
    into this run; with `may_park` this run may leave one (`merged` then has Pending rows)."""

    def __init__(
        self,
        layer: nn.Module,
        base_forward: Callable,
        args: tuple,
        kwargs: dict,
        tail: Tail | None,
        may_park: bool,
    ):
        batch = _batch_size(args, kwargs, layer._interlace_width)
        self.k = min(layer._interlace_tp_subbatches, batch)
        forward = _checkpointed(base_forward) if _under_checkpoint() else base_forward
        originals = _tensors((args, kwargs))
        differentiable = [t.requires_grad for t in originals]
        self.inputs = [t for t in originals if t.requires_grad]
        self.split = [t.dim() > 0 and t.shape[0] == batch for t in self.inputs]
        self.leaves: list[list[torch.Tensor]] = []
        calls = []
        for piece in _split((args, kwargs), batch, self.k):
            fresh = [
                t.detach().requires_grad_() if d else t
                for t, d in zip(_tensors(piece), differentiable, strict=True)
            ]
            self.leaves.append([t for t, d in zip(fresh, differentiable, strict=True) if d])
            a, kw = _with_tensors(piece, iter(fresh))
            calls.append(lambda a=a, kw=kw: forward(*a, **kw))
        self.aliases = _ParameterAliases(layer)
        self.params = self.aliases.params
        self.aliases.swap_in()
        try:
            outputs, self.parked = interleave(calls, tail, may_park)
        except BaseException:
            self.aliases.swap_out()
            raise
        if self.parked is None:
            self.aliases.swap_out()
        self.outputs = [_tensors(o) for o in outputs]

        def done(result: Any) -> None:
            self.outputs[-1] = _tensors(result)
            self.aliases.swap_out()

        self.merged, self.parked = _merge_or_defer(outputs, self.parked, batch, done)

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        """Gradients of the inputs, then of the parameters, given the merged outputs' `grads`."""
        pieces = [
            [None] * self.k if g is None else g.split([o[j].shape[0] for o in self.outputs])
            for j, g in enumerate(grads)
        ]
        wrt = self.aliases.aliases

        def differentiate(i: int) -> tuple[torch.Tensor | None, ...]:
            pairs = [
                (out, pieces[j][i])
                for j, out in enumerate(self.outputs[i])
                if out.requires_grad and pieces[j][i] is not None
            ]
            if not pairs:
                return (None,) * (len(self.leaves[i]) + len(wrt))
            outs, gs = zip(*pairs, strict=True)
            return torch.autograd.grad(outs, self.leaves[i] + wrt, gs, allow_unused=True)

        self.aliases.share()
        try:
            results = run_interleaved([lambda i=i: differentiate(i) for i in range(self.k)])
        finally:
            self.aliases.unshare()
        n = len(self.inputs)
        input_grads = []
        for j, split in enumerate(self.split):
            parts = [r[j] for r in results]
            if split:
                shapes = [leaves[j] for leaves in self.leaves]
                parts = [
                    torch.zeros_like(s) if g is None else g
                    for g, s in zip(parts, shapes, strict=True)
                ]
                input_grads.append(torch.cat(parts, 0))
            else:
                input_grads.append(_sum(parts))
        summed = [_sum([r[n + j] for r in results]) for j in range(len(wrt))]
        return input_grads + self.aliases.gradients(summed)


def _sum(grads: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of the gradients present; None if there are none."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    return torch.stack(present).sum(0) if len(present) > 1 else present[0]


def _shared_blocks(layer: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, its shared block) for each module of `layer` that shares one weight block
    among the sub-batches: those with a `shared_block()` answering one (a 3D linear with
    z > 1, `tensor3d.shared.SharedBlock`: a `param` it stands for, a `leaf` the sub-batches
    differentiate for, `gradient(summed)` the param's gradient, `release()`). The module
    uses its `shared` attribute while the sub-batches run."""
    found = [(m, getattr(m, "shared_block", None)) for m in layer.modules()]
    pairs = [(m, share()) for m, share in found if callable(share)]
    return [(m, block) for m, block in pairs if block is not None]


class _ParameterAliases:
    """Detached aliases standing in for a layer's trainable parameters while its sub-batches
    run, so that each sub-batch's graph ends at leaves of its own (see `_SubBatchRun`); tied
    parameters share one alias. A parameter served by a shared block (`_shared_blocks`) is
    stood in for by the block's `leaf`, its gradient the block's `gradient` of the sub-batches'
    sum. Written by hand rather than with `torch.func.functional_call`, whose swap lasts one
    call: a parked tail goes on running the layer's code after that call has returned, and
    must see the aliases until it finishes."""

    def __init__(self, layer: nn.Module):
        self.shared = _shared_blocks(layer)
        served = {id(block.param) for _, block in self.shared}
        own = [p for p in layer.parameters() if p.requires_grad and id(p) not in served]
        trained = [block for _, block in self.shared if block.param.requires_grad]
        self.params = own + [block.param for block in trained]
        self.aliases = [p.detach().requires_grad_() for p in own] + [b.leaf for b in trained]
        self._finish = [None] * len(own) + [block.gradient for block in trained]
        by_id = {id(p): a for p, a in zip(own, self.aliases[: len(own)], strict=True)}
        self._slots = [
            (module, name, param, by_id[id(param)])
            for module in layer.modules()
            for name, param in module._parameters.items()
            if param is not None and id(param) in by_id
        ]

    def swap_in(self) -> None:
        """Put the aliases in the parameters' places, and the shared blocks in use."""
        for module, name, _, alias in self._slots:
            module._parameters[name] = alias
        self.share()

    def swap_out(self) -> None:
        """Put the parameters back; the shared blocks out of use."""
        for module, name, param, _ in self._slots:
            module._parameters[name] = param
        self.unshare()

    def share(self) -> None:
        """Put the shared blocks in use (the forward, and the backward's recomputation)."""
        for module, block in self.shared:
            module.shared = block

    def unshare(self) -> None:
        """Put the shared blocks out of use, their gathered data released."""
        for module, block in self.shared:
            module.shared = None
            block.release()

    def gradients(self, summed: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The parameters' gradients from the sub-batches' `summed` gradients of the aliases."""
        return [
            grad if finish is None else finish(grad)
            for grad, finish in zip(summed, self._finish, strict=True)
        ]


def _row_sizes(batch: int, k: int) -> list[int]:
    """Rows of each of the k sub-batches `tensor_split` cuts from `batch` rows."""
    q, r = divmod(batch, k)
    return [q + 1] * r + [q] * (k - r)


def _merge_or_defer(
    outputs: list[Any],
    parked: Seat | None,
    batch: int,
    on_tail: Callable[[Any], None] | None,
) -> tuple[Any, Seat | None]:
    """The merged outputs of a run, and the seat still to write their last rows (None when
    complete). With a `parked` seat, outputs whose tensors are all cut along the batch get
    full-batch buffers: the rows known now are copied in, the seat writes its own (through
    `.data`, so no version counter moves under the next layer's saved tensors) when it
    finishes, then calls `on_tail(result)`. Other outputs: the seat is finished here."""
    sizes = _row_sizes(batch, len(outputs))
    cut = parked is not None and all(
        t.dim() > 0 and t.shape[0] == size
        for out, size in zip(outputs[:-1], sizes, strict=False)
        for t in _tensors(out)
    )
    if parked is not None and not (cut and _tensors(outputs[0])):
        parked.on_finish = on_tail
        outputs[-1] = finish_seat(parked)
        parked = None
    if parked is None:
        with torch.no_grad():
            return _merge(outputs), None
    start = batch - sizes[-1]
    known = [_tensors(o) for o in outputs[:-1]]
    buffers = [t.new_empty((batch, *t.shape[1:])) for t in known[0]]
    with torch.no_grad():
        for j, buffer in enumerate(buffers):
            torch.cat([ts[j] for ts in known], out=buffer[:start])

    def write_rows(result: Any) -> None:
        rows = _tensors(result)
        if [t.shape[0] for t in rows] != [sizes[-1]] * len(buffers):
            raise PlanError("tp_subbatches: the last sub-batch returned outputs of other shapes")
        with torch.no_grad():
            for buffer, t in zip(buffers, rows, strict=True):
                buffer.data[start:].copy_(t)
        if on_tail is not None:
            on_tail(result)

    parked.on_finish = write_rows
    return _with_tensors(outputs[0], iter(buffers)), parked


def _leave_tail(result: Any, parked: Seat | None, batch: int, k: int) -> Any:
    """`result` as the caller receives it: with a `parked` seat, its tensors become `Pending`
    aliases registered as the pending tail (see `interleave`)."""
    if parked is None:
        return result
    pending = [t.as_subclass(Pending) for t in _tensors(result)]
    start = batch - _row_sizes(batch, k)[-1]
    set_pending(Tail(parked, pending, start, batch))
    return _with_tensors(result, iter(pending))


class _InterleavedBackward(torch.autograd.Function):
    """Joins a `_SubBatchRun` to the outer graph: forward returns the merged outputs' tensors
    (computed already); backward runs the sub-batches' backward interleaved."""

    @staticmethod
    def forward(ctx, run: _SubBatchRun, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.run = run
        outputs = tuple(t.detach() for t in _tensors(run.merged))
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        run, ctx.run = ctx.run, None
        return (None, *run.backward(grads))


class _SubBatched:
    """Mixed into a layer's class: `forward` runs the original one per sub-batch, interleaved,
    and (with autograd recording) so does the backward."""

    _interlace_tp_subbatches: int
    _interlace_width: int

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        base_forward = super().forward  # type: ignore[misc]
        tail = take_pending(_tensors((args, kwargs)))
        batch = _batch_size(args, kwargs, self._interlace_width)
        k = min(self._interlace_tp_subbatches, batch or 0)
        split = k >= 2 and _splittable((args, kwargs))
        if tail is not None and not (
            split and tail.rows() == (batch - _row_sizes(batch, k)[-1], batch)
        ):
            finish_tail(tail)
            tail = None
        if not split:
            return base_forward(*args, **kwargs)
        may_park = self._interlace_defer and deferral_allowed()
        if not torch.is_grad_enabled():
            pieces = _split((args, kwargs), batch, k)
            calls = [lambda p=p: base_forward(*p[0], **p[1]) for p in pieces]
            aliases = _ParameterAliases(self)  # type: ignore[arg-type]
            aliases.share()
            try:
                outputs, parked = interleave(calls, tail, may_park)
            except BaseException:
                aliases.unshare()
                raise
            if parked is None:
                aliases.unshare()
            merged, parked = _merge_or_defer(outputs, parked, batch, lambda _: aliases.unshare())
            return _leave_tail(merged, parked, batch, k)
        run = _SubBatchRun(self, base_forward, args, kwargs, tail, may_park)  # type: ignore[arg-type]
        joined = _InterleavedBackward.apply(run, *run.inputs, *run.params)
        parked, run.parked = run.parked, None
        return _leave_tail(_with_tensors(run.merged, iter(joined)), parked, batch, k)


_CLASSES: dict[type, type] = {}


def _sub_batched_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"SubBatched{cls.__name__}", (_SubBatched, cls), {})
    return _CLASSES[cls]


def check_tp_overlap(
    model: nn.Module, structure: Structure, subbatches: int, sequence_parallel: bool
) -> None:
    """Raise PlanError if `subbatches` > 1 cannot apply to `model` of this structure."""
    if subbatches < 2:
        return
    if sequence_parallel:
        raise PlanError(
            "tp_subbatches>1 overlaps tensor parallel all-reduces; with sequence_parallel=True "
            "use tp_subbatches=1"
        )
    if structure.layers is None and not (structure.attentions or structure.feed_forwards):
        raise PlanError("tp_subbatches>1 found no transformer layer to overlap")
    if structure.layers is not None and structure.experts and not _overlapped(model, structure):
        raise PlanError(
            f"tp_subbatches>1 sub-batches the layers without a Mixture-of-Experts layer, and "
            f"every layer holds one ({structure.experts}: routing takes the whole batch); use "
            "tp_subbatches=1"
        )


def apply_tp_overlap(
    model: nn.Module,
    structure: Structure,
    subbatches: int,
    sequence_parallel: bool = False,
    block_boundary: bool = True,
    width: int | None = None,
) -> list[str]:
    """Make every layer of the tensor-parallel `model` (already split by
    `apply_tensor_parallel` or `apply_tensor3d` with `structure`) run in `subbatches`
    interleaved sub-batches; return the report line. Parameters and their names are unchanged
    (each layer's class gains the sub-batching forward in place). `block_boundary`: inside
    `model`'s forward, each layer's last all-reduce runs under the next layer's first compute.
    `width`: the residual stream's last dimension as the layers see it (a 3D grid's d/x;
    default d_model), by which the hidden state, and its batch size, is found. `subbatches`
    < 2: nothing to do."""
    check_tp_overlap(model, structure, subbatches, sequence_parallel)
    if subbatches < 2:
        return []
    if structure.layers is not None:
        names = _overlapped(model, structure)
    else:
        names = [a.name for a in structure.attentions] + [f.name for f in structure.feed_forwards]
    modules = [model.get_submodule(name) for name in names]
    defer = block_boundary and structure.layers is not None and not _share_parameters(modules)
    for module in modules:
        module.__class__ = _sub_batched_class(type(module))
        module._interlace_tp_subbatches = subbatches
        module._interlace_width = width or structure.d_model
        module._interlace_defer = defer
    if defer:
        model.register_forward_pre_hook(lambda *_: enter_deferral(), prepend=True)
        model.register_forward_hook(lambda *_: leave_deferral(), always_call=True)
    where = structure.layers if structure.layers is not None else "attention and feed-forward"
    boundary = ", each layer's last one under the next layer's first compute" if defer else ""
    return [
        f"overlapped tensor parallel: {len(names)} modules ({where}) run {subbatches} "
        f"interleaved sub-batches, forward all-reduces async{boundary}"
    ]


def _overlapped(model: nn.Module, structure: Structure) -> list[str]:
    """The layers of `model`'s layer list that run sub-batched: those holding no
    Mixture-of-Experts layer, whose routing (capacity, aux loss) takes the whole batch: they
    run whole, between the others."""
    count = len(model.get_submodule(structure.layers))
    names = [f"{structure.layers}.{i}" for i in range(count)]
    return [n for n in names if not any(is_under(e, n) for e in structure.experts)]


def _share_parameters(modules: list[nn.Module]) -> bool:
    """Whether any parameter belongs to more than one of `modules` (layers with tied weights
    cannot leave a tail: the next layer would see the previous one's parameter aliases)."""
    seen: set[int] = set()
    for module in modules:
        own = {id(p) for p in module.parameters()}
        if own & seen:
            return True
        seen |= own
    return False

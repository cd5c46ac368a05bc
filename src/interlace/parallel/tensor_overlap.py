"""Overlapped 1D tensor parallelism: sub-batches take turns so one's all-reduce hides under
another's compute (`plan.overlap.tp_subbatches = k >= 2`).

Every transformer layer of the layer list (found by `detect`) is made to split its input along
the batch dimension into k sub-batches and run its own, unchanged forward once per sub-batch,
the k runs interleaved. Each run executes on its own thread, but only one thread computes at a
time: a baton passes round-robin, and the only place it is handed over is the forward
all-reduce of a row-parallel layer (`tp_comm.reduce_from_tp`), which, while a baton is held,
issues the all-reduce asynchronously (c10d `async_op=True`), passes the baton, and waits on
its result only when the baton comes back. With k = 2 in a pre-norm block:

    attn(1) ─ all-reduce(1) issued ─► attn(2) ─ all-reduce(2) issued ─► wait(1), MLP(1) ─
    all-reduce(1) issued ─► wait(2), MLP(2) ─ all-reduce(2) issued ─► wait(1) ─► wait(2)

which is the block-level schedule (attention of every sub-batch, then each one's MLP while the
others' reductions fly); only the last sub-batch's MLP all-reduce of a layer stays exposed.
Because the hand-over points are the same on every rank, all ranks issue their collectives in
the same order. The all-reduced bytes are those of plain TP, in k times as many calls.

Backward mirrors it. Each sub-batch's graph is recorded on its own thread, ending at leaves
of its own: fresh copies of its inputs and detached aliases of the layer's parameters
(`torch.func.functional_call`). The layer's output joins the outer graph through one
autograd function whose backward differentiates the k graphs on k threads under the same
baton; the hand-over point there is the input-gradient all-reduce of `copy_to_tp`, issued
async. With k = 2: MLP-backward(2) runs while the MLP input-gradient all-reduce of sub-batch 1
flies, and so on down the block. The summed parameter gradients are returned to the real
parameters by the outer graph, so their hooks (DDP buckets, replica sums) fire once per
parameter per backward, as without sub-batches. Without autograd recording (evaluation) only
the forward is interleaved.

Threads rather than a rewritten forward: the layer's own code (built-in GPT, Hugging Face GPT-2,
Llama, any model `detect` understands) runs untouched, with no per-model schedule. Not
overlapped: the last sub-batch's reduction of each layer, at the block boundary, in both
directions; and on CUDA the backward's hand-over only happens where the autograd engine runs
the backward on the calling thread (CPU), elsewhere the reductions run synchronously.

Splitting rule: a tensor argument whose first dimension equals the hidden state's batch size B
is split along it (tuples, lists and dicts are walked), anything else (None, numbers, strings,
broadcast tensors such as rotary tables [1, T, d]) is handed to every sub-batch as is. A call
with another kind of argument (a KV cache object) or B < 2 runs unsplit. Outputs are
concatenated along the batch dimension.

Activation checkpointing: a layer called inside torch's checkpoint (`recompute=full` or
`stage-aware` in a pipeline) runs unsplit, as plain TP, both in its forward and in its
recomputation. torch's checkpoint recomputes once per autograd graph task, and each
sub-batch's backward is a graph task of its own, so sub-batch threads could not share one
recomputation. Its all-reduces are still not repeated by the recomputation
(`tp_comm.ReductionReplay`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from interlace.errors import PlanError
from interlace.parallel.detect import Structure
from interlace.parallel.tp_comm import set_reduce_yield

_PASSED = (type(None), bool, int, float, str, torch.dtype, torch.device)


class _Baton:
    """Lets n threads run one at a time, handing over round-robin among those not finished."""

    def __init__(self, n: int):
        self.turn = 0
        self.finished = [False] * n
        self.cond = threading.Condition()

    def wait_turn(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == i)

    def pass_on(self, i: int) -> None:
        n = len(self.finished)
        with self.cond:
            following = ((i + s) % n for s in range(1, n + 1))
            self.turn = next((j for j in following if not self.finished[j]), -1)
            self.cond.notify_all()

    def switch(self, i: int) -> None:
        self.pass_on(i)
        self.wait_turn(i)


def run_interleaved(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` each on its own thread, one at a time, switching at `reduce_from_tp`; return
    their results in order (the first exception is re-raised). Grad mode, autocast, the
    accelerator device and the saved-tensor hooks (offloading, memory meters) of the caller
    are carried into the threads."""
    baton = _Baton(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    grad = torch.is_grad_enabled()
    autocast = [
        (dev, torch.get_autocast_dtype(dev))
        for dev in ("cpu", "cuda")
        if torch.is_autocast_enabled(dev)
    ]
    device = torch.accelerator.current_device_index() if torch.accelerator.is_available() else None
    saved_hooks = _saved_tensor_hooks()

    def worker(i: int) -> None:
        baton.wait_turn(i)
        set_reduce_yield(lambda: baton.switch(i))
        if saved_hooks is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(*saved_hooks)
        try:
            if device is not None:
                torch.accelerator.set_device_index(device)
            with torch.set_grad_enabled(grad):
                contexts = [torch.autocast(dev, dtype) for dev, dtype in autocast]
                for c in contexts:
                    c.__enter__()
                try:
                    results[i] = calls[i]()
                finally:
                    for c in reversed(contexts):
                        c.__exit__(None, None, None)
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)
        finally:
            if saved_hooks is not None:
                torch._C._autograd._pop_saved_tensors_default_hooks()
            set_reduce_yield(None)
            baton.finished[i] = True
            baton.pass_on(i)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _saved_tensor_hooks() -> tuple[Callable, Callable] | None:
    """The caller's innermost saved-tensor hooks (pack, unpack), None when there are none.
    torch keeps them per thread and has no public getter, hence the private call."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _under_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are torch's activation checkpoint's."""
    hooks = _saved_tensor_hooks()
    return hooks is not None and hooks[0].__module__ == "torch.utils.checkpoint"


def _batch_size(args: tuple, kwargs: dict, d_model: int) -> int | None:
    for value in (*args, *kwargs.values()):
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dim() >= 2
            and value.shape[-1] == d_model
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
    replaced by detached aliases (`torch.func.functional_call`), so every sub-batch's graph
    ends at leaves of its own: `backward` differentiates the k graphs on k threads that take
    turns like the forward's (one sub-batch's input-gradient all-reduce of `copy_to_tp` flies
    while the next computes), and returns the summed parameter gradients to the real
    parameters through the outer graph — whose hooks (DDP buckets, replica sums) then fire
    exactly once per parameter, as without sub-batches."""

    def __init__(self, layer: nn.Module, base_forward: Callable, args: tuple, kwargs: dict):
        batch = _batch_size(args, kwargs, layer._interlace_d_model)
        self.k = min(layer._interlace_tp_subbatches, batch)
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
            calls.append(lambda a=a, kw=kw: base_forward(*a, **kw))
        named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.aliases = {n: p.detach().requires_grad_() for n, p in named}
        held = {f"layer.{n}": a for n, a in self.aliases.items()}
        outputs = torch.func.functional_call(_Holder(layer), held, (calls,))
        self.outputs = [_tensors(o) for o in outputs]
        with torch.no_grad():
            self.merged = _merge(outputs)

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        """Gradients of the inputs, then of the parameters, given the merged outputs' `grads`."""
        pieces = [
            [None] * self.k if g is None else g.split([o[j].shape[0] for o in self.outputs])
            for j, g in enumerate(grads)
        ]
        wrt = list(self.aliases.values())

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

        results = run_interleaved([lambda i=i: differentiate(i) for i in range(self.k)])
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
        return input_grads + [_sum([r[n + j] for r in results]) for j in range(len(wrt))]


def _sum(grads: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of the gradients present; None if there are none."""
    present = [g for g in grads if g is not None]
    if not present:
        return None
    return torch.stack(present).sum(0) if len(present) > 1 else present[0]


class _Holder(nn.Module):
    """Holds a layer as its child `layer`, so `functional_call` can swap the layer's
    parameters around a run of interleaved calls without calling the layer (its hooks have
    run already, on the whole batch)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """The calls' results, run by `run_interleaved`."""
        return run_interleaved(calls)


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
    _interlace_d_model: int

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        base_forward = super().forward  # type: ignore[misc]
        batch = _batch_size(args, kwargs, self._interlace_d_model)
        k = min(self._interlace_tp_subbatches, batch or 0)
        if k < 2 or not _splittable((args, kwargs)) or _under_checkpoint():
            return base_forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            pieces = _split((args, kwargs), batch, k)
            return _merge(
                run_interleaved([lambda p=p: base_forward(*p[0], **p[1]) for p in pieces])
            )
        run = _SubBatchRun(self, base_forward, args, kwargs)  # type: ignore[arg-type]
        joined = _InterleavedBackward.apply(run, *run.inputs, *run.params)
        return _with_tensors(run.merged, iter(joined))


_CLASSES: dict[type, type] = {}


def _sub_batched_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"SubBatched{cls.__name__}", (_SubBatched, cls), {})
    return _CLASSES[cls]


def check_tp_overlap(structure: Structure, subbatches: int, sequence_parallel: bool) -> None:
    """Raise PlanError if `subbatches` > 1 cannot apply to a model of this structure."""
    if subbatches < 2:
        return
    if sequence_parallel:
        raise PlanError(
            "tp_subbatches>1 overlaps the all-reduce of plain 1D TP; with sequence_parallel=True "
            "use tp_subbatches=1"
        )
    if structure.experts:
        raise PlanError(
            f"tp_subbatches>1 would split the batch of the replicated Mixture-of-Experts layers "
            f"{structure.experts} (routing capacity depends on it); use tp_subbatches=1"
        )
    if structure.layers is None and not (structure.attentions or structure.feed_forwards):
        raise PlanError("tp_subbatches>1 found no transformer layer to overlap")


def apply_tp_overlap(
    model: nn.Module, structure: Structure, subbatches: int, sequence_parallel: bool = False
) -> list[str]:
    """Make every layer of the tensor-parallel `model` (already split by
    `apply_tensor_parallel` with `structure`) run in `subbatches` interleaved sub-batches;
    return the report line. Parameters and their names are unchanged (each layer's class gains
    the sub-batching forward in place). `subbatches` < 2: nothing to do."""
    check_tp_overlap(structure, subbatches, sequence_parallel)
    if subbatches < 2:
        return []
    if structure.layers is not None:
        count = len(model.get_submodule(structure.layers))
        names = [f"{structure.layers}.{i}" for i in range(count)]
    else:
        names = [a.name for a in structure.attentions] + [f.name for f in structure.feed_forwards]
    for name in names:
        module = model.get_submodule(name)
        module.__class__ = _sub_batched_class(type(module))
        module._interlace_tp_subbatches = subbatches
        module._interlace_d_model = structure.d_model
    where = structure.layers if structure.layers is not None else "attention and feed-forward"
    return [
        f"overlapped tensor parallel: {len(names)} modules ({where}) run {subbatches} "
        "interleaved sub-batches, forward all-reduces async"
    ]

"""Memory per rank, measured: what a rank keeps between steps (parameters, gradients, optimizer
states: the bytes of its tensors' storages) and what a step allocates on top (the peak of the
tensors its operations create and keep alive: saved activations, temporaries, communication
buffers), on any device.

Written here because torch's own tracker (`torch.distributed._tools.MemTracker`) refuses a
module called more than once per step (micro-batches, pipeline schedules), and the CPU has no
allocator statistics. `LiveBytes` is a `TorchDispatchMode` that holds a weak reference to the
storage of every tensor an operation creates and drops it once the storage is freed, the
approach torch's tracker takes, without its per-module bookkeeping. On CUDA the allocator's own
peak (`torch.cuda.max_memory_allocated`) is reported beside it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

from interlace.tensors import local_tensor

T = TypeVar("T")


def _plain(tree: Any) -> list[torch.Tensor]:
    """The tensors of `tree` with storage of their own (not meta, not a wrapper such as a
    DTensor, whose local tensors reach the mode in their own operations)."""
    return [
        leaf
        for leaf in tree_leaves(tree)
        if isinstance(leaf, torch.Tensor)
        and leaf.device.type != "meta"
        and not is_traceable_wrapper_subclass(leaf)
    ]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts by its local shard;
    views of one buffer, such as DDP's gradient buckets, count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{"parameters", "gradients", "optimizer", "optimizer_saved"}: bytes of this rank's
    parameters, of their gradients (where set) and of the optimizer's state tensors, and how
    many fewer those take than in fp32 (bf16 moments: as many as they take)."""
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = [s for s in states if s.dim() > 0]
    held = storage_bytes(tensors)
    return {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": held,
        "optimizer_saved": 4 * sum(local_tensor(s).numel() for s in tensors) - held,
    }


MEASURED_STEP = 2
"""The step a run measures (0-based from where it starts or resumes): the third, since DDP
rebuilds its gradient buckets in the second and compiled blocks compile in the first."""


class LiveBytes(TorchDispatchMode):
    """Within: the bytes of the storages created by operations and not yet freed (`current`),
    their maximum (`peak`), per process. Storages created before entering are not counted.

    Compiled modules run eagerly within (torch.compile does not trace under a dispatch mode).
    They are told so (`torch.compiler.set_stance("force_eager")`): a compiled block called
    under the mode without it was skipped for good, and ran eagerly for the rest of the run
    (under torch 2.13, a 12-layer MoE model's compiled CPU step went from ~19 to ~35 ms).

    Other threads may enter the same probe while it is active (the sub-batches of overlapped
    tensor parallelism carry the caller's dispatch modes, `interleave`): only the outermost
    entry sets the stance and only its exit stops the count. An inner exit that forgot the
    storages still live, as it once did, counted them until the end, for good: a 2-layer
    model's sub-batched forward was measured 5.4 MiB above what it held."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[int, int]] = {}  # data_ptr → (weak ref, bytes)
        self.current = 0
        self.peak = 0
        self._eager = contextlib.ExitStack()
        self._entries = 0
        self._lock = threading.Lock()

    def __enter__(self) -> LiveBytes:
        with self._lock:
            self._entries += 1
            if self._entries == 1:
                self._eager.enter_context(torch.compiler.set_stance("force_eager"))
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._drop_freed()
        inputs = {leaf.untyped_storage().data_ptr() for leaf in _plain((args, kwargs))}
        for leaf in _plain(out):
            storage = leaf.untyped_storage()
            if storage.data_ptr() not in inputs:  # views and in-place results are not new
                self._add(storage)
        self.peak = max(self.peak, self.current)
        return out

    def tracked_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the distinct storages of `tensors` that were created within (the rest, held
        before, is not part of `current`)."""
        seen = {}
        for tensor in tensors:
            key = local_tensor(tensor).untyped_storage().data_ptr()
            if key in self._live:
                seen[key] = self._live[key][1]
        return sum(seen.values())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key in self._live or storage.nbytes() == 0:
            return
        self._live[key] = (storage._weak_ref(), storage.nbytes())
        self.current += storage.nbytes()

    def _drop_freed(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._live[key]
                self.current -= nbytes

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        with self._lock:
            self._entries -= 1
            if self._entries:
                return
        self._eager.close()
        self._drop_freed()
        for ref, _ in self._live.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self._live.clear()


def unseen(hook: Callable[..., None]) -> Callable[..., None]:
    """`hook` run with no dispatch mode active, so that the operations it makes to read the
    step (a DTensor gradient's `to_local`, a view) are seen by no mode of the step's own: a
    recomputed block's selective-checkpoint modes count every operation of its forward and
    its replay, and one more in the replay (the probe's hook there, once the later blocks'
    gradients exist) broke the replay. `LiveBytes` does not see them either: they allocate
    nothing."""

    @functools.wraps(hook)
    def without_modes(*args: Any) -> None:
        with _disable_current_modes():
            hook(*args)

    return without_modes


def measure_step(
    step: Callable[[], T], model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[T, dict[str, int]]:
    """Run `step()`, one training step of `model` with `optimizer`, measured; returns its result
    and the bytes of this rank's {"parameters", "gradients", "optimizer"} (taken just before
    the optimizer updates, or after the step when it applied no update), "activations" (the
    largest sample, at the end of any module's forward, of what the step had allocated and
    kept, gradients excepted: saved activations of the micro-batches in flight, gathered
    parameters, temporaries) and "step_peak" (the most the step had allocated at once,
    gradients included). On CUDA the allocator's counters; elsewhere `LiveBytes`. Hooks and
    the probe are removed on return."""
    held: dict[str, int] = {}
    params = list(model.parameters())
    cuda = params[0].device.type == "cuda"
    probe = contextlib.nullcontext() if cuda else LiveBytes()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    samples, peaks = [0], [0]
    kept = {local_tensor(p).untyped_storage().data_ptr() for p in params}

    def gathered() -> int:
        """Bytes of the parameters the model holds now in storages it did not hold at the
        step's start: FSDP2's unsharded copies, which it allocates and frees by resizing
        storages made when it wrapped the model, unseen by `LiveBytes`."""
        return storage_bytes(
            p
            for p in model.parameters()
            if not is_traceable_wrapper_subclass(p) and p.untyped_storage().data_ptr() not in kept
        )

    @unseen
    def sample(*_: Any) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if cuda:
            samples.append(torch.cuda.memory_allocated() - base - storage_bytes(grads))
        else:
            now = probe.current + gathered()
            samples.append(now - probe.tracked_bytes(grads))
            peaks.append(now)

    @unseen
    def before_update(opt: torch.optim.Optimizer, *_: Any) -> None:
        held.update(state_bytes(model, opt))

    handles = [m.register_forward_hook(sample) for m in model.modules()]
    handles.append(optimizer.register_step_pre_hook(before_update))
    try:
        with probe:
            result = step()
    finally:
        for handle in handles:
            handle.remove()
    peak = torch.cuda.max_memory_allocated() - base if cuda else max(probe.peak, *peaks)
    if not held:  # the update was skipped (a non-finite step): the state as it stands
        held.update(state_bytes(model, optimizer))
    return result, {**held, "activations": max(samples), "step_peak": peak}


def describe_memory(memory: dict[str, Any]) -> str:
    """One line of a run's measured memory (`Trainer.memory`): the rank that holds the most,
    its state and its activations, each beside the planner's estimate."""
    rank, mine = max(
        enumerate(memory["per_rank"]),
        key=lambda item: item[1]["parameters"] + item[1]["optimizer"] + item[1]["activations"],
    )
    state = mine["parameters"] + mine["gradients"] + mine["optimizer"]
    predicted = memory["predicted"]
    extra = (
        predicted["activations"] + predicted["recompute_working_set"] + predicted["fsdp_gathered"]
    )
    mib = 2**20
    saved = mine.get("optimizer_saved", 0)
    low_state = f"; low-precision optimizer states save {saved / mib:.1f}" if saved else ""
    return (
        f"memory at step {memory['step']}, rank {rank}: parameters + gradients + optimizer "
        f"{state / mib:.1f} MiB (estimate {predicted['params_grads_optimizer'] / mib:.1f}"
        f"{low_state}), activations {mine['activations'] / mib:.1f} MiB (estimate "
        f"{extra / mib:.1f}), step peak {mine['step_peak'] / mib:.1f} MiB"
    )

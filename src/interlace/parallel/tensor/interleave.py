"""Threads that take turns, handing over at tensor parallel all-reduces, and the tail a layer
leaves running for the next one: the scheduling under overlapped tensor parallelism
(`interlace.parallel.tensor.overlap`).

`interleave(calls)` runs each call on its own thread, one at a time. A baton passes
round-robin among the unfinished threads, and the only place it is handed over is a 1D TP
all-reduce (`reduction.set_reduce_yield`): the thread issues the reduction asynchronously, passes
the baton, and waits on the result when the baton comes back.

**The tail (block-boundary overlap, Merak's third level).** When deferral is allowed, the last
unfinished thread does not wait for its final reduction: it parks with the reduction in flight
and `interleave` returns without it. The layer hands its caller merged outputs whose last rows
are not written yet (`Pending` tensors) and registers the parked thread as the pending tail.
The next sub-batched layer called with those outputs adopts the tail into its own run, in the
ring just before the sub-batch that reads the missing rows:

    layer i:    ... MLP(k−1) ─ all-reduce(k−1) issued ─► park
    layer i+1:  attn(0..k−2 of i+1) ─► wait, finish layer i's tail (rows written) ─► attn(k−1) ...

so the last reduction of block i flies under block i+1's first compute. Any other use of a
`Pending` tensor first finishes the tail (`resolve_pending`), as does leaving the
`deferral_scope` (the model's forward), so no one reads rows that are not written yet; code
that reads the tensor outside torch's Python API (a C++ collective on it) must leave the scope
first. Only forward passes defer; the backward's last input-gradient all-reduce of each layer
stays exposed, because the autograd engine may read (accumulate) a layer's gradient in C++.

Seats run on kept threads (`_ThreadPool`) with the caller's grad mode, autocast, device,
saved-tensor hooks and intra-op thread count, and each draws random numbers from a stream of
its own (`_RandomState`), so a checkpointed sub-batch's recomputation draws what its forward
drew.

Written by hand rather than with async functional collectives: the layer's own forward code
runs unchanged on each thread, so the hand-over points come from the collectives it calls,
and a sub-batch can only be suspended mid-layer on a thread of its own.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from interlace.parallel.tensor.reduction import set_reduce_yield

_COND = threading.Condition()


class _ThreadPool:
    """Threads kept for the seats, each serving one job at a time. A fresh thread per seat
    would cost a layer about 40% more CPU time on a CPU: its first
    allocations come from a new malloc arena, page by page. (`concurrent.futures` pools
    hold a job's thread in their own bookkeeping and cannot hand a parked seat's thread
    over to the next layer's run, hence this small one.)"""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on an idle thread, or on a new one."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), daemon=True).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            inbox.get()()
            with self._lock:
                self._idle.append(inbox)

    def forget(self) -> None:
        """After fork: the parent's threads do not exist in the child."""
        self._idle, self._lock = [], threading.Lock()


_POOL = _ThreadPool()
os.register_at_fork(after_in_child=_POOL.forget)


class Seat:
    """One thread of an interleaved run: its call, its ring, its result or error.

    `on_finish(result)` runs on the thread after the call returns, before the next seat gets
    the baton: a tail writes its rows there."""

    def __init__(self, call: Callable[[], Any], rng: _RandomState):
        self.call = call
        self.rng = rng
        self.ring: _Ring
        self.finished = False
        self.parked = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.on_finish: Callable[[Any], None] | None = None


class _Ring:
    """Seats taking turns in order; `may_park`: the last unfinished seat parks at its
    reduction instead of waiting on it."""

    def __init__(self, seats: list[Seat], may_park: bool):
        self.seats = seats
        self.may_park = may_park
        self.turn: Seat | None = seats[0]
        for seat in seats:
            seat.ring = self

    def pass_on(self, seat: Seat) -> None:
        """Give the baton to the next unfinished seat after `seat` (itself if it is alone).
        Call with `_COND` held."""
        i = self.seats.index(seat)
        following = self.seats[i + 1 :] + self.seats[: i + 1]
        self.turn = next((s for s in following if not s.finished), None)
        _COND.notify_all()

    def alone(self, seat: Seat) -> bool:
        return all(s.finished for s in self.seats if s is not seat)


class _RandomState:
    """A seat's own stream of the global random generators (CPU, and CUDA once initialised):
    each seat draws (dropout masks) from its stream only, whatever the order the seats take
    turns in, so a seat's checkpointed recomputation draws what its forward drew. The
    streams are seeded from the caller's generator, one seed per seat."""

    def __init__(self, cpu: torch.Tensor, cuda: torch.Tensor | None):
        self.cpu, self.cuda = cpu, cuda

    @staticmethod
    def _cuda() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    @classmethod
    def seeded(cls) -> _RandomState:
        """A new stream, seeded by one draw from the global CPU generator."""
        seed = int(torch.randint(0, 2**62, (1,)).item())
        cuda = torch.Generator("cuda").manual_seed(seed).get_state() if cls._cuda() else None
        return cls(torch.Generator().manual_seed(seed).get_state(), cuda)

    @classmethod
    def current(cls) -> _RandomState:
        """The global generators' state now."""
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state() if cls._cuda() else None)

    def enter(self) -> None:
        """Make this stream the global generators' state."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)

    def leave(self) -> None:
        """Keep where the global generators are, for the next `enter`."""
        self.cpu = torch.get_rng_state()
        if self.cuda is not None:
            self.cuda = torch.cuda.get_rng_state()


def _switch(seat: Seat) -> None:
    """The yield point of a seat's reductions: pass the baton, wait for it, and if every
    other seat has finished and the ring allows it, park until adopted or resolved."""
    seat.rng.leave()
    with _COND:
        seat.ring.pass_on(seat)
        _COND.wait_for(lambda: seat.ring.turn is seat)
        if seat.ring.may_park and seat.ring.alone(seat):
            seat.parked = True
            _COND.notify_all()
            _COND.wait_for(lambda: not seat.parked and seat.ring.turn is seat)
            set_reduce_yield(None)  # adopted: run to the end without handing over again
    seat.rng.enter()


def _worker(seat: Seat, state: _ThreadState) -> None:
    with _COND:
        _COND.wait_for(lambda: seat.ring.turn is seat)
    set_reduce_yield(lambda: _switch(seat))
    try:
        seat.rng.enter()
        seat.result = state.run(seat.call)
        if seat.on_finish is not None:
            seat.on_finish(seat.result)
    except BaseException as exc:  # handed to the caller by `interleave`
        seat.error = exc
    finally:
        set_reduce_yield(None)
        seat.rng.leave()
        with _COND:
            seat.finished = True
            seat.ring.pass_on(seat)


@dataclass
class _ThreadState:
    """The caller's thread-local state carried into the seats' threads: grad mode, autocast,
    the accelerator device, the saved-tensor hooks (offloading, memory meters), the dispatch
    modes (the memory probe's `LiveBytes`, which otherwise would not see the seats' tensors)
    and the intra-op thread count (OpenMP keeps it per thread: a new thread would otherwise
    compute on every core, oversubscribing ranks that share a CPU)."""

    grad: bool
    threads: int
    autocast: list[tuple[str, torch.dtype]]
    device: int | None
    saved_hooks: tuple[Callable, Callable] | None
    modes: list[Any]

    @classmethod
    def capture(cls) -> _ThreadState:
        return cls(
            grad=torch.is_grad_enabled(),
            threads=torch.get_num_threads(),
            autocast=[
                (dev, torch.get_autocast_dtype(dev))
                for dev in ("cpu", "cuda")
                if torch.is_autocast_enabled(dev)
            ],
            device=(
                torch.accelerator.current_device_index()
                if torch.accelerator.is_available()
                else None
            ),
            saved_hooks=_carried_hooks(),
            modes=_get_current_dispatch_mode_stack(),
        )

    def run(self, call: Callable[[], Any]) -> Any:
        torch.set_num_threads(self.threads)
        with contextlib.ExitStack() as stack:
            if self.saved_hooks is not None:
                torch._C._autograd._push_saved_tensors_default_hooks(*self.saved_hooks)
                stack.callback(torch._C._autograd._pop_saved_tensors_default_hooks)
            if self.device is not None:
                torch.accelerator.set_device_index(self.device)
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for mode in self.modes:
                stack.enter_context(mode)
            for dev, dtype in self.autocast:
                stack.enter_context(torch.autocast(dev, dtype))
            return call()


def _carried_hooks() -> tuple[Callable, Callable] | None:
    """The caller's saved-tensor hooks to install in the seats, except torch's activation
    checkpoint's: a checkpoint recomputes once per autograd graph task, and each seat's
    backward is one, so its seats checkpoint themselves (`overlap._checkpointed`)."""
    hooks = saved_tensor_hooks()
    return None if hooks is None or hooks[0].__module__ == "torch.utils.checkpoint" else hooks


def saved_tensor_hooks() -> tuple[Callable, Callable] | None:
    """The caller's innermost saved-tensor hooks (pack, unpack), None when there are none.
    torch keeps them per thread and has no public getter, hence the private call."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def interleave(
    calls: list[Callable[[], Any]], tail: Tail | None = None, may_park: bool = False
) -> tuple[list[Any], Seat | None]:
    """Run `calls` on threads taking turns; return (their results in order, the parked seat
    or None). With `may_park` the last call may park at its final reduction: its result is
    then None until the seat, adopted or resolved, finishes. A `tail` of an earlier run is
    adopted into the ring just before the last call, and finishes within this run. The first
    exception of any seat is re-raised."""
    seats = [Seat(call, _RandomState.seeded()) for call in calls]
    resume = _RandomState.seeded()  # the caller's generators go on from a stream of their own
    ring_seats = seats[:-1] + ([tail.seat] if tail is not None else []) + seats[-1:]
    state = _ThreadState.capture()
    with _COND:
        ring = _Ring(ring_seats, may_park)
        if tail is not None:
            tail.seat.parked = False
            _COND.notify_all()
    for seat in seats:
        _POOL.submit(lambda seat=seat: _worker(seat, state))
    with _COND:
        _COND.wait_for(lambda: all(s.finished or s.parked for s in ring.seats))
    resume.enter()
    errors = [s.error for s in ring.seats if s.error is not None]
    if errors:
        for seat in ring.seats:
            if seat.parked:
                _finish(seat)
        raise errors[0]
    parked = next((s for s in seats if s.parked), None)
    results = [s.result for s in seats]
    _release(ring)
    return results, parked


def _release(ring: _Ring) -> None:
    """Drop what a finished run's seats hold (calls, results, the ring they share), so that
    no reference cycle keeps a sub-batch's outputs, and their graph, alive until the
    garbage collector runs. A parked seat keeps its call and gets a new ring when adopted."""
    for seat in ring.seats:
        if seat.finished:
            seat.call = seat.result = seat.on_finish = None
    ring.seats = [s for s in ring.seats if not s.finished]


def run_interleaved(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` each on its own thread, one at a time, switching at the 1D TP all-reduces;
    return their results in order (the first exception is re-raised)."""
    return interleave(calls)[0]


def _finish(seat: Seat) -> None:
    """Let a parked seat run to its end alone and wait for it (the caller's random state
    kept)."""
    caller = _RandomState.current()
    with _COND:
        _Ring([seat], may_park=False)
        seat.parked = False
        _COND.notify_all()
        _COND.wait_for(lambda: seat.finished)
    caller.enter()


def finish_seat(seat: Seat) -> Any:
    """Run a parked seat to its end; its result (its error re-raised)."""
    _finish(seat)
    if seat.error is not None:
        raise seat.error
    result = seat.result
    _release(seat.ring)
    return result


# ---- the pending tail


class Pending(torch.Tensor):
    """A layer's merged output whose last rows a parked tail has yet to write. Any torch
    operation on it (other than reading its shape, dtype or device) first finishes the
    pending tail; the operation's results are plain tensors."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in _METADATA:
            resolve_pending()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


_METADATA = frozenset(
    {
        torch.Tensor.shape.__get__,
        torch.Tensor.dtype.__get__,
        torch.Tensor.device.__get__,
        torch.Tensor.requires_grad.__get__,
        torch.Tensor.is_floating_point,
        torch.Tensor.dim,
        torch.Tensor.size,
    }
)


@dataclass
class Tail:
    """A parked seat and the outputs it completes (rows [start, stop) of each, by batch)."""

    seat: Seat
    outputs: list[torch.Tensor]
    start: int
    stop: int

    def rows(self) -> tuple[int, int]:
        """(start, stop) of the rows the tail writes."""
        return self.start, self.stop

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        """Whether any of `tensors` is one of the outputs (by identity)."""
        return any(t is o for t in tensors for o in self.outputs)


_state = threading.local()


def set_pending(tail: Tail) -> None:
    """Register `tail` as this thread's pending tail (finishing any earlier one first)."""
    resolve_pending()
    _state.pending = tail


def take_pending(tensors: list[torch.Tensor]) -> Tail | None:
    """The pending tail if `tensors` (a layer's inputs) include its outputs, handed over to
    the caller, who must adopt it (`interleave(..., tail=)`) or finish it (`finish_tail`).
    Otherwise any pending tail is finished here and None returned."""
    tail = getattr(_state, "pending", None)
    if tail is not None and tail.holds(tensors):
        _state.pending = None
        return tail
    resolve_pending()
    return None


def finish_tail(tail: Tail | None) -> None:
    """Run a taken `tail` to its end (its rows written); re-raise its error."""
    if tail is not None:
        finish_seat(tail.seat)


def resolve_pending() -> None:
    """Finish this thread's pending tail, if any."""
    tail = getattr(_state, "pending", None)
    _state.pending = None
    finish_tail(tail)


def deferral_allowed() -> bool:
    """Whether a layer called now may leave a tail: inside a `deferral_scope`."""
    return getattr(_state, "depth", 0) > 0


def enter_deferral() -> None:
    """Open a deferral scope (see `deferral_scope`); for module pre-forward hooks."""
    _state.depth = getattr(_state, "depth", 0) + 1


def leave_deferral() -> None:
    """Close a deferral scope, finishing the pending tail; for module forward hooks."""
    _state.depth -= 1
    resolve_pending()


@contextlib.contextmanager
def deferral_scope() -> Iterator[None]:
    """Layers called inside may leave their last reduction running for the next layer; on
    leaving, the pending tail is finished."""
    enter_deferral()
    try:
        yield
    finally:
        leave_deferral()

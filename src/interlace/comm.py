"""The comm meter: every collective interlace issues goes through here and is counted.

Each call records the op name, the mesh group's name, the payload bytes (the tensor handed to the
collective) and the ring-model bytes one rank puts on the wire, plus wall time for blocking calls
when the meter is `timed`. Op names are the ones the planner's cost model uses: `all_reduce`,
`all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`, and `ring_pass` (one tensor handed to
the next rank of a ring while one arrives from the previous).

The collectives themselves are torch.distributed's (c10d for eager/async calls, functional
collectives for lazily-waited tensors); this module only adds the accounting, which torch lacks.
"""

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class Group:
    """A named process group of `size` ranks; `rank` is this process's index inside it."""

    name: str
    pg: dist.ProcessGroup
    size: int
    rank: int


Reduce = Callable[[torch.Tensor, Group], torch.Tensor]
"""How a sum over a group is computed: (x, group) → Σ_ranks x, a new tensor."""


def wire_bytes(op: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends under the ring algorithm for `op` on `payload` input bytes.

    all_reduce 2(p-1)/p·n; all_gather (p-1)·n (n = this rank's shard); reduce_scatter and
    all_to_all (p-1)/p·n; broadcast n (the root's view); ring_pass n.
    """
    p = group_size
    if p <= 1:
        return 0.0
    factors = {
        "all_reduce": 2 * (p - 1) / p,
        "all_gather": float(p - 1),
        "reduce_scatter": (p - 1) / p,
        "all_to_all": (p - 1) / p,
        "broadcast": 1.0,
        "ring_pass": 1.0,
    }
    return factors[op] * payload


class CommMeter:
    """Per-process counters of collectives, keyed by (group name, op)."""

    def __init__(self, timed: bool = False) -> None:
        self.timed = timed
        self.reset()

    def reset(self) -> None:
        """Forget everything counted so far."""
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._wire: dict[tuple[str, str], float] = defaultdict(float)
        self._seconds: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, op: str, group: Group, payload: int, seconds: float | None = None) -> None:
        """Count one call of `op` on `group` with `payload` bytes (and its time, if known)."""
        key = (group.name, op)
        self._calls[key] += 1
        self._bytes[key] += payload
        self._wire[key] += wire_bytes(op, payload, group.size)
        if seconds is not None:
            self._seconds[key] += seconds

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """{group: {op: {calls, bytes, wire_bytes, seconds}}} of everything counted since reset."""
        out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
        for key in sorted(self._calls):
            name, op = key
            out[name][op] = {
                "calls": self._calls[key],
                "bytes": self._bytes[key],
                "wire_bytes": self._wire[key],
                "seconds": self._seconds[key],
            }
        return dict(out)

    def bytes_per_group(self) -> dict[str, int]:
        """{group: payload bytes over all ops} since reset."""
        totals: dict[str, int] = defaultdict(int)
        for (name, _), nbytes in self._bytes.items():
            totals[name] += nbytes
        return dict(totals)


meter = CommMeter()
"""The process's default meter; pass another to any collective to count separately."""


def _run(op: str, group: Group, payload: int, call: Any, async_op: bool, m: CommMeter | None):
    m = meter if m is None else m
    if not (m.timed and not async_op):
        m.record(op, group, payload)
        return call()
    start = time.perf_counter()
    result = call()
    m.record(op, group, payload, time.perf_counter() - start)
    return result


def all_reduce(
    tensor: torch.Tensor,
    group: Group,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
    meter: CommMeter | None = None,
) -> dist.Work | None:
    """In-place all-reduce of `tensor` (any shape) over `group`."""
    return _run(
        "all_reduce",
        group,
        tensor.nbytes,
        lambda: dist.all_reduce(tensor, op=op, group=group.pg, async_op=async_op),
        async_op,
        meter,
    )


def all_reduce_flat_(
    tensors: list[torch.Tensor],
    group: Group,
    divisor: float = 1.0,
    wire_dtype: torch.dtype | None = None,
) -> None:
    """Sum the `tensors` (any shapes, one dtype) over `group` in one all-reduce of their
    concatenation (cast to `wire_dtype` if given), then divide by `divisor`, in place: one
    collective, not one per tensor."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(wire_dtype or tensors[0].dtype)
    if group.size > 1:
        all_reduce(flat, group)
    if divisor != 1:
        flat.div_(divisor)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        t.copy_(piece.view_as(t))


_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch's all-gather into one tensor, under the name of the installed torch (newer ones
deprecate `all_gather_into_tensor` for `all_gather_single`, with a warning on every call)."""


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: Group,
    async_op: bool = False,
    meter: CommMeter | None = None,
) -> dist.Work | None:
    """Gather `shard` [n, ...] from every rank into `output` [p·n, ...] (rank order)."""
    return _run(
        "all_gather",
        group,
        shard.nbytes,
        lambda: _gather_into_tensor(output, shard, group=group.pg, async_op=async_op),
        async_op,
        meter,
    )


def reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: Group,
    async_op: bool = False,
    meter: CommMeter | None = None,
) -> dist.Work | None:
    """Sum `tensor` [p·n, ...] over ranks; rank r keeps rows [r·n, (r+1)·n) in `output`. On
    gloo, synchronous, as `ring_reduce_scatter` (torch's runs a whole all-reduce there)."""

    def torchs() -> dist.Work | None:
        return dist.reduce_scatter_tensor(output, tensor, group=group.pg, async_op=async_op)

    def ring() -> None:
        output.copy_(ring_reduce_scatter(tensor.view(group.size, -1), group.pg).view_as(output))

    gloo = dist.get_backend(group.pg) == "gloo"
    call = ring if gloo and not async_op else torchs
    return _run("reduce_scatter", group, tensor.nbytes, call, async_op, meter)


def ring_reduce_scatter(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Σ over the n ranks of `group` of their `chunks[rank]` (chunks [n, S] on every rank) →
    [S], as a ring of n-1 point-to-point steps: each rank passes its running sum of one chunk
    to the next and adds its own piece to the chunk it receives, sending (n-1)/n of the buffer.

    Written here because gloo has no reduce-scatter: torch runs `reduce_scatter_tensor` on it as
    a whole all-reduce, sending twice that (NCCL's is a ring already)."""
    n, rank = chunks.shape[0], group.rank()
    after = dist.get_global_rank(group, (rank + 1) % n)
    before = dist.get_global_rank(group, (rank - 1) % n)
    running = chunks[(rank - 1) % n].clone()
    for step in range(n - 1):
        received = torch.empty_like(running)
        ops = [
            dist.P2POp(dist.isend, running, after, group),
            dist.P2POp(dist.irecv, received, before, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        running = received.add_(chunks[(rank - step - 2) % n])
    return running


def ring_pass(
    tensor: torch.Tensor, group: Group, tag: int = 0, meter: CommMeter | None = None
) -> tuple[torch.Tensor, list[dist.Work]]:
    """Send `tensor` to the next rank of `group` (index + 1, cyclic) and receive the previous
    rank's tensor of the same shape and dtype; returns (the receive buffer, the works to wait on
    before reading it or changing `tensor`). `tag` keeps two passes in flight at once apart."""
    received = torch.empty_like(tensor)
    after = dist.get_global_rank(group.pg, (group.rank + 1) % group.size)
    before = dist.get_global_rank(group.pg, (group.rank - 1) % group.size)
    ops = [
        dist.P2POp(dist.isend, tensor, after, group.pg, tag),
        dist.P2POp(dist.irecv, received, before, group.pg, tag),
    ]
    works = _run(
        "ring_pass", group, tensor.nbytes, lambda: dist.batch_isend_irecv(ops), True, meter
    )
    return received, works


def all_to_all(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: Group,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    async_op: bool = False,
    meter: CommMeter | None = None,
) -> dist.Work | None:
    """Exchange rows of `tensor` with every rank (uneven `*_splits` allowed) into `output`."""
    return _run(
        "all_to_all",
        group,
        tensor.nbytes,
        lambda: dist.all_to_all_single(
            output, tensor, output_splits, input_splits, group=group.pg, async_op=async_op
        ),
        async_op,
        meter,
    )


def broadcast(
    tensor: torch.Tensor,
    src_group_rank: int,
    group: Group,
    async_op: bool = False,
    meter: CommMeter | None = None,
) -> dist.Work | None:
    """Broadcast `tensor` from the rank with index `src_group_rank` inside `group`."""
    return _run(
        "broadcast",
        group,
        tensor.nbytes,
        lambda: dist.broadcast(tensor, group_src=src_group_rank, group=group.pg, async_op=async_op),
        async_op,
        meter,
    )


def lazy_all_reduce(
    tensor: torch.Tensor, group: Group, meter: CommMeter | None = None
) -> torch.Tensor:
    """Functional all-reduce (sum): returns a new tensor that waits only when first used, so
    compute issued in between overlaps the communication. No autograd: use it on values, not
    on activations that need gradients."""
    return _run(
        "all_reduce",
        group,
        tensor.nbytes,
        lambda: funcol.all_reduce(tensor, "sum", group.pg),
        True,
        meter,
    )


def ddp_allreduce_hook(group: Group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook equal to torch's default (average of the bucket over `group`), metered.

    Register with `ddp.register_comm_hook(group, ddp_allreduce_hook)`.
    """
    tensor = bucket.buffer()
    tensor.div_(group.size)
    work = all_reduce(tensor, group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


def ddp_hook_in(dtype: torch.dtype, hook: Callable) -> Callable:
    """The DDP comm hook `hook` run on its bucket cast to `dtype` (bf16: half the bytes), its
    result cast back into the bucket. Written here because torch's bf16_compress_wrapper does
    the same but DDP accepts it over NCCL only."""

    def hook_in_dtype(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        bucket.set_buffer(buffer.to(dtype))
        return hook(state, bucket).then(lambda fut: buffer.copy_(fut.value()))

    return hook_in_dtype

"""Cost terms of 3D tensor parallelism (`tp3d = (x, y, z)`), as `interlace.parallel.tensor3d.layers`
runs it, for `planner.step.step_terms` (`tensor3d_terms`).

Per transformer layer and micro-batch, with T = tokens / z on each rank and b bytes per element,
for every linear n_in → n_out (normal: q, k, v, up; transposed: out projection, down — the
"in" and "out" groups swap; `tensor3d.layer_wire_bytes` gives the same bytes on the wire):

- forward: all_gather of the weight over Z and all_reduce of the output [T, n_out/p_out] over
  the "in" group (exposed);
- backward: the weight gathered again over Z; the input gradient [T, n_in/p_in]
  all-reduced over the "out" group asynchronously while the dW matmul runs, so only
  max(0, all_reduce − dW) is exposed; the dW block [n_out/p_out, n_in/p_in] reduce-scattered
  over Z asynchronously, waited before the optimizer: hidden under the rest of the
  micro-batch's backward, exposed beyond it (under FSDP2, `dp_shard > 1`, waited inside the
  backward: exposed whole);
- recomputation replays the forward collectives of checkpointed layers;
- weight prefetch (`Overlap.tp3d_prefetch`, `tensor3d_prefetch`): each Z all-gather but the
  first of a pass (forward; backward with its recomputations) is issued while the linear
  before it in the pass computes, so only max(0, gather − that linear's compute) stays
  exposed (`prefetched_gathers`; forward matmul 2·T·n_in·n_out/(x·y) FLOPs, backward twice
  that), less the part `overlap_efficiency` does not hide; the rest is `hidden`. Without it
  every gather is exposed. Under FSDP2 (`dp_shard > 1`) nothing is prefetched across blocks:
  each block's first forward gather and last backward gather stay exposed;
- each of the block's two LayerNorms all-reduces [T, 2] statistics over X forward and
  backward; the first stage splits the embedding output over X and the last gathers the
  residual [T, d/x] over X before the replicated final norm;
- sequence parallelism over Y (`sequence_parallel`): the residual between blocks is
  [T/y, d/x]. Each block's entry all-gathers it over Y (forward) and reduce-scatters its
  gradient (backward), which replaces its normal layers' dX all-reduces over Y; each
  transposed layer reduce-scatters its output over Y (forward) and all-gathers its gradient
  (backward) in place of its all-reduce. Same bytes as the all-reduces, all exposed (the
  normal layers' dX reduction no longer hides under dW); the norms' statistics cover T/y
  tokens; the ends' gathers also cross Y ([T/y, d/x] of the embedding's gradient, [T/y, d]
  before the final norm). The y all-reduce of the norms' and transposed biases' gradients
  ([d/x] each) is not priced, as the z one of the blocks' norms;
- overlapped sub-batches (`tp_subbatches` s > 1): a layer without an MoE layer runs s
  sub-batches taking turns, handing over at each linear's output all-reduce and input-gradient
  all-reduce. Those become s all-reduces of 1/s the payload each, pooled with the replayed
  forward's, and hide under the other sub-batches' compute as 1D's do
  (`cost_tensor.exposed_under_subbatches`; each layer's last forward reduction, but the
  stage's last, under the next layer when `defers_block_boundary`); the norms' statistics are
  all-reduced once per sub-batch, exposed. With z > 1 the sub-batches share each linear's
  gathered block and reduce-scatter their summed dW once (`tensor3d.shared`): Z is priced
  as without sub-batches;
- the embedding and the LM head are split by vocabulary rows over the x·y ranks (`tp_xy`):
  the embedding's output [T, d] all-reduced there in the forward, the head's input gradient
  in the backward (the cross-entropy's [T] reductions are not priced, as under 1D); with
  z > 1 their weight gradients are summed over z (`ends_z_sum_seconds`, `tp_z.all_reduce`).

Groups sit in rank order x (stride 1), y (stride x), z (stride x·y). The embedding's and the
head's compute is divided by x·y·z, their weights by x·y.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interlace.models.config import GPTConfig
from interlace.parallel.tensor.options import defers_block_boundary
from interlace.plan import Plan
from interlace.planner.bytes import GRAD_BYTES
from interlace.planner.collective_cost import (
    CommTerms,
    collective_seconds,
    exposed_after_overlap,
    group_inside_node,
)
from interlace.planner.cost_tensor import exposed_under_subbatches
from interlace.planner.cost_work import StageWork
from interlace.planner.gemm import Linear, block_linears
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage


@dataclass(frozen=True)
class Layer3DCost:
    """Seconds of one layer's 3D-TP collectives per micro-batch, by comm-meter term:
    `exposed` on the critical path and `hidden` under compute; `forward` the share of
    `exposed` that a recomputation replays and `replay_hidden` the gather seconds it hides.
    Under sub-batches, `split` are the x and y all-reduces issued on the sub-batch threads
    (hidden or not by `tensor3d_terms`), `split_forward` their share a recomputation replays
    and `boundary` one sub-batch's last forward reduction (where the last sub-batch parks).
    With prefetch, `first_forward` / `first_backward` are the seconds `hidden` credits to the
    first linear's forward gather and the last linear's backward gather, which a pass
    starting there cannot hide."""

    exposed: dict[str, float]
    hidden: dict[str, float]
    forward: dict[str, float]
    replay_hidden: float = 0.0
    first_forward: float = 0.0
    first_backward: float = 0.0
    split: dict[str, float] = field(default_factory=dict)
    split_forward: dict[str, float] = field(default_factory=dict)
    boundary: float = 0.0


def _add(into: dict[str, float], key: str, seconds: float) -> None:
    if seconds:
        into[key] = into.get(key, 0.0) + seconds


def layer_cost(
    config: GPTConfig,
    tp3d: tuple[int, int, int],
    tokens: float,
    act_bytes: int,
    rate: float,
    hardware: Hardware,
    prefetch: bool = False,
    scatter_in_backward: bool = False,
    sequence_parallel: bool = False,
    subbatches: int = 1,
) -> Layer3DCost:
    """The collectives of one transformer layer per micro-batch of `tokens` tokens (before the
    split over z), `rate` FLOP/s per device, on `hardware`, the weight gathers prefetched
    under the neighbouring linear's compute when `prefetch`, the Z reduce-scatters waited
    inside the backward when `scatter_in_backward` (FSDP2), the sequence split over Y when
    `sequence_parallel`, run in `subbatches` interleaved sub-batches (see the module
    docstring)."""
    x, y, z = tp3d
    per_node = hardware.devices_per_node
    size = {"x": x, "y": y, "z": z}
    inside = {
        "x": group_inside_node(x, 1, per_node),
        "y": group_inside_node(y, x, per_node),
        "z": group_inside_node(z, x * y, per_node),
    }
    t = tokens / z
    exposed: dict[str, float] = {}
    hidden: dict[str, float] = {}
    forward: dict[str, float] = {}
    split: dict[str, float] = {}
    split_forward: dict[str, float] = {}
    scatter = boundary = 0.0
    linears = block_linears(config)
    gathers = prefetched_gathers(
        linears, tp3d, t, act_bytes, rate, hardware, prefetch, not scatter_in_backward
    )
    for lin, (gather, gather_f, gather_b) in zip(linears, gathers, strict=True):
        in_axis, out_axis = ("y", "x") if lin.transposed else ("x", "y")
        p_in, p_out = size[in_axis], size[out_axis]
        block = lin.n_in * lin.n_out / (x * y) * act_bytes

        def seconds(op: str, payload: float, axis: str) -> float:
            return collective_seconds(op, payload, size[axis], inside[axis], hardware)

        def pieces(payload: float, axis: str) -> float:  # one all-reduce per sub-batch
            return subbatches * seconds("all_reduce", payload / subbatches, axis)

        output = t * lin.n_out / p_out * act_bytes
        for into in (exposed, forward):
            _add(into, "tp_z.all_gather", gather_f)
        _add(exposed, "tp_z.all_gather", gather_b)  # the backward's gather
        _add(hidden, "tp_z.all_gather", 2 * gather - gather_f - gather_b)
        if sequence_parallel and lin.transposed:  # its output, then the next block's entry
            scatter_y = seconds("reduce_scatter", output, "y")
            gather_y = seconds("all_gather", output / y, "y")
            for into in (exposed, forward):
                _add(into, "tp_y.reduce_scatter", scatter_y)
                _add(into, "tp_y.all_gather", gather_y)
            _add(exposed, "tp_y.all_gather", gather_y)  # their backward
            _add(exposed, "tp_y.reduce_scatter", scatter_y)
        elif subbatches > 1:  # on the sub-batch threads
            for into in (split, split_forward):
                _add(into, f"tp_{in_axis}.all_reduce", pieces(output, in_axis))
            if size[in_axis] > 1:  # the layer's last hand-over in the forward so far
                boundary = seconds("all_reduce", output / subbatches, in_axis)
        else:
            out_reduce = seconds("all_reduce", output, in_axis)
            for into in (exposed, forward):
                _add(into, f"tp_{in_axis}.all_reduce", out_reduce)
        grad_in = t * lin.n_in / p_in * act_bytes
        if subbatches > 1:
            _add(split, f"tp_{out_axis}.all_reduce", pieces(grad_in, out_axis))
        elif not (sequence_parallel and out_axis == "y"):  # else the block entry's scatter
            dx = seconds("all_reduce", grad_in, out_axis)
            dw = 2 * t * lin.n_in * lin.n_out / (x * y) / rate
            dx_exposed = exposed_after_overlap(dx, max(0.0, dx - dw), hardware)
            _add(exposed, f"tp_{out_axis}.all_reduce", dx_exposed)
            _add(hidden, f"tp_{out_axis}.all_reduce", dx - dx_exposed)
        scatter += seconds("reduce_scatter", block, "z")
    backward = 4 * t * sum(s.n_in * s.n_out for s in linears) / (x * y) / rate
    scatter_exposed = (
        scatter
        if scatter_in_backward
        else exposed_after_overlap(scatter, max(0.0, scatter - backward), hardware)
    )
    _add(exposed, "tp_z.reduce_scatter", scatter_exposed)
    _add(hidden, "tp_z.reduce_scatter", scatter - scatter_exposed)
    rows = t / y if sequence_parallel else t
    stats = rows / subbatches * 2 * act_bytes  # each sub-batch's, waited on its thread
    norms = 2 * subbatches * collective_seconds("all_reduce", stats, x, inside["x"], hardware)
    _add(exposed, "tp_x.all_reduce", 2 * norms)
    _add(forward, "tp_x.all_reduce", norms)
    first, last = gathers[0], gathers[-1]
    replay_hidden = sum(whole - ahead for whole, ahead, _ in gathers)
    return Layer3DCost(
        exposed,
        hidden,
        forward,
        replay_hidden,
        first[0] - first[1],
        last[0] - last[2],
        split,
        split_forward,
        boundary,
    )


def prefetched_gathers(
    linears: tuple[Linear, ...],
    tp3d: tuple[int, int, int],
    t: float,
    act_bytes: int,
    rate: float,
    hardware: Hardware,
    prefetch: bool,
    across_blocks: bool = True,
) -> list[tuple[float, float, float]]:
    """Seconds of each linear's weight all-gather over Z for `t` tokens per rank: (the whole
    gather, exposed in forward, exposed in backward). Without `prefetch`, all exposed. With
    it, a gather flies while the linear before it in the pass computes: in forward the
    previous linear's forward matmul (2·t·n_in·n_out/(x·y) FLOPs), in backward the next
    linear's backward (twice that), the layers repeating (q follows the previous layer's
    down, unless not `across_blocks`: under FSDP2 a block's pieces are gathered in its own
    pre-forward and pre-backward, so its first linear's forward gather and its last one's
    backward gather are exposed), so the ideal exposed part is max(0, gather − that compute),
    of which `overlap_efficiency` of the rest hides."""
    x, y, z = tp3d
    inside = group_inside_node(z, x * y, hardware.devices_per_node)
    out = []
    for j, lin in enumerate(linears):
        block = lin.n_in * lin.n_out / (x * y) * act_bytes
        gather = collective_seconds("all_gather", block / z, z, inside, hardware)
        if not prefetch:
            out.append((gather, gather, gather))
            continue
        before, after = linears[j - 1], linears[(j + 1) % len(linears)]
        forward = 2 * t * before.n_in * before.n_out / (x * y) / rate
        backward = 4 * t * after.n_in * after.n_out / (x * y) / rate
        if not across_blocks:  # nothing to hide under at the block's edges
            forward = forward if j > 0 else 0.0
            backward = backward if j < len(linears) - 1 else 0.0
        forward_exposed, backward_exposed = (
            exposed_after_overlap(gather, max(0.0, gather - compute), hardware)
            for compute in (forward, backward)
        )
        out.append((gather, forward_exposed, backward_exposed))
    return out


def ends_seconds(
    config: GPTConfig,
    tp3d: tuple[int, int, int],
    tokens: float,
    act_bytes: int,
    hardware: Hardware,
    sequence_parallel: bool = False,
) -> tuple[dict[str, float], dict[str, float]]:
    """The collectives of the embedding and of the head per micro-batch, by term: the
    vocab-parallel [T, d] all-reduced over the x·y ranks (the embedding's forward, the head's
    backward) and the residual gathered (the head's forward, before the replicated final norm:
    [T, d/x] over X; under `sequence_parallel` [T/y, d/x] over X, then [T/y, d] over Y; the
    embedding's backward, its gradient: [T/y, d/x] over Y, then [T, d/x] over X)."""
    x, y, z = tp3d
    residual = tokens / z * config.d_model * act_bytes
    per_node = hardware.devices_per_node
    inside = group_inside_node(x * y, 1, per_node)
    reduce = {
        "tp_xy.all_reduce": collective_seconds("all_reduce", residual, x * y, inside, hardware)
    }
    inside_x, inside_y = group_inside_node(x, 1, per_node), group_inside_node(y, x, per_node)
    if not sequence_parallel:
        gather = {
            "tp_x.all_gather": collective_seconds("all_gather", residual / x, x, inside_x, hardware)
        }
        return {**reduce, **gather}, {**reduce, **gather}

    def gathers(x_shard: float, y_shard: float) -> dict[str, float]:
        return {
            "tp_x.all_gather": collective_seconds("all_gather", x_shard, x, inside_x, hardware),
            "tp_y.all_gather": collective_seconds("all_gather", y_shard, y, inside_y, hardware),
        }

    embed = gathers(residual / x, residual / (x * y))
    head = gathers(residual / (x * y), residual / y)
    return {**reduce, **embed}, {**reduce, **head}


def ends_z_sum_seconds(plan: Plan, stage: Stage, hardware: Hardware, shards: int) -> float:
    """Seconds of the all-reduce over z (z > 1, else 0) of the gradients every z slice holds
    alike, each fed its own rows: the embedding's and head's vocabulary rows, ends / (x·y)
    fp32 gradients per rank, or their FSDP2 shard of them (`shards` ranks). A hook sums them as
    backward makes them, each micro-batch; FSDP2's shards are summed once a step after its
    reduce-scatter (`grad_sums`). The blocks' norms and biases ([d] each) are left out."""
    if plan.tp3d is None or plan.tp3d[2] == 1:
        return 0.0
    x, y, z = plan.tp3d
    ends = (stage.params - stage.layer_params) / (x * y * shards)
    if not ends:
        return 0.0
    inside = group_inside_node(z, x * y, hardware.devices_per_node)
    return collective_seconds("all_reduce", ends * GRAD_BYTES, z, inside, hardware)


def tensor3d_terms(
    plan: Plan,
    stage: Stage,
    config: GPTConfig,
    tokens: int,
    act_bytes: int,
    work: StageWork,
    hardware: Hardware,
) -> CommTerms:
    """The 3D tensor parallel collectives of `stage` per micro-batch of `tokens` tokens (before
    the split over z) at `act_bytes` bytes per element, `work`'s compute and rate: its layers'
    `layer_cost` (checkpointed layers replaying their forward's; under `tp_subbatches` those
    without an MoE layer sub-batched, their x and y all-reduces hidden under the other
    sub-batches' compute as 1D's are, `cost_tensor.exposed_under_subbatches`), the first gather
    of each pass under prefetch, and the collectives of the model's ends (`ends_seconds`).
    `forward_calls` is the exposed seconds' forward share (`calls` 1); empty without 3D
    tensor parallelism."""
    if plan.tp3d is None:
        return CommTerms()
    exposed: dict[str, float] = {}
    hidden: dict[str, float] = {}
    split: dict[str, float] = {}
    prefetch, sequence = plan.overlap.tp3d_prefetch, plan.sequence_parallel
    sharded, s = plan.sharded_data_parallel, plan.overlap.tp_subbatches
    args = (config, plan.tp3d, tokens, act_bytes, work.rate, hardware, prefetch, sharded, sequence)
    layer = layer_cost(*args)
    split_layers = stage.n_layers - stage.n_moe if s > 1 else 0  # MoE layers run whole
    kinds = [(layer, stage.n_layers - split_layers)]
    if split_layers:
        kinds.append((layer_cost(*args, subbatches=s), split_layers))
    forward = split_forward = 0.0
    for cost, count in kinds:
        checkpointed = stage.n_checkpointed * count / stage.n_layers if stage.n_layers else 0
        for key, seconds in cost.exposed.items():
            exposed[key] = exposed.get(key, 0.0) + count * seconds
        for key, seconds in cost.forward.items():
            exposed[key] = exposed.get(key, 0.0) + checkpointed * seconds
            forward += (count + checkpointed) * seconds
        for key, seconds in cost.hidden.items():
            hidden[key] = hidden.get(key, 0.0) + count * seconds
        for key, seconds in cost.split.items():
            split[key] = split.get(key, 0.0) + count * seconds
        for key, seconds in cost.split_forward.items():
            split[key] += checkpointed * seconds
            split_forward += (count + checkpointed) * seconds
    pool = sum(split.values())
    if pool:
        boundary = 0.0
        if defers_block_boundary(plan):  # each forward boundary but the stage's last hides
            boundary = max(0, split_layers - 1) * kinds[-1][0].boundary
        share = exposed_under_subbatches(pool, s, boundary, work, hardware) / pool
        for key, seconds in split.items():
            exposed[key] = exposed.get(key, 0.0) + share * seconds
            hidden[key] = hidden.get(key, 0.0) + (1 - share) * seconds
        forward += share * split_forward
    if prefetch and stage.n_layers:
        # the first gather of the forward and of the backward pass has nothing to hide under;
        # a checkpointed stage's backward starts with the recomputed first linear
        gather = "tp_z.all_gather"
        replayed = stage.n_checkpointed * layer.replay_hidden
        start = layer.first_forward
        start += layer.first_forward if stage.n_checkpointed else layer.first_backward
        if replayed + start:
            exposed[gather] = exposed.get(gather, 0.0) + start
            hidden[gather] = hidden.get(gather, 0.0) + replayed - start
            forward += layer.first_forward
    embed, head = ends_seconds(config, plan.tp3d, tokens, act_bytes, hardware, sequence)
    for held, end in ((stage.has_embed, embed), (stage.has_head, head)):
        for key, seconds in end.items():
            if held and seconds:
                exposed[key] = exposed.get(key, 0.0) + seconds
    reduce = "tp_xy.all_reduce"  # the embedding's forward; the head's backward
    forward += stage.has_embed * embed[reduce] + stage.has_head * (
        sum(head.values()) - head[reduce]
    )
    if not plan.sharded_data_parallel:  # FSDP2's shards sum once a step (`cost_data`)
        z_sum = ends_z_sum_seconds(plan, stage, hardware, shards=1)
        if z_sum:
            exposed["tp_z.all_reduce"] = z_sum
    total = sum(exposed.values())
    return CommTerms(exposed, hidden, forward / total if total else 0.0, 1.0)

"""3D tensor parallelism with the Z all-gathers of weights prefetched one layer ahead.

Parallel equals serial with prefetch on (the default) after two SGD steps, through the helpers of
`test_tensor3d.py`. A traced run logs, on every rank, each Z all-gather (whose weight, async or
not, in forward or backward) and when each 3D linear's forward and backward begin, and counts
the comm meter per step, with prefetch on and off: from the second step on, every gather but the
first of each half of the pass is issued while the layer before computes, before its own layer
begins; the bytes, call counts and gradients stay those of prefetch off and of the serial model,
also with recomputed (activation-checkpointed) blocks and for a no-grad evaluation forward.
"""

import copy
import functools
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import assert_grads_close
from interlace import comm
from interlace.errors import PlanError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.parallel.parallelize import parallelize
from interlace.parallel.tensor3d.layers import Linear3D, layer_wire_bytes
from interlace.parallel.tensor3d.prefetch import in_backward
from interlace.plan import Overlap, Plan
from interlace.testing import run_ranks
from test_tensor3d import ATOL, B, T, _assert_equal_to_serial, _batch, _expected_piece, _serial_run

PREFETCH_LINE = "weights all-gathered over z one layer ahead (prefetch)"


@pytest.mark.parametrize("tp3d", [(1, 1, 2), (2, 1, 2)])
def test_prefetched_3d_equals_serial(tp3d):
    for result in _assert_equal_to_serial(tp3d):
        assert any(line.endswith(PREFETCH_LINE) for line in result["report"])


# ----------------------------------------------------------------------------- traced runs


def _checkpoint_blocks(model: nn.Module) -> None:
    """Recompute every block in backward (torch's non-reentrant activation checkpointing)."""
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _traced_steps(model: nn.Module, ref: dict, tp3d: tuple, prefetch: bool, recompute: bool):
    """Two SGD steps and one no-grad forward of the 3D model; per step the event log, the comm
    meter's calls and wire bytes, and the largest differences from the serial run."""
    plan = Plan(tp3d=tp3d, overlap=Overlap(tp3d_prefetch=prefetch))
    mesh = build_mesh(plan)
    par = parallelize(copy.deepcopy(model), plan, mesh)
    if recompute:
        _checkpoint_blocks(par.model)
    at = {a: (mesh.rank(f"tp_{a}"), mesh.size(f"tp_{a}")) for a in "xyz"}
    linears = {n: m for n, m in par.model.named_modules() if isinstance(m, Linear3D)}
    owner = {m.weight.data_ptr(): n for n, m in linears.items()}
    events: list[tuple] = []
    for name, layer in linears.items():
        layer.register_forward_pre_hook(
            lambda m, a, n=name: events.append(("use", n, in_backward()))
        )
        layer.register_forward_hook(functools.partial(_log_backward_use, events, name))
    real = comm.all_gather

    def logged(output, shard, group, async_op=False, meter=None):
        if group.name == "tp_z" and shard.data_ptr() in owner:
            events.append(("gather", owner[shard.data_ptr()], in_backward(), async_op))
        return real(output, shard, group, async_op=async_op, meter=meter)

    opt = torch.optim.SGD(par.model.parameters(), lr=0.1, momentum=0.9)
    steps: list[dict] = []
    with mock.patch.object(comm, "all_gather", logged):
        for step in range(len(ref["losses"]) + 1):
            events.clear()
            comm.meter.reset()
            tokens = _batch(step)
            errors = {}
            if step < len(ref["losses"]):
                loss = par.forward_backward(tokens[:, :-1], tokens[:, 1:])
                errors["loss"] = (loss - ref["losses"][step]).abs().item()
                grads = {name: p.grad for name, p in par.model.named_parameters()}
                expected = {n: _expected_piece(n, ref["grads"][step][n], at) for n in grads}
                assert_grads_close(grads, expected, what=f"rank {at} step {step}")
                opt.step()
                opt.zero_grad()
            else:
                par.evaluate(tokens[:, :-1], tokens[:, 1:])
            meter = {
                (g, op): (v["calls"], v["wire_bytes"])
                for g, ops in comm.meter.snapshot().items()
                for op, v in ops.items()
            }
            steps.append({"events": list(events), "meter": meter, "errors": errors})
    return {"steps": steps, "linears": list(linears)}


def _log_backward_use(events: list, name: str, module: nn.Module, args: tuple, out: torch.Tensor):
    """Log ("use", name, True) when the gradient of the layer's output arrives in backward."""
    if out.requires_grad and not in_backward():
        out.register_hook(lambda grad: events.append(("use", name, True)))


def _run_modes(recompute: bool, tp3d: tuple = (1, 1, 2)) -> dict[bool, list[dict]]:
    model, ref = _serial_run()
    world = tp3d[0] * tp3d[1] * tp3d[2]
    return {
        prefetch: run_ranks(world, _traced_steps, model, ref, tp3d, prefetch, recompute)
        for prefetch in (True, False)
    }


def _uses_and_gathers(events: list[tuple], backward: bool) -> tuple[list, list]:
    """[(position, layer)] of the layer uses and [(position, layer, async)] of the gathers in
    one half of a pass, in order."""
    uses = [(i, e[1]) for i, e in enumerate(events) if e[0] == "use" and e[2] == backward]
    gathers = [
        (i, e[1], e[3]) for i, e in enumerate(events) if e[0] == "gather" and e[2] == backward
    ]
    return uses, gathers


def _assert_ahead(events: list[tuple], prefetched: bool) -> None:
    """Each half of the pass: the j-th gather serves the j-th layer use. Prefetched: gather j > 0
    is async, issued after use j−1 began and before use j begins; else every gather is
    synchronous and issued once its use has begun."""
    for backward in (False, True):
        uses, gathers = _uses_and_gathers(events, backward)
        assert [u[1] for u in uses] == [g[1] for g in gathers]
        for j, ((use_at, _), (gather_at, name, is_async)) in enumerate(
            zip(uses, gathers, strict=True)
        ):
            if prefetched and j > 0:
                assert uses[j - 1][0] < gather_at < use_at and is_async, (backward, j, name)
            else:
                assert use_at < gather_at and not is_async, (backward, j, name)


@pytest.fixture(scope="module")
def plain_runs() -> dict[bool, list[dict]]:
    return _run_modes(recompute=False)


@pytest.fixture(scope="module")
def recomputed_runs() -> dict[bool, list[dict]]:
    return _run_modes(recompute=True)


def test_each_gather_is_issued_one_layer_ahead(plain_runs):
    for prefetch, ranks in plain_runs.items():
        for rank in ranks:
            first, second, evaluation = rank["steps"]
            _assert_ahead(first["events"], prefetched=False)  # the first pass records
            _assert_ahead(second["events"], prefetched=prefetch)
            _assert_ahead(evaluation["events"], prefetched=prefetch)


def test_recomputed_layers_are_prefetched_too(recomputed_runs):
    """Recomputation gathers inside backward (a block's forward again, then its backward): from
    the second step on, all but the first gather of each half of the pass are async."""
    for prefetch, ranks in recomputed_runs.items():
        for rank in ranks:
            for step, expect_async in zip(rank["steps"], (False, prefetch, prefetch), strict=True):
                for backward in (False, True):
                    _, gathers = _uses_and_gathers(step["events"], backward)
                    assert [g[2] for g in gathers] == [
                        expect_async and j > 0 for j in range(len(gathers))
                    ]


@pytest.mark.parametrize("runs", ["plain_runs", "recomputed_runs"])
def test_gradients_and_bytes_are_unchanged_by_prefetch(runs, request):
    by_mode = request.getfixturevalue(runs)
    for on, off in zip(by_mode[True], by_mode[False], strict=True):
        for step_on, step_off in zip(on["steps"], off["steps"], strict=True):
            assert step_on["meter"] == step_off["meter"]
            bad = {k: v for k, v in step_on["errors"].items() if not v <= ATOL}
            assert not bad, f"differs from serial with prefetch: {bad}"


def test_gathers_per_step_follow_the_formula(plain_runs, recomputed_runs):
    cfg = get_preset("tiny")
    d, f, tokens, tp3d = cfg.d_model, cfg.ffn_dim, B * T // 2, (1, 1, 2)
    shapes = [(d, d, False)] * 3 + [(d, d, True), (d, f, False), (f, d, True)]
    z_bytes = cfg.n_layers * sum(
        layer_wire_bytes(*s[:2], tokens, tp3d, s[2])["tp_z"] for s in shapes
    )
    per_layer = {"plain": 2, "recomputed": 3, "evaluation": 1}  # forward, (recompute), backward
    for kind, runs in (("plain", plain_runs), ("recomputed", recomputed_runs)):
        for rank in runs[True]:
            linears = len(rank["linears"])
            _, second, evaluation = rank["steps"]
            assert second["meter"][("tp_z", "all_gather")][0] == per_layer[kind] * linears
            assert evaluation["meter"][("tp_z", "all_gather")][0] == linears
            if kind == "plain":  # AxoNN: 2 all-gathers and 1 reduce-scatter of every block
                got = second["meter"][("tp_z", "all_gather")][1]
                got += second["meter"][("tp_z", "reduce_scatter")][1]
                assert got == pytest.approx(z_bytes)


def test_prefetch_switch_is_checked():
    plan = Plan.parse("tp3d=1x1x2,tp3d_prefetch=false")
    assert plan.overlap.tp3d_prefetch is False and Plan.parse(str(plan)) == plan
    with pytest.raises(PlanError, match="tp3d_prefetch=false applies to 3D tensor parallelism"):
        Plan.parse("dp=2,tp3d_prefetch=false").validate(2)
    with pytest.raises(PlanError, match="tp3d_prefetch=2 must be true or false"):
        Plan(tp3d=(1, 1, 2), overlap=Overlap(tp3d_prefetch=2)).validate(2)

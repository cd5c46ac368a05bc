"""Block-boundary overlap of sub-batched tensor parallelism: a layer's last all-reduce flies
under the next layer's first compute (`tp_interleave`'s pending tail), and nothing reads the
rows it has not written yet.

Each case runs tp=2 with k sub-batches on forked ranks and compares with the serial model built
from the same seed (fp32, loss and every gradient), and logs the order in which the layers'
parts run on the sub-batch threads.
"""

import copy
import threading

import pytest
import torch
from torch import nn

from helpers import assert_grads_close
from interlace.errors import PlanError
from interlace.loss import causal_lm_loss
from interlace.mesh import build_mesh
from interlace.models.gpt import build_model
from interlace.models.presets import get_preset
from interlace.parallel.detect import find_structure
from interlace.parallel.parallelize import parallelize
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.tensor import interleave as tp_interleave
from interlace.parallel.tensor import overlap
from interlace.parallel.tensor import reduction as tp_reduction
from interlace.parallel.tensor.shard import shard_of, shard_spec
from interlace.plan import Overlap, Plan
from interlace.testing import run_ranks
from test_context_parallel import _steps

B, T = 4, 16
ATOL = 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(get_preset("tiny"))


def _tokens() -> torch.Tensor:
    vocab = get_preset("tiny").vocab_size
    return torch.randint(0, vocab, (B, T + 1), generator=torch.Generator().manual_seed(0))


def _serial() -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    model = _model()
    initial = copy.deepcopy(model)
    tokens = _tokens()
    loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:], model)
    loss.backward()
    return initial, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _split(model: nn.Module, k: int) -> Parallelized:
    structure = find_structure(model)
    plan = Plan(tp=2)
    par = parallelize(model, plan, build_mesh(plan))
    overlap.apply_tp_overlap(par.model, structure, k)
    return par


def _parallel_loss(par: Parallelized) -> torch.Tensor:
    """The split model's loss of the batch: its logits (this rank's vocabulary slice) scored by
    the plan's vocabulary-parallel loss."""
    tokens = _tokens()
    return par.loss(par.module(tokens[:, :-1]), tokens[:, 1:])


def _errors(model: nn.Module, loss, loss_ref, grads_ref) -> dict[str, float]:
    group = build_mesh(Plan(tp=2)).group("tp")
    errors = {"loss": (loss.detach() - loss_ref).abs().item()}
    grads, expected = {}, {}
    for name, p in model.named_parameters():
        spec, ref = shard_spec(p), grads_ref[name]
        grads[name] = p.grad
        expected[name] = ref if spec is None else shard_of(ref, spec, group.rank, group.size)
    assert_grads_close(grads, expected, what=f"tp rank {group.rank}")
    return errors


def _counted(counts: dict[str, int]) -> None:
    """Count, in `counts`, the runs that left a tail and the runs that adopted one."""
    interleave = tp_interleave.interleave

    def counting(calls, tail=None, may_park=False):
        results, parked = interleave(calls, tail, may_park)
        counts["adopted"] += tail is not None
        counts["parked"] += parked is not None
        return results, parked

    overlap.interleave = counting


def _step(model: nn.Module, loss_ref, grads_ref, k: int) -> dict:
    par = _split(model, k)
    model = par.model
    counts = {"adopted": 0, "parked": 0}
    _counted(counts)
    log: list[tuple[str, str]] = []
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_pre_hook(
            lambda *_, i=i: log.append((f"attn{i}", threading.current_thread().name))
        )
        block.mlp.register_forward_hook(
            lambda *_, i=i: log.append((f"mlp{i} done", threading.current_thread().name))
        )
    loss = _parallel_loss(par)
    loss.backward()
    return {"errors": _errors(model, loss, loss_ref, grads_ref), "counts": counts, "log": log}


@pytest.mark.parametrize("k", [2, 4])
def test_each_layer_leaves_its_last_reduction_to_the_next_and_equals_serial(k):
    model, loss, grads = _serial()
    for result in run_ranks(2, _step, model, loss, grads, k):
        bad = {name: e for name, e in result["errors"].items() if not e <= ATOL}
        assert not bad, bad
        layers = len(model.blocks)
        # every layer parks its last sub-batch; every layer but the first adopts one
        assert result["counts"] == {"parked": layers, "adopted": layers - 1}
        log = result["log"]
        # layer 0's last sub-batch finishes its MLP (its all-reduce waited on) only after
        # layer 1's first sub-batch has started its attention
        finished = [i for i, (event, _) in enumerate(log) if event == "mlp0 done"]
        started = [i for i, (event, _) in enumerate(log) if event == "attn1"]
        assert len(finished) == len(started) == k
        assert started[0] < finished[-1]
        assert all(f < started[0] for f in finished[:-1])


def _inference(model: nn.Module, k: int) -> dict:
    par = _split(model, k)
    counts = {"adopted": 0, "parked": 0}
    _counted(counts)
    with torch.no_grad():
        logits = par.module(_tokens()[:, :-1])  # this rank's vocabulary slice
    return {"logits": logits, "counts": counts}


def test_inference_without_autograd_defers_and_equals_serial():
    model = _model()
    with torch.no_grad():
        expected = model(_tokens()[:, :-1])
    for rank, out in enumerate(run_ranks(2, _inference, copy.deepcopy(model), 2)):
        assert out["counts"] == {"parked": len(model.blocks), "adopted": len(model.blocks) - 1}
        width = out["logits"].shape[-1]
        local = expected[..., rank * width : (rank + 1) * width]
        torch.testing.assert_close(out["logits"], local, atol=ATOL, rtol=0)


def _block_input() -> torch.Tensor:
    return torch.randn(B, T, get_preset("tiny").d_model, generator=torch.Generator().manual_seed(1))


def _other_uses(model: nn.Module, k: int) -> dict:
    """Layers called by hand inside a deferral scope, the output used in between."""
    model = _split(model, k).model
    x = _block_input()
    out: dict = {}
    with torch.no_grad(), tp_interleave.deferral_scope():
        y = model.blocks[0](x)
        out["pending"] = isinstance(y, tp_interleave.Pending)
        out["shape"] = tuple(y.shape)  # metadata: must not finish the tail
        out["still_pending"] = getattr(tp_interleave._state, "pending", None) is not None
        out["doubled"] = y * 2  # any operation: the tail finishes first
        out["after_op"] = getattr(tp_interleave._state, "pending", None) is not None
        out["next"] = model.blocks[1](y)
    out["left_scope"] = getattr(tp_interleave._state, "pending", None) is not None
    out["next"] = out["next"].as_subclass(torch.Tensor)  # finished when the scope was left
    return out


def test_any_other_use_of_a_pending_output_finishes_the_tail_first():
    model = _model()
    x = _block_input()
    with torch.no_grad():  # the serial blocks
        first = model.blocks[0](x)
        second = model.blocks[1](first)
    for out in run_ranks(2, _other_uses, model, 2):
        assert out["pending"] and out["shape"] == (B, T, 64) and out["still_pending"]
        assert not out["after_op"] and not out["left_scope"]
        torch.testing.assert_close(out["doubled"], 2 * first, atol=ATOL, rtol=0)
        torch.testing.assert_close(out["next"], second, atol=ATOL, rtol=0)


def test_a_failing_tail_raises_on_the_caller():
    def failing() -> None:
        tp_reduction._yield_point.switch()  # as after an async all-reduce: the lone seat parks
        raise ValueError("late failure")

    results, parked = tp_interleave.interleave([failing], may_park=True)
    assert results == [None] and parked is not None
    with pytest.raises(ValueError, match="late failure"):
        tp_interleave.finish_seat(parked)


def _through_parallelize(model: nn.Module, loss_ref, grads_ref, boundary: bool) -> dict:
    """One step of the plan's tp=2, 2 sub-batches: errors against serial and runs parked."""
    plan = Plan(tp=2, overlap=Overlap(tp_subbatches=2, tp_block_boundary=boundary))
    par = parallelize(model, plan, build_mesh(plan))
    counts = {"adopted": 0, "parked": 0}
    _counted(counts)
    loss = _parallel_loss(par)
    loss.backward()
    return {"errors": _errors(par.model, loss, loss_ref, grads_ref), "parked": counts["parked"]}


def test_the_plan_switches_the_block_boundary_step():
    model, loss, grads = _serial()
    layers = len(model.blocks)
    for boundary, parked in [(True, layers), (False, 0)]:
        for result in run_ranks(2, _through_parallelize, model, loss, grads, boundary):
            bad = {name: e for name, e in result["errors"].items() if not e <= ATOL}
            assert not bad, f"tp_block_boundary={boundary}: {bad}"
            assert result["parked"] == parked, f"tp_block_boundary={boundary}"
    with pytest.raises(PlanError, match="tp_block_boundary=false applies"):
        Plan.parse("tp=2,tp_block_boundary=false").validate(2)


@pytest.mark.parametrize(
    "plan_text", ["dp_shard=2,tp=2", pytest.param("dp_shard=2,tp3d=2x1x1", marks=pytest.mark.slow)]
)
def test_under_fsdp2_each_layer_waits_for_its_own_reductions(plan_text):
    # FSDP2 reshards a layer's weights when its forward returns: a parked reduction's thread
    # would then run the layer's bias add on the shard, so under dp_shard no layer defers
    plan_text += ",tp_subbatches=2"
    serial = _steps("dp=1", 1)
    for rank, result in enumerate(run_ranks(4, _steps, plan_text, 4)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        overlapped = next(line for line in result["report"] if "sub-batches" in line)
        assert "under the next layer" not in overlapped, rank


def _seat_threads() -> set[int]:
    seen: set[int] = set()

    def call() -> None:
        seen.add(threading.get_ident())
        tp_reduction._yield_point.switch()

    tp_interleave.run_interleaved([call, call])
    return seen


def test_seats_run_on_kept_threads_also_after_fork():
    first = _seat_threads()
    assert len(first) == 2 and threading.get_ident() not in first
    assert _seat_threads() == first  # the same threads serve the next run
    # a forked child has none of the parent's threads; its runs must not wait on them
    (child,) = run_ranks(1, _seat_threads, timeout=20)
    assert len(child) == 2


def _pipeline_parks(model: nn.Module) -> int:
    """Runs that left a tail in one step of pp=2 × tp=2 with 2 sub-batches, on this rank."""
    plan = Plan(
        tp=2, pp=2, micro_batches=2, overlap=Overlap(tp_subbatches=2, tp_block_boundary=True)
    )
    par = parallelize(model, plan, build_mesh(plan))
    counts = {"adopted": 0, "parked": 0}
    _counted(counts)
    tokens = _tokens()
    par.forward_backward(tokens[:, :-1], tokens[:, 1:])
    return counts["parked"]


def test_pipeline_stages_leave_each_layer_s_last_reduction_to_the_next():
    """A stage runs its blocks outside the model's forward; the deferral scope tensor
    parallelism adds to its forward scopes lets each layer's last all-reduce fly under the
    next layer there too (without it no run parks, and the result is the same)."""
    for parked in run_ranks(4, _pipeline_parks, _model()):
        assert parked > 0

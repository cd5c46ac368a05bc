"""Overlapped tensor parallelism (`tp_subbatches`): parallel equals serial, same bytes.

Every rank builds the serial model from one seed, splits a copy with 1D tensor parallelism and
makes its layers run k interleaved sub-batches; the loss and every gradient must equal the
serial model's in fp32, and the metered all-reduce bytes must equal plain TP's.
"""

import copy
import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import assert_grads_close
from hf_models import needs_hf, tiny_hf_model
from interlace import comm
from interlace.errors import PlanError
from interlace.loss import causal_lm_loss
from interlace.mesh import build_mesh
from interlace.models.gpt import build_model
from interlace.models.presets import get_preset
from interlace.parallel.detect import find_structure
from interlace.parallel.parallelize import parallelize
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.replay import ReductionReplay
from interlace.parallel.tensor import reduction as tp_reduction
from interlace.parallel.tensor.interleave import run_interleaved
from interlace.parallel.tensor.overlap import apply_tp_overlap
from interlace.parallel.tensor.shard import shard_of, shard_spec
from interlace.plan import Overlap, Plan
from interlace.testing import run_ranks

B, T, VOCAB, D, LAYERS = 4, 16, 256, 64, 2
ATOL = 1e-5


def _build(kind: str) -> nn.Module:
    if kind == "gpt":
        torch.manual_seed(0)
        return build_model(get_preset("tiny"))
    return tiny_hf_model(kind, D, LAYERS, VOCAB, positions=64)


def _loss(
    kind: str, model: nn.Module, tokens: torch.Tensor, par: Parallelized | None = None
) -> torch.Tensor:
    """The serial model's loss of one batch, or (`par`) the split one's: the built-in GPT's
    logits (this rank's vocabulary slice) scored by the plan's loss; a Hugging Face model's by
    its own `labels` loss, on logits its split head gathers (`_gathers_logits`)."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    if kind == "gpt":
        return causal_lm_loss(model(x), y, model) if par is None else par.loss(par.module(x), y)
    module = model if par is None else par.module
    return module(input_ids=x, labels=x, use_cache=False).loss


def _gathers_logits(kind: str) -> bool:
    """Hugging Face models score full logits with their own loss; the built-in GPT's vocabulary
    slices go to the plan's vocabulary-parallel loss."""
    return kind != "gpt"


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(0))


def _serial(kind: str) -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    model = _build(kind)
    initial = copy.deepcopy(model)
    loss = _loss(kind, model, _tokens())
    loss.backward()
    return initial, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _parallel_step(model: nn.Module, kind: str, tp: int, k: int) -> tuple[torch.Tensor, dict]:
    """Loss and metered all-reduces of one forward + backward under tp (k > 1: overlapped)."""
    structure = find_structure(model)
    plan = Plan(tp=tp)
    mesh = build_mesh(plan)
    par = parallelize(model, plan, mesh, gather_logits=_gathers_logits(kind))
    report = apply_tp_overlap(model, structure, k)
    assert (len(report) == 1) == (k > 1), report
    comm.meter.reset()
    loss = _loss(kind, model, _tokens(), par)
    loss.backward()
    return loss.detach(), comm.meter.snapshot()["tp"]["all_reduce"]


def _compare(model: nn.Module, loss_ref, grads_ref, kind: str, tp: int, k: int) -> dict:
    plain = copy.deepcopy(model)
    loss, reduced = _parallel_step(model, kind, tp, k)
    _, plain_reduced = _parallel_step(plain, kind, tp, 1)
    group = build_mesh(Plan(tp=tp)).group("tp")
    errors = {"loss": (loss - loss_ref).abs().item()}
    grads, expected = {}, {}
    for name, p in model.named_parameters():
        spec, ref = shard_spec(p), grads_ref[name]
        grads[name] = p.grad
        expected[name] = ref if spec is None else shard_of(ref, spec, group.rank, group.size)
    assert_grads_close(grads, expected, what=f"tp rank {group.rank}")
    return {"errors": errors, "reduced": reduced, "plain": plain_reduced}


CASES = [
    ("gpt", 2, 2),
    ("gpt", 2, 4),
    ("gpt", 4, 2),
    ("gpt", 4, 4),
    pytest.param("gpt2", 2, 2, marks=needs_hf),
    pytest.param("llama", 2, 2, marks=needs_hf),
    pytest.param("llama", 2, 4, marks=needs_hf),
]


@pytest.mark.parametrize(("kind", "tp", "k"), CASES)
def test_overlapped_tp_equals_serial_with_the_same_bytes(kind, tp, k):
    model, loss, grads = _serial(kind)
    for rank, result in enumerate(run_ranks(tp, _compare, model, loss, grads, kind, tp, k)):
        bad = {name: e for name, e in result["errors"].items() if not e <= ATOL}
        assert not bad, f"rank {rank} differs from serial: {bad}"
        got, plain = result["reduced"], result["plain"]
        assert got["bytes"] == plain["bytes"]
        # every all-reduce inside a layer (attention and MLP, forward and backward) is k-fold
        assert got["calls"] - plain["calls"] == (k - 1) * 4 * LAYERS


def test_interleaved_calls_take_turns_at_each_reduction():
    log: list[str] = []

    def call(i: int) -> int:
        log.append(f"attn {i}")
        tp_reduction._yield_point.switch()  # what reduce_from_tp does after issuing its all-reduce
        log.append(f"mlp {i}")
        tp_reduction._yield_point.switch()
        log.append(f"done {i}")
        return i

    assert run_interleaved([lambda i=i: call(i) for i in range(3)]) == [0, 1, 2]
    assert log == [f"{part} {i}" for part in ("attn", "mlp", "done") for i in range(3)]
    with pytest.raises(ValueError, match="boom"):
        run_interleaved([lambda: None, lambda: int("boom")])


def _backward_reductions(model: nn.Module, tp: int, k: int) -> list[tuple[bool, int]]:
    """(issued async?, rows) of every tp all-reduce during the backward of one step."""
    plan = Plan(tp=tp, overlap=Overlap(tp_subbatches=k))
    par = parallelize(model, plan, build_mesh(plan))
    loss = _loss("gpt", model, _tokens(), par)
    log: list[tuple[bool, int]] = []
    issue = comm.all_reduce

    def logged(tensor, group, *args, **kwargs):
        if group.name == "tp":
            log.append((bool(kwargs.get("async_op")), tensor.shape[0]))
        return issue(tensor, group, *args, **kwargs)

    comm.all_reduce = logged
    try:
        loss.backward()
    finally:
        comm.all_reduce = issue
    return log


def test_backward_input_gradient_reductions_are_interleaved_over_sub_batches():
    k = 2
    log = run_ranks(2, _backward_reductions, _build("gpt"), 2, k)[0]
    inside = [entry for entry in log if entry[0]]
    # each layer's two copy_to_tp reductions (MLP and attention input), once per sub-batch,
    # issued async with the sub-batch's rows; the rest (LM head input) stays synchronous
    assert inside == [(True, B // k)] * (2 * LAYERS * k)
    assert all(rows == B for is_async, rows in log if not is_async)


def test_refuses_sequence_parallel_and_models_whose_every_layer_routes():
    with pytest.raises(PlanError, match="sequence_parallel"):
        apply_tp_overlap(_build("gpt"), find_structure(_build("gpt")), 2, sequence_parallel=True)
    every = build_model(dataclasses.replace(get_preset("moe-tiny"), moe_every=1))
    with pytest.raises(PlanError, match="every layer holds one"):
        apply_tp_overlap(every, find_structure(every), 2)
    moe = build_model(get_preset("moe-tiny"))  # layer 1 routes: it runs whole
    (line,) = apply_tp_overlap(moe, find_structure(moe), 2)
    assert "1 modules" in line and not hasattr(moe.blocks[1], "_interlace_tp_subbatches")


def _through_parallelize(model: nn.Module, loss_ref, grads_ref, plan: Plan) -> dict:
    """The report and the errors against serial of one step of `plan` applied by parallelize."""
    par = parallelize(model, plan, build_mesh(plan))
    group = build_mesh(plan).group("tp")
    loss = _loss("gpt", model, _tokens(), par)
    loss.backward()
    grads, expected = {}, {}
    for name, p in par.model.named_parameters():
        spec, ref = shard_spec(p), grads_ref[name]
        grads[name] = p.grad
        expected[name] = ref if spec is None else shard_of(ref, spec, group.rank, group.size)
    assert_grads_close(grads, expected, what=f"tp rank {group.rank}")
    return {"report": par.report, "loss": (loss.detach() - loss_ref).abs().item()}


def _refusal(plan: Plan) -> str:
    with pytest.raises(PlanError) as err:
        parallelize(_build("gpt"), plan, build_mesh(plan))
    return str(err.value)


def test_parallelize_refuses_tp_subbatches_without_tp():
    message = run_ranks(1, _refusal, Plan(overlap=Overlap(tp_subbatches=2)))[0]
    assert message == (
        "tp_subbatches=2 overlaps tensor parallel all-reduces: it needs tp > 1 (or a tp3d grid "
        "of more than one rank) and no sequence_parallel"
    )


def test_parallelize_applies_tp_subbatches():
    plan = Plan(tp=2, overlap=Overlap(tp_subbatches=2))
    model, loss, grads = _serial("gpt")
    for rank, result in enumerate(run_ranks(2, _through_parallelize, model, loss, grads, plan)):
        assert result["loss"] <= ATOL, f"rank {rank}: loss differs from serial by {result['loss']}"
        report = result["report"]
        assert any(line.startswith("overlapped tensor parallel: 2 modules") for line in report)


def _bench_rank(options: dict) -> dict:
    from interlace.bench.base import RankContext
    from interlace.bench.tp import run_rank
    from interlace.comm import Group

    group = Group("world", dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    return run_rank(RankContext(group, None, "lo", options))


def test_tp_benchmark_runs_every_mode_on_the_same_losses_and_bytes():
    from interlace.bench.tp import BENCHMARK
    from interlace.bench.tp_megatron import unavailable

    tiny = {"seq_len": 32, "d_model": 64, "heads": 4, "layers": 2, "batch": 4, "steps": 1}
    options = {**BENCHMARK.options, **tiny}
    BENCHMARK.check(options)
    result = run_ranks(2, _bench_rank, options)[0]
    modes = result["modes"]
    peer = {"megatron_core_tp"} if unavailable() is None else set()
    overlapped = {"overlapped_tp_k2", "overlapped_tp_k2_in_block"}
    assert set(modes) == {"plain_tp", "dtensor_tp"} | overlapped | peer
    losses = [m["loss"] for m in modes.values()]
    assert max(losses) - min(losses) < 1e-4, losses
    plain, over = modes["plain_tp"], modes["overlapped_tp_k2"]
    in_block = modes["overlapped_tp_k2_in_block"]
    assert plain["meter_all_reduce_bytes"] == over["meter_all_reduce_bytes"] > 0
    assert in_block["meter_all_reduce_bytes"] == over["meter_all_reduce_bytes"]
    if not peer:
        assert "Megatron-Core not run" in result["peers_skipped"]["megatron_core"]
    doc = {"result": result, "options": options, "environment": {"ranks": 2, "network": "lo"}}
    assert "overlapped_tp_k2" in BENCHMARK.table(doc) and "x)" in BENCHMARK.headline(doc)


def test_interleaved_calls_carry_the_callers_saved_tensor_hooks():
    packed: list[str] = []
    x = torch.randn(3, requires_grad=True)

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(threading.current_thread().name)
        return t

    def call() -> torch.Tensor:
        loss = (x * x).sum()
        tp_reduction._yield_point.switch()  # as after an async all-reduce: both seats alive
        return loss

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = run_interleaved([call, call])
    threads = set(packed)
    assert len(threads) == 2 and threading.current_thread().name not in threads
    sum(losses).backward()
    torch.testing.assert_close(x.grad, 4 * x.detach())


def _checkpointed_step(model: nn.Module, loss_ref, grads_ref, k: int) -> dict:
    """Errors against serial, layer forward calls and tp all-reduce calls of one step of
    tp=2 with k sub-batches and every layer checkpointed."""
    structure = find_structure(model)
    plan = Plan(tp=2)
    group = build_mesh(plan).group("tp")
    par = parallelize(model, plan, build_mesh(plan))
    apply_tp_overlap(model, structure, k)
    calls = []
    for block in model.blocks:  # checkpointed as pipeline stages do
        block.attn.register_forward_pre_hook(lambda *_: calls.append(1))
        block.forward = lambda x, run=block.forward: checkpoint(
            run, x, use_reentrant=False, context_fn=ReductionReplay.contexts
        )
    comm.meter.reset()
    loss = _loss("gpt", model, _tokens(), par)
    loss.backward()
    errors = {"loss": (loss.detach() - loss_ref).abs().item()}
    grads, expected = {}, {}
    for name, p in model.named_parameters():
        spec, ref = shard_spec(p), grads_ref[name]
        grads[name] = p.grad
        expected[name] = ref if spec is None else shard_of(ref, spec, group.rank, group.size)
    assert_grads_close(grads, expected, what=f"tp rank {group.rank}")
    return {"errors": errors, "calls": len(calls), "reduced": comm.meter.snapshot()["tp"]}


def test_checkpointed_sub_batched_layers_recompute_and_equal_serial():
    model, loss, grads = _serial("gpt")
    sub = run_ranks(2, _checkpointed_step, model, loss, grads, 2)[0]
    plain = run_ranks(2, _checkpointed_step, model, loss, grads, 1)[0]
    bad = {name: e for name, e in sub["errors"].items() if not e <= ATOL}
    assert not bad, f"differs from serial: {bad}"
    # attention ran once in the forward and once in the recomputation, per sub-batch: each
    # sub-batch checkpoints itself
    assert plain["calls"] == 2 * LAYERS and sub["calls"] == 2 * 2 * LAYERS
    # the same bytes; inside layers k-fold calls, and no recomputation repeats an all-reduce
    got, ref = sub["reduced"]["all_reduce"], plain["reduced"]["all_reduce"]
    assert got["bytes"] == ref["bytes"]
    assert got["calls"] - ref["calls"] == (2 - 1) * 4 * LAYERS


def _dropout_step(model: nn.Module, checkpointed: bool) -> dict[str, torch.Tensor]:
    """Loss and gradients of one tp=2, k=2 training step with dropout, every block
    checkpointed or not, from the same random seed."""
    structure = find_structure(model)
    plan = Plan(tp=2)
    par = parallelize(model, plan, build_mesh(plan))
    apply_tp_overlap(model, structure, 2)
    if checkpointed:
        for block in model.blocks:
            block.forward = lambda x, run=block.forward: checkpoint(
                run, x, use_reentrant=False, context_fn=ReductionReplay.contexts
            )
    torch.manual_seed(5)
    loss = _loss("gpt", model.train(), _tokens(), par)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def test_checkpointed_sub_batches_redraw_their_own_dropout_masks():
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("tiny"), dropout=0.2))
    kept = run_ranks(2, _dropout_step, copy.deepcopy(model), False)
    recomputed = run_ranks(2, _dropout_step, model, True)
    for a, b in zip(kept, recomputed, strict=True):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=ATOL, rtol=0, msg=name)

"""3D tensor parallelism: parallel equals serial, bytes as AxoNN's formula, plans refused.

Every rank gets the serial model (built once in the parent) and the same batches. The 3D model
takes its z slice of each batch; its loss, every gradient (each rank's piece against the slice
of the serial gradient, cut here by hand from the layout in `interlace.parallel.tensor3d`), the
gradient norm and the parameters after two SGD steps must agree with the serial run in fp32.
"""

import copy
import dataclasses
import itertools
import json
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import assert_grads_close
from interlace import comm
from interlace.checkpoint import checkpoint_name
from interlace.cli import main
from interlace.errors import PlanError
from interlace.loss import cross_entropy
from interlace.mesh import build_mesh
from interlace.models.gpt import build_model
from interlace.models.presets import get_preset
from interlace.parallel.detect import find_structure
from interlace.parallel.parallelize import parallelize
from interlace.parallel.pieces import load_pieces
from interlace.parallel.storage import Storage
from interlace.parallel.tensor3d.apply import check_tensor3d
from interlace.parallel.tensor3d.layers import layer_wire_bytes
from interlace.parallel.tensor3d.shard import (
    Grid,
    Shard3D,
    assemble3d,
    shard3d_of,
    shard3d_parameter,
)
from interlace.plan import Overlap, Plan
from interlace.report import read_metrics
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

B, T = 4, 16
ATOL = 1e-5
NORMAL = ("q_proj", "k_proj", "v_proj", "up")
TRANSPOSED = ("out_proj", "down")


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(step))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD, not AdamW: Adam divides by sqrt(v), which magnifies rounding on tiny gradients
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _serial_run(steps: int = 2) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = build_model(get_preset("tiny"))
    initial = copy.deepcopy(model)
    opt = _optimizer(model)
    ref: dict = {"losses": [], "grads": []}
    for step in range(steps):
        tokens = _batch(step)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        ref["losses"].append(loss.detach())
        ref["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        if step == 0:
            ref["norm"] = torch.nn.utils.get_total_norm(list(ref["grads"][0].values()))
        opt.step()
        opt.zero_grad()
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return initial, ref


def _cut(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def _expected_piece(name: str, full: torch.Tensor, at: dict[str, tuple[int, int]]) -> torch.Tensor:
    """This rank's piece of a serial tensor; `at` = {axis: (rank, size)}."""
    owner, _, kind = name.rpartition(".")
    layer = owner.rpartition(".")[2]
    if layer in NORMAL + TRANSPOSED:
        rows, cols = ("x", "y") if layer in TRANSPOSED else ("y", "x")
        piece = _cut(full, 0, *at[rows])
        if kind == "weight":
            piece = _cut(_cut(piece, 1, *at[cols]), 0, *at["z"])
        return piece
    if name.startswith("blocks.") and ".ln_" in name:
        return _cut(full, 0, *at["x"])
    if name in ("wte.weight", "lm_head.weight"):  # vocabulary rows over the x·y ranks
        (x, xs), (y, ys) = at["x"], at["y"]
        return _cut(full, 0, y * xs + x, xs * ys)
    return full


def _compare(
    model: nn.Module,
    ref: dict,
    tp3d: tuple[int, int, int],
    dp: int,
    sequence_parallel: bool,
    subbatches: int = 1,
) -> dict:
    overlap = Overlap(tp_subbatches=subbatches)
    plan = Plan(tp3d=tp3d, dp=dp, sequence_parallel=sequence_parallel, overlap=overlap)
    mesh = build_mesh(plan)
    par = parallelize(model, plan, mesh)
    residual: list[tuple[int, ...]] = []  # what the second block receives
    second = par.model.get_submodule("blocks.1")
    second.register_forward_pre_hook(lambda mod, args: residual.append(tuple(args[0].shape)))
    grid = Grid.from_mesh(mesh)
    at = {a: (grid.axis(a).rank, grid.axis(a).size) for a in "xyz"}
    dp_group = mesh.group("dp")
    opt = _optimizer(par.model)
    errors: dict[str, float] = {}
    for step, serial_loss in enumerate(ref["losses"]):
        tokens = _batch(step)
        rows = B // dp
        mine = tokens[dp_group.rank * rows : (dp_group.rank + 1) * rows]
        loss = par.forward_backward(mine[:, :-1], mine[:, 1:])  # data parallel: mean over dp
        par.sync_gradients()
        if step == 0:
            ops = comm.meter.snapshot()
        if dp > 1:
            comm.all_reduce(loss, dp_group)
        errors[f"loss {step}"] = (loss / dp - serial_loss).abs().item()
        grads = {name: p.grad for name, p in par.model.named_parameters()}
        expected = {name: _expected_piece(name, ref["grads"][step][name], at) for name in grads}
        assert_grads_close(grads, expected, what=f"rank {at} step {step}")
        if step == 0:
            errors["grad norm"] = (par.clip_grad_norm_(float("inf")) - ref["norm"]).abs().item()
        opt.step()
        opt.zero_grad()
    for name, p in par.model.named_parameters():
        expected = _expected_piece(name, ref["params"][name], at)
        errors[f"param {name}"] = (p.detach() - expected).abs().max().item()
    return {"errors": errors, "report": par.report, "residual": residual[0], "ops": ops}


def _assert_equal_to_serial(
    tp3d: tuple[int, int, int], dp: int = 1, sequence_parallel: bool = False, subbatches: int = 1
) -> list[dict]:
    model, ref = _serial_run()
    world_size = dp * tp3d[0] * tp3d[1] * tp3d[2]
    results = run_ranks(world_size, _compare, model, ref, tp3d, dp, sequence_parallel, subbatches)
    for rank, result in enumerate(results):
        bad = {k: v for k, v in result["errors"].items() if not v <= ATOL}
        assert not bad, f"rank {rank} differs from serial: {bad}"
    return results


@pytest.mark.parametrize("tp3d", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)])
def test_3d_parallel_equals_serial(tp3d):
    results = _assert_equal_to_serial(tp3d)
    assert results[0]["report"][0].startswith("3D tensor parallel over")


@pytest.mark.slow
def test_3d_parallel_2x2x2_equals_serial():
    _assert_equal_to_serial((2, 2, 2))


def test_3d_with_data_parallel_equals_serial():
    _assert_equal_to_serial((2, 1, 1), dp=2)


@pytest.mark.parametrize(
    "tp3d", [(1, 2, 1), (2, 2, 1), pytest.param((1, 2, 2), marks=pytest.mark.slow)]
)
def test_sequence_parallel_3d_equals_serial(tp3d):
    # the residual stream between blocks is [B/z, T/y, d/x]; over y the activations move by
    # the sequence's all-gathers and reduce-scatters, and all that y all-reduces is the
    # gradients of each layer's two norms' weights and biases and two transposed biases [d/x]
    x, y, z = tp3d
    cfg = get_preset("tiny")
    for result in _assert_equal_to_serial(tp3d, sequence_parallel=True):
        assert result["residual"] == (B // z, T // y, cfg.d_model // x)
        tp_y = result["ops"]["tp_y"]
        assert {"all_gather", "reduce_scatter"} <= set(tp_y)
        assert tp_y["all_reduce"]["bytes"] == cfg.n_layers * 6 * cfg.d_model // x * 4


@pytest.mark.parametrize(
    "tp3d", [(2, 1, 1), (1, 1, 2), pytest.param((1, 2, 1), marks=pytest.mark.slow)]
)
def test_overlapped_3d_equals_serial_with_the_same_bytes(tp3d):
    # two sub-batches take turns at each linear's all-reduces: the same bytes over x and y,
    # each reduction inside a layer issued once per sub-batch; over z the sub-batches share
    # one gathered block per linear and reduce-scatter their summed dW once: the same calls
    plain = _assert_equal_to_serial(tp3d)
    for result, before in zip(_assert_equal_to_serial(tp3d, subbatches=2), plain, strict=True):
        assert "overlapped tensor parallel" in result["report"][-1]
        for axis in ("tp_x", "tp_y", "tp_z"):
            got, was = result["ops"].get(axis, {}), before["ops"].get(axis, {})
            assert got.keys() == was.keys()
            for op, meter in got.items():
                assert meter["bytes"] == was[op]["bytes"], (axis, op)
                if axis == "tp_z":
                    assert meter["calls"] == was[op]["calls"], op
            if axis != "tp_z" and axis in result["ops"]:  # the ends' gather and split stay whole
                assert got["all_reduce"]["calls"] > was["all_reduce"]["calls"]


def _reductions_by_thread(model: nn.Module, tp3d: tuple[int, int, int]) -> dict:
    """(rows, issuing thread) of every async all-reduce over x or y in the forward and in the
    backward of one step under `tp3d` with two sub-batches."""
    plan = Plan(tp3d=tp3d, overlap=Overlap(tp_subbatches=2))
    par = parallelize(model, plan, build_mesh(plan))
    log: dict[str, list[tuple[int, int]]] = {"forward": [], "backward": []}
    issue, phase = comm.all_reduce, ["forward"]

    def logged(tensor, group, *args, **kwargs):
        if group.name in ("tp_x", "tp_y") and kwargs.get("async_op"):
            log[phase[0]].append((tensor.shape[0], threading.get_ident()))
        return issue(tensor, group, *args, **kwargs)

    tokens = _batch(0)
    comm.all_reduce = logged
    try:
        loss = par.loss(par.module(tokens[:, :-1]), tokens[:, 1:])
        phase[0] = "backward"
        loss.backward()
    finally:
        comm.all_reduce = issue
    return log


def test_sub_batches_hand_over_at_each_3d_linear_reduction():
    # x = 2: the normal linears (q, k, v, up) all-reduce their outputs over x, the transposed
    # ones (out, down) their input gradients; each sub-batch's rows, and in the backward the
    # turn passes at each: consecutive reductions of a layer come from the two sub-batches
    torch.manual_seed(0)
    layers = get_preset("tiny").n_layers
    log = run_ranks(2, _reductions_by_thread, build_model(get_preset("tiny")), (2, 1, 1))[0]
    assert [rows for rows, _ in log["forward"]] == [B // 2] * (4 * layers * 2)
    backward = log["backward"]
    assert [rows for rows, _ in backward] == [B // 2] * (2 * layers * 2)
    same = sum(a[1] == b[1] for a, b in itertools.pairwise(backward))
    assert same <= layers - 1, backward


# ----------------------------------------------------------------------------- Trainer

CONFIG = TrainConfig(
    model="tiny", steps=3, global_batch=8, eval_every=3, out=None, progress=False,
    warmup_steps=1, lr=5e-4,
)  # fmt: skip


def _trainer_run(config: TrainConfig, plan_text: str, resume_from: Path | None = None) -> dict:
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if plan.world_size > 1 else None
    trainer = Trainer(prepare_run(config, plan, plan.world_size), mesh)
    if resume_from is not None:
        trainer.resume(resume_from)
    if config.out:
        trainer.fit()
        rows = read_metrics(Path(config.out) / "metrics.jsonl")
    else:
        rows = [trainer.train_step() for _ in range(config.steps)]
    at = {}
    if mesh is not None:
        grid = Grid.from_mesh(mesh)
        at = {a: (grid.axis(a).rank, grid.axis(a).size) for a in "xyz"}
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"rows": rows, "params": params, "at": at, "eval": trainer.evaluate()}


def _assert_trainer_follows(result: dict, serial: dict, atol: float = 1e-5) -> None:
    for key in ("loss", "grad_norm"):
        got = [r[key] for r in result["rows"]]
        assert got == pytest.approx([r[key] for r in serial["rows"]], abs=atol), key
    assert result["eval"] == pytest.approx(serial["eval"], abs=atol)
    for name, value in result["params"].items():
        expected = _expected_piece(name, serial["params"][name], result["at"])
        torch.testing.assert_close(value, expected, atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def serial_training() -> dict:
    return run_ranks(1, _trainer_run, CONFIG, "")[0]


@pytest.mark.parametrize("plan_text", ["tp3d=2x1x1,dp=2", "tp3d=1x2x2"])
def test_trainer_3d_follows_serial(serial_training, plan_text):
    plan = Plan.parse(plan_text)
    split = {f"tp_{a}" for a, n in zip("xyz", plan.tp3d, strict=True) if n > 1}
    for result in run_ranks(plan.world_size, _trainer_run, CONFIG, plan_text):
        _assert_trainer_follows(result, serial_training)
        assert split <= set(result["rows"][0]["comm_bytes"])


def test_trainer_3d_resume_continues_the_same_trajectory(tmp_path):
    config = dataclasses.replace(CONFIG, steps=4, ckpt_every=2, out=str(tmp_path / "full"))
    full = run_ranks(4, _trainer_run, config, "tp3d=2x1x2")
    checkpoint = tmp_path / "full" / "checkpoints" / checkpoint_name(2)
    resumed_config = dataclasses.replace(config, out=str(tmp_path / "resumed"))
    resumed = run_ranks(4, _trainer_run, resumed_config, "tp3d=2x1x2", checkpoint)
    for before, after in zip(full, resumed, strict=True):
        assert [r["step"] for r in after["rows"]] == [3, 4]
        assert [r["loss"] for r in after["rows"]] == pytest.approx(
            [r["loss"] for r in before["rows"][2:]], abs=1e-6
        )
        for name, value in after["params"].items():
            torch.testing.assert_close(value, before["params"][name], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- bytes


def _axonn_bytes(h: int, kh: int, tokens: int, grid: dict[str, int], transposed: bool) -> dict:
    """REFERENCE.md §3 for a layer h → kh, b = 4: X 2(x−1)/x·T·kh/y·b, Y 2(y−1)/y·T·h/x·b,
    Z 3(z−1)/z·h·kh/(x·y)·b; a transposed layer swaps the roles of X and Y."""
    x, y = (grid["y"], grid["x"]) if transposed else (grid["x"], grid["y"])
    z = grid["z"]
    first, second = ("tp_y", "tp_x") if transposed else ("tp_x", "tp_y")
    return {
        first: 2 * (x - 1) / x * tokens * kh / y * 4,
        second: 2 * (y - 1) / y * tokens * h / x * 4,
        "tp_z": 3 * (z - 1) / z * kh * h / (x * y) * 4,
    }


def _wire(snapshot: dict, group: str, *ops: str) -> float:
    return sum(snapshot.get(group, {}).get(op, {}).get("wire_bytes", 0.0) for op in ops)


def _measure_bytes(tp3d: tuple[int, int, int], model: nn.Module) -> dict:
    from interlace.parallel.tensor3d.layers import Linear3D

    plan = Plan(tp3d=tp3d)
    grid = Grid.from_mesh(build_mesh(plan))
    out: dict = {}
    for transposed, (n_in, n_out) in ((False, (64, 256)), (True, (256, 64))):
        torch.manual_seed(0)
        layer = Linear3D(nn.Linear(n_in, n_out, bias=False), grid, transposed)
        width = n_in // (grid.y.size if transposed else grid.x.size)
        comm.meter.reset()
        layer(torch.randn(8, width, requires_grad=True)).sum().backward()
        out[transposed] = comm.meter.snapshot()
    par = parallelize(model, plan, build_mesh(plan))
    comm.meter.reset()
    tokens = _batch(0)
    par.forward_backward(tokens[:, :-1], tokens[:, 1:])
    out["model"] = comm.meter.snapshot()
    return out


def test_bytes_per_collective_equal_the_axonn_formula():
    tp3d = (2, 2, 2)
    grid = dict(zip("xyz", tp3d, strict=True))
    model, _ = _serial_run(steps=1)
    cfg = model.config
    d, f, layers = cfg.d_model, cfg.ffn_dim, cfg.n_layers
    for measured in run_ranks(8, _measure_bytes, tp3d, model):
        for transposed, (h, kh) in ((False, (64, 256)), (True, (256, 64))):
            expected = _axonn_bytes(h, kh, 8, grid, transposed)
            snap = measured[transposed]
            assert _wire(snap, "tp_x", "all_reduce") == pytest.approx(expected["tp_x"])
            assert _wire(snap, "tp_y", "all_reduce") == pytest.approx(expected["tp_y"])
            got_z = _wire(snap, "tp_z", "all_gather", "reduce_scatter")
            assert got_z == pytest.approx(expected["tp_z"])
            assert layer_wire_bytes(h, kh, 8, tp3d, transposed) == pytest.approx(expected)
        # the whole model, one step: q, k, v and up normal; out_proj and down transposed
        tokens = B * T // grid["z"]
        per_layer = [_axonn_bytes(d, d, tokens, grid, False)] * 3 + [
            _axonn_bytes(d, d, tokens, grid, True),
            _axonn_bytes(d, f, tokens, grid, False),
            _axonn_bytes(f, d, tokens, grid, True),
        ]
        total = {g: layers * sum(b[g] for b in per_layer) for g in ("tp_x", "tp_y", "tp_z")}
        norms = layers * 2 * 2 * (2 * (grid["x"] - 1) / grid["x"] * tokens * 2 * 4)
        snap = measured["model"]
        assert _wire(snap, "tp_y", "all_reduce") == pytest.approx(total["tp_y"])
        assert _wire(snap, "tp_x", "all_reduce") == pytest.approx(total["tp_x"] + norms)
        assert _wire(snap, "tp_z", "all_gather", "reduce_scatter") == pytest.approx(total["tp_z"])
        # residual split (backward) and gather (forward) over x: [tokens, d/x] each
        gathers = 2 * (grid["x"] - 1) * tokens * d // grid["x"] * 4
        assert _wire(snap, "tp_x", "all_gather") == pytest.approx(gathers)


# ----------------------------------------------------------------------------- refused plans


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (Plan(tp3d=(3, 1, 1)), "d_model=64 is not divisible by 3, the tp3d=3x1x1 factor x"),
        (Plan(tp3d=(1, 3, 1)), "n_heads=4 is not divisible by 3, the tp3d=1x3x1 factor y"),
        (
            Plan(tp3d=(1, 2, 64)),
            "query width / y=32 is not divisible by 64, the tp3d=1x2x64 factor z",
        ),
        (
            Plan(tp3d=(1, 2, 1), sequence_parallel=True, overlap=Overlap(tp_subbatches=2)),
            "no sequence_parallel",
        ),
    ],
)
def test_plans_the_grid_cannot_split_are_refused(plan, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        plan.validate(plan.world_size, get_preset("tiny"))


def test_a_vocabulary_the_xy_ranks_cannot_split_is_refused():
    spec = dataclasses.replace(get_preset("tiny"), vocab_size=98)
    message = "vocab_size=98 is not divisible by 4, the tp3d=2x2x1 factor x·y"
    with pytest.raises(PlanError, match=re.escape(message)):
        Plan(tp3d=(2, 2, 1)).validate(4, spec)
    model = build_model(spec)
    with pytest.raises(PlanError, match=re.escape("wte: " + message)):
        check_tensor3d(model, find_structure(model), (2, 2, 1))


def test_mixture_of_experts_and_other_models_are_refused():
    with pytest.raises(PlanError, match="does not split Mixture-of-Experts layers; use ep > 1"):
        Plan(tp3d=(2, 1, 1)).validate(2, get_preset("moe-tiny"))
    other = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 256))
    with pytest.raises(PlanError, match=r"needs a layer list .* found in Sequential; use tp=N"):
        check_tensor3d(other, find_structure(other), (2, 1, 1))


def test_batch_not_divisible_by_z_is_refused_before_training():
    config = dataclasses.replace(CONFIG, global_batch=6)
    with pytest.raises(PlanError, match=r"tp3d z=2 .* holds 3 sequences"):
        prepare_run(config, Plan(dp=2, tp3d=(1, 1, 2)), 4)


@pytest.mark.slow
def test_cli_trains_tp3d_with_data_parallel(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    args = ["train", "--model", "tiny", "--global-batch", "4", "--eval-batches", "1"]
    args += ["--no-progress", "--steps", "2", "--out", str(out), "--plan", "tp3d=2x1x1,dp=2"]
    assert main([*args, "--nproc", "4"]) == 0, capfd.readouterr().err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["comm_bytes"]["tp_x"] > 0 and r["comm_bytes"]["dp"] > 0 for r in rows)
    report = json.loads((out / "report.json").read_text())
    assert any(line.startswith("3D tensor parallel") for line in report["parallel"])


def _grids(sizes: tuple[int, int, int]) -> list[Grid]:
    """Every rank's Grid of x·y·z ranks of `sizes` (groups without a process group)."""
    return [
        Grid(*(comm.Group(a, None, n, r) for a, n, r in zip("xyz", sizes, ranks, strict=True)))
        for ranks in itertools.product(*(range(n) for n in sizes))
    ]


@pytest.mark.parametrize(
    "spec",
    [
        Shard3D(rows="y", cols="x", flat="z"),
        Shard3D(rows="y", flat="z", segments=3),  # a fused q|k|v cut twice along its rows
        Shard3D(rows="z", cols="y", replicas=2),  # grouped-query kv rows shared by 2 ranks
        Shard3D(rows="x", cols="y", flat="z", conv1d=True),  # stored [in, out]
    ],
)
def test_assemble3d_rebuilds_the_full_tensor_from_every_distinct_piece(spec):
    """Every rank's `shard3d_of` piece on a 2x2x2 grid, keyed as checkpoints key them, gives
    the full tensor back (`interlace export` reads 3D checkpoints through it)."""
    full = torch.randn(24, 16)
    pieces = {}
    for grid in _grids((2, 2, 2)):
        coords = tuple(
            grid.axis(a).rank // (spec.replicas if a == spec.rows else 1) for a in spec.axes
        )
        pieces[coords] = shard3d_of(full, spec, grid)
    assert torch.equal(assemble3d(pieces, spec), full)


def _chunked(full: torch.Tensor, spec: Shard3D, grid: Grid) -> torch.Tensor:
    """The piece of `full` under `spec` cut by chunks, as the layout describes it: each of the
    rows' segments in rows/replicas parts, then cols, then flat."""
    piece = full.t() if spec.conv1d else full
    if spec.rows is not None:
        rows = grid.axis(spec.rows)
        parts, index = rows.size // spec.replicas, rows.rank // spec.replicas
        piece = torch.cat([s.chunk(parts)[index] for s in piece.chunk(spec.segments)])
    for dim, axis in ((1, spec.cols), (0, spec.flat)):
        if axis is not None:
            piece = piece.chunk(grid.axis(axis).size, dim)[grid.axis(axis).rank]
    return piece


class _FullWeights:
    """`pieces.Weights` of full tensors in memory: a read is the runs' elements, counted."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.elements = 0

    def read(self, name: str, runs: list) -> torch.Tensor:
        piece = self.tensors[name]
        for dim, dim_runs in enumerate(runs):
            piece = torch.cat([piece.narrow(dim, a, b - a) for a, b in dim_runs], dim)
        self.elements += piece.numel()
        return piece

    def init_buffers(self, modules: list[nn.Module]) -> None:
        pass


@pytest.mark.parametrize("sizes", [(2, 2, 2), (1, 2, 3), (3, 2, 1)])
@pytest.mark.parametrize(
    "spec",
    [
        Shard3D(rows="y", cols="x", flat="z"),
        Shard3D(rows="x", cols="y", flat="z"),  # a transposed layer's
        Shard3D(rows="y", cols="x", flat="z", segments=3),  # a fused q|k|v
        Shard3D(rows="y", cols="x", flat="z", replicas=2),  # grouped-query kv rows on 2 ranks
        Shard3D(rows="y", cols="x", flat="z", segments=3, conv1d=True),  # GPT-2's c_attn
        Shard3D(rows="x", cols="y", flat="z", conv1d=True),  # stored [in, out]
        Shard3D(rows="y", segments=3),  # the fused bias
        Shard3D(rows="x"),  # a norm's weight
    ],
)
def test_a_3d_piece_of_a_meta_model_is_read_as_shard3d_of_cuts_it(spec, sizes):
    """A parameter split on the meta device, made real by `load_pieces`, holds exactly the piece
    `shard3d_of` cuts from the full tensor (itself the chunks the layout describes), reading
    as many elements as it holds."""
    shape = (24, 36) if spec.cols else (24,)
    full = torch.randn(shape[::-1] if spec.conv1d else shape)
    for grid in _grids(sizes):
        module = nn.Module()
        module.weight = shard3d_parameter(nn.Parameter(full.to("meta")), spec, grid)
        weights = _FullWeights({"weight": full})
        load_pieces(module, [module], Storage(), None, grid, torch.device("cpu"), weights)
        expected = shard3d_of(full, spec, grid)
        assert torch.equal(expected, _chunked(full, spec, grid))
        assert torch.equal(module.weight, expected)
        assert weights.elements == expected.numel()

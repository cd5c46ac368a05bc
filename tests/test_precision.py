"""Mixed precision: every parallel plan trained in bf16 follows the serial model trained in bf16
(losses and pre-clipping gradient norms step by step), and its forward really computed in bf16.

Tolerance: bf16 keeps 8 significant bits, and a split changes where partial results are
rounded to it (a row-parallel matmul rounds each rank's partial sum before the all-reduce), so
a plan and the serial run differ by rounding of the order of bf16 against fp32 (measured below
1e-3 relative on these runs). LOSS_ATOL and NORM_RTOL allow 5× that; a gradient scale error (a
sum over ranks for a mean, a dropped 1/accumulation) is ≥ 2× and fails.
"""

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import TINY_RUN
from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

LOSS_ATOL = 5e-3
NORM_RTOL = 5e-3

BASE = dataclasses.replace(TINY_RUN, precision="bf16")


def _model_file(tmp_path, preset: str, **changes) -> str:
    config = dataclasses.replace(get_preset(preset), **changes)
    path = tmp_path / f"{preset}-changed.json"
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


def _output_dtypes(model: torch.nn.Module) -> set[str]:
    """The dtypes of every tensor any module of `model` outputs from now on (filled as it
    runs)."""
    dtypes: set[str] = set()
    for module in model.modules():
        module.register_forward_hook(
            lambda m, i, out: dtypes.add(str(out.dtype)) if torch.is_tensor(out) else None
        )
    return dtypes


def _run(config: TrainConfig, plan_text: str, world_size: int) -> dict:
    """Every step's (loss, grad_norm), and the dtypes of every module output in the forward."""
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if world_size > 1 else None
    trainer = Trainer(prepare_run(config, plan, world_size), mesh)
    dtypes = _output_dtypes(trainer.model)
    rows = [trainer.train_step() for _ in range(config.steps)]
    return {"rows": [(r["loss"], r["grad_norm"]) for r in rows], "dtypes": dtypes}


def _assert_follows(result: dict, serial: dict) -> None:
    losses, norms = zip(*result["rows"], strict=True)
    serial_losses, serial_norms = zip(*serial["rows"], strict=True)
    assert losses == pytest.approx(serial_losses, abs=LOSS_ATOL)
    assert norms == pytest.approx(serial_norms, rel=NORM_RTOL)
    assert "torch.bfloat16" in result["dtypes"], result["dtypes"]


DENSE_PLANS = [
    "dp=2",
    "dp=2,dp_overlap=false",
    "tp=2",
    "tp=2,sequence_parallel=true",
    "tp=2,tp_subbatches=2",
    "tp3d=2x1x1",
    "tp3d=1x1x2",
]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    config = dataclasses.replace(
        BASE, model=_model_file(tmp_path_factory.mktemp("dense"), "tiny", n_layers=4)
    )
    return config, _run(config, "dp=1", 1)


@pytest.mark.parametrize("plan_text", DENSE_PLANS)
def test_bf16_plan_follows_the_serial_bf16_run(dense, plan_text):
    config, serial = dense
    world_size = Plan.parse(plan_text).world_size
    for result in run_ranks(world_size, _run, config, plan_text, world_size):
        _assert_follows(result, serial)


PIPELINE_PLANS = {  # plan: stage boundaries between ranks × pipelines (one per tp rank)
    "pp=2,micro_batches=2,schedule=gpipe": 1,
    "pp=2,micro_batches=2,schedule=1f1b": 1,
    "pp=2,micro_batches=4,schedule=interleaved": 3,  # 2 virtual stages per rank: 4 stages
    "pp=2,micro_batches=4,schedule=shifted,recompute=full": 1,
    "pp=2,tp=2,micro_batches=2": 2,
}


@pytest.mark.parametrize("plan_text", PIPELINE_PLANS)
def test_bf16_pipeline_sends_bf16_and_follows_the_serial_bf16_run(dense, plan_text):
    """Every schedule sends its activations, and their gradients back, in bf16: of one step's
    point-to-point traffic every floating-point byte is bf16, 2 bytes per element of the
    boundary activation [B, T, d] each way (fp32 would be 4); a received activation is fp32
    again inside the stage (the residual stream of every block, as in the serial run); and the
    run follows the serial bf16 run."""
    config, serial = dense
    model = get_preset("tiny")
    elements = config.global_batch * model.seq_len * model.d_model  # one boundary, one way
    world_size = Plan.parse(plan_text).world_size
    sent: dict[str, int] = {}
    for result in run_ranks(world_size, _run_pipeline, config, plan_text, world_size):
        _assert_follows(result, serial)
        assert result["residual"] == {"torch.float32"}  # restored on receipt, as serial
        for dtype, count in result["p2p_bytes"].items():
            sent[dtype] = sent.get(dtype, 0) + count
    assert sent == {"torch.bfloat16": PIPELINE_PLANS[plan_text] * 2 * elements * 2}


class _SentBytes(TorchDispatchMode):
    """Bytes of the floating-point tensors this process sends point to point, by dtype: torch's
    pipeline schedules and the shifted executor alike send through the c10d.send op."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.send.default:
            for tensor in args[0]:
                if tensor.is_floating_point():
                    key = str(tensor.dtype)
                    self.bytes[key] = self.bytes.get(key, 0) + tensor.nbytes
        return func(*args, **(kwargs or {}))


def _run_pipeline(config: TrainConfig, plan_text: str, world_size: int) -> dict:
    """`_run`, plus the bytes sent point to point in the last step (after the first step's
    shape exchange), by dtype."""
    plan = Plan.parse(plan_text)
    trainer = Trainer(prepare_run(config, plan, world_size), build_mesh(plan))
    dtypes = _output_dtypes(trainer.model)
    residual: set[str] = set()  # of every block's output, the residual stream
    for block in trainer.model.blocks.values():
        block.register_forward_hook(lambda m, i, out: residual.add(str(out.dtype)))
    rows = [trainer.train_step() for _ in range(config.steps - 1)]
    with _SentBytes() as sent:
        rows.append(trainer.train_step())
    return {
        "rows": [(r["loss"], r["grad_norm"]) for r in rows],
        "dtypes": dtypes,
        "residual": residual,
        "p2p_bytes": sent.bytes,
    }


@pytest.mark.parametrize("plan_text", ["dp=2,ep=2", "dp=2,ep=2,tp=2,etp=2"])
def test_bf16_expert_parallel_follows_the_serial_bf16_run(tmp_path, plan_text):
    # dropless and without the auxiliary loss: per-rank routing equals serial routing; with
    # experts split over tp (etp) each rank's partial expert outputs are rounded before the sum
    model = _model_file(tmp_path, "moe-tiny", dropless=True, aux_loss_coef=0.0)
    config = dataclasses.replace(BASE, model=model)
    serial = _run(config, "dp=1", 1)
    world_size = Plan.parse(plan_text).world_size
    for result in run_ranks(world_size, _run, config, plan_text, world_size):
        _assert_follows(result, serial)


def test_bf16_with_gradient_accumulation_follows_the_serial_bf16_run(dense):
    config, serial = dense
    for result in run_ranks(2, _run, dataclasses.replace(config, micro_batch=2), "dp=2", 2):
        _assert_follows(result, serial)


def test_bf16_and_fp16_runs_stay_close_to_fp32_and_fp32_computes_in_fp32(dense):
    config, bf16 = dense
    fp32 = _run(dataclasses.replace(config, precision="fp32"), "dp=1", 1)
    fp16 = _run(dataclasses.replace(config, precision="fp16"), "dp=1", 1)
    assert "torch.bfloat16" not in fp32["dtypes"] and "torch.float16" not in fp32["dtypes"]
    assert "torch.float16" in fp16["dtypes"]
    # fp16's scaled gradients are unscaled before the norm: otherwise it would be 65536x
    for low in (bf16, fp16):
        losses, norms = zip(*low["rows"], strict=True)
        assert losses == pytest.approx([r[0] for r in fp32["rows"]], abs=LOSS_ATOL)
        assert norms == pytest.approx([r[1] for r in fp32["rows"]], rel=NORM_RTOL)


def test_fp16_gradient_scaler_agrees_over_model_parallel_ranks(dense):
    """fp16 under tp=2 follows the serial fp32 run: each rank's scaled gradient piece is
    unscaled before the norm, and every rank steps (or skips) together."""
    config, _ = dense
    serial = _run(dataclasses.replace(config, precision="fp32"), "dp=1", 1)
    config = dataclasses.replace(config, precision="fp16")
    for result in run_ranks(2, _run, config, "tp=2", 2):
        losses, norms = zip(*result["rows"], strict=True)
        assert losses == pytest.approx([r[0] for r in serial["rows"]], abs=LOSS_ATOL)
        assert norms == pytest.approx([r[1] for r in serial["rows"]], rel=NORM_RTOL)
        assert "torch.float16" in result["dtypes"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a CPU without native bf16 (AVX2 only) takes ~6 s per bf16 step
def test_demo_preset_trained_200_steps_in_bf16_ends_within_2_percent_of_fp32():
    """The demo run (`make demo`'s model and data) for 200 steps, one process: the mean loss of
    its last 20 steps and its held-out loss in bf16 within 2 % of fp32's."""
    config = TrainConfig(steps=200, eval_every=200, out=None, progress=False)
    ends = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # one process, no ranks to fork: both cores
    try:
        for precision in ("fp32", "bf16"):
            run = dataclasses.replace(config, precision=precision)
            trainer = Trainer(prepare_run(run, Plan(), 1))
            rows = [trainer.train_step() for _ in range(run.steps)]
            ends[precision] = (sum(r["loss"] for r in rows[-20:]) / 20, trainer.evaluate())
    finally:
        torch.set_num_threads(threads)
    for fp32, bf16 in zip(ends["fp32"], ends["bf16"], strict=True):
        assert bf16 == pytest.approx(fp32, rel=0.02), ends


@pytest.mark.parametrize("plan_text", ["dp=2", "dp=2,dp_overlap=false"])
def test_bf16_gradient_reduction_sends_half_the_bytes_and_follows_the_serial_run(dense, plan_text):
    """grad_reduce_dtype=bf16: the dp all-reduce carries 2 bytes per parameter (DDP through
    torch's bf16 wrapper, or the flat all-reduce after backward) and the run still follows
    the serial one within bf16 rounding."""
    config, serial = dense
    config = dataclasses.replace(config, grad_reduce_dtype="bf16")
    for result in run_ranks(2, _run_with_bytes, config, plan_text, 2):
        _assert_follows(result, serial)
        assert result["dp_bytes"] == 2 * result["params"] + 4  # + the fp32 loss


def _run_with_bytes(config: TrainConfig, plan_text: str, world_size: int) -> dict:
    plan = Plan.parse(plan_text)
    trainer = Trainer(prepare_run(config, plan, world_size), build_mesh(plan))
    dtypes = _output_dtypes(trainer.model)
    rows = [trainer.train_step() for _ in range(config.steps)]
    return {
        "rows": [(r["loss"], r["grad_norm"]) for r in rows],
        "dtypes": dtypes,
        "dp_bytes": rows[-1]["comm_bytes"]["dp"],
        "params": sum(p.numel() for p in trainer.model.parameters()),
    }


def test_bf16_gradient_reduction_with_compression_is_refused():
    config = dataclasses.replace(BASE, grad_reduce_dtype="bf16")
    with pytest.raises(ConfigError, match="grad_compression=topk sends its own format"):
        prepare_run(config, Plan.parse("dp=2,grad_compression=topk"), 2)

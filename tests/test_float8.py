"""float8 linear layers (`interlace.float8`): their products against fp32's, the converter, and
plans trained in fp8 against the serial fp8 run, on the CPU (torch emulates `_scaled_mm` there;
the CLI still refuses fp8 on the CPU, so the equality tests let `resolve_precision` pass it).

Tolerances: e4m3 keeps 3 mantissa bits (a relative step of 2⁻³ at worst, 2⁻⁴ on average), e5m2
2; a product of K terms averages the rounding, so a product is within a few percent of fp32's
(PRODUCT_RTOL, Frobenius). A plan and the serial run scale different tensors (a column-parallel
rank's weight piece has its own amax under tensorwise), so they round differently (measured
on these runs: 3e-4 relative in the loss; fp8 against bf16 1e-4); losses follow within
LOSS_RTOL. A dropped scale loses every value below e4m3's smallest subnormal (2⁻⁹) and fails
the product tests by far; halving a product's gradient fails the linear layer's.
"""

import dataclasses

import pytest
import torch

from helpers import TINY_RUN
from interlace.cli import main
from interlace.float8 import Float8Linear, Float8Matmul, convert_to_float8, scaled_product
from interlace.mesh import build_mesh
from interlace.models.gpt import build_model
from interlace.parallel.detect import find_structure
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run

PRODUCT_RTOL = 0.06
LOSS_RTOL = 1e-3
E4M3 = torch.float8_e4m3fn
RECIPES = ("tensorwise", "rowwise")


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm())


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_product_is_the_fp32_product_to_float8_accuracy_at_any_magnitude(recipe):
    """Operands around 1e-3 (most below e4m3's smallest normal, 2⁻⁶) and around 1e3 (above its
    largest, 448) multiply as in fp32 within PRODUCT_RTOL: the scales carry the magnitude."""
    torch.manual_seed(0)
    for magnitude in (1e-3, 1e3):
        a, b = torch.randn(64, 128) * magnitude, torch.randn(128, 32) * magnitude
        product = scaled_product(a, b, E4M3, E4M3, recipe, torch.float32)
        assert _relative(product, a @ b) < PRODUCT_RTOL


def test_rowwise_scales_keep_an_outlier_row_from_spoiling_the_others():
    """One row 1e6 times larger: under one scale for the tensor the other rows fall below e4m3's
    resolution; with one scale per row they keep float8's accuracy."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    a[0] *= 1e6
    exact = (a @ b)[1:]
    rowwise = scaled_product(a, b, E4M3, E4M3, "rowwise", torch.float32)[1:]
    tensorwise = scaled_product(a, b, E4M3, E4M3, "tensorwise", torch.float32)[1:]
    assert _relative(rowwise, exact) < PRODUCT_RTOL
    assert _relative(tensorwise, exact) > 0.5


def test_a_product_not_aligned_to_16_runs_in_the_compute_dtype():
    a, b = torch.randn(8, 20), torch.randn(20, 24)
    product = scaled_product(a, b, E4M3, E4M3, "tensorwise", torch.bfloat16)
    assert torch.equal(product, a.bfloat16() @ b.bfloat16())


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_output_and_both_gradients_follow_fp32(recipe):
    """y = x·Wᵀ + b and the gradients of x, W and b, against fp32 autograd; the output
    gradient goes through e5m2 under tensorwise (2 mantissa bits: a wider tolerance)."""
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64, requires_grad=True)
    layer = torch.nn.Linear(64, 48)
    grad = torch.randn(4, 32, 48)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    want = torch.autograd.grad(expected, (x, layer.weight, layer.bias), grad)
    y = Float8Matmul(recipe).linear(x, layer.weight, layer.bias)
    got = torch.autograd.grad(y, (x, layer.weight, layer.bias), grad)
    assert _relative(y, expected) < PRODUCT_RTOL
    for actual, wanted in zip(got, want, strict=True):
        assert actual.dtype == wanted.dtype
        assert _relative(actual, wanted) < 2 * PRODUCT_RTOL


def test_converter_turns_the_blocks_linears_to_float8_and_leaves_the_rest():
    """Every attention and feed-forward linear of the blocks multiplies in float8; the head, the
    embeddings, the router and the experts of an MoE block do not; names are unchanged."""
    model = build_model("moe-tiny")
    names = list(model.state_dict())
    moe_layers = find_structure(model).experts
    (line,) = convert_to_float8(model, "rowwise", "blocks", moe_layers)
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = {n for n in linears if n == "lm_head" or n.startswith(tuple(moe_layers))}
    assert kept and "blocks.1.mlp.router.proj" in kept
    assert converted == linears - kept
    assert f"in {len(converted)} linear layers" in line
    assert list(model.state_dict()) == names


def _fp8(monkeypatch) -> None:
    """Let fp8 through `resolve_precision` on the CPU (the CLI refuses it there)."""
    monkeypatch.setattr("interlace.train.setup.resolve_precision", lambda name, device: name)


def _losses(config, plan_text: str) -> list[float]:
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan) if plan.world_size > 1 else None
    trainer = Trainer(prepare_run(config, plan, plan.world_size), mesh)
    return [trainer.train_step()["loss"] for _ in range(config.steps)]


@pytest.fixture(scope="module")
def serial_runs():
    """The tiny GPT's serial losses in bf16 and in fp8 (both recipes)."""
    with pytest.MonkeyPatch.context() as patch:
        _fp8(patch)
        bf16 = _losses(dataclasses.replace(TINY_RUN, precision="bf16"), "dp=1")
        fp8 = {recipe: _losses(_fp8_run(recipe), "dp=1") for recipe in RECIPES}
    return bf16, fp8


def _fp8_run(recipe: str):
    return dataclasses.replace(TINY_RUN, precision="fp8", fp8_recipe=recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_serial_run_follows_bf16_and_differs_from_it(serial_runs, recipe):
    bf16, fp8 = serial_runs
    assert fp8[recipe] == pytest.approx(bf16, rel=LOSS_RTOL)
    assert fp8[recipe] != bf16  # the products really ran in float8


@pytest.mark.parametrize(
    "plan_text", ["dp=2", "tp=2", "tp=2,sequence_parallel=true", "tp3d=2x1x1", "dp_shard=2"]
)
def test_fp8_plan_follows_the_serial_fp8_run(serial_runs, monkeypatch, plan_text):
    _fp8(monkeypatch)
    _, fp8 = serial_runs
    world_size = Plan.parse(plan_text).world_size
    for losses in run_ranks(world_size, _losses, _fp8_run("tensorwise"), plan_text):
        assert losses == pytest.approx(fp8["tensorwise"], rel=LOSS_RTOL)


def test_fp8_on_the_cpu_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--steps", "1", "--out", str(out), "--no-progress"]
    code = main([*argv, "--precision", "fp8"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    assert err == [
        "interlace: error: precision=fp8 needs a CUDA GPU with float8 matmuls (compute "
        "capability 8.9 or newer: Ada, Hopper); this run's device is the CPU; use bf16 or fp32"
    ]
    assert not out.exists()


@pytest.mark.cuda
def test_fp8_trains_on_a_gpu_with_float8_and_is_refused_on_one_without(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--steps", "2", "--out", str(out), "--no-progress"]
    code = main([*argv, "--precision", "fp8"])
    if torch.cuda.get_device_capability() >= (8, 9):
        assert code == 0
        assert (out / "report.json").exists()
    else:
        assert code == 2 and not out.exists()
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("interlace: error: precision=fp8 ")


def test_a_recipe_without_fp8_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "tiny", "--steps", "1", "--out", str(out), "--no-progress"]
    assert main([*argv, "--precision", "bf16", "--fp8-recipe", "rowwise"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "fp8_recipe=rowwise applies to precision=fp8" in line
    assert not out.exists()


def test_the_planner_prices_fp8_as_bf16_and_says_so(capsys):
    argv = ["plan", "--model", "gpt2-124m", "--hardware", "dgx-h100", "--plan", "dp=8"]
    assert main([*argv, "--precision", "bf16"]) == 0
    bf16 = capsys.readouterr().out
    assert main([*argv, "--precision", "fp8"]) == 0
    fp8 = capsys.readouterr()
    assert fp8.out == bf16
    assert fp8.err.splitlines() == [
        "interlace: fp8 priced as bf16, its other dtype: the planner has no float8 matmul rates "
        "yet (an upper bound on the step)"
    ]

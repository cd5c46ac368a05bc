"""On a CUDA device (skipped elsewhere; each test in a fresh interpreter, see conftest): a GPT
step under bf16 autocast follows the fp32 step on the CPU; the count sketch encodes and decodes
bit for bit as on the CPU; grouped experts follow the per-expert loop; the Trainer's CUDA
defaults (bf16, compiled blocks) follow its fp32 CPU run and report MFU; the fused AdamW applies
the clip in its step as torch's clipping pass does, and skips a non-finite step on the device;
bench mfu measures a row in a process where CUDA has not started; a profiled run says where
the device time went."""

import copy
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_RUN
from interlace.bench.mfu import _afresh
from interlace.compress import sketch
from interlace.mesh import DEVICE_ENV
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.moe.grouped import grouped_mlp
from interlace.parallel.grad_norm import GradNorm
from interlace.plan import Plan
from interlace.precision import reads_amp_hooks
from interlace.throughput import device_peak_tflops, model_flops_per_token
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig
from test_nonfinite import _assert_bit_identical, _poison_in_backward, _snapshot

pytestmark = pytest.mark.cuda

CONFIG = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4)

# bf16 keeps 8 significant bits (rounding ≤ 2^-9 ≈ 0.2 % per value) and the error grows through
# the layers. With CPU bf16 autocast this model's loss is off by ≈ 0.002 % and its gradient by
# ≈ 0.5 %; the bounds leave room for CUDA's kernels.
LOSS_RTOL = 1e-2
GRAD_RTOL = 5e-2


def _step(model: torch.nn.Module, idx: torch.Tensor, bf16: bool) -> tuple[float, torch.Tensor]:
    """Loss of one forward pass and the gradient of every parameter as one fp32 CPU vector."""
    idx = idx.to(next(model.parameters()).device)
    with torch.autocast(idx.device.type, torch.bfloat16, enabled=bf16):
        logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    grads = [p.grad.float().flatten().cpu() for p in model.parameters()]
    return loss.item(), torch.cat(grads)


def test_gpt_step_in_bf16_on_cuda_follows_fp32_on_the_cpu():
    torch.manual_seed(0)
    cpu = build_model(CONFIG)
    cuda = copy.deepcopy(cpu).cuda()
    idx = torch.randint(CONFIG.vocab_size, (4, CONFIG.seq_len + 1))
    loss, grad = _step(cpu, idx, bf16=False)
    cuda_loss, cuda_grad = _step(cuda, idx, bf16=True)
    assert cuda_loss == pytest.approx(loss, rel=LOSS_RTOL)
    assert (cuda_grad - grad).norm() <= GRAD_RTOL * grad.norm()


def _sketch_round_trip(device: str) -> dict[str, torch.Tensor]:
    """Hashes, table and every decoding of 2000 integer-valued entries (sums exact in fp32, so
    the order of CUDA's atomic adds cannot change them), moved to the CPU."""
    gen = torch.Generator().manual_seed(0)
    n = 2000
    positions = torch.randperm(100_000, generator=gen)[:n].sort().values.to(device)
    values = torch.randint(-100, 101, (n,), generator=gen).float().to(device)
    out = {}
    for method in sketch.DECODE_METHODS:
        cols = sketch.sketch_columns(n, sketch.DEFAULT_WIDTH[method])
        hashes = sketch.CountSketch.from_seed(7, rows=3, cols=cols, device=device)
        columns, signs = hashes.columns(positions), hashes.signs(positions, values.dtype)
        table = sketch.encode(values, columns, signs, cols)
        decoder = sketch.Decoder(method, columns, signs, cols)
        out |= {
            f"{method} columns": columns,
            f"{method} signs": signs,
            f"{method} table": table,
            f"{method} exact": decoder.exact,
            f"{method} decoded": decoder(table),
        }
    return {key: tensor.cpu() for key, tensor in out.items()}


def test_count_sketch_on_cuda_equals_the_cpu():
    cpu, cuda = _sketch_round_trip("cpu"), _sketch_round_trip("cuda")
    for key, expected in cpu.items():
        assert torch.equal(cuda[key], expected), key


def test_grouped_experts_in_bf16_on_cuda_follow_the_per_expert_loop_in_fp32():
    """Sixteen experts' feed-forward on CUDA in one grouped call under bf16 autocast
    (`F.grouped_mm` on sm90+, the padded bmm elsewhere) against each expert's own fp32 matmuls
    on the CPU: output and every gradient within bf16's tolerance."""
    gen = torch.Generator().manual_seed(0)
    n_experts, d, ffn = 16, 64, 128
    counts = torch.tensor([0, 5, 17, 3, 9, 0, 1, 30, 2, 8, 4, 6, 11, 0, 7, 1])
    x = torch.randn(int(counts.sum()) + 4, d, generator=gen)  # 4 rows past Σ counts
    w_up = torch.randn(n_experts, ffn, d, generator=gen) / d**0.5
    w_down = torch.randn(n_experts, d, ffn, generator=gen) / ffn**0.5
    b_up, b_down = torch.randn(n_experts, ffn, generator=gen), torch.randn(n_experts, d)
    leaves = [t.requires_grad_() for t in (x, w_up, b_up, w_down, b_down)]

    expected = torch.zeros_like(x)
    for e, rows in enumerate(torch.arange(int(counts.sum())).split(counts.tolist())):
        h = F.gelu(x[rows] @ w_up[e].T + b_up[e])
        expected = expected.index_add(0, rows, h @ w_down[e].T + b_down[e])
    expected_grads = torch.autograd.grad((expected**2).sum(), leaves)

    cuda_leaves = [t.detach().cuda().requires_grad_() for t in leaves]
    with torch.autocast("cuda", torch.bfloat16):
        out = grouped_mlp(cuda_leaves[0], counts.cuda(), *cuda_leaves[1:], act=F.gelu)
    grads = torch.autograd.grad((out.float() ** 2).sum(), cuda_leaves)
    assert out.dtype == torch.bfloat16
    assert (out.float().cpu() - expected).norm() <= GRAD_RTOL * expected.norm()
    for grad, want in zip(grads, expected_grads, strict=True):
        assert (grad.float().cpu() - want).norm() <= GRAD_RTOL * want.norm()


def test_trainer_compiled_in_bf16_on_cuda_follows_fp32_on_the_cpu_and_reports_mfu():
    """The Trainer's defaults on CUDA (bf16, compiled blocks) against the same run in fp32 on
    the CPU: the loss of each of 4 steps within bf16's tolerance; every row carries tokens/s,
    model TFLOP/s per device, MFU against the H100-class peak and peak device memory."""
    run = dataclasses.replace(TINY_RUN, steps=4)
    os.environ[DEVICE_ENV] = "cpu"
    try:
        cpu_rows = _train(run)
    finally:
        del os.environ[DEVICE_ENV]
    setup = prepare_run(run, Plan(), 1)
    assert (setup.precision, setup.compile) == ("bf16", True)
    trainer = Trainer(setup)
    rows = [trainer.train_step() for _ in range(run.steps)]
    flops = model_flops_per_token(setup.model_config)
    for row, cpu_row in zip(rows, cpu_rows, strict=True):
        assert row["loss"] == pytest.approx(cpu_row["loss"], rel=LOSS_RTOL)
        assert row["model_tflops"] == pytest.approx(flops * row["tokens_per_s"] / 1e12)
        peak = device_peak_tflops(torch.device("cuda"), "bf16")
        assert peak is None or row["mfu"] == pytest.approx(row["model_tflops"] / peak)
        assert row["peak_memory_gib"] > 0
        assert row["alloc_retries"] == 0  # a tiny model leaves the allocator room


def _train(run: TrainConfig) -> list[dict]:
    trainer = Trainer(prepare_run(run, Plan(), 1))
    return [trainer.train_step() for _ in range(run.steps)]


def test_fused_adamw_on_cuda_applies_the_clip_in_its_step_as_torch_clips():
    """`GradNorm.clip_` handed CUDA's fused AdamW leaves 1/c for its kernel: three steps of
    clipped gradients end where torch's clipping pass then the same fused step ends."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(256, 64, generator=gen), torch.randn(64, generator=gen)]
    grads = [[torch.randn(w.shape, generator=gen) * (s + 1) for w in weights] for s in range(3)]

    def run(in_step: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(w.cuda()) for w in weights]
        optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
        clipping = GradNorm(params)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.cuda()
            if in_step:
                clipping.clip_(1.0, optimizer)
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        return [p.detach().cpu() for p in params]

    for ours, reference in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_a_nan_gradient_on_cuda_is_skipped_by_the_fused_step_on_the_device():
    """The fused AdamW gets the verdict as `found_inf`: the poisoned step leaves weights, moments
    and step counts bit for bit, with no host sync before the update."""
    trainer = Trainer(prepare_run(dataclasses.replace(TINY_RUN, steps=3), Plan(), 1))
    assert reads_amp_hooks(trainer.optimizer)
    _poison_in_backward(trainer, step=2)
    trainer.train_step()
    before = _snapshot(trainer)
    row = trainer.train_step()
    _assert_bit_identical(before, _snapshot(trainer))
    assert row["skipped"] and row["grad_norm"] != row["grad_norm"]  # NaN
    assert not trainer.train_step().get("skipped")


def test_bench_mfu_measures_a_row_in_a_process_that_has_not_started_cuda():
    # the allocator's statistics exist only once CUDA starts: resetting them first would fail
    assert not torch.cuda.is_initialized()
    row = _afresh(torch.device("cuda", 0), lambda: 123.0)
    assert row == {"tokens_per_s": 123.0, "peak_memory_gib": 0.0, "alloc_retries": 0}


def test_a_profiled_cuda_run_heads_its_table_with_where_the_device_time_went(tmp_path):
    run = dataclasses.replace(TINY_RUN, steps=5, out=str(tmp_path), profile_steps=1)
    report = Trainer(prepare_run(run, Plan(), 1)).fit()
    spent = report["profile_device_time"]
    assert spent["steps"] == 1 and 0 < spent["busy"] <= spent["span"]
    assert spent["by_kind"]["matmul"] > 0
    head = (tmp_path / "profile/rank0.txt").read_text().splitlines()
    assert head[0].startswith("device time per step (mean of 1 profiled): span ")
    assert head[1].startswith("busy by kind") and "matmul" in head[1]

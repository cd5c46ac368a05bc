"""The presets' efficiency against measured runs: the planner's MFU for one H100 at the shapes
`interlace bench mfu` measured there (one device, bf16 autocast + torch.compile, the plain
loop; GPT at vocabulary 4096, T = 1024), and fp32's.

Measured on one H100 80GB (torch 2.11): gpt2-124m at global batch 16 reaches 34.8 % MFU in
bf16 + compile, 4.6 % in fp32; gpt2-1.5b at global batch 8 reaches 40.6 % in bf16 + compile
(MFU against the bf16 dense peak, 989 TFLOP/s, with the planner's FLOP count). The planner
must price each within 15 % of the measurement: the old bf16 efficiency (0.7) priced them at
66 % and 62 %. The MoE preset's step and its optimizer's share, likewise.
"""

import dataclasses

import pytest

from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.planner.cost import estimate
from interlace.planner.hardware import PRESETS

MEASURED = [  # (preset, global batch, dtype, MFU against the bf16 peak)
    ("gpt2-124m", 16, "bf16", 0.348),
    ("gpt2-1.5b", 8, "bf16", 0.406),
    ("gpt2-124m", 16, "fp32", 0.046),
]


@pytest.mark.parametrize(("preset", "global_batch", "dtype", "measured"), MEASURED)
def test_h100_preset_prices_one_device_within_15_percent_of_the_measured_mfu(
    preset, global_batch, dtype, measured
):
    hardware = PRESETS["dgx-h100"]
    spec = dataclasses.replace(get_preset(preset), vocab_size=4096, seq_len=1024)
    cost = estimate(Plan(dp=1), spec, hardware, global_batch, dtype=dtype)
    mfu = cost.tflops_per_device * 1e12 / hardware.peak("bf16")
    assert mfu == pytest.approx(measured, rel=0.15)


def test_h100_preset_prices_the_moe_step_and_its_optimizer_as_measured():
    """moe-gpt-12l (vocabulary 50304) at global batch 16 on the same H100: the Trainer's step
    took 81.5 ms in a fresh process (85.3 ms in `bench mfu`), of which the fused AdamW and
    the gradient norm over its 1.71 B parameters 24.5 ms (torch profiler); priced with HBM3's
    datasheet rate, the optimizer came to 16.4 ms."""
    hardware = PRESETS["dgx-h100"]
    spec = dataclasses.replace(get_preset("moe-gpt-12l"), vocab_size=50304)
    cost = estimate(Plan(dp=1), spec, hardware, 16, dtype="bf16")
    assert cost.breakdown["optimizer"] == pytest.approx(24.5e-3, rel=0.15)
    assert cost.step_seconds == pytest.approx(81.5e-3, rel=0.15)

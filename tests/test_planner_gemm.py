"""The matmul shape model (`planner.gemm`) priced by hand: tile and wave quantisation on a
device's SMs, split-K for small outputs over deep sums, the harmonic mean over a linear's
forward and two backward matmuls, and the per-device shapes each tensor split gives a layer."""

import dataclasses

import pytest

from interlace.errors import ConfigError
from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.gemm import (
    harmonic_efficiency,
    layer_shape_efficiency,
    shape_efficiency,
    shape_model,
)
from interlace.planner.hardware import PRESETS, local

SMS = 132
H100_TILES = shape_model(PRESETS["dgx-h100"], "bf16")  # tile and wave quantisation on 132 SMs


def test_an_output_of_one_full_wave_of_the_largest_tile_fills_every_sm():
    # 12 × 11 tiles of 256 × 128: one wave on 132 SMs, every slot useful
    assert shape_efficiency(12 * 256, 11 * 128, 256, SMS) == 1.0
    assert shape_efficiency(100, 100, 100, 0) == 1.0  # no SMs: no shape model


def test_one_tile_column_too_many_costs_a_wave_and_a_smaller_tile_wins():
    # 12 × 12 = 144 tiles of 256 × 128 take two waves (144 / 264); 128 × 64 tiles (0.8 of the
    # largest's throughput): 24 × 24 = 576 in five waves, 576 / 660 of them useful
    q = shape_efficiency(12 * 256, 12 * 128, 256, SMS)
    assert q == pytest.approx(0.8 * 576 / 660)


def test_a_small_output_over_a_deep_sum_is_split_along_it():
    # [256, 256] is 2 tiles of 256 × 128; 16384 deep splits 64 ways: 128 of the 132 SMs busy
    assert shape_efficiency(256, 256, 64 * 256, SMS) == pytest.approx(128 / 132)
    # too shallow to split: 2 tiles of 132 slots, or 16 of 64 × 64 at 0.6
    assert shape_efficiency(256, 256, 256, SMS) == pytest.approx(0.6 * 16 / 132)


def test_a_linear_is_priced_by_its_three_matmuls_harmonically():
    # forward [3072, 1408] and input gradient [3072, 1408]: one full wave each; the weight
    # gradient [1408, 1408] over 3072 rows: 66 tiles split in two, 121 / 132 of the slots useful
    q = harmonic_efficiency([(3072, 1408, 1408)], H100_TILES)
    assert q == pytest.approx(3 / (1 + 1 + 132 / 121))


@pytest.mark.parametrize(
    "plan, shapes",
    [
        # 1D tp=2: q, k, v and up split their outputs; out and down their inputs
        (
            Plan(tp=2),
            [(32, 64), (32, 64), (32, 64), (64, 32), (128, 64), (64, 128)],
        ),
        # tp3d=2x1x1: normal layers split their inputs over x; transposed ones their outputs
        (
            Plan(tp3d=(2, 1, 1)),
            [(64, 32), (64, 32), (64, 32), (32, 64), (256, 32), (32, 256)],
        ),
    ],
)
def test_a_layer_is_priced_at_the_shapes_one_device_holds(plan, shapes):
    config = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4)
    rows = 512
    expected = harmonic_efficiency([(rows, n, k) for n, k in shapes], H100_TILES)
    assert layer_shape_efficiency(plan, config, rows, H100_TILES) == pytest.approx(expected)
    assert expected < 1


def test_gpu_presets_name_their_sms_and_a_negative_count_is_refused():
    assert {name: PRESETS[name].sm_count for name in ("dgx-a100", "dgx-h100")} == {
        "dgx-a100": 108,
        "dgx-h100": 132,
    }
    assert local(1e12, 1e9).sm_count == 0  # a CPU: no shape model
    with pytest.raises(ConfigError, match=r"sm_count=-1 must be an integer >= 0"):
        dataclasses.replace(PRESETS["dgx-a100"], sm_count=-1)

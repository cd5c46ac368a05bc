"""Throughput figures: the model FLOP count against the formula by hand, the device peak
table, and the metrics a training step reports."""

import dataclasses
import json
import math

import pytest
import torch

from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.report import summarize
from interlace.throughput import device_peak_tflops, model_flops_per_token
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig


def test_gpt2_124m_flops_per_token_are_6n_plus_12ltd():
    c = get_preset("gpt2-124m")
    L, d, T, V = c.n_layers, c.d_model, c.seq_len, c.vocab_size
    matmul_params = L * (4 * d * d + 2 * d * c.ffn_dim) + d * V  # the tied head still multiplies
    assert model_flops_per_token(c) == 6 * matmul_params + 12 * L * T * d


def test_moe_flops_count_the_active_experts_only():
    moe = get_preset("moe-tiny")
    dense = dataclasses.replace(moe, n_experts=0)
    d, f, k = moe.d_model, moe.ffn_dim, moe.top_k
    router = d * moe.n_experts
    extra = len(moe.moe_layers) * (6 * (k - 1) * 2 * d * f + 6 * router)
    assert model_flops_per_token(moe) == model_flops_per_token(dense) + extra


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "fp32", 67.0),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_device_peak_is_looked_up_by_the_cuda_device_name(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops(torch.device("cuda", 0), precision) == peak


def test_cpu_has_no_peak():
    assert device_peak_tflops(torch.device("cpu"), "fp32") is None


def _rows(**changes):
    config = TrainConfig(
        model="tiny", steps=3, global_batch=8, eval_every=0, out=None, progress=False, **changes
    )
    trainer = Trainer(prepare_run(config, Plan(), 1))
    return trainer, [trainer.train_step() for _ in range(config.steps)]


def test_every_step_reports_model_tflops_and_mfu_against_the_given_peak():
    trainer, rows = _rows(peak_tflops=2.0)
    flops = model_flops_per_token(trainer.setup.model_config)
    for row in rows:
        assert row["model_tflops"] == pytest.approx(flops * row["tokens_per_s"] / 1e12)
        assert row["mfu"] == pytest.approx(row["model_tflops"] / 2.0)
    summary = summarize(rows)
    assert summary["mean_mfu"] == pytest.approx(sum(r["mfu"] for r in rows[1:]) / 2)


def test_mfu_is_left_out_where_the_peak_is_unknown():
    _, rows = _rows()
    assert all("mfu" not in row and "model_tflops" in row for row in rows)
    assert summarize(rows)["mean_mfu"] is None


def test_synthetic_data_trains_at_the_presets_vocabulary(tmp_path):
    """data=synthetic keeps the model's own vocabulary (not the tokenizer's), draws its ids
    uniformly (the first loss is about ln V) and is the same for the same seed."""
    model = dataclasses.replace(get_preset("tiny"), vocab_size=1000)
    path = tmp_path / "tiny-1000.json"
    path.write_text(json.dumps(model.to_dict()))
    config = TrainConfig(
        model=str(path), data="synthetic", steps=2, global_batch=4, eval_every=0, out=None
    )
    setup = prepare_run(config, Plan(), 1)
    assert setup.model_config.vocab_size == 1000
    tokens = setup.data.tokens
    assert int(tokens.min()) >= 0 and int(tokens.max()) == 999
    assert len(tokens.unique()) > 900  # uniform over the ids, not text
    assert setup.data.fingerprint == prepare_run(config, Plan(), 1).data.fingerprint
    first = Trainer(setup).train_step()
    assert first["loss"] == pytest.approx(math.log(1000), rel=0.05)


def test_allocator_retries_are_counted_from_the_runs_start_and_warned_about_once(
    monkeypatch, capsys
):
    """On CUDA each row carries the caching allocator's retries since the Trainer was built; the
    first step that has any prints one warning line (faked here: the CPU has no such count)."""
    counts = iter([5, 5, 7, 9, 9])  # at the Trainer's start, then after each step
    monkeypatch.setattr("interlace.train.trainer.allocator_retries", lambda device: next(counts))
    config = TrainConfig(
        model="tiny", steps=4, global_batch=8, eval_every=0, out=None, progress=False
    )
    report = Trainer(prepare_run(config, Plan(), 1)).fit()
    assert report["alloc_retries"] == 4
    warnings = [line for line in capsys.readouterr().err.splitlines() if "allocator" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("interlace: warning: by step 2 the CUDA caching allocator")
    assert "retried 2 allocation(s)" in warnings[0]
    assert "expandable_segments:True" in warnings[0]


def test_the_cpu_reports_no_allocator_retries():
    _, rows = _rows()
    assert all("alloc_retries" not in row for row in rows)
    assert summarize(rows)["alloc_retries"] is None

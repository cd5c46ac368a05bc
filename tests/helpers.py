"""What the test modules share (pytest puts tests/ on sys.path: `from helpers import ...`): the
gradient criterion `assert_grads_close`, `SVM_DATA`, the LIBSVM files shipped with the tests, and
`fake_calibration`, a machine calibration of made-up numbers for the planner's `local`.

Gradients are compared relative to each tensor's own scale, not with one absolute tolerance:
in the tiny test models the largest entry of a tensor ranges from ~1 (output biases) down to
~5e-5 (attention query weights and biases), where an absolute 1e-5 lets a 20 % error through.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

from interlace import checkpoint
from interlace.mesh import build_mesh
from interlace.models.config import GPTConfig
from interlace.models.presets import get_preset
from interlace.moe.experts import STORED_AS, expert_keys
from interlace.plan import Plan
from interlace.planner import calibrate as cal
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

SVM_DATA = Path(__file__).parent / "data" / "svm"
"""heart_scale, heart_scale.tr and heart_scale.t (origin: data/svm/README.md)."""

TINY_RUN = TrainConfig(
    model="tiny",
    steps=3,
    global_batch=8,
    eval_every=0,
    out=None,
    progress=False,
    warmup_steps=1,
    lr=5e-4,
)
"""Three steps of the tiny GPT, no files: the run the equality tests start from. Adam divides
each update by the gradient's running scale, so an element whose gradient is near zero turns
float rounding (different summation order over ranks) into an update difference proportional
to lr; lr=5e-4 keeps that below 2e-5 after 3 steps."""


def fake_calibration(**overrides) -> cal.Calibration:
    """A calibration of this machine (its fingerprint) with made-up rates: fp32 and bf16
    matmuls at 1 and 2 threads, a 1 GB/s link, 8 GB of memory; `overrides` replace fields."""
    fields = {
        "matmul_flops": {"fp32": {"1": 5e10, "2": 9e10}, "bf16": {"1": 2e11, "2": 3e11}},
        "link_latency": 1e-4,
        "link_bandwidth": 1e9,
        "memory_bytes": 8e9,
        "fingerprint": cal.fingerprint(),
        "overlap_efficiency": 0.6,
        "memory_bandwidth": {"1": 1e10, "2": 1.6e10},
    }
    return cal.Calibration(**{**fields, **overrides})


def tiny_config(n_layers: int = 4, **changes) -> GPTConfig:
    """The tiny preset with `n_layers` layers and `changes` (GPTConfig fields)."""
    return dataclasses.replace(get_preset("tiny"), n_layers=n_layers, **changes)


GRAD_RTOL = 1e-4
"""Default tolerance of `assert_grads_close`, relative to each expected tensor's largest entry:
float32 gradients summed in another order (over ranks, over split matmuls) agree to a few 1e-7
of it; 1e-4 still catches any dropped scale factor or mean taken as a sum."""

GRAD_FLOOR = 1e-7
"""Slack on top of the relative tolerance, as a fraction of the largest entry of all the expected
tensors compared together: a gradient that is zero in exact arithmetic (a key projection's bias:
softmax ignores a shift common to a row's scores) comes out as float32 rounding noise, a few
1e-10 of the largest gradients, which no relative criterion on its own scale can match."""


def per_expert(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every stacked expert tensor (`<layer>.experts.up_weight` [E, ...]) replaced
    by its E slices under the names expert parallelism holds them as
    (`<layer>.experts.<e>.up.weight`)."""
    out = {}
    for name, tensor in tensors.items():
        parent, _, leaf = name.rpartition(".")
        if leaf in STORED_AS and parent.rpartition(".")[2] == "experts":
            out.update(zip(expert_keys(name, len(tensor)), tensor, strict=True))
        else:
            out[name] = tensor
    return out


def assert_grads_close(
    actual: Mapping[str, torch.Tensor] | torch.Tensor,
    expected: Mapping[str, torch.Tensor] | torch.Tensor,
    rtol: float = GRAD_RTOL,
    floor: float = GRAD_FLOOR,
    what: str = "",
) -> None:
    """Each tensor of `actual` ({name: tensor}, or one tensor) within `rtol` of its `expected`
    counterpart relative to that tensor's own scale: max|a - e| <= rtol · max|e| + floor · m,
    m the largest |entry| of all the expected tensors.

    Raises AssertionError naming every tensor off (and its relative error), and any name in one
    mapping but not the other. `what` prefixes the message (a rank, a step)."""
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        actual, expected = {"tensor": actual}, {"tensor": expected}
    prefix = f"{what}: " if what else ""
    missing = sorted(set(expected) ^ set(actual))
    assert not missing, f"{prefix}names in only one of actual, expected: {missing}"
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, f"{prefix}{name}: shape {got.shape} != {want.shape}"
    scales = {name: _diff_and_scale(actual[name], want) for name, want in expected.items()}
    slack = floor * max((scale for _, scale in scales.values()), default=0.0)
    bad = []
    for name, (diff, scale) in scales.items():
        if not diff <= rtol * scale + slack:  # `not <=`: NaN fails too
            relative = diff / scale if scale > 0 else float("inf")
            bad.append(
                f"{name}: max|Δ| {diff:.3g} is {relative:.3g} of max|expected| {scale:.3g}"
                f" (rtol {rtol:g})"
            )
    assert not bad, prefix + f"{len(bad)} of {len(expected)} tensors differ:\n  " + "\n  ".join(bad)


def _diff_and_scale(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(max |actual - expected|, max |expected|)."""
    if expected.numel() == 0:
        return 0.0, 0.0
    a, e = actual.detach().double(), expected.detach().double().to(actual.device)
    return float((a - e).abs().max()), float(e.abs().max())


def train_steps(
    config: TrainConfig, plan_text: str, resume_from=None, saved_at: int | None = None
) -> tuple[list[float], Trainer]:
    """This rank's run of `config` under `plan_text` (from the checkpoint `resume_from`, if
    given) to `config.steps`: the losses of the steps it takes and the trainer; with
    `config.out`, a checkpoint after step `saved_at`."""
    plan = Plan.parse(plan_text)
    trainer = Trainer(
        prepare_run(config, plan, plan.world_size),
        build_mesh(plan) if plan.world_size > 1 else None,
    )
    if resume_from is not None:
        trainer.resume(resume_from)
    losses = []
    while trainer.step < config.steps:
        losses.append(trainer.train_step()["loss"])
        if config.out and trainer.step == saved_at:
            trainer.save()
    return losses, trainer


@contextlib.contextmanager
def pieces_under_own_keys() -> Iterator[None]:
    """Checkpoints written inside hold each rank's tensor parallel pieces under keys of their
    own where they are not one block of the full tensor or FSDP2 shards them, as checkpoints
    were written before such pieces were stored as full tensors."""
    write = checkpoint._write_folder

    def as_before(tmp, step, model, optimizer, meta, storage):
        sharded = {
            name
            for name, param in model.named_parameters(remove_duplicate=False)
            if isinstance(param, DTensor)
        }
        layouts = {name: lay for name, lay in storage.layouts.items() if name not in sharded}
        kept = dataclasses.replace(storage, whole={}, layouts=layouts)
        return write(tmp, step, model, optimizer, meta, kept)

    with mock.patch.object(checkpoint, "_write_folder", as_before):
        yield

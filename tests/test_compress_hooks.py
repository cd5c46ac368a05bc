"""Compression hooks under DDP on 2 ranks, against the single-process model on the same data."""

import math

import pytest
import torch
import torch._dynamo  # DDP imports it lazily (2-8 s); forked ranks then share it
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers import assert_grads_close
from interlace import comm
from interlace.bench.compress_workloads import (
    DensityProbe,
    Workload,
    click_workload,
    density_probe_hook,
    gpt_workload,
    grad_density,
)
from interlace.compress import make_comm_hook
from interlace.errors import ConfigError
from interlace.report import summarize, write_report
from interlace.testing import run_ranks

_KEEP_ALIVE: list = []
TINY_CLICKS = {"table_rows": (3000, 2000, 1000), "dim": 8, "hidden": 16, "batch_size": 32}


class _Regression(nn.Module):
    """A dense model: x [B, 8] → prediction [B], scored by MSE against y [B]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def _regression(rank: int) -> Workload:
    gen = torch.Generator().manual_seed(rank)
    batches = iter(lambda: (torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen)), 0)
    return Workload(
        _Regression(), batches, lambda module, batch: F.mse_loss(module(batch[0]), batch[1])
    )


def _workload(name: str, rank: int) -> Workload:
    return click_workload(**TINY_CLICKS, rank=rank) if name == "clicks" else _regression(rank)


def _train(
    kind: str, options: dict, steps: int, bucket_cap_mb: float, workload: str = "clicks"
) -> dict:
    """`steps` SGD steps of DDP(workload's model) with hook `kind`, and of the serial model fed
    both ranks' batches; returns both models' parameters and gradients at every step (DDP's:
    after the hook), each rank's own first gradient and the hook state's records."""
    rank = dist.get_rank()
    group = comm.Group("dp", dist.group.WORLD, 2, rank)
    data = [_workload(workload, r) for r in range(2)]
    serial_work = _workload(workload, 0)
    serial = serial_work.model
    ddp = DistributedDataParallel(data[rank].model, bucket_cap_mb=bucket_cap_mb)
    state, hook = make_comm_hook(kind, group, **options)
    ddp.register_comm_hook(state, hook)
    if kind == "powersgd":
        # torch's PowerSGD callbacks run on gloo's worker thread; a DDP or state freed from
        # there makes the process group's thread join itself ("Resource deadlock avoided")
        # about one run in four: keep both until the rank exits.
        _KEEP_ALIVE.append((ddp, state))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=0.5)
    grads, serial_grads = [], []
    for step in range(steps):
        batches = [next(d.batches) for d in data]
        if step == 0:  # every rank's own gradient, at the initial weights the models share
            local = [_gradients(serial, serial_work.loss(serial, batch)) for batch in batches]
        opt.zero_grad()
        data[rank].loss(ddp, batches[rank]).backward()
        grads.append({n: p.grad.clone() for n, p in data[rank].model.named_parameters()})
        opt.step()
        serial_opt.zero_grad()
        both = tuple(torch.cat(parts) for parts in zip(*batches, strict=True))
        serial_work.loss(serial, both).backward()
        serial_grads.append({n: p.grad.clone() for n, p in serial.named_parameters()})
        serial_opt.step()
    out = {
        "params": {n: p.detach().clone() for n, p in data[rank].model.named_parameters()},
        "serial": {n: p.detach().clone() for n, p in serial.named_parameters()},
        "grads": grads,
        "serial_grads": serial_grads,
        "local_grads": local,
    }
    if hasattr(state, "stats"):
        out["paths"] = sorted({s.path for s in state.stats.values()})
        out["bucket_counts"] = state.bucket_counts
        out["rebuilds"] = state.rebuilds
        out["summary"] = state.summary()
        out["stats"] = list(state.stats.values())
    return out


def _gradients(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: d loss / d parameter} (zeros where the loss does not reach), `.grad` untouched."""
    params = dict(model.named_parameters())
    found = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {
        n: torch.zeros_like(p) if g is None else g
        for (n, p), g in zip(params.items(), found, strict=True)
    }


def _assert_matches_serial(results: list[dict], atol: float) -> None:
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name  # ranks agree bitwise
        torch.testing.assert_close(value, results[0]["serial"][name], atol=atol, rtol=0)
    for step, (grads, serial) in enumerate(
        zip(results[0]["grads"], results[0]["serial_grads"], strict=True)
    ):
        assert_grads_close(grads, serial, what=f"step {step}")


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()]).double()


def _first_step(result: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first step's gradient after the hook and each rank's own, flattened."""
    mine, theirs = (_flat(g) for g in result["local_grads"])
    return _flat(result["grads"][0]), mine, theirs


def test_lossless_sketch_hook_equals_serial_training_across_bucket_rebuild():
    options = {"decode": "peel", "width_factor": 2.0}
    results = run_ranks(2, _train, "sketch", options, 4, 0.05, timeout=60)
    _assert_matches_serial(results, atol=1e-5)
    r0 = results[0]
    assert r0["bucket_counts"][0] == 1 and r0["bucket_counts"][-1] > 1  # DDP rebuilt its buckets
    assert r0["rebuilds"] >= 1
    assert "sketch" in r0["paths"]
    assert r0["summary"]["ratio"] < 0.5


def test_median_sketch_with_error_feedback_keeps_ranks_identical():
    options = {"decode": "median", "width_factor": 1.0, "error_feedback": True}
    r0, r1 = run_ranks(2, _train, "sketch", options, 4, 0.05, timeout=60)
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name
    assert "sketch" in r0["paths"]
    # lossy: the trajectory departs from serial training, but stays near it
    drift = max((v - r0["serial"][n]).abs().max().item() for n, v in r0["params"].items())
    assert 0 < drift < 1.0
    # The bitmap union is exact: an entry arrives non-zero where some rank's gradient is, and
    # only there. Median decoding of a sketch as wide as the non-zeros errs on colliding entries.
    sent, a, b = _first_step(r0)
    assert torch.equal(sent != 0, (a != 0) | (b != 0))
    mean = (a + b) / 2
    error = float((sent - mean).norm() / mean.norm())
    assert error < 0.3  # measured 0.15 of the mean gradient's norm


def test_sketch_hook_sends_dense_buckets_dense_and_probes_them_once():
    options = {"recheck_every": 50}
    results = run_ranks(2, _train, "sketch", options, 5, 25.0, "dense", timeout=60)
    _assert_matches_serial(results, atol=1e-5)
    stats = results[0]["stats"]
    assert stats and all(s.path == "dense" and s.calls == 4 for s in stats)
    for s in stats:  # one bitmap probe after DDP's rebuild, then plain all-reduces
        assert s.bytes_sent - s.dense_bytes == math.ceil(s.numel / 8)
        assert s.union_density == 1.0


def test_topk_hook_with_every_entry_equals_serial_training():
    results = run_ranks(2, _train, "topk", {"fraction": 1.0}, 3, 0.05, timeout=60)
    _assert_matches_serial(results, atol=1e-5)
    assert results[0]["paths"] == ["topk"]


def test_topk_hook_with_few_entries_keeps_ranks_identical():
    r0, r1 = run_ranks(2, _train, "topk", {"fraction": 0.002, "error_feedback": True}, 3, 0.05)
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name
    assert r0["summary"]["ratio"] == pytest.approx(0.004, rel=0.05)  # 0.2 % × 8 B vs 4 B dense
    drift = max((v - r0["serial"][n]).abs().max().item() for n, v in r0["params"].items())
    assert drift > 1e-4  # fewer entries than the gradients' non-zeros: really lossy
    # First step: every entry that arrives is the mean of what the ranks sent there, i.e. the
    # mean gradient (both sent it) or half of one rank's entry; each rank's largest is among them.
    sent, a, b = _first_step(r0)
    kept = sent != 0
    numel, tensors = sent.numel(), len(r0["grads"][0])
    assert 0 < int(kept.sum()) <= 2 * (0.002 * numel + tensors)  # ≤ ⌈0.2 %⌉ per bucket and rank
    tol = 1e-5 * float(sent.abs().max())
    arrived = [(sent - value).abs() <= tol for value in ((a + b) / 2, a / 2, b / 2)]
    assert bool((arrived[0] | arrived[1] | arrived[2])[kept].all())
    assert bool(arrived[0][kept].any())  # the largest entries are in both ranks' top-k
    for own in (a, b):
        assert kept[own.abs().argmax()]


def test_torch_powersgd_runs_with_one_bucket():
    rank = 2
    options = {"matrix_approximation_rank": rank, "start_powerSGD_iter": 2}
    r0, r1 = run_ranks(2, _train, "powersgd", options, 3, 100.0, timeout=60)
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name
    # Steps 0-1 are plain all-reduces; step 2, the first compressed one, starts from the serial
    # weights. For each matrix M (viewed [rows, -1]) of the mean gradient PowerSGD returns
    # P·Pᵀ·M, P an orthonormal basis [rows, rank] of M·Q: a projection of rank ≤ `rank`, whose
    # inner product with M is its squared norm. Vectors are all-reduced as they are.
    for step in (0, 1):
        assert_grads_close(r0["grads"][step], r0["serial_grads"][step], what=f"step {step}")
    sent, mean = r0["grads"][2], r0["serial_grads"][2]
    vectors = [n for n, g in sent.items() if g.dim() == 1]
    assert_grads_close({n: sent[n] for n in vectors}, {n: mean[n] for n in vectors})
    for name in sent.keys() - vectors:
        s, m = (g.double().reshape(g.shape[0], -1) for g in (sent[name], mean[name]))
        singular = torch.linalg.svdvals(s)
        assert float(singular[rank:].sum()) <= 1e-5 * float(singular[0]), name
        assert float((s * m).sum()) == pytest.approx(float(s.square().sum()), rel=1e-4), name
    error = float((_flat(sent) - _flat(mean)).norm() / _flat(mean).norm())
    # one power iteration from a random Q, rank 2 of 8- to 24-wide matrices: measured 0.74
    assert 0.05 < error < 0.9


def test_make_comm_hook_rejects_unknown_kinds_and_options():
    group = comm.Group("dp", None, 1, 0)
    with pytest.raises(ConfigError, match="sketch"):
        make_comm_hook("zip", group)
    with pytest.raises(ConfigError, match="width_factor"):
        make_comm_hook("sketch", group, widht_factor=2.0)
    with pytest.raises(ConfigError, match="fraction"):
        make_comm_hook("topk", group, fraction=0.0)
    assert make_comm_hook("dense", group) == (group, comm.ddp_allreduce_hook)


def test_gpt_embedding_gradient_is_sparse_only_when_untied():
    densities = {}
    for tied in (False, True):
        work = gpt_workload(vocab_size=4096, d_model=16, seq_len=16, batch_size=4, tied=tied)
        work.loss(work.model, next(work.batches)).backward()
        densities[tied] = grad_density(work.model)
    assert densities[False]["wte.weight"] < 0.05  # ≤ 68 distinct tokens of 4096
    assert densities[False]["lm_head.weight"] == 1.0
    assert densities[True]["wte.weight"] == 1.0  # the tied LM head touches every row


def _probe_buckets() -> dict:
    group = comm.Group("dp", dist.group.WORLD, 2, dist.get_rank())
    work = click_workload(**TINY_CLICKS, rank=dist.get_rank())
    ddp = DistributedDataParallel(work.model, bucket_cap_mb=0.05)
    probe = DensityProbe(group, comm.ddp_allreduce_hook)
    ddp.register_comm_hook(probe, density_probe_hook)
    for _ in range(2):
        work.loss(ddp, next(work.batches)).backward()
    return {"probe": (probe.densities, probe.numels), "params": grad_density(work.model)}


def test_density_probe_reports_each_bucket():
    r0, _ = run_ranks(2, _probe_buckets)
    densities, numels = r0["probe"]
    assert sum(numels.values()) == sum(
        p.numel() for p in click_workload(**TINY_CLICKS).model.parameters()
    )
    assert len(densities) > 1 and all(0 < d < 0.2 for d in densities.values())  # tables dominate
    assert r0["params"]["tables.0.weight"] < 0.1 and r0["params"]["mlp.0.weight"] > 0.9


@pytest.mark.parametrize(("ratios", "noted"), [([1.03, 1.02], True), ([1.03, 0.81], False)])
def test_a_run_whose_compression_sends_the_dense_bytes_says_so(tmp_path, ratios, noted):
    steps = enumerate(ratios)
    rows = [
        {
            "step": i + 1,
            "loss": 1.0,
            "step_time_s": 1.0,
            "tokens_per_s": 1.0,
            "compression_ratio": r,
        }
        for i, r in steps
    ]
    report = summarize(rows)
    assert report["compression_ratio"] == ratios[-1]
    notes = write_report(tmp_path, {**report, "title": "t"})
    assert any("compression sent" in note for note in notes) == noted

"""Compression hooks under DDP on 2 ranks, against the single-process model on the same data."""

import math

import pytest
import torch
import torch._dynamo  # DDP imports it lazily (2-8 s); forked ranks then share it
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from interlace import comm
from interlace.compress import make_comm_hook
from interlace.compress.workloads import (
    DensityProbe,
    Workload,
    click_workload,
    density_probe_hook,
    gpt_workload,
    grad_density,
)
from interlace.errors import ConfigError
from interlace.testing import run_ranks

_KEEP_ALIVE: list = []
TINY_CLICKS = {"table_rows": (3000, 2000, 1000), "dim": 8, "hidden": 16, "batch_size": 32}


class _Regression(nn.Module):
    """A dense model: x [B, 8] → (prediction [B], MSE loss against y [B])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = self.net(x).squeeze(1)
        return prediction, nn.functional.mse_loss(prediction, y)


def _regression(rank: int) -> Workload:
    gen = torch.Generator().manual_seed(rank)
    batches = iter(lambda: (torch.randn(16, 8, generator=gen), torch.randn(16, generator=gen)), 0)
    return Workload(_Regression(), batches)


def _workload(name: str, rank: int) -> Workload:
    return click_workload(**TINY_CLICKS, rank=rank) if name == "clicks" else _regression(rank)


def _train(
    kind: str, options: dict, steps: int, bucket_cap_mb: float, workload: str = "clicks"
) -> dict:
    """`steps` SGD steps of DDP(workload's model) with hook `kind`, and of the serial model fed
    both ranks' batches; returns both models' parameters and the hook state's records."""
    rank = dist.get_rank()
    group = comm.Group("dp", dist.group.WORLD, 2, rank)
    data = [_workload(workload, r) for r in range(2)]
    serial = _workload(workload, 0).model
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
    for _ in range(steps):
        batches = [next(d.batches) for d in data]
        opt.zero_grad()
        ddp(*batches[rank])[1].backward()
        opt.step()
        serial_opt.zero_grad()
        ids, labels = (torch.cat(parts) for parts in zip(*batches, strict=True))
        serial(ids, labels)[1].backward()
        serial_opt.step()
    out = {
        "params": {n: p.detach().clone() for n, p in data[rank].model.named_parameters()},
        "serial": {n: p.detach().clone() for n, p in serial.named_parameters()},
    }
    if hasattr(state, "stats"):
        out["paths"] = sorted({s.path for s in state.stats.values()})
        out["bucket_counts"] = state.bucket_counts
        out["rebuilds"] = state.rebuilds
        out["summary"] = state.summary()
        out["stats"] = list(state.stats.values())
    return out


def _assert_matches_serial(results: list[dict], atol: float) -> None:
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name  # ranks agree bitwise
        torch.testing.assert_close(value, results[0]["serial"][name], atol=atol, rtol=0)


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


def test_torch_powersgd_runs_with_one_bucket():
    options = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
    r0, r1 = run_ranks(2, _train, "powersgd", options, 3, 100.0, timeout=60)
    for name, value in r0["params"].items():
        assert torch.equal(value, r1["params"][name]), name


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
        work.model(*next(work.batches))[1].backward()
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
        ddp(*next(work.batches))[1].backward()
    return {"probe": (probe.densities, probe.numels), "params": grad_density(work.model)}


def test_density_probe_reports_each_bucket():
    r0, _ = run_ranks(2, _probe_buckets)
    densities, numels = r0["probe"]
    assert sum(numels.values()) == sum(
        p.numel() for p in click_workload(**TINY_CLICKS).model.parameters()
    )
    assert len(densities) > 1 and all(0 < d < 0.2 for d in densities.values())  # tables dominate
    assert r0["params"]["tables.0.weight"] < 0.1 and r0["params"]["mlp.0.weight"] > 0.9

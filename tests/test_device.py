"""The device choice on a machine with CUDA, simulated by `torch.cuda.is_available() → True`:
torchrun ranks take their local GPU and NCCL; forked gloo ranks compute on the CPU and touch no
CUDA (this machine's torch has none, so any CUDA call would fail the rank)."""

import math

import pytest
import torch
import torch.distributed as dist

from interlace.errors import ConfigError
from interlace.mesh import DEVICE_ENV, backend_for, build_mesh, default_device
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig


@pytest.fixture
def cuda_machine(monkeypatch):
    """One CUDA device reported, no CPU pin from the test session, outside torchrun."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # optimizers ask it where CUDA seems available; with the GPU hidden it would fail
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv(DEVICE_ENV)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_a_torchrun_rank_takes_its_local_gpu_and_nccl(cuda_machine, monkeypatch):
    assert default_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_device() == torch.device("cuda", 1)
    assert backend_for(default_device()) == "nccl"


def test_the_cpu_when_pinned_or_without_cuda(cuda_machine, monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert default_device() == torch.device("cpu")
    monkeypatch.delenv(DEVICE_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ConfigError, match="INTERLACE_DEVICE='gpu'"):
        default_device()


def _train_and_checkpoint(out: str) -> dict:
    """One dp=2 step, saved and resumed, every decision taken inside the rank."""
    plan = Plan.parse("dp=2")
    config = TrainConfig(
        model="tiny", steps=1, global_batch=4, eval_every=0, out=out, progress=False
    )
    trainer = Trainer(prepare_run(config, plan, 2), build_mesh(plan))
    loss = trainer.train_step()["loss"]
    checkpoint = trainer.save()
    trainer.resume(checkpoint)
    rng = torch.load(checkpoint / f"rng-rank{dist.get_rank()}.pt", weights_only=False)
    return {
        "device": str(default_device()),
        "trainer": str(trainer.device),
        "loss": loss,
        "rng": sorted(rng),
    }


def test_forked_gloo_ranks_train_on_the_cpu_where_cuda_is_available(cuda_machine, tmp_path):
    results = run_ranks(2, _train_and_checkpoint, str(tmp_path))
    for r in results:
        assert r["device"] == r["trainer"] == "cpu"
        assert math.isfinite(r["loss"])
        assert r["rng"] == ["torch"]  # no CUDA generator asked for
    assert not torch.cuda.is_initialized()  # the parent stays free to fork again

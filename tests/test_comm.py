"""Comm meter: each collective is executed correctly and counted with its bytes."""

import pytest
import torch

from interlace import comm
from interlace.mesh import build_mesh
from interlace.plan import Plan
from interlace.testing import run_ranks


def _every_op():
    mesh = build_mesh(Plan(dp=2))
    dp = mesh.group("dp")
    meter = comm.CommMeter(timed=True)
    r = dp.rank
    t = torch.full((4,), float(r + 1))
    comm.all_reduce(t, dp, meter=meter)
    gathered = torch.empty(8)
    comm.all_gather(gathered, torch.full((4,), float(r)), dp, meter=meter)
    scattered = torch.empty(2)
    comm.reduce_scatter(scattered, torch.arange(4.0), dp, meter=meter)
    exchanged = torch.empty(3)
    send = torch.arange(3.0) + 10 * r
    splits_in = [1, 2] if r == 0 else [2, 1]
    splits_out = [1, 2] if r == 0 else [2, 1]
    comm.all_to_all(exchanged, send, dp, splits_out, splits_in, meter=meter)
    b = torch.full((2,), float(r))
    comm.broadcast(b, 1, dp, meter=meter)
    lazy = comm.lazy_all_reduce(torch.ones(5), dp, meter=meter)
    return {
        "all_reduce": t,
        "all_gather": gathered,
        "reduce_scatter": scattered,
        "all_to_all": exchanged,
        "broadcast": b,
        "lazy": lazy.clone(),
        "snapshot": meter.snapshot(),
        "per_group": meter.bytes_per_group(),
    }


def test_collectives_compute_and_count():
    r0, r1 = run_ranks(2, _every_op)
    assert torch.equal(r0["all_reduce"], torch.full((4,), 3.0))
    assert torch.equal(r1["all_gather"], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert torch.equal(r0["reduce_scatter"], torch.tensor([0.0, 2.0]))
    assert torch.equal(r1["reduce_scatter"], torch.tensor([4.0, 6.0]))
    # rank0 sends [0] to itself and [1,2] to rank1; rank1 sends [10,11] to rank0 and [12] to itself
    assert torch.equal(r0["all_to_all"], torch.tensor([0.0, 10.0, 11.0]))
    assert torch.equal(r1["all_to_all"], torch.tensor([1.0, 2.0, 12.0]))
    assert torch.equal(r0["broadcast"], torch.ones(2))
    assert torch.equal(r0["lazy"], torch.full((5,), 2.0))
    ops = r0["snapshot"]["dp"]
    assert ops["all_reduce"]["calls"] == 2 and ops["all_reduce"]["bytes"] == 16 + 20
    assert ops["all_reduce"]["wire_bytes"] == pytest.approx(36.0)  # 2(p-1)/p = 1 at p=2
    assert ops["all_gather"]["bytes"] == 16 and ops["all_gather"]["wire_bytes"] == 16
    assert ops["reduce_scatter"]["wire_bytes"] == 8
    assert ops["broadcast"]["bytes"] == 8
    assert ops["reduce_scatter"]["seconds"] > 0
    assert r0["per_group"] == {"dp": 36 + 16 + 16 + 12 + 8}


def test_wire_bytes_ring_factors():
    assert comm.wire_bytes("all_reduce", 400, 4) == 600
    assert comm.wire_bytes("all_gather", 100, 4) == 300
    assert comm.wire_bytes("reduce_scatter", 400, 4) == 300
    assert comm.wire_bytes("all_to_all", 400, 1) == 0

"""Mesh: named groups with the documented rank order (tp innermost, pp outermost)."""

import torch.distributed as dist

from interlace.mesh import build_mesh, mesh_dims
from interlace.plan import Plan
from interlace.testing import run_ranks


def _group_members(plan_text):
    mesh = build_mesh(Plan.parse(plan_text))
    members = {}
    for name in mesh.dims:
        group = mesh.group(name)
        members[name] = sorted(dist.get_process_group_ranks(group.pg))
        assert group.size == mesh.size(name) and group.rank == mesh.rank(name)
    return members


def test_1d_rank_order_tp_innermost_pp_outermost():
    results = run_ranks(8, _group_members, "dp=2,pp=2,tp=2")
    for rank, groups in enumerate(results):
        pp_i, dp_i, tp_i = rank // 4, (rank // 2) % 2, rank % 2
        assert groups["tp"] == [pp_i * 4 + dp_i * 2 + t for t in range(2)]
        assert groups["dp"] == [pp_i * 4 + d * 2 + tp_i for d in range(2)]
        assert groups["pp"] == [p * 4 + dp_i * 2 + tp_i for p in range(2)]


def test_3d_rank_order_x_fastest():
    results = run_ranks(8, _group_members, "dp=2,tp3d=2x2x1")
    for rank, groups in enumerate(results):
        assert groups["tp_x"] == [rank - rank % 2 + i for i in range(2)]
        base = rank - (rank // 2 % 2) * 2
        assert groups["tp_y"] == [base, base + 2]
        assert groups["tp_z"] == [rank]
        assert groups["dp"] == sorted([rank % 4, rank % 4 + 4])


def test_mesh_dims_names_and_sizes():
    assert mesh_dims(Plan(dp=2, pp=3, tp=4)) == (("pp", "dp", "tp"), (3, 2, 4))
    assert mesh_dims(Plan(dp=2, tp3d=(2, 3, 4))) == (
        ("pp", "dp", "tp_z", "tp_y", "tp_x"),
        (1, 2, 4, 3, 2),
    )

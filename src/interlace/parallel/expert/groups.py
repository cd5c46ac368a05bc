"""Expert parallel process groups, carved out of the data parallel groups.

Expert parallelism of degree `ep` splits every data parallel group of `dp` ranks (listed in dp
index order) into dp / ep consecutive chunks of `ep` ranks, ep innermost:

    dp index  d = j · ep + i        i = index inside the expert group (0 ≤ i < ep)
                                    j = which expert group             (0 ≤ j < dp / ep)
    ep group     {d = j · ep + i : i}   the ranks that split the experts between them (all-to-all)
    ep_dp group  {d = j · ep + i : j}   the ranks holding the same experts (their gradients
                                        are averaged here instead of over dp)

Example, `dp=4, tp=2, ep=2` on 8 ranks (rank = dp_index · 2 + tp_index): dp groups
{0, 2, 4, 6} and {1, 3, 5, 7}; ep groups {0, 2}, {4, 6}, {1, 3}, {5, 7}; ep_dp groups
{0, 4}, {2, 6}, {1, 5}, {3, 7}.

Each group is one `dist.new_group` call; torch requires every rank to call new_group for every
group in the same order, so the groups of all dp groups are created on every rank. The mesh's
DeviceMesh could build them by reshaping itself into (pp, dp/ep, ep, tp…), but that would
create a second copy of the pp and tp groups too; new_group makes only the two new ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from interlace.comm import Group
from interlace.divisors import divisors
from interlace.errors import PlanError
from interlace.mesh import Mesh


class ExpertGroups(NamedTuple):
    """A rank's expert-parallel groups: `ep` splits the experts between its ranks, `ep_dp` holds
    the same experts (their replicas), `others` route other tokens to the same experts: ep ×
    tp's `tp`, ep × tp3d's `tp_xy` and, with z > 1, `tp_z` (empty without tensor
    parallelism)."""

    ep: Group
    ep_dp: Group
    others: tuple[Group, ...]


def build_expert_groups(mesh: Mesh, ep: int) -> tuple[Group, Group]:
    """(ep_group, ep_dp_group) of this rank for expert parallel degree `ep` (see the module
    docstring for the layout). Collective: every rank of the mesh must call it, with the same
    `ep`. Raises PlanError if `ep` does not divide the mesh's dp size."""
    dp = mesh.size("dp")
    if ep < 1 or dp % ep:
        fits = divisors(dp)
        raise PlanError(
            f"ep={ep} must divide dp={dp} (expert groups are carved out of the data parallel "
            f"groups); use ep in {fits}"
        )
    ranks = mesh.device_mesh.mesh
    dp_groups = ranks.movedim(mesh.dims.index("dp"), -1).reshape(-1, dp).tolist()
    me = dist.get_rank()
    ep_group = ep_dp_group = None
    for members in dp_groups:
        for j in range(dp // ep):
            group = _new_group("ep", members[j * ep : (j + 1) * ep], me)
            ep_group = group or ep_group
        for i in range(ep):
            group = _new_group("ep_dp", members[i::ep], me)
            ep_dp_group = group or ep_dp_group
    assert ep_group is not None and ep_dp_group is not None, "rank missing from the mesh"
    return ep_group, ep_dp_group


def _new_group(name: str, members: list[int], me: int) -> Group | None:
    """Create the process group of `members` (collective); return it as a Group if `me` is in it."""
    pg = dist.new_group(members)
    if me not in members:
        return None
    return Group(name=name, pg=pg, size=len(members), rank=members.index(me))

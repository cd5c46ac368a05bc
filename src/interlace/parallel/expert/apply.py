"""`parallelize_experts`: replace every MoE layer of a model (built-in `MoELayer`, or a block
with fused experts found by structure) by its expert-parallel form, linked in forward order;
`link_within` links them again per pipeline stage; `share_tokens_over_tp` makes them dispatch
each token once per tensor-parallel group (ep × tp, `tp_tokens`)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from interlace.comm import Group
from interlace.moe.balance import Balancer, make_balancer
from interlace.moe.layer import MoELayer
from interlace.parallel.detect import ExpertBlock, find_expert_blocks
from interlace.parallel.expert.fused import parallelize_fused_experts
from interlace.parallel.expert.layer import ExpertParallelMoE, schedule_transfers
from interlace.parallel.expert.tp_tokens import TokenShare
from interlace.parallel.grad_sums import sum_gradient_over


def parallelize_experts(
    model: nn.Module,
    group: Group,
    balance: str | Balancer = "none",
    history: int = 16,
    overlap: bool = True,
    blocks: list[ExpertBlock] | None = None,
) -> list[str]:
    """Replace every `MoELayer` in `model` by an `ExpertParallelMoE` over `group`, and the
    fused experts module of every block with fused experts (HF Mixtral, Qwen2-MoE; `blocks`,
    or found by `detect.find_expert_blocks`: pass those found before a tensor split changed
    the blocks' other parts) by a `FusedExpertParallel` (in place), linked in module order by
    `schedule_transfers` (`overlap`: asynchronous Trans and Agg).

    Every rank must pass the same full model. The built-in GPT keeps summing each layer's
    `aux_loss`. Returns one report line per replaced layer.
    """
    balancer = make_balancer(balance) if isinstance(balance, str) else balance
    report = []
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)]
    replaced: list[tuple[str, ExpertParallelMoE]] = []
    for name, layer in targets:
        parent_name, _, child = name.rpartition(".")
        parallel = ExpertParallelMoE(layer, group, balancer, history, overlap)
        setattr(model.get_submodule(parent_name), child, parallel)
        replaced.append((name, parallel))
    blocks = find_expert_blocks(model) if blocks is None else blocks
    replaced += parallelize_fused_experts(model, blocks, group, balancer, history, overlap)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    replaced.sort(key=lambda item: order[item[0]])
    layers = [parallel for _, parallel in replaced]
    for name, parallel in replaced:
        last = parallel.first_expert + parallel.num_local - 1
        report.append(
            f"{name}: experts {parallel.first_expert}-{last} of {parallel.num_experts} on this "
            f"rank (ep={group.size}, {group.name} group), balance={balancer.name}"
        )
    schedule_transfers(layers)
    return report


def link_within(stages: Iterable[nn.Module]) -> None:
    """Link the expert-parallel layers of each module of `stages` (a pipeline rank's stages)
    among themselves only, in module order: a layer issues the next layer's Trans only where
    that layer runs on the same stage (the stage's last issues none)."""
    for stage in stages:
        schedule_transfers([m for m in stage.modules() if isinstance(m, ExpertParallelMoE)])


def share_tokens_over_tp(
    model: nn.Module, tp: Group, replicated: bool, rows: tuple[Group, ...] = ()
) -> list[str]:
    """Make every `ExpertParallelMoE` of `model` dispatch each token once per `tp` group (see the
    module docstring): the tokens `replicated` over it (each rank takes its chunk) or already
    split (sequence parallelism); the aux loss averaged over `rows` too (groups whose ranks
    route other tokens: tp3d's z slices, and its y ranks under sequence parallelism);
    returns the report line."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    for layer in layers:
        layer.tokens = TokenShare(tp, replicated=replicated, rows=rows)
        if replicated:  # else the sequence pass hooks every replicated layer parameter
            for param in layer.router.parameters():
                sum_gradient_over(param, tp)
    how = f"1/{tp.size} of the tokens" if replicated else "its own sequence shard"
    over = " and ".join(["ep_dp", tp.name, *(group.name for group in rows)])
    return [
        f"ep × tp: each {tp.name} rank dispatches {how} in {len(layers)} expert-parallel "
        f"layers; expert gradients summed over {over}"
    ]

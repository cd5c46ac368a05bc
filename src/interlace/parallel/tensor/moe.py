"""1D tensor parallelism inside Mixture-of-Experts blocks with fused experts (`ExpertBlock`:
Hugging Face Mixtral, Qwen2-MoE, any block of the same structure).

Every expert is a SwiGLU feed-forward, y = down_e · (act(gate_e · x) ⊙ (up_e · x)), its
weights stored for all E experts at once: gate|up [E, 2F, d] and down [E, d, F]. With p ranks
and rank r, each expert is split as a dense feed-forward is (`apply.py`), along F:

- gate|up keeps rows [r·F/p, (r+1)·F/p) of the gate half and of the up half (`ShardSpec(1,
  segments=2)`: the local tensor is [E, 2F/p, d], still gate rows then up rows, so the block's
  own forward splits it in two as before); down keeps columns [r·F/p, (r+1)·F/p)
  (`ShardSpec(2)`, [E, d, F/p]). Every rank computes every expert, on F/p features.
- The router is replicated: it reads the full block input, so every rank picks the same top-k
  experts and gate weights, and the block's output on rank r is the partial sum over its
  features of Σ_j gate_j · expert_j(x).
- A shared expert (Qwen2-MoE) is an ordinary feed-forward: gate and up column-parallel, down
  cut along its input features but *not* reduced on its own; its gate (d → 1) is replicated.
  sigmoid(shared_gate(x)) scales each token's partial sum, so the scaled partials still add up.
- One all-reduce (`reduce_from_tp`) of the block output sums routed and shared partials
  together; `copy_to_tp` at the block input all-reduces the input gradient. Under sequence
  parallelism these are the sequence all-gather and reduce-scatter instead.
- The replicated router and shared gate see full tokens but only this rank's partial outputs,
  so their gradients are partial: a hook sums them over the group (under sequence parallelism
  the sequence pass of `apply.py` hooks every replicated parameter of the layers already).

The block's own forward runs unchanged (its routing, its expert loop or grouped matmul); only
parameters are replaced, by their shards, under the same names, with their ShardSpec recorded
as `apply.py` does (checkpoints and `shard_of` work on them).
"""

from __future__ import annotations

from torch import nn

from interlace.comm import Group
from interlace.divisors import check_divides
from interlace.errors import PlanError
from interlace.parallel.detect import ExpertBlock, Structure
from interlace.parallel.grad_sums import sum_gradient_over
from interlace.parallel.tensor.layers import enter_block, leave_block
from interlace.parallel.tensor.shard import ShardSpec, shard_column, shard_parameter

FFN_WIDTH_ATTRS = ("intermediate_dim", "intermediate_size", "ffn_dim")
"""Attributes of an experts module or feed-forward holding its full width (by convention)."""


def check_expert_blocks(
    model: nn.Module,
    structure: Structure,
    tp: int,
    subbatches: int,
    experts_whole: bool = False,
) -> None:
    """Raise PlanError, before anything changes, if `tp` ranks cannot split `structure`'s
    expert blocks: an expert width (unless `experts_whole`: expert parallelism keeps them) or
    shared width not divisible by `tp`, a biased shared down projection, or sub-batch overlap
    (`subbatches` > 1)."""
    if tp == 1 or not structure.expert_blocks:
        return
    names = [b.name for b in structure.expert_blocks]
    if subbatches > 1:
        raise PlanError(
            f"tp_subbatches={subbatches} is not implemented for the Mixture-of-Experts blocks "
            f"{names}; use tp_subbatches=1"
        )
    for b in structure.expert_blocks:
        widths = [] if experts_whole else [(f"{b.name}.{b.experts}", b.ffn_dim)]
        if b.shared is not None:
            widths.append((b.shared.name, b.shared.ffn_dim))
            down = model.get_submodule(f"{b.shared.name}.{b.shared.down}")
            # with whole experts the shared expert reduces its own output, bias added after
            if getattr(down, "bias", None) is not None and not experts_whole:
                raise PlanError(
                    f"{b.shared.name}.{b.shared.down}: a shared expert's down projection with "
                    "a bias cannot join the block's single all-reduce; build it without bias"
                )
        check_divides(tp, "tensor parallel degree", [(f"{w}: ffn width", n) for w, n in widths])


def shard_expert_block(
    module: nn.Module, block: ExpertBlock, group: Group, sequence_parallel: bool
) -> str:
    """Split the expert block `module` (described by `block`) over `group` in place, as the
    module docstring says; return its report line."""
    p = group.size
    experts = getattr(module, block.experts)
    spec_gate_up, spec_down = ShardSpec(1, segments=2), ShardSpec(2)
    for name, spec in ((block.gate_up, spec_gate_up), (block.down, spec_down)):
        setattr(experts, name, shard_parameter(getattr(experts, name), spec, group))
    _set_width(experts, block.ffn_dim, block.ffn_dim // p)
    replicated = [getattr(module, block.router)]
    shared = ""
    if block.shared is not None:
        ff = block.shared
        ff_module = module.get_submodule(ff.name.removeprefix(f"{block.name}."))
        for producer in ff.producers:
            shard_column(getattr(ff_module, producer), 1, 1, group)
        down = getattr(ff_module, ff.down)
        down.weight = shard_parameter(down.weight, ShardSpec(1), group)
        down.in_features = ff.ffn_dim // p
        _set_width(ff_module, ff.ffn_dim, ff.ffn_dim // p)
        shared = f"; shared expert {ff.ffn_dim // p} of {ff.ffn_dim} features per rank"
        if block.shared_gate is not None:
            replicated.append(getattr(module, block.shared_gate))
    if not sequence_parallel:  # the sequence pass hooks every replicated layer parameter
        for part in replicated:
            for param in part.parameters():
                sum_gradient_over(param, group)
    enter_block(module, block.d_model, group, sequence_parallel)
    leave_block(module, group, sequence_parallel)
    return (
        f"{block.name}: {block.n_experts} experts, {block.ffn_dim // p} of {block.ffn_dim} "
        f"features each per rank ({block.experts}.{block.gate_up} gate and up halves "
        f"column-parallel, {block.experts}.{block.down} row-parallel){shared}; router "
        "replicated; one all-reduce of the block output"
    )


def _set_width(module: nn.Module, full: int, local: int) -> None:
    for name in FFN_WIDTH_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value == full:
            setattr(module, name, local)

"""What the cost model knows of a model: per-shard work and sizes (`ModelProfile`), and what
one pipeline stage holds, runs and keeps in memory (`Stage`, `stages_of`, `stage_memory`).

A profile cuts a GPTConfig's GPT (built on the `meta` device) into the pipeline partitioner's
shards (`interlace.parallel.pipeline.partition.model_shards`); stages are the partitioner's
balanced split of its layers. The cost modules (`interlace.planner.step`) price them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from interlace.models.config import GPTConfig
from interlace.models.gpt import GPT
from interlace.parallel.expert.options import expert_split
from interlace.parallel.pipeline.partition import (
    Shard,
    balance,
    checkpointed_count,
    micro_batches_in_flight,
    model_shards,
)
from interlace.plan import Plan
from interlace.planner.bytes import GRAD_BYTES, state_bytes_per_param


@dataclass(frozen=True, eq=False)
class ModelProfile:
    """Per-shard work and sizes of a GPTConfig at one sequence length (see module docstring).
    Compared and hashed by identity: `model_profile` returns one object per config.

    shards: (embed, layer_0 … layer_{L−1}, head) from `model_shards`; expert_params: expert
    parameters inside each shard (0 outside MoE layers).
    """

    config: GPTConfig
    shards: tuple[Shard, ...]
    expert_params: tuple[int, ...]

    @property
    def layers(self) -> tuple[Shard, ...]:
        """The layer shards, in order."""
        return self.shards[1:-1]

    @property
    def forward_flops_per_token(self) -> float:
        """Forward FLOPs of the whole model per token."""
        return sum(s.flops for s in self.shards)


@functools.lru_cache(maxsize=32)
def model_profile(config: GPTConfig) -> ModelProfile:
    """Build `config`'s GPT on the `meta` device (no memory) and cut it into shards."""
    with torch.device("meta"):
        model = GPT(config)
    shards = model_shards(model, config.seq_len)
    d, f = config.d_model, config.ffn_dim
    expert_mlp = 2 * d * f + (f + d) * int(config.bias)
    moe = set(config.moe_layers)
    experts = [0] + [
        config.n_experts * expert_mlp if i in moe else 0 for i in range(len(shards) - 2)
    ]
    return ModelProfile(config, shards, (*experts, 0))


@functools.lru_cache(maxsize=4096)
def _stage_bounds(profile: ModelProfile, pp: int, scale: float) -> tuple[tuple[int, int], ...]:
    layers = profile.layers
    counts = balance(
        [s.flops for s in layers],
        pp,
        first_extra=3 * profile.shards[0].flops,
        last_extra=3 * profile.shards[-1].flops,
        stage_scale=[scale] * pp,
    )
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return tuple(bounds)


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds and runs (FLOPs per token, forward). `selective`: its
    checkpointed layers keep their matmul outputs and recompute only elementwise work;
    `top_k`: experts each token of its MoE layers is routed to; `moe_layer_flops`: the forward
    FLOPs per token of its layers holding one."""

    shards: tuple[Shard, ...]
    checkpointed: tuple[bool, ...]
    expert_params: int
    has_embed: bool
    has_head: bool
    n_moe: int
    n_moe_checkpointed: int
    selective: bool = False
    top_k: int = 1
    moe_layer_flops: float = 0.0

    @functools.cached_property
    def flops(self) -> float:
        """Forward FLOPs per token of all the stage's shards."""
        return sum(s.flops for s in self.shards)

    @functools.cached_property
    def layer_flops(self) -> float:
        """Forward FLOPs per token of the stage's transformer layers."""
        return sum(s.flops for s in self.shards if s.kind == "layer")

    @functools.cached_property
    def layer_params(self) -> int:
        """Parameters of the stage's transformer layers."""
        return sum(s.params for s in self.shards if s.kind == "layer")

    @functools.cached_property
    def recompute_flops(self) -> float:
        """Forward FLOPs per token a recomputation replays (the checkpointed layers'; none under
        selective recomputation, which replays elementwise work only)."""
        if self.selective:
            return 0.0
        return sum(s.flops for s, c in zip(self.shards, self.checkpointed, strict=True) if c)

    @functools.cached_property
    def selective_elements(self) -> float:
        """Elements per token that selective recomputation recomputes (its checkpointed layers'
        saved activations beyond what they keep): elementwise work, priced by memory traffic.
        0 unless `selective`."""
        if not self.selective:
            return 0.0
        pairs = zip(self.shards, self.checkpointed, strict=True)
        return sum(s.activations - s.selective for s, c in pairs if c)

    @functools.cached_property
    def params(self) -> int:
        """Parameters of all the stage's shards (expert parameters included)."""
        return sum(s.params for s in self.shards)

    @functools.cached_property
    def n_layers(self) -> int:
        """Transformer layers on the stage."""
        return sum(s.kind == "layer" for s in self.shards)

    @functools.cached_property
    def n_checkpointed(self) -> int:
        """Checkpointed layers on the stage."""
        return sum(self.checkpointed)


@functools.lru_cache(maxsize=4096)
def stages_of(
    profile: ModelProfile, pp: int, ratios: tuple[float, ...], selective: bool = False
) -> tuple[Stage, ...]:
    """The pp stages of the partitioner's balanced split, with `ratios` checkpointed (fully, or
    `selective`ly)."""
    bounds = _stage_bounds(profile, pp, 3.0 if selective else 3.0 + max(ratios))
    return tuple(_stage(profile, bounds, s, ratios[s], selective) for s in range(pp))


def _stage(
    profile: ModelProfile,
    bounds: tuple[tuple[int, int], ...],
    s: int,
    ratio: float,
    selective: bool,
) -> Stage:
    start, stop = bounds[s]
    n_ckpt = checkpointed_count(ratio, stop - start)
    layer_ckpt = [i < n_ckpt for i in range(stop - start)]
    first, last = s == 0, s == len(bounds) - 1
    shards = (
        ((profile.shards[0],) if first else ())
        + profile.layers[start:stop]
        + ((profile.shards[-1],) if last else ())
    )
    checkpointed = (*([False] if first else []), *layer_ckpt, *([False] if last else []))
    experts = profile.expert_params[1 + start : 1 + stop]
    moe = [e > 0 for e in experts]
    return Stage(
        shards=shards,
        checkpointed=tuple(checkpointed),
        expert_params=sum(experts),
        has_embed=first,
        has_head=last,
        n_moe=sum(moe),
        n_moe_checkpointed=sum(a and b for a, b in zip(moe, layer_ckpt, strict=True)),
        selective=selective,
        top_k=profile.config.top_k,
        moe_layer_flops=sum(
            sh.flops for sh, e in zip(profile.layers[start:stop], experts, strict=True) if e
        ),
    )


def _per_rank(shard: Shard, tp: int, sequence_parallel: bool) -> float:
    """Elements per token of `shard`'s saved activations on one of `tp` 1D tensor parallel
    ranks: the replicated part whole (split over the sequence with sequence parallelism), the
    rest split."""
    if sequence_parallel:
        return shard.activations / tp
    return shard.replicated + (shard.activations - shard.replicated) / tp


def device_params(stage: Stage, plan: Plan) -> float:
    """Parameters one device of `stage` keeps between steps: non-expert parameters split by tp,
    expert parameters as the runtime splits them (`expert.options.expert_split`); under 3D tensor
    parallelism the layers' split by x·y·z and the rest over `split_group`; the
    non-expert parameters split again over FSDP's `plan.shard_ranks` (dp_shard, × cp under
    context parallelism)."""
    return dense_params(stage, plan) / plan.shard_ranks + stage.expert_params / expert_split(plan)


def dense_params(stage: Stage, plan: Plan) -> float:
    """Non-expert parameters one device of `stage` holds before sharded data parallelism:
    split by tp; under 3D tensor parallelism the layers' by x·y·z and the rest by
    `split_group`."""
    dense = stage.params - stage.expert_params
    if plan.tp3d is None:
        return dense / plan.tp_size
    ends = stage.params - stage.layer_params
    return (dense - ends) / plan.tp_size + ends / split_group(plan)[1]


def split_group(plan: Plan) -> tuple[str, int]:
    """(name, size) of the tensor-parallel group that splits the embedding and the LM head by
    vocabulary rows and whose ranks share an expert-parallel layer's tokens: ("tp", tp), or a
    3D grid's x·y ranks ("tp_xy", x·y; each z rank holds the same pieces)."""
    if plan.tp3d is not None:
        return "tp_xy", plan.tp3d[0] * plan.tp3d[1]
    return "tp", plan.tp_size


def _block_params(stage: Stage, plan: Plan) -> float:
    """Parameters of the largest block of `stage` on one of its tp ranks."""
    return max((s.params for s in stage.shards if s.kind == "layer"), default=0) / plan.tp_size


def gathered_bytes(stage: Stage, plan: Plan, param_bytes: int) -> float:
    """Bytes of the parameters sharded data parallelism holds gathered at once on one device
    of `stage`, in the compute dtype (`param_bytes` each): the root's (embedding, norm, head:
    kept for the whole step) and two blocks' (the one computing and the one prefetched; every
    block's without `reshard_after_forward`). 0 without dp_shard."""
    if not plan.sharded_data_parallel:
        return 0.0
    root = (stage.params - stage.layer_params) / split_group(plan)[1]
    blocks = 2 if plan.reshard_after_forward else stage.n_layers
    return (root + blocks * _block_params(stage, plan)) * param_bytes


def unsharded_gradient_bytes(stage: Stage, plan: Plan) -> float:
    """Bytes of the fp32 gradients sharded data parallelism holds unsharded at once during the
    backward on one device of `stage`: two blocks' (the one computing and the one being
    reduce-scattered). 0 without dp_shard."""
    if not plan.sharded_data_parallel:
        return 0.0
    return 2 * _block_params(stage, plan) * GRAD_BYTES


def stage_memory(
    stage: Stage,
    plan: Plan,
    tokens: int,
    act_bytes: int,
    d: int,
    s: int,
    v: int,
    optimizer_state: str = "fp32",
) -> dict[str, float]:
    """Bytes one device of pipeline stage `s` (of `v` virtual stages per rank) holds at its peak
    for micro-batches of `tokens` tokens, activations of `act_bytes` bytes and width `d`: by
    part (parameters with gradients and optimizer state, AdamW's moments in `optimizer_state`'s
    dtype; saved activations of the micro-batches in flight, a recomputation's working set, the
    parameters sharded data parallelism gathers and the block gradients it holds before their
    reduce-scatter) and their `total`. Under `tp_subbatches` each sub-batched layer keeps one
    more copy of its output, [tokens, d] (3D: [tokens/z, d/x]). Under etp each tp rank keeps
    the rows its tp group received, gathered for its expert pieces, and their results
    (2 · top_k · d a token and layer), not 1/tp of them."""
    tp = plan.tp_size
    boundary = d / tp if plan.sequence_parallel and plan.tp3d is None else d

    def kept(shard: Shard) -> float:  # per token, by a checkpointed layer
        return boundary + (shard.selective - d) / tp if stage.selective else boundary

    saved = sum(
        kept(shard) if ckpt else _per_rank(shard, tp, plan.sequence_parallel)
        for shard, ckpt in zip(stage.shards, stage.checkpointed, strict=True)
    )
    if plan.etp > 1:  # each tp rank keeps its tp group's gathered expert rows, not 1/tp
        saved += (stage.n_moe - stage.n_moe_checkpointed) * 2 * stage.top_k * d * (1 - 1 / tp)
    if plan.tp3d is not None:  # tokens over z; the head's V over x·y
        x, y, z = plan.tp3d
        seq = y if plan.sequence_parallel else 1  # the residual's tokens over y

        def saved3d(shard: Shard, ckpt: bool) -> float:
            if shard.kind == "layer":  # d-wide tensors (1D's replicated part) over x, the rest
                inner = shard.activations - shard.replicated  # (heads, ffn features) over y
                if ckpt:
                    return kept(shard) / (x * seq)
                # the norms' inputs are split over y too; the producers' shared input is the
                # sequence gathered
                norms = shard.norm_inputs * (1 - 1 / seq)
                return (shard.replicated - norms) / x + inner / y
            return _per_rank(shard, x * y, False) if shard.kind == "head" else shard.activations

        pairs = zip(stage.shards, stage.checkpointed, strict=True)
        saved = sum(saved3d(shard, ckpt) for shard, ckpt in pairs) / z
    if plan.overlap.tp_subbatches > 1:  # a sub-batched layer's output: its sub-batches' rows
        # stay with their graphs, the next layer reads them concatenated, one more copy
        x, z = (plan.tp3d[0], plan.tp3d[2]) if plan.tp3d is not None else (1, 1)
        saved += (stage.n_layers - stage.n_moe) * d / (x * z)
    if plan.pipelined:
        in_flight = micro_batches_in_flight(plan.schedule, s, plan.pp, plan.micro_batches, v)
    else:
        in_flight = 1.0
    activations = in_flight * tokens * saved * act_bytes
    working = 0.0
    if stage.n_checkpointed:  # one layer's recomputed tensors (selective: beyond what it kept)
        widest = max(
            _per_rank(sh, tp, plan.sequence_parallel) - (kept(sh) if stage.selective else 0.0)
            for sh, c in zip(stage.shards, stage.checkpointed, strict=True)
            if c
        )
        working = tokens * widest * act_bytes
    state = device_params(stage, plan) * state_bytes_per_param(optimizer_state)
    gathered = gathered_bytes(stage, plan, act_bytes)
    gradients = unsharded_gradient_bytes(stage, plan)
    return {
        "total": state + activations + working + gathered + gradients,
        "params_grads_optimizer": state,
        "activations": activations,
        "recompute_working_set": working,
        "fsdp_gathered": gathered,
        "fsdp_gradients": gradients,
        "micro_batches_in_flight": in_flight,
        "stage": float(s),
    }

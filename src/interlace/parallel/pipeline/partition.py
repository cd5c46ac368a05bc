"""Split a transformer into pipeline stages: shards, their costs, and a balancing dynamic program.

**Shards.** A decoder is a chain: embeddings → L layers → final norm + LM head (+ loss). The parts
are found by structure (`interlace.parallel.detect`: the layer `nn.ModuleList`, the token
embedding, the head), so the built-in GPT, Hugging Face GPT-2 and Llama split the same way:

    embed  = every parameterised module before the layer list (token and position embeddings)
    layer_i = one element of the layer list
    head   = every parameterised module after it (final norm, LM head) and the loss

Merak walks a traced graph and closes a shard when its parameter count passes total/shards,
merging shards that a skip connection would jump. In a decoder every skip connection lives
inside one layer, so the cuts such a walk can make are exactly the layer boundaries: we cut
there directly, with no tracing (which also works on `meta`-device models of any size).

**Cost of a shard** (per token, from parameter shapes alone):

    forward F = 2 · Σ (elements of every weight matrix used by a token)
              + 4 · T · (attention width)                 (q·kᵀ and attn·v over T positions)
    training  = F (forward) + 2F (backward) [+ F (recomputed forward) when checkpointed]

Embedding tables cost no multiply-adds (a lookup); a tied LM head costs 2·d·V at the head. In a
Mixture-of-Experts layer each expert's matrices count with weight top_k / n_experts (every
token visits top_k of them).

**Memory of a stage** (bytes): parameters × `state_bytes` (fp32 weight, gradient and two AdamW
moments = 16 bytes) + activations × micro-batches in flight. A layer saves about
Σ (in + out widths of its matrices) + (norm widths) elements per token for backward, corrected
by what attention and feed-forward blocks are known to keep (`_block_saved_correction`: q, k
and v read one input, the out and down outputs go to the residual sum unsaved, attention keeps
its output and a log-sum-exp per head, a gated MLP its activated gate); the head keeps its
input and the loss's V log-probabilities; a checkpointed layer keeps only its input (d per
token). In flight: every micro-batch under
GPipe, min(M, P − s) on stage s under 1F1B; interleaved 1F1B is estimated from its warm-up
depth. These are estimates for planning, not measurements.

**Assignment.** Stages are contiguous runs of layers, each with at least one layer; the first
also holds `embed`, the last `head`. `balance` is a dynamic program over (stage, last layer)
that minimises the slowest stage's training cost exactly (Merak's "autopipe" objective).
Users may instead give layers per stage, or the names of the layers that begin stages 1…P−1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from interlace.errors import PlanError
from interlace.models.matrices import matrices
from interlace.parallel.detect import Structure, find_structure
from interlace.tensors import is_under

TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k")
"""Attributes of a Mixture-of-Experts block (or its direct children) that hold top_k."""


@dataclass(frozen=True)
class Shard:
    """One indivisible piece of the chain: `kind` "embed", "layer" or "head".

    flops: forward FLOPs per token; activations: elements saved per token for backward;
    boundary: elements per token of the shard's output (what crosses a stage boundary and what
    a checkpointed layer keeps); replicated: the part of `activations` that 1D tensor
    parallelism leaves whole on every rank (norm inputs, and the input shared by the
    column-parallel producers of each attention and feed-forward block and of the head);
    selective: elements per token a layer keeps under selective recomputation (its input, the
    outputs of its matrices and of its attention: `interlace.recompute`); norm_inputs: the
    norms' inputs, the part of `replicated` that sequence parallelism splits.
    """

    name: str
    kind: str
    modules: tuple[str, ...]
    params: int
    flops: float
    activations: float
    boundary: int
    replicated: float = 0.0
    selective: float = 0.0
    norm_inputs: float = 0.0


@dataclass(frozen=True)
class Partition:
    """Contiguous layer ranges per stage: stage s runs layers [bounds[s][0], bounds[s][1])."""

    shards: tuple[Shard, ...]
    bounds: tuple[tuple[int, int], ...]

    @property
    def embed(self) -> Shard:
        """The embedding shard (on stage 0)."""
        return self.shards[0]

    @property
    def head(self) -> Shard:
        """The head shard (on the last stage)."""
        return self.shards[-1]

    @property
    def layers(self) -> tuple[Shard, ...]:
        """The layer shards, in order."""
        return self.shards[1:-1]

    @property
    def n_stages(self) -> int:
        """Number of (virtual) stages."""
        return len(self.bounds)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """How many layers each stage holds."""
        return tuple(stop - start for start, stop in self.bounds)

    def stage_shards(self, stage: int) -> tuple[Shard, ...]:
        """Every shard stage `stage` runs: its layers, plus embed (first) and head (last)."""
        start, stop = self.bounds[stage]
        out = self.layers[start:stop]
        if stage == 0:
            out = (self.embed, *out)
        if stage == self.n_stages - 1:
            out = (*out, self.head)
        return out

    def stage_cost(self, stage: int, recompute_ratio: float = 0.0) -> float:
        """Training FLOPs per token of `stage`: 3F, plus F for the checkpointed fraction
        `recompute_ratio` of its layers (embed and head are never checkpointed)."""
        start, stop = self.bounds[stage]
        n_ckpt = checkpointed_count(recompute_ratio, stop - start)
        layer_flops = [s.flops for s in self.layers[start:stop]]
        total = 3 * sum(s.flops for s in self.stage_shards(stage))
        return total + sum(layer_flops[:n_ckpt])

    def stage_memory(
        self,
        stage: int,
        tokens: int,
        in_flight: float,
        recompute_ratio: float = 0.0,
        bytes_per_element: int = 4,
        state_bytes: int = 16,
    ) -> float:
        """Estimated bytes of `stage`: parameter state plus `in_flight` micro-batches of
        `tokens` tokens of saved activations (see the module docstring)."""
        start, stop = self.bounds[stage]
        n_ckpt = checkpointed_count(recompute_ratio, stop - start)
        params = sum(s.params for s in self.stage_shards(stage))
        saved = 0.0
        for i, shard in enumerate(self.stage_shards(stage)):
            layer_index = i - (1 if stage == 0 else 0)
            is_ckpt = shard.kind == "layer" and layer_index < n_ckpt
            saved += shard.boundary if is_ckpt else shard.activations
        return params * state_bytes + in_flight * tokens * saved * bytes_per_element


def checkpointed_count(ratio: float, n_layers: int) -> int:
    """Layers to checkpoint for a checkpoint `ratio` in [0, 1] of `n_layers` (rounded up, so a
    memory-derived ratio is always honoured)."""
    return min(n_layers, math.ceil(ratio * n_layers - 1e-9))


# --------------------------------------------------------------------------- shards
def model_shards(model: nn.Module, seq_len: int | None = None) -> tuple[Shard, ...]:
    """Cut `model` (built-in GPT, HF GPT-2/Llama, or any decoder whose layers sit in one
    `nn.ModuleList`) into (embed, layer_0, …, layer_{L−1}, head). `seq_len` (T, for the
    attention term) defaults to the model's `config.seq_len` / `n_positions` /
    `max_position_embeddings`. Works on `meta`-device models."""
    try:
        structure = find_structure(model)
    except ValueError as exc:
        raise PlanError(f"pipeline partitioning: {exc}") from None
    if structure.layers is None:
        raise PlanError(
            "pipeline partitioning found no layer list (an nn.ModuleList of attention blocks); "
            "pp>1 needs a model built as a chain of layers"
        )
    T = seq_len or seq_len_of(model)
    d = structure.d_model
    layer_list = model.get_submodule(structure.layers)
    q_width = {a.name: a.n_heads * a.head_dim for a in structure.attentions}

    before, after = [], []
    seen_layers = False
    for name, module in model.named_modules():
        if name == structure.layers:
            seen_layers = True
            continue
        if is_under(name, structure.layers) or not _own(module):
            continue
        (after if seen_layers else before).append(name)

    counted: set[int] = set()
    embed = _shard("embed", "embed", model, before, counted, structure.experts, 0.0, d)
    layers = []
    for index, layer in enumerate(layer_list):
        name = f"{structure.layers}.{index}"
        leaves = [f"{name}.{n}" if n else name for n, m in layer.named_modules() if _own(m)]
        attention = sum(4 * T * w for a, w in q_width.items() if is_under(a, name))
        kept = _block_saved_correction(structure, name)
        # selective recomputation keeps each attention's output and log-sum-exp per head
        attention_out = sum(
            a.n_heads * a.head_dim + a.n_heads
            for a in structure.attentions
            if is_under(a.name, name)
        )
        blocks = [
            b for b in (*structure.attentions, *structure.feed_forwards) if is_under(b.name, name)
        ]
        shard = _shard(
            name,
            "layer",
            model,
            leaves,
            counted,
            structure.experts,
            attention,
            d,
            kept,
            len(blocks) * d,
            d + attention_out,
        )
        layers.append(shard)
    vocab = structure.vocab.vocab if structure.vocab is not None else d
    # the head's V-wide output stands for the loss's log-probabilities (the logits themselves
    # are not kept: log-softmax keeps its output)
    head = _shard("head", "head", model, after, counted, structure.experts, 0.0, vocab, 0.0, d)
    return (embed, *layers, head)


def _block_saved_correction(structure: Structure, layer: str) -> float:
    """Elements per token that the attention and feed-forward blocks of `layer` keep beyond
    (negative: below) the in + out widths of their matrices: producers reading one input keep
    it once; the out and down projections' outputs go into the residual sum, kept by no one;
    attention keeps its output (the projection's input is another tensor) and one log-sum-exp
    per head; a gated feed-forward keeps the activated gate too."""
    d, extra = structure.d_model, 0.0
    for a in structure.attentions:
        if is_under(a.name, layer):
            extra += -(len(a.producers) - 1) * d - d + a.n_heads * a.head_dim + a.n_heads
    for f in structure.feed_forwards:
        if is_under(f.name, layer):
            extra += -(len(f.producers) - 1) * d - d + (len(f.producers) - 1) * f.ffn_dim
    return extra


def _own(module: nn.Module) -> bool:
    return bool(list(module.parameters(recurse=False)))


def seq_len_of(model: nn.Module) -> int:
    """The model's sequence length T: its config's `seq_len`, `n_positions` or
    `max_position_embeddings`."""
    config = getattr(model, "config", None)
    for attr in ("seq_len", "n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise PlanError("cannot read the sequence length from the model; pass seq_len")


def _shard(
    name: str,
    kind: str,
    model: nn.Module,
    modules: list[str],
    counted: set[int],
    experts: list[str],
    attention_flops: float,
    boundary: int,
    extra_saved: float = 0.0,
    shared_inputs: float = 0.0,
    selective_extra: float = 0.0,
) -> Shard:
    """Sum parameters (each tensor once over the whole model), FLOPs and saved activations of
    the leaf `modules` (`shared_inputs`: elements per token of the replicated inputs of
    column-parallel producers, counted in `replicated` with the norms' inputs), and what
    selective recomputation keeps: the matrices' outputs plus `selective_extra`. `counted`
    holds ids of parameters already owned by an earlier shard: a tied LM head costs FLOPs at
    the head but its parameters belong to the embedding."""
    params = 0
    flops = float(attention_flops)
    saved = float(extra_saved)
    replicated = float(shared_inputs)
    selective = float(selective_extra)
    norm_inputs = 0.0
    for module_name in modules:
        module = model.get_submodule(module_name)
        weight = _expert_weight(model, module_name, experts)
        matrix = {id(p) for p in matrices(module)}
        for p in module.parameters(recurse=False):
            if id(p) not in counted:
                counted.add(id(p))
                params += p.numel()
            if isinstance(module, nn.Embedding) or id(p) not in matrix:
                continue
            per_slice = p.shape[-1] + p.shape[-2]
            slices = p.numel() // (p.shape[-1] * p.shape[-2])
            flops += 2 * p.numel() * weight
            saved += per_slice * slices * weight
            selective += p.shape[-2] * slices * weight
        if not isinstance(module, nn.Embedding) and all(
            p.dim() == 1 for p in module.parameters(recurse=False)
        ):
            width = next(module.parameters(recurse=False)).shape[0]  # a norm saves its input
            saved += width
            replicated += width
            norm_inputs += width
    return Shard(
        name,
        kind,
        tuple(modules),
        params,
        flops,
        saved,
        boundary,
        replicated,
        selective,
        norm_inputs,
    )


def _expert_weight(model: nn.Module, name: str, experts: list[str]) -> float:
    """top_k / n_experts for a matrix inside one expert of a Mixture-of-Experts block, else 1."""
    for block_name in experts:
        if not is_under(name, block_name) or name == block_name:
            continue
        block = model.get_submodule(block_name)
        child_name = name[len(block_name) + 1 :].split(".")[0]
        child = block.get_submodule(child_name)
        if isinstance(child, nn.ModuleList):
            n_experts = len(child)
        else:
            fused = [p for p in child.parameters(recurse=False) if p.dim() >= 3]
            if not fused:
                return 1.0  # the router or shared experts: every token
            n_experts = fused[0].shape[0]
        return _top_k(block) / n_experts
    return 1.0


def _top_k(block: nn.Module) -> int:
    for module in (block, *block.children()):
        for attr in TOP_K_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return 1


# --------------------------------------------------------------------------- balancing
def balance(
    costs: Sequence[float],
    n_stages: int,
    *,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    stage_scale: Sequence[float] | None = None,
) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage, each stage ≥ 1 contiguous layer.

    Stage s over layers [i, j) costs stage_scale[s] · Σ costs[i:j], plus `first_extra` on
    stage 0 and `last_extra` on the last. Dynamic program over (stage, layers covered):
    best[s][j] = min_i max(best[s−1][i], cost(s, i, j)), O(P·L²); ties go to the earliest cut.
    """
    n = len(costs)
    if n_stages < 1 or n < n_stages:
        raise PlanError(
            f"cannot split {n} layers into {n_stages} pipeline stages of at least one layer; "
            f"use pp<={n}"
        )
    scale = list(stage_scale) if stage_scale is not None else [1.0] * n_stages
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == n_stages - 1 else 0.0)
        return scale[s] * (prefix[j] - prefix[i]) + extra

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts = []
    j = n
    for s in range(n_stages - 1, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return tuple(reversed(counts))


def partition(
    model: nn.Module,
    n_stages: int,
    *,
    layers_per_stage: Sequence[int] | None = None,
    split_points: Sequence[str] | None = None,
    recompute_ratios: Sequence[float] | None = None,
    seq_len: int | None = None,
) -> Partition:
    """Assign `model`'s layers to `n_stages` contiguous stages.

    Default: `balance` on training FLOPs (each stage's layers scaled by 3 + its checkpoint
    ratio from `recompute_ratios`, embed on stage 0, head on the last). Overrides:
    `layers_per_stage` (one count per stage, summing to the layer count), or `split_points`,
    the names of the n_stages − 1 layers that begin stages 1, 2, … (e.g. "blocks.6" or
    "model.layers.16"). Raises PlanError naming any bad count or name.
    """
    shards = model_shards(model, seq_len)
    layers = shards[1:-1]
    if layers_per_stage is not None and split_points is not None:
        raise PlanError("give layers_per_stage or split_points, not both")
    if split_points is not None:
        counts = _counts_from_split_points(model, layers, n_stages, split_points)
    elif layers_per_stage is not None:
        counts = _check_counts(tuple(layers_per_stage), n_stages, len(layers))
    else:
        ratios = list(recompute_ratios) if recompute_ratios is not None else [0.0] * n_stages
        if len(ratios) != n_stages:
            raise PlanError(f"{len(ratios)} recompute ratios for {n_stages} stages")
        counts = balance(
            [s.flops for s in layers],
            n_stages,
            first_extra=3 * shards[0].flops,
            last_extra=3 * shards[-1].flops,
            stage_scale=[3 + r for r in ratios],
        )
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return Partition(shards, tuple(bounds))


def _check_counts(counts: tuple[int, ...], n_stages: int, n_layers: int) -> tuple[int, ...]:
    if len(counts) != n_stages:
        raise PlanError(
            f"layers_per_stage={list(counts)} has {len(counts)} entries for {n_stages} stages; "
            f"give one count per stage"
        )
    if any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != n_layers:
        raise PlanError(
            f"layers_per_stage={list(counts)} must be positive counts summing to the model's "
            f"{n_layers} layers"
        )
    return counts


def _counts_from_split_points(
    model: nn.Module, layers: Sequence[Shard], n_stages: int, names: Sequence[str]
) -> tuple[int, ...]:
    index = {s.name: i for i, s in enumerate(layers)}
    known = {name for name, _ in model.named_modules()}
    valid = f"layers {layers[1].name} … {layers[-1].name}" if len(layers) > 1 else "none"
    starts = []
    for name in names:
        if name not in known:
            raise PlanError(
                f"split point '{name}' matches no module of the model; a split point names the "
                f"layer that begins a stage: {valid}"
            )
        if name not in index:
            raise PlanError(
                f"split point '{name}' is a module but not a layer of the layer list; use one "
                f"of {valid}"
            )
        if index[name] == 0:
            raise PlanError(f"split point '{name}' would leave stage 0 without a layer; {valid}")
        starts.append(index[name])
    if len(starts) != n_stages - 1:
        raise PlanError(
            f"{len(starts)} split points for {n_stages} stages; give {n_stages - 1} layer names"
        )
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise PlanError(f"split points {list(names)} must name layers in increasing order")
    edges = [0, *starts, len(layers)]
    return tuple(b - a for a, b in itertools.pairwise(edges))


# --------------------------------------------------------------------------- in-flight, table
def micro_batches_in_flight(
    schedule: str, stage: int, pp: int, micro_batches: int, virtual_stages: int = 1
) -> float:
    """Micro-batches of activations rank `stage` holds at its peak: M for GPipe, min(M, P − s)
    for 1F1B (one more on stage P − 2 under the shifted schedule with M ≥ 4), and for
    interleaved 1F1B its warm-up depth in chunks divided by the chunks per rank (each chunk
    holds 1/v of the rank's layers)."""
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "shifted" and stage == pp - 2 and micro_batches >= 4:
        return float(min(micro_batches, pp - stage + 1))
    if schedule == "interleaved":
        v = virtual_stages
        chunks = min(micro_batches * v, (v - 1) * pp + 2 * (pp - 1 - stage) + 1)
        return chunks / v
    return float(min(micro_batches, pp - stage))


def describe_stages(
    part: Partition,
    *,
    pp: int | None = None,
    schedule: str = "1f1b",
    micro_batches: int = 1,
    micro_batch_tokens: int = 1,
    recompute_ratios: Sequence[float] | None = None,
) -> str:
    """A text table, one row per (virtual) stage: index, rank, layers, training GFLOPs per
    micro-batch, share of the slowest stage, estimated memory (GiB) and checkpoint ratio.
    `pp` is the number of ranks (stages beyond it are interleaved onto rank s mod pp)."""
    pp = pp or part.n_stages
    v = part.n_stages // pp
    ratios = list(recompute_ratios) if recompute_ratios is not None else [0.0] * part.n_stages
    costs = [part.stage_cost(s, ratios[s]) * micro_batch_tokens for s in range(part.n_stages)]
    slowest = max(costs)
    rows = [("stage", "rank", "layers", "GFLOP/mb", "vs max", "memory GiB", "recompute")]
    for s, (start, stop) in enumerate(part.bounds):
        rank = s % pp
        in_flight = micro_batches_in_flight(schedule, rank, pp, micro_batches, v)
        memory = part.stage_memory(s, micro_batch_tokens, in_flight, ratios[s])
        names = [part.layers[start].name, part.layers[stop - 1].name]
        what = names[0] if stop - start == 1 else f"{names[0]}…{names[1].rsplit('.', 1)[-1]}"
        what = ("embed + " if s == 0 else "") + what + (" + head" if s == part.n_stages - 1 else "")
        rows.append(
            (
                str(s),
                str(rank),
                what,
                f"{costs[s] / 1e9:.3g}",
                f"{costs[s] / slowest:.2f}",
                f"{memory / 2**30:.3g}",
                f"{ratios[s]:.2f}",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)

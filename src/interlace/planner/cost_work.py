"""The compute of one micro-batch on a pipeline stage, for `planner.step.step_terms`.

FLOPs per token of each layer, the embeddings and the head come from the stage's shards
(`planner.profile`): forward F, backward 2F, a checkpointed layer's recomputed forward +F.
Selective recomputation replays elementwise work only: priced as writing and reading once the
tensors it recomputes at the hardware's memory bandwidth.
Time = FLOPs / (peak(dtype) · `hardware.efficiency(rows, dtype, d_model)` · q), at the model's
width (where the hardware knows how its non-matmul work scales) and the rows each matmul sees,
q the tile and wave quantisation of the layer's matmul shapes on the hardware's `sm_count`
SMs (`gemm.layer_shape_efficiency`, 1 without SMs; experts: `gemm.expert_shape_efficiency`):

- the micro-batch's tokens; under 3D tensor parallelism tokens / z (its x·y ranks split the
  embedding and head by vocabulary rows, so every part is split by x·y·z, as 1D splits by tp);
- under `tp_subbatches` s > 1 (1D or 3D), those rows / s (each sub-batch runs its own matmuls; a
  layer holding an MoE layer runs whole; its share of the replayed work taken as of the FLOPs);
- for each expert its share of the ep group's tokens, tokens · top_k · ep / E (balanced).

Tensor parallelism divides the layers' FLOPs by the tp group size.

Where the hardware has rates measured on a grid of shapes in `dtype` (`planner.surface`,
`--calibrate`), those price each matmul shape in place of q, and attention's 4 · T · w FLOPs
a token (forward; twice that backward, again in a replayed forward) run at the causal
attention kernel's measured rate at the sequence length T and head width, not at the matmuls'.
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.models.config import GPTConfig
from interlace.plan import Plan
from interlace.planner.bytes import activation_bytes
from interlace.planner.gemm import (
    expert_shape_efficiency,
    layer_shape_efficiency,
    shape_model,
)
from interlace.planner.hardware import Hardware
from interlace.planner.profile import Stage


@dataclass(frozen=True)
class StageWork:
    """Seconds of compute of one micro-batch on a stage: `compute` its forward and backward
    (3F), `recompute` its checkpointed layers' replayed forward; `rate` the FLOP/s of the
    micro-batch's matmuls and `expert_rate` of one expert's (at the rows each sees);
    `shape_factor` the part of `rate` the layer's matmul shapes cost (`gemm`, 1 without)."""

    compute: float
    recompute: float
    rate: float
    expert_rate: float
    shape_factor: float = 1.0


def stage_work(
    plan: Plan,
    config: GPTConfig,
    stage: Stage,
    tokens: int,
    hardware: Hardware,
    dtype: str,
) -> StageWork:
    """The compute of `stage` for a micro-batch of `tokens` tokens in `dtype` under `plan`
    (see the module docstring); experts at their balanced share of the tokens."""
    tp, shapes = plan.tp_size, shape_model(hardware, dtype)
    batch_split = plan.tp3d[2] if plan.tp3d is not None else 1  # 3D: z splits the tokens
    width = config.d_model  # the model's width: how much non-matmul work each token carries
    rows = tokens / batch_split
    shape_factor = layer_shape_efficiency(plan, config, rows, shapes)
    rate = hardware.matmul_flops(dtype, rows, width) * shape_factor
    compute = 3 * stage.flops * tokens / tp / rate
    recompute = stage.recompute_flops * tokens / tp / rate
    split = plan.tensor_parallel or plan.tensor3d_parallel
    subbatches = plan.overlap.tp_subbatches if split else 1
    if subbatches > 1:  # each layer without experts runs on rows / s rows at a time
        sub_rows = rows / subbatches
        sub_rate = hardware.matmul_flops(dtype, sub_rows, width)
        sub_rate *= layer_shape_efficiency(plan, config, sub_rows, shapes)
        dense = stage.layer_flops - stage.moe_layer_flops
        compute += _slower(3 * dense * tokens / tp, sub_rate, rate)
        replayed = stage.recompute_flops * dense / stage.layer_flops if stage.layer_flops else 0
        recompute += _slower(replayed * tokens / tp, sub_rate, rate)
    expert_rate = rate
    if stage.n_moe:  # an expert computes its share of the ep group's tokens
        expert_rows = tokens * config.top_k * plan.ep / config.n_experts
        expert_rate = hardware.matmul_flops(dtype, expert_rows, width)
        expert_rate *= expert_shape_efficiency(config, expert_rows, shapes)
        expert = tokens * config.top_k * 4 * config.d_model * config.ffn_dim / tp  # per layer
        compute += _slower(3 * stage.n_moe * expert, expert_rate, rate)
        if not stage.selective:  # selective keeps the experts' matmul outputs
            recompute += _slower(stage.n_moe_checkpointed * expert, expert_rate, rate)
    surface = hardware.surface
    if surface is not None and surface.dtype == dtype:  # attention at its kernel's rate
        per_token = 4 * config.seq_len * config.n_heads * config.head_dim / tp  # one layer
        kernel = hardware.matmul_flops(dtype, rows, width)
        kernel *= surface.attention_factor(config.seq_len, config.head_dim)
        replayed = 0 if stage.selective else stage.n_checkpointed
        compute += _slower(3 * stage.n_layers * per_token * tokens, kernel, rate)
        recompute += _slower(replayed * per_token * tokens, kernel, rate)
    traffic = 2 * stage.selective_elements * tokens / tp * activation_bytes(dtype)
    recompute += traffic / hardware.memory_bandwidth
    return StageWork(compute, recompute, rate, expert_rate, shape_factor)


def _slower(flops: float, rate_at: float, rate: float) -> float:
    """Extra seconds of `flops` run at `rate_at` FLOP/s instead of `rate` (0.0 when equal)."""
    return flops * (1 / rate_at - 1 / rate)

"""Pipeline parallelism (`plan.pp`, mesh group "pp"): partition, stages, schedules, recompute.

- `partition`: cut a decoder into embed / layers / head shards by structure, cost them from
  parameter shapes, and balance contiguous layers over stages with a dynamic program (or take
  the user's counts or split points); `describe_stages` prints the result.
- `stage`: the built-in GPT's stage modules (original parameter names kept) and the tied
  embedding shared by the first and last stage.
- `hf_stage`: stage modules of Hugging Face decoder LMs (GPT-2, Llama, …), their parts found
  by structure, HF parameter names kept.
- `schedule`: torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B for a Plan.
- `shifted`: Merak's shifted critical-path schedule (recomputation before the gradient
  receive; one more warm-up forward on stage P − 2), our own executor.
- `recompute`: none, full, Merak's stage-aware ratios, or explicit per-stage ratios.
- `layout`: `pipeline_layout(model, plan)`, the partition and recomputation of every stage,
  shared by the runner and `interlace plan --show-stages`.
- `runner`: `PipelineRunner`, one training step on every pipeline rank.
- `trace`: `StepRecorder`, a timeline span per stage forward, backward and recomputation of
  every micro-batch, gathered to one rank and written as a Chrome trace + PNG (imported from
  `interlace.parallel.pipeline.trace`, not re-exported here: it imports the runner).
"""

from interlace.parallel.pipeline.hf_stage import DecoderParts, HFStage, hf_local_module
from interlace.parallel.pipeline.layout import PipelineLayout, pipeline_layout
from interlace.parallel.pipeline.partition import (
    Partition,
    Shard,
    balance,
    describe_stages,
    micro_batches_in_flight,
    model_shards,
    partition,
)
from interlace.parallel.pipeline.recompute import (
    checkpointed_layers,
    ratio_for_budget,
    recompute_ratios,
    stage_aware_ratios,
)
from interlace.parallel.pipeline.runner import PipelineRunner, cross_entropy_loss
from interlace.parallel.pipeline.schedule import (
    PIPELINE_SCHEDULES,
    build_schedule,
    check_schedule,
    virtual_stages_for,
)
from interlace.parallel.pipeline.shifted import ShiftedSchedule, shifted_order
from interlace.parallel.pipeline.stage import GPTStage, TiedEmbedding, local_module

__all__ = [
    "PIPELINE_SCHEDULES",
    "DecoderParts",
    "GPTStage",
    "HFStage",
    "Partition",
    "PipelineLayout",
    "PipelineRunner",
    "Shard",
    "ShiftedSchedule",
    "TiedEmbedding",
    "balance",
    "build_schedule",
    "check_schedule",
    "checkpointed_layers",
    "cross_entropy_loss",
    "describe_stages",
    "hf_local_module",
    "local_module",
    "micro_batches_in_flight",
    "model_shards",
    "partition",
    "pipeline_layout",
    "ratio_for_budget",
    "recompute_ratios",
    "shifted_order",
    "stage_aware_ratios",
    "virtual_stages_for",
]

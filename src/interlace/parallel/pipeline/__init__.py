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
- `wire`: activations and their gradients cross stage boundaries in the run's compute dtype.
- `layout`: `pipeline_layout(model, plan)`, the partition and recomputation of every stage,
  shared by the runner and `interlace plan --show-stages`.
- `runner`: `PipelineRunner`, one training step on every pipeline rank.
- `trace`: `StepRecorder`, a timeline span per stage forward, backward and recomputation of
  every micro-batch, gathered to one rank and written as a Chrome trace + PNG.

Import from the modules themselves (`interlace.parallel.pipeline.runner`): the package re-exports
nothing, so importing one module never imports the rest.
"""

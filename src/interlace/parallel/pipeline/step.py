"""What pipeline parallelism adds to `parallelize` (step 6): this rank's stages, and their share
of each step (the schedule that runs it, gradient norm, checkpoint layout)."""

from __future__ import annotations

from collections.abc import Sequence

from interlace.mesh import Mesh
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.parallel.storage import Storage


def pipeline_step(
    result: Parallelized,
    mesh: Mesh,
    split_points: Sequence[str] | None,
    layers_per_stage: Sequence[int] | None,
) -> None:
    """Step 6 of `parallelize`: keep this rank's pipeline stages over "pp"; the model becomes
    those stages, which its schedule runs (`result.executor`); the norm's share and the checkpoint
    layout of what this rank keeps."""
    plan = result.plan
    runner = PipelineRunner(
        result.model,
        plan,
        mesh,
        result.scores,
        split_points=split_points,
        layers_per_stage=layers_per_stage,
        precision=result.precision.compute,
        forward_scopes=result.forward_scopes,
    )
    result.executor = runner
    result.model = result.module = runner.module
    result.norm_shares.append(runner.norm_share())
    held = dict(runner.module.named_parameters(remove_duplicate=False))
    storage = result.storage
    result.storage = Storage(
        aliases=runner.checkpoint_aliases(),
        keys={n: k for n, k in storage.keys.items() if n in held},
        layouts={n: layout for n, layout in storage.layouts.items() if n in held},
        whole={n: whole for n, whole in storage.whole.items() if n in held},
        assembly={n: spec for n, spec in storage.assembly.items() if n in held},
    )
    result.report.append(f"pipeline: stages {runner.stage_indices} of {runner.layout.n_stages}")

"""The parallel dimensions' plan rules, one torch-free `options` module each, in mesh order
(outermost first). Each module gives `mesh_dims(plan)` (its named mesh dimensions and sizes),
`check_values(plan)` (its options, before any work) and `check_model(plan, spec)` (what the
model must divide); `Plan.validate` and `interlace.mesh` loop over them. Expert parallelism
adds no mesh dimension of its own (its groups are carved out of "dp")."""

from __future__ import annotations

from interlace.parallel.context import options as context_options
from interlace.parallel.data import options as data_options
from interlace.parallel.expert import options as expert_options
from interlace.parallel.pipeline import options as pipeline_options
from interlace.parallel.tensor import options as tensor_options
from interlace.parallel.tensor3d import options as tensor3d_options

DIMENSIONS = (
    pipeline_options,
    data_options,
    context_options,
    tensor_options,
    tensor3d_options,
    expert_options,
)
"""Every dimension's plan rules, in mesh order."""

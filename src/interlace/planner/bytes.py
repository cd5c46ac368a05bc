"""Bytes per element and per parameter that the planner's time and memory terms are priced in.

One home for the sizes both the cost model (`cost`, `cost_moe`, `cost_data`, ...) and the
calibration (`calibrate.measure_optimizer_bandwidth`) use, so neither imports the other for
them.
"""

from __future__ import annotations

GRAD_BYTES = 4
"""Bytes per gradient element in the data parallel all-reduce (fp32)."""
MOMENT_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per element of each of AdamW's two moments under each `optimizer_state`."""
OPTIMIZER_STATES = tuple(MOMENT_BYTES)
"""The dtypes a run can keep AdamW's moments in (`--optimizer-state`; `optim_lowbit` for
bf16)."""
MASTER_BYTES = 4
"""Bytes per element of a parameter's weight and of its gradient (fp32) between steps."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}
"""Bytes per activation element of each compute dtype."""


def state_bytes_per_param(optimizer_state: str = "fp32") -> int:
    """Bytes a parameter holds between steps: its fp32 weight and gradient (8) and AdamW's two
    moments in `optimizer_state`'s dtype (fp32: 8, so 16 in all; bf16: 4, so 12)."""
    return 2 * MASTER_BYTES + 2 * MOMENT_BYTES[optimizer_state]


def step_bytes_per_param(optimizer_state: str = "fp32") -> int:
    """Memory traffic of one parameter's optimizer step: AdamW reads the fp32 weight, gradient
    and two moments and writes the weight and moments, and the gradient norm reads the
    gradient once more: 32 bytes with fp32 moments, 24 with bf16 ones. torch's fused step
    (fp32 moments) streams just that, applying the clip coefficient within its own pass; the
    bf16-moment step (`optim_lowbit`), a dozen unfused operations per tensor, is priced at
    what it must stream, not at the passes it makes."""
    moments = 2 * MOMENT_BYTES[optimizer_state]
    return (2 * MASTER_BYTES + moments) + (MASTER_BYTES + moments) + MASTER_BYTES


def activation_bytes(dtype: str) -> int:
    """Bytes per activation element in compute dtype `dtype` (`DTYPE_BYTES`; 2 for a dtype
    not listed)."""
    return DTYPE_BYTES.get(dtype, 2)

"""Bytes per element and per parameter that the planner's time and memory terms are priced in.

One home for the sizes both the cost model (`cost`, `cost_moe`, `cost_data`, ...) and the
calibration (`calibrate.measure_optimizer_bandwidth`) use, so neither imports the other for
them.
"""

from __future__ import annotations

GRAD_BYTES = 4
"""Bytes per gradient element in the data parallel all-reduce (fp32)."""
STATE_BYTES = 16
"""Bytes per parameter of fp32 weight, fp32 gradient and two fp32 AdamW moments."""
OPTIMIZER_BYTES_PER_PARAM = 32
"""Memory traffic of one parameter's optimizer step: AdamW reads the fp32 weight, gradient and
two moments (16 bytes) and writes the weight and moments (12), and the gradient norm reads the
gradient once more (4); the fused step applies the clip coefficient within its own pass."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4}
"""Bytes per activation element of each compute dtype."""


def activation_bytes(dtype: str) -> int:
    """Bytes per activation element in compute dtype `dtype` (`DTYPE_BYTES`; 2 for a dtype
    not listed)."""
    return DTYPE_BYTES.get(dtype, 2)

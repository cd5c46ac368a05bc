"""What a training step achieves: model FLOPs per token, TFLOP/s per device and MFU against the
device's dense peak in the run's precision, peak device memory, and the CUDA caching
allocator's retries.

Model FLOPs count what the model needs, not what the hardware ran: 3 × the forward (forward,
and backward at twice the forward) of every matmul — 6 · N per token for N matmul parameters
(a MoE layer's active experts only) — plus attention's 12 · L · T · d (scores and weighted
values over T positions, forward and backward); the planner's model profile computes the
same, so both speak one count. Recomputation re-runs forwards the count leaves out: it costs
hardware FLOPs, not model FLOPs.
"""

from __future__ import annotations

import torch

from interlace.models.config import GPTConfig
from interlace.planner.profile import model_profile

DEVICE_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
}
"""Dense (no sparsity) peak TFLOP/s per device and precision, from the vendors' data sheets
(SXM parts unless named; fp32 without TF32, which interlace leaves off). Matched in this order
against the CUDA device name, so "H100 PCIe" wins over "H100"."""


def model_flops_per_token(config: GPTConfig) -> float:
    """Model FLOPs of one training token of `config`'s GPT (forward + backward, see above)."""
    return 3 * model_profile(config).forward_flops_per_token


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """Dense peak TFLOP/s of `device` in `precision` (bf16, fp16, fp32), or None where unknown
    (the CPU, or a GPU missing from DEVICE_PEAK_TFLOPS; pass --peak-tflops then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in DEVICE_PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None


def peak_memory_gib(device: torch.device) -> float | None:
    """The most device memory this process has held in tensors so far (GiB); None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def allocator_retries(device: torch.device) -> int | None:
    """How often, so far in this process, the CUDA caching allocator found no block for an
    allocation, released its whole cache and tried again; None off CUDA. Each retry waits for
    the device and returns memory to the driver, so a step that needs one runs much slower."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def retries_warning(step: int, retries: int) -> str:
    """The one-line warning for `retries` allocator retries seen by step `step`."""
    return (
        f"warning: by step {step} the CUDA caching allocator had released its cache and retried "
        f"{retries} allocation(s): device memory is nearly full or fragmented, and each retry "
        "waits for the device. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually ends "
        "them; so does a smaller --micro-batch, recomputation or sharded data parallelism"
    )


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA stream runs ahead of the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

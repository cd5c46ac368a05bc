"""Hardware descriptions the cost model prices plans on: compute, memory and two link levels.

A cluster is nodes of `devices_per_node` identical devices. Devices of one node talk over the
intra-node link (NVLink, Infinity Fabric, PCIe); devices of different nodes over the network.
Each link is priced α + β·bytes (α: latency of one message, β = 1 / bandwidth), with bandwidth
given **per device and per direction**: `inter_node_bandwidth` is one device's share of its
node's network (a node with 8 × 200 Gb/s NICs and 8 GPUs gives each 25 GB/s).

The presets hold nominal datasheet numbers (dense tensor-core peaks, link rates) and a
`matmul_efficiency`, the fraction of peak a training step's matmuls reach, with
`efficiency_by_dtype` where a dtype was measured to reach a different fraction (dgx-h100's bf16
and fp16: see its entry). They are starting points for planning, not measurements:
`local(...)` builds a Hardware from numbers measured on the machine at hand, and
`interlace.planner.calibrate.local_hardware(ranks)` measures this machine (the hardware named
`local`).

**Efficiency by shape.** A matmul on few rows m (tokens of a micro-batch, a sub-batch or one
expert) reaches less of the peak than a large one: each call pays a fixed overhead (kernel
launch, tile quantisation, the non-matmul work around it) that a small m does not amortise.
`efficiency(m)` = matmul_efficiency · m / (m + matmul_half_rows): at m = matmul_half_rows half
the large-matmul efficiency (efficiency_by_dtype's value in place of matmul_efficiency for the
dtypes it names). `matmul_half_rows` = 0 (every preset's value: datasheets publish no
such figure) gives the constant matmul_efficiency at every m; `bench planner` fits it on this
machine from the model's own step at several row counts (`calibrate.fit_half_rows`).

**Efficiency by width.** A step's non-matmul work (norms, activations, residual adds, the
loss) grows per token as the model's width d, its matmuls as d², so at a tensor core's matmul
speed a narrow model spends a larger share of its step outside the matmuls. For the dtypes in
`width_half_by_dtype` the efficiency is multiplied by d / (d + w), w the width at which both
take as long (dgx-h100's bf16 and fp16, fitted on two measured steps: see its entry).

**Tile and wave quantisation.** On a GPU preset (`sm_count` > 0) each layer's matmul shapes
cost a further factor (`planner.gemm`), multiplied in by the cost model (`cost_work`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from interlace.errors import ConfigError
from interlace.planner.surface import RateSurface

GB = 1e9
"""Bytes in a (decimal) gigabyte, the unit of link datasheets."""
GIB = 2**30
"""Bytes in a gibibyte, the unit device memory is usually quoted in."""


@dataclass(frozen=True)
class Hardware:
    """One cluster's devices and links.

    peak_flops: dense peak FLOP/s per device for each dtype name ("bf16", "fp16", "tf32",
        "fp32"); matmul_efficiency: fraction of that peak a large matmul reaches (0, 1].
    memory_bytes: device memory; devices_per_node: devices sharing the fast intra-node link.
    intra_/inter_node_bandwidth: bytes/s one device sends per direction on that link;
    intra_/inter_node_latency: seconds per message (α) on that link.
    overlap_efficiency: the fraction of a collective that hides under concurrent compute where
        interlace overlaps them (1: fully, as with separate copy engines; measured on a CPU).
    memory_bandwidth: bytes/s a device streams through its memory (HBM, or what an optimizer
        step reaches on a CPU); it prices the optimizer step. inf: the step is not priced.
    idle_speedup: how much faster one device computes while the others of its node idle than
        while all compute (1 for accelerators; above 1 for CPU ranks sharing cores, whose
        pipeline bubbles then run the busy stages faster).
    matmul_half_rows: the rows (tokens) a matmul needs to reach half of matmul_efficiency
        (`efficiency`); 0: matmul_efficiency at every size.
    sm_count: the device's streaming multiprocessors (compute units), over which a matmul's
        output tiles run in waves (`planner.gemm`: its shape costs a factor of the rate); 0:
        no shape model (a CPU, or an efficiency measured on the model's own step).
    efficiency_by_dtype: matmul_efficiency of the dtypes named here, where a step in that
        dtype was measured to reach another fraction of its peak (each in (0, 1]).
    width_half_by_dtype: for the dtypes named here, the model width d (d_model) at which a
        step's non-matmul work takes as long as its matmuls (`efficiency`); 0 or absent: no
        dependence on the width.
    sources: where each kind of figure comes from, by kind (`RATE_KINDS`: "compute",
        "links", "overlap", "memory"), for `--explain`; `source(kind)` defaults to "assumed".
    surface: matmul and attention rates measured on a grid of shapes in one dtype
        (`planner.surface`; `--calibrate`), which price that dtype's shapes in place of the
        tile and wave model; None: not measured.
    """

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    matmul_efficiency: float
    memory_bytes: float
    devices_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    overlap_efficiency: float = 1.0
    memory_bandwidth: float = math.inf
    idle_speedup: float = 1.0
    matmul_half_rows: float = 0.0
    sm_count: int = 0
    efficiency_by_dtype: dict[str, float] = field(default_factory=dict, hash=False)
    width_half_by_dtype: dict[str, float] = field(default_factory=dict, hash=False)
    sources: dict[str, str] = field(default_factory=dict, hash=False)
    surface: RateSurface | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        for dtype, half in self.width_half_by_dtype.items():
            if not 0 <= half < math.inf:
                raise ConfigError(
                    f"{self.name}: width_half_by_dtype[{dtype}]={half} must be a finite "
                    "number >= 0 (model width at which non-matmul work equals the matmuls')"
                )
        if not 0 <= self.matmul_half_rows < math.inf:
            raise ConfigError(
                f"{self.name}: matmul_half_rows={self.matmul_half_rows} must be a finite number "
                ">= 0 (rows at which a matmul reaches half of matmul_efficiency; 0 = the same "
                "efficiency at every size), e.g. 256"
            )
        if not 0 <= self.overlap_efficiency <= 1:
            raise ConfigError(
                f"{self.name}: overlap_efficiency={self.overlap_efficiency} must be in [0, 1]"
            )
        if not isinstance(self.sm_count, int) or self.sm_count < 0:
            raise ConfigError(
                f"{self.name}: sm_count={self.sm_count!r} must be an integer >= 0 (streaming "
                "multiprocessors; 0 = no matmul shape model), e.g. 132"
            )
        if not self.idle_speedup >= 1:
            raise ConfigError(f"{self.name}: idle_speedup={self.idle_speedup} must be >= 1")
        efficiencies = {
            "matmul_efficiency": self.matmul_efficiency,
            **{f"efficiency_by_dtype[{k}]": v for k, v in self.efficiency_by_dtype.items()},
        }
        for key, value in efficiencies.items():
            if not 0 < value <= 1:
                raise ConfigError(f"{self.name}: {key}={value} must be in (0, 1], e.g. 0.7")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ConfigError(
                f"{self.name}: devices_per_node={self.devices_per_node!r} must be a positive "
                "integer, e.g. 8"
            )
        positive = {
            "memory_bytes": self.memory_bytes,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "memory_bandwidth": self.memory_bandwidth,
            **{f"peak_flops[{k}]": v for k, v in self.peak_flops.items()},
        }
        for key, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{self.name}: {key}={value} must be > 0")
        for key in ("intra_node_latency", "inter_node_latency"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{self.name}: {key}={getattr(self, key)} must be >= 0")
        if not self.peak_flops:
            raise ConfigError(f"{self.name}: peak_flops needs at least one dtype, e.g. bf16")

    def source(self, kind: str) -> str:
        """Where this hardware's `kind` figures (one of `RATE_KINDS`) come from."""
        if kind not in RATE_KINDS:
            raise ValueError(f"unknown kind of rate {kind!r}; one of {', '.join(RATE_KINDS)}")
        return self.sources.get(kind, "assumed")

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device in `dtype`; ConfigError naming the known dtypes."""
        if dtype not in self.peak_flops:
            raise ConfigError(
                f"hardware {self.name} has no peak for dtype {dtype!r}; choose one of: "
                f"{', '.join(self.peak_flops)}"
            )
        return self.peak_flops[dtype]

    def efficiency(
        self, rows: float | None = None, dtype: str | None = None, width: float | None = None
    ) -> float:
        """Fraction of peak the matmuls of a step on `rows` rows (tokens) of a model `width`
        wide (d_model) reach in `dtype`: E · rows / (rows + matmul_half_rows) · width /
        (width + width_half), E = efficiency_by_dtype[dtype] where given, else
        matmul_efficiency, width_half = width_half_by_dtype[dtype] (0 without); each factor
        1 where its size is None (a large matmul, a wide model) or its half is 0."""
        large = self.efficiency_by_dtype.get(dtype, self.matmul_efficiency)
        if rows is not None and self.matmul_half_rows:
            large *= rows / (rows + self.matmul_half_rows)
        half = self.width_half_by_dtype.get(dtype, 0.0)
        if width is not None and half:
            large *= width / (width + half)
        return large

    def matmul_flops(
        self, dtype: str, rows: float | None = None, width: float | None = None
    ) -> float:
        """FLOP/s a device sustains on the matmuls of a step on `rows` rows (tokens; None:
        large matmuls) of a model `width` wide (None: wide): peak(dtype) · efficiency."""
        return self.peak(dtype) * self.efficiency(rows, dtype, width)

    def link(self, inside_node: bool) -> tuple[float, float]:
        """(α seconds per message, bandwidth bytes/s) of the intra- or inter-node link."""
        if inside_node:
            return self.intra_node_latency, self.intra_node_bandwidth
        return self.inter_node_latency, self.inter_node_bandwidth


RATE_KINDS = ("compute", "links", "overlap", "memory")
"""The kinds of figure a Hardware prices with, each with its `source`."""

DATASHEET = {
    "compute": "datasheet peak × an assumed matmul efficiency, not measured",
    "links": "datasheet link rates",
    "overlap": "assumed: collectives hide fully under compute",
    "memory": "datasheet memory bandwidth",
}
"""The sources of a preset's figures where nothing was measured."""


def _a100_peaks() -> dict[str, float]:
    return {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}


PRESETS: dict[str, Hardware] = {
    # 8 × A100-SXM4-80GB, NVLink 3 (600 GB/s both directions), 8 × 200 Gb/s InfiniBand.
    "dgx-a100": Hardware(
        name="dgx-a100",
        peak_flops=_a100_peaks(),
        matmul_efficiency=0.75,
        sm_count=108,
        memory_bytes=80 * GIB,
        devices_per_node=8,
        intra_node_bandwidth=300 * GB,
        intra_node_latency=5e-6,
        inter_node_bandwidth=25 * GB,
        inter_node_latency=10e-6,
        memory_bandwidth=2039 * GB,
        sources=DATASHEET,
    ),
    # 4 × A100-SXM4-40GB per node, NVLink 3, 4 × 25 GB/s Slingshot-11 NICs per node.
    "perlmutter": Hardware(
        name="perlmutter",
        peak_flops=_a100_peaks(),
        matmul_efficiency=0.75,
        sm_count=108,
        memory_bytes=40 * GIB,
        devices_per_node=4,
        intra_node_bandwidth=300 * GB,
        intra_node_latency=5e-6,
        inter_node_bandwidth=25 * GB,
        inter_node_latency=10e-6,
        memory_bandwidth=1555 * GB,
        sources=DATASHEET,
    ),
    # 8 × H100-SXM5-80GB, NVLink 4 (900 GB/s both directions), 8 × 400 Gb/s InfiniBand.
    # Efficiency measured on one H100 80GB (torch 2.11, T = 1024, vocabulary 4096, one device):
    # bf16 autocast + torch.compile reaches 34.8 % of the bf16 peak for gpt2-124m (d 768,
    # batch 16) and 40.6 % for gpt2-1.5b (d 1600, batch 8): non-matmul work (norms,
    # activations, residuals; per token ∝ d against the matmuls' ∝ d²) weighs more on the
    # narrower model. E · d / (d + w) through both points gives E = 0.48, w = 291 (fitted
    # without the matmul shapes' factor, kept with it: docs/planner.md); Megatron-LM's
    # published H100 runs (41–49 % MFU at d 2048–20480, `bench published`) sit on the same
    # curve. fp32 reaches 68 % of the fp32 peak
    # (4.6 % of bf16's), which 0.7 prices. tf32 is not measured. The optimizer step streams at
    # 2240 GB/s, not HBM3's 3350: on that H100 (torch profiler, moe-gpt-12l, 1.71 B parameters)
    # the fused AdamW took 21.9 ms and the gradient norm 2.6 ms, 32 bytes a parameter in 24.5 ms.
    # The other GPU presets give their memory's datasheet rate, not measured.
    "dgx-h100": Hardware(
        name="dgx-h100",
        peak_flops={"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
        matmul_efficiency=0.7,
        efficiency_by_dtype={"bf16": 0.48, "fp16": 0.48},
        width_half_by_dtype={"bf16": 291.0, "fp16": 291.0},
        sm_count=132,
        memory_bytes=80 * GIB,
        devices_per_node=8,
        intra_node_bandwidth=450 * GB,
        intra_node_latency=4e-6,
        inter_node_bandwidth=50 * GB,
        inter_node_latency=8e-6,
        memory_bandwidth=2240 * GB,
        sources={
            **DATASHEET,
            "compute": "datasheet peak × efficiency measured on one H100 (bf16: two compiled "
            "steps, by model width)",
            "memory": "measured on one H100 (the optimizer step, torch profiler)",
        },
    ),
    # Frontier node: 4 × MI250X = 8 GCDs (each one device, 64 GB HBM), Infinity Fabric between
    # GCDs (50 GB/s per direction on a single link), 4 × 25 GB/s Slingshot-11 per node.
    "frontier": Hardware(
        name="frontier",
        peak_flops={"bf16": 191.5e12, "fp16": 191.5e12, "fp32": 47.9e12},
        matmul_efficiency=0.55,
        sm_count=110,
        memory_bytes=64 * GIB,
        devices_per_node=8,
        intra_node_bandwidth=50 * GB,
        intra_node_latency=8e-6,
        inter_node_bandwidth=12.5 * GB,
        inter_node_latency=12e-6,
        memory_bandwidth=1600 * GB,
        sources=DATASHEET,
    ),
    # 8 × RTX 3090 (24 GB) on PCIe 4.0 per node (no NVLink), one 100 Gb/s InfiniBand NIC.
    "rtx3090-ib": Hardware(
        name="rtx3090-ib",
        peak_flops={"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12},
        matmul_efficiency=0.65,
        sm_count=82,
        memory_bytes=24 * GIB,
        devices_per_node=8,
        intra_node_bandwidth=16 * GB,
        intra_node_latency=10e-6,
        inter_node_bandwidth=12.5 * GB / 8,
        inter_node_latency=15e-6,
        memory_bandwidth=936 * GB,
        sources=DATASHEET,
    ),
}


def local(
    matmul_flops: float | Mapping[str, float],
    link_bandwidth: float,
    *,
    memory_bytes: float = 16 * GIB,
    devices_per_node: int = 1,
    inter_node_bandwidth: float | None = None,
    latency: float = 50e-6,
    dtype: str = "fp32",
    name: str = "local",
    overlap_efficiency: float = 1.0,
    memory_bandwidth: float = math.inf,
    idle_speedup: float = 1.0,
    sources: dict[str, str] | None = None,
) -> Hardware:
    """A Hardware from measurements: `matmul_flops` sustained FLOP/s of a large matmul in
    `dtype`, or one such rate per dtype name (so matmul_efficiency is 1); `link_bandwidth`
    bytes/s per direction between two devices of a node; `inter_node_bandwidth` defaults to
    the same link, `latency` is α of both links; `overlap_efficiency`, `memory_bandwidth` and
    `idle_speedup` as measured (`calibrate.measure_overlap`,
    `calibrate.measure_optimizer_bandwidth`); `sources` says where each kind came from
    (default: every kind "measured")."""
    return Hardware(
        name=name,
        peak_flops=(
            {k: float(v) for k, v in matmul_flops.items()}
            if isinstance(matmul_flops, Mapping)
            else {dtype: float(matmul_flops)}
        ),
        matmul_efficiency=1.0,
        memory_bytes=memory_bytes,
        devices_per_node=devices_per_node,
        intra_node_bandwidth=float(link_bandwidth),
        intra_node_latency=latency,
        inter_node_bandwidth=float(
            link_bandwidth if inter_node_bandwidth is None else inter_node_bandwidth
        ),
        inter_node_latency=latency,
        overlap_efficiency=overlap_efficiency,
        memory_bandwidth=memory_bandwidth,
        idle_speedup=idle_speedup,
        sources=sources or dict.fromkeys(RATE_KINDS, "measured"),
    )


LOCAL = "local"
"""The hardware name that means this machine, measured (`interlace.planner.calibrate`)."""


def get_hardware(name: str) -> Hardware:
    """The preset named `name`; ConfigError listing the names otherwise, and for "local" (this
    machine is measured, not a preset) naming `calibrate.local_hardware`."""
    if name == LOCAL:
        raise ConfigError(
            f"hardware {LOCAL!r} is this machine, measured: build it with "
            "interlace.planner.calibrate.local_hardware(ranks), not as a preset"
        )
    if name not in PRESETS:
        raise ConfigError(
            f"unknown hardware {name!r}; choose one of: {', '.join(PRESETS)}, {LOCAL} "
            "(this machine, measured)"
        )
    return PRESETS[name]

"""`tp3d`: bytes per rank per training step of each tensor parallel group, 1D TP against every 3D
layout (x, y, z) of the same ranks, as the comm meter counts them and as predicted; plus step time,
for layouts with z > 1 also without the weight prefetch (`tp3d_prefetch=false`).

One forward + backward of the built-in GPT per layout, all ranks in the tensor parallel group.
Measured: the meter's wire bytes (ring model) per group ("tp", or "tp_x", "tp_y", "tp_z",
"tp_xy") in one step. Predicted: AxoNN's per-layer formula (`tensor3d.layer_wire_bytes`)
summed over every block linear, plus what the layout adds beside its linears: the LayerNorm
statistics and the residual split / gather over X, the loss mean and the replicated
parameters' gradients over Z, and over the x·y ranks (`tp_xy`) the vocab-parallel embedding
and head and the sharded cross-entropy's three [T] reductions; for 1D TP, Megatron's two
all-reduces of [T, d] per block each way, the vocab-parallel embedding and head, and the
sharded cross-entropy's three [T] reductions. Measured must equal predicted exactly.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch

from interlace import comm
from interlace.bench.base import GPT_OPTION_HELP, Benchmark, RankContext, gpt_config
from interlace.bench.timing import median, sample
from interlace.errors import ConfigError
from interlace.mesh import build_mesh
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.parallel.parallelize import parallelize
from interlace.parallel.tensor3d.layers import layer_wire_bytes
from interlace.parallel.tensor3d.shard import shard3d_spec
from interlace.plan import Overlap, Plan

_GROUPS = ("tp", "tp_x", "tp_y", "tp_z", "tp_xy")
_B = 4  # bytes per fp32 element


def layouts(ranks: int) -> list[tuple[int, int, int] | None]:
    """1D TP (None), then every grid (x, y, z) with x·y·z = ranks, x fastest-varying first."""
    grids = [
        (x, y, z)
        for z, y, x in itertools.product(range(1, ranks + 1), repeat=3)
        if x * y * z == ranks
    ]
    return [None, *sorted(grids, key=lambda g: (-g[0], -g[1]))]


def _name(grid: tuple[int, int, int] | None, ranks: int) -> str:
    return f"tp={ranks}" if grid is None else "tp3d=" + "x".join(map(str, grid))


def predicted_3d(
    cfg: GPTConfig, tokens: int, grid: tuple[int, int, int], z_params: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(AxoNN's formula over the block linears, + this layout's other collectives) in wire bytes
    per group for one step; `tokens` per rank, `z_params` elements whose gradients are all-reduced
    over Z (every parameter but the 3D weights)."""
    x, y, z = grid
    d, f = cfg.d_model, cfg.ffn_dim
    linears = [(d, d, False)] * 3 + [(d, d, True), (d, f, False), (f, d, True)]
    formula = dict.fromkeys(("tp_x", "tp_y", "tp_z"), 0.0)
    for n_in, n_out, transposed in linears:
        for group, nbytes in layer_wire_bytes(n_in, n_out, tokens, grid, transposed).items():
            formula[group] += cfg.n_layers * nbytes
    ring = {k: 2 * (k - 1) / k for k in (x, z, x * y)}
    total = dict(formula)
    total["tp_xy"] = ring[x * y] * vocab_parallel_elements(cfg.d_model, tokens) * _B
    total["tp_x"] += cfg.n_layers * 2 * 2 * ring[x] * tokens * 2 * _B  # LayerNorm Σx, Σx²
    total["tp_x"] += 2 * (x - 1) * tokens * d // x * _B  # residual split (bwd) + gather (fwd)
    total["tp_z"] += ring[z] * (1 + z_params) * _B  # the loss, replicated gradients
    return formula, total


def predicted_1d(cfg: GPTConfig, tokens: int, p: int) -> dict[str, float]:
    """Megatron 1D TP's wire bytes per rank per step: [T, d] all-reduced at every block's exit
    (forward) and entry (backward), the embedding (forward) and head entry (backward), and the
    sharded cross-entropy's row max and [2, T] sums."""
    act = tokens * cfg.d_model * _B
    vocab = vocab_parallel_elements(cfg.d_model, tokens) * _B
    return {"tp": 2 * (p - 1) / p * (4 * cfg.n_layers * act + vocab)}


def vocab_parallel_elements(d: int, tokens: int) -> int:
    """Elements all-reduced per step by a vocab-parallel embedding and head and the sharded
    cross-entropy: [T, d] out of the embedding (forward) and into the head (backward), the
    loss's row max and [2, T] sums."""
    return 2 * tokens * d + 3 * tokens


def _measure(
    options: dict[str, Any],
    grid: tuple[int, int, int] | None,
    ranks: int,
    ctx: RankContext,
    prefetch: bool = True,
) -> dict[str, Any]:
    plan = (
        Plan(tp=ranks) if grid is None else Plan(tp3d=grid, overlap=Overlap(tp3d_prefetch=prefetch))
    )
    cfg = gpt_config(options)
    torch.manual_seed(0)
    par = parallelize(build_model(cfg), plan, build_mesh(plan))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (options["batch"], cfg.seq_len + 1), generator=g)
    losses: list[float] = []

    x, y = par.rows(tokens[:, :-1]), par.rows(tokens[:, 1:])

    def step() -> None:
        par.model.zero_grad(set_to_none=True)
        loss = par.loss(par.model(x), y)
        loss.backward()
        losses.append(loss.item())

    step_s = sample(step, ctx.group, min_samples=options["steps"], min_seconds=0)
    comm.meter.reset()
    step()
    snap = comm.meter.snapshot()
    measured = {
        group: sum(op["wire_bytes"] for op in snap[group].values())
        for group in _GROUPS
        if group in snap
    }
    per_rank_tokens = options["batch"] * cfg.seq_len // (1 if grid is None else grid[2])
    row: dict[str, Any] = {"tp3d": grid, "measured": measured, "step_s": step_s}
    row.update(step_median_s=median(step_s), loss=losses[-1], tokens_per_rank=per_rank_tokens)
    if grid is None:
        row["formula"] = row["predicted"] = predicted_1d(cfg, per_rank_tokens, ranks)
    else:
        z_params = sum(
            p.numel()
            for p in par.model.parameters()
            if (spec := shard3d_spec(p)) is None or "z" not in spec.axes
        )
        row["formula"], row["predicted"] = predicted_3d(cfg, per_rank_tokens, grid, z_params)
    row["predicted"] = {k: v for k, v in row["predicted"].items() if v}
    return row


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Every layout of the world's ranks, one after another (same model, same batch); layouts
    with z > 1 again without the weight prefetch, for its step time."""
    ranks, options = ctx.group.size, ctx.options
    rows = {_name(g, ranks): _measure(options, g, ranks, ctx) for g in layouts(ranks)}
    for grid in layouts(ranks):
        if grid is not None and grid[2] > 1:
            off = _measure(options, grid, ranks, ctx, prefetch=False)
            rows[_name(grid, ranks)]["step_median_s_no_prefetch"] = off["step_median_s"]
    return {
        "params": gpt_config(options).num_params(),
        "layouts": rows,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def table(doc: dict[str, Any]) -> str:
    """One row per layout: measured and predicted MB per group, step time (and without the
    weight prefetch)."""
    r = doc["result"]
    lines = [
        f"GPT {r['params'] / 1e6:.2f} M params; wire MB per rank per step, measured/predicted",
        f"{'layout':12s} " + " ".join(f"{g:>15s}" for g in _GROUPS) + f" {'step s':>7s}"
        f" {'no prefetch':>11s}",
    ]
    for name, row in r["layouts"].items():
        cells = []
        for g in _GROUPS:
            m, p = row["measured"].get(g, 0.0), row["predicted"].get(g, 0.0)
            cells.append(f"{m / 1e6:7.3f}/{p / 1e6:<7.3f}" if m or p else f"{'-':>15s}")
        off = row.get("step_median_s_no_prefetch")
        off_cell = f"{off:11.3f}" if off is not None else f"{'-':>11s}"
        lines.append(f"{name:12s} " + " ".join(cells) + f" {row['step_median_s']:7.3f} {off_cell}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Left: measured wire MB per group, stacked per layout, predicted total marked; right: step
    time per layout."""
    from interlace.plotting import new_figure, save_figure

    rows = doc["result"]["layouts"]
    names = list(rows)
    fig, axes = new_figure(1, 2, figsize=(11, 4))
    left, right = axes[0]
    bottom = [0.0] * len(names)
    for i, g in enumerate(_GROUPS):
        values = [rows[n]["measured"].get(g, 0.0) / 1e6 for n in names]
        left.bar(names, values, bottom=bottom, label=g, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    totals = [sum(rows[n]["predicted"].values()) / 1e6 for n in names]
    left.plot(names, totals, "k_", markersize=22, label="predicted")
    left.set_ylabel("wire MB per rank per step")
    left.legend(fontsize=7)
    right.bar(names, [rows[n]["step_median_s"] for n in names], color="0.5", label="prefetch")
    off = [
        (n, rows[n]["step_median_s_no_prefetch"])
        for n in names
        if "step_median_s_no_prefetch" in rows[n]
    ]
    if off:
        right.plot(*zip(*off, strict=True), "rv", label="no prefetch")
        right.legend(fontsize=7)
    right.set_ylabel("seconds per forward + backward")
    env = doc["environment"]
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.suptitle(f"1D vs 3D tensor parallelism, {env['ranks']} ranks, {env['network']}", fontsize=9)
    save_figure(fig, path)


def check(options: dict[str, Any]) -> None:
    """Positive sizes and heads dividing d_model (each layout is checked when it is built)."""
    sizes = ("vocab", "seq_len", "d_model", "layers", "heads", "batch", "steps")
    if any(options[s] < 1 for s in sizes):
        raise ConfigError(f"{', '.join(sizes)} must all be >= 1")
    if options["d_model"] % options["heads"]:
        raise ConfigError(f"heads={options['heads']} must divide d_model={options['d_model']}")


def headline(doc: dict[str, Any]) -> str:
    """Largest relative gap between measured and predicted bytes, and the layout moving least."""
    rows = doc["result"]["layouts"]
    gap = max(
        abs(row["measured"].get(g, 0.0) - p) / p
        for row in rows.values()
        for g, p in row["predicted"].items()
    )
    least = min(rows, key=lambda n: sum(rows[n]["measured"].values()))
    one_d = next(iter(rows))
    return (
        f"measured wire bytes equal the prediction (largest gap {gap:.1e}); {least} moves "
        f"{sum(rows[least]['measured'].values()) / 1e6:.2f} MB per rank per step vs "
        f"{sum(rows[one_d]['measured'].values()) / 1e6:.2f} MB for {one_d}"
    )


def key_numbers(doc_result: dict[str, Any]) -> dict[str, float]:
    """Each layout's median step time (and without the weight prefetch)."""
    numbers = {f"{n} step_s": row["step_median_s"] for n, row in doc_result["layouts"].items()}
    for n, row in doc_result["layouts"].items():
        if "step_median_s_no_prefetch" in row:
            numbers[f"{n} step_s no prefetch"] = row["step_median_s_no_prefetch"]
    return numbers


BENCHMARK = Benchmark(
    name="tp3d",
    summary="bytes per group per step: 1D TP vs every 3D tensor parallel layout, vs the formula",
    describe=(
        "One forward + backward of the built-in GPT on all ranks under 1D tensor parallelism "
        "and under every 3D layout x·y·z of the same ranks. The comm meter's wire bytes per "
        "rank per group are compared with AxoNN's per-layer formula (REFERENCE.md §3) summed "
        "over the block linears plus the layout's other collectives (LayerNorm statistics and "
        "residual split/gather over X, loss and replicated gradients over Z, the vocab-parallel "
        "embedding, head and cross-entropy over the x·y ranks, tp_xy). A bytes benchmark: "
        "loopback is enough; step times on loopback show compute, not the network. Layouts "
        "with z > 1 are timed again without the weight prefetch (each Z all-gather issued when "
        "its layer needs it instead of one layer ahead)."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    default_ranks=4,
    options={
        "vocab": 256,
        "seq_len": 64,
        "d_model": 128,
        "layers": 2,
        "heads": 4,
        "batch": 8,
        "steps": 3,
    },
    option_help={
        **GPT_OPTION_HELP,
        "batch": "sequences per step",
        "steps": "timed steps per layout (their median is kept)",
    },
)

"""`moe`: expert-parallel MoE load balancing — none (capacity + drop) vs dropless vs FasterMoE
shadowing vs Pro-Prophet's lightweight placement, on skewed and on recorded routing.

The model is a stack of `layers` blocks, each an `ExpertParallelMoE` (ep = every rank of the
cluster, E/ep experts per rank) followed by a replicated non-MoE op (LayerNorm + Linear + GELU,
residual), trained with SGD on a squared-output loss; every rank feeds its own `tokens` random
tokens per step.

**How the routing is forced.** The router is the layer's real top-k router with one change:
its choices. Before each step the benchmark samples every token's k experts from the workload
and the router takes those instead of its own top-k; everything else is the library's — the
projection runs, the gate weights are the router's softmax probabilities at the chosen experts
(renormalised for top-2), the capacity rule, drops and aux loss are unchanged, and the counts
all-gather, dispatch, replicas, combine and backward are the unmodified expert-parallel layer.
So the load is exactly the workload's while the compute and communication are real. Tokens
are sampled per source rank from the workload's popularity: `skewed` is the Zipf-like
drifting generator of `interlace.bench.moe_routing_workloads` (ranks see it tilted by a per-rank
preference), `recorded` replays the per-step, per-layer counts of a few real training steps of
the built-in MoE-GPT preset `recorded_model` on the built-in corpus (recorded on rank 0 and
broadcast; every rank replays the same popularity; the recorded model's experts set E; on a
top-1 recording, top-2's second expert is drawn from the same popularity among the rest).
The strategies take turns step by step, so a shared machine's changing load hits them alike.

Per strategy, workload and top-k: balance degree (std over devices of tokens computed, after
drops for `none`), max/mean device load, the fraction of assignments dropped, bytes moved
(every all_to_all the comm meter counted on all ranks: parameter Trans, gradient Agg, token
dispatch/combine), the seconds of placement search per step (on the layers' background
threads; prophet replans every `prophet_replan` steps, shadow every step), the slowest rank's
step time (median), and one MoE layer's forward + backward alone (median) next to Pro-Prophet's
performance model T = 4·T_A2A + 3·T_FEC + T_Trans + T_Agg for its count matrix and placement,
B̄ and t calibrated on this cluster. `search_model` (default `measured`) makes the shadow and
prophet searches price with the refined model and every calibrated term
(`moe_calibrate.layer_cost`, the hidden share h from `moe_overlap`); `paper` gives them
Pro-Prophet's terms from the same B̄ and t. The non-MoE op's gradients are not all-reduced (the
same cost for every strategy). `trans_overlap` (default true) runs Trans/Agg overlapped with
compute, each block issuing the next one's Trans after its dispatch; false runs them
synchronously. Prophet's search prices Trans/Agg overlap-adjusted when they overlap
(Pro-Prophet's scheduler); shadow's prices them in full (FasterMoE's broadcasts).

**Peer.** With the `peers` extra installed and `peers=true`, DeepSpeed-MoE's layer runs in
the same blocks on the same routing, with token drops (`deepspeed_drop`, capacity_factor as
above) and without (`deepspeed_dropless`); see `moe_deepspeed.py`. It has no balancing; its
bytes are computed from its capacity-padded buffers, and its layer has no performance model.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from interlace import comm
from interlace.bench import moe_deepspeed
from interlace.bench.base import Benchmark, RankContext, check_names
from interlace.bench.moe_calibrate import layer_cost, measure_expert, measure_link
from interlace.bench.moe_forced import forced_layer
from interlace.bench.moe_overlap import measure_hidden_share, probe_routing
from interlace.bench.moe_report import headline, key_numbers, plot, table, targets
from interlace.bench.moe_routing_workloads import (
    RecordedRouting,
    SkewedRouting,
    record_routing,
    sample_assignments,
)
from interlace.bench.timing import median, sample, slowest
from interlace.errors import ConfigError
from interlace.models.presets import get_preset
from interlace.moe.balance import (
    ExpertSize,
    LayerCost,
    Placement,
    balance_degree,
    device_loads,
    layer_time,
    make_balancer,
)
from interlace.parallel.expert.layer import ExpertParallelMoE, schedule_transfers

STRATEGIES = ("none", "dropless", "shadow", "prophet")
WORKLOADS = ("skewed", "recorded")
SEARCH_MODELS = ("measured", "paper")
_METER = comm.CommMeter()  # the benchmark's own bookkeeping stays out of the default meter


class _Block(nn.Module):
    """x + moe(x), then x + gelu(dense(norm(x))): an MoE layer and the next non-MoE op."""

    def __init__(self, moe: ExpertParallelMoE, d_model: int):
        super().__init__()
        self.moe = moe
        self.norm = nn.LayerNorm(d_model)
        self.dense = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.moe(x)
        return x + F.gelu(self.dense(self.norm(x)))


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * 999_983 + int(key) + 11) % (2**62)
    return torch.Generator().manual_seed(seed)


def _gather(vector: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """[D, len(vector)]: every rank's vector."""
    vector = vector.reshape(-1).contiguous()
    out = vector.new_empty(group.size * vector.numel())
    comm.all_gather(out, vector, group, meter=_METER)
    return out.view(group.size, -1)


def _total(value: float, group: comm.Group) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(tensor, group, meter=_METER)
    return float(tensor)


# ---------------------------------------------------------------------- calibration
def _calibrate(ctx: RankContext) -> dict[str, Any]:
    """The performance model's constants measured on the live group (`moe_calibrate`), c
    (`route_time_s`), the rest of the layer per routed assignment: what a dropless layer's
    forward + backward on an even top-1 routing leaves after the other modelled terms, and h
    (`hidden_share`, `moe_overlap`) on a stack of `layers` blocks on that routing."""
    o, group = ctx.options, ctx.group
    cal = measure_link(group, o["tokens"], o["d_model"])
    cal |= measure_expert(group, o["tokens"], o["d_model"], o["ffn"])
    even = ((torch.arange(o["tokens"]) + group.rank) % o["experts"]).unsqueeze(1)

    def forced(choices: torch.Tensor, overlap: bool = True) -> ExpertParallelMoE:
        moe = ExpertParallelMoE(forced_layer(o, o["experts"], 1), group, "dropless", 1, overlap)
        moe.router.choices = choices
        return moe

    def stack(overlap: bool) -> nn.Module:
        torch.manual_seed(o["seed"])
        base = Placement.blocked(o["experts"], group.size)
        probe = probe_routing(o["tokens"], base, group.rank)
        blocks = [_Block(forced(probe, overlap), o["d_model"]) for _ in range(o["layers"])]
        schedule_transfers([b.moe for b in blocks])
        return nn.Sequential(*blocks)

    moe = forced(even)
    seconds, kept = _layer_seconds(ctx, moe)
    rest = seconds - layer_time(kept, moe.placement, layer_cost(cal, moe.expert_size)).total
    cal["route_time_s"] = max(0.0, rest) / o["tokens"]
    cal["calibration_layer_s"] = seconds
    x = torch.randn(1, o["tokens"], o["d_model"], generator=_generator(o["seed"], group.rank, 97))
    return cal | measure_hidden_share(group, stack, x, max(5, o["layer_samples"]))


# ---------------------------------------------------------------------- workloads
def _workload(ctx: RankContext, name: str) -> tuple[Any, dict[str, Any]]:
    """(workload with .popularity(step, source, layer), its description)."""
    o, group = ctx.options, ctx.group
    if name == "skewed":
        work = SkewedRouting(
            o["experts"], o["exponent"], o["drift"], locality=o["locality"], seed=o["seed"]
        )
        return work, {"experts": o["experts"], "exponent": o["exponent"], "drift": o["drift"]}
    preset = get_preset(o["recorded_model"])
    shape = (o["recorded_steps"], len(preset.moe_layers), preset.n_experts)
    counts = torch.zeros(shape, dtype=torch.long)
    if group.rank == 0:
        start = time.perf_counter()
        counts = record_routing(
            o["recorded_model"], o["recorded_steps"], o["recorded_batch"], seed=o["seed"]
        ).counts
        print(
            f"recorded {shape[0]} steps of {o['recorded_model']} in "
            f"{time.perf_counter() - start:.1f} s",
            flush=True,
        )
    comm.broadcast(counts, 0, group, meter=_METER)
    popularity = (counts.sum(dim=(0, 1)).double() / counts.sum()).tolist()
    return RecordedRouting(counts, preset.top_k, o["recorded_model"]), {
        "experts": preset.n_experts,
        "model": o["recorded_model"],
        "counts": counts.tolist(),
        "mean_popularity": popularity,
    }


def _set_routing(blocks: list[_Block], work: Any, step: int, rank: int, o: dict, k: int) -> None:
    for layer, block in enumerate(blocks):
        router = block.moe.router
        pop = work.popularity(step, source=rank, layer=layer)
        chosen = sample_assignments(pop, o["tokens"], k, _generator(o["seed"], step, rank, layer))
        router.choices = chosen


# ---------------------------------------------------------------------- one configuration
def _build(ctx: RankContext, experts: int, k: int, strategy: str, cal: dict) -> list[_Block]:
    o, group = ctx.options, ctx.group
    torch.manual_seed(o["seed"])  # the same full model on every rank
    blocks = []
    for _ in range(o["layers"]):
        layer = forced_layer(o, experts, k)
        size_flops = 2 * 2 * o["d_model"] * o["ffn"]
        modelled: dict[str, Any] = {
            "bandwidth": cal["bandwidth_Bps"],
            "flops": cal["throughput_tokens_per_s"] * size_flops,
        }
        if o["search_model"] == "measured":  # the sizes are the layer's, set by `cost`
            template = ExpertSize(token_bytes=1, expert_bytes=1, flops_per_token=size_flops)
            modelled["measured"] = layer_cost(cal, template, cal["route_time_s"])
        if strategy == "prophet":
            modelled |= {
                "replan_every": o["prophet_replan"],
                "alpha": o["alpha"],
                "overlap": o["trans_overlap"],
            }
        options = modelled if strategy in ("shadow", "prophet") else {}
        balancer = make_balancer(strategy, **options)
        moe = ExpertParallelMoE(layer, group, balancer, overlap=o["trans_overlap"])
        blocks.append(_Block(moe, o["d_model"]))
    schedule_transfers([b.moe for b in blocks])
    return blocks


def _layer_stats(block: _Block, group: comm.Group) -> dict[str, Any]:
    """This step's computed counts [D, E] (kept ones) and what they give under the placement."""
    moe = block.moe
    kept = _gather(moe.router.last_kept, group)
    routed = moe.routing_history[-1]
    computed, _ = device_loads(kept, moe.placement)
    p_bytes = moe.expert_size.expert_bytes
    moved = sum(len(moe.placement.replicas[e]) for e in moe.placement.replicated) * p_bytes
    return {
        "kept": kept,
        "balance_degree": balance_degree(kept, moe.placement),
        "max_mean": float(computed.max() / computed.mean().clamp(min=1e-9)),
        "dropped": int(routed.sum() - kept.sum()),
        "assignments": int(routed.sum()),
        "trans_bytes": moved,
    }


class _Run:
    """One strategy's model on one workload and top-k, stepped one iteration at a time so that
    the strategies can take turns (a shared machine's load then affects them alike)."""

    def __init__(self, ctx: RankContext, k: int, blocks: list[_Block]):
        self.ctx, self.k = ctx, k
        self.blocks = blocks
        self.model = nn.Sequential(*self.blocks)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=ctx.options["lr"])
        self.step_s: list[float] = []
        self.a2a: list[float] = []
        self.trans: list[float] = []
        self.balance: list[float] = []
        self.load: list[float] = []
        self.dropped = self.assigned = 0
        self.plan_s = 0.0  # background search seconds applied during the measured steps
        self._timings: list[Any] = [None] * len(blocks)

    def step(self, work: Any, step: int) -> None:
        """One training iteration on the workload's routing of `step`; measured after warm-up."""
        o, group = self.ctx.options, self.ctx.group
        _set_routing(self.blocks, work, step, group.rank, o, self.k)
        x = torch.randn(
            1, o["tokens"], o["d_model"], generator=_generator(o["seed"], step, group.rank, 99)
        )
        dist.barrier(group=group.pg)
        comm.meter.reset()
        start = time.perf_counter()
        loss = self.model(x).float().pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        sent = comm.meter.snapshot().get(group.name, {}).get("all_to_all", {}).get("bytes", 0)
        searched = self._new_searches()
        if step < o["warmup"]:
            return
        self.plan_s += searched
        self.step_s.append(slowest(elapsed, group))
        stats = [self._stats(b) for b in self.blocks]
        self.a2a.append(self._all_to_all_bytes(sent, stats))
        self.balance.append(sum(s["balance_degree"] for s in stats) / len(stats))
        self.load.append(sum(s["max_mean"] for s in stats) / len(stats))
        self.dropped += sum(s["dropped"] for s in stats)
        self.assigned += sum(s["assignments"] for s in stats)
        self.trans.append(sum(s["trans_bytes"] for s in stats))

    def _stats(self, block: _Block) -> dict[str, Any]:
        return _layer_stats(block, self.ctx.group)

    def _new_searches(self) -> float:
        """Seconds of the placement searches applied since the last call (on their thread)."""
        seconds = 0.0
        for i, block in enumerate(self.blocks):
            timing = getattr(block.moe, "plan_timing", None)
            if timing is not None and timing is not self._timings[i]:
                seconds += timing.search_s
            self._timings[i] = timing
        return seconds

    def _all_to_all_bytes(self, sent: float, stats: list[dict[str, Any]]) -> float:
        """This step's all_to_all bytes over every rank (as the comm meter counted them)."""
        return _total(sent, self.ctx.group)

    def _layer(self, work: Any, cal: dict) -> dict[str, Any]:
        return _time_layer(self.ctx, self.blocks[0], work, self.k, cal)

    def result(self, work: Any, cal: dict) -> dict[str, Any]:
        """The measured steps' figures, then one layer timed alone against the model."""
        layer = self._layer(work, cal)
        trans_bytes = median(self.trans)
        return {
            "step_s": self.step_s,
            "step_median_s": median(self.step_s),
            "balance_degree": sum(self.balance) / len(self.balance),
            "max_mean_load": sum(self.load) / len(self.load),
            "dropped_fraction": self.dropped / max(self.assigned, 1),
            "all_to_all_bytes": median(self.a2a),
            "trans_bytes": trans_bytes,
            "agg_bytes": trans_bytes,
            "token_bytes": median(self.a2a) - 2 * trans_bytes,
            "plan_s_per_step": slowest(self.plan_s, self.ctx.group) / len(self.step_s),
            **layer,
        }


class _DeepSpeedRun(_Run):
    """DeepSpeed-MoE's layer in the same blocks: counts, drops and bytes from its capacity."""

    def _stats(self, block: _Block) -> dict[str, Any]:
        moe, group, tokens = block.moe, self.ctx.group, self.ctx.options["tokens"]
        routed = _gather(torch.bincount(moe.router.choices.flatten(), minlength=moe.experts), group)
        capacity = moe.capacity(tokens)
        kept = routed if capacity is None else routed.clamp(max=capacity)
        placement = Placement.blocked(moe.experts, group.size)
        computed, _ = device_loads(kept, placement)
        rows = moe.experts * (capacity if capacity is not None else int(routed.max()))
        return {
            "balance_degree": balance_degree(kept, placement),
            "max_mean": float(computed.max() / computed.mean().clamp(min=1e-9)),
            "dropped": int(routed.sum() - kept.sum()),
            "assignments": int(routed.sum()),
            "trans_bytes": 0,
            # dispatch and combine, forward and backward: [E, C, d] fp32 from every rank
            "a2a_bytes": 4 * group.size * rows * self.ctx.options["d_model"] * 4,
        }

    def _all_to_all_bytes(self, sent: float, stats: list[dict[str, Any]]) -> float:
        return float(sum(s["a2a_bytes"] for s in stats))

    def _layer(self, work: Any, cal: dict) -> dict[str, Any]:
        o, group, block = self.ctx.options, self.ctx.group, self.blocks[0]
        _set_routing([block], work, o["warmup"] + o["steps"], group.rank, o, self.k)
        x = torch.randn(1, o["tokens"], o["d_model"], generator=_generator(o["seed"], 98))
        x.requires_grad_(True)

        def fwd_bwd() -> None:
            block.moe(x).float().pow(2).mean().backward()

        seconds = median(sample(fwd_bwd, group, min_samples=o["layer_samples"], min_seconds=0))
        return {"layer_s": seconds, "model_layer_s": None, "model_rel_error": None}


def _deepspeed_blocks(ctx: RankContext, experts: int, k: int, drop: bool) -> list[_Block]:
    o = ctx.options
    torch.manual_seed(o["seed"])
    return [
        _Block(
            moe_deepspeed.DeepSpeedMoE(
                o["d_model"], o["ffn"], experts, k, o["capacity_factor"], drop, ctx.group.size
            ),
            o["d_model"],
        )
        for _ in range(o["layers"])
    ]


def _run_strategies(ctx: RankContext, work: Any, experts: int, k: int, cal: dict, peer: bool):
    """Every strategy (and DeepSpeed-MoE when `peer`), taking turns step by step:
    {strategy: figures}."""
    o = ctx.options
    runs = {s: _Run(ctx, k, _build(ctx, experts, k, s, cal)) for s in o["strategies"].split(",")}
    if peer:
        for name, drop in (("deepspeed_drop", True), ("deepspeed_dropless", False)):
            runs[name] = _DeepSpeedRun(ctx, k, _deepspeed_blocks(ctx, experts, k, drop))
    for step in range(o["warmup"] + o["steps"]):
        for run in runs.values():
            run.step(work, step)
    return {s: run.result(work, cal) for s, run in runs.items()}


def _layer_seconds(ctx: RankContext, moe: ExpertParallelMoE) -> tuple[float, torch.Tensor]:
    """Median seconds (slowest rank) of the layer's forward + backward alone on this rank's
    fixed batch [1, tokens, d_model], and the [D, E] counts it computed (kept)."""
    o, group = ctx.options, ctx.group
    x = torch.randn(1, o["tokens"], o["d_model"], generator=_generator(o["seed"], group.rank, 98))
    x.requires_grad_(True)

    def fwd_bwd() -> None:
        moe(x).float().pow(2).mean().backward()

    seconds = median(sample(fwd_bwd, group, min_samples=o["layer_samples"], min_seconds=0))
    return seconds, _gather(moe.router.last_kept, group)


def _time_layer(ctx: RankContext, block: _Block, work: Any, k: int, cal: dict) -> dict[str, Any]:
    """One MoE layer's forward + backward alone on the next step's routing (median of the
    slowest rank), next to the performance model's estimate for its counts and placement:
    refined with every calibrated term (`model_*`), and Pro-Prophet's original terms with the
    bandwidth of the even all-to-all and the throughput of all ranks at once (`paper_*`)."""
    o, group = ctx.options, ctx.group
    moe = block.moe
    schedule_transfers([moe])  # alone: it no longer issues the next layer's Trans
    _set_routing([block], work, o["warmup"] + o["steps"], group.rank, o, k)
    seconds, kept = _layer_seconds(ctx, moe)
    modelled = layer_time(
        kept, moe.placement, layer_cost(cal, moe.expert_size, cal["route_time_s"])
    )
    paper = layer_time(
        kept,
        moe.placement,
        LayerCost(
            token_bytes=moe.expert_size.token_bytes,
            expert_bytes=moe.expert_size.expert_bytes,
            bandwidth=cal["bandwidth_Bps"],
            throughput=cal["throughput_tokens_per_s"],
        ),
    )
    return {
        "layer_s": seconds,
        "model_layer_s": modelled.total,
        "model_terms": asdict(modelled),
        "model_rel_error": abs(modelled.total - seconds) / seconds,
        "paper_model_layer_s": paper.total,
        "paper_model_terms": asdict(paper),
        "paper_model_rel_error": abs(paper.total - seconds) / seconds,
        "replicated": list(moe.placement.replicated),
    }


def _deepspeed_peer(wanted: bool) -> str | None:
    """None when DeepSpeed-MoE runs (initialised here), else why it is skipped (printed)."""
    reason = moe_deepspeed.unavailable() if wanted else "DeepSpeed-MoE not run: peers=false"
    if reason is None:
        moe_deepspeed.init_deepspeed()
    else:
        print(f"moe bench: {reason}", flush=True)
    return reason


def run_rank(ctx: RankContext) -> dict[str, Any]:
    """Calibrate, then every workload × top-k × strategy."""
    o, group = ctx.options, ctx.group
    cal = _calibrate(ctx)
    skipped = _deepspeed_peer(o["peers"])
    workloads: dict[str, Any] = {}
    errors, paper_errors = [], []
    for name in o["workloads"].split(","):
        work, info = _workload(ctx, name)
        experts = info["experts"]
        if experts % group.size:
            raise ConfigError(f"{name}: {experts} experts cannot be split over {group.size} ranks")
        entry: dict[str, Any] = {"workload": info}
        for k in (int(v) for v in o["top_k"].split(",")):
            strategies = _run_strategies(ctx, work, experts, k, cal, skipped is None)
            modelled = [v for v in strategies.values() if v["model_rel_error"] is not None]
            errors += [v["model_rel_error"] for v in modelled]
            paper_errors += [v["paper_model_rel_error"] for v in modelled]
            entry[f"top{k}"] = {"strategies": strategies, "targets": targets(strategies)}
        workloads[name] = entry
    return {
        "calibration": cal,
        "workloads": workloads,
        "model_error": {
            "mean_relative_error": sum(errors) / len(errors),
            "count": len(errors),
            "paper_mean_relative_error": sum(paper_errors) / len(paper_errors),
        },
        "peers": {"deepspeed_moe": {"skipped": skipped} if skipped else {"ran": True}},
    }


def check(options: dict[str, Any]) -> None:
    """Known strategies and workloads, top-k in {1, 2}, positive sizes."""
    check_names(options, "strategies", STRATEGIES)
    check_names(options, "workloads", WORKLOADS)
    if not set(options["top_k"].split(",")) <= {"1", "2"}:
        raise ConfigError(f"top_k={options['top_k']!r}: use 1, 2 or 1,2")
    positive = (
        "experts",
        "layers",
        "d_model",
        "ffn",
        "tokens",
        "steps",
        "layer_samples",
        "recorded_steps",
        "recorded_batch",
        "prophet_replan",
    )
    bad = [key for key in positive if options[key] < 1]
    if bad or options["warmup"] < 0 or options["capacity_factor"] <= 0:
        raise ConfigError(f"{bad or 'warmup/capacity_factor'} must be positive (warmup >= 0)")
    if options["search_model"] not in SEARCH_MODELS:
        raise ConfigError(
            f"search_model={options['search_model']!r}: use one of {', '.join(SEARCH_MODELS)}"
        )
    recorded = "recorded" in options["workloads"].split(",")
    if recorded and not get_preset(options["recorded_model"]).is_moe:
        raise ConfigError(f"recorded_model={options['recorded_model']} has no MoE layer")


BENCHMARK = Benchmark(
    name="moe",
    summary="MoE expert-parallel load balancing: none / dropless / shadow / Pro-Prophet",
    describe=(
        "A stack of expert-parallel MoE layers (ep = all ranks), each followed by a non-MoE op, "
        "trained on routing forced from a workload (a Zipf-like drifting popularity, and the "
        "recorded routing of a real MoE-GPT run), top-1 and top-2, with no balancing (capacity "
        "drops), dropless, FasterMoE shadowing and Pro-Prophet placement. Reported: balance "
        "degree, max/mean load, drops, all_to_all bytes (tokens, Trans, Agg), step time and one "
        "layer's time next to Pro-Prophet's performance model. The physical limit of a layer is "
        "the busiest device's expert compute plus its received tokens over the link."
    ),
    table=table,
    plot=plot,
    run_rank=run_rank,
    check=check,
    headline=headline,
    key_numbers=key_numbers,
    options={
        "workloads": ",".join(WORKLOADS),
        "strategies": ",".join(STRATEGIES),
        "top_k": "1,2",
        "experts": 8,
        "layers": 2,
        "d_model": 128,
        "ffn": 512,
        "tokens": 4096,
        "capacity_factor": 1.25,
        "exponent": 1.2,
        "drift": 0.05,
        "locality": 0.5,
        "recorded_model": "moe-demo",
        "recorded_steps": 12,
        "recorded_batch": 8,
        "prophet_replan": 4,
        "alpha": 0.1,
        "trans_overlap": True,
        "search_model": "measured",
        "peers": True,
        "steps": 8,
        "warmup": 2,
        "layer_samples": 3,
        "lr": 1e-3,
        "seed": 0,
    },
    option_help={
        "workloads": "routing, comma-separated: skewed (Zipf-like, drifting), recorded (real)",
        "strategies": "load balancing strategies compared, comma-separated",
        "top_k": "experts per token, comma-separated: 1, 2 or 1,2",
        "experts": "experts per layer of the skewed workload (recorded: the recorded model's)",
        "layers": "MoE blocks in the stack",
        "d_model": "token width",
        "ffn": "hidden width of an expert",
        "tokens": "tokens per rank per step",
        "capacity_factor": "expert capacity over an even share of tokens (none drops the rest)",
        "exponent": "Zipf exponent of the skewed popularity (0: uniform)",
        "drift": "per-step change of each expert's log-weight (skewed)",
        "locality": "strength of each rank's own expert preference (skewed; 0: none)",
        "recorded_model": "MoE preset whose training routing `recorded` replays",
        "recorded_steps": "training steps recorded",
        "recorded_batch": "sequences per recorded step",
        "prophet_replan": "steps between Pro-Prophet's placement searches",
        "alpha": "Pro-Prophet's search stops below a load spread of alpha x tokens / experts",
        "trans_overlap": "Trans / Agg overlapped with compute (false: synchronous)",
        "search_model": "cost model of the shadow and prophet searches: measured or paper",
        "peers": "also DeepSpeed-MoE, where the peers extra is installed",
        "steps": "timed steps per strategy",
        "warmup": "untimed steps before them",
        "layer_samples": "timed samples of one layer's forward + backward alone",
        "lr": "SGD learning rate",
        "seed": "seed of the routing, weights and inputs",
    },
)

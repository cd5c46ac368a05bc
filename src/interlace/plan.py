"""The Plan: every parallel choice of a training run in one frozen, validated, serialisable value.

A Plan says how `world_size = dp · dp_shard · pp · cp · tp_size` ranks cooperate: data parallel
replicas `dp`, each sharded over `dp_shard` ranks (FSDP; `dp_shard > 1` with `dp > 1` is HSDP),
pipeline stages `pp`, context parallel degree `cp` (each sequence split over cp ranks),
tensor parallel degree (`tp` for Megatron-style 1D, or `tp3d = (x, y, z)`
for AxoNN-style 3D, with `sequence_parallel` for 1D), expert parallel degree `ep` (carved out of
the dp · dp_shard data-parallel ranks), pipeline `micro_batches`,
`schedule`, `recompute`, the `overlap` options, `grad_compression` and `moe_balance`.

`Plan.parse("dp=2,tp=2,tp_subbatches=2")` reads the CLI form; nested options are addressed by
their leaf name. `str(plan)` writes that form back (non-default fields only), so
`Plan.parse(str(plan)) == plan`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from interlace.divisors import check_divides, divisors
from interlace.errors import PlanError
from interlace.finite import check_finite_fields
from interlace.parallel.context import options as context_options
from interlace.parallel.context.options import CP_MODES
from interlace.parallel.pipeline.options import (
    PIPELINE_SCHEDULES,
    check_schedule,
    virtual_stages_for,
)
from interlace.parallel.tensor3d.options import check_grid
from interlace.plan_pending import fmt_tp3d, pending_rows

RECOMPUTE_MODES = ("none", "full", "selective", "stage-aware")
PIPELINE_ONLY_RECOMPUTE = ("stage-aware",)
GRAD_COMPRESSIONS = ("none", "sketch", "powersgd", "topk")
MOE_BALANCES = ("none", "dropless", "shadow", "prophet")


@dataclass(frozen=True)
class Overlap:
    """How communication is hidden under computation.

    dp_overlap: all-reduce gradient buckets during backward (DDP); False = one all-reduce after
        backward (the no-overlap baseline).
    dp_bucket_mb: DDP bucket size in MiB.
    tp_subbatches: sub-batches per micro-batch for overlapped tensor parallelism (1 = off).
    tp3d_prefetch: all-gather the next 3D linear's weight over tp3d's z while the current one
        computes (AxoNN); False = each gather when its layer needs it. Same bytes either way.
    tp_block_boundary: with tp_subbatches > 1, each layer's last forward all-reduce runs under
        the next layer's first compute; False = every layer waits for its own.
    """

    dp_overlap: bool = True
    dp_bucket_mb: float = 25.0
    tp_subbatches: int = 1
    tp3d_prefetch: bool = True
    tp_block_boundary: bool = True


@dataclass(frozen=True)
class Plan:
    """Every parallel choice of a run. Construct freely; `validate` decides whether it can run.

    dp: data-parallel replicas; dp_shard: ranks each replica's parameters, gradients and
    optimizer states are sharded over (torch's FSDP2); reshard_after_forward: with dp_shard > 1,
    free the gathered parameters after each block's forward and gather them again for its
    backward (False: keep them until backward, one all-gather less per block, more memory).
    cp: context parallel ranks each sequence is split over (zig-zag; `interlace.parallel.context`),
    attending by `cp_mode`: "ring" (key/value blocks around the ring) or "alltoall" (heads ↔
    sequence, cp dividing the heads).
    """

    dp: int = 1
    dp_shard: int = 1
    reshard_after_forward: bool = True
    pp: int = 1
    tp: int = 1
    tp3d: tuple[int, int, int] | None = None
    ep: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    micro_batches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    overlap: Overlap = field(default_factory=Overlap)
    grad_compression: str = "none"
    moe_balance: str = "none"

    # ----------------------------------------------------------------- derived sizes
    @property
    def tp_size(self) -> int:
        """Ranks in one tensor parallel group: `tp`, or x·y·z for 3D."""
        return math.prod(self.tp3d) if self.tp3d is not None else self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks, the ranks a global batch is split over: dp · dp_shard."""
        return self.dp * self.dp_shard

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: dp · dp_shard · pp · cp · tp_size (ep lives inside the
        data-parallel ranks)."""
        return self.dp_size * self.pp * self.cp * self.tp_size

    # ----------------------------------------------------------------- predicates
    @property
    def tensor_parallel(self) -> bool:
        """1D (Megatron) tensor parallelism: tp > 1."""
        return self.tp > 1

    @property
    def tensor3d_parallel(self) -> bool:
        """3D (AxoNN) tensor parallelism: a tp3d grid of more than one rank."""
        return self.tp3d is not None and self.tp_size > 1

    @property
    def expert_parallel(self) -> bool:
        """Experts placed by an expert-parallel layer: ep > 1, or a balancing strategy."""
        return self.ep > 1 or self.moe_balance != "none"

    @property
    def context_parallel(self) -> bool:
        """Context parallelism: each sequence split over cp > 1 ranks."""
        return self.cp > 1

    @property
    def pipelined(self) -> bool:
        """Pipeline parallelism: pp > 1."""
        return self.pp > 1

    @property
    def data_parallel(self) -> bool:
        """Data parallelism, replicated or sharded: dp · dp_shard > 1."""
        return self.dp_size > 1

    @property
    def sharded_data_parallel(self) -> bool:
        """Parameters, gradients and optimizer states sharded over data-parallel ranks (FSDP2):
        dp_shard > 1."""
        return self.dp_shard > 1

    @property
    def shard_ranks(self) -> int:
        """Ranks each replica's parameters, gradients and optimizer states are sharded over
        (FSDP2): dp_shard, times cp under context parallelism (its ranks hold the same
        parameters); 1 without sharded data parallelism."""
        return self.dp_shard * self.cp if self.sharded_data_parallel else 1

    @property
    def dp_overlapped(self) -> bool:
        """Gradients reduced during backward (DDP buckets): `dp_overlap`, and a model whose
        backward can carry it — no pipeline (several backward passes per step) and no 3D tensor
        parallelism (its Z reduce-scatters finish after backward). Sharded data parallelism
        reduces in its own way (FSDP2's reduce-scatters during backward)."""
        return (
            self.overlap.dp_overlap
            and not self.pipelined
            and self.tp3d is None
            and not self.sharded_data_parallel
        )

    def micro_batch_rows(self, global_batch: int, accumulation: int = 1) -> int:
        """Sequences of one pipeline micro-batch (one forward on one rank) when `global_batch`
        sequences per step are split over dp · dp_shard ranks, `accumulation` sequential
        micro-batches per rank and `micro_batches` pipeline micro-batches; PlanError, naming a
        fix, unless every split is even, including tp3d's z over the rows and `tp_subbatches`
        within them."""
        if global_batch < 1:
            raise PlanError(f"global batch {global_batch} must be a positive number of sequences")
        if global_batch % (self.dp_size * accumulation):
            steps = f" × {accumulation} accumulation steps" if accumulation > 1 else ""
            raise PlanError(
                f"global batch {global_batch} is not divisible by {self._dp_text}{steps}; use a "
                f"multiple of {self.dp_size * accumulation}"
            )
        rows = global_batch // (self.dp_size * accumulation)
        unit = self.batch_rows_unit
        if rows % unit:
            z = f" × tp3d z={self.tp3d[2]}" if self.tp3d is not None else ""
            raise PlanError(
                f"micro_batches={self.micro_batches}{z} split a rank's forward, but it holds "
                f"{rows} sequences (global batch {global_batch} / {self._dp_text}); use "
                f"micro_batches dividing {rows}, or a global batch that gives a multiple of "
                f"{unit}"
            )
        rows //= self.micro_batches
        if self.overlap.tp_subbatches > 1 and rows % self.overlap.tp_subbatches:
            raise PlanError(
                f"tp_subbatches={self.overlap.tp_subbatches} must divide the {rows} sequences "
                "of a micro-batch; use a divisor of them, or a larger global batch"
            )
        return rows

    @property
    def _dp_text(self) -> str:
        """How messages name the data-parallel ranks: 'dp=4', or 'dp·dp_shard=4' when sharded."""
        return f"dp·dp_shard={self.dp_size}" if self.sharded_data_parallel else f"dp={self.dp}"

    @property
    def batch_rows_unit(self) -> int:
        """The rows a rank's batch must be a multiple of: whole pipeline micro-batches, each
        split evenly over tp3d's z."""
        return self.micro_batches * (self.tp3d[2] if self.tp3d is not None else 1)

    # ----------------------------------------------------------------- validation
    def validate(self, world_size: int, spec: Any = None) -> Plan:
        """Check the plan can run on `world_size` ranks (and on model `spec`, a GPTConfig-like
        object with d_model, n_heads, vocab_size, n_layers, ffn_dim, n_experts). Returns self;
        raises PlanError naming the bad value and a valid alternative."""
        self._check_values()
        self._check_implemented()
        if self.world_size != world_size:
            raise PlanError(
                f"plan '{self}' needs {self.world_size} ranks but the world size is {world_size}; "
                f"{self._world_size_fix(world_size)}"
            )
        if spec is not None:
            self.check_model(spec)
        return self

    def _check_values(self) -> None:
        for name in ("dp", "dp_shard", "pp", "tp", "ep", "cp", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name}={value!r} must be a positive integer, e.g. {name}=1")
        check_finite_fields(self, PlanError)
        check_finite_fields(self.overlap, PlanError)
        if self.overlap.tp_subbatches < 1:
            raise PlanError(f"tp_subbatches={self.overlap.tp_subbatches} must be >= 1 (1 = off)")
        if self.overlap.dp_bucket_mb <= 0:
            raise PlanError(f"dp_bucket_mb={self.overlap.dp_bucket_mb} must be > 0, e.g. 25")
        if not isinstance(self.overlap.tp3d_prefetch, bool):
            raise PlanError(
                f"tp3d_prefetch={self.overlap.tp3d_prefetch!r} must be true or false, e.g. "
                "tp3d_prefetch=false"
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise PlanError(
                f"reshard_after_forward={self.reshard_after_forward!r} must be true or false, "
                "e.g. reshard_after_forward=false"
            )
        if not self.reshard_after_forward and not self.sharded_data_parallel:
            raise PlanError(
                "reshard_after_forward=false applies to sharded data parallelism; use it with "
                "dp_shard=2 or more, or drop it"
            )
        if not isinstance(self.overlap.tp_block_boundary, bool):
            raise PlanError(
                f"tp_block_boundary={self.overlap.tp_block_boundary!r} must be true or false, "
                "e.g. tp_block_boundary=false"
            )
        if not self.overlap.tp_block_boundary and self.overlap.tp_subbatches < 2:
            raise PlanError(
                "tp_block_boundary=false applies to overlapped tensor parallelism; use it with "
                "tp_subbatches=2 or more, or drop it"
            )
        if not self.overlap.tp3d_prefetch and self.tp3d is None:
            raise PlanError(
                "tp3d_prefetch=false applies to 3D tensor parallelism; use it with tp3d=XxYxZ "
                "or drop it"
            )
        if self.tp3d is not None:
            if len(self.tp3d) != 3 or any(not isinstance(d, int) or d < 1 for d in self.tp3d):
                raise PlanError(f"tp3d={self.tp3d!r} must be three positive integers, e.g. 2x2x1")
            if self.tp != 1:
                raise PlanError(
                    f"tp={self.tp} and tp3d={fmt_tp3d(self.tp3d)} are exclusive; use one of them"
                )
        _check_choice("schedule", self.schedule, PIPELINE_SCHEDULES)
        _check_choice("recompute", self.recompute, RECOMPUTE_MODES)
        _check_choice("grad_compression", self.grad_compression, GRAD_COMPRESSIONS)
        _check_choice("moe_balance", self.moe_balance, MOE_BALANCES)
        _check_choice("cp_mode", self.cp_mode, CP_MODES)
        if self.cp_mode != "ring" and not self.context_parallel:
            raise PlanError(f"cp_mode={self.cp_mode} applies to context parallelism; use cp > 1")
        if self.grad_compression != "none" and self.dp_size == 1:
            raise PlanError(
                f"grad_compression={self.grad_compression} compresses the data-parallel "
                "gradient all-reduce and needs dp > 1"
            )
        if self.grad_compression != "none" and self.sharded_data_parallel:
            raise PlanError(
                f"grad_compression={self.grad_compression} is a DDP comm hook; sharded data "
                f"parallelism (dp_shard={self.dp_shard}) reduce-scatters its gradients instead: "
                "use grad_compression=none, or dp_shard=1"
            )
        if self.grad_compression != "none" and not self.overlap.dp_overlap:
            raise PlanError(
                f"grad_compression={self.grad_compression} is a DDP comm hook and needs "
                "dp_overlap=true; drop dp_overlap=false"
            )
        if self.moe_balance in ("shadow", "prophet") and self.ep == 1:
            raise PlanError(
                f"moe_balance={self.moe_balance} places experts across an expert parallel "
                "group; use ep > 1 (ep divides dp)"
            )
        if self.pp == 1:
            for name, value, default in (
                ("micro_batches", self.micro_batches, 1),
                ("schedule", self.schedule, "1f1b"),
            ):
                if value != default:
                    raise PlanError(
                        f"{name}={value} applies to pipeline parallelism; use pp > 1 with it "
                        f"(gradient accumulation is the trainer's micro_batch)"
                    )
        if self.pp == 1 and self.recompute in PIPELINE_ONLY_RECOMPUTE:
            raise PlanError(
                f"recompute={self.recompute} sets a ratio per pipeline stage and needs pp > 1; "
                "use recompute=full or selective without a pipeline"
            )
        if self.pp > 1 and self.grad_compression != "none":
            raise PlanError(
                f"grad_compression={self.grad_compression} compresses DDP's all-reduce, which a "
                "pipeline does not use; use grad_compression=none with pp > 1"
            )
        only_1d = self.tp3d is None  # tp3d with these: the not-implemented table's
        if only_1d and self.overlap.tp_subbatches > 1 and (self.tp == 1 or self.sequence_parallel):
            raise PlanError(
                f"tp_subbatches={self.overlap.tp_subbatches} overlaps 1D tensor parallel "
                "all-reduces: it needs tp > 1 and no sequence_parallel"
            )
        if only_1d and self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence_parallel=true needs 1D tensor parallelism (tp > 1)")
        if self.dp_size % self.ep:
            raise PlanError(
                f"ep={self.ep} must divide {self._dp_text} (expert groups are carved "
                f"out of the data parallel ranks); use ep in {divisors(self.dp_size)}"
            )

    def _check_implemented(self) -> None:
        """The one table of combinations that are valid but not implemented yet
        (`plan_pending.pending_rows`)."""
        for active, what, fix in pending_rows(self):
            if active:
                raise PlanError(f"{what} is not implemented yet; use {fix}")

    def _world_size_fix(self, world_size: int) -> str:
        others = self.pp * self.cp * self.tp_size * self.dp_shard
        if world_size % others == 0:
            return f"use dp={world_size // others} for {world_size} ranks"
        return f"launch {self.world_size} ranks (--nproc {self.world_size})"

    def check_model(self, spec: Any) -> None:
        """PlanError unless the plan can split model `spec` (a GPTConfig-like object with
        d_model, n_heads, vocab_size, n_layers, ffn_dim, seq_len, n_experts): divisibility by
        the tensor degrees, enough layers for the stages, experts for ep."""
        tp = self.tp  # 1D; 1 under tp3d, whose grid _check_tp3d checks
        if self.tp3d is not None:
            self._check_tp3d(spec)
        if spec.d_model % spec.n_heads:
            raise PlanError(
                f"hidden size d_model={spec.d_model} is not divisible by n_heads={spec.n_heads}; "
                f"use n_heads in {divisors(spec.d_model)[-6:]}"
            )
        check_divides(
            tp,
            "tensor parallel degree",
            [
                ("n_heads", spec.n_heads),
                ("d_model", spec.d_model),
                ("ffn_dim", spec.ffn_dim),
                ("vocab_size", spec.vocab_size),
            ],
        )
        if self.sequence_parallel and spec.seq_len % tp:
            raise PlanError(
                f"seq_len={spec.seq_len} is not divisible by tp={tp}, as sequence_parallel "
                f"needs; use a seq_len that is a multiple of {tp}"
            )
        if spec.n_layers < self.pp:
            raise PlanError(
                f"pp={self.pp} exceeds n_layers={spec.n_layers}; use pp<={spec.n_layers}"
            )
        if self.pp > 1:
            self._check_pipeline(spec)
        if self.context_parallel:
            context_options.check_model(self, spec)
        if self.overlap.tp_subbatches > 1 and spec.n_experts:
            raise PlanError(
                f"tp_subbatches={self.overlap.tp_subbatches} with a Mixture-of-Experts model "
                "would change its routing capacity; use tp_subbatches=1"
            )
        if (self.ep > 1 or self.moe_balance != "none") and not spec.n_experts:
            raise PlanError(
                f"ep={self.ep}, moe_balance={self.moe_balance} need a Mixture-of-Experts model; "
                "the model has no experts (use e.g. --model moe-tiny)"
            )
        if self.ep > 1 and spec.n_experts % self.ep:
            raise PlanError(
                f"n_experts={spec.n_experts} is not divisible by ep={self.ep}; "
                f"use ep in {divisors(spec.n_experts)}"
            )

    def _check_tp3d(self, spec: Any) -> None:
        """The grid (x, y, z) splits this model (`tensor3d.options.check_grid`, the runtime's rule);
        experts are not split."""
        assert self.tp3d is not None
        if spec.n_experts:
            raise PlanError(
                f"tp3d={fmt_tp3d(self.tp3d)} does not split Mixture-of-Experts models; use a "
                "dense model or tp=N"
            )
        head_dim = spec.d_model // spec.n_heads
        check_grid(
            self.tp3d,
            spec.d_model,
            [("the model", spec.n_heads, head_dim, spec.n_heads)],
            [("the model", spec.ffn_dim)],
        )

    def _check_pipeline(self, spec: Any) -> None:
        """The schedule can run this many micro-batches over pp stages of this model."""
        check_schedule(
            self.schedule,
            self.pp,
            self.micro_batches,
            spec.n_layers,
            virtual_stages_for(self.schedule, None),
        )

    # ----------------------------------------------------------------- text and JSON
    @classmethod
    def parse(cls, text: str) -> Plan:
        """Read 'dp=2,tp=2,tp_subbatches=2' (nested options by leaf name). Empty text = defaults."""
        top: dict[str, Any] = {}
        nested: dict[str, Any] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            if "=" not in item:
                raise PlanError(f"plan item '{item}' is not field=value, e.g. 'dp=2'")
            key, raw = (s.strip() for s in item.split("=", 1))
            target = nested if key in _OVERLAP_FIELDS else top
            if key not in _OVERLAP_FIELDS and key not in _PLAN_FIELDS:
                raise PlanError(
                    f"unknown plan field '{key}'{_did_you_mean(key)}; valid fields: "
                    f"{', '.join(_ALL_FIELDS)}"
                )
            if key in target:
                raise PlanError(f"plan field '{key}' is given twice")
            target[key] = _parse_value(key, raw)
        return cls(**top, overlap=Overlap(**nested))

    @classmethod
    def parse_for(cls, text: str, world_size: int) -> Plan:
        """`parse(text)` with `dp` filling `world_size` when the text does not name it: on 4
        ranks, 'ep=4' reads as 'dp=4,ep=4' and '' as 'dp=4'. If pp · tp does not divide the
        world size, dp stays 1 and `validate` names the fix."""
        plan = cls.parse(text)
        named = any(item.split("=", 1)[0].strip() == "dp" for item in text.split(","))
        others = plan.pp * plan.cp * plan.tp_size * plan.dp_shard
        if named or world_size % others:
            return plan
        return dataclasses.replace(plan, dp=world_size // others)

    def __str__(self) -> str:
        items = [f"{k}={_fmt(v)}" for k, v in self._non_defaults().items()]
        return ",".join(items) if items else "dp=1"

    def _non_defaults(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "overlap":
                continue
            value = getattr(self, f.name)
            if value != _PLAN_DEFAULTS[f.name]:
                out[f.name] = value
        for f in dataclasses.fields(Overlap):
            value = getattr(self.overlap, f.name)
            if value != f.default:
                out[f.name] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (nested overlap options as a dict)."""
        data = dataclasses.asdict(self)
        data["tp3d"] = list(self.tp3d) if self.tp3d is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of to_dict; unknown keys raise PlanError."""
        data = dict(data)
        overlap = data.pop("overlap", {}) or {}
        unknown = (set(data) - set(_PLAN_FIELDS)) | (set(overlap) - set(_OVERLAP_FIELDS))
        if unknown:
            raise PlanError(f"unknown plan fields {sorted(unknown)}")
        if data.get("tp3d") is not None:
            data["tp3d"] = tuple(data["tp3d"])
        return cls(**data, overlap=Overlap(**overlap))

    def to_json(self) -> str:
        """JSON text of to_dict()."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of to_json."""
        return cls.from_dict(json.loads(text))


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan) if f.name != "overlap")
_OVERLAP_FIELDS = tuple(f.name for f in dataclasses.fields(Overlap))
_ALL_FIELDS = _PLAN_FIELDS + _OVERLAP_FIELDS
_PLAN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Plan) if f.name != "overlap"}
_FIELD_TYPES = {
    **{f.name: f.type for f in dataclasses.fields(Plan)},
    **{f.name: f.type for f in dataclasses.fields(Overlap)},
}


def _parse_value(key: str, raw: str) -> Any:
    kind = _FIELD_TYPES[key]
    try:
        if key == "tp3d":
            dims = tuple(int(d) for d in raw.lower().split("x"))
            if len(dims) != 3:
                raise ValueError
            return dims
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes")
    except ValueError:
        example = {"tp3d": "2x2x1", "int": "2", "float": "25", "bool": "true"}
        hint = example.get(key, example.get(kind, ""))
        raise PlanError(f"{key}={raw!r} is not a valid {kind}; e.g. {key}={hint}") from None
    return raw


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return fmt_tp3d(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, _ALL_FIELDS, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""

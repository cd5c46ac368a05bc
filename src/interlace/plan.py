"""The Plan: every parallel choice of a training run in one frozen, validated, serialisable value.

A Plan says how `world_size = dp · dp_shard · pp · cp · tp_size` ranks cooperate: data parallel
replicas `dp`, each sharded over `dp_shard` ranks (FSDP; `dp_shard > 1` with `dp > 1` is HSDP),
pipeline stages `pp`, context parallel degree `cp` (each sequence split over cp ranks),
tensor parallel degree (`tp` for Megatron-style 1D, or `tp3d = (x, y, z)`
for AxoNN-style 3D, with `sequence_parallel` for 1D), expert parallel degree `ep` (carved out of
the dp · dp_shard data-parallel ranks) and expert tensor parallel degree `etp` (1: experts
whole; tp: each expert split over the 1D tensor parallel group), pipeline `micro_batches`,
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

from interlace.divisors import divisors
from interlace.errors import PlanError, check_plan_choice
from interlace.finite import check_finite_fields
from interlace.parallel.dimensions import DIMENSIONS
from interlace.parallel.pipeline.options import virtual_stages_for
from interlace.plan_pending import fmt_tp3d, pending_rows

RECOMPUTE_MODES = ("none", "full", "selective", "stage-aware")


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
    sequence, cp dividing the heads). virtual_stages: pipeline stages per rank of
    schedule=interleaved (Megatron's virtual pipeline; 0: the schedule's own, 2 for interleaved
    and 1 for every other schedule).
    """

    dp: int = 1
    dp_shard: int = 1
    reshard_after_forward: bool = True
    pp: int = 1
    tp: int = 1
    tp3d: tuple[int, int, int] | None = None
    ep: int = 1
    etp: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 0
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

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank runs: `virtual_stages`, or the schedule's own where 0."""
        return virtual_stages_for(self.schedule, self.virtual_stages or None)

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
                f"global batch {global_batch} is not divisible by {self.dp_text}{steps}; use a "
                f"multiple of {self.dp_size * accumulation}"
            )
        rows = global_batch // (self.dp_size * accumulation)
        unit = self.batch_rows_unit
        if rows % unit:
            z = f" × tp3d z={self.tp3d[2]}" if self.tp3d is not None else ""
            raise PlanError(
                f"micro_batches={self.micro_batches}{z} split a rank's forward, but it holds "
                f"{rows} sequences (global batch {global_batch} / {self.dp_text}); use "
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
    def dp_text(self) -> str:
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
        """The sizes positive integers and every value finite, the recomputation mode known,
        then each dimension's own options (`parallel.dimensions`)."""
        for name in ("dp", "dp_shard", "pp", "tp", "ep", "etp", "cp", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name}={value!r} must be a positive integer, e.g. {name}=1")
        check_finite_fields(self, PlanError)
        check_finite_fields(self.overlap, PlanError)
        check_plan_choice("recompute", self.recompute, RECOMPUTE_MODES)
        for dimension in DIMENSIONS:
            dimension.check_values(self)

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
        d_model, n_heads, vocab_size, n_layers, ffn_dim, seq_len, n_experts): heads that divide
        the width, then what each dimension needs of it (`parallel.dimensions`): divisibility by
        the tensor degrees, enough layers for the stages, experts for ep, ..."""
        if spec.d_model % spec.n_heads:
            raise PlanError(
                f"hidden size d_model={spec.d_model} is not divisible by n_heads={spec.n_heads}; "
                f"use n_heads in {divisors(spec.d_model)[-6:]}"
            )
        for dimension in DIMENSIONS:
            dimension.check_model(self, spec)

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


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, _ALL_FIELDS, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""

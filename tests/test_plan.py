"""Plan: parsing, string and JSON round trips, and every PlanError case."""

from types import SimpleNamespace

import pytest

from interlace.errors import PlanError
from interlace.plan import Overlap, Plan


def spec(**overrides):
    base = dict(d_model=64, n_heads=4, ffn_dim=256, vocab_size=256, n_layers=2, n_experts=0)
    base.update(overrides)
    return SimpleNamespace(**base)


def test_parse_reads_fields_and_nested_leaf_names():
    plan = Plan.parse(
        "dp=2, pp=2,tp=2,micro_batches=8,schedule=gpipe,tp_subbatches=2,"
        "dp_overlap=false,dp_bucket_mb=4"
    )
    assert (plan.dp, plan.pp, plan.tp, plan.micro_batches) == (2, 2, 2, 8)
    assert plan.schedule == "gpipe"
    assert plan.overlap == Overlap(dp_overlap=False, dp_bucket_mb=4.0, tp_subbatches=2)


def test_parse_tp3d_and_sizes():
    plan = Plan.parse("dp=2,tp3d=2x2x1")
    assert plan.tp3d == (2, 2, 1)
    assert plan.tp_size == 4 and plan.world_size == 8


@pytest.mark.parametrize(
    "text",
    [
        "",
        "dp=4",
        "dp=2,pp=2,tp=2,micro_batches=4,schedule=gpipe",
        "dp=2,tp3d=2x1x2,dp_overlap=false",
        "ep=2,dp=4,moe_balance=prophet",
    ],
)
def test_str_parse_and_json_round_trip(text):
    plan = Plan.parse(text)
    assert Plan.parse(str(plan)) == plan
    assert Plan.from_json(plan.to_json()) == plan
    assert "\n" not in str(plan)


def test_str_is_readable_and_lists_non_defaults_only():
    assert str(Plan(dp=4)) == "dp=4"
    assert str(Plan()) == "dp=1"
    assert str(Plan.parse("dp=2,dp_overlap=false")) == "dp=2,dp_overlap=false"


@pytest.mark.parametrize(
    "text, words",
    [
        ("microbatches=2", ["unknown plan field 'microbatches'", "did you mean 'micro_batches'"]),
        ("dp", ["not field=value"]),
        ("dp=two", ["dp='two'", "int"]),
        ("tp3d=2x2", ["tp3d='2x2'"]),
        ("dp=2,dp=3", ["given twice"]),
        ("dp_overlap=maybe", ["dp_overlap='maybe'"]),
    ],
)
def test_parse_errors_name_the_bad_item(text, words):
    with pytest.raises(PlanError) as err:
        Plan.parse(text)
    for word in words:
        assert word in str(err.value)


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(PlanError, match=r"needs 2 ranks but the world size is 4; use dp=4"):
        Plan(dp=2).validate(4)


@pytest.mark.parametrize(
    "plan, words",
    [
        (Plan(dp=0), ["dp=0", "positive"]),
        (Plan(micro_batches=0), ["micro_batches=0"]),
        (Plan(schedule="zigzag"), ["schedule='zigzag'", "1f1b"]),
        (Plan(recompute="some"), ["recompute='some'", "stage-aware"]),
        (Plan(grad_compression="zip"), ["grad_compression='zip'", "sketch"]),
        (Plan(grad_compression="sketch"), ["grad_compression=sketch", "needs dp > 1"]),
        (Plan(sequence_parallel=True), ["sequence_parallel=true needs", "tp > 1"]),
        (Plan(moe_balance="prophet"), ["moe_balance=prophet places experts", "ep > 1"]),
        (Plan(overlap=Overlap(tp_subbatches=2)), ["tp_subbatches=2 overlaps", "tp > 1"]),
        (Plan(micro_batches=4), ["micro_batches=4 applies to pipeline parallelism", "pp > 1"]),
        (Plan(schedule="gpipe"), ["schedule=gpipe applies to pipeline parallelism"]),
        (Plan(virtual_stages=4), ["virtual_stages=4 applies to pipeline parallelism"]),
        (Plan(pp=2, micro_batches=2, virtual_stages=4), ["needs schedule=interleaved"]),
        (
            Plan(pp=2, micro_batches=2, schedule="interleaved", virtual_stages=1),
            ["at least 2 virtual stages", "virtual_stages=2 or more"],
        ),
        (Plan(pp=2, micro_batches=2, virtual_stages=-1), ["virtual_stages=-1 must be"]),
        (Plan(recompute="stage-aware"), ["recompute=stage-aware sets a ratio per pipeline stage"]),
        (Plan(dp=2, pp=2, grad_compression="sketch"), ["a pipeline does not use"]),
        (
            Plan(dp=2, grad_compression="sketch", overlap=Overlap(dp_overlap=False)),
            ["grad_compression=sketch is a DDP comm hook", "dp_overlap"],
        ),
        (Plan(moe_balance="magic"), ["moe_balance='magic'", "prophet"]),
        (Plan(tp=2, tp3d=(2, 1, 1)), ["exclusive"]),
        (Plan(tp3d=(2, 0, 1)), ["tp3d", "positive"]),
        (Plan(dp=4, ep=3), ["ep=3 must divide dp=4", "[1, 2, 4]"]),
        (Plan(dp=2, ep=2, etp=2), ["etp=2 splits each expert", "ep > 1 with tp > 1"]),
        (Plan(dp=2, tp=2, etp=2), ["etp=2 splits each expert", "etp = tp"]),
        (Plan(dp=2, ep=2, tp=4, etp=2), ["etp=2 must be 1", "etp=1 or etp=4"]),
        (Plan(dp=2, ep=2, tp3d=(2, 1, 1), etp=2), ["1D tensor parallel group"]),
        (Plan(tp3d=(2, 1, 2), sequence_parallel=True), ["over tp3d's y, which is 1", "y > 1"]),
        (Plan(etp=0), ["etp=0", "positive"]),
        (Plan(overlap=Overlap(tp_subbatches=0)), ["tp_subbatches=0"]),
        (Plan(overlap=Overlap(dp_bucket_mb=0)), ["dp_bucket_mb=0"]),
    ],
)
def test_invalid_values_are_rejected(plan, words):
    with pytest.raises(PlanError) as err:
        plan.validate(plan.world_size if plan.dp > 0 else 1)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "plan, word",
    [
        (Plan(cp=2, tp3d=(1, 2, 1)), "cp=2 with tp3d=1x2x1"),
        (Plan(cp=2, dp=2, ep=2), "cp=2 with expert parallelism (ep=2"),
    ],
)
def test_features_of_later_modules_say_not_implemented(plan, word):
    with pytest.raises(PlanError, match="not implemented yet") as err:
        plan.validate(plan.world_size)
    assert word in str(err.value)


def test_hidden_not_divisible_by_heads():
    with pytest.raises(PlanError, match=r"d_model=66 is not divisible by n_heads=4"):
        Plan(dp=2).validate(2, spec(d_model=66))


def test_spec_checks_against_tensor_degree():
    # The spec check runs on the tensor degree independently of the implemented-features gate.
    with pytest.raises(
        PlanError, match=r"n_heads=6 is not divisible by the tensor parallel degree 4"
    ):
        Plan(tp=4).check_model(spec(d_model=96, n_heads=6))
    with pytest.raises(PlanError, match=r"vocab_size=250 is not divisible"):
        Plan(tp=4).check_model(spec(vocab_size=250))
    with pytest.raises(PlanError, match=r"pp=4 exceeds n_layers=2"):
        Plan(pp=4).check_model(spec())
    with pytest.raises(PlanError, match=r"n_experts=6 is not divisible by ep=4"):
        Plan(dp=4, ep=4).check_model(spec(n_experts=6))


def test_valid_plan_returns_itself():
    plan = Plan(dp=4)
    assert plan.validate(4, spec()) is plan


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(PlanError, match="unknown plan fields"):
        Plan.from_dict({"dp": 1, "zz": 2})


def test_sequence_parallel_needs_seq_len_divisible_by_tp():
    plan = Plan(tp=4, sequence_parallel=True)
    with pytest.raises(PlanError, match=r"seq_len=66 is not divisible by tp=4"):
        plan.validate(4, spec(seq_len=66))
    assert plan.validate(4, spec(seq_len=64)) is plan


def test_expert_parallelism_needs_a_moe_model():
    with pytest.raises(PlanError, match=r"need a Mixture-of-Experts model"):
        Plan(dp=2, ep=2).validate(2, spec())
    assert Plan(dp=4, ep=2, moe_balance="prophet").validate(4, spec(n_experts=4))


def test_pipeline_plans_are_checked_against_the_model():
    moe = Plan(dp=2, ep=2, pp=2, micro_batches=2)
    assert moe.validate(4, spec(n_experts=4)) is moe  # MoE layers in every stage
    with pytest.raises(PlanError):  # 1F1B needs at least as many micro-batches as stages
        Plan(pp=4, micro_batches=2).validate(4, spec(n_layers=4))
    plan = Plan(pp=2, micro_batches=4, schedule="shifted", recompute="stage-aware")
    assert plan.validate(2, spec(n_layers=4)) is plan

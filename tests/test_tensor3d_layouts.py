"""3D tensor parallelism inside pipeline stages (z = 1, and z > 1: the last stage's copy of the
tied embedding summed over z), under sharded data parallelism (z = 1) and with recomputed blocks
(z > 1), each also with the sequence split over y (`sequence_parallel`) or in overlapped
sub-batches (`tp_subbatches`; with z > 1 one gathered block per linear shared by
the sub-batches): the Trainer's losses
and gradient norms over four steps equal one process's; under FSDP2 with z > 1 the weight
prefetch over z serves each block's linears but its first."""

from unittest import mock

import pytest

from interlace import comm
from interlace.models.presets import get_preset
from interlace.plan import Plan
from interlace.testing import run_ranks
from test_context_parallel import STEPS, _steps


@pytest.fixture(scope="module")
def serial() -> dict:
    return _steps("dp=1", 1)


@pytest.mark.parametrize(
    "plan_text",
    [
        "pp=2,tp3d=2x1x1,micro_batches=2",
        pytest.param("pp=2,tp3d=1x2x1,micro_batches=4,schedule=gpipe", marks=pytest.mark.slow),
        "pp=2,tp3d=2x1x1,micro_batches=2,schedule=shifted,recompute=full",
        "pp=2,tp3d=1x1x2,micro_batches=2",
        "pp=2,tp3d=1x1x2,micro_batches=2,schedule=gpipe,tp3d_prefetch=false",
        "pp=2,tp3d=1x2x1,micro_batches=2,sequence_parallel=true",
        "pp=2,tp3d=1x2x1,micro_batches=2,sequence_parallel=true,schedule=shifted,recompute=full",
    ],
)
def test_3d_tensor_parallel_stages_equal_serial(serial, plan_text):
    # the last stage's copy of the tied embedding holds the embedding's gradient
    expected = {**serial["grads"], "lm_head.weight": serial["grads"]["wte.weight"]}
    for rank, result in enumerate(run_ranks(4, _steps, plan_text, 4)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert result["comm"]["pp"] > 0
        assert {name for name in result["grads"]} <= set(expected)


@pytest.mark.parametrize(
    "plan_text",
    [
        pytest.param("pp=2,tp3d=2x1x1,micro_batches=2,tp_subbatches=2", marks=pytest.mark.slow),
        pytest.param("dp=2,tp3d=1x2x1,tp_subbatches=2,recompute=full", marks=pytest.mark.slow),
        pytest.param(
            "dp_shard=2,tp3d=2x1x1,tp_subbatches=2,recompute=selective", marks=pytest.mark.slow
        ),
        "dp_shard=2,tp3d=1x1x2,tp_subbatches=2,recompute=selective",
        pytest.param("pp=2,tp3d=1x1x2,micro_batches=2,tp_subbatches=2", marks=pytest.mark.slow),
        pytest.param("tp3d=2x1x2,tp_subbatches=2,recompute=full", marks=pytest.mark.slow),
        pytest.param(
            "pp=2,tp3d=1x2x1,micro_batches=2,tp_subbatches=2,schedule=shifted,recompute=full",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_overlapped_3d_sub_batches_equal_serial(serial, plan_text):
    # each layer's sub-batches take turns at the x and y all-reduces, the last one's left to
    # the next layer; in stages, with data parallel ranks, FSDP2 and recomputed sub-batches
    for rank, result in enumerate(run_ranks(4, _steps, plan_text, 4)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert any("2 interleaved sub-batches" in line for line in result["report"]), rank


@pytest.mark.parametrize(
    ("plan_text", "axis"),
    [
        ("dp_shard=2,tp3d=2x1x1", "tp_x"),
        pytest.param("dp_shard=2,tp3d=1x2x1", "tp_y", marks=pytest.mark.slow),
        ("dp_shard=2,tp3d=1x1x2,tp3d_prefetch=false", "tp_z"),
        ("dp_shard=2,tp3d=1x2x1,sequence_parallel=true", "tp_y"),
    ],
)
def test_sharded_3d_tensor_parallel_equals_serial(serial, plan_text, axis):
    # with z > 1 each weight's Z-reduced gradient reaches FSDP2 inside the backward
    for rank, result in enumerate(run_ranks(4, _steps, plan_text, 4)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert result["comm"][axis] > 0
        assert any("sharded over dp_shard=2" in line for line in result["report"])
        assert result["grads"].keys() == serial["grads"].keys()


@pytest.mark.parametrize(
    "plan_text",
    [
        "tp3d=1x1x2,recompute=full",
        "tp3d=1x1x2,recompute=selective",
        pytest.param("tp3d=1x1x2,recompute=selective,tp3d_prefetch=false", marks=pytest.mark.slow),
        pytest.param("pp=2,tp3d=1x1x2,micro_batches=2,recompute=selective", marks=pytest.mark.slow),
        "tp3d=1x2x2,recompute=selective,tp3d_prefetch=false,sequence_parallel=true",
        pytest.param(
            "tp3d=1x2x2,recompute=selective,sequence_parallel=true", marks=pytest.mark.slow
        ),
    ],
)
def test_recomputed_3d_blocks_with_z_equal_serial(serial, plan_text):
    # the recomputed forward gathers each weight over z again, in the forward's order (and
    # the sequence over y again under sequence parallelism); under the weight prefetch a
    # block's gathers run ahead in the forward and not in the recomputation, out of sight of
    # selective recomputation's cache, which must find the same operations in both
    world_size = Plan.parse(plan_text).world_size
    for rank, result in enumerate(run_ranks(world_size, _steps, plan_text, world_size)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert result["comm"]["tp_z"] > 0


def _z_gathers(plan_text: str) -> dict:
    """`_steps` of `plan_text` on 4 ranks, with the weight all-gathers over z counted: issued
    ahead (async) or on the spot."""
    counts = {True: 0, False: 0}
    issue = comm.all_gather

    def counted(output, shard, group, async_op=False, meter=None):
        if group.name == "tp_z":
            counts[async_op] += 1
        return issue(output, shard, group, async_op=async_op, meter=meter)

    with mock.patch.object(comm, "all_gather", counted):
        result = _steps(plan_text, 4)
    return {**result, "ahead": counts[True], "on the spot": counts[False]}


@pytest.mark.parametrize(
    "plan_text",
    [
        "dp_shard=2,tp3d=1x1x2",
        pytest.param("dp_shard=2,tp3d=1x1x2,recompute=selective", marks=pytest.mark.slow),
    ],
)
def test_sharded_3d_grid_with_z_prefetches_within_each_block(serial, plan_text):
    # FSDP2 gathers a block's pieces in its pre-forward (pre-backward, or the recomputed
    # forward's): the z prefetch serves the block's next linear, and each block's first
    # gather of either half of the pass is on the spot. The first step records the order:
    # every gather on the spot
    layers, linears = get_preset("tiny").n_layers, 6
    backward = 2 * linears if "selective" in plan_text else linears  # recomputed, then back
    per_step = layers * (linears + backward)
    recorded = STEPS - 1
    for rank, result in enumerate(run_ranks(4, _z_gathers, plan_text)):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert result["ahead"] == recorded * (per_step - 2 * layers), rank
        assert result["on the spot"] == per_step + recorded * 2 * layers, rank

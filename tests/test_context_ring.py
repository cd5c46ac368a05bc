"""Context parallelism's pieces: the zig-zag split of a sequence, ring attention and all-to-all
attention, against plain causal attention over the whole sequence (outputs and the gradients
of q, k and v, fp32, at 2 and 4 ranks, with and without grouped-query attention)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from interlace.comm import CommMeter, Group
from interlace.parallel.context import ring as ring_module
from interlace.parallel.context.alltoall import alltoall_attention
from interlace.parallel.context.ring import (
    merge,
    pair_backward,
    pair_forward,
    pair_kernels,
    ring_attention,
    visibility,
)
from interlace.parallel.context.zigzag import (
    shard_sequence,
    zigzag_chunks,
    zigzag_positions,
)
from interlace.testing import run_ranks


def test_shards_put_back_together_give_the_sequence_and_its_positions():
    x = torch.arange(2 * 16).view(2, 16)
    shards = [shard_sequence(x, 4, r) for r in range(4)]
    assert shards[0].tolist()[0] == [0, 1, 14, 15]  # chunks 0 and 7 of 8
    assert shards[3].tolist()[0] == [6, 7, 8, 9]  # chunks 3 and 4
    order = torch.cat([zigzag_positions(16, 4, r) for r in range(4)])  # all-to-all's reorder
    assert torch.equal(torch.cat(shards, dim=1)[:, order.argsort()], x)
    for r in range(4):
        assert torch.equal(zigzag_positions(16, 4, r), shards[r][0])


def test_every_rank_attends_to_the_same_number_of_keys():
    cp, chunk = 4, 8
    work = []
    for rank in range(cp):
        queries = zigzag_positions(2 * cp * chunk, cp, rank)
        work.append(int((queries + 1).sum()))  # query at position p sees p + 1 keys
    assert max(work) == min(work)
    contiguous = [sum(p + 1 for p in range(r * 2 * chunk, (r + 1) * 2 * chunk)) for r in range(cp)]
    assert max(contiguous) > 3 * min(contiguous)  # what the zig-zag order avoids


def test_a_sequence_two_cp_chunks_cannot_split_is_refused():
    with pytest.raises(ValueError, match=r"seq_len=12 .* divisible by 8"):
        zigzag_positions(12, 4, 0)


def test_chunk_pairs_are_seen_whole_or_causally():
    assert [visibility(2, b) for b in (1, 2, 3)] == ["full", "causal", "none"]
    assert zigzag_chunks(3, 1) == (1, 4)


def test_merging_two_key_blocks_by_log_sum_exp_is_attention_over_both():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    k2, v2 = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out, lse = merge(*pair_forward(q, k, v, "full", 0.5), *pair_forward(q, k2, v2, "full", 0.5))
    expected, expected_lse = pair_forward(
        q, torch.cat([k, k2], 2), torch.cat([v, v2], 2), "full", 0.5
    )
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)


ATTENTIONS = {"ring": ring_attention, "alltoall": alltoall_attention}


def _against_serial(mode: str, heads: int, kv_heads: int) -> dict:
    """This rank's `mode` attention output and q/k/v gradients against those of causal SDPA
    over the whole sequence (same seed everywhere), each taken at this rank's zig-zag share."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = Group("cp", dist.group.WORLD, cp, rank)
    torch.manual_seed(0)
    T = 8 * cp
    q = torch.randn(2, heads, T, 16, requires_grad=True)
    k = torch.randn(2, kv_heads, T, 16, requires_grad=True)
    v = torch.randn(2, kv_heads, T, 16, requires_grad=True)
    dout = torch.randn(2, heads, T, 16)
    repeat = heads // kv_heads
    serial = F.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=True
    )
    serial.backward(dout)
    shard = lambda t: shard_sequence(t.detach(), cp, rank, dim=2)  # noqa: E731
    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    meter = CommMeter()
    original = ring_module.comm.meter
    ring_module.comm.meter = meter
    try:
        out = ATTENTIONS[mode](*mine, group)
        out.backward(shard(dout))
    finally:
        ring_module.comm.meter = original
    return {
        "out": (out.detach(), shard(serial)),
        "grads": [(m.grad, shard(t.grad)) for m, t in zip(mine, (q, k, v), strict=True)],
        "calls": {op: entry["calls"] for op, entry in meter.snapshot()["cp"].items()},
    }


def _assert_equal_to_serial(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        torch.testing.assert_close(*result["out"], rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        for name, (got, expected) in zip("qkv", result["grads"], strict=True):
            torch.testing.assert_close(
                got, expected, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: grad of {name}"
            )


@pytest.mark.parametrize(("cp", "heads", "kv_heads"), [(2, 4, 4), (4, 4, 4), (2, 4, 2), (4, 4, 1)])
def test_ring_attention_equals_causal_attention_over_the_whole_sequence(cp, heads, kv_heads):
    results = run_ranks(cp, _against_serial, "ring", heads, kv_heads)
    _assert_equal_to_serial(results)
    # forward: cp − 1 key/value passes; backward: cp − 1 more and cp of the gradients
    assert all(result["calls"] == {"ring_pass": 3 * cp - 2} for result in results)


@pytest.mark.parametrize(("cp", "heads", "kv_heads"), [(2, 4, 4), (4, 4, 4), (2, 4, 2)])
def test_alltoall_attention_equals_causal_attention_over_the_whole_sequence(cp, heads, kv_heads):
    results = run_ranks(cp, _against_serial, "alltoall", heads, kv_heads)
    _assert_equal_to_serial(results)
    # q, k, v and the output exchanged once each way, and their gradients back
    assert all(result["calls"] == {"all_to_all": 8} for result in results)


def test_alltoall_needs_cp_to_divide_the_heads():
    group = Group("cp", None, 4, 0)
    q = torch.zeros(1, 4, 8, 2)
    with pytest.raises(ValueError, match=r"the 2 key/value heads over cp=4 .* cp_mode=ring"):
        alltoall_attention(q, torch.zeros(1, 2, 8, 2), torch.zeros(1, 2, 8, 2), group)


def _fused_pair_equals_plain_softmax(device: str, dtype: torch.dtype, tolerance: dict) -> None:
    """A device's fused pair kernels (`pair_kernels`) against the plain float32 softmax pair on
    the same inputs: output, log-sum-exp and (dq, dk, dv), each pair visibility."""
    for how in ("causal", "full"):
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(2, 4, 32, 64, device=device) for _ in range(4))
        q, k, v = (t.to(dtype) for t in (q, k, v))
        forward, backward = pair_kernels(torch.device(device))
        out, lse = forward(q, k, v, how, 0.3)
        assert out.dtype == lse.dtype == torch.float32  # merged in float32 whatever the inputs
        torch.testing.assert_close((out, lse), pair_forward(q, k, v, how, 0.3), **tolerance)
        delta = (dout * out).sum(-1)
        fused = backward(q, k, v, how, 0.3, lse, dout, delta, out)
        plain = pair_backward(q, k, v, how, 0.3, lse, dout, delta)
        torch.testing.assert_close(fused, plain, **tolerance)


def test_the_plain_softmax_pair_equals_the_fused_cpu_kernel():
    # the fused kernel runs on the CPU, the plain softmax where no fused kernel is wired
    _fused_pair_equals_plain_softmax("cpu", torch.float32, {})


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [
        (torch.float32, {"rtol": 1e-4, "atol": 1e-4}),
        # bf16 inputs: 8 significant bits, each value rounded by up to 2^-9 in the kernel
        (torch.bfloat16, {"rtol": 2e-2, "atol": 2e-2}),
    ],
)
def test_the_cuda_pair_kernels_equal_the_plain_softmax(dtype, tolerance):
    _fused_pair_equals_plain_softmax("cuda", dtype, tolerance)

"""Sharded data parallelism on the CPU prefetches: each block's parameters are all-gathered
asynchronously, the next block's issued before the current block computes (FSDP2's own prefetch
needs a second CUDA stream)."""

import torch.distributed as dist

from interlace.mesh import build_mesh
from interlace.plan import Plan
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run
from interlace.train_config import TrainConfig

# the name FSDP2's default all-gather calls on torch.distributed (renamed in torch 2.13)
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def _gathers_seen_by_each_block() -> tuple[list[int], list[bool]]:
    config = TrainConfig(model="tiny", steps=2, global_batch=4, eval_every=0, out=None)
    plan = Plan.parse("dp_shard=2")
    trainer = Trainer(prepare_run(config, plan, 2), build_mesh(plan))
    issued: list[bool] = []  # async_op of every all-gather, in order
    gather = getattr(dist, GATHER)

    def recorded(*args, async_op=False, **kwargs):
        issued.append(async_op)
        return gather(*args, async_op=async_op, **kwargs)

    seen: list[int] = []  # gathers issued when each block starts computing
    for block in trainer.model.blocks:
        block.register_forward_pre_hook(lambda *_: seen.append(len(issued)))
    setattr(dist, GATHER, recorded)
    try:
        trainer.train_step()
    finally:
        setattr(dist, GATHER, gather)
    return seen, issued


def test_each_block_is_gathered_asynchronously_a_block_ahead():
    seen, issued = run_ranks(2, _gathers_seen_by_each_block)[0]
    # the root, block 0 and block 1 (prefetched) before block 0 computes; nothing new before
    # block 1 does
    assert seen == [3, 3]
    assert issued[1:3] == [True, True]  # the blocks' gathers (the root's first, kept whole)
    assert all(issued[1:])  # backward's re-gathers too

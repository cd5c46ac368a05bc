"""Overlapped Trans/Agg equal the synchronous path: the same loss, every gradient and the same
collectives and bytes; only the order moves (the next layer's Trans right after a dispatch)."""

import copy

import torch
import torch.distributed as dist

from helpers import assert_grads_close
from interlace import comm
from interlace.comm import CommMeter, Group
from interlace.loss import causal_lm_loss
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.moe.balance import Prophet
from interlace.parallel.expert.apply import parallelize_experts
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.testing import run_ranks

GPT = GPTConfig(
    vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, n_experts=4, top_k=2,
    moe_every=1, dropless=True, d_ff=32,
)  # fmt: skip
# replicas pay; priced alike in both paths (left to follow the layer, they would differ)
COMPUTE_BOUND = Prophet(replan_every=1, bandwidth=1e9, flops=1e6, overlap=True)


class _OrderMeter(CommMeter):
    """A meter that also keeps the order of its calls as (op, payload bytes)."""

    def reset(self) -> None:
        """Forget the counters and the order."""
        super().reset()
        self.order: list[tuple[str, int]] = []

    def record(self, op: str, group: Group, payload: int, seconds: float | None = None) -> None:
        """Count the call and note it."""
        super().record(op, group, payload, seconds)
        self.order.append((op, payload))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _overlapped_and_synchronous_steps(steps: int = 3):
    """`steps` SGD steps of a 2-MoE-layer GPT over ep = every rank, overlapped and not."""
    group = Group("ep", dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    torch.manual_seed(0)
    model = build_model(GPT)
    models = {flag: copy.deepcopy(model) for flag in (True, False)}
    for flag, m in models.items():
        parallelize_experts(m, group, COMPUTE_BOUND, overlap=flag)
    gen = torch.Generator().manual_seed(10 + group.rank)
    meter, default = _OrderMeter(), comm.meter
    rows = []
    for _ in range(steps):
        idx, targets = (
            torch.randint(0, GPT.vocab_size, (3, GPT.seq_len), generator=gen) for _ in "xy"
        )
        row = {}
        for flag, m in models.items():
            comm.meter = meter
            meter.reset()
            try:
                loss = causal_lm_loss(m(idx), targets, m)
                forward = list(meter.order)
                loss.backward()
            finally:
                comm.meter = default
            layers = [b for b in m.modules() if isinstance(b, ExpertParallelMoE)]
            row[flag] = {
                "loss": loss.detach(),
                "grads": _grads(m),
                "forward": forward,
                "backward": meter.order[len(forward) :],
                "snapshot": meter.snapshot(),
                "replicated": [layer.placement.replicated for layer in layers],
            }
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.5 * p.grad
            m.zero_grad(set_to_none=True)
        rows.append(row)
    return rows


def _moved_trans(forward: list[tuple[str, int]], second_replicated: bool):
    """The synchronous forward order [Trans₀?, gather₀, dispatch₀, combine₀, Trans₁?, gather₁,
    dispatch₁, combine₁] with Trans₁ moved to right after dispatch₀, as overlap issues it."""
    if not second_replicated:
        return forward
    first, second = (i for i, (op, _) in enumerate(forward) if op == "all_gather")
    trans = forward[second - 1]
    assert trans[0] == "all_to_all"
    moved = forward[: second - 1] + forward[second:]
    return [*moved[: first + 2], trans, *moved[first + 2 :]]


def test_overlapped_trans_and_agg_equal_the_synchronous_path():
    moved_somewhere = False
    for rows in run_ranks(4, _overlapped_and_synchronous_steps):
        for row in rows:
            overlapped, synchronous = row[True], row[False]
            assert overlapped["replicated"] == synchronous["replicated"]
            torch.testing.assert_close(overlapped["loss"], synchronous["loss"], atol=1e-6, rtol=0)
            assert overlapped["grads"].keys() == synchronous["grads"].keys()
            assert_grads_close(overlapped["grads"], synchronous["grads"])
            assert overlapped["snapshot"] == synchronous["snapshot"]  # calls and bytes per op
            assert sorted(overlapped["backward"]) == sorted(synchronous["backward"])
            second = bool(synchronous["replicated"][1])
            expected = _moved_trans(synchronous["forward"], second)
            assert overlapped["forward"] == expected
            moved_somewhere |= second
    assert moved_somewhere

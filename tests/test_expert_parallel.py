"""Expert parallelism equals the single-device MoE layer: output, loss and every gradient.

Each rank routes its own tokens. The reference is the full `MoELayer` run on that rank's tokens
alone (what plain data parallelism computes); an expert's gradient on its owner must equal the
sum over the expert group of the reference gradients, every other gradient the rank's own.
"""

import copy

import pytest
import torch
import torch._dynamo  # DDP imports it lazily: once here beats once per forked rank
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from helpers import assert_grads_close, per_expert
from interlace import comm
from interlace.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from interlace.comm import Group
from interlace.loss import causal_lm_loss
from interlace.mesh import build_mesh
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.moe import MoELayer
from interlace.moe.balance import Prophet, Shadow
from interlace.parallel.expert.apply import parallelize_experts
from interlace.parallel.expert.grads import (
    expert_norm_share,
    expert_parameter_names,
    reduce_expert_gradients,
)
from interlace.parallel.expert.groups import build_expert_groups
from interlace.parallel.expert.layer import ExpertParallelMoE
from interlace.parallel.grad_norm import clip_grad_norm_
from interlace.plan import Plan
from interlace.testing import run_ranks

D_MODEL, FFN, TOKENS = 8, 16, 12
ATOL = 1e-6
MLP_PARAMS = ("up.weight", "up.bias", "down.weight", "down.bias")


def _world_group() -> Group:
    return Group("ep", dist.group.WORLD, dist.get_world_size(), dist.get_rank())


def _moe(n_experts: int, top_k: int, dropless: bool = True, skew: float = 0.0) -> MoELayer:
    """The same layer on every rank; `skew` tilts the router towards expert 0."""
    torch.manual_seed(0)
    layer = MoELayer(D_MODEL, FFN, n_experts, top_k=top_k, capacity_factor=1.0, dropless=dropless)
    with torch.no_grad():
        layer.router.proj.weight.normal_(0.0, 0.5)
        layer.router.proj.weight[0, 0] += skew
    return layer


def _rank_inputs(rank: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens [2, TOKENS/2, d] (requiring grad) and a fixed output weighting."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, TOKENS // 2, D_MODEL, generator=gen)
    x[..., 0] += shift
    return x.requires_grad_(), torch.randn(2, TOKENS // 2, D_MODEL, generator=gen)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _ep_and_reference(n_experts: int, top_k: int, dropless: bool):
    group = _world_group()
    reference = _moe(n_experts, top_k, dropless)
    parallel = ExpertParallelMoE(copy.deepcopy(reference), group)
    x, w = _rank_inputs(group.rank)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = parallel(x), reference(x_ref)
    ((out * w).sum() + parallel.aux_loss).backward()
    ((out_ref * w).sum() + reference.aux_loss).backward()
    return {
        "dropped": int((~reference.router(x_ref.reshape(-1, D_MODEL)).keep).sum()),
        "out": (out.detach(), out_ref.detach()),
        "x_grad": (x.grad, x_ref.grad),
        "aux": (parallel.aux_loss.detach(), reference.aux_loss.detach()),
        "grads": _grads(parallel),
        "ref_grads": per_expert(_grads(reference)),
    }


def _check_against_reference(results, n_experts: int):
    """Outputs, input and router grads per rank; expert grads on owners = Σ reference grads."""
    world = len(results)
    for r in results:
        for name in ("out", "x_grad", "aux"):
            torch.testing.assert_close(*r[name], atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(
            r["grads"]["router.proj.weight"], r["ref_grads"]["router.proj.weight"]
        )
    for rank, r in enumerate(results):
        local = range(rank * n_experts // world, (rank + 1) * n_experts // world)
        owned = {n for n in r["grads"] if n.startswith("experts.")}
        assert owned == {f"experts.{e}.{p}" for e in local for p in MLP_PARAMS}
        got = {name: r["grads"][name] for name in owned}
        expected = {name: sum(other["ref_grads"][name] for other in results) for name in owned}
        assert_grads_close(got, expected, what=f"rank {rank}")


@pytest.mark.parametrize("world, n_experts", [(2, 4), (4, 4)])
@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_expert_parallel_equals_single_device_layer(world, n_experts, top_k):
    results = run_ranks(world, _ep_and_reference, n_experts, top_k, True)
    _check_against_reference(results, n_experts)


def test_per_rank_capacity_drops_what_the_local_layer_drops():
    # capacity_factor=1 with top-2 over 4 experts drops some assignments on each rank; under
    # EP the capacity is per rank, so the local layer on the rank's tokens is the reference.
    results = run_ranks(2, _ep_and_reference, 4, 2, False)
    assert all(r["dropped"] > 0 for r in results)
    _check_against_reference(results, 4)


def _metered_bytes():
    group = _world_group()
    parallel = ExpertParallelMoE(_moe(4, 2), group)
    x, w = _rank_inputs(group.rank)
    comm.meter.reset()
    out = parallel(x)
    forward = comm.meter.snapshot()["ep"]
    (out * w).sum().backward()
    total = comm.meter.snapshot()["ep"]
    counts = parallel.routing_history[-1]
    local = slice(group.rank * 2, group.rank * 2 + 2)
    return forward, total, int(counts[group.rank].sum()), int(counts[:, local].sum())


def test_metered_all_to_all_bytes_equal_the_exchanged_token_rows():
    for forward, total, sent_rows, received_rows in run_ranks(2, _metered_bytes):
        row = D_MODEL * 4  # fp32
        assert sent_rows == TOKENS * 2  # dropless top-2: every assignment travels
        # forward: dispatch sends this rank's rows, combine sends back what it received
        assert forward["all_to_all"]["calls"] == 2
        assert forward["all_to_all"]["bytes"] == (sent_rows + received_rows) * row
        assert forward["all_gather"]["bytes"] == 4 * 8  # one [E] int64 count vector
        # backward: the same two exchanges in reverse
        assert total["all_to_all"]["calls"] == 4
        assert total["all_to_all"]["bytes"] == 2 * (sent_rows + received_rows) * row


def _routing_statistics():
    group = _world_group()
    parallel = ExpertParallelMoE(_moe(4, 2), group, history=2)
    x, _ = _rank_inputs(group.rank)
    local_counts = []
    for _ in range(3):
        parallel(x)
        local_counts.append(parallel.last_tokens_per_expert.clone())
    parallel.eval()
    parallel(x)  # evaluation adds nothing to the history
    return list(parallel.routing_history), local_counts


def test_routing_history_holds_the_gathered_source_by_expert_counts():
    results = run_ranks(2, _routing_statistics)
    for history, _ in results:
        assert len(history) == 2  # maxlen
        for i, matrix in enumerate(history):
            assert matrix.shape == (2, 4) and matrix.dtype == torch.long
            for rank, (_, local_counts) in enumerate(results):
                assert matrix[rank].tolist() == local_counts[i + 1].tolist()
            assert int(matrix.sum()) == 2 * TOKENS * 2  # two ranks, top-2


def _balanced_steps(balance, steps: int = 3):
    """`steps` SGD steps of the skewed layer under `balance` and under plain dropless."""
    group = _world_group()
    layers = {
        name: ExpertParallelMoE(_moe(4, 2, skew=3.0), group, b)
        for name, b in (("dropless", "dropless"), ("balanced", balance))
    }
    rows = []
    for step in range(steps):
        x, w = _rank_inputs(group.rank + 10 * step, shift=1.5)
        row = {}
        for name, layer in layers.items():
            comm.meter.reset()
            loss = (layer(x.detach().requires_grad_()) * w).sum() + layer.aux_loss
            loss.backward()
            row[name] = {
                "loss": loss.detach(),
                "grads": _grads(layer),
                "placement": layer.placement,
                "summary": layer.balance_summary(),
                "counts": layer.routing_history[-1],
                "a2a_bytes": comm.meter.snapshot()["ep"]["all_to_all"]["bytes"],
            }
            with torch.no_grad():
                for p in layer.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        rows.append(row)
    return rows


FAST_LINK = {"replan_every": 1, "bandwidth": 1e9, "flops": 1e6}  # compute-bound: replicas pay


@pytest.mark.parametrize("balance", [Prophet(**FAST_LINK), Shadow(**FAST_LINK)])
def test_replicating_experts_keeps_loss_and_gradients_of_dropless(balance):
    results = run_ranks(4, _balanced_steps, balance)
    replicated_somewhere = False
    for rank, rows in enumerate(results):
        for row in rows:
            plain, balanced = row["dropless"], row["balanced"]
            torch.testing.assert_close(balanced["loss"], plain["loss"], atol=1e-5, rtol=1e-5)
            assert balanced["grads"].keys() == plain["grads"].keys()
            assert_grads_close(balanced["grads"], plain["grads"], what=f"rank {rank}")
            replicated_somewhere |= bool(balanced["placement"].replicated)
            assert balanced["a2a_bytes"] == _expected_a2a_bytes(rank, balanced)
            assert plain["a2a_bytes"] == _expected_a2a_bytes(rank, plain)
        assert rows[0]["balanced"]["placement"].replicated == ()  # nothing to plan from yet
    assert replicated_somewhere
    last = results[0][-1]["balanced"]
    assert 0 in last["placement"].replicated  # expert 0 is the hot one
    assert last["summary"]["replicated"] == list(last["placement"].replicated)
    assert last["summary"]["balance_degree"] < last["summary"]["balance_degree_base"]


def _expected_a2a_bytes(rank: int, row) -> int:
    """Token rows that travel (those of replicated experts stay home), both ways, forward and
    backward; plus Trans (owner → replicas) and Agg (replicas → owner) of flat parameters."""
    placement, counts = row["placement"], row["counts"]
    sent = torch.where(placement.replica_mask(), 0, counts)
    local = slice(rank, rank + 1)  # 4 experts on 4 ranks
    token_rows = int(sent[rank].sum()) + int(sent[:, local].sum())
    numel = 2 * D_MODEL * FFN + FFN + D_MODEL
    out = sum(len(placement.replicas[e]) for e in placement.replicated if e == rank)
    into = sum(rank in placement.replicas[e] for e in placement.replicated)
    return 2 * token_rows * D_MODEL * 4 + (out + into) * numel * 4


GPT = GPTConfig(
    vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2, n_experts=4, top_k=2,
    moe_every=1, dropless=True, d_ff=32,
)  # fmt: skip


def _data_and_expert_parallel_steps(balance, steps: int = 2):
    """dp=4, ep=2 training steps of a GPT under DDP (expert parameters left out, reduced over
    ep_dp instead; gradients clipped) beside the serial model on the whole batch; returns
    per-step differences."""
    mesh = build_mesh(Plan(dp=4, ep=2))
    ep, ep_dp = build_expert_groups(mesh, 2)
    torch.manual_seed(0)
    model = build_model(GPT)
    serial = copy.deepcopy(model)
    report = parallelize_experts(model, ep, balance)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, expert_parameter_names(model)
    )
    ddp = DistributedDataParallel(model, process_group=mesh.group("dp").pg)
    gen = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(steps):
        idx = torch.randint(0, GPT.vocab_size, (4, 2, GPT.seq_len), generator=gen)
        targets = torch.randint(0, GPT.vocab_size, (4, 2, GPT.seq_len), generator=gen)
        loss = causal_lm_loss(ddp(idx[mesh.rank("dp")]), targets[mesh.rank("dp")], model)
        loss.backward()
        reduce_expert_gradients(model, ep_dp, dp_size=4)
        norm = clip_grad_norm_(model.parameters(), 0.5, [expert_norm_share(model, ep)])
        # serial: data parallelism averages the per-rank losses (each with its own aux loss)
        serial_loss = (
            sum(causal_lm_loss(serial(i), t, serial) for i, t in zip(idx, targets, strict=True)) / 4
        )
        serial_loss.backward()
        serial_norm = torch.nn.utils.clip_grad_norm_(serial.parameters(), 0.5)
        serial_grads = per_expert(_grads(serial))
        grads = _grads(model)
        expected = {n: serial_grads[n] for n in grads}
        assert_grads_close(grads, expected, what=f"rank {mesh.rank('dp')}, step {len(rows)}")
        rows.append(
            {
                "loss": (_dp_mean(loss.detach(), mesh), serial_loss.detach()),
                "norm": (norm, serial_norm),
                "experts": sorted({n.split(".")[4] for n in _grads(model) if ".experts." in n}),
                "replicated": [b.mlp.placement.replicated for b in model.blocks],
            }
        )
        for module in (model, serial):
            with torch.no_grad():
                for p in module.parameters():
                    p -= 0.5 * p.grad
            module.zero_grad(set_to_none=True)
    return report, rows


def _dp_mean(value: torch.Tensor, mesh) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, group=mesh.group("dp").pg)
    return value / mesh.size("dp")


@pytest.mark.parametrize("balance", ["dropless", Prophet(**FAST_LINK)])
def test_data_and_expert_parallel_training_equals_serial(balance):
    results = run_ranks(4, _data_and_expert_parallel_steps, balance)
    for rank, (report, rows) in enumerate(results):
        name = balance if isinstance(balance, str) else balance.name
        assert len(report) == 2 and report[0].endswith(f"balance={name}")
        for row in rows:
            torch.testing.assert_close(*row["loss"], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(*row["norm"], atol=1e-6, rtol=1e-5)
            # ep index = dp index % 2 (rank = dp index here): experts 0-1 or 2-3
            assert row["experts"] == (["0", "1"] if rank % 2 == 0 else ["2", "3"])
    if not isinstance(balance, str):
        assert any(any(r["replicated"]) for r in results[0][1])


def _group_members():
    mesh = build_mesh(Plan(dp=4, tp=2, ep=2))
    ep, ep_dp = build_expert_groups(mesh, 2)
    return [(g.name, g.size, g.rank, dist.get_process_group_ranks(g.pg)) for g in (ep, ep_dp)]


def test_expert_groups_split_each_dp_group_into_consecutive_chunks():
    # rank = dp_index · 2 + tp_index; dp groups {0,2,4,6}, {1,3,5,7}
    for rank, (ep, ep_dp) in enumerate(run_ranks(8, _group_members)):
        dp_index, tp_index = rank // 2, rank % 2
        chunk = dp_index // 2
        assert ep == ("ep", 2, dp_index % 2, [(chunk * 2 + i) * 2 + tp_index for i in range(2)])
        assert ep_dp == ("ep_dp", 2, chunk, [(j * 2 + dp_index % 2) * 2 + tp_index for j in (0, 1)])


def _save_after_one_step(root):
    """One AdamW step of an ep=2 GPT (same batch on both ranks, so the replicated parameters
    stay identical), then a checkpoint; returns this rank's parameters and expert Adam state."""
    group = _world_group()
    torch.manual_seed(0)
    model = build_model(GPT)
    parallelize_experts(model, group, "dropless")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(
        0, GPT.vocab_size, (2, GPT.seq_len), generator=torch.Generator().manual_seed(3)
    )
    causal_lm_loss(model(idx), idx, model).backward()
    optimizer.step()
    save_checkpoint(root, 1, model, optimizer, {"run": "ep"}, keep=1)
    names = dict(model.named_parameters())
    moments = {n: optimizer.state[p]["exp_avg"] for n, p in names.items() if ".experts." in n}
    return {n: p.detach() for n, p in names.items()}, moments


def test_expert_parallel_checkpoint_loads_into_the_serial_model(tmp_path):
    # global expert indices make every expert's key unique: the shards of both ranks together
    # are the serial model's state dict, optimizer state included
    results = run_ranks(2, _save_after_one_step, tmp_path)
    torch.manual_seed(1)
    serial = build_model(GPT)
    optimizer = torch.optim.AdamW(serial.parameters(), lr=1e-2)
    load_checkpoint(resolve_checkpoint(tmp_path), serial, optimizer, {"run": "ep"})
    named = dict(serial.named_parameters())
    params = per_expert({n: p.detach() for n, p in named.items()})
    serial_moments = per_expert({n: optimizer.state[p]["exp_avg"] for n, p in named.items()})
    for rank_params, moments in results:
        for name, value in rank_params.items():
            torch.testing.assert_close(params[name], value, atol=0, rtol=0)
        for name, value in moments.items():
            torch.testing.assert_close(serial_moments[name], value)

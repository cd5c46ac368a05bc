"""Mixture-of-Experts blocks with fused experts under 1D tensor parallelism: found by structure
(not by class or parameter names), sharded as recorded, refused with a clear error where not
supported. Parallel equals serial for HF Mixtral and Qwen2-MoE is in test_tensor_parallel.py."""

import re

import pytest
import torch
from torch import nn

from hf_models import needs_hf, tiny_hf_model
from interlace.errors import PlanError
from interlace.mesh import build_mesh
from interlace.parallel.detect import find_expert_blocks, find_structure
from interlace.parallel.fits import check_fits
from interlace.parallel.parallelize import parallelize
from interlace.parallel.tensor.moe import check_expert_blocks
from interlace.parallel.tensor.shard import shard_spec
from interlace.plan import Plan
from interlace.testing import run_ranks

D, VOCAB, E, F = 64, 256, 4, 96


class _Scores(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(E, D))


class _Bank(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_out = nn.Parameter(torch.randn(E, D, F))  # down first: order must not matter
        self.w_in = nn.Parameter(torch.randn(E, 2 * F, D))


class _Sparse(nn.Module):
    """The structure of a fused-expert block under names no model uses."""

    def __init__(self, odd: bool = False):
        super().__init__()
        self.bank = _Bank()
        self.pick = _Scores()
        if odd:
            self.extra = nn.Linear(D, 3)


class _LM(nn.Module):
    def __init__(self, odd: bool = False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.ffn = _Sparse(odd)
        self.out = nn.Linear(D, VOCAB, bias=False)


def test_a_fused_expert_block_is_found_by_its_shapes_alone():
    (block,) = find_structure(_LM()).expert_blocks
    assert (block.name, block.router, block.experts) == ("ffn", "pick", "bank")
    assert (block.gate_up, block.down, block.n_experts, block.ffn_dim) == ("w_in", "w_out", E, F)
    odd = find_structure(_LM(odd=True))  # an unknown extra child: left whole, replicated
    assert not odd.expert_blocks and odd.experts == ["ffn"]


@needs_hf
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hf_sparse_blocks_are_expert_blocks(kind):
    model = tiny_hf_model(kind, D, 2, VOCAB, positions=64)
    blocks = find_expert_blocks(model)
    assert [b.name for b in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(
        (b.router, b.experts, b.n_experts, b.ffn_dim) == ("gate", "experts", E, F) for b in blocks
    )
    shared = blocks[0].shared
    if kind == "qwen2_moe":
        assert shared.name == "model.layers.0.mlp.shared_expert" and shared.ffn_dim == 128
        assert blocks[0].shared_gate == "shared_expert_gate"
    else:
        assert shared is None and blocks[0].shared_gate is None
    structure = find_structure(model)
    assert structure.expert_blocks == blocks and structure.experts == [b.name for b in blocks]


@needs_hf
def test_widths_not_divisible_and_subbatches_are_refused_before_any_change():
    model = tiny_hf_model("qwen2_moe", D, 1, VOCAB, positions=64, ffn=90)
    structure = find_structure(model)
    message = (
        "model.layers.0.mlp.experts: ffn width=90 is not divisible by the tensor parallel degree "
        "4; use a degree in [1, 2, 3, 5, 6, 9, 10, 15]"
    )
    with pytest.raises(PlanError, match=re.escape(message)):
        check_expert_blocks(model, structure, 4, 1)
    with pytest.raises(PlanError, match="tp_subbatches=2 is not implemented"):
        check_expert_blocks(model, structure, 2, 2)
    check_expert_blocks(model, structure, 2, 1)


@needs_hf
def test_expert_and_tensor_parallelism_keep_fused_experts_whole_for_expert_parallelism():
    # (test_train_hf.py trains these layouts as one process)
    model = tiny_hf_model("qwen2_moe", D, 1, VOCAB, positions=64, shared_ffn=90)
    for sp in (False, True):
        check_fits(model, Plan(dp=2, ep=2, tp=2, sequence_parallel=sp))
    with pytest.raises(PlanError, match="ffn width"):  # the shared expert is still split
        check_fits(model, Plan(dp=2, ep=2, tp=4))


def _sharded_shapes(kind: str) -> dict:
    model = tiny_hf_model(kind, D, 1, VOCAB, positions=64)
    plan = Plan(tp=2)
    par = parallelize(model, plan, build_mesh(plan))
    return {
        n: (tuple(p.shape), shard_spec(p)) for n, p in par.model.named_parameters() if ".mlp." in n
    } | {"report": [line for line in par.report if "mlp" in line]}


@needs_hf
def test_shard_specs_are_recorded_for_experts_and_the_shared_expert():
    shapes = run_ranks(2, _sharded_shapes, "qwen2_moe")[1]
    prefix = "model.layers.0.mlp."
    gate_up, down = shapes[prefix + "experts.gate_up_proj"], shapes[prefix + "experts.down_proj"]
    assert gate_up[0] == (E, F, D) and (gate_up[1].dim, gate_up[1].segments) == (1, 2)
    assert down[0] == (E, D, F // 2) and down[1].dim == 2
    assert shapes[prefix + "gate.weight"] == ((E, D), None)
    assert shapes[prefix + "shared_expert_gate.weight"] == ((1, D), None)
    assert shapes[prefix + "shared_expert.up_proj.weight"][0] == (64, D)
    assert shapes[prefix + "shared_expert.down_proj.weight"][0] == (D, 64)
    assert any("one all-reduce of the block output" in line for line in shapes["report"])

"""Which parameters AdamW decays (`interlace.optim.build_optimizer`): matrices only, the same
ones whether an MoE layer holds its experts stacked or one module each."""

import torch
from torch import nn

from interlace.models.gpt import build_model
from interlace.models.presets import PRESETS
from interlace.moe.experts import STORED_AS
from interlace.optim import build_optimizer


def _decayed(module: nn.Module) -> set[str]:
    optimizer = build_optimizer(module, lr=1e-3, weight_decay=0.1)
    ids = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    return {name for name, p in module.named_parameters() if id(p) in ids}


def test_stacked_experts_decay_their_weights_not_their_biases_as_expert_modules_do():
    torch.manual_seed(0)
    model = build_model(PRESETS["moe-tiny"])
    layer = next(m for m in model.modules() if hasattr(m, "router"))
    stacked = _decayed(layer.experts)
    as_modules = _decayed(nn.ModuleList(layer.experts.expert(e) for e in range(len(layer.experts))))
    assert stacked == {"up_weight", "down_weight"}
    assert {n.split(".", 1)[1] for n in as_modules} == {STORED_AS[n] for n in stacked}
    assert {n.split(".", 1)[0] for n in as_modules} == {str(e) for e in range(len(layer.experts))}
    everywhere = _decayed(model)
    assert {n for n in everywhere if ".experts." in n} == {
        n for n in everywhere if n.endswith(("experts.up_weight", "experts.down_weight"))
    }
    assert all(p.dim() >= 2 for n, p in model.named_parameters() if n in everywhere)
    assert any("router" in n for n in everywhere)  # a router's [E, d] is a matrix

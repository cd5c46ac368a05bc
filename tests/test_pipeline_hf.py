"""Pipeline parallelism of Hugging Face decoders: GPT-2 (tied head, position embedding), Llama
(untied, rotary, grouped-query attention) and the Mixture-of-Experts Mixtral and Qwen2-MoE
(fused experts; Qwen2-MoE's shared expert) built from tiny configs run through
`PipelineRunner`; the loss and every gradient equal the serial HF model's, parameter by
parameter under HF names."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_grads_close
from hf_models import needs_hf, tiny_hf_model
from interlace.errors import PlanError
from interlace.mesh import build_mesh
from interlace.parallel.pipeline.hf_stage import DecoderParts, HFStage
from interlace.parallel.pipeline.runner import PipelineRunner
from interlace.plan import Plan
from interlace.testing import run_ranks

pytestmark = needs_hf

D, VOCAB, LAYERS = (
    32,
    96,
    4,
)  # VOCAB differs from every feed-forward width (the head is found by shape)
ROWS, LENGTH = 8, 16
TIED = {"gpt2": {"lm_head.weight": "transformer.wte.weight"}}


def _build(kind: str) -> nn.Module:
    return tiny_hf_model(kind, D, LAYERS, VOCAB, positions=32, ffn=64)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x and next-token targets y [ROWS, LENGTH] cut from one token sequence."""
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _serial(kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = _build(kind)
    x, y = _batch()
    loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
    # the runner's loss on pre-shifted targets is HF's own causal-LM loss
    hf_loss = model(torch.cat([x, y[:, -1:]], dim=1), labels=torch.cat([x, y[:, -1:]], dim=1)).loss
    torch.testing.assert_close(loss, hf_loss, atol=1e-6, rtol=0)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipeline(kind: str, plan_text: str) -> dict:
    plan = Plan.parse(plan_text)
    runner = PipelineRunner(_build(kind), plan, build_mesh(plan))
    loss = runner.step(*_batch())
    return {
        "loss": float(loss),
        "grads": {n: p.grad.clone() for n, p in runner.named_parameters()},
        "keys": set(runner.state_dict()),
        "checkpointed": set().union(*(stage.checkpointed for stage in runner.stages)),
    }


CASES = [
    ("gpt2", "pp=2,micro_batches=4,schedule=1f1b"),
    ("gpt2", "pp=2,micro_batches=4,schedule=gpipe,recompute=full"),
    ("llama", "pp=2,micro_batches=4,schedule=1f1b"),
    ("llama", "pp=2,micro_batches=4,schedule=gpipe,recompute=full"),
    ("llama", "pp=2,micro_batches=4,schedule=1f1b,recompute=selective"),
    ("llama", "pp=2,micro_batches=4,schedule=shifted,recompute=stage-aware"),
    ("gpt2", "pp=2,micro_batches=4,schedule=interleaved"),
    ("gpt2", "pp=4,micro_batches=4,schedule=1f1b"),
    ("mixtral", "pp=2,micro_batches=4,schedule=1f1b,recompute=full"),
    ("qwen2_moe", "pp=2,micro_batches=4,schedule=shifted,recompute=stage-aware"),
]


@pytest.mark.parametrize(("kind", "plan_text"), CASES)
def test_hf_pipeline_loss_and_every_gradient_equal_serial(kind, plan_text):
    plan = Plan.parse(plan_text)
    serial_loss, serial = _serial(kind)
    results = run_ranks(plan.pp, _pipeline, kind, plan_text, timeout=60)
    seen: set[str] = set()
    for i, rank in enumerate(results):
        assert rank["loss"] == pytest.approx(serial_loss, abs=1e-5)
        assert rank["keys"] == set(rank["grads"])  # HF state-dict names, one per parameter
        expected = {name: serial[TIED.get(kind, {}).get(name, name)] for name in rank["grads"]}
        assert_grads_close(rank["grads"], expected, what=f"rank {i}")
        seen |= {TIED.get(kind, {}).get(name, name) for name in rank["grads"]}
    assert seen == set(serial)
    if kind == "gpt2":  # the tied head's copy sits on the last rank, the embedding on the first
        assert "lm_head.weight" in results[-1]["grads"]
        assert "transformer.wte.weight" in results[0]["grads"]
    checkpointed = sum(len(rank["checkpointed"]) for rank in results)
    every = {"none": 0, "full": LAYERS, "selective": LAYERS}
    assert checkpointed == every.get(plan.recompute, checkpointed)
    assert plan.recompute == "none" or checkpointed > 0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_stages_in_a_row_equal_the_models_own_forward(kind, attention):
    """Causal masking, positions and rotary embeddings as in HF's forward, under either
    attention implementation (eager needs the explicit causal mask)."""
    model = _build(kind)
    model.config._attn_implementation = attention
    parts = DecoderParts.read(model)
    stages = [
        HFStage(model, parts, range(0, 1), first=True, last=False, checkpointed=frozenset({0})),
        HFStage(model, parts, range(1, 3), first=False, last=False),
        HFStage(model, parts, range(3, 4), first=False, last=True, head_copy=parts.tied),
    ]
    x, _ = _batch()
    h = x
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, model(x).logits, atol=1e-5, rtol=0)


def test_found_parts_and_refused_structures():
    gpt2 = DecoderParts.read(_build("gpt2"))
    assert (gpt2.embedding, gpt2.positions, gpt2.layers, gpt2.norm, gpt2.head, gpt2.tied) == (
        "transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head", True
    )  # fmt: skip
    llama = DecoderParts.read(_build("llama"))
    assert (llama.rotary, llama.positions, llama.tied) == ("model.rotary_emb", None, False)

    odd = _build("gpt2")
    odd.transformer.scale = nn.Linear(D, D)  # an unknown module outside the layers
    with pytest.raises(PlanError, match=r"'transformer.scale' \(Linear\) outside the layer list"):
        DecoderParts.read(odd)
    windowed = _build("llama")
    windowed.config.layer_types = ["sliding_attention", "full_attention"] * 2
    with pytest.raises(PlanError, match="sliding_attention"):
        DecoderParts.read(windowed)
    headless = _build("llama").model  # the base model: no LM head
    with pytest.raises(PlanError, match="found no LM head"):
        DecoderParts.read(headless)

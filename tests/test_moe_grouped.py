"""The grouped expert compute (`interlace.moe.grouped`) equals the per-expert loop it replaced:
`MoELayer`'s output and every gradient (input, router, each expert) against the old forward,
one feed-forward per expert on its slices of the stacked weights, written out here, with
capacity drops, dropless, top-1 and top-2, and an expert receiving no token; fused SwiGLU
experts (expert parallelism's `FusedExpert`) against one call each; the stacked weights' cast
to the compute dtype, one copy each way. Each on `F.grouped_mm` and
on the padded `bmm` fallback (forced); fp32 on the CPU, where `F.grouped_mm` runs eagerly on
the tests' aligned widths. A compiled layer with capacity is one graph that no new routing
recompiles."""

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_close
from interlace.moe import grouped
from interlace.moe.grouped import cast_weight, grouped_mlp, stack_as, stack_parameters
from interlace.moe.layer import MoELayer
from interlace.parallel.expert.fused import FusedExpert

D, FFN, TOKENS = 16, 32, 24


@pytest.fixture(params=["grouped_mm", "bmm"])
def path(request, monkeypatch):
    """The grouped path under test: `F.grouped_mm` (skipped where it does not apply), or the
    padded bmm fallback, forced."""
    if request.param == "bmm":
        monkeypatch.setattr(grouped, "grouped_mm_applies", lambda *operands: False)
    elif not grouped.grouped_mm_applies(torch.zeros(1, D), torch.zeros(2, FFN, D)):
        pytest.skip("F.grouped_mm does not run float32 here")
    return request.param


def _expert(layer: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert `e` of `layer` on x [n, d], an MLP on its slices of the stacked weights."""
    w = layer.experts
    h = F.gelu(F.linear(x, w.up_weight[e], w.up_bias[e]), approximate="tanh")
    return F.linear(h, w.down_weight[e], w.down_bias[e])


def _loop_forward(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The forward before grouping: the kept assignments sorted by expert, one MLP each."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens)
    layer.aux_loss = routing.aux_loss
    token_index = torch.arange(tokens.shape[0]).unsqueeze(1).expand_as(routing.expert_index)
    kept_expert = routing.expert_index[routing.keep]
    order = torch.argsort(kept_expert, stable=True)
    kept_token = token_index[routing.keep][order]
    kept_gate = routing.gate_weight[routing.keep][order]
    counts = torch.bincount(kept_expert, minlength=len(layer.experts)).tolist()
    out = torch.zeros_like(tokens)
    tokens_of, gates_of = kept_token.split(counts), kept_gate.split(counts)
    for e, (token, gate) in enumerate(zip(tokens_of, gates_of, strict=True)):
        out.index_add_(0, token, _expert(layer, e, tokens[token]) * gate.unsqueeze(1))
    return out.view_as(x)


def _layer(n_experts: int, top_k: int, dropless: bool, avoid: int | None = None) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(D, FFN, n_experts, top_k=top_k, capacity_factor=0.75, dropless=dropless)
    with torch.no_grad():
        layer.router.proj.weight.normal_(0.0, 0.5)
        layer.router.proj.weight[0, 0] += 2.0  # crowd expert 0: capacity drops
    if avoid is not None:  # no token ever chooses expert `avoid`
        layer.router.choose = lambda probs: (
            probs.index_fill(1, torch.tensor(avoid), -1.0).topk(top_k, dim=-1).indices
        )
    return layer


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch x [2, TOKENS/2, D] leaning towards expert 0, and output weights of its shape."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, TOKENS // 2, D, generator=gen)
    x[..., 0] += 1.0
    return x, torch.randn(2, TOKENS // 2, D, generator=gen)


def _run(layer: MoELayer, forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(output, {input and every parameter: gradient}) of one forward and backward."""
    x, w = _inputs()
    x.requires_grad_()
    out = forward(layer, x)
    ((out * w).sum() + layer.aux_loss).backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return out.detach(), {"input": x.grad, **grads}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dropless", [False, True])
def test_grouped_layer_equals_the_per_expert_loop(path, top_k, dropless):
    layer = _layer(4, top_k, dropless)
    keep = layer.router(_inputs()[0].view(-1, D)).keep
    assert dropless == bool(keep.all()), "capacity must drop assignments, dropless none"
    reference = copy.deepcopy(layer)
    out, grads = _run(layer, MoELayer.__call__)
    expected, expected_grads = _run(reference, _loop_forward)
    assert_grads_close(out, expected, what="output")
    assert_grads_close(grads, expected_grads)


@pytest.mark.parametrize("dropless", [False, True])
def test_an_expert_without_tokens_gets_a_zero_gradient(path, dropless):
    layer = _layer(4, 2, dropless, avoid=2)
    reference = copy.deepcopy(layer)
    out, grads = _run(layer, MoELayer.__call__)
    assert layer.last_tokens_per_expert[2] == 0
    expected, expected_grads = _run(reference, _loop_forward)
    assert_grads_close(out, expected, what="output")
    assert_grads_close(grads, expected_grads)
    assert not grads["experts.up_weight"][2].any()


@pytest.mark.parametrize("rows", [None, 9])
def test_fused_experts_equal_a_loop_and_rows_past_the_counts_get_zero(path, rows):
    # SwiGLU experts without bias (HF Mixtral's, under expert parallelism): one FusedExpert call
    # per expert against the grouped call `FusedExpertParallel.run_experts` makes; the last 3
    # rows belong to no expert
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor([4, 0, 9, 5])
    names = ("gate_up_proj", "down_proj")
    experts = [
        FusedExpert(
            torch.randn(2 * FFN, D, generator=gen),
            torch.randn(D, FFN, generator=gen),
            names,
            F.silu,
        )
        for _ in counts
    ]
    x = torch.randn(21, D, generator=gen)
    w = torch.randn(21, D, generator=gen)
    reference = copy.deepcopy(experts)

    x_grouped = x.clone().requires_grad_()
    params = stack_parameters(experts)
    y = grouped_mlp(
        x_grouped, counts, params[names[0]], None, params[names[1]], None, experts[0].glu, rows
    )
    (y * w).sum().backward()

    x_loop = x.clone().requires_grad_()
    pieces = x_loop[:18].split(counts.tolist())
    outputs = [expert(piece) for expert, piece in zip(reference, pieces, strict=True)]
    expected = torch.cat([*outputs, torch.zeros(3, D)])
    (expected * w).sum().backward()

    assert_grads_close(y.detach(), expected.detach(), what="output")
    grads = {f"{i}.{n}": p.grad for i, e in enumerate(experts) for n, p in e.named_parameters()}
    expected_grads = {
        f"{i}.{n}": p.grad for i, e in enumerate(reference) for n, p in e.named_parameters()
    }
    assert_grads_close({"input": x_grouped.grad, **grads}, {"input": x_loop.grad, **expected_grads})
    assert not x_grouped.grad[18:].any()


def test_dropout_scales_or_zeroes_each_expert_output_after_its_down_projection():
    torch.manual_seed(3)
    layer = MoELayer(D, FFN, 2, dropout=0.5)
    x, counts = torch.randn(10, D), torch.tensor([6, 4])
    layer.eval()
    plain = layer.experts(x, counts)
    layer.train()
    dropped = layer.experts(x, counts)
    zero = dropped == 0
    assert 0 < zero.float().mean() < 1
    torch.testing.assert_close(dropped[~zero], 2 * plain[~zero])


def test_compiled_layer_is_one_graph_for_every_routing():
    # capacity: every shape in the layer follows from the input's, and the fallback (taken
    # for float32 under compile) needs no sync; inductor, forward and backward: about 10 s
    torch._dynamo.reset()
    layer = _layer(4, 2, dropless=False)
    reference = copy.deepcopy(layer)
    compiled = torch.compile(layer, fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(2, TOKENS // 2, D, generator=gen) for _ in range(2)]
    routings = [layer.router(x.view(-1, D)).expert_index for x in batches]
    assert not torch.equal(*routings)
    patches = torch._dynamo.config.patch(error_on_recompile=True)
    with patches, torch._inductor.config.patch(compile_threads=1):
        for x in batches:
            out = compiled(x)
            out.square().sum().backward()
            expected = _loop_forward(reference, x)
            expected.square().sum().backward()
            assert_grads_close(out.detach(), expected.detach(), what="output")
    grads = {name: p.grad for name, p in layer.named_parameters()}
    assert_grads_close(grads, {name: p.grad for name, p in reference.named_parameters()})


def test_experts_are_stacked_in_the_compute_dtype_each_receiving_its_fp32_gradient():
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(4, 3) for _ in range(5))
    stacked = stack_parameters(experts, torch.bfloat16)
    assert {t.dtype for t in stacked.values()} == {torch.bfloat16}
    assert torch.equal(stacked["weight"][2], experts[2].weight.to(torch.bfloat16))
    upstream = torch.randn(5, 3, 4, dtype=torch.bfloat16)
    (stacked["weight"] * upstream).sum().backward()
    for i, expert in enumerate(experts):
        assert expert.weight.grad.dtype == torch.float32
        assert torch.equal(expert.weight.grad, upstream[i].float())
    assert stack_parameters(experts)["bias"].dtype == torch.float32  # None: their own


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stack_as_is_a_well_formed_operator_for_the_compiler(dtype):
    """torch's own checks of a custom op: its shape function, autograd registration and
    schema agree with what it does (what torch.compile relies on to keep it whole)."""
    tensors = [torch.randn(3, 5, requires_grad=True) for _ in range(4)]
    torch.library.opcheck(stack_as, (tensors, dtype))


def test_a_stacked_weight_is_cast_once_and_its_gradient_cast_back():
    weight = torch.randn(3, 8, 4, requires_grad=True)
    cast = cast_weight(weight, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and cast.stride() == weight.stride()
    assert torch.equal(cast, weight.detach().to(torch.bfloat16))
    upstream = torch.randn(3, 8, 4, dtype=torch.bfloat16)
    (cast * upstream).sum().backward()
    assert weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad, upstream.float())
    torch.library.opcheck(cast_weight, (weight, torch.bfloat16))

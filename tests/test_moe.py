"""Top-k routing and the local MoE layer, checked against numbers worked out by hand."""

import subprocess
import sys

import pytest
import torch

from interlace.errors import ConfigError
from interlace.moe import MoELayer, TopKRouter

# Router probabilities chosen by hand, one row per token. With the router weight set to the
# identity and inputs x = log(p), softmax(x · Wᵀ) = p exactly.
PROBS_3 = [
    [0.70, 0.20, 0.10],
    [0.60, 0.30, 0.10],
    [0.15, 0.80, 0.05],
    [0.20, 0.10, 0.70],
]


def _identity_router(n_experts: int, **kwargs) -> TopKRouter:
    router = TopKRouter(n_experts, n_experts, **kwargs)
    with torch.no_grad():
        router.proj.weight.copy_(torch.eye(n_experts))
    return router


def _inputs(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_equals_hand_computed_switch_loss_over_first_choices(top_k):
    routing = _identity_router(3, top_k=top_k)(_inputs(PROBS_3))
    # First choices: experts 0, 0, 1, 2 → f = (2/4, 1/4, 1/4).
    # Mean probabilities: P_0 = (0.7+0.6+0.15+0.2)/4, P_1 = (0.2+0.3+0.8+0.1)/4,
    # P_2 = (0.1+0.1+0.05+0.7)/4.
    expected = 3 * (2 / 4 * 1.65 / 4 + 1 / 4 * 1.4 / 4 + 1 / 4 * 0.95 / 4)
    assert routing.aux_loss.item() == pytest.approx(expected, rel=1e-5)


def test_aux_loss_is_one_when_routing_is_perfectly_balanced():
    routing = _identity_router(2)(_inputs([[0.9, 0.1], [0.1, 0.9]]))
    assert routing.aux_loss.item() == pytest.approx(1.0, rel=1e-5)


def test_top1_routes_to_the_most_probable_expert_with_its_raw_probability():
    routing = _identity_router(3, top_k=1, dropless=True)(_inputs(PROBS_3))
    assert routing.expert_index.squeeze(1).tolist() == [0, 0, 1, 2]
    torch.testing.assert_close(routing.gate_weight.squeeze(1), torch.tensor([0.7, 0.6, 0.8, 0.7]))


def test_top2_gate_weights_are_the_two_best_probabilities_renormalised_to_sum_one():
    routing = _identity_router(3, top_k=2, dropless=True)(_inputs(PROBS_3))
    assert routing.expert_index.tolist() == [[0, 1], [0, 1], [1, 0], [2, 0]]
    expected = torch.tensor(
        [
            [0.7 / 0.9, 0.2 / 0.9],
            [0.6 / 0.9, 0.3 / 0.9],
            [0.8 / 0.95, 0.15 / 0.95],
            [0.7 / 0.9, 0.2 / 0.9],
        ]
    )
    torch.testing.assert_close(routing.gate_weight, expected)


def test_capacity_drops_overflow_in_token_order_for_top1():
    # Capacity ceil(0.5 · 4 · 1 / 2) = 1; first choices 0, 0, 1, 0 → tokens 1 and 3 overflow.
    probs = [[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]]
    routing = _identity_router(2, top_k=1, capacity_factor=0.5)(_inputs(probs))
    assert routing.capacity == 1
    assert routing.keep.squeeze(1).tolist() == [True, False, True, False]
    assert routing.tokens_per_expert.tolist() == [3, 1]


def test_capacity_serves_every_first_choice_before_any_second_choice():
    # Capacity ceil(0.5 · 4 · 2 / 4) = 1. Choices (first, second): t0 (0, 1), t1 (1, 0),
    # t2 (2, 3), t3 (0, 3). First choices claim experts 0, 1, 2 (t3's first overflows expert 0);
    # then second choices in token order: t0 → 1 full, t1 → 0 full, t2 → 3 kept, t3 → 3 full.
    # Token-order priority alone would have let t0's second choice take expert 1 from t1.
    probs = [
        [0.5, 0.3, 0.1, 0.1],
        [0.3, 0.5, 0.1, 0.1],
        [0.1, 0.1, 0.5, 0.3],
        [0.5, 0.1, 0.1, 0.3],
    ]
    routing = _identity_router(4, top_k=2, capacity_factor=0.5)(_inputs(probs))
    assert routing.expert_index.tolist() == [[0, 1], [1, 0], [2, 3], [0, 3]]
    assert routing.keep.tolist() == [[True, False], [True, False], [True, True], [False, False]]
    assert routing.tokens_per_expert.tolist() == [3, 2, 1, 2]


def test_dropless_router_keeps_every_assignment_and_has_no_capacity():
    routing = _identity_router(2, top_k=1, dropless=True)(_inputs([[0.9, 0.1]] * 5))
    assert routing.capacity is None
    assert routing.keep.all()


def test_router_rejects_top_k_larger_than_the_expert_count():
    with pytest.raises(ConfigError, match=r"top_k=2 with n_experts=1"):
        TopKRouter(8, n_experts=1, top_k=2)


def _layer(d_model: int, n_experts: int, **kwargs) -> MoELayer:
    torch.manual_seed(0)
    layer = MoELayer(d_model, 2 * d_model, n_experts, **kwargs)
    with torch.no_grad():
        layer.router.proj.weight.normal_(0.0, 0.5)
    return layer


def test_dropless_moe_equals_a_per_token_reference():
    layer = _layer(8, 4, top_k=2, dropless=True)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    out = layer(x)

    tokens = x.reshape(-1, 8)
    expected = torch.empty_like(tokens)
    for n, token in enumerate(tokens):
        probs = torch.softmax(layer.router.proj.weight @ token, dim=0)
        best = torch.argsort(probs, descending=True)[:2].tolist()
        total = probs[best].sum()
        expected[n] = sum(probs[e] / total * layer.experts.expert(e)(token) for e in best)
    torch.testing.assert_close(out, expected.view(3, 5, 8))


def test_fully_dropped_tokens_get_zero_output_and_kept_ones_their_expert_output():
    layer = _layer(2, 2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.proj.weight.copy_(torch.eye(2))
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    x = probs.log().view(1, 4, 2)
    out = layer(x)[0]
    assert torch.all(out[1] == 0) and torch.all(out[3] == 0)
    torch.testing.assert_close(out[0], 0.9 * layer.experts.expert(0)(x[0, 0]))
    torch.testing.assert_close(out[2], 0.7 * layer.experts.expert(1)(x[0, 2]))


def test_moe_backward_gives_gradients_to_router_and_every_expert():
    layer = _layer(8, 4, top_k=2, dropless=True)
    x = torch.randn(4, 16, 8, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    assert (layer.last_tokens_per_expert > 0).all(), "every expert must receive tokens"
    (out.square().mean() + layer.aux_loss).backward()
    assert layer.router.proj.weight.grad.abs().sum() > 0
    for e in range(len(layer.experts)):
        assert layer.experts.up_weight.grad[e].abs().sum() > 0
        assert layer.experts.down_weight.grad[e].abs().sum() > 0
    assert x.grad.abs().sum() > 0


def test_layer_records_tokens_per_expert_counting_every_choice():
    layer = _layer(8, 4, top_k=2)
    layer(torch.randn(2, 6, 8))
    assert layer.last_tokens_per_expert.shape == (4,)
    assert layer.last_tokens_per_expert.sum().item() == 2 * 6 * 2


def test_moe_package_imports_before_the_models_package_in_a_fresh_interpreter():
    code = "import interlace.moe, interlace.models; print(interlace.moe.MoELayer.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "MoELayer"

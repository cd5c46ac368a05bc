"""Reference GPT: shapes, causality, tied head, loss, init, presets and config validation."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from interlace.errors import ConfigError
from interlace.loss import causal_lm_loss
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.models.mlp import MLP
from interlace.models.presets import PRESETS, get_preset
from interlace.moe import MoELayer

TINY = GPTConfig(vocab_size=97, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _tokens(config: GPTConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=generator)


def test_forward_gives_logits_batch_time_vocab():
    torch.manual_seed(0)
    model = build_model(TINY)
    logits = model(_tokens(TINY, batch=3)[:, :10])
    assert logits.shape == (3, 10, TINY.vocab_size)


def test_changing_a_token_leaves_logits_of_earlier_positions_unchanged():
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    idx = _tokens(TINY)
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % TINY.vocab_size
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_lm_head_weight_is_the_token_embedding():
    model = build_model(TINY)
    assert model.lm_head.weight is model.wte.weight


def test_dense_loss_equals_cross_entropy_of_the_logits_and_aux_loss_is_zero():
    torch.manual_seed(0)
    model = build_model(TINY)
    idx, targets = _tokens(TINY, seed=1), _tokens(TINY, seed=2)
    logits = model(idx)
    loss = causal_lm_loss(logits, targets, model)
    log_probs = logits.log_softmax(dim=-1)
    by_hand = -log_probs.gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss, by_hand)
    assert model.aux_loss.item() == 0.0


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = build_model(TINY)
    causal_lm_loss(model(_tokens(TINY)), _tokens(TINY, seed=1), model).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_input_longer_than_seq_len_raises_config_error_naming_both_lengths():
    model = build_model(TINY)
    idx = torch.zeros(1, TINY.seq_len + 1, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"T=17.*seq_len=16"):
        model(idx)


def test_attention_reshapes_heads_from_the_projection_width():
    """Column-sharding q/k/v to half the heads must work without touching the module."""
    torch.manual_seed(0)
    attn = build_model(TINY).blocks[0].attn
    half = TINY.d_model // 2
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.weight.data = proj.weight.data[:half]
        proj.bias.data = proj.bias.data[:half]
    attn.out_proj.weight.data = attn.out_proj.weight.data[:, :half]
    out = attn(torch.randn(2, 5, TINY.d_model))
    assert out.shape == (2, 5, TINY.d_model)


def test_gpt2_init_zero_biases_unit_layernorm_and_scaled_residual_projections():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, seq_len=8, d_model=128, n_layers=8, n_heads=4)
    model = build_model(config)
    block = model.blocks[3]
    assert torch.all(block.attn.q_proj.bias == 0) and torch.all(block.mlp.down.bias == 0)
    assert torch.all(block.ln_1.weight == 1)
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert block.attn.out_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.mlp.down.weight.std().item() == pytest.approx(residual_std, rel=0.05)


def test_stacked_experts_get_the_init_their_linear_layers_would():
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=64, seq_len=8, d_model=128, n_layers=8, n_heads=4, n_experts=4, moe_every=1
    )
    experts = build_model(config).blocks[3].mlp.experts
    assert not experts.up_bias.any() and not experts.down_bias.any()
    for e in range(len(experts)):  # every expert, not only the stack as a whole
        assert experts.up_weight[e].std().item() == pytest.approx(0.02, rel=0.05)
        residual_std = 0.02 / math.sqrt(2 * 8)
        assert experts.down_weight[e].std().item() == pytest.approx(residual_std, rel=0.05)


def test_meta_model_materialised_with_to_empty_and_init_weights_equals_a_cpu_model():
    model = build_model("moe-tiny", device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(3)
    model.init_weights()
    reference = build_model("moe-tiny")
    torch.manual_seed(3)
    reference.init_weights()  # the same draws, in the same order, on an ordinary model
    assert model.lm_head.weight is model.wte.weight
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    idx = _tokens(model.config)
    torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        dataclasses.replace(TINY, bias=False, d_ff=48),
        dataclasses.replace(TINY, n_experts=3, top_k=2, moe_every=1),
        dataclasses.replace(TINY, n_layers=3, n_experts=2, bias=False),
    ],
    ids=["dense", "no-bias-custom-ffn", "moe-every-layer", "moe-every-other-no-bias"],
)
def test_num_params_equals_the_built_models_parameter_count(config):
    model = build_model(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_on_meta_with_num_params_equal_to_its_parameter_count(name):
    model = build_model(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert get_preset(name).num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "size"),
    [
        ("bench-25m", 25e6),
        ("gpt2-124m", 124e6),
        ("gpt2-350m", 350e6),
        ("gpt2-1.5b", 1.5e9),
        ("megatron-2.5b", 2.5e9),
        ("megatron-8.3b", 8.3e9),
        ("gpt-20b", 20e9),
        ("axonn-80b", 80e9),
        ("gpt3-175b", 175e9),
    ],
)
def test_sized_preset_has_within_5_percent_of_the_parameters_in_its_name(name, size):
    assert get_preset(name).num_params() == pytest.approx(size, rel=0.05)


def test_moe_every_two_makes_odd_layers_moe_and_moe_every_one_makes_all():
    every_other = build_model(dataclasses.replace(TINY, n_layers=4, n_experts=2, moe_every=2))
    every = build_model(dataclasses.replace(TINY, n_layers=4, n_experts=2, moe_every=1))
    assert [isinstance(b.mlp, MoELayer) for b in every_other.blocks] == [False, True, False, True]
    assert all(isinstance(b.mlp, MoELayer) for b in every.blocks)
    assert all(isinstance(b.mlp, MLP) for b in build_model(TINY).blocks)


def test_ffn_dim_is_four_times_d_model_unless_d_ff_is_set():
    assert TINY.ffn_dim == 4 * 32
    assert dataclasses.replace(TINY, d_ff=50).ffn_dim == 50


def test_config_round_trips_through_json():
    config = get_preset("moe-demo")
    assert GPTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"d_model": 100, "n_heads": 12},
            r"d_model=100 is not divisible by n_heads=12; "
            r"use d_model=96 or n_heads=10",
        ),
        ({"n_layers": 0}, r"n_layers=0 must be a positive integer"),
        ({"d_ff": -4}, r"d_ff=-4 must be a positive integer"),
        ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
        ({"n_experts": 4, "top_k": 3}, r"top_k=3 is not supported; use top_k=1"),
        ({"n_experts": 1, "top_k": 2}, r"top_k=2 exceeds n_experts=1"),
        ({"n_experts": 4, "moe_every": 3}, r"moe_every=3 with n_layers=2 gives no MoE layer"),
        ({"n_experts": 4, "capacity_factor": 0.0}, r"capacity_factor=0.0 must be > 0"),
    ],
)
def test_invalid_config_raises_config_error_naming_the_value(changes, message):
    with pytest.raises(ConfigError, match=message):
        build_model(dataclasses.replace(TINY, **changes))


def test_unknown_preset_raises_config_error_listing_the_presets():
    with pytest.raises(ConfigError, match=r"unknown preset 'gpt5'; choose one of: tiny, demo"):
        get_preset("gpt5")


def test_from_dict_rejects_unknown_and_missing_fields():
    with pytest.raises(ConfigError, match=r"unknown GPTConfig field\(s\) \['width'\]"):
        GPTConfig.from_dict({**TINY.to_dict(), "width": 3})
    partial = {k: v for k, v in TINY.to_dict().items() if k != "n_heads"}
    with pytest.raises(ConfigError, match=r"missing required field\(s\) \['n_heads'\]"):
        GPTConfig.from_dict(partial)


def test_moe_loss_is_cross_entropy_plus_coef_times_summed_layer_aux_losses():
    torch.manual_seed(0)
    config = dataclasses.replace(
        TINY, n_layers=3, n_experts=4, top_k=2, moe_every=1, aux_loss_coef=0.5
    )
    model = build_model(config)
    idx, targets = _tokens(config), _tokens(config, seed=1)
    logits = model(idx)
    loss = causal_lm_loss(logits, targets, model)
    aux = sum(b.mlp.aux_loss for b in model.blocks)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.5 * aux
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(model.aux_loss, aux)
    assert aux.item() > 0

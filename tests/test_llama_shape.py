"""The built-in GPT in Llama's shape (RMSNorm, SwiGLU, rotary positions, grouped-query
attention, untied head): the same function as Hugging Face's Llama with the same weights, its
config checked and counted, and every parallel layout's losses, gradient norms and gradients
equal one process's (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import assert_grads_close
from hf_models import needs_hf, transformers
from interlace.errors import ConfigError, PlanError
from interlace.export import llama
from interlace.models.config import GPTConfig
from interlace.models.gpt import GPT, build_model
from interlace.models.presets import get_preset
from interlace.models.rotary import rotate
from interlace.plan import Plan
from interlace.testing import run_ranks
from test_context_parallel import _steps

LLAMA_TINY = get_preset("llama-tiny")


@needs_hf
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_llama_shape_computes_hugging_face_llama(kv_heads):
    config = dataclasses.replace(LLAMA_TINY, n_kv_heads=kv_heads, rope_theta=500000.0)
    torch.manual_seed(0)
    ours = GPT(config)
    theirs = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.d_model,
            intermediate_size=config.ffn_dim,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=config.seq_len,
            rms_norm_eps=1e-5,
            rope_theta=config.rope_theta,
            tie_word_embeddings=False,
        )
    )
    theirs.load_state_dict(llama.hf_state(ours.state_dict(), config))
    idx = torch.randint(config.vocab_size, (2, config.seq_len))
    torch.testing.assert_close(ours(idx), theirs(idx).logits, atol=2e-5, rtol=1e-4)


def test_rotary_scores_depend_only_on_the_distance():
    torch.manual_seed(0)
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    positions = torch.arange(5)

    def scores(shift: int) -> torch.Tensor:
        rq, rk = rotate(q, positions + shift, 10.0), rotate(k, positions + shift, 10.0)
        return torch.einsum("bthd,bshd->bhts", rq, rk)

    torch.testing.assert_close(scores(0), scores(37), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores(0), torch.einsum("bthd,bshd->bhts", q, k), atol=1e-3)


def test_parameters_are_counted_as_built():
    for name in ("llama-tiny", "tiny"):
        config = get_preset(name)
        model = build_model(config, device="meta")
        assert config.num_params() == sum(p.numel() for p in model.parameters()), name
    assert get_preset("llama3-8b").num_params() == pytest.approx(8.03e9, rel=1e-3)
    assert get_preset("llama3-70b").num_params() == pytest.approx(70.55e9, rel=1e-3)


def test_a_rotary_model_has_no_position_table_and_round_trips():
    model = build_model(LLAMA_TINY, device="meta")
    assert model.wpe is None and not any("wpe" in n for n, _ in model.named_parameters())
    assert GPTConfig.from_dict(LLAMA_TINY.to_dict()) == LLAMA_TINY
    # a GPT-2-shaped config's dict is as it was before the Llama fields existed
    assert "norm" not in get_preset("tiny").to_dict()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_kv_heads": 3}, "n_heads=4 is not divisible by n_kv_heads=3"),
        ({"norm": "batchnorm"}, "norm='batchnorm' is not known; use one of layernorm, rmsnorm"),
        ({"feed_forward": "relu"}, "use one of gelu, swiglu"),
        ({"position_encoding": "alibi"}, "use one of learned, rotary"),
        ({"rope_theta": 0.5}, "rope_theta=0.5 must be > 1"),
        ({"n_heads": 64}, "rotary positions need an even head width"),
        ({"n_experts": 4, "top_k": 1}, "feed_forward='swiglu' with n_experts=4"),
    ],
)
def test_bad_llama_fields_are_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        dataclasses.replace(LLAMA_TINY, **changes).validate()


@pytest.fixture(scope="module")
def serial() -> dict:
    return _steps("dp=1", 1, "llama-tiny")


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "plan_text, axis",
    [
        ("tp=2", "tp"),
        ("tp=2,sequence_parallel=true", "tp"),
        ("cp=2", "cp"),
        ("pp=2,micro_batches=2", "pp"),
        pytest.param("dp_shard=2", None, marks=SLOW),  # FSDP2: unmetered
        pytest.param("tp=2,tp_subbatches=2", "tp", marks=SLOW),
        pytest.param("cp=2,cp_mode=alltoall", "cp", marks=SLOW),
        pytest.param("tp3d=1x2x1", "tp_y", marks=SLOW),
        pytest.param("tp3d=2x1x2", "tp_x", marks=SLOW),
        pytest.param("tp=4", "tp", marks=SLOW),  # 4 ranks over 2 kv heads: each held twice
    ],
)
def test_every_layout_of_the_llama_shape_equals_serial(serial, plan_text, axis):
    world_size = Plan.parse(plan_text).world_size
    for rank, result in enumerate(
        run_ranks(world_size, _steps, plan_text, world_size, "llama-tiny")
    ):
        assert result["losses"] == pytest.approx(serial["losses"], abs=2e-5), rank
        assert result["norms"] == pytest.approx(serial["norms"], rel=1e-5), rank
        assert axis is None or result["comm"][axis] > 0, result["comm"]
        if plan_text.startswith(("cp", "dp_shard", "pp")):  # whole gradients, their own names
            held = {name: serial["grads"][name] for name in result["grads"]}
            assert_grads_close(result["grads"], held, what=f"{plan_text}, rank {rank}")


def test_a_tensor_degree_that_splits_kv_heads_unevenly_is_refused_before_launch():
    spec = dataclasses.replace(
        LLAMA_TINY, vocab_size=288, d_model=96, n_heads=12, n_kv_heads=4, d_ff=192
    )
    with pytest.raises(PlanError, match=r"n_kv_heads=4 is not divisible by .* tp=6, nor tp by it"):
        Plan.parse("tp=6").validate(6, spec)
    Plan.parse("tp=2").validate(2, spec)

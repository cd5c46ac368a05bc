"""1D tensor parallelism: parallel equals serial, communication as derived, structure found.

Every rank builds the serial model from one seed, parallelizes a deep copy and runs the same
batches through both: the loss, every gradient (a sharded one against its slice of the serial
gradient), the gradient norm, and the parameters after two AdamW steps must agree in fp32.
"""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from helpers import assert_grads_close
from hf_models import needs_hf, tiny_hf_model, transformers
from interlace import comm
from interlace.comm import Group
from interlace.errors import PlanError
from interlace.loss import causal_lm_loss
from interlace.mesh import build_mesh
from interlace.models.config import GPTConfig
from interlace.models.gpt import CausalSelfAttention, build_model
from interlace.models.presets import get_preset
from interlace.parallel.detect import find_structure
from interlace.parallel.grad_norm import grad_norm
from interlace.parallel.parallelize import parallelize
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.tensor.apply import apply_tensor_parallel, check_divisible
from interlace.parallel.tensor.shard import gather_full, shard_of, shard_spec, tensor_norm_share
from interlace.plan import Plan
from interlace.testing import run_ranks

B, T, VOCAB, D, LAYERS = 2, 16, 256, 64, 2
ATOL = 1e-5


# ----------------------------------------------------------------------------- models


class _Mixer(nn.Module):
    """Three linear layers that are neither attention nor a feed-forward block."""

    def __init__(self, d: int):
        super().__init__()
        self.a = nn.Linear(d, 24)
        self.b = nn.Linear(d, 40)
        self.c = nn.Linear(24, d)

    def forward(self, x):
        return self.c(self.a(x) * self.b(x)[..., :24])


class _OddLayer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, 4)
        self.mixer = _Mixer(d)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mixer(x)


class _OddLM(nn.Module):
    """A custom language model (untied head, unknown mixer): returns logits only."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([_OddLayer(D)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return build_model(get_preset("tiny"))
    if kind == "moe":
        return build_model(get_preset("moe-tiny"))
    if kind == "odd":
        return _OddLM()
    return tiny_hf_model(kind, D, LAYERS, VOCAB, positions=64)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(step))


def _gathers_logits(kind: str) -> bool:
    """Whether the split LM head all-gathers full logits: for the models scored by a loss of
    their own (the custom model's, Hugging Face's from `labels`); the built-in GPT's are scored
    by the plan's vocabulary-parallel loss."""
    return kind not in ("gpt", "moe")


def _loss(
    kind: str, model: nn.Module, tokens: torch.Tensor, par: Parallelized | None = None
) -> torch.Tensor:
    """The serial model's loss of one batch, or (`par`) the split one's, as a loop computes it."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    if kind in ("gpt", "moe"):
        if par is None:
            return causal_lm_loss(model(x), y, model)
        return par.loss(par.module(x), y)
    if par is not None:
        model = par.module
    if kind == "odd":
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    return model(input_ids=x, labels=x, use_cache=False).loss


# ----------------------------------------------------------------------------- parallel = serial


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD, not AdamW: Adam divides by sqrt(v), so a 1e-8 rounding difference on a gradient
    # element that is itself ~1e-8 would move that parameter by up to lr.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _serial_run(kind: str, steps: int = 2) -> tuple[nn.Module, dict]:
    """The initial model (to hand to the ranks) and the serial losses, first gradients, their
    norm and the parameters after `steps` steps. Built once in the parent, so the ranks (forked)
    import nothing and each start from the very same weights."""
    model = _build(kind)
    initial = copy.deepcopy(model)
    opt = _optimizer(model)
    ref: dict = {"losses": []}
    for step in range(steps):
        loss = _loss(kind, model, _batch(step))
        loss.backward()
        ref["losses"].append(loss.detach())
        if step == 0:
            ref["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
            ref["norm"] = torch.nn.utils.get_total_norm(list(ref["grads"].values()))
        opt.step()
        opt.zero_grad()
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return initial, ref


def _piece(full: torch.Tensor, param: torch.Tensor, group: Group) -> torch.Tensor:
    spec = shard_spec(param)
    piece = full if spec is None else shard_of(full, spec, group.rank, group.size)
    assert piece.shape == param.shape, f"shape {tuple(param.shape)} != {tuple(piece.shape)}"
    return piece


def _compare_with_serial(model: nn.Module, ref: dict, kind: str, tp: int, sp: bool) -> dict:
    plan = Plan(tp=tp)
    mesh = build_mesh(plan)
    group = mesh.group("tp")
    par = parallelize(model, plan, mesh, sequence_parallel=sp, gather_logits=_gathers_logits(kind))
    assert set(ref["params"]) == {n for n, _ in par.model.named_parameters()}
    opt = _optimizer(par.model)
    errors: dict[str, float] = {}
    for step, serial_loss in enumerate(ref["losses"]):
        loss = _loss(kind, par.model, _batch(step), par)
        loss.backward()
        errors[f"loss at step {step}"] = (loss - serial_loss).abs().item()
        if step == 0:
            params = dict(par.model.named_parameters())
            expected = {name: _piece(ref["grads"][name], p, group) for name, p in params.items()}
            grads = {name: p.grad for name, p in params.items()}
            assert_grads_close(grads, expected, what=f"tp rank {group.rank}")
            norm = grad_norm(par.model.parameters(), [tensor_norm_share(group)])
            errors["grad norm"] = (norm - ref["norm"]).abs().item()
        opt.step()
        opt.zero_grad()
    for name, p in par.model.named_parameters():
        full = ref["params"][name]
        errors[f"param {name}"] = (p.detach() - _piece(full, p, group)).abs().max().item()
        if (spec := shard_spec(p)) is not None:
            errors[f"gathered {name}"] = (gather_full(p, spec, group) - full).abs().max().item()
    n_sharded = sum(shard_spec(p) is not None for p in par.model.parameters())
    return {"errors": errors, "sharded": n_sharded, "report": par.report}


def _run_and_compare(kind: str, tp: int, sp: bool) -> list[dict]:
    model, ref = _serial_run(kind)
    return run_ranks(tp, _compare_with_serial, model, ref, kind, tp, sp)


def _assert_equal_to_serial(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        bad = {k: v for k, v in result["errors"].items() if not v <= ATOL}
        assert not bad, f"rank {rank} differs from serial: {bad}"
        assert result["sharded"] > 0


CASES = [
    ("gpt", 2, False),
    ("gpt", 4, False),
    ("gpt", 2, True),
    ("gpt", 4, True),
    pytest.param("gpt2", 2, False, marks=needs_hf),
    pytest.param("gpt2", 4, False, marks=needs_hf),
    pytest.param("gpt2", 2, True, marks=needs_hf),
    pytest.param("llama", 2, False, marks=needs_hf),
    pytest.param("llama", 4, False, marks=needs_hf),  # 2 kv heads on 4 ranks: replicated
    pytest.param("llama", 4, True, marks=needs_hf),
    pytest.param("mixtral", 2, False, marks=needs_hf),  # every expert split along its F
    pytest.param("mixtral", 2, True, marks=needs_hf),
    pytest.param("qwen2_moe", 2, False, marks=needs_hf),  # + shared expert and its gate
    pytest.param("qwen2_moe", 4, True, marks=needs_hf),
]


@pytest.mark.parametrize(("kind", "tp", "sp"), CASES)
def test_parallel_equals_serial(kind, tp, sp):
    _assert_equal_to_serial(_run_and_compare(kind, tp, sp))


def test_moe_experts_stay_replicated_and_match_serial():
    results = _run_and_compare("moe", 2, False)
    _assert_equal_to_serial(results)
    assert any(line.startswith("blocks.1.mlp: Mixture-of-Experts") for line in results[0]["report"])


def test_unknown_structure_is_reported_replicated_and_model_matches_serial():
    report = find_structure(_OddLM()).report()
    mixer = [line for line in report if line.startswith("layers.0.mixer:")]
    assert len(mixer) == 1 and "left replicated" in mixer[0], report
    assert "a: 64 → 24, b: 64 → 40, c: 24 → 64" in mixer[0]
    results = _run_and_compare("odd", 2, False)
    _assert_equal_to_serial(results)  # the head gathers full logits for the custom loss
    assert mixer[0] in results[0]["report"]


def _logits(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if kind in ("gpt", "moe", "odd"):
        return model(x)
    return model(input_ids=x, use_cache=False).logits


def _head_output(
    model: nn.Module, kind: str, tokens: torch.Tensor, gather: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """tp=2: this rank's logits and the plan's loss of them."""
    plan = Plan(tp=2)
    par = parallelize(model, plan, build_mesh(plan), gather_logits=gather)
    logits = _logits(kind, par.module, tokens[:, :-1])
    return logits.detach(), par.loss(logits, tokens[:, 1:]).detach()


def _assert_head_output(kind: str, gather: bool) -> None:
    """Each rank's logits are its vocabulary slice of the serial logits (all of them when
    gathering), and the plan's loss of them is the serial loss."""
    model = _build(kind)
    tokens = _batch(0)
    serial_logits = _logits(kind, model, tokens[:, :-1]).detach()
    serial_loss = causal_lm_loss(serial_logits, tokens[:, 1:], model).detach()
    for rank, (logits, loss) in enumerate(run_ranks(2, _head_output, model, kind, tokens, gather)):
        half = VOCAB // 2
        expected = serial_logits if gather else serial_logits[..., rank * half : (rank + 1) * half]
        torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
        torch.testing.assert_close(loss, serial_loss, rtol=0, atol=ATOL)


def test_builtin_gpt_returns_its_vocab_shard_of_the_logits_and_the_full_loss():
    _assert_head_output("gpt", gather=False)


@pytest.mark.parametrize(
    ("kind", "gather"),
    [
        ("gpt", True),
        ("odd", False),
        ("odd", True),
        pytest.param("gpt2", False, marks=needs_hf),
        pytest.param("gpt2", True, marks=needs_hf),
    ],
)
def test_every_split_head_returns_its_vocab_shard_unless_it_gathers_the_logits(kind, gather):
    _assert_head_output(kind, gather)


def _data_and_tensor_parallel(model: nn.Module, ref: dict) -> dict:
    plan = Plan(dp=2, tp=2)
    mesh = build_mesh(plan)
    tp, dp = mesh.group("tp"), mesh.group("dp")
    par = parallelize(model, plan, mesh)
    assert isinstance(par.module, DistributedDataParallel)  # gradients averaged in backward
    mine = _batch(0)[dp.rank : dp.rank + 1]  # each data parallel rank: one of the B rows
    comm.meter.reset()
    par.loss(par.module(mine[:, :-1]), mine[:, 1:]).backward()
    par.sync_gradients()
    assert comm.meter.snapshot()["dp"]["all_reduce"]["calls"] > 0
    params = dict(par.model.named_parameters())
    expected = {name: _piece(ref["grads"][name], p, tp) for name, p in params.items()}
    grads = {name: p.grad for name, p in params.items()}
    assert_grads_close(grads, expected, what=f"dp rank {dp.rank}, tp rank {tp.rank}")
    errors = {}
    errors["grad norm"] = (par.clip_grad_norm_(float("inf")) - ref["norm"]).abs().item()
    return errors


def test_data_parallel_over_tensor_parallel_equals_serial():
    model, ref = _serial_run("gpt", steps=1)
    for rank, errors in enumerate(run_ranks(4, _data_and_tensor_parallel, model, ref)):
        bad = {k: v for k, v in errors.items() if not v <= ATOL}
        assert not bad, f"rank {rank} differs from serial: {bad}"


def _untouched_at_tp1(model: nn.Module) -> tuple[list[str], int]:
    plan = Plan()
    out = parallelize(model, plan, build_mesh(plan))
    assert out.module is out.model is model
    return out.report, sum(shard_spec(p) is not None for p in out.model.parameters())


def test_tp1_leaves_the_model_as_it_is():
    assert run_ranks(1, _untouched_at_tp1, _build("gpt")) == [([], 0)]


# ----------------------------------------------------------------------------- bytes


def _measure(model: nn.Module, kind: str, tp: int, sp: bool) -> tuple[dict, dict]:
    plan = Plan(tp=tp)
    mesh = build_mesh(plan)
    par = parallelize(model, plan, mesh, sequence_parallel=sp, gather_logits=_gathers_logits(kind))
    comm.meter.reset()
    loss = _loss(kind, par.model, _batch(0), par)
    forward = comm.meter.snapshot()
    comm.meter.reset()
    loss.backward()
    return forward, comm.meter.snapshot()


def _counts(snapshot: dict) -> dict:
    return {op: (v["calls"], v["bytes"]) for op, v in snapshot["tp"].items()}


def _expected_bytes(kind: str, p: int, sp: bool) -> tuple[dict, dict]:
    """Analytical (calls, payload bytes) per op. act = one [B, T, d] fp32 activation."""
    act, tokens, logits = B * T * D * 4, B * T * 4, B * T * VOCAB // p * 4
    blocks = 2 * LAYERS  # attention and MLP of every layer
    loss = {"gpt": (2, 3 * tokens), "gpt2": (0, 0)}[kind]  # row max; [sum exp, target logit]
    if not sp:
        forward = {"all_reduce": (1 + blocks + loss[0], (1 + blocks) * act + loss[1])}
        if kind == "gpt2":
            forward["all_gather"] = (1, logits)  # full logits for HF's loss
        # backward: each block entry and the head entry all-reduce their input gradient
        return forward, {"all_reduce": (blocks + 1, (blocks + 1) * act)}
    forward = {
        "all_reduce": (1 + loss[0], act + loss[1]),  # embedding, then scattered
        "all_gather": (blocks + 1, (blocks + 1) * act // p),  # block entries + final norm
        "reduce_scatter": (blocks, blocks * act),  # block exits (payload: the full input)
    }
    replicated = 6 * LAYERS + 2  # 2 LayerNorms (w, b) and 2 row biases a layer; final norm
    backward = {
        "all_gather": (blocks + 1, (blocks + 1) * act // p),  # block exits + embedding scatter
        "reduce_scatter": (blocks + 1, (blocks + 1) * act),  # block entries + final norm
        "all_reduce": (replicated, replicated * D * 4),  # sequence-parallel parameter grads
    }
    return forward, backward


BYTE_CASES = [
    ("gpt", 2, False),
    ("gpt", 4, False),
    ("gpt", 2, True),
    pytest.param("gpt2", 2, False, marks=needs_hf),
]


@pytest.mark.parametrize(("kind", "tp", "sp"), BYTE_CASES)
def test_measured_bytes_equal_analytical_counts(kind, tp, sp):
    forward, backward = _expected_bytes(kind, tp, sp)
    model, _ = _serial_run(kind, steps=1)  # built (and its lazy imports done) in the parent
    for rank, (fwd, bwd) in enumerate(run_ranks(tp, _measure, model, kind, tp, sp)):
        assert set(fwd) == set(bwd) == {"tp"}, f"rank {rank}: collectives outside tp"
        assert _counts(fwd) == forward, f"rank {rank} forward"
        assert _counts(bwd) == backward, f"rank {rank} backward"


# ----------------------------------------------------------------------------- structure


@needs_hf
def test_llama_structure_matches_its_own_tp_plan():
    model = _build("llama")
    found = find_structure(model)
    plan = {}
    for a in found.attentions:
        plan.update({f"{a.name}.{n}": "colwise" for n in a.producers})
        plan[f"{a.name}.{a.out}"] = "rowwise"
    for f in found.feed_forwards:
        plan.update({f"{f.name}.{n}": "colwise" for n in f.producers})
        plan[f"{f.name}.{f.down}"] = "rowwise"
    generic = {re.sub(r"\.\d+\.", ".*.", k): v for k, v in plan.items()}
    expected = {k: v for k, v in model._tp_plan.items() if "layers" in k}
    assert generic == expected
    assert (found.vocab.embedding, found.vocab.head) == ("model.embed_tokens", "lm_head")
    assert (found.layers, found.final_norm) == ("model.layers", "model.norm")


@needs_hf
def test_gpt2_fused_attention_is_found():
    found = find_structure(_build("gpt2"))
    attn = found.attentions[0]
    assert (attn.name, attn.producers, attn.out) == ("transformer.h.0.attn", ("c_attn",), "c_proj")
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (4, 4, 16)
    assert found.vocab.tied and found.final_norm == "transformer.ln_f"


# ----------------------------------------------------------------------------- errors


def _gpt(**sizes) -> nn.Module:
    base = {"vocab_size": 384, "seq_len": 16, "d_model": 96, "n_layers": 1, "n_heads": 6}
    return build_model(GPTConfig(**{**base, **sizes}), device="meta")


@pytest.mark.parametrize(
    ("model", "size", "fitting"),
    [
        (lambda: _gpt(d_model=64, n_heads=4), "the model's d_model=64", [1, 2, 4, 8, 16, 32, 64]),
        (lambda: _gpt(vocab_size=256), "wte: vocab_size=256", [1, 2, 4, 8, 16, 32, 64, 128]),
        (lambda: _gpt(n_heads=4), "blocks.0.attn: n_heads=4", [1, 2, 4]),
        (lambda: _gpt(d_ff=100), "blocks.0.mlp: ffn_dim=100", [1, 2, 4, 5, 10, 20, 25, 50]),
    ],
)
def test_sizes_not_divisible_by_tp_raise_plan_error_naming_them(model, size, fitting):
    message = f"{size} is not divisible by the tensor parallel degree 3; use a degree in {fitting}"
    with pytest.raises(PlanError, match=re.escape(message)):
        check_divisible(find_structure(model()), 3)


@needs_hf
def test_kv_heads_neither_dividing_nor_divisible_raise_plan_error():
    config = transformers.LlamaConfig(
        hidden_size=96, num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=192, vocab_size=384,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with pytest.raises(PlanError, match=r"self_attn: n_kv_heads=2 .* tp=3"):
        check_divisible(find_structure(model), 3)
    check_divisible(find_structure(model), 2)


def test_sequence_parallel_refuses_replicated_experts_before_changing_anything():
    model = build_model(get_preset("moe-tiny"), device="meta")
    before = {n: p.shape for n, p in model.named_parameters()}
    fake = Group(name="tp", pg=None, size=2, rank=0)  # never used: refused first
    with pytest.raises(PlanError, match=r"sequence_parallel=True .*blocks\.1\.mlp"):
        apply_tensor_parallel(model, find_structure(model), fake, sequence_parallel=True)
    assert {n: p.shape for n, p in model.named_parameters()} == before

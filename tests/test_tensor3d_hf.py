"""3D tensor parallelism of Hugging Face GPT-2 and Llama: parallel equals serial.

The parent builds each tiny model once and runs it serially (HF's own loss from `labels`). Every
rank splits a copy on its grid, runs the same batch (its z slice, and its dp slice) once forward
and backward, and compares in fp32 the loss, the gradient norm and every gradient: each rank's
piece against the slice `shard3d_of` cuts from the serial gradient by the parameter's Shard3D.
Norms are recognised on a model built on the meta device as on a real one, and plans are
checked there.
"""

import pytest
import torch
from torch import nn

from helpers import assert_grads_close
from hf_models import needs_hf, tiny_hf_model, transformers
from interlace import comm
from interlace.errors import PlanError
from interlace.mesh import build_mesh
from interlace.parallel.fits import check_fits
from interlace.parallel.parallelize import parallelize
from interlace.parallel.tensor3d.layers import rms_norm_eps
from interlace.parallel.tensor3d.shard import Grid, shard3d_of, shard3d_spec
from interlace.plan import Overlap, Plan
from interlace.testing import run_ranks

pytestmark = needs_hf

B, T, D, LAYERS = 4, 12, 64, 2
VOCAB = 96  # differs from every ffn width (256, 128): the LM head is found by its shape
ATOL = 1e-5
GRIDS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)]


def _build(kind: str, kv_heads: int = 2) -> nn.Module:
    return tiny_hf_model(kind, D, LAYERS, VOCAB, positions=32, kv_heads=kv_heads)


def _tokens(length: int = T) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, length), generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def _serial(model: nn.Module, length: int) -> dict:
    loss = _loss(model, _tokens(length))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return {
        "loss": loss.detach(),
        "grads": grads,
        "norm": torch.nn.utils.get_total_norm(grads.values()),
    }


def _compare(
    model: nn.Module,
    ref: dict,
    tp3d: tuple[int, int, int],
    dp: int,
    sequence_parallel: bool,
    subbatches: int,
) -> dict:
    overlap = Overlap(tp_subbatches=subbatches)
    plan = Plan(tp3d=tp3d, dp=dp, sequence_parallel=sequence_parallel, overlap=overlap)
    mesh = build_mesh(plan)
    par = parallelize(model, plan, mesh)
    grid, dp_group = Grid.from_mesh(mesh), mesh.group("dp")
    rows = B // dp
    batch = _tokens(ref["length"])
    tokens = par.rows(batch[dp_group.rank * rows : (dp_group.rank + 1) * rows])
    # HF's own loss from `labels` shifts inside; here the loop's (over z: the mean) scores
    # the logits of every position but the last against the next token
    logits = par.module(input_ids=tokens[:, :-1], use_cache=False).logits
    loss = par.loss(logits, tokens[:, 1:])
    loss.backward()  # data parallel: DDP averages over dp
    par.sync_gradients()
    loss = loss.detach()
    if dp > 1:
        comm.all_reduce(loss, dp_group)
    errors = {"loss": (loss / dp - ref["loss"]).abs().item()}
    grads, expected = {}, {}
    for name, p in par.model.named_parameters():
        spec, full = shard3d_spec(p), ref["grads"][name]
        grads[name] = p.grad
        expected[name] = full if spec is None else shard3d_of(full, spec, grid)
    assert_grads_close(grads, expected, what=f"dp rank {dp_group.rank}")
    errors["grad norm"] = (par.clip_grad_norm_(float("inf")) - ref["norm"]).abs().item()
    names = sorted(n for n, _ in par.model.named_parameters())
    return {"errors": errors, "names": names, "report": par.report}


def _assert_equal_to_serial(
    model: nn.Module,
    tp3d: tuple[int, int, int],
    dp: int = 1,
    sequence_parallel: bool = False,
    subbatches: int = 1,
) -> list:
    # the loop feeds T - 1 positions: under sequence parallelism a multiple of y
    length = T + 1 if sequence_parallel else T
    ref = {**_serial(model, length), "length": length}
    world_size = dp * tp3d[0] * tp3d[1] * tp3d[2]
    results = run_ranks(world_size, _compare, model, ref, tp3d, dp, sequence_parallel, subbatches)
    for rank, result in enumerate(results):
        assert result["names"] == sorted(ref["grads"]), f"rank {rank}: parameters differ"
        bad = {k: v for k, v in result["errors"].items() if not v <= ATOL}
        assert not bad, f"rank {rank} differs from serial: {bad}"
    return results


@pytest.mark.parametrize("tp3d", GRIDS)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_3d_parallel_equals_serial(kind, tp3d):
    results = _assert_equal_to_serial(_build(kind), tp3d)
    assert results[0]["report"][0].startswith("3D tensor parallel over")


def test_llama_kv_heads_replicated_over_y_equal_serial():
    # one kv head, y=2: each y rank holds a replica, its gradient summed before z's reduce-scatter
    results = _assert_equal_to_serial(_build("llama", kv_heads=1), (1, 2, 2))
    assert any("1 of 1 kv heads (each on 2 y ranks)" in line for line in results[0]["report"])


def test_gpt2_3d_with_data_parallel_equals_serial():
    _assert_equal_to_serial(_build("gpt2"), (2, 1, 1), dp=2)


@pytest.mark.parametrize(
    ("kind", "tp3d", "kv_heads"),
    [
        ("gpt2", (1, 2, 1), 2),
        pytest.param("llama", (2, 2, 1), 2, marks=pytest.mark.slow),
        pytest.param("llama", (1, 2, 2), 1, marks=pytest.mark.slow),
    ],
)
def test_hf_sequence_parallel_3d_equals_serial(kind, tp3d, kv_heads):
    # the decoder layers take [B/z, T/y, d/x]; attention and MLP gather the sequence over y
    results = _assert_equal_to_serial(_build(kind, kv_heads), tp3d, sequence_parallel=True)
    assert any(line.startswith("sequence parallel over y=2") for line in results[0]["report"])


@pytest.mark.parametrize(
    ("kind", "tp3d", "kv_heads"),
    [
        pytest.param("llama", (2, 1, 1), 2, marks=pytest.mark.slow),
        pytest.param("gpt2", (1, 2, 1), 2, marks=pytest.mark.slow),
        pytest.param("llama", (1, 2, 2), 1, marks=pytest.mark.slow),
    ],
)
def test_hf_overlapped_3d_sub_batches_equal_serial(kind, tp3d, kv_heads):
    # the decoder layers take [B, T, d/x] in two interleaved halves of the batch (Llama's
    # rotary tables split with them); with z = 2 the halves share each gathered block, and a
    # kv head held by both y ranks has its summed gradient added over them once
    results = _assert_equal_to_serial(_build(kind, kv_heads), tp3d, subbatches=2)
    assert any("2 interleaved sub-batches" in line for line in results[0]["report"])


def test_norms_are_recognised_on_the_meta_device_as_on_the_cpu():
    """A model built for its shapes has no values to probe its norms with: `check_fits` splits
    it all the same, and its RMS norms are recognised as the real model's are. Not RMS norms:
    one scaling by (1 + weight) (Gemma's), on either device, and one ignoring its weight, on
    the meta device, where the probe's weight is random (a real one's may be all ones)."""
    for kind in ("gpt2", "llama"):
        with torch.device("meta"):
            meta = _build(kind)
        check_fits(meta, Plan(tp3d=(2, 1, 1)))
    real = _build("llama")
    for name, module in real.named_modules():
        if name.endswith("layernorm"):
            assert rms_norm_eps(meta.get_submodule(name), D) == rms_norm_eps(module, D) == 1e-6
    assert rms_norm_eps(_GainNorm(D, lambda w: 1 + w), D) is None
    with torch.device("meta"):
        one_plus, unweighted = _GainNorm(D, lambda w: 1 + w), _GainNorm(D, lambda w: 1)
    assert rms_norm_eps(one_plus, D) is None and rms_norm_eps(unweighted, D) is None


class _GainNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · gain(weight), weight [d] initialised to 0."""

    def __init__(self, d: int, gain):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = 1e-6
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gain(self.weight)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_kv_heads_the_grid_cannot_split_are_refused(device):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=48, num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3,
        intermediate_size=128, vocab_size=VOCAB,
    )  # fmt: skip
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(PlanError, match=r"n_kv_heads=3 is not divisible by tp3d=1x2x1's y=2"):
        check_fits(model, Plan(tp3d=(1, 2, 1)))

"""A `hf:PATH` folder with weights, run on several ranks, is built on the meta device and each
rank reads only its pieces from the safetensors: the same tensors, bit for bit, as the model
built whole and then split (buffers recomputed, tied weights tied; Mixture-of-Experts tensors
fused from experts stored one by one, as transformers fuses them); a tensor-parallel rank reads
half of each split tensor and never a whole one, a 3D tensor-parallel rank as much as it holds,
an expert-parallel rank only its experts; folders without weights, or whose conversion cannot
be read piece by piece, are built whole."""

import dataclasses

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from helpers import TINY_RUN
from hf_models import needs_hf, saved_tiny_model, tiny_hf_model, transformers
from interlace.mesh import build_mesh
from interlace.models import hf, hf_weights
from interlace.parallel.parallelize import parallelize
from interlace.parallel.parallelized import Parallelized
from interlace.parallel.tensor.shard import shard_spec
from interlace.parallel.tensor3d.shard import shard3d_spec
from interlace.plan import Plan
from interlace.tensors import local_tensor
from interlace.testing import run_ranks
from interlace.train import Trainer, prepare_run

pytestmark = needs_hf

VOCAB = 320
SPLITS = [
    ("gpt2", "dp=2", 2),
    ("gpt2", "tp=2", 2),  # fused q|k|v: three runs per piece; tied head
    ("gpt2", "pp=2,micro_batches=2", 2),  # the last stage's copy of the tied embedding
    ("llama", "dp=2", 2),
    ("llama", "tp=2,sequence_parallel=true", 2),
    ("llama", "tp=4", 4),  # 2 kv heads: each read by two ranks
    ("llama", "pp=2,micro_batches=2", 2),
    ("llama", "dp_shard=2", 2),
    ("llama", "dp_shard=2,tp=2", 4),  # FSDP2's shard of a tensor parallel piece
    ("llama-sharded", "tp=2", 2),  # several files and their index
    ("llama-bf16", "tp=2", 2),  # bf16 files: trained in fp32 all the same
    ("mixtral", "dp=2", 2),  # experts stored one by one, fused as transformers loads them
    ("mixtral", "tp=2", 2),  # each expert's gate and up rows, its down columns
    ("mixtral", "dp_shard=2", 2),  # FSDP2's shard: experts 0-1 and 2-3
    ("mixtral", "dp=2,ep=2", 2),  # experts 0-1 and 2-3, one module each, renamed
    ("mixtral", "dp_shard=2,ep=2", 2),
    ("mixtral", "dp=2,dp_shard=2,ep=2", 4),  # each expert FSDP2-sharded over its ep_dp pair
    ("qwen2_moe", "tp=2", 2),  # and a shared expert
    ("qwen2_moe", "dp=2,ep=2", 2),
    ("gpt2", "tp3d=2x1x1", 2),  # norms' and Conv1D blocks' columns over x
    ("gpt2", "tp3d=1x2x2", 4),  # fused q|k|v rows per part over y, then over z
    ("gpt2", "dp=2,tp3d=1x2x1", 4),
    ("llama", "tp3d=2x1x1", 2),  # RMS norms recognised on the meta device
    ("llama", "tp3d=1x2x2", 4),
    ("llama", "tp3d=1x4x1", 4),  # 2 kv heads: each read by two y ranks
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """{kind: hf:PATH} of the tiny saved models."""
    root = tmp_path_factory.mktemp("hf")
    kinds = ("gpt2", "llama", "mixtral", "qwen2_moe")
    folders = {kind: saved_tiny_model(kind, root / kind, VOCAB) for kind in kinds}
    sharded = saved_tiny_model("llama", root / "sharded", VOCAB, max_shard_size="20KB")
    bf16 = saved_tiny_model("llama", root / "bf16", VOCAB, dtype=torch.bfloat16)
    return {**folders, "llama-sharded": sharded, "llama-bf16": bf16}


def _split(model: str, plan_text: str, pieces: bool) -> Parallelized:
    """The folder's model split by the plan: built on the meta device and read piece by piece,
    or built whole by transformers and then split."""
    plan = Plan.parse(plan_text)
    mesh = build_mesh(plan)
    folder = hf.hf_folder(model)
    config = hf.load_config(folder)
    if not pieces:
        return parallelize(hf.build(folder, config, mesh.device), plan, mesh)
    with torch.device("meta"):
        meta = hf.build_from_config(config)
    return parallelize(meta, plan, mesh, weights=hf_weights.open_weights(folder, meta))


def _held(model: str, plan_text: str, pieces: bool) -> tuple[dict, dict, list]:
    """{name: local tensor} of every parameter, its gradient after one step on a fixed batch
    (hooks such as sequence parallelism's all-reduce included) and every buffer this rank holds
    (a pipeline's stages' too), {name: (ShardSpec, Shard3D)} of every parameter, and the names
    sharing each parameter (ties)."""
    result = _split(model, plan_text, pieces)
    x = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    result.forward_backward(x[:, :-1], x[:, 1:])
    held = nn.ModuleList(result.roots())
    params = dict(held.named_parameters())
    tensors = {
        **{name: local_tensor(t).detach().clone() for name, t in params.items()},
        **{f"{name}.grad": local_tensor(t.grad).clone() for name, t in params.items()},
        **{name: t.clone() for name, t in held.named_buffers()},
    }
    specs = {name: (shard_spec(p), shard3d_spec(p)) for name, p in params.items()}
    shared: dict[int, list[str]] = {}
    for name, param in result.model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    return tensors, specs, sorted(shared.values())


@pytest.mark.parametrize(("kind", "plan_text", "ranks"), SPLITS)
def test_each_rank_reads_the_pieces_the_whole_model_split_gives_it(folders, kind, plan_text, ranks):
    whole = run_ranks(ranks, _held, folders[kind], plan_text, False, timeout=120)
    pieces = run_ranks(ranks, _held, folders[kind], plan_text, True, timeout=120)
    for (expected, expected_specs, expected_ties), (tensors, specs, ties) in zip(
        whole, pieces, strict=True
    ):
        assert ties == expected_ties
        assert specs == expected_specs
        assert tensors.keys() == expected.keys()
        for name, tensor in tensors.items():
            assert torch.equal(tensor, expected[name]), name


class _Recorded:
    """`safetensors.safe_open` recording each read's name and size; a whole tensor cannot be
    read (no `get_tensor`)."""

    def __init__(self, path, framework):
        self.file = _SAFE_OPEN(path, framework)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def get_slice(self, name):
        return _RecordedSlice(name, self.file.get_slice(name))


class _RecordedSlice:
    def __init__(self, name, stored):
        self.name, self.stored = name, stored

    def get_shape(self):
        return self.stored.get_shape()

    def __getitem__(self, index):
        piece = self.stored[index]
        _READS.append((self.name, piece.numel()))
        return piece


_SAFE_OPEN = safetensors.safe_open
_READS: list[tuple[str, int]] = []  # this process's reads through `_Recorded`


def _trainer_reads(model: str, plan_text: str, ranks: int = 2) -> tuple[list, dict]:
    """The reads of this rank's Trainer building the model ([(name, elements)]) and {name:
    elements held} of its parameters."""
    plan = Plan.parse(plan_text)
    trainer = Trainer(
        prepare_run(dataclasses.replace(TINY_RUN, model=model), plan, ranks), build_mesh(plan)
    )
    held = {n: local_tensor(p).numel() for n, p in trainer.model.named_parameters()}
    return list(_READS), held


def test_a_tensor_parallel_rank_reads_half_of_each_split_tensor_and_nothing_whole(
    folders, monkeypatch
):
    """tp=2 through the Trainer: each tensor is read once, as much of it as the rank holds
    (half of a split one), never the whole model's copy (transformers' loader is off)."""
    stored = load_file(hf.hf_folder(folders["llama"]) / "model.safetensors")
    full = {name: tensor.numel() for name, tensor in stored.items()}
    monkeypatch.setattr(safetensors, "safe_open", _Recorded)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)
    for reads, held in run_ranks(2, _trainer_reads, folders["llama"], "tp=2", timeout=120):
        assert dict(reads) == held
        assert len(reads) == len(held) == len(full)
        split = {name for name, size in held.items() if size < full[name]}
        assert split and all(2 * held[name] == full[name] for name in split)


@pytest.mark.parametrize(
    ("kind", "plan_text", "ranks"),
    [("llama", "tp3d=1x2x2", 4), ("gpt2", "tp3d=1x2x2", 4), ("gpt2", "tp3d=2x1x1", 2)],
)
def test_a_3d_rank_reads_exactly_what_it_holds(folders, monkeypatch, kind, plan_text, ranks):
    """tp3d through the Trainer: each rank reads of each tensor as many elements as it holds
    (GPT-2's fused q|k|v: one run per part; transformers' loader is off), so no rank reads the
    whole model; the grid's ranks together read each 3D linear's weight exactly once."""
    stored = load_file(hf.hf_folder(folders[kind]) / "model.safetensors")
    full = {name: tensor.numel() for name, tensor in stored.items()}
    linears = {n for n in full if n.endswith("weight") and ("_proj." in n or ".c_" in n)}
    monkeypatch.setattr(safetensors, "safe_open", _Recorded)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)
    read = {name: 0 for name in linears}
    for reads, held in run_ranks(ranks, _trainer_reads, folders[kind], plan_text, ranks):
        assert {name: sum(n for r, n in reads if r == name) for name in held} == held
        assert {name for name, _ in reads} == held.keys()
        assert sum(held.values()) < sum(full.values())
        for name in linears:
            read[name] += held[name]
    assert read == {name: full[name] for name in linears}


@pytest.mark.parametrize("plan_text", ["dp=2,ep=2", "tp=2"])
def test_a_rank_reads_only_the_experts_and_pieces_it_holds(folders, monkeypatch, plan_text):
    """Mixtral's experts are stored one tensor each, fused by the model: a rank reads as many
    elements as it holds and no more; under ep=2 each expert's tensors are read, whole, by
    exactly one rank of the pair, under tp=2 half of each by each rank."""
    stored = load_file(hf.hf_folder(folders["mixtral"]) / "model.safetensors")
    experts = {name: t.numel() for name, t in stored.items() if ".experts." in name}
    monkeypatch.setattr(safetensors, "safe_open", _Recorded)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", None)
    ranks = run_ranks(2, _trainer_reads, folders["mixtral"], plan_text, timeout=120)
    read = []
    for reads, held in ranks:
        assert sum(size for _, size in reads) == sum(held.values())
        read.append({name: sum(n for r, n in reads if r == name) for name in experts})
    for name, size in experts.items():
        sizes = sorted(r[name] for r in read)
        assert sizes == ([0, size] if "ep" in plan_text else [size // 2] * 2), name


def test_a_folder_storing_fused_experts_is_read_by_the_model_s_names(tmp_path):
    """Experts saved fused, under the model's own names (as the model holds them), are read as
    any tensor is, and equal the model's."""
    folder = tmp_path / "fused"
    folder.mkdir()
    model = tiny_hf_model("mixtral", 32, 2, VOCAB, positions=32)
    model.config.save_pretrained(folder)
    save_file(model.state_dict(), folder / "model.safetensors")
    with torch.device("meta"):
        meta = hf.build_from_config(hf.load_config(folder))
    weights = hf_weights.open_weights(folder, meta)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert weights.stored[name] == name
    full = model.state_dict()[name]
    runs = [[(1, 3)], [(0, 10), (96, 106)], [(0, 32)]]
    expected = torch.cat([full[1:3, :10], full[1:3, 96:106]], 1)
    assert torch.equal(weights.read(name, runs), expected)


def test_a_folder_without_weights_or_converted_otherwise_is_built_whole(
    folders, tmp_path, monkeypatch
):
    """A folder with only config.json: nothing to read. A conversion other than stacking
    experts and concatenating parts (here a transpose after them) is not reproduced piece by
    piece."""
    from transformers import conversion_mapping, core_model_loading

    mixtral = hf.hf_folder(folders["mixtral"])
    with torch.device("meta"):
        meta = hf.build_from_config(hf.load_config(mixtral))
    assert hf_weights.open_weights(mixtral, meta) is not None
    mapping = conversion_mapping.get_model_conversion_mapping

    def transposed(model):
        conversions = mapping(model)
        for conversion in conversions:
            if isinstance(conversion, core_model_loading.WeightConverter):
                conversion.operations.append(core_model_loading.Transpose(1, 2))
        return conversions

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", transposed)
    assert hf_weights.open_weights(mixtral, meta) is None
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((mixtral / "config.json").read_bytes())
    assert hf_weights.open_weights(bare, meta) is None

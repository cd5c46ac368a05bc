"""A run before any rank starts: its checked settings, model shape and tokenized data
(`prepare_run` → `RunSetup`), and what a checkpoint records of it: the identity a resume must
share (`run_identity`), the layout it may change (`run_layout`, `layout_changes`) and the
settings a tracker logs (`run_settings`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from interlace.compile import resolve_compile
from interlace.data import (
    TokenData,
    TrainBatches,
    describe_corpus,
    get_tokenizer,
)
from interlace.data import load_corpus as read_corpus
from interlace.data.shards import ShardData, ShardIndex, is_shard_folder
from interlace.data.tokens import SYNTHETIC
from interlace.errors import DataError
from interlace.mesh import Mesh, default_device
from interlace.models import hf, hf_weights
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.models.presets import get_preset
from interlace.parallel.data.apply import check_reduce_dtype
from interlace.parallel.fits import check_fits
from interlace.parallel.pieces import Weights
from interlace.parallel.pipeline.layout import check_split
from interlace.plan import Plan
from interlace.precision import resolve_precision
from interlace.train_config import TrainConfig


@dataclasses.dataclass
class RunSetup:
    """What a run needs before any rank starts: the checked config, plan, model config, data."""

    config: TrainConfig
    plan: Plan
    model_config: GPTConfig
    data: TokenData | ShardData
    corpus: str
    precision: str
    compile: bool
    hf_config: Any = None
    """The transformers config of a `hf:PATH` model (None for the built-in GPT, whose config
    is `model_config`; for a HF model `model_config` is its shape, `hf.shape_of`)."""


SYNTHETIC_BATCHES = 16
"""Global batches of distinct windows `data=synthetic` draws; steps beyond reuse them."""


def prepare_run(config: TrainConfig, plan: Plan, world_size: int) -> RunSetup:
    """Check everything that can be checked before training (config, preset, data, plan against
    world size and model) and build the tokenized data. Raises an InterlaceError subclass."""
    config.validate()
    folder = hf.hf_folder(config.model)
    hf_config = hf.load_config(folder) if folder is not None else None
    model_config = get_preset(config.model) if hf_config is None else hf.shape_of(hf_config, None)
    seq_len = config.seq_len or model_config.seq_len
    if config.data == SYNTHETIC:  # the preset's vocabulary, random tokens
        model_config = dataclasses.replace(model_config, seq_len=seq_len)
        windows = SYNTHETIC_BATCHES * config.global_batch
        make_data = functools.partial(
            TokenData.synthetic, model_config.vocab_size, seq_len, windows, config.seed
        )
    elif is_shard_folder(config.data):  # the index's vocabulary, windows read on demand
        vocab = _vocabulary(ShardIndex.read(config.data).vocab_size, model_config, hf_config)
        model_config = dataclasses.replace(model_config, vocab_size=vocab, seq_len=seq_len)
        make_data = functools.partial(ShardData, config.data, seq_len)
    else:  # the tokenizer's vocabulary
        text = read_corpus(config.data)
        tokenizer = get_tokenizer(config.tokenizer, text)
        vocab = _vocabulary(tokenizer.vocab_size, model_config, hf_config)
        model_config = dataclasses.replace(model_config, vocab_size=vocab, seq_len=seq_len)
        make_data = functools.partial(TokenData.from_text, text, tokenizer, seq_len)
    model_config.validate()
    plan.validate(world_size, model_config)
    accum = config.accumulation(plan.dp_size)
    plan.micro_batch_rows(config.global_batch, accum)
    shapes = _build_model(model_config, hf_config, config.model, torch.device("meta"))
    check_fits(shapes, plan)
    check_split(shapes, plan, config.split_points or None, config.layers_per_stage or None)
    data = make_data()
    TrainBatches(data, config.global_batch, config.seed)  # raises if the corpus is too small
    device = default_device()
    precision = resolve_precision(config.precision, device)
    compiled = resolve_compile(config.compile, device, plan)
    check_reduce_dtype(plan, config.grad_reduce_dtype)
    corpus = describe_corpus(config.data)
    return RunSetup(config, plan, model_config, data, corpus, precision, compiled, hf_config)


def _vocabulary(token_ids: int, model_config: GPTConfig, hf_config: Any) -> int:
    """The run's vocabulary for data of `token_ids` ids: theirs for the built-in GPT, the
    embedding's for a `hf:PATH` model (DataError if the ids do not fit in it)."""
    if hf_config is None:
        return token_ids
    if token_ids > model_config.vocab_size:
        raise DataError(
            f"the data's tokenizer has {token_ids} ids but the model's embedding only "
            f"{model_config.vocab_size}; use the model's own tokenizer (or a smaller one)"
        )
    return model_config.vocab_size


def _build_model(
    model_config: GPTConfig, hf_config: Any, name: str, device: torch.device
) -> torch.nn.Module:
    """The run's model on `device`: the built-in GPT of `model_config`, or the `hf:PATH` model
    `name` of `hf_config` (its weights loaded where the folder has them)."""
    if hf_config is None:
        return build_model(model_config, device=device)
    folder = hf.hf_folder(name)
    assert folder is not None
    if device.type == "meta":  # shapes only: never read the weights
        with device:
            return hf.build_from_config(hf_config)
    return hf.build(folder, hf_config, device)


def model_to_split(
    setup: RunSetup, mesh: Mesh | None, device: torch.device
) -> tuple[torch.nn.Module, Weights | None]:
    """The model `parallelize` splits, and where its pieces are read from. A `hf:PATH` model
    whose folder stores its tensors as `hf_weights.open_weights` reads them (under the model's
    names, renamed, experts fused), run on a mesh, is built on the meta device, each rank
    reading only its pieces (`interlace.parallel.pieces`); any other is built whole on
    `device` (None)."""
    build = functools.partial(_build_model, setup.model_config, setup.hf_config, setup.config.model)
    folder = hf.hf_folder(setup.config.model)
    # a folder without weights: initialised from the seed, whole
    if mesh is not None and folder is not None and hf.has_weights(folder):
        model = build(torch.device("meta"))
        weights = hf_weights.open_weights(folder, model)
        if weights is not None:
            return model, weights
    return build(device), None


def run_identity(setup: RunSetup) -> dict[str, Any]:
    """What a checkpoint must share with a run to resume it: the model, the data and the order
    it is drawn in. The plan, the world size, the precision and the global batch may change."""
    hf_config = setup.hf_config
    return {
        "model": setup.model_config.to_dict() if hf_config is None else hf.identity(hf_config),
        "data": {"fingerprint": setup.data.fingerprint, "seed": setup.config.seed},
    }


def run_layout(setup: RunSetup) -> dict[str, Any]:
    """How a run splits its work, recorded in a checkpoint beside its identity: plan,
    precision, optimizer state and global batch."""
    return {
        "plan": setup.plan.to_dict(),
        "precision": setup.precision,
        "optimizer_state": setup.config.optimizer_state,
        "global_batch": setup.config.global_batch,
    }


def run_settings(setup: RunSetup) -> dict[str, Any]:
    """A run's resolved settings, as an experiment tracker records them: its train options,
    the model's shape, its layout (`run_layout`), whether its blocks are compiled, its corpus."""
    return {
        "train": setup.config.to_dict(),
        "model": setup.model_config.to_dict(),
        **run_layout(setup),
        "compiled": setup.compile,
        "corpus": setup.corpus,
    }


def layout_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Lines telling how a resumed run's `now` layout (`run_layout`) differs from the `saved`
    checkpoint's: another plan, precision or optimizer state (a note; a checkpoint from before
    `optimizer_state` held fp32 moments), another global batch (a warning: the data no longer
    continues at the same global sample)."""
    lines = []
    plan, saved_plan = Plan.from_dict(now["plan"]), Plan.from_dict(saved.get("plan", {}))
    if plan != saved_plan:
        lines.append(f"resuming a checkpoint of plan '{saved_plan}' under plan '{plan}'")
    if saved.get("precision", now["precision"]) != now["precision"]:
        lines.append(f"resuming a {saved['precision']} checkpoint in {now['precision']}")
    if saved.get("optimizer_state", "fp32") != now["optimizer_state"]:
        lines.append(
            f"resuming {saved.get('optimizer_state', 'fp32')} AdamW moments as "
            f"{now['optimizer_state']} ones"
        )
    if saved.get("global_batch", now["global_batch"]) != now["global_batch"]:
        lines.append(
            f"warning: the global batch changed from {saved['global_batch']} to "
            f"{now['global_batch']}; the data order continues from the same step, not the "
            "same sample"
        )
    return lines

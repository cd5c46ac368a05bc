"""`interlace export RUN --to hf OUT`: a checkpoint as a Hugging Face folder that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads: the built-in GPT as GPT-2
(learned positions) or as Llama (rotary positions), a `hf:PATH` model as itself (its weights
under their own names, its config).

OUT receives `model.safetensors` (fp32), `config.json` and, where the run has one, its
tokenizer (`tokenizer_file.py`). Everything is checked before anything is written, and the
folder is written beside OUT under a hidden name, then renamed over it: an error (a full disk
too) leaves OUT as it was, never half-written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from interlace.checkpoint import checkpoint_at, resolve_checkpoint, verify_checkpoint
from interlace.errors import ConfigError, ExportError, OutputError
from interlace.export import gpt2, llama
from interlace.export.full_state import read_full_state
from interlace.export.tokenizer_file import write_tokenizer
from interlace.models import hf
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.plan import Plan
from interlace.run_folder import fsync_path


def export_hf(run: Path, out: Path, step: int | None = None, overwrite: bool = False) -> list[str]:
    """Write the checkpoint of `step` (default: the newest valid one) of the run folder `run`
    as a Hugging Face folder `out`; returns lines telling what was written. Raises an
    InterlaceError subclass, with `out` untouched, for a missing or corrupt checkpoint, a model
    neither GPT-2 nor Llama expresses, pieces that cannot be joined, or a non-empty `out` without
    `overwrite`; OutputError if writing `out` fails (`out` untouched then too)."""
    run, out = Path(run), Path(out)
    _check_out(run, out, overwrite)
    checkpoint = resolve_checkpoint(run) if step is None else checkpoint_at(run, step)
    meta = verify_checkpoint(checkpoint, {})
    hf_fields = meta["model"].get("hf")
    exported = _builtin(checkpoint, meta) if hf_fields is None else _hf(checkpoint, meta, hf_fields)
    with _replaced_folder(out) as folder:
        _save_safetensors(exported.weights, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(exported.config, indent=2) + "\n")
        tokenizer = write_tokenizer(meta["train"], exported.vocab_size, folder)
    plan = Plan.from_dict(meta["plan"])
    return [
        f"exported '{checkpoint}' (step {meta['step']}, plan {plan}) to '{out}': "
        f"{exported.description}",
        tokenizer,
    ]


@dataclass(frozen=True)
class _Exported:
    """What an export writes: weights under Hugging Face names, config.json's fields, the
    vocabulary (for the tokenizer) and a phrase describing the model."""

    weights: dict[str, torch.Tensor]
    config: dict[str, Any]
    vocab_size: int
    description: str


def _builtin(checkpoint: Path, meta: dict[str, Any]) -> _Exported:
    """The built-in GPT of `meta` as Llama if its positions are rotary, else as GPT-2
    (ExportError for what that family cannot express)."""
    config = GPTConfig.from_dict(meta["model"])
    family = llama if config.position_encoding == "rotary" else gpt2
    family.check_expressible(config)
    model = build_model(config, device="meta")
    shapes = {name: param.shape for name, param in model.named_parameters()}
    fields = family.hf_config(model)
    return _Exported(
        family.hf_state(read_full_state(checkpoint, meta, shapes), config),
        fields,
        config.vocab_size,
        f"{fields['architectures'][0]}, {config.num_params():,} parameters, vocabulary "
        f"{config.vocab_size}, context {config.seq_len}",
    )


def _hf(checkpoint: Path, meta: dict[str, Any], fields: dict[str, Any]) -> _Exported:
    """A `hf:PATH` model as itself: every parameter under its own name (a tied head once, as
    transformers saves it), the config the checkpoint recorded."""
    config = hf.config_from_identity(fields)
    with torch.device("meta"):
        model = hf.build_from_config(config)
    shapes = {name: param.shape for name, param in model.named_parameters()}
    weights = read_full_state(checkpoint, meta, shapes)
    params = sum(shape.numel() for shape in shapes.values())
    return _Exported(
        weights,
        config.to_dict(),
        config.vocab_size,
        f"{type(model).__name__}, {params:,} parameters, vocabulary {config.vocab_size}",
    )


def _check_out(run: Path, out: Path, overwrite: bool) -> None:
    """ExportError unless `out` can take the export: absent, an empty folder, or a folder
    `overwrite` allows replacing that is neither the run folder nor one holding it."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"output '{out}' exists and is not a folder; choose another")
    if run.resolve().is_relative_to(out.resolve()):
        raise ExportError(f"output '{out}' holds the run '{run}' itself; choose another folder")
    if any(out.iterdir()) and not overwrite:
        raise ExportError(
            f"output folder '{out}' is not empty; pass --overwrite to replace it, or choose another"
        )


@contextlib.contextmanager
def _replaced_folder(out: Path) -> Iterator[Path]:
    """A new hidden folder beside `out` to write into; when the block ends its files are
    fsync'd and it replaces `out`, or it is removed if the block raised (an OSError, such as a
    full disk, as one OutputError line)."""
    tmp, old = (out.with_name(f".{out.name}.{suffix}") for suffix in ("partial", "old"))
    for stale in (tmp, old):  # left by an export that was killed
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        for file in tmp.iterdir():
            fsync_path(file)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            where = f" ('{exc.filename}')" if exc.filename else ""
            raise OutputError(
                f"writing '{out}' failed: {exc.strerror or exc}{where}; it was left as it was"
            ) from exc
        raise
    shutil.rmtree(old, ignore_errors=True)
    fsync_path(out.parent)


def _save_safetensors(weights: dict[str, torch.Tensor], file: Path) -> None:
    """`weights` as a safetensors `file`, readable as its folder is (safetensors creates files
    readable by their owner only)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError(
            "export to hf needs the `safetensors` package: pip install 'interlace[hf]'"
        ) from None
    save_file(weights, file, metadata={"format": "pt"})
    file.chmod(file.parent.stat().st_mode & 0o666)

"""`interlace export RUN --to hf OUT`: a checkpoint of the built-in GPT as a Hugging Face
GPT-2 folder that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads.

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
from pathlib import Path

import torch

from interlace.checkpoint import checkpoint_at, resolve_checkpoint, verify_checkpoint
from interlace.errors import ConfigError, ExportError, OutputError
from interlace.export.full_state import read_full_state
from interlace.export.gpt2 import check_expressible, gpt2_config, gpt2_state
from interlace.export.tokenizer_file import write_tokenizer
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model
from interlace.plan import Plan
from interlace.run_folder import fsync_path


def export_hf(run: Path, out: Path, step: int | None = None, overwrite: bool = False) -> list[str]:
    """Write the checkpoint of `step` (default: the newest valid one) of the run folder `run`
    as a Hugging Face GPT-2 folder `out`; returns lines telling what was written. Raises an
    InterlaceError subclass, with `out` untouched, for a missing or corrupt checkpoint, a model
    GPT-2 cannot express, pieces that cannot be joined, or a non-empty `out` without
    `overwrite`; OutputError if writing `out` fails (`out` untouched then too)."""
    run, out = Path(run), Path(out)
    _check_out(run, out, overwrite)
    checkpoint = resolve_checkpoint(run) if step is None else checkpoint_at(run, step)
    meta = verify_checkpoint(checkpoint, {})
    config = GPTConfig.from_dict(meta["model"])
    check_expressible(config)
    model = build_model(config, device="meta")
    shapes = {name: param.shape for name, param in model.named_parameters()}
    weights = gpt2_state(read_full_state(checkpoint, meta, shapes), config)
    with _replaced_folder(out) as folder:
        _save_safetensors(weights, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(gpt2_config(model), indent=2) + "\n")
        tokenizer = write_tokenizer(meta["train"], config.vocab_size, folder)
    plan = Plan.from_dict(meta["plan"])
    return [
        f"exported '{checkpoint}' (step {meta['step']}, plan {plan}) to '{out}': "
        f"GPT2LMHeadModel, {config.num_params():,} parameters, vocabulary {config.vocab_size}, "
        f"context {config.seq_len}",
        tokenizer,
    ]


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

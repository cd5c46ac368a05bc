"""Pipeline stage modules of Hugging Face decoder language models (GPT-2, Llama, and kin).

    first stage:  ids [b, T] → token embedding (+ position embedding) → dropout → its layers
    middle stage: h [b, T, d] → its layers → h [b, T, d]
    last stage:   h [b, T, d] → its layers → final norm → LM head → logits [b, T, V]

The parts are found by structure (`find_structure`: token embedding, layer list, final norm,
LM head), not by a table of model names. Every other leaf module outside the layer list must
be one of three kinds, else `DecoderParts.read` raises a PlanError naming it:

- **position embedding**: a second `nn.Embedding` of width d (GPT-2's `wpe`), added to the
  token embedding at positions 0 … T−1;
- **dropout**: an `nn.Dropout` before the layer list (GPT-2's `drop`), after the embeddings;
- **rotary embedding**: a parameter-free module holding an `inv_freq` buffer (Llama's
  `rotary_emb`). This is the one family convention relied on: HF's rotary modules map
  (h, position_ids [1, T]) to (cos, sin), which every decoder layer takes as
  `position_embeddings`; each stage that runs layers evaluates it from the positions.

Each layer is called as HF's own decoder forward calls it, with keywords: `attention_mask`
from HF's `create_causal_mask` for the model's config and attention implementation (None
under sdpa, which then runs causally), `position_ids` [1, T], and the rotary (cos, sin) if
any; no cache. Configs whose `layer_types` name anything but full attention (sliding windows)
are refused, as is a model whose base forward does more than the above (e.g. scales the
embeddings): the tests check GPT-2 and Llama against the full model's own forward.

Like `GPTStage`, a stage references the model's modules (no copy) and keeps their HF names:
`parts` maps "transformer.h.5" (or "model.layers.5") to the module, and `hf_local_module`
gathers a rank's stages into one module with exactly the serial model's parameter names. A
tied LM head on the last stage is an own copy (`copy_head`), summed by `TiedEmbedding`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from interlace.errors import PlanError
from interlace.parallel.detect import find_structure
from interlace.parallel.pipeline.aux_loss import StageAuxLoss
from interlace.parallel.pipeline.partition import seq_len_of
from interlace.parallel.pipeline.stage import copy_head, run_span
from interlace.recompute import checkpointed
from interlace.tensors import is_under

Piece = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DecoderParts:
    """Dotted names of a HF decoder's pipeline parts (None where the model has no such part)."""

    embedding: str
    layers: str
    norm: str
    head: str
    tied: bool
    positions: str | None
    rotary: str | None
    dropouts: tuple[str, ...]
    seq_len: int

    @classmethod
    def read(cls, model: nn.Module) -> DecoderParts:
        """Find the parts of `model` by structure (module docstring); PlanError naming what
        was not understood."""
        try:
            structure = find_structure(model)
        except ValueError as exc:
            raise PlanError(f"pipeline execution: {exc}") from None
        vocab = structure.vocab
        found = {
            "LM head (a linear layer d → vocab mirroring the token embedding)": (
                vocab.head if vocab is not None else None
            ),
            "layer list (an nn.ModuleList of attention blocks)": structure.layers,
            "final norm (a [d] leaf after the layer list)": structure.final_norm,
        }
        missing = [what for what, name in found.items() if name is None]
        if missing or vocab is None or getattr(model, "config", None) is None:
            what = ", ".join(missing) or "config"
            raise PlanError(
                f"pipeline execution of {type(model).__name__}: found no {what}; a pipeline "
                "runs decoder LMs built as embedding → layers → final norm → LM head"
            )
        _check_attention_kinds(model)
        assert structure.layers is not None and structure.final_norm is not None
        assert vocab.head is not None
        known = {vocab.embedding, structure.final_norm, vocab.head}
        positions: list[str] = []
        rotary: list[str] = []
        dropouts: list[str] = []
        after_layers = False
        for name, module in model.named_modules():
            if name == structure.layers:
                after_layers = True
            if name in known or is_under(name, structure.layers):
                continue
            if list(module.children()):
                if list(module.parameters(recurse=False)):
                    raise _unknown(model, name, module, "a container with its own parameters")
                continue
            if isinstance(module, nn.Embedding) and module.embedding_dim == vocab.d_model:
                positions.append(name)
            elif isinstance(module, nn.Dropout) and not after_layers:
                dropouts.append(name)
            elif hasattr(module, "inv_freq") and not list(module.parameters()):
                rotary.append(name)
            else:
                raise _unknown(model, name, module, "not a position or rotary embedding")
        for kind, names in (("position embeddings", positions), ("rotary embeddings", rotary)):
            if len(names) > 1:
                raise PlanError(
                    f"pipeline execution of {type(model).__name__}: {len(names)} {kind} "
                    f"({', '.join(names)}); a stage understands at most one"
                )
        return cls(
            embedding=vocab.embedding,
            layers=structure.layers,
            norm=structure.final_norm,
            head=vocab.head,
            tied=vocab.tied,
            positions=positions[0] if positions else None,
            rotary=rotary[0] if rotary else None,
            dropouts=tuple(dropouts),
            seq_len=seq_len_of(model),
        )


def _unknown(model: nn.Module, name: str, module: nn.Module, why: str) -> PlanError:
    return PlanError(
        f"pipeline execution of {type(model).__name__}: module '{name}' "
        f"({type(module).__name__}) outside the layer list is {why}; a stage understands "
        "token / position embeddings, dropout, rotary embeddings, the final norm and the LM head"
    )


def _check_attention_kinds(model: nn.Module) -> None:
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise PlanError(
            f"pipeline execution of {type(model).__name__}: layer_types {sorted(kinds)} are "
            "not understood; a stage runs full causal attention only"
        )


class HFStage(nn.Module):
    """Layers [start, stop) of a HF decoder, with its embeddings if `first` and its final norm
    and LM head if `last`.

    forward: ids [b, T] (first) or hidden [b, T, d] → hidden [b, T, d], or logits [b, T, V]
    (last). Layers whose global index is in `checkpointed` run under activation checkpointing
    (non-reentrant, in `recompute_mode` "full" or "selective"). `head_copy` makes the last
    stage's LM head an own copy of the tied
    embedding. Same interface as `GPTStage` (`is_first`, `is_last`, `blocks`, `pieces`).
    """

    forward_scopes: tuple[Callable[[], contextlib.AbstractContextManager], ...] = ()
    """Contexts the forward runs inside (set by `PipelineRunner`)."""

    def __init__(
        self,
        model: nn.Module,
        parts: DecoderParts,
        layers: range,
        *,
        first: bool,
        last: bool,
        checkpointed: frozenset[int] = frozenset(),
        recompute_mode: str = "full",
        head_copy: bool = False,
    ) -> None:
        super().__init__()
        self.is_first, self.is_last = first, last
        self.checkpointed, self.recompute_mode = checkpointed, recompute_mode
        self.config = model.config
        names: list[str] = []
        if first:
            names += [parts.embedding, *filter(None, [parts.positions]), *parts.dropouts]
        names += [f"{parts.layers}.{i}" for i in layers]
        if last:
            names += [parts.norm, parts.head]
        self.parts = {name: model.get_submodule(name) for name in names}
        if last and head_copy:
            self.parts[parts.head] = copy_head(self.parts[parts.head])
        self.model = named_holder(self.parts)  # registers the parts under their HF names
        self.rotary = model.get_submodule(parts.rotary) if parts.rotary else None
        self.blocks = nn.ModuleDict({str(i): self.parts[f"{parts.layers}.{i}"] for i in layers})
        self._names = parts
        self.aux = StageAuxLoss([], 0.0)  # a HF decoder's loss here is its cross-entropy

    def forward(
        self, x: torch.Tensor, start: int = 0, stop: int | None = None, checkpoint: bool = True
    ) -> torch.Tensor:
        """See the class docstring for the shapes; `stage.run_span` for the arguments."""
        return run_span(self, x, start, stop, checkpoint)

    def run_piece(self, piece: Piece, recomputed: bool, x: torch.Tensor) -> torch.Tensor:
        """`piece(x)`, under torch's checkpoint in `recompute_mode` when `recomputed` (no
        tensor parallelism here: no reduction to replay)."""
        if not recomputed:
            return piece(x)
        return checkpointed(piece, self.recompute_mode, x, replay_reductions=False)

    def pieces(self) -> list[tuple[Piece, bool]]:
        """The stage's computation in order, as (function, checkpointed) pairs: the embedding
        (first stage), each layer, the head (last stage)."""
        out: list[tuple[Piece, bool]] = []
        if self.is_first:
            out.append((self._embed, False))
        for i, layer in self.blocks.items():
            out.append((self._layer_call(layer), int(i) in self.checkpointed))
        if self.is_last:
            out.append((self._head, False))
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.parts[self._names.embedding](ids)
        if self._names.positions is not None:
            h = h + self.parts[self._names.positions](_positions(h))
        for name in self._names.dropouts:
            h = self.parts[name](h)
        return h

    def _layer_call(self, layer: nn.Module) -> Piece:
        def run(h: torch.Tensor) -> torch.Tensor:
            return layer(h, **self._layer_kwargs(h))

        return run

    def _layer_kwargs(self, h: torch.Tensor) -> dict[str, object]:
        """What HF's decoder forward passes every layer: causal mask, positions, rotary."""
        from transformers.masking_utils import create_causal_mask  # the optional hf extra

        positions = _positions(h)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=h,
            attention_mask=None,
            past_key_values=None,
            position_ids=positions,
        )
        kwargs: dict[str, object] = {"attention_mask": mask, "position_ids": positions}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(h, positions)
        return kwargs

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        return self.parts[self._names.head](self.parts[self._names.norm](h))


def _positions(h: torch.Tensor) -> torch.Tensor:
    """Position ids [1, T] of a sequence h [b, T, …] (no cache: positions start at 0)."""
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def named_holder(parts: Mapping[str, nn.Module]) -> nn.Module:
    """A module holding each of `parts` at its dotted name ("model.layers.3" becomes
    holder.model.layers[3]), so its parameters carry the original model's names."""
    root = nn.Module()
    for name, module in parts.items():
        *path, leaf = name.split(".")
        parent = root
        for step in path:
            if step not in parent._modules:
                parent.add_module(step, nn.Module())
            parent = parent._modules[step]
        parent.add_module(leaf, module)
    return root


def hf_local_module(stages: Sequence[HFStage]) -> nn.Module:
    """One module holding every parameter of this rank's `stages` under the HF model's own
    names (e.g. transformer.wte, transformer.h.<i>, lm_head): what the optimizer and
    checkpoints see."""
    parts: dict[str, nn.Module] = {}
    for stage in stages:
        parts.update(stage.parts)
    return named_holder(parts)

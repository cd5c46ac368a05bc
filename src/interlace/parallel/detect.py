"""Find the parts of a transformer that tensor parallelism splits, by module structure alone.

No table of module names: a model is read through the shapes of its layers. A *linear layer* is
an `nn.Linear` (weight [out, in]) or Hugging Face's `Conv1D` (weight [in, out]). With d the
token embedding width:

- **token embedding / LM head**: the `nn.Embedding` [V, d] whose shape a linear layer d → V
  mirrors (the LM head; tied when both hold the same Parameter). Without such a head, the
  embedding with the most rows. Other embeddings (positions) stay replicated.
- **attention**: a module whose direct linear children are producers reading d and one output
  projection (the last child writing d) whose input width equals the query width: three
  producers q, k, v (k and v may be narrower: grouped-query attention), or one fused producer
  of width 3·(query width) in q, k, v order (GPT-2's `c_attn`). Head width from the module's
  `head_dim`, or its width divided by a head-count attribute.
- **feed-forward**: one or two producers d → f (up, or gate and up) and a down projection f → d.
- **Mixture-of-Experts block with fused experts** (Hugging Face Mixtral, Qwen2-MoE, ...): a
  module whose children are a router holding one parameter [E, d], an experts module holding
  exactly two parameters, gate|up [E, 2F, d] and down [E, d, F], and optionally a shared
  feed-forward expert with its gate (a linear layer d → 1). Tensor parallelism splits every
  expert's F; expert parallelism splits the E experts (`ExpertBlock`, `find_expert_blocks`).
- **other Mixture-of-Experts layers**: a module with a child list of ≥ 2 feed-forward experts,
  or any other child holding ≥ 3-D parameters: left whole, replicated (expert parallelism is
  the `ep` dimension's work).
- **layer list**: the `nn.ModuleList` holding the attention blocks; **final norm**: the last
  parameterised leaf after it whose parameters are all [d] (the norm before the head).

Any other linear layer is left replicated and reported with the reason: `Structure.report()`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from interlace.tensors import is_under

Layout = Literal["linear", "conv1d"]

HEAD_COUNT_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads")
"""Attention-module attributes that hold the query head count (by convention, not by model)."""


def _conv1d_type() -> type | None:
    """HF's Conv1D class if transformers is loaded (a model holding one has loaded it)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def linear_shape(module: nn.Module) -> tuple[int, int, Layout] | None:
    """(in_features, out_features, layout) of a linear layer, None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, "linear"
    conv1d = _conv1d_type()
    if conv1d is not None and isinstance(module, conv1d):
        n_in, n_out = module.weight.shape
        return n_in, n_out, "conv1d"
    return None


@dataclass(frozen=True)
class Attention:
    """An attention block: `producers` (q, k, v child names, or one fused q|k|v) → `out`."""

    name: str
    producers: tuple[str, ...]
    out: str
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def fused(self) -> bool:
        """True when one layer computes q, k and v side by side (width 3·n_heads·head_dim)."""
        return len(self.producers) == 1


@dataclass(frozen=True)
class FeedForward:
    """A feed-forward block: `producers` (up, or gate and up: d → ffn_dim) → `down` (→ d)."""

    name: str
    producers: tuple[str, ...]
    down: str
    ffn_dim: int


@dataclass(frozen=True)
class ExpertBlock:
    """A Mixture-of-Experts block with fused experts; child and parameter names are local.

    `router`: the child holding the routing weight [n_experts, d_model]; `experts`: the child
    holding `gate_up` [n_experts, 2·ffn_dim, d_model] (gate rows, then up rows) and `down`
    [n_experts, d_model, ffn_dim]; `shared`: a shared feed-forward expert (its `name` is the
    full module name), added to the routed output after scaling by sigmoid(`shared_gate`(x)).
    """

    name: str
    router: str
    experts: str
    gate_up: str
    down: str
    n_experts: int
    d_model: int
    ffn_dim: int
    shared: FeedForward | None = None
    shared_gate: str | None = None


@dataclass(frozen=True)
class Vocab:
    """Token embedding [vocab, d_model] and the LM head d_model → vocab (None if not found)."""

    embedding: str
    head: str | None
    tied: bool
    vocab: int
    d_model: int


@dataclass
class Structure:
    """What tensor parallelism will split in a model, and what it leaves replicated (notes).

    `experts` names every Mixture-of-Experts layer, those in `expert_blocks` (which 1D tensor
    parallelism splits) included; the others stay whole."""

    d_model: int
    vocab: Vocab | None
    attentions: list[Attention] = field(default_factory=list)
    feed_forwards: list[FeedForward] = field(default_factory=list)
    expert_blocks: list[ExpertBlock] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    layers: str | None = None
    final_norm: str | None = None
    notes: list[str] = field(default_factory=list)

    def report(self) -> list[str]:
        """One line per found part and per module left replicated, naming the module."""
        lines = []
        if self.vocab is not None:
            v = self.vocab
            head = f"LM head {v.head}" + (" (tied)" if v.tied else "") if v.head else "no LM head"
            lines.append(
                f"{v.embedding}: token embedding [{v.vocab}, {v.d_model}], vocab-parallel; {head}"
            )
        for a in self.attentions:
            kind = "fused q|k|v" if a.fused else "q, k, v"
            lines.append(
                f"{a.name}: attention ({kind} = {', '.join(a.producers)} → {a.out}), "
                f"{a.n_heads} heads, {a.n_kv_heads} kv heads of width {a.head_dim}"
            )
        for f in self.feed_forwards:
            lines.append(
                f"{f.name}: feed-forward ({', '.join(f.producers)} → {f.down}), "
                f"ffn width {f.ffn_dim}"
            )
        for b in self.expert_blocks:
            shared = f", shared expert {b.shared.name}" if b.shared else ""
            lines.append(
                f"{b.name}: Mixture-of-Experts block (router {b.router}, {b.n_experts} experts "
                f"fused in {b.experts}, ffn width {b.ffn_dim}{shared})"
            )
        return lines + self.notes


def find_structure(model: nn.Module) -> Structure:
    """Read `model`'s attention, feed-forward, MoE, embedding, head, layer list and final norm
    from its module shapes (see the module docstring); nothing is modified."""
    modules = dict(model.named_modules())
    vocab = _find_vocab(model)
    if vocab is None:
        raise ValueError(
            "no token embedding (nn.Embedding) found: tensor parallelism needs the model "
            "width, read from the token embedding"
        )
    structure = Structure(d_model=vocab.d_model, vocab=vocab)
    claimed: list[str] = []
    for name, module in modules.items():
        if name == "" or is_under(name, *claimed):
            continue
        block = expert_block(name, module)
        if block is not None and block.d_model == vocab.d_model:
            structure.expert_blocks.append(block)
            structure.experts.append(name)
            claimed.append(name)
            continue
        if _is_experts(module, vocab.d_model):
            structure.experts.append(name)
            structure.notes.append(
                f"{name}: Mixture-of-Experts layer left replicated on every tensor parallel "
                "rank (its experts are split by expert parallelism, plan.ep)"
            )
            claimed.append(name)
            continue
        found = _classify(name, module, vocab.d_model)
        if isinstance(found, Attention):
            structure.attentions.append(found)
            claimed.append(name)
        elif isinstance(found, FeedForward):
            structure.feed_forwards.append(found)
            claimed.append(name)
        elif isinstance(found, str):
            structure.notes.append(found)
            claimed.append(name)
    for name, module in modules.items():
        shape = linear_shape(module)
        if shape is None or is_under(name, *claimed) or name == vocab.head:
            continue
        structure.notes.append(
            f"{name}: linear layer {shape[0]} → {shape[1]} outside any attention or "
            "feed-forward block, left replicated"
        )
    for name, module in modules.items():
        if isinstance(module, nn.Embedding) and name != vocab.embedding:
            structure.notes.append(
                f"{name}: embedding [{module.num_embeddings}, {module.embedding_dim}] is not "
                "the token embedding (no LM head of its shape), left replicated"
            )
    structure.layers = _find_layers(model, structure)
    structure.final_norm = _find_final_norm(model, structure)
    return structure


def _find_vocab(model: nn.Module) -> Vocab | None:
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None
    linears = [(n, m, linear_shape(m)) for n, m in model.named_modules()]
    best: Vocab | None = None
    for emb_name, emb in embeddings:
        rows, width = emb.num_embeddings, emb.embedding_dim
        for head_name, head, shape in linears:
            if shape is None or shape[:2] != (width, rows) or shape[2] != "linear":
                continue
            tied = head.weight is emb.weight
            candidate = Vocab(emb_name, head_name, tied, rows, width)
            if best is None or (tied, rows) > (best.tied, best.vocab):
                best = candidate
    if best is not None:
        return best
    emb_name, emb = max(embeddings, key=lambda item: item[1].num_embeddings)
    return Vocab(emb_name, None, False, emb.num_embeddings, emb.embedding_dim)


def find_expert_blocks(model: nn.Module) -> list[ExpertBlock]:
    """Every Mixture-of-Experts block with fused experts in `model`, outermost first (see
    `expert_block`); needs no token embedding."""
    blocks: list[ExpertBlock] = []
    for name, module in model.named_modules():
        if not is_under(name, *(b.name for b in blocks)) and (block := expert_block(name, module)):
            blocks.append(block)
    return blocks


def expert_block(name: str, module: nn.Module) -> ExpertBlock | None:
    """`module` (named `name`) as an ExpertBlock, or None: its children must be exactly a
    router (one parameter [E, d]), fused experts (two parameters, [E, 2F, d] and [E, d, F]),
    and optionally a feed-forward shared expert and a linear d → 1 shared gate."""
    if list(module.parameters(recurse=False)):
        return None
    children = [(n, c, list(c.parameters(recurse=False))) for n, c in module.named_children()]
    fused = [(n, c, ps) for n, c, ps in children if any(p.dim() == 3 for p in ps)]
    if len(fused) != 1:
        return None
    experts_name, experts, _ = fused[0]
    shapes = _fused_shapes(experts)
    if shapes is None:
        return None
    gate_up, down, (n_experts, d, ffn) = shapes
    router = shared = shared_gate = None
    for child_name, child, params in children:
        if child is experts or not any(True for _ in child.parameters()):
            continue
        found = _classify(f"{name}.{child_name}", child, d)
        shape = linear_shape(child)
        if len(params) == 1 and tuple(params[0].shape) == (n_experts, d) and router is None:
            router = child_name
        elif isinstance(found, FeedForward) and shared is None:
            shared = found
        elif shape is not None and shape[:2] == (d, 1) and shared_gate is None:
            shared_gate = child_name
        else:
            return None
    if router is None or (shared_gate is not None and shared is None):
        return None
    return ExpertBlock(
        name, router, experts_name, gate_up, down, n_experts, d, ffn, shared, shared_gate
    )


def _fused_shapes(experts: nn.Module) -> tuple[str, str, tuple[int, int, int]] | None:
    """(gate|up name, down name, (E, d, F)) if `experts` holds exactly the parameters
    [E, 2F, d] and [E, d, F] (in either order) and no children with parameters."""
    params = list(experts.named_parameters())
    if len(params) != 2 or any(p.dim() != 3 for _, p in params):
        return None
    for (up_name, up), (down_name, down) in (params, params[::-1]):
        n_experts, width, d = up.shape
        if width % 2 == 0 and tuple(down.shape) == (n_experts, d, width // 2):
            return up_name, down_name, (n_experts, d, width // 2)
    return None


def _linear_children(module: nn.Module) -> list[tuple[str, int, int]]:
    out = []
    for child_name, child in module.named_children():
        shape = linear_shape(child)
        if shape is not None:
            out.append((child_name, shape[0], shape[1]))
    return out


def _is_experts(module: nn.Module, d: int) -> bool:
    for child in module.children():
        experts = isinstance(child, nn.ModuleList) and len(child) >= 2
        if experts and all(isinstance(_classify("", e, d), FeedForward) for e in child):
            return True
        fused = any(p.dim() >= 3 for p in child.parameters(recurse=False))
        if fused and not isinstance(child, nn.modules.conv._ConvNd):
            return True
    return False


def _classify(name: str, module: nn.Module, d: int) -> Attention | FeedForward | str | None:
    """Attention or FeedForward if `module` is one; a note (str) if its linear children look
    like a block but fit neither; None if it is no block at all."""
    children = _linear_children(module)
    writers = [c for c in children if c[2] == d]
    if len(children) < 2 or not writers:
        return None
    out = writers[-1]
    producers = [c for c in children if c is not out]
    listing = ", ".join(f"{n}: {i} → {o}" for n, i, o in children)
    why = f"{name}: left replicated, its linear layers ({listing}) "
    if any(i != d for _, i, _ in producers):
        return why + f"do not all read the model width {d}"
    widths = [o for _, _, o in producers]
    if len(producers) <= 2 and all(w == out[1] for w in widths):
        return FeedForward(name, tuple(n for n, _, _ in producers), out[0], out[1])
    q_width = out[1]
    if len(producers) == 1 and widths[0] == 3 * q_width:
        kv_width = q_width
    elif len(producers) == 3 and widths[0] == q_width and widths[1] == widths[2]:
        kv_width = widths[1]
    else:
        return why + "match neither attention (q, k, v → out) nor feed-forward (up → down)"
    head_dim = _head_dim(module, q_width)
    if head_dim is None or q_width % head_dim or kv_width % head_dim:
        return why + "look like attention, but its head width is unknown (no `head_dim`)"
    return Attention(
        name,
        tuple(n for n, _, _ in producers),
        out[0],
        q_width // head_dim,
        kv_width // head_dim,
        head_dim,
    )


def _head_dim(module: nn.Module, q_width: int) -> int | None:
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    for attr in HEAD_COUNT_ATTRS:
        heads = getattr(module, attr, None)
        if isinstance(heads, int) and heads > 0 and q_width % heads == 0:
            return q_width // heads
    return None


def _find_layers(model: nn.Module, structure: Structure) -> str | None:
    if not structure.attentions:
        return None
    first = structure.attentions[0].name
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and is_under(first, name):
            return name
    return None


def _find_final_norm(model: nn.Module, structure: Structure) -> str | None:
    if structure.layers is None:
        return None
    after, found = False, None
    for name, module in model.named_modules():
        if name == structure.layers:
            after = True
            continue
        if not after or is_under(name, structure.layers):
            continue
        if structure.vocab is not None and name == structure.vocab.head:
            break
        params = list(module.parameters(recurse=False))
        if params and not list(module.children()) and all(_is_width(p, structure) for p in params):
            found = name
    return found


def _is_width(param: torch.Tensor, structure: Structure) -> bool:
    return param.dim() == 1 and param.shape[0] == structure.d_model

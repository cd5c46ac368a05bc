"""Attention head bookkeeping shared by 1D and 3D tensor parallelism: the attributes a split
attention module must see updated (head counts, kv heads, query width, heads per kv head), and
the report words for the heads one rank holds."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from interlace.parallel.detect import HEAD_COUNT_ATTRS, Attention

KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
"""Attention attributes holding the kv head count."""


WIDTH_ATTRS = ("split_size", "embed_dim", "hidden_size")
"""Attention attributes holding the query width (divided only when equal to it)."""


GROUP_ATTRS = ("num_key_value_groups",)
"""Attention attributes holding query heads per kv head."""


def heads_held(a: Attention, heads: int, kv_heads: int, replicas: int, ranks: str) -> str:
    """Report words for the heads one rank holds: "2 of 4 heads, 1 of 2 kv heads (each on 2
    ranks)"; `ranks` names the ranks sharing a kv head."""
    kv = ""
    if a.n_kv_heads != a.n_heads:
        kv = f", {kv_heads} of {a.n_kv_heads} kv heads"
        kv += f" (each on {replicas} {ranks})" if replicas > 1 else ""
    return f"{heads} of {a.n_heads} heads{kv}"


def set_local_heads(module: nn.Module, a: Attention, heads: int, kv_heads: int) -> None:
    """Set the head-count and width attributes of attention `module` that hold `a`'s full
    values to this rank's `heads` query and `kv_heads` kv heads (by attribute convention)."""
    _update_attrs(module, HEAD_COUNT_ATTRS, a.n_heads, heads)
    _update_attrs(module, KV_HEAD_ATTRS, a.n_kv_heads, kv_heads)
    _update_attrs(module, WIDTH_ATTRS, a.n_heads * a.head_dim, heads * a.head_dim)
    _update_attrs(module, GROUP_ATTRS, a.n_heads // a.n_kv_heads, heads // kv_heads)


def _update_attrs(module: nn.Module, names: Iterable[str], full: int, local: int) -> None:
    for name in names:
        if getattr(module, name, None) == full and not isinstance(getattr(module, name), bool):
            setattr(module, name, local)

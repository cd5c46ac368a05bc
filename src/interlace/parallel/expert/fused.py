"""Expert parallelism for Mixture-of-Experts blocks with fused experts (`ExpertBlock`: Hugging
Face Mixtral, Qwen2-MoE, any block of the same structure), through `ExpertParallelMoE`.

Such a block routes by itself and then calls its experts module as
`experts(hidden [N, d], top_k_index [N, k], top_k_weights [N, k]) → [N, d]`, the experts' weights
fused for all E of them: gate|up [E, 2F, d] and down [E, d, F]. `FusedExpertParallel` takes
the experts module's place under the same call, so the block's own router, shared expert and
output code run unchanged on every rank:

- the routing it is handed becomes a dropless `Routing` (`_GivenRouting`: every assignment
  kept, no load-balancing loss of its own: the model keeps computing its own from the router
  it still holds);
- this rank's E/D experts become `FusedExpert` modules, one per expert, holding its slices
  gate|up [2F, d] and down [d, F] under the fused parameters' names, registered under the
  expert's global index like every expert-parallel layer
  (`<block>.<experts>.experts.<e>.<gate_up name>`);
- dispatch, combine, replicas (Trans / Agg) and the balancing strategies are
  `ExpertParallelMoE`'s own; `run_experts` computes the experts it is given (this rank's, or
  replicas) stacked, in one grouped call (`interlace.moe.grouped.grouped_mlp`).

Each expert computes down · (act(gate · x) ⊙ (up · x)), with the gate rows first in gate|up and
`act` the experts module's `act_fn`, as the fused module does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from interlace.comm import Group
from interlace.errors import PlanError
from interlace.matmul import PLAIN, Matmul
from interlace.moe.balance import Balancer
from interlace.moe.gating import Routing
from interlace.moe.grouped import grouped_mlp
from interlace.parallel.detect import ExpertBlock
from interlace.parallel.expert.layer import ExpertParallelMoE


class FusedExpert(nn.Module):
    """One expert of a fused experts module: x [n, d] → down · (act(gate · x) ⊙ (up · x)) [n, d],
    with parameters `<gate_up_name>` [2F, d] (gate rows, then up rows) and `<down_name>` [d, F]."""

    matmul: Matmul = PLAIN
    """Computes the products (`interlace.matmul`); a converter may set another."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        names: tuple[str, str],
        act: Callable[[torch.Tensor], torch.Tensor],
    ):
        super().__init__()
        self.names = names
        self.act = act
        for name, value in zip(names, (gate_up, down), strict=True):
            self.register_parameter(name, nn.Parameter(value.detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, d] → [n, d]."""
        gate_up, down = (getattr(self, name) for name in self.names)
        return self.matmul.linear(self.glu(self.matmul.linear(x, gate_up)), down)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) ⊙ up of the hidden [n, 2F] (gate columns, then up columns) → [n, F]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class _GivenRouting(nn.Module):
    """The router of `ExpertParallelMoE` for a block that routed its tokens itself: returns the
    choice handed to `give` as a dropless `Routing` (the `dropless` flag is kept for the
    balancers; this routing never drops)."""

    def __init__(self, n_experts: int, d_model: int):
        super().__init__()
        self.n_experts = n_experts
        self.d_model = d_model
        self.dropless = True
        self._given: tuple[torch.Tensor, torch.Tensor] | None = None

    def give(self, index: torch.Tensor, weights: torch.Tensor) -> None:
        """Hand over the next call's choice: expert `index` [N, k] and gate `weights` [N, k]."""
        self._given = (index, weights)

    def forward(self, x: torch.Tensor) -> Routing:
        """Routing of the N tokens x [N, d] from the choice last handed to `give`."""
        if self._given is None:
            raise RuntimeError("fused experts called without their routing (top_k_index)")
        (index, weights), self._given = self._given, None
        if index.shape != weights.shape or index.shape[0] != x.shape[0]:
            raise ValueError(
                f"routing of shape {tuple(index.shape)} with weights {tuple(weights.shape)} "
                f"for {x.shape[0]} tokens; expected [N, k] both"
            )
        index = index.long()
        return Routing(
            expert_index=index,
            gate_weight=weights,
            keep=torch.ones_like(index, dtype=torch.bool),
            aux_loss=x.new_zeros((), dtype=torch.float32),
            tokens_per_expert=torch.bincount(index.flatten(), minlength=self.n_experts),
            capacity=None,
        )


@dataclass
class _FusedExperts:
    """The fused experts as `ExpertParallelMoE` takes them: `len()` is E, `expert(e)` expert e
    as a `FusedExpert`."""

    gate_up: torch.Tensor
    down: torch.Tensor
    names: tuple[str, str]
    act: Callable[[torch.Tensor], torch.Tensor]

    def __len__(self) -> int:
        return self.gate_up.shape[0]

    def expert(self, e: int) -> FusedExpert:
        return FusedExpert(self.gate_up[e], self.down[e], self.names, self.act)


@dataclass
class _Layer:
    """What `ExpertParallelMoE` is built from: a `router` and the `experts`."""

    router: nn.Module
    experts: _FusedExperts


class FusedExpertParallel(ExpertParallelMoE):
    """`ExpertParallelMoE` in place of a fused experts module (`block`'s `experts` child,
    given whole and identical on every rank): called as the fused module is,
    (hidden [N, d], top_k_index [N, k], top_k_weights [N, k]) → [N, d]; keeps this rank's
    E/D experts. `balance`, `history`, `overlap` as for `ExpertParallelMoE`."""

    def __init__(
        self,
        fused: nn.Module,
        block: ExpertBlock,
        group: Group,
        balance: str | Balancer = "none",
        history: int = 16,
        overlap: bool = True,
    ):
        where = f"{block.name}.{block.experts}"
        act = getattr(fused, "act_fn", None)
        if not callable(act):
            raise PlanError(
                f"{where}: fused experts without an `act_fn` attribute; expert parallelism "
                "needs the experts' activation (gate rows first in gate|up, act_fn on them)"
            )
        gate_up, down = getattr(fused, block.gate_up), getattr(fused, block.down)
        experts = _FusedExperts(gate_up, down, (block.gate_up, block.down), act)
        router = _GivenRouting(block.n_experts, block.d_model)
        super().__init__(_Layer(router, experts), group, balance, history, overlap)

    @torch.compiler.disable  # as ExpertParallelMoE.forward, which it calls
    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """[N, d] tokens routed to experts `top_k_index` [N, k] with `top_k_weights` [N, k] →
        [N, d]; collective over the expert group. Never traced by torch.compile. Under ep ×
        tp the routing is cut to the tokens this rank dispatches, as its hidden states are
        (`tp_tokens`): the block routed them all, alike on every tp rank."""
        share = self.tokens
        if share is not None:
            top_k_index, top_k_weights = share.enter(top_k_index), share.enter(top_k_weights)
        self.router.give(top_k_index, top_k_weights)
        return super().forward(hidden)

    def run_experts(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """`FusedExpert`s stacked in `params` ({gate|up name: [n, 2F, d], down name:
        [n, d, F]}) on x [M, d] sorted by expert, `counts` [n] → [M, d], in one grouped call."""
        template = next(iter(self.experts.values()))
        gate_up, down = (params[name] for name in template.names)
        return grouped_mlp(x, counts, gate_up, None, down, None, template.glu)


def parallelize_fused_experts(
    model: nn.Module,
    blocks: list[ExpertBlock],
    group: Group,
    balance: str | Balancer,
    history: int,
    overlap: bool,
) -> list[tuple[str, ExpertParallelMoE]]:
    """Replace each of `blocks`' experts module in `model` by a `FusedExpertParallel` over
    `group` (in place); return (name, layer) per block, in model order."""
    layers = []
    for block in blocks:
        parent = model.get_submodule(block.name)
        fused = getattr(parent, block.experts)
        parallel = FusedExpertParallel(fused, block, group, balance, history, overlap)
        setattr(parent, block.experts, parallel)
        layers.append((f"{block.name}.{block.experts}", parallel))
    return layers


def fused_expert_slices(model: nn.Module) -> dict[str, tuple[str, int]]:
    """{name of a parameter of an expert this rank keeps: (name of the fused parameter [E, ...]
    of the full model it is a slice of, its expert index)} of every `FusedExpertParallel` in
    `model`: `<layer>.experts.<e>.<name>` is `<layer>.<name>`[e]."""
    return {
        f"{layer}.experts.{e}.{name}": (f"{layer}.{name}", int(e))
        for layer, module in model.named_modules()
        if isinstance(module, FusedExpertParallel)
        for e, expert in module.experts.items()
        for name in expert.names
    }

"""Expert parallelism: the experts of each MoE layer split over the ranks of an `ep` group.

An expert group of D ranks shares the E experts of a layer, E/D each: expert e lives on rank
e // (E/D) (its owner). The router is replicated. Each rank routes its own tokens, then

    1. all-gathers its [E] routing counts → the [D, E] count matrix on every rank (token
       counts per source rank and expert; also the routing statistics, `routing_history`);
    2. sorts its kept assignments by expert (so by owner) and all-to-alls the token rows to
       the owners, uneven splits read off the count matrix (dispatch);
    3. each owner runs its experts on what it received, all in one grouped call
       (`interlace.moe.grouped`: the rows sorted by expert, the experts' weights stacked in
       each forward: the layer keeps its experts one module each, to place and move them);
    4. all-to-alls the results back (combine), weights them by the gates and adds them into
       token order: y_n = Σ_j keep[n, j] · gate[n, j] · expert_{e[n, j]}(x_n), as `MoELayer`.

Both all-to-alls are autograd functions whose backward is the reverse all-to-all; each is
written here over `interlace.comm` (rather than taken from functional collectives) so that the
meter counts both directions.

**Capacity under EP.** Capacity is per rank, as in DeepSpeed: each rank applies
C = ceil(capacity_factor · N_rank · k / E) to its own N_rank tokens, so an expert receives at
most D · C tokens. The layer therefore computes exactly what `MoELayer` computes on each rank's
tokens separately — the same tokens drop as in plain data parallelism with the same per-rank
batch, whatever `ep` is. The aux loss is each rank's own, as under data parallelism. Under
ep × tp a rank routes its share of its tp group's tokens (`tokens`, a `tp_tokens.TokenShare`):
capacity and aux loss are that share's.

**Balancing** (`interlace.moe.balance`). A strategy may add replicas to the placement: for a
replicated expert, the owner sends its parameters to the replica ranks (Trans, in the forward)
and the replica ranks compute that expert on the tokens they routed to it themselves, which
then skip the dispatch. Trans is one all-to-all of flattened parameters rather than broadcasts:
it reaches exactly the chosen subset of ranks without a process group per subset, and moves
every replicated expert of the layer in one call. Trans is an autograd function whose
backward sends the replicas' gradients back and sums them into the owner's (Agg), so the owner
alone holds the expert's gradient and optimizer state. Every token meets the same parameters as
without replicas: output, loss and gradients equal the dropless layer's (up to the order of
floating-point sums).

**Planning overlapped with the all-to-all** (Pro-Prophet's scheduler). When the next training
iteration replans (`Balancer.due`), the layer starts the balancer's search on a background
thread (`BackgroundSearch`, one per layer and search) right after it has gathered this
iteration's [D, E] count matrix, so the search runs while the layer's dispatch, experts and
combine, the rest of the forward, the backward and the optimizer step run (collectives and
matmuls release the GIL). The next training iteration applies the result where the
synchronous search used to run: just before it issues the layer's Trans (at the start of the
layer's forward, or after the previous layer's dispatch with `overlap`), waiting for the thread
if it is still running and raising its exception there. The search is a deterministic function
of the gathered counts, which are the same on every rank, so every rank applies the same
placement at the same point without talking; the search issues no collective, so the order of
collectives is untouched, and the placement (hence the math) is the one the synchronous search
on the previous iteration's counts gives. `plan_timing` (in `balance_summary`) records the
search's wall time and how long the layer waited for it.

**Overlap** (Pro-Prophet's scheduler; `overlap=True`, the default). A block is an MoE layer
and the non-MoE compute up to the next one; `schedule_transfers` links the layers in forward
order. Trans of layer l+1 is planned (its placement applied) and issued asynchronously (a metered
`comm.all_to_all(..., async_op=True)`) right after layer l's dispatch, so it flies during
layer l's expert compute and combine, the block's non-MoE compute, and layer l+1's routing,
count all-gather, dispatch and local experts; layer l+1 waits on the handle only when it
computes its replicas. The first layer issues its own Trans at the start of its forward. In the
backward, Agg is issued asynchronously where the synchronous path runs it; a callback queued on
the autograd engine waits on it at the end of the backward pass (the latest point before the
expert gradients are reduced and stepped) and adds the replicas' gradients into the owner's
`.grad`. The collectives, their bytes and the math are those of the synchronous path
(`overlap=False`); only the forward order moves. The balancer prices Trans and Agg as hidden
only when the layer overlaps them (`Balancer.for_layer`), unless it was told explicitly.

**Gradients.** Router gradients are local (each rank's own tokens), like every non-expert
parameter: average them over dp as usual. An owner's expert gradient is the sum over its expert
group's tokens; to equal data parallelism's average over dp, sum it over the ep_dp group and
divide by dp (`reduce_expert_gradients`), and leave expert parameters out of the dp all-reduce
(`expert_parameter_names`); under sharded data parallelism FSDP2 shards the experts over ep_dp
and its reduce-scatter does both (`shard.py`). Gradient norms must count each expert once:
`grad_norm` and `clip_grad_norm_` sum the expert squares over the ep group. Local experts are
registered under their global index (`experts["5"]`), so checkpoint keys name the same expert
on every rank and every `ep`, the keys a layer of stacked experts stores them under
(`moe.experts.expert_keys`).

Collectives run in the same order on every rank, backward included: every rank issues the
count all-gather, Trans (when anything is replicated), dispatch and combine in every forward,
with empty shares where it has nothing to send (with overlap, layer l+1's Trans between layer
l's dispatch and combine).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from interlace import comm
from interlace.comm import Group
from interlace.divisors import divisors
from interlace.errors import ConfigError, PlanError
from interlace.moe.balance import (
    BackgroundSearch,
    Balancer,
    ExpertSize,
    Placement,
    PlanTiming,
    balance_degree,
    device_loads,
    make_balancer,
)
from interlace.moe.gating import expert_counts
from interlace.moe.grouped import mlp_experts, run_by_expert
from interlace.moe.layer import MoELayer
from interlace.parallel.expert.comm import all_to_all_rows, keep_in_graph
from interlace.parallel.expert.local import LocalExperts
from interlace.parallel.expert.trans import InFlight, Trans, TransRoute
from interlace.precision import compute_dtype

if TYPE_CHECKING:
    from interlace.parallel.expert.split import ExpertSplit
    from interlace.parallel.expert.tp_tokens import TokenShare


class ExpertParallelMoE(nn.Module):
    """An `MoELayer` with its experts split over `group`: [B, T, d_model] → [B, T, d_model].

    Built from a full local `MoELayer` (identical on every rank of the group: same seed), whose
    router it takes over and of whose experts it keeps this rank's E/D, each copied out as an
    `MLP` of its own (`GroupedExperts.expert`) registered under its global index in `experts`
    (`LocalExperts`, which stacks their parameters when called). Any module with a `router`
    (tokens [N, d] → `Routing`; attributes `d_model`, `dropless`) and `experts` (`len()`: E;
    `expert(e)`: expert e, a module) will do; experts other than `MLP` need a subclass whose
    `run_experts` computes them stacked: `fused.py` builds one from a block with fused experts
    (HF Mixtral). `balance` is a strategy name or a `Balancer`; one that forces dropless routing
    sets the router's `dropless` flag.

    After each forward: `aux_loss` (this rank's load-balancing loss) and
    `last_tokens_per_expert` ([E], this rank's routed counts) as in `MoELayer`; in training mode
    `routing_history` gains the [D, E] count matrix (tokens routed from rank s to expert e,
    before capacity drops, on the CPU), at most `history` of them, newest last. `placement` is
    the expert placement in use. `tokens` (ep × tp, set by `apply.share_tokens_over_tp`):
    which of the input's tokens this rank routes and dispatches; None: all of them. `split`
    (etp, set by `tp_split.split_experts_over_tp`): each expert split over the tp group.

    `overlap` (default) issues Trans and Agg asynchronously (module docstring, "Overlap");
    False runs them synchronously inside the forward and backward. The balancer is bound to it
    (`Balancer.for_layer`): a prophet strategy left at `overlap=None` prices Trans and Agg as
    hidden exactly when the layer overlaps them. `schedule_transfers` links consecutive layers
    so that each issues the next one's Trans. Placement searches run on a background thread
    (module docstring, "Planning overlapped with the all-to-all").
    """

    def __init__(
        self,
        layer: MoELayer,
        group: Group,
        balance: str | Balancer = "none",
        history: int = 16,
        overlap: bool = True,
    ):
        super().__init__()
        n_experts = len(layer.experts)
        if n_experts % group.size:
            raise PlanError(
                f"{n_experts} experts cannot be split over ep={group.size} ranks; use ep in "
                f"{divisors(n_experts)}"
            )
        if history < 1:
            raise ConfigError(f"history={history} must be >= 1 (iterations of routing counts)")
        self.group = group
        balancer = make_balancer(balance) if isinstance(balance, str) else balance
        self.balancer = balancer.for_layer(overlap)
        self.router = layer.router
        if self.balancer.dropless is not None:
            self.router.dropless = self.balancer.dropless
        self.num_experts = n_experts
        self.num_local = n_experts // group.size
        self.first_expert = group.rank * self.num_local
        local = range(self.first_expert, self.first_expert + self.num_local)
        self.experts = LocalExperts({str(e): layer.experts.expert(e) for e in local})
        self.base_placement = Placement.blocked(n_experts, group.size)
        self.placement = self.base_placement
        self.routing_history: deque[torch.Tensor] = deque(maxlen=history)
        self.iteration = 0
        self.aux_loss = torch.zeros(())
        self.last_tokens_per_expert = torch.zeros(n_experts, dtype=torch.long)
        self.overlap = overlap
        self.tokens: TokenShare | None = None  # ep × tp: the tokens this rank dispatches
        self.split: ExpertSplit | None = None  # etp: each expert split over tp
        self._next: tuple[ExpertParallelMoE, ...] = ()  # a tuple: not registered as a child
        self._inflight: InFlight | None = None  # this layer's Trans, issued ahead of it
        self._planning: BackgroundSearch | None = None  # the next replan's search, running
        self.plan_timing: PlanTiming | None = None  # of the newest search applied

        self.measure_experts()

    def measure_experts(self) -> None:
        """Read what one local expert holds (names, elements; `expert_size`, which the
        balancer prices): at construction, and again after its parameters are split
        (`tp_split`)."""
        template = self._local_experts()[0]
        self._param_names = [name for name, _ in template.named_parameters()]
        self._numel = sum(p.numel() for p in template.parameters())
        matmul = sum(p.numel() for p in template.parameters() if p.dim() >= 2)
        element = next(template.parameters()).element_size()
        d_model = self.router.d_model
        self.expert_size = ExpertSize(d_model * element, self._numel * element, 2 * matmul)

    def _local_experts(self) -> list[nn.Module]:
        return list(self.experts.values())

    def _expert_params(self) -> list[nn.Parameter]:
        return [p for e in self._local_experts() for p in e.parameters()]

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable  # a compiled block runs the rest of itself compiled around it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] → [B, T, d_model]; collective over the expert group. Never traced
        by torch.compile: the all-to-alls' splits are read on the host and the placement
        search runs on a thread of its own."""
        tokens = x.reshape(-1, x.shape[-1])
        share, n = self.tokens, tokens.shape[0]
        if share is not None:
            tokens = share.enter(tokens)
        trans = self._take_inflight()
        placement = trans.placement
        routing = self.router(tokens)
        self.aux_loss = routing.aux_loss if share is None else share.aux_loss(routing.aux_loss)
        self.last_tokens_per_expert = routing.tokens_per_expert.detach()
        routed, kept = self._gather_counts(routing)
        if self.split is not None:  # the placements of a tp group's pieces must agree
            routed = self.split.total(routed)
        if self.training:
            self.routing_history.append(routed.cpu().clone())
            self.iteration += 1
            self._start_plan(self.routing_history[-1])  # runs under the all-to-alls below

        index = torch.arange(tokens.shape[0], device=x.device).unsqueeze(1)
        expert = routing.expert_index[routing.keep]
        token = index.expand_as(routing.expert_index)[routing.keep]
        gate = routing.gate_weight[routing.keep]
        replica_mask = placement.replica_mask().to(x.device)  # [D, E]
        here = replica_mask[self.group.rank][expert]
        sent = torch.where(replica_mask, 0, kept)  # [D, E] tokens that travel to the owner

        out = self._dispatch_and_combine(tokens, expert[~here], token[~here], gate[~here], sent)
        if trans.replicas is not None:
            replicas = trans.wait()
            assignments = expert[here], token[here], gate[here]
            self._compute_replicas(out, tokens, replicas, trans.experts, *assignments)
            out = keep_in_graph(out, replicas)
        if share is not None:
            out = share.leave(out, n)
        return out.view_as(x)

    def _gather_counts(self, routing) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather ([D, E] routed, [D, E] kept) counts: one [E] vector per rank when
        dropless (they coincide), [2, E] with capacity."""
        routed = routing.tokens_per_expert
        shard = routed
        if routing.capacity is not None:
            kept = torch.bincount(routing.expert_index[routing.keep], minlength=self.num_experts)
            shard = torch.stack([routed, kept])
        shard = shard.reshape(-1).contiguous()
        gathered = shard.new_empty(self.group.size * shard.numel())
        comm.all_gather(gathered, shard, self.group)
        matrix = gathered.view(self.group.size, -1, self.num_experts)
        return matrix[:, 0], matrix[:, -1]

    def _dispatch_and_combine(
        self,
        tokens: torch.Tensor,
        expert: torch.Tensor,
        token: torch.Tensor,
        gate: torch.Tensor,
        sent: torch.Tensor,
    ) -> torch.Tensor:
        """Send this rank's assignments (expert, token, gate) [M] to the experts' owners, run
        the owners' experts, bring the results back and add gate · result into token order
        [N, d]. `sent` [D, E]: assignments every rank sends to each expert's owner."""
        d, rank, local = self.group.size, self.group.rank, self.num_local
        input_splits = sent[rank].view(d, local).sum(dim=1).tolist()
        received = sent[:, self.first_expert : self.first_expert + local]  # [D, local]
        output_splits = received.sum(dim=1).tolist()

        order = torch.argsort(expert, stable=True)
        token, gate = token[order], gate.index_select(0, order)
        inbox = all_to_all_rows(
            tokens.index_select(0, token), self.group, output_splits, input_splits
        )
        self._issue_next_trans()  # flies during these experts and the non-MoE compute after
        results = self._run_local_experts(inbox, received)
        back = all_to_all_rows(results, self.group, input_splits, output_splits)
        out = torch.zeros_like(tokens)
        out.index_add_(0, token, (back * gate.unsqueeze(1).to(back.dtype)).to(out.dtype))
        return out

    def _run_local_experts(self, inbox: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """Rows of `inbox` arrive by source rank, then local expert (counts `received`
        [D, local]); run the local experts on them in one grouped call (`run_experts`) and
        return the results in arrival order."""
        params = self.experts(compute_dtype(inbox))  # stacked (FSDP2 gathers them here)
        return run_by_expert(lambda x, n: self._run(params, x, n), inbox, received)

    def _run(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """`run_experts` on x [M, d] sorted by expert, `counts` [n]; with the experts split over
        tp, on the rows of every rank of the tp group, this rank's rows of the sum returned
        (`ExpertSplit.run`)."""
        if self.split is None:
            return self.run_experts(params, x, counts)
        return self.split.run(lambda rows, n: self.run_experts(params, rows, n), x, counts)

    def run_experts(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The experts whose parameters `params` holds stacked ({name: [n, *shape]}, names as
        in one local expert) on x [M, d] sorted by expert, `counts` [n] → [M, d], in one
        grouped call: `MLP` experts (`mlp_experts`); subclasses with other experts override.
        Under etp each computes its part of the sum over its tp group (`ExpertSplit`)."""
        if self.split is not None:
            params = self.split.params(params)
        return mlp_experts(self._local_experts()[0], params, x, counts)

    # ------------------------------------------------------------------ replicas
    def _start_plan(self, counts: torch.Tensor) -> None:
        """If the next training iteration replans (it is due, or the strategy finds the placement
        in use stale for these counts), start its search from this iteration's count matrix
        `counts` [D, E] (CPU, never modified) on a background thread; `_replan` applies it. A
        search started earlier and never applied is superseded."""
        balancer, base, size = self.balancer, self.base_placement, self.expert_size
        if not (balancer.due(self.iteration) or balancer.stale(counts, self.placement, base, size)):
            return
        self._planning = BackgroundSearch(
            lambda: balancer.search(counts, base, size), name=f"interlace-plan-{id(self):x}"
        )

    def _replan(self) -> None:
        """At a planning iteration, apply the placement the background search found from the
        previous iteration's counts (waiting for it if it is still running; its exception, if
        any, is raised here)."""
        if self._planning is not None:
            planning, self._planning = self._planning, None
            self.placement, self.plan_timing = planning.result(self.iteration)

    def _issue_trans(self) -> InFlight:
        """Apply the planned placement (at a planning iteration, in training) and issue this
        layer's Trans (autograd: Agg): asynchronous with `overlap`, else complete on return."""
        if self.training:
            self._replan()
        params = self._expert_params()
        versions = tuple(p._version for p in params)
        placement = self.placement
        if not placement.replicated:
            return InFlight(placement, None, (), None, versions)
        route = TransRoute.build(placement, self.group.rank, self._numel)
        works: list[dist.Work | None] = []
        replicas = Trans.apply(route, self.group, self.overlap, works, *params)
        return InFlight(placement, replicas, route.recv_experts, works[0], versions)

    def _issue_next_trans(self) -> None:
        """With `overlap`, issue the next layer's Trans now (every rank at the same point)."""
        if not (self.overlap and self._next):
            return
        following = self._next[0]
        if following._inflight is not None:  # issued earlier and never used: drop it
            following._inflight.wait()
        following._inflight = following._issue_trans()

    def _take_inflight(self) -> InFlight:
        """This layer's Trans: the one issued ahead of it if its parameters have not changed
        since (an optimizer step in between makes it stale), else one issued now."""
        trans, self._inflight = self._inflight, None
        if trans is not None:
            if trans.versions == tuple(p._version for p in self._expert_params()):
                return trans
            trans.wait()
        return self._issue_trans()

    def _compute_replicas(
        self,
        out: torch.Tensor,
        tokens: torch.Tensor,
        replicas: torch.Tensor,
        replicated_here: tuple[int, ...],
        expert: torch.Tensor,
        token: torch.Tensor,
        gate: torch.Tensor,
    ) -> None:
        """Add gate · expert(token) into `out` for the assignments (expert, token, gate) to
        experts replicated here, all run in one grouped call on their received flat parameters
        (`replicas`, [R · numel], ascending by expert as `replicated_here`)."""
        if not replicated_here:
            return
        template = self._local_experts()[0]
        shapes = [p.shape for p in template.parameters()]
        sizes = [math.prod(shape) for shape in shapes]
        pieces = replicas.view(len(replicated_here), self._numel).split(sizes, dim=1)
        params = {
            name: piece.reshape(-1, *shape)
            for name, piece, shape in zip(self._param_names, pieces, shapes, strict=True)
        }
        held = torch.tensor(replicated_here, device=expert.device)
        replica = torch.searchsorted(held, expert)  # each assignment's row in `replicas`
        order = torch.argsort(replica, stable=True)
        token, gate = token[order], gate.index_select(0, order)
        counts = expert_counts(replica, len(replicated_here))
        y = self._run(params, tokens.index_select(0, token), counts)
        out.index_add_(0, token, (y * gate.unsqueeze(1).to(y.dtype)).to(out.dtype))

    # ------------------------------------------------------------------ metrics
    def balance_summary(self) -> dict[str, Any]:
        """For the newest count matrix C [D, E] (`counts`, tokens routed from rank s to expert
        e): tokens computed per rank [D] under the base placement and under the current one
        (`tokens_base`, `tokens`), their balance degree (std), and the replicated experts with
        their replica ranks. Once a placement search has been applied, its timing
        (`plan_timing`): `plan_search_s` (its wall seconds on the background thread),
        `plan_wait_s` (seconds the layer waited for it), `plan_hidden_s` (the rest, run under
        the layer's work) and `plan_iteration` (the iteration it was applied at). Empty before
        any step."""
        if not self.routing_history:
            return {}
        counts = self.routing_history[-1]
        base, _ = device_loads(counts, self.base_placement)
        balanced, _ = device_loads(counts, self.placement)
        replicated = self.placement.replicated
        summary: dict[str, Any] = {
            "balance_degree_base": balance_degree(counts, self.base_placement),
            "balance_degree": balance_degree(counts, self.placement),
            "replicated": list(replicated),
            "replicas": [list(self.placement.replicas[e]) for e in replicated],
            "counts": counts.tolist(),
            "tokens_base": [int(v) for v in base.tolist()],
            "tokens": [int(v) for v in balanced.tolist()],
        }
        timing = self.plan_timing
        if timing is not None:
            summary |= {
                "plan_search_s": timing.search_s,
                "plan_wait_s": timing.wait_s,
                "plan_hidden_s": timing.hidden_s,
                "plan_iteration": timing.iteration,
            }
        return summary


def schedule_transfers(layers: list[ExpertParallelMoE]) -> None:
    """Link `layers`, given in forward order, so that each issues the next one's Trans right
    after its own dispatch (when the layers overlap); the last issues none (so one layer
    passed alone is unlinked). Every rank must link the same layers."""
    for layer, following in itertools.pairwise(layers):
        layer._next = (following,)
    if layers:
        layers[-1]._next = ()


# ---------------------------------------------------------------------- gradients

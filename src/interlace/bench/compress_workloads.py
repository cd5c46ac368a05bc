"""Workloads with really sparse gradients, for the compression hooks and their benchmark.

Each builder returns a `Workload`: the model (same initial weights on every rank for the same
`seed`), an endless iterator of batches (different on each `rank`) and the loss of a batch,
`loss(module, batch)` (module: the model or its DDP wrapper, whose forward must run). Ids
follow a Zipf law (P(id = k) ∝ (k + 1)^−s), as tokens and item ids do.

- `gpt_workload`: the built-in GPT with a large vocabulary and small width. Only the embedding
  rows of the batch's tokens get gradient — but our GPT ties `lm_head` to `wte`, and the LM head's
  softmax gives every vocabulary row a gradient, so with `tied=True` the embedding gradient is
  dense. `tied=False` (the default) gives `lm_head` its own weight (initialised as a copy): the
  `wte` gradient is then sparse (≈ unique tokens / vocab) and `lm_head`'s stays dense, so the
  buckets holding `wte` are the ones the sketch can shrink.
- `click_workload`: a recommendation-style click model, several large `nn.Embedding` tables
  (dense gradients, `sparse=False`) and a small MLP, on synthetic clicks whose probability is a
  hidden function of the ids; each table's gradient density is ≈ unique ids in the batch / rows.

`DensityProbe` wraps any comm hook and records each DDP bucket's density; `grad_density`
reports each parameter's after a backward pass.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from interlace.loss import causal_lm_loss
from interlace.models.config import GPTConfig
from interlace.models.gpt import build_model

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    """A model, an endless iterator of its batches, and `loss(module, batch)`: the mean loss on
    one batch (a 0-d tensor to back-propagate) of `module`, the model or a wrapper of it."""

    model: nn.Module
    batches: Iterator[Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]


class Zipf:
    """Sampler of ids in [0, n) with P(k) ∝ (k + 1)^−exponent (inverse CDF, vectorised)."""

    def __init__(self, n: int, exponent: float, device: torch.device | str = "cpu") -> None:
        ranks = torch.arange(1, n + 1, dtype=torch.float64, device=device)
        cdf = torch.cumsum(ranks.pow(-exponent), 0)
        self.cdf = cdf / cdf[-1]
        self.n = n

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """int64 ids of `shape`; `generator` must live on the sampler's device."""
        u = torch.rand(shape, generator=generator, dtype=torch.float64, device=self.cdf.device)
        return torch.searchsorted(self.cdf, u).clamp_(max=self.n - 1)


def _generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def gpt_workload(
    vocab_size: int = 32768,
    d_model: int = 32,
    n_layers: int = 2,
    n_heads: int = 2,
    seq_len: int = 64,
    batch_size: int = 8,
    tied: bool = False,
    zipf_exponent: float = 1.1,
    seed: int = 0,
    rank: int = 0,
    device: torch.device | str = "cpu",
) -> Workload:
    """The GPT with a large vocabulary; batches are (tokens [B, T], next tokens [B, T]).

    `tied=False` unties `lm_head` from `wte` so that `wte`'s gradient is sparse (module doc).
    """
    config = GPTConfig(vocab_size, seq_len, d_model, n_layers, n_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(config)
    if not tied:
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    model.to(device)
    ids = Zipf(vocab_size, zipf_exponent, device)
    gen = _generator(seed * 7919 + rank + 1, device)

    def batches() -> Iterator[Batch]:
        while True:
            tokens = ids.sample((batch_size, seq_len + 1), gen)
            yield tokens[:, :-1], tokens[:, 1:]

    def loss(module: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return causal_lm_loss(module(x), y, model)

    return Workload(model, batches(), loss)


class ClickModel(nn.Module):
    """Click-through model: one embedding per id feature, concatenated, then an MLP.

    forward(ids [B, F]) → click logits [B]; the loss is binary cross-entropy against labels
    in {0, 1}.
    """

    def __init__(self, table_rows: tuple[int, ...], dim: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, dim) for rows in table_rows)
        self.mlp = nn.Sequential(
            nn.Linear(len(table_rows) * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, F] → logits [B]."""
        features = torch.cat([table(ids[:, f]) for f, table in enumerate(self.tables)], dim=1)
        return self.mlp(features).squeeze(1)


def click_workload(
    table_rows: tuple[int, ...] = (200_000, 100_000, 50_000, 20_000),
    dim: int = 16,
    hidden: int = 64,
    batch_size: int = 256,
    zipf_exponent: float = 1.05,
    seed: int = 0,
    rank: int = 0,
    device: torch.device | str = "cpu",
) -> Workload:
    """ClickModel on synthetic clicks; batches are (ids [B, F], labels [B]).

    A hidden score per id (the same on every rank) sets the click probability
    sigmoid(Σ_f score_f[id_f] / sqrt(F)); ids of each feature are Zipf-distributed.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ClickModel(table_rows, dim, hidden)
    model.to(device)
    shared = _generator(seed, device)
    scores = [torch.randn(rows, generator=shared, device=device) for rows in table_rows]
    samplers = [Zipf(rows, zipf_exponent, device) for rows in table_rows]
    gen = _generator(seed * 7919 + rank + 1, device)
    scale = len(table_rows) ** -0.5

    def batches() -> Iterator[Batch]:
        while True:
            ids = torch.stack([z.sample((batch_size,), gen) for z in samplers], dim=1)
            logit = sum(s[ids[:, f]] for f, s in enumerate(scores)) * scale
            labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
            yield ids, labels

    def loss(module: nn.Module, batch: Batch) -> torch.Tensor:
        ids, labels = batch
        return F.binary_cross_entropy_with_logits(module(ids), labels)

    return Workload(model, batches(), loss)


def grad_density(model: nn.Module) -> dict[str, float]:
    """{parameter name: fraction of non-zero gradient entries} after a backward pass."""
    return {
        name: float((p.grad != 0).sum()) / p.numel()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


@dataclass
class DensityProbe:
    """Wraps a comm hook and its state; `densities` {bucket index: nnz/numel of this rank's
    bucket at its last call} and `numels` {bucket index: elements} follow DDP's rebuilds.

    ddp.register_comm_hook(DensityProbe(group, comm.ddp_allreduce_hook), density_probe_hook)
    """

    state: Any
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
    densities: dict[int, float] = field(default_factory=dict)
    numels: dict[int, int] = field(default_factory=dict)


def density_probe_hook(
    probe: DensityProbe, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Record the bucket's density, then run the wrapped hook."""
    flat, index = bucket.buffer(), bucket.index()
    probe.densities[index] = float((flat != 0).sum()) / max(1, flat.numel())
    probe.numels[index] = flat.numel()
    if bucket.is_last():
        for stale in [i for i in probe.densities if i > index]:
            del probe.densities[stale], probe.numels[stale]
    return probe.hook(probe.state, bucket)

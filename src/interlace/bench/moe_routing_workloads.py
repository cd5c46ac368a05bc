"""Routing workloads for MoE load-balancing experiments: who sends how many tokens to which expert.

Two sources of expert popularity, both read through `popularity(step, source, layer)` → [E]
probabilities (source = the device the tokens start on):

- `SkewedRouting`: a synthetic Zipf-like popularity. Expert of rank r (in a fixed random order)
  gets weight (r + 1)^−exponent; the log-weights then drift by a mean-reverting random walk
  (step size `drift`, pulled back towards the Zipf baseline), so adjacent iterations look alike
  while the hot set shifts over tens of iterations. Each source device sees the popularity
  tilted by a fixed per-device preference of strength `locality`, so the tokens of one expert
  come unevenly from the devices (what a subset placement can exploit).
- `RecordedRouting`: the per-step, per-MoE-layer token counts of a real training run of the
  built-in MoE-GPT (`record_routing`), replayed step by step (cycling when the run is shorter).
  The recording is single-process, so every source device replays the same popularity.

`sample_assignments` draws top-k expert choices (token → experts) for a batch from a popularity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from interlace.errors import ConfigError


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key) + 7) % (2**62)
    return torch.Generator().manual_seed(seed)


@dataclass
class SkewedRouting:
    """Zipf-like, slowly drifting expert popularity over `num_experts` experts (module docstring).

    exponent: Zipf exponent s (0 = uniform; larger = more skewed).
    drift: standard deviation of the per-iteration change of each expert's log-weight.
    reversion: fraction of the distance back to the Zipf baseline closed per iteration.
    locality: strength of each source device's fixed preference (0 = all devices alike).
    seed: the workload; the same seed gives the same popularities on every process.
    """

    num_experts: int
    exponent: float = 1.2
    drift: float = 0.05
    reversion: float = 0.02
    locality: float = 0.5
    seed: int = 0
    _walks: dict[int, list[torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"num_experts={self.num_experts} must be >= 1")
        if self.exponent < 0 or self.drift < 0 or self.locality < 0:
            raise ConfigError("exponent, drift and locality must be >= 0")
        if not 0 <= self.reversion <= 1:
            raise ConfigError(f"reversion={self.reversion} must be in [0, 1]")

    def _baseline(self, layer: int) -> torch.Tensor:
        """Zipf log-weights −s·log(rank + 1), ranks in a random order per layer."""
        order = torch.randperm(self.num_experts, generator=_generator(self.seed, layer, 1))
        ranks = torch.empty(self.num_experts, dtype=torch.float64)
        ranks[order] = torch.arange(self.num_experts, dtype=torch.float64)
        return -self.exponent * torch.log1p(ranks)

    def _log_weights(self, step: int, layer: int) -> torch.Tensor:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        walk = self._walks.setdefault(layer, [self._baseline(layer)])
        base = walk[0]
        while len(walk) <= step:
            noise = torch.randn(
                self.num_experts,
                generator=_generator(self.seed, layer, 2, len(walk)),
                dtype=torch.float64,
            )
            previous = walk[-1]
            walk.append(previous + self.reversion * (base - previous) + self.drift * noise)
        return walk[step]

    def popularity(self, step: int, source: int = 0, layer: int = 0) -> torch.Tensor:
        """[E] float64 probabilities of an assignment going to each expert at iteration `step`,
        for tokens starting on device `source`, in MoE layer `layer`."""
        logw = self._log_weights(step, layer)
        if self.locality > 0:
            tilt = torch.randn(
                self.num_experts,
                generator=_generator(self.seed, layer, 3, source),
                dtype=torch.float64,
            )
            logw = logw + self.locality * tilt
        return torch.softmax(logw, dim=0)


@dataclass(frozen=True)
class RecordedRouting:
    """Routing counts recorded from a training run: counts [steps, layers, E] (assignments per
    expert, before capacity drops), and the recorded model's top_k."""

    counts: torch.Tensor
    top_k: int = 1
    model: str = ""

    @property
    def num_experts(self) -> int:
        """E of the recorded model."""
        return int(self.counts.shape[-1])

    @property
    def num_layers(self) -> int:
        """MoE layers of the recorded model."""
        return int(self.counts.shape[1])

    def popularity(self, step: int, source: int = 0, layer: int = 0) -> torch.Tensor:
        """[E] float64 share of assignments per expert at recorded step `step` (cycled) of
        recorded MoE layer `layer` (cycled); the same for every source."""
        row = self.counts[step % self.counts.shape[0], layer % self.num_layers].to(torch.float64)
        return row / row.sum().clamp(min=1)


def sample_assignments(
    popularity: torch.Tensor, num_tokens: int, top_k: int, generator: torch.Generator
) -> torch.Tensor:
    """[num_tokens, top_k] long: each token's distinct experts, drawn from `popularity` [E]
    without replacement (first choice by popularity, the second among the rest)."""
    if top_k > popularity.numel():
        raise ConfigError(f"top_k={top_k} exceeds the {popularity.numel()} experts")
    weights = popularity.to(torch.float64).clamp(min=1e-12).expand(num_tokens, -1)
    return torch.multinomial(weights, top_k, replacement=False, generator=generator)


def record_routing(
    model: str = "moe-tiny",
    steps: int = 4,
    global_batch: int = 4,
    seq_len: int | None = None,
    data: str | None = None,
    seed: int = 0,
    warmup_steps: int = 20,
) -> RecordedRouting:
    """Train the built-in MoE-GPT preset `model` for `steps` steps in this process on the
    built-in corpus (or `data`) and record every MoE layer's routed counts per step
    (`last_tokens_per_expert`, summed over the step's micro-batches). `warmup_steps` is the
    learning-rate warm-up (the training default); with none, a fresh router collapses and
    jumps between experts from one step to the next."""
    from interlace.models.presets import get_preset
    from interlace.moe.layer import MoELayer
    from interlace.plan import Plan
    from interlace.train import Trainer, prepare_run
    from interlace.train_config import TrainConfig

    preset = get_preset(model)
    if not preset.is_moe:
        raise ConfigError(f"model '{model}' has no MoE layer; use a moe-* preset")
    config = TrainConfig(
        model=model,
        data=data,
        steps=max(steps, 1),
        global_batch=global_batch,
        seq_len=seq_len,
        warmup_steps=warmup_steps,
        eval_every=0,
        out=None,
        progress=False,
        seed=seed,
    )
    trainer = Trainer(prepare_run(config, Plan(), 1))
    layers = [m for m in trainer.model.modules() if isinstance(m, MoELayer)]
    sums: list[torch.Tensor] = []

    def accumulate(module: MoELayer, _inputs: object, _output: object) -> None:
        sums[layers.index(module)] += module.last_tokens_per_expert.cpu()

    hooks = [layer.register_forward_hook(accumulate) for layer in layers]
    rows = []
    try:
        for _ in range(steps):
            sums[:] = [torch.zeros(preset.n_experts, dtype=torch.long) for _ in layers]
            trainer.train_step()
            rows.append(torch.stack(sums))
    finally:
        for hook in hooks:
            hook.remove()
    return RecordedRouting(torch.stack(rows), top_k=preset.top_k, model=model)

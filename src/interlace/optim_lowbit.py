"""AdamW with its two moments kept in bf16 and rounded stochastically (`--optimizer-state bf16`):
4 bytes of optimizer state per parameter instead of fp32's 8. Weights stay fp32.

Written here because torch's AdamW keeps its moments in the parameter's dtype and has neither a
bf16-state mode nor stochastic rounding. Rounding to nearest would not do: a moment whose change
in one step is below half a bf16 unit in the last place (2^-9 to 2^-8 of its value) never
moves, so with beta2 = 0.95 the second moment stops short of a squared gradient within 4 to
8 % of it, and the first moment of a gradient that shrinks slowly stalls. Stochastic rounding
rounds up with the probability of the remainder's share of that unit, so each stored moment
equals its fp32 value in expectation and small changes add up.

Each step, one tensor after the other (so that widened moments exist for one tensor at a time:
a whole group's would take back the saving at the step's peak), the moments are widened to
fp32, the update is torch's AdamW's (the same operations in the same order; `torch.optim.AdamW`
with fp32 moments equals it up to the moments' rounding), and the fp32 moments are stored back
rounded stochastically. A DTensor (FSDP2's shard) is updated through its local piece, its
state a DTensor like torch's.

The random bits of a tensor's step come from a generator seeded afresh from (the run's seed,
the tensor's position in the optimizer, its step count): data-parallel replicas of a tensor
round alike and stay equal, and a resumed run draws the bits the uninterrupted one drew, so it
continues bit for bit with no generator state in the checkpoint (which holds the step counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from interlace.tensors import local_tensor

_LOW_BITS = 1 << 16
"""fp32's 16 mantissa bits below bf16's last one."""
_MOMENTS = ("exp_avg", "exp_avg_sq")


def stochastic_round_(out: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """Write `value` (fp32) into `out` (bf16, the same shape), each element rounded to one of
    its two bf16 neighbours with probability proportional to its closeness to it: uniform
    random bits from `generator` are added below bf16's last mantissa bit, then those bits are
    dropped (a carry rounds the magnitude up). `value` is overwritten with the rounded value."""
    noise = torch.randint(
        0, _LOW_BITS, value.shape, dtype=torch.int32, device=value.device, generator=generator
    )
    value.view(torch.int32).add_(noise).bitwise_and_(-_LOW_BITS)
    out.copy_(value)  # exact: the dropped bits are zero


def rounding_seed(run_seed: int, position: int, step: int) -> int:
    """The generator seed of step `step` of the optimizer's `position`-th tensor in a run seeded
    `run_seed`: the three packed into 64 bits (16, 16 and 32), then mixed by splitmix64's
    finaliser so that every bit depends on all three (torch's CPU generator keeps only a
    seed's low 32 bits)."""
    z = (run_seed % (1 << 16)) << 48 | (position % (1 << 16)) << 32 | step % (1 << 32)
    z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9 % (1 << 64)
    z = (z ^ z >> 27) * 0x94D049BB133111EB % (1 << 64)
    return z ^ z >> 31


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's update) over fp32 `params` with exp_avg and
    exp_avg_sq stored in bf16 by `stochastic_round_`; `seed` seeds the rounding (see the module
    docstring). State per parameter as torch's: "step" (0-d fp32 on the CPU), "exp_avg",
    "exp_avg_sq" (the parameter's shape, bf16)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int = 0,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self.register_load_state_dict_post_hook(_moments_in_bf16)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW update of every parameter that has a gradient; returns `closure()`'s loss
        (evaluated first, with gradients enabled) when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = (p for group in self.param_groups for p in group["params"])
        groups = (group for group in self.param_groups for _ in group["params"])
        for position, (param, group) in enumerate(zip(params, groups, strict=True)):
            if param.grad is not None:
                self._update(param, group, position)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any], position: int) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for name in _MOMENTS:
                state[name] = torch.zeros_like(param, dtype=torch.bfloat16)
        state["step"] += 1
        step = int(state["step"])
        lr, (beta1, beta2) = group["lr"], group["betas"]
        weight = local_tensor(param)
        grad = local_tensor(param.grad).float()
        exp_avg = local_tensor(state["exp_avg"]).float()
        exp_avg_sq = local_tensor(state["exp_avg_sq"]).float()
        weight.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
        generator = self._generator(weight.device)
        generator.manual_seed(rounding_seed(self.seed, position, step))
        stochastic_round_(local_tensor(state["exp_avg"]), exp_avg, generator)
        stochastic_round_(local_tensor(state["exp_avg_sq"]), exp_avg_sq, generator)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def _moments_in_bf16(optimizer: torch.optim.Optimizer) -> None:
    """Store the moments in bf16 again after `load_state_dict`, which casts every floating
    point state tensor to its parameter's dtype (fp32); bf16 moments come back exactly."""
    for state in optimizer.state.values():
        for name in _MOMENTS:
            if name in state:
                state[name] = state[name].to(torch.bfloat16)

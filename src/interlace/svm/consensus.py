"""Distributed mode: the rows are split across ranks and solved by consensus ADMM.

Rank k of K holds rows A_k [n_k, d] and labels y_k [n_k] ∈ {−1, +1} (n = Σ n_k). The problem is
the single-process one, rewritten with a local copy (x_k, b_k) of the weights and intercept per
rank and one shared (z, β):

    min  Σ_k (1/n) 1ᵀξ_k + P(z)
    s.t. x_k − z = 0,  b_k − β = 0,  H_k x_k + b_k·y_k + ξ_k − 1 − s_k = 0,  ξ_k, s_k ≥ 0  ∀k

with H_k = diag(y_k)·A_k. Every feasible point has x_k = z and b_k = β on all ranks, and then
Σ_k 1ᵀξ_k / n is the full hinge loss (1/n) Σ_i max(0, 1 − y_i(a_iᵀz + β)) at its minimum over
ξ, so the minimisers are exactly those of the single-process problem. Note the weight 1/n
(global n), not 1/n_k. With scaled duals u1_k [d], v_k (intercept), u2_k [n_k] and ρ = ρ1/ρ2,
one iteration is

    x_k = (H_kᵀH_k + ρI)⁻¹ (ρ(z − u1_k) + H_kᵀ(1 + s_k − ξ_k − u2_k − b_k·y_k))   (local)
    b_k = (ρ(β − v_k) + y_kᵀ(1 + s_k − ξ_k − u2_k − H_k x_k)) / (ρ + n_k)        (local)
    z   = prox_{P/(K·ρ1)}(mean_k(x_k + u1_k)),  β = mean_k(b_k + v_k)          (one all-reduce)
    ξ_k = max(0, 1 + s_k − u2_k − H_k x_k − b_k·y_k − 1/(n·ρ2))                 (local)
    s_k = max(0, H_k x_k + ξ_k − 1 + u2_k + b_k·y_k)                             (local)
    u1_k += x_k − z;  v_k += b_k − β;  u2_k += H_k x_k + ξ_k − 1 − s_k + b_k·y_k

and the stopping rule is the single-process one on the global objective at (z, β). Its hinge sum
rides in the next iteration's all-reduce, so each iteration costs one all-reduce of d + 2 numbers
(the last iteration's local x-update is computed and dropped). The all-reduce goes through
`interlace.comm`, so every rank sees the same values and stops at the same iteration. Written
by hand because torch.distributed offers the collectives but no consensus solver.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils.validation import check_array

from interlace import comm
from interlace.svm import admm
from interlace.svm.linsolve import GramSolver
from interlace.svm.penalties import penalty_value, prox
from interlace.svm.settings import DEFAULTS, SVMSettings


class ConsensusResult(NamedTuple):
    """The shared model: `coef` [d] (exactly sparse), `intercept`, iterations run."""

    coef: np.ndarray
    intercept: float
    n_iter: int


def fit_consensus(
    X_local, y_local, group: comm.Group, settings: SVMSettings = DEFAULTS
) -> ConsensusResult:
    """Fit the penalised SVM with `settings` on rows split across the ranks of `group`; call on
    every rank.

    X_local [n_k, d] (dense or sparse; d equal on all ranks, n_k ≥ 1), y_local [n_k] in
    {−1, +1}. `settings.rho2=None` is 1/n for the global n. Returns the same `ConsensusResult` on
    every rank. Bad input raises ValueError on every rank (the ranks agree on the check first, so
    none is left waiting).
    """
    penalty, lam, theta = settings.penalty, settings.lam, settings.shape
    try:
        A = check_array(X_local, accept_sparse="csr", dtype=np.float64, ensure_min_samples=0)
        y = np.asarray(y_local, dtype=float).ravel()
        problem = _local_problem(A, y)
    except ValueError:  # still take part in the agreement below, so no rank hangs
        A, y, problem = np.zeros((0, 0)), np.zeros(0), _UNREADABLE
    n_k, d = A.shape
    n = _agree_on_input(n_k, d, problem, group)
    rho1, rho2 = settings.rho1, settings.rho2_for(n)
    rho = rho1 / rho2
    K = group.size

    H = admm.signed_rows(A, y)
    gram = GramSolver(H, rho)
    x, z, u1 = np.zeros(d), np.zeros(d), np.zeros(d)
    xi, s, u2 = np.zeros(n_k), np.zeros(n_k), np.zeros(n_k)
    b = beta = v = 0.0
    # One all-reduce per iteration carries [Σ(x_k + u1_k), Σ(b_k + v_k), hinge sum at (z, β)]:
    # the objective of iterate t arrives with iteration t + 1, where the stopping test runs.
    shared = torch.zeros(d + 2, dtype=torch.float64)
    history: list[float] = []
    converged = False
    t = 0  # z-updates done so far
    while True:
        x = gram.solve(rho * (z - u1) + H.T @ (1.0 + s - xi - u2 - b * y))
        Hx = H @ x
        if settings.fit_intercept:
            b = (rho * (beta - v) + float(y @ (1.0 + s - xi - u2 - Hx))) / (rho + n_k)
        shared[:d] = torch.from_numpy(x + u1)
        shared[d] = b + v
        shared[d + 1] = float(np.maximum(0.0, 1.0 - (H @ z + beta * y)).sum())
        comm.all_reduce(shared, group)
        total = shared.numpy()
        if t > 0:
            history.append(total[d + 1] / n + float(penalty_value(z, penalty, lam, theta).sum()))
            if t > 1 and admm.relative_change(history[-1], history[-2]) < settings.tol:
                converged = True
                break
            if t == settings.max_iter:
                break
        z = prox(total[:d] / K, penalty, lam, theta, K * rho1)
        beta = float(total[d]) / K if settings.fit_intercept else 0.0
        xi = np.maximum(0.0, 1.0 + s - u2 - Hx - b * y - 1.0 / (n * rho2))
        s = np.maximum(0.0, Hx + xi - 1.0 + u2 + b * y)
        u1 = u1 + x - z
        v = v + b - beta
        u2 = u2 + Hx + xi - 1.0 - s + b * y
        t += 1
    if not converged:
        warnings.warn(
            f"consensus ADMM stopped at max_iter={settings.max_iter} before the objective's "
            f"relative change fell below tol={settings.tol}; raise max_iter or tol",
            ConvergenceWarning,
            stacklevel=2,
        )
    return ConsensusResult(z.copy(), beta, len(history))


_PROBLEMS = (
    "",
    "no rows",
    "label count differs from row count",
    "labels not all in {-1, +1}",
    "X not a 2-D array of finite numbers",
)
_UNREADABLE = len(_PROBLEMS) - 1


def _local_problem(A, y: np.ndarray) -> int:
    """Index into `_PROBLEMS` of what is wrong with this rank's input alone (0: nothing)."""
    if A.shape[0] == 0:
        return 1
    if y.shape != (A.shape[0],):
        return 2
    if not np.isin(y, (-1.0, 1.0)).all():
        return 3
    return 0


def _agree_on_input(n_k: int, d: int, problem: int, group: comm.Group) -> int:
    """Check every rank's input together; return the global row count n. Raises ValueError on
    all ranks at once, naming each bad rank's problem, if any input is bad or d differs."""
    # Per rank [problem, n_k, d] in its own row, so one sum tells every rank everything.
    table = torch.zeros(group.size, 3, dtype=torch.float64)
    table[group.rank] = torch.tensor([problem, n_k, d], dtype=torch.float64)
    comm.all_reduce(table, group)
    codes, rows, widths = (column.astype(int) for column in table.T.numpy())
    if codes.any() or len(set(widths.tolist())) > 1:
        shapes = ", ".join(f"rank {r}: {rows[r]}x{widths[r]}" for r in range(group.size))
        bad = "; ".join(f"rank {r}: {_PROBLEMS[c]}" for r, c in enumerate(codes) if c)
        raise ValueError(
            "fit_consensus needs, on every rank, at least one row, one label in {-1, +1} per row "
            f"and the same feature count; got {shapes}" + (f"; {bad}" if bad else "")
        )
    return int(rows.sum())


def world_group() -> comm.Group:
    """The whole initialised process group as a `comm.Group` named "world"."""
    return comm.Group("world", dist.group.WORLD, dist.get_world_size(), dist.get_rank())

"""A sparse, high-dimensional classification problem whose true support is known.

Used by the benchmark and the tests to check that the nonconvex penalties find the features that
matter. scikit-learn's `make_classification` gives dense features and no ground-truth weights,
hence this small generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp


@dataclass(frozen=True)
class SparseProblem:
    """X [n, d] CSR, labels y [n] in {−1, +1}, true weights `w` [d] non-zero on `support` [k]."""

    X: sp.csr_matrix
    y: np.ndarray
    w: np.ndarray
    support: np.ndarray


def make_sparse_problem(
    n: int = 300,
    d: int = 2000,
    k: int = 10,
    *,
    noise_density: float = 0.02,
    signal_density: float = 0.5,
    noise: float = 0.5,
    seed: int = 0,
) -> SparseProblem:
    """n rows of d features, k of them informative.

    The k support columns are non-zero in `signal_density` of the rows, the other d − k in
    `noise_density` (values N(0, 1) wherever non-zero). True weights are ±U(1, 2) on the support;
    y = sign(Xw + `noise`·N(0, 1)).
    """
    if not 0 < k <= d:
        raise ValueError(f"k={k} must be in [1, d={d}]")
    rng = np.random.default_rng(seed)
    support = np.sort(rng.choice(d, size=k, replace=False))
    density = np.full(d, noise_density)
    density[support] = signal_density
    mask = rng.random((n, d)) < density[None, :]
    rows, cols = np.nonzero(mask)
    X = sp.csr_matrix((rng.standard_normal(rows.size), (rows, cols)), shape=(n, d))
    w = np.zeros(d)
    w[support] = rng.choice([-1.0, 1.0], size=k) * rng.uniform(1.0, 2.0, size=k)
    y = np.where(X @ w + noise * rng.standard_normal(n) > 0, 1.0, -1.0)
    return SparseProblem(X=X, y=y, w=w, support=support)

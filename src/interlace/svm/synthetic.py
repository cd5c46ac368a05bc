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


@dataclass(frozen=True)
class CategoricalProblem:
    """One-hot X [n, d] CSR whose columns form `groups` (one per categorical variable, each row
    has exactly one 1 per group), labels y [n] in {−1, +1} from a rule on `rule_variables` [r];
    `groups` [d] maps each column to its variable and `support` [k] lists the rule's columns."""

    X: sp.csr_matrix
    y: np.ndarray
    groups: np.ndarray
    rule_variables: np.ndarray
    support: np.ndarray


def make_categorical_problem(
    n_samples: int = 600,
    n_variables: int = 22,
    levels: tuple[int, int] = (2, 8),
    rule_variables: int = 3,
    *,
    seed: int = 0,
) -> CategoricalProblem:
    """n_samples rows of n_variables categorical variables, one-hot encoded, y set by a few.

    Each variable has a level count drawn from `levels` (inclusive) and level frequencies from a
    flat Dirichlet. Each of the `rule_variables` variables marks levels as positive, in random
    order, as many as bring their share of rows nearest one half (never all); y = +1 where more
    than half of the rule variables sit at a positive level, else −1. The rule is linear in
    those variables' columns with a margin (weight 1 on the positive levels, b = −r/2 for r rule
    variables), so the classes are separable and every other column is noise.
    """
    low, high = levels
    if not 2 <= low <= high:
        raise ValueError(f"levels={levels} must be (low, high) with 2 <= low <= high")
    if not 1 <= rule_variables <= n_variables:
        raise ValueError(f"rule_variables={rule_variables} must be in [1, {n_variables}]")
    rng = np.random.default_rng(seed)
    counts = rng.integers(low, high + 1, size=n_variables)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    frequencies = [rng.dirichlet(np.ones(c)) for c in counts]
    codes = np.stack([rng.choice(len(f), size=n_samples, p=f) for f in frequencies])
    rule = np.sort(rng.choice(n_variables, size=rule_variables, replace=False))
    votes = np.zeros(n_samples)
    for v in rule:
        order = rng.permutation(counts[v])
        share = np.cumsum(frequencies[v][order])[:-1]  # rows covered by the first 1, 2, ... levels
        votes += np.isin(codes[v], order[: np.argmin(np.abs(share - 0.5)) + 1])
    y = np.where(votes > rule_variables / 2, 1.0, -1.0)
    rows = np.repeat(np.arange(n_samples), n_variables)
    cols = (codes + offsets[:-1, None]).T.ravel()
    X = sp.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(n_samples, offsets[-1]))
    groups = np.repeat(np.arange(n_variables), counts)
    support = np.flatnonzero(np.isin(groups, rule))
    return CategoricalProblem(X=X, y=y, groups=groups, rule_variables=rule, support=support)

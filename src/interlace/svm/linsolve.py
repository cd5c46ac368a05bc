"""The ADMM x-update's linear system (HᵀH + ρI)x = r, factorised once and solved every iteration.

H [n, d] is dense or scipy.sparse. The factorisation is chosen by shape, so the matrix factorised
is the smaller Gram matrix:

- n ≥ d: Cholesky of HᵀH + ρI  [d, d]
- n < d: Woodbury, (HᵀH + ρI)⁻¹ = (I − Hᵀ(I + HHᵀ/ρ)⁻¹H/ρ)/ρ, with Cholesky of I + HHᵀ/ρ  [n, n]

A sparse H is never densified; its small-side Gram matrix is formed with a sparse product and
made dense only when it has at most `DENSE_GRAM_LIMIT` rows, else it stays sparse and is
factorised by SuperLU (scipy has no sparse Cholesky). scipy provides the factorisations; this
module only picks one and applies Woodbury, which scipy does not offer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.linalg
import scipy.linalg.lapack
import scipy.sparse as sp
import scipy.sparse.linalg

DENSE_GRAM_LIMIT = 4000
"""Largest sparse-input Gram matrix (rows) that is made dense for a Cholesky factorisation."""


class GramSolver:
    """Solve (HᵀH + ρI)x = r for many right-hand sides r [d] with one factorisation.

    `method` says which was used: "cholesky", "woodbury-cholesky", "sparse-lu" or
    "woodbury-sparse-lu"; `gram_shape` is the shape of the matrix that was factorised.
    """

    def __init__(self, H: np.ndarray | sp.spmatrix | sp.sparray, rho: float) -> None:
        if rho <= 0:
            raise ValueError(f"rho={rho!r} must be > 0")
        n, d = H.shape
        self.H = H
        self.rho = float(rho)
        self.woodbury = n < d
        # Woodbury: I + HHᵀ/ρ [n, n]; else HᵀH + ρI [d, d] (the shift is added below).
        gram = H @ H.T / self.rho if self.woodbury else H.T @ H
        shift = 1.0 if self.woodbury else self.rho
        self.gram_shape = gram.shape
        if sp.issparse(gram) and gram.shape[0] > DENSE_GRAM_LIMIT:
            lu = scipy.sparse.linalg.splu(sp.csc_matrix(gram + shift * sp.eye(gram.shape[0])))
            self._solve_small: Callable[[np.ndarray], np.ndarray] = lu.solve
            kind = "sparse-lu"
        else:
            dense = gram.toarray() if sp.issparse(gram) else np.array(gram, dtype=float)
            dense[np.diag_indices_from(dense)] += shift
            self._solve_small = _cholesky_solver(dense)
            kind = "cholesky"
        self.method = f"woodbury-{kind}" if self.woodbury else kind

    def solve(self, r: np.ndarray) -> np.ndarray:
        """x [d] with (HᵀH + ρI)x = r for r [d]."""
        if not self.woodbury:
            return self._solve_small(r)
        inner = self._solve_small(self.H @ r)
        return (r - (self.H.T @ inner) / self.rho) / self.rho


def _cholesky_solver(matrix: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A solve function for the SPD `matrix` [m, m], through LAPACK potrf/potrs directly
    (scipy.linalg.cho_solve adds ~8 µs of checks per call, which dominates small problems)."""
    factor, info = scipy.linalg.lapack.dpotrf(matrix, lower=1)
    if info != 0:
        raise ValueError(
            f"the x-update matrix is not positive definite (LAPACK info={info}); "
            "the data probably holds NaN or inf"
        )

    def solve(r: np.ndarray) -> np.ndarray:
        x, _ = scipy.linalg.lapack.dpotrs(factor, r, lower=1)
        return x

    return solve

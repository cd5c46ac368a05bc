"""`SVMSettings`: the penalty, the solver and the ADMM settings, checked in one place.

`NonconvexSVC`, `admm.solve`, `lla.solve`, `consensus.fit_consensus`, `regularization_path` and
`interlace svm` all take them; each field's help says what it means and is also the `interlace
svm` option's. `solver` picks what the estimator, the path and the command run; `admm.solve` and
`fit_consensus` always run ADMM, and `lla.solve` uses only the penalty fields and the intercept.

Why ρ2 = 1/n by default, not the paper's: λ = 2⁻⁶ and SCAD a = 3.7 follow the paper's
heart_scale run, but its ρ1 = 1.5, ρ2 = 10 do not suit the relative-change stopping rule. The
hinge term carries weight 1/n, so a fixed ρ2 that large moves each slack by at most 1/(n·ρ2) per
iteration and the rule stops early, far from a minimum (after 4 iterations on the full
heart_scale, 46 % above the best objective found). The margin constraints' multipliers are the
hinge weights α_i/n with α_i ∈ [0, 1], so ρ2 = 1/n keeps the scaled dual u2 of order 1 whatever n
is. With ρ1 = 0.5 it stopped within 3 % of the best objective found on the four LIBSVM files
here, but up to 19 % above it on scikit-learn's standardised breast-cancer set (30 correlated
features), where lowering `tol` or raising `max_iter` helps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from interlace.config_args import option
from interlace.errors import ConfigError
from interlace.svm.penalties import DEFAULT_THETA, PENALTIES, check_number, check_penalty

SOLVERS = ("lla", "admm")
"""`lla`: the ℓ1-SVM, then one reweighted ℓ1 step (`interlace.svm.lla`); `admm`: ADMM on the
nonconvex problem from w = 0 (`interlace.svm.admm`)."""

_THETAS = ", ".join(f"{name} {theta}" for name, theta in DEFAULT_THETA.items())


@dataclass(frozen=True)
class SVMSettings:
    """The penalised SVM's settings (module docstring); ConfigError on construction, naming the
    bad value and what would be valid, if one cannot work."""

    penalty: str = option("scad", f"nonconvex penalty: {', '.join(PENALTIES)}")
    lam: float = option(2**-6, "penalty strength λ >= 0")
    theta: float | None = option(
        None,
        "penalty shape: SCAD a (> 2), MCP γ, LSP θ, capped-ℓ1 θ; None: the penalty's own "
        f"({_THETAS})",
    )
    solver: str = option(
        "lla",
        "lla: the l1-SVM, then one reweighted l1 step (both exact linear programs); admm: ADMM "
        "from w = 0 (rho1, rho2, max_iter and tol apply to it only)",
        choices=SOLVERS,
    )
    rho1: float = option(0.5, "ADMM penalty of the constraint x = z")
    rho2: float | None = option(None, "ADMM penalty of the margin constraint; None: 1/n_samples")
    max_iter: int = option(1000, "iteration limit; reaching it warns with ConvergenceWarning")
    tol: float = option(1e-4, "stop when the objective's relative change falls below this")
    fit_intercept: bool = option(True, "fit the intercept b (otherwise b = 0)", flag="--intercept")

    def __post_init__(self) -> None:
        check_penalty(self.penalty, self.lam, self.theta)
        if self.solver not in SOLVERS:
            raise ConfigError(
                f"solver={self.solver!r} is unknown; choose one of {', '.join(SOLVERS)}"
            )
        check_number("rho1", self.rho1, positive=True)
        if self.rho2 is not None:
            check_number("rho2", self.rho2, positive=True)
        max_iter = self.max_iter
        if isinstance(max_iter, bool) or not isinstance(max_iter, int | np.integer) or max_iter < 1:
            raise ConfigError(f"max_iter={max_iter!r} must be an integer >= 1")
        check_number("tol", self.tol, positive=False)

    @property
    def shape(self) -> float:
        """The penalty's shape parameter: `theta`, or the penalty's default when it is None."""
        return DEFAULT_THETA[self.penalty] if self.theta is None else float(self.theta)

    def rho2_for(self, n: int) -> float:
        """ρ2 for `n` rows in all: `rho2`, or 1/n when it is None (module docstring)."""
        return 1.0 / n if self.rho2 is None else float(self.rho2)


DEFAULTS = SVMSettings()
"""The default settings."""

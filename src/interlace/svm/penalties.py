"""The four nonconvex sparsity penalties: their values and their exact proximal operators.

Every penalty acts elementwise on t = |w_j| with strength `lam` ≥ 0 and shape `theta` > 0:

- SCAD (theta = a > 2):  λt for t ≤ λ; (−t² + 2aλt − λ²)/(2(a−1)) for λ < t ≤ aλ; (a+1)λ²/2 beyond.
- MCP (theta = γ > 0):   λt − t²/(2γ) for t ≤ γλ; γλ²/2 beyond.
- LSP (theta = θ > 0):   λ·log(1 + t/θ).
- capped-ℓ1 (θ > 0):     λ·min(t, θ).

The proximal operator prox(v) = argmin_t p(t) + (ρ/2)(t − v)² is solved exactly for any ρ > 0,
even where p is more concave than ρ is convex: p is smooth on a few intervals of t ≥ 0, so the
minimiser is an endpoint of an interval or a stationary point inside one. For |v| we list those
few candidates (0 among them, directly or as a clipped point), evaluate the prox objective at
each and keep the lowest (ties go to the candidate nearest 0); the sign of v is restored at the
end. NumPy has no such operator, hence this module.
"""

from __future__ import annotations

import numpy as np

from interlace.errors import ConfigError

PENALTIES = ("scad", "mcp", "lsp", "capped_l1")
"""Names accepted wherever a penalty is chosen."""

DEFAULT_THETA = {"scad": 3.7, "mcp": 3.0, "lsp": 1.0, "capped_l1": 1.0}
"""Shape parameter used when none is given: SCAD a = 3.7 (Fan & Li; the authors' setting),
MCP γ = 3, LSP θ = 1 and capped-ℓ1 θ = 1 (slope λ at 0 for LSP, like the others; cap at |w| = 1)."""


def check_number(name: str, value: object, *, positive: bool) -> float:
    """`value` as a float if it is a finite number > 0 (`positive`) or >= 0; else ConfigError."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ConfigError(f"{name}={value!r} must be a finite number {bound}")
    number = float(value)
    if not np.isfinite(number) or number < 0 or (positive and number == 0):
        raise ConfigError(f"{name}={value!r} must be a finite number {bound}")
    return number


def check_penalty(penalty: str, lam: float, theta: float | None) -> float:
    """Validate a penalty choice; return the shape parameter to use (default if `theta` is None).

    Raises ConfigError naming the bad value and what is valid.
    """
    if penalty not in PENALTIES:
        raise ConfigError(f"penalty={penalty!r} is unknown; choose one of {', '.join(PENALTIES)}")
    check_number("lam", lam, positive=False)
    if theta is None:
        return DEFAULT_THETA[penalty]
    theta = check_number("theta", theta, positive=True)
    if penalty == "scad" and not theta > 2:
        raise ConfigError(f"theta={theta!r} is SCAD's a and must be > 2 (the usual choice is 3.7)")
    return theta


def penalty_value(w: np.ndarray, penalty: str, lam: float, theta: float) -> np.ndarray:
    """Elementwise penalty p(w_j) for `w` of any shape; same shape out."""
    t = np.abs(np.asarray(w, dtype=float))
    if penalty == "scad":
        a = theta
        middle = (-(t**2) + 2 * a * lam * t - lam**2) / (2 * (a - 1))
        return np.where(t <= lam, lam * t, np.where(t <= a * lam, middle, (a + 1) * lam**2 / 2))
    if penalty == "mcp":
        g = theta
        return np.where(t <= g * lam, lam * t - t**2 / (2 * g), g * lam**2 / 2)
    if penalty == "lsp":
        return lam * np.log1p(t / theta)
    if penalty == "capped_l1":
        return lam * np.minimum(t, theta)
    raise ConfigError(f"penalty={penalty!r} is unknown; choose one of {', '.join(PENALTIES)}")


def penalty_slope(w: np.ndarray, penalty: str, lam: float, theta: float) -> np.ndarray:
    """Elementwise slope p'(t) at t = |w_j| ≥ 0 (right derivative: λ at 0, λ/θ for LSP); same shape.

    p is concave on t ≥ 0, so p(t) ≤ p(t0) + p'(t0)(t − t0): the weighted ℓ1 term with these
    slopes majorises the penalty at t0, which is what the one-step LLA fit minimises.
    """
    t = np.abs(np.asarray(w, dtype=float))
    if penalty == "scad":
        a = theta
        return np.where(t <= lam, lam, np.maximum(a * lam - t, 0.0) / (a - 1))
    if penalty == "mcp":
        return np.maximum(lam - t / theta, 0.0)
    if penalty == "lsp":
        return lam / (theta + t)
    if penalty == "capped_l1":
        return np.where(t < theta, lam, 0.0)
    raise ConfigError(f"penalty={penalty!r} is unknown; choose one of {', '.join(PENALTIES)}")


def prox(v: np.ndarray, penalty: str, lam: float, theta: float, rho: float) -> np.ndarray:
    """Exact argmin_t p(t) + (rho/2)(t − v)², elementwise over `v` [d]; returns [d]."""
    v = np.asarray(v, dtype=float)
    a = np.abs(v)
    if penalty == "scad":
        t = _prox_scad(a, lam, theta, rho)
    elif penalty == "mcp":
        t = _prox_mcp(a, lam, theta, rho)
    elif penalty == "lsp":
        t = _prox_lsp(a, lam, theta, rho)
    elif penalty == "capped_l1":
        t = _prox_capped_l1(a, lam, theta, rho)
    else:
        raise ConfigError(f"penalty={penalty!r} is unknown; choose one of {', '.join(PENALTIES)}")
    return np.copysign(t, v)


def _lowest(*pairs: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Of (candidate t, its prox cost) pairs, each [d], the t with the lowest cost per entry;
    ties keep the earlier pair (list candidates nearest 0 first)."""
    best, best_cost = pairs[0]
    for t, cost in pairs[1:]:
        better = cost < best_cost
        best = np.where(better, t, best)
        best_cost = np.where(better, cost, best_cost)
    return best


# In each piece below, a piece's minimiser over its closed interval is its clipped stationary point
# when the piece is convex, else one of its endpoints. An endpoint shared with a flat (constant)
# outer piece is never better than that piece's minimiser max(a, endpoint), and an endpoint shared
# with a convex inner piece is covered by that piece's clipped minimiser, so such endpoints are
# not listed again. 0 is listed wherever no clipped minimiser covers it.


def _prox_scad(a: np.ndarray, lam: float, A: float, rho: float) -> np.ndarray:
    half = 0.5 * rho
    t1 = np.clip(a - lam / rho, 0.0, lam)  # on [0, λ]: λt, convex; covers t = 0
    pairs = [(t1, lam * t1 + half * (t1 - a) ** 2)]
    curvature = rho * (A - 1) - 1  # of the middle piece (−t² + 2aλt − λ²)/(2(a−1)) + ρ/2(t−v)²
    if curvature > 0:
        t2 = np.clip((rho * (A - 1) * a - A * lam) / curvature, lam, A * lam)
        p2 = (-(t2**2) + 2 * A * lam * t2 - lam**2) / (2 * (A - 1))
        pairs.append((t2, p2 + half * (t2 - a) ** 2))
    t3 = np.maximum(a, A * lam)  # on [aλ, ∞): constant (a+1)λ²/2
    pairs.append((t3, (A + 1) * lam**2 / 2 + half * (t3 - a) ** 2))
    return _lowest(*pairs)


def _prox_mcp(a: np.ndarray, lam: float, gamma: float, rho: float) -> np.ndarray:
    half = 0.5 * rho
    curvature = rho - 1 / gamma  # of λt − t²/(2γ) + ρ/2(t−v)² on [0, γλ]
    if curvature > 0:
        t1 = np.clip((rho * a - lam) / curvature, 0.0, gamma * lam)
    else:
        t1 = np.zeros_like(a)
    pairs = [(t1, lam * t1 - t1**2 / (2 * gamma) + half * (t1 - a) ** 2)]
    t2 = np.maximum(a, gamma * lam)  # on [γλ, ∞): constant γλ²/2
    pairs.append((t2, gamma * lam**2 / 2 + half * (t2 - a) ** 2))
    return _lowest(*pairs)


def _prox_lsp(a: np.ndarray, lam: float, theta: float, rho: float) -> np.ndarray:
    # (θ + t)·derivative = ρt² + ρ(θ − v)t + λ − ρvθ: the derivative is negative only between
    # the two roots, so the larger root is the one interior local minimum. Without real roots
    # the objective increases on t ≥ 0, and 0 beats whatever t1 the clamped formula gives.
    disc = np.maximum((a + theta) ** 2 - 4 * lam / rho, 0.0)
    t1 = np.maximum((a - theta + np.sqrt(disc)) / 2, 0.0)
    zero = np.zeros_like(a)
    return _lowest(
        (zero, 0.5 * rho * a**2),
        (t1, lam * np.log1p(t1 / theta) + 0.5 * rho * (t1 - a) ** 2),
    )


def _prox_capped_l1(a: np.ndarray, lam: float, theta: float, rho: float) -> np.ndarray:
    half = 0.5 * rho
    t1 = np.clip(a - lam / rho, 0.0, theta)  # on [0, θ]: λt, convex; covers t = 0
    t2 = np.maximum(a, theta)  # on [θ, ∞): constant λθ
    return _lowest(
        (t1, lam * t1 + half * (t1 - a) ** 2),
        (t2, lam * theta + half * (t2 - a) ** 2),
    )

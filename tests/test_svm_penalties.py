"""Penalty values and their proximal operators, checked against hand values and brute force."""

import numpy as np
import pytest

from interlace.errors import ConfigError
from interlace.svm.penalties import PENALTIES, check_penalty, penalty_value, prox

# (penalty, shape values): the shapes include ones where a piece of the prox objective is concave
# for the smaller ρ below (SCAD ρ(a−1) < 1, MCP ρ < 1/γ), so every branch is exercised.
SHAPES = {"scad": [2.1, 3.7, 8.0], "mcp": [0.5, 3.0], "lsp": [0.05, 1.0], "capped_l1": [0.2, 1.5]}
GRID = np.linspace(-7.0, 7.0, 28001)  # step 5e-4
V = np.linspace(-5.0, 5.0, 41)


@pytest.mark.parametrize("penalty", PENALTIES)
@pytest.mark.parametrize("lam", [0.05, 0.7, 2.0])
@pytest.mark.parametrize("rho", [0.2, 1.5, 10.0])
def test_prox_equals_brute_force_minimisation(penalty, lam, rho):
    for theta in SHAPES[penalty]:
        t = prox(V, penalty, lam, theta, rho)
        cost = penalty_value(t, penalty, lam, theta) + 0.5 * rho * (t - V) ** 2
        grid_costs = (
            penalty_value(GRID, penalty, lam, theta)[None, :]
            + 0.5 * rho * (GRID[None, :] - V[:, None]) ** 2
        )
        best = grid_costs.min(axis=1)
        where = GRID[grid_costs.argmin(axis=1)]
        # Never worse than any grid point (so optimal up to the grid's resolution) ...
        assert np.all(cost <= best + 1e-10), (penalty, lam, theta, rho)
        # ... and at the grid's minimiser wherever that minimiser is unique.
        far = np.abs(GRID[None, :] - where[:, None]) > 0.01
        runner_up = np.where(far, grid_costs, np.inf).min(axis=1)
        unique = runner_up > best + 1e-6
        off = np.abs(t - where) > 1e-3
        assert unique.sum() > len(V) // 2
        assert not np.any(off & unique), (penalty, lam, theta, rho, V[off], t[off], where[off])


@pytest.mark.parametrize("penalty", PENALTIES)
def test_prox_keeps_sign_and_zeroes_small_values(penalty):
    theta = check_penalty(penalty, 0.5, None)
    v = np.array([-3.0, -0.01, 0.0, 0.01, 3.0])
    t = prox(v, penalty, 0.5, theta, 1.0)
    assert t[1] == t[2] == t[3] == 0.0
    assert t[0] < 0 < t[4]
    assert t[0] == -t[4]


def test_penalty_values_by_hand():
    # SCAD λ=1, a=3.7: linear, quadratic middle, flat tail.
    got = penalty_value(np.array([0.5, -2.0, 10.0]), "scad", 1.0, 3.7)
    assert got == pytest.approx([0.5, (-4 + 2 * 3.7 * 2 - 1) / (2 * 2.7), 4.7 / 2])
    # MCP λ=1, γ=3.
    assert penalty_value(np.array([1.0, 5.0]), "mcp", 1.0, 3.0) == pytest.approx([1 - 1 / 6, 1.5])
    # LSP λ=2, θ=1 at t = e − 1 is 2·log(e) = 2.
    assert penalty_value(np.array([np.e - 1]), "lsp", 2.0, 1.0) == pytest.approx([2.0])
    # capped-ℓ1 λ=2, θ=0.5.
    assert penalty_value(np.array([0.25, -3.0]), "capped_l1", 2.0, 0.5) == pytest.approx([0.5, 1.0])


@pytest.mark.parametrize("penalty", ["scad", "mcp"])
def test_piecewise_penalties_are_continuous_at_the_knots(penalty):
    lam, theta = 0.8, 3.7
    knots = [lam, theta * lam] if penalty == "scad" else [theta * lam]
    for knot in knots:
        left, right = penalty_value(np.array([knot - 1e-9, knot + 1e-9]), penalty, lam, theta)
        assert left == pytest.approx(right, abs=1e-8)


def test_check_penalty_defaults_and_errors():
    assert check_penalty("scad", 0.1, None) == 3.7
    assert check_penalty("mcp", 0.1, 2.5) == 2.5
    with pytest.raises(ConfigError, match="penalty='l1' is unknown; choose one of scad"):
        check_penalty("l1", 0.1, None)
    with pytest.raises(ConfigError, match=r"lam=-0\.1 must be a finite number >= 0"):
        check_penalty("mcp", -0.1, None)
    with pytest.raises(ConfigError, match="SCAD's a and must be > 2"):
        check_penalty("scad", 0.1, 2.0)
    with pytest.raises(ConfigError, match="theta=0 must be a finite number > 0"):
        check_penalty("lsp", 0.1, 0)
    with pytest.raises(ConfigError, match="lam='big'"):
        check_penalty("lsp", "big", None)

"""SVMSettings: checked once on construction, shared by the estimator and the `svm` command."""

import argparse
import dataclasses

import pytest

from interlace.config_args import dataclass_from_args
from interlace.errors import ConfigError
from interlace.svm import NonconvexSVC, SVMSettings
from interlace.svm.cli import add_svm_args


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"penalty": "lasso"}, "penalty='lasso' is unknown; choose one of scad"),
        ({"lam": float("nan")}, "lam=nan must be a finite number >= 0"),
        ({"theta": 2.0}, "SCAD's a and must be > 2"),
        ({"rho1": 0}, "rho1=0 must be a finite number > 0"),
        ({"rho2": -1.0}, "rho2=-1.0 must be a finite number > 0"),
        ({"max_iter": 2.5}, "max_iter=2.5 must be an integer >= 1"),
        ({"max_iter": True}, "max_iter=True must be an integer >= 1"),
        ({"tol": -1e-3}, "tol=-0.001 must be a finite number >= 0"),
        ({"solver": "cd"}, "solver='cd' is unknown; choose one of lla, admm"),
    ],
)
def test_bad_settings_are_refused_on_construction(changes, message):
    with pytest.raises(ConfigError, match=message):
        SVMSettings(**changes)
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(SVMSettings(), **changes)


def test_shape_and_rho2_fill_in_the_defaults():
    assert SVMSettings().shape == 3.7
    assert SVMSettings(penalty="mcp").shape == 3.0
    assert SVMSettings(penalty="lsp", theta=2).shape == 2.0
    assert SVMSettings().rho2_for(8) == 0.125
    assert SVMSettings(rho2=3).rho2_for(8) == 3.0


def test_the_estimators_parameters_are_the_settings_fields():
    fields = {f.name: f.default for f in dataclasses.fields(SVMSettings)}
    assert NonconvexSVC().get_params() == fields


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="interlace svm")
    add_svm_args(parser)
    return parser.parse_args(["train.libsvm", *argv])


def test_command_line_options_build_the_settings():
    assert dataclass_from_args(SVMSettings, _parse()) == SVMSettings()
    args = _parse("--penalty", "mcp", "--lam", "0.5", "--rho2", "2", "--max-iter", "7")
    assert dataclass_from_args(SVMSettings, args) == SVMSettings(
        penalty="mcp", lam=0.5, rho2=2.0, max_iter=7
    )
    no_intercept = dataclass_from_args(SVMSettings, _parse("--no-intercept"))
    assert no_intercept == SVMSettings(fit_intercept=False)

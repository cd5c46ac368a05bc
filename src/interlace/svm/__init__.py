"""Sparse linear SVMs with nonconvex penalties (SCAD, MCP, LSP, capped-ℓ1).

They are fitted by one LLA step from the exact ℓ1-SVM (`interlace.svm.lla`, the default) or by
ADMM (`interlace.svm.admm`). `NonconvexSVC` is the scikit-learn estimator; `regularization_path`
fits a decreasing λ sequence; `interlace.svm.select` picks λ by cross-validation;
`interlace.svm.consensus.fit_consensus` splits the rows across torch.distributed ranks;
`SVMSettings` holds the settings that all of them take. Needs the `svm` extra (scikit-learn,
scipy, highspy).
"""

try:
    import highspy  # noqa: F401
    import scipy  # noqa: F401
    import sklearn  # noqa: F401
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        f"interlace.svm needs {missing.name!r}: install the svm extra, pip install 'interlace[svm]'"
    ) from missing

from interlace.svm.estimator import NonconvexSVC
from interlace.svm.path import RegularizationPath, regularization_path
from interlace.svm.penalties import PENALTIES
from interlace.svm.settings import SVMSettings

__all__ = ["PENALTIES", "NonconvexSVC", "RegularizationPath", "SVMSettings", "regularization_path"]

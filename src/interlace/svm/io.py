"""Reading LIBSVM / svmlight files, with errors that say which file and what is wrong.

Parsing is scikit-learn's `load_svmlight_files`; this module only turns its failures (and a
missing, empty or single-class file) into one-line `DataError`s before any fitting starts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.datasets import load_svmlight_files

from interlace.errors import DataError


def load_libsvm(*paths: str | Path) -> list[tuple[sp.csr_matrix, np.ndarray]]:
    """Read one or more LIBSVM files into [(X [n_i, d] CSR float64, y [n_i]), ...].

    All files share one feature count d (the largest index in any of them), so a train and a test
    file line up column for column. Raises DataError for a missing, unreadable, unparsable or
    empty file.
    """
    if not paths:
        raise DataError("no LIBSVM file given")
    for path in paths:
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise DataError(f"LIBSVM file {str(path)!r} {what}; give the path of a data file")
        if p.stat().st_size == 0:
            raise DataError(f"LIBSVM file {str(path)!r} is empty")
    try:
        loaded = load_svmlight_files([str(p) for p in paths], dtype=np.float64)
    except (ValueError, UnicodeDecodeError, OSError) as error:
        names = ", ".join(repr(str(p)) for p in paths)
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(
            f"cannot parse {names} as LIBSVM ('label index:value ...' lines): {detail}"
        ) from error
    pairs = [
        (sp.csr_matrix(loaded[i]), np.asarray(loaded[i + 1])) for i in range(0, len(loaded), 2)
    ]
    for path, (X, _) in zip(paths, pairs, strict=True):
        if X.shape[0] == 0:
            raise DataError(f"LIBSVM file {str(path)!r} holds no data rows")
    return pairs

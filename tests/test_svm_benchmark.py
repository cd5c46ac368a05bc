"""The benchmark's quick mode: runs, is JSON-able, tabulates and plots."""

import json

import pytest

from helpers import SVM_DATA
from interlace.bench.svm_benchmark import (
    _QUICK,
    BASELINES,
    _splits,
    data_dir,
    plot_svm,
    run_svm_benchmark,
    svm_table,
)
from interlace.svm.penalties import PENALTIES


@pytest.fixture(scope="module")
def quick():
    with pytest.MonkeyPatch.context() as patch:  # the LIBSVM files shipped with the tests
        patch.setenv("INTERLACE_SVM_DATA", str(SVM_DATA))
        return run_svm_benchmark(quick=True)


def test_quick_benchmark_covers_every_dataset_and_method(quick):
    json.dumps(quick)
    names = set(quick["datasets"])
    assert {"breast_cancer", "synthetic_150x300"} <= names
    assert "heart_scale" in names
    assert not any(note.startswith("skipped") for note in quick["notes"])
    for entry in quick["datasets"].values():
        assert set(entry["methods"]) == {*PENALTIES, *BASELINES}
        for method, m in entry["methods"].items():
            assert 0.5 <= m["test_accuracy"] <= 1.0, method
            assert 0 <= m["nonzeros"] <= entry["n_features"]
            assert m["fit_seconds"] > 0
            if method in PENALTIES:
                assert set(m["targets"]) == {
                    "accuracy_ge_l1",
                    "fewer_nonzeros_than_l1",
                    "time_ratio_to_l1",
                    "time_within_3x_l1",
                }
    # The synthetic problem's 5 informative features are all found.
    synthetic = quick["datasets"]["synthetic_150x300"]["methods"]
    assert synthetic["scad"]["support_size"] == 5
    assert synthetic["scad"]["support_found"] == 5


def test_table_and_plot(quick, tmp_path):
    table = svm_table(quick)
    for method in (*PENALTIES, *BASELINES):
        assert method in table
    assert "support 5/5" in table
    png = tmp_path / "svm.png"
    plot_svm(quick, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_data_folder_from_env_and_missing_files_are_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv("INTERLACE_SVM_DATA", str(tmp_path))
    assert data_dir() == tmp_path
    notes = []
    splits = _splits(_QUICK, notes)
    assert [s.name for s in splits] == ["breast_cancer", "synthetic_150x300"]
    assert any("skipped heart_scale" in note and str(tmp_path) in note for note in notes)

"""BENCHMARKS.md from the benchmarks' JSON: a run's note, where its JSON has one, is printed
under its result."""

import json

from interlace.bench.markdown import render


def _mfu_doc(**extra) -> dict:
    rows = [
        {
            "model": "m",
            "mode": mode,
            "batch": 4,
            "tokens_per_s": tps,
            "model_tflops": 1.0,
            "mfu": None,
        }
        for mode, tps in (("trainer", 120.0), ("loop_bf16", 100.0))
    ]
    return {
        "benchmark": "mfu",
        "command": "interlace bench mfu",
        "environment": {
            "started": "2026-11-26T00:00:00+0000",
            "network": "single process",
            "ranks": 1,
            "cpus": 2,
            "torch": "2.13.0",
            "interlace": "0.1.0",
        },
        "result": {"device": "cpu", "device_name": "cpu", "rows": rows},
        **extra,
    }


def test_a_runs_note_is_printed_under_its_result(tmp_path):
    (tmp_path / "mfu.json").write_text(json.dumps(_mfu_doc(note="measured before the fix")))
    page = render(tmp_path, tmp_path / "BENCHMARKS.md")
    section = page[page.index("## mfu") :]
    assert "**Result:** m: Trainer 1.20x the plain loop." in section
    assert section.index("**Result:**") < section.index("**Note:** measured before the fix")


def test_a_run_without_a_note_prints_none(tmp_path):
    (tmp_path / "mfu.json").write_text(json.dumps(_mfu_doc()))
    assert "**Note:**" not in render(tmp_path, tmp_path / "BENCHMARKS.md")

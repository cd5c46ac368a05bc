"""`interlace bench precision` on the CPU, cut short: every mode trains the same model from the
same seed, fp8 emulated there, and each final loss is compared with bf16's."""

import pytest

from interlace.bench.precision import BENCHMARK, MODES, run_local
from interlace.errors import ConfigError


def test_every_mode_trains_the_same_start_and_is_compared_with_bf16(tmp_path):
    options = {**BENCHMARK.defaults(), "steps": 8, "tail": 2}
    result = run_local(options)
    modes = result["modes"]
    assert result["fp8_emulated"] and list(modes) == list(MODES)
    first = modes["bf16"]["losses"][0]
    for mode, row in modes.items():
        assert len(row["losses"]) == 8
        assert row["losses"][0] == pytest.approx(first, rel=1e-3)  # same weights, same batch
        assert row["final"] == pytest.approx(sum(row["losses"][-2:]) / 2)
        assert row["vs_bf16"] == pytest.approx(row["final"] / modes["bf16"]["final"] - 1)
        assert mode == "bf16" or row["losses"] != modes["bf16"]["losses"]  # another format ran
    assert modes["bf16"]["losses"][-1] < first  # it trains
    doc = {"result": result}
    BENCHMARK.plot(doc, tmp_path / "precision.png")
    assert "fp8 emulated" in BENCHMARK.table(doc)
    assert "fp8_tensorwise" in BENCHMARK.headline(doc)


def test_a_tail_longer_than_half_the_run_is_refused():
    with pytest.raises(ConfigError, match="at least twice tail"):
        BENCHMARK.check({**BENCHMARK.defaults(), "steps": 10, "tail": 6})

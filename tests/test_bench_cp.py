"""The `cp` benchmark on 4 forked ranks with the tiny model at short sequences: every degree
measured, activations per rank falling with cp, longer sequences fitting under cp=1's peak,
the ring's times and the zig-zag balance, and the report built from them."""

import json

import pytest
import torch.distributed as dist

from interlace.bench import get_benchmark
from interlace.bench.base import RankContext
from interlace.bench.cp import work_balance
from interlace.bench.cp_report import activation_ratio, longest_ratio
from interlace.comm import Group
from interlace.errors import ConfigError
from interlace.testing import run_ranks

OPTIONS = {"seq_len": 512, "max_seq_len": 2048, "tokens_per_rank": 256, "sequences": 1}


def _rank(options):
    from interlace.bench.cp import run_rank

    group = Group("world", dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    return run_rank(RankContext(group, None, "lo", options))


@pytest.fixture(scope="module")
def doc():  # about 40 s on 2 cores: the tests reading it are slow
    bench = get_benchmark("cp")
    options = {**bench.options, **OPTIONS}
    bench.check(options)
    result = run_ranks(4, _rank, options, timeout=240)[0]
    return {
        "benchmark": "cp",
        "options": options,
        "environment": {"ranks": 4, "network": "loopback"},
        "result": json.loads(json.dumps(result)),  # as the JSON holds it
    }


@pytest.mark.slow
def test_activations_fall_and_longer_sequences_fit_with_cp(doc):
    assert set(doc["result"]["degrees"]) == {"1", "2", "4"}
    assert activation_ratio(doc, 2) < 0.65
    assert activation_ratio(doc, 4) < activation_ratio(doc, 2)
    assert longest_ratio(doc, 4) >= 2
    for cp, row in doc["result"]["degrees"].items():
        longest, tried = row["longest"]["longest"], row["longest"]["tried"]
        cap = doc["result"]["cap_bytes"]
        assert all(t["step_peak"] <= cap for t in tried if t["seq_len"] <= longest)
        assert all(t["step_peak"] > cap for t in tried if t["seq_len"] > longest)
        assert (row["ring"] is None) == (cp == "1")
        if row["ring"]:
            assert 0 <= row["ring"]["hidden"] <= 1 and row["ring"]["transfer_s"] > 0


def test_zig_zag_shares_carry_equal_attention_work():
    assert work_balance(4096, 4) == 1.0 and work_balance(4096, 2) == 1.0


@pytest.mark.slow
def test_table_headline_and_plot(doc, tmp_path):
    bench = get_benchmark("cp")
    text = bench.table(doc)
    assert "longest" in text and len(text.splitlines()) == 2 + 3
    assert bench.headline(doc).startswith("cp=4: activations per rank")
    bench.plot(doc, tmp_path / "cp.png")
    assert (tmp_path / "cp.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("change", "needle"),
    [({"seq_len": 100}, "multiple of 8"), ({"max_seq_len": 256}, "at least seq_len")],
)
def test_bad_options_are_refused_before_any_rank_starts(change, needle):
    bench = get_benchmark("cp")
    with pytest.raises(ConfigError, match=needle):
        bench.check({**bench.options, **change})

"""Every benchmark's options say what they mean (`interlace bench list`), and every run says
what it will run, and where, before it starts."""

import pytest

from interlace.bench import REGISTRY, get_benchmark, runner
from interlace.bench.base import Benchmark
from interlace.bench.runner import announce, run_benchmark
from interlace.cli import main


@pytest.mark.parametrize("name", REGISTRY)
def test_every_option_of_every_benchmark_says_what_it_means(name):
    bench = get_benchmark(name)
    assert set(bench.option_help) == set(bench.options)
    assert all(meaning.strip() for meaning in bench.option_help.values())
    assert set(bench.cpu_options) <= set(bench.options)
    assert all(type(v) is type(bench.options[k]) for k, v in bench.cpu_options.items())


def test_bench_list_prints_each_option_with_its_default_and_meaning(capsys):
    assert main(["bench", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    ddp = get_benchmark("ddp")
    assert all(f"  {k}={v}  {ddp.option_help[k]}" in listed for k, v in ddp.options.items())
    mfu = get_benchmark("mfu")
    compile_line = f"  compile=True  {mfu.option_help['compile']}; on a CPU: False"
    assert compile_line in listed


def test_a_multi_rank_benchmark_is_announced_with_its_options_ranks_and_links():
    ddp = get_benchmark("ddp")
    assert announce(ddp, ddp.options, 2, "1gbit") == (
        "bench ddp: model=bench-25m micro_batch=4 steps=3 on 2 CPU rank(s) (gloo) linked at 1gbit"
    )
    assert announce(ddp, ddp.options, 4, "loopback").endswith("on 4 CPU rank(s) (gloo) on loopback")


def test_the_runner_prints_the_line_before_the_benchmark_starts(tmp_path, capsys, monkeypatch):
    printed_before: list[str] = []
    probe = Benchmark(
        name="probe",
        summary="",
        describe="",
        table=lambda doc: "",
        plot=lambda doc, path: path.write_bytes(b""),
        run_local=lambda options: printed_before.append(capsys.readouterr().out) or {},
        options={"steps": 3},
        option_help={"steps": "timed steps"},
    )
    monkeypatch.setattr(runner, "get_benchmark", lambda name: probe)
    run_benchmark("probe", None, "loopback", tmp_path, ["steps=2"], command="t", repeat=2)
    assert printed_before == ["bench probe: steps=2 locally on cpu; 2 times\n", ""]

"""interlace bench: the emulated cluster comes up and down cleanly, shapes its links, cleans up
after failures; the runner writes JSON + PNG; loopback fallback is marked."""

import ast
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import interlace
from interlace.bench import get_benchmark, runner
from interlace.bench.cluster import LOOPBACK, PREFIX, Cluster, leftover_namespaces
from interlace.bench.collectives import bus_factor
from interlace.bench.runner import BenchFailed, parse_options, run_benchmark
from interlace.cli import main
from interlace.errors import ConfigError
from interlace.planner.calibrate import hidden_fraction
from interlace.rates import parse_rate

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2",
)

_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5555)); s.listen(1); c, _ = s.accept(); n, start = 0, None
while True:
    d = c.recv(1 << 20)
    start = start or time.perf_counter()
    if not d: break
    n += len(d)
print(n * 8 / (time.perf_counter() - start))
"""
_SENDER = """
import socket, sys, time
for _ in range(100):
    try: s = socket.create_connection((sys.argv[1], 5555)); break
    except OSError: time.sleep(0.05)
block = bytes(1 << 20)
for _ in range(int(sys.argv[2])): s.sendall(block)
s.close()
"""


def test_parse_rate_units_and_errors():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("200mbit") == 2e8
    assert parse_rate("64kbit") == 64e3
    for bad in ("1gb", "fast", "0mbit", "-1gbit"):
        with pytest.raises(ConfigError, match="not a rate like 1gbit"):
            parse_rate(bad)


def _bench_imports(path: Path) -> list[tuple[int, str | None]]:
    """(line, enclosing function or None) of each import of interlace.bench in `path`."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, child.name)
                continue
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module:
                names = [f"{child.module}.{alias.name}" for alias in child.names]
            if any(f"{name}.".startswith("interlace.bench.") for name in names):
                found.append((child.lineno, function))
            visit(child, function)

    visit(ast.parse(path.read_text()), None)
    return found


def test_the_library_does_not_import_the_benchmarks():
    """Only `interlace bench` itself (cli.py's `_bench`, run on demand) loads interlace.bench."""
    root = Path(interlace.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(root / "bench"):
            continue
        allowed = {"_bench"} if path == root / "cli.py" else set()
        offenders += [
            f"{path.relative_to(root)}:{line}"
            for line, function in _bench_imports(path)
            if function not in allowed
        ]
    assert offenders == []


def test_bus_factor_and_hidden_fraction():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0
    assert hidden_fraction(1.0, 1.0, 2.0) == 0.0  # serial
    assert hidden_fraction(1.0, 1.0, 1.0) == 1.0  # fully hidden
    assert hidden_fraction(2.0, 1.0, 2.5) == 0.5


def test_options_are_typed_from_defaults_and_unknown_keys_rejected():
    bench = get_benchmark("collectives")
    options = parse_options(bench, ["max_size=4096", "ops=all_reduce"])
    assert options["max_size"] == 4096 and options["ops"] == "all_reduce"
    with pytest.raises(ConfigError, match="not key=value with a key of 'collectives'"):
        parse_options(bench, ["nope=1"])
    with pytest.raises(ConfigError, match="max_size='big' is not a int"):
        parse_options(bench, ["max_size=big"])


def test_cli_lists_benchmarks_and_rejects_unknown(capsys):
    assert main(["bench", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("collectives", "overlap", "ddp"))
    assert main(["bench", "nosuch"]) == 2
    assert "unknown benchmark 'nosuch'" in capsys.readouterr().err


def test_cli_exits_with_1_when_a_benchmark_run_fails(capsys, monkeypatch):
    def fail(*args, **kwargs):
        raise BenchFailed("rank 1 failed (exit code 3):\nboom")

    monkeypatch.setattr(runner, "run_benchmark", fail)
    assert main(["bench", "collectives"]) == 1
    assert capsys.readouterr().err == "interlace: rank 1 failed (exit code 3):\nboom\n"


def test_loopback_run_writes_json_and_png_marked_not_shaped(tmp_path):
    doc = run_benchmark(
        "collectives",
        2,
        "loopback",
        tmp_path,
        ["max_size=4096", "min_seconds=0"],
        command="interlace bench test",
    )
    assert doc["environment"]["network"] == LOOPBACK
    saved = json.loads((tmp_path / "collectives.json").read_text())
    assert saved["command"] == "interlace bench test"
    ops = {row["op"] for row in saved["result"]["rows"]}
    assert ops == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    assert all(
        row["link_fraction"] is None and row["seconds"] > 0 for row in saved["result"]["rows"]
    )
    assert len(saved["per_rank"]) == 2
    assert (tmp_path / "collectives.png").read_bytes()[:4] == b"\x89PNG"


def _throughput_to_rank0(cluster: Cluster, sender_rank: int, megabytes: int) -> float:
    """Bits per second of a TCP stream from `sender_rank` to rank 0."""
    receiver = subprocess.Popen(
        cluster.rank_command(0, [sys.executable, "-c", _RECEIVER]),
        stdout=subprocess.PIPE,
        text=True,
    )
    subprocess.run(
        cluster.rank_command(
            sender_rank, [sys.executable, "-c", _SENDER, cluster.master_addr, str(megabytes)]
        ),
        check=True,
        timeout=60,
    )
    return float(receiver.communicate(timeout=30)[0])


@needs_netns
def test_cluster_comes_up_and_down_cleanly():
    with Cluster(3, parse_rate("100mbit")) as cluster:
        assert cluster.shaped
        assert sorted(leftover_namespaces()) == sorted(
            [f"{PREFIX}hub", f"{PREFIX}r0", f"{PREFIX}r1", f"{PREFIX}r2"]
        )
        assert _throughput_to_rank0(cluster, 2, 1) > 0  # rank 2 reaches rank 0 over the bridge
    assert leftover_namespaces() == []


@needs_netns
def test_shaped_link_measures_within_15_percent_of_its_rate():
    rate = parse_rate("200mbit")
    with Cluster(2, rate) as cluster:
        measured = _throughput_to_rank0(cluster, 1, 30)
    assert measured == pytest.approx(rate, rel=0.15)


@needs_netns
def test_leftovers_of_a_crashed_run_are_removed_on_the_next_start():
    subprocess.run(["ip", "netns", "add", f"{PREFIX}r7"], check=True)
    with Cluster(2, parse_rate("100mbit")):
        assert f"{PREFIX}r7" not in leftover_namespaces()
    assert leftover_namespaces() == []


def _pids_in(namespace: str) -> list[str]:
    return subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    ).stdout.split()


def _kill_rank_when_running(rank: int) -> None:
    """Wait until rank `rank`'s worker runs, give it a second, then SIGKILL it."""
    namespace = f"{PREFIX}r{rank}"
    deadline = time.monotonic() + 60
    while not _pids_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    while (pids := _pids_in(namespace)) and time.monotonic() < deadline:
        subprocess.run(["kill", "-9", *pids], capture_output=True, check=False)
        time.sleep(0.2)


@needs_netns
def test_cleanup_after_a_rank_crashes(tmp_path):
    killer = threading.Thread(target=_kill_rank_when_running, args=(1,))
    killer.start()
    with pytest.raises(BenchFailed, match=r"rank \d failed"):
        run_benchmark(
            "overlap",
            2,
            "100mbit",
            tmp_path / "out",
            [],
            command="interlace bench test",
            timeout_s=120,
        )
    killer.join()
    assert leftover_namespaces() == []
    assert not (tmp_path / "out").exists()


@needs_netns
def test_cleanup_when_the_caller_fails_inside_the_cluster():
    with pytest.raises(RuntimeError, match="on purpose"), Cluster(2, parse_rate("100mbit")) as c:
        sleeper = subprocess.Popen(c.rank_command(1, ["sleep", "60"]))
        raise RuntimeError("on purpose")
    assert sleeper.wait(timeout=10) != 0  # killed with its namespace
    assert leftover_namespaces() == []


def test_bad_option_is_refused_before_any_rank_starts(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "collectives", "--set", "ops=all_reduce,bogus", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ops ['bogus'] unknown" in err[0]
    assert not out.exists()


def test_report_page_quotes_the_json_figures(tmp_path, capsys):
    results = tmp_path / "results"
    doc = run_benchmark(
        "collectives",
        2,
        "loopback",
        results,
        ["max_size=1024", "min_seconds=0", "ops=all_reduce"],
        command="interlace bench collectives --marker",
        repeat=2,
    )
    page = tmp_path / "BENCHMARKS.md"
    assert main(["bench", "report", "--out", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    assert "interlace bench collectives --marker" in text
    row = doc["result"]["rows"][0]
    assert f"{row['seconds'] * 1e3:10.2f}".strip() in text  # the table comes from the JSON
    assert "Reproducibility: 2 runs" in text
    assert "![collectives](results/collectives.png)" in text
    assert "## ddp\n" in text and "_Not measured yet._" in text


@pytest.mark.slow  # ~20-50 s: eight DDP set-ups in fresh interpreters; CI runs it
def test_sketch_benchmark_runs_every_mode_and_quotes_bytes(tmp_path):
    doc = run_benchmark(
        "sketch",
        2,
        "loopback",
        tmp_path,
        ["workloads=click", "steps=2", "warmup=0"],
        command="interlace bench t",
    )
    click = doc["result"]["workloads"]["click"]
    assert set(click["modes"]) == {"dense", "powersgd", "topk", "sketch"}
    for mode in click["modes"].values():
        assert len(mode["losses"]) == 2 and mode["step_median_s"] > 0
    assert click["codec"]["nnz"] < click["codec"]["numel"]  # really sparse
    summary = click["modes"]["sketch"]["hook_summary"]
    assert summary["bytes_sent"] < 0.2 * summary["dense_bytes"]

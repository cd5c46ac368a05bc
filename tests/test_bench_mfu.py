"""`bench mfu` on the CPU (its smoke run): every mode of every shape measured, the figures
derived from the model FLOP count, and bad options refused before any work."""

import sys
import types

import pytest
import torch

from interlace.bench import get_benchmark, mfu_estimate, mfu_runs
from interlace.bench.mfu import _afresh, in_blocks, time_loop
from interlace.bench.mfu_estimate import EFFICIENCY, model_costs
from interlace.bench.mfu_runs import batches, dense_equivalent, mode_precision, modes, shape
from interlace.bench.runner import announce, parse_options
from interlace.errors import ConfigError
from interlace.mesh import DEVICE_ENV
from interlace.models.gpt import build_model
from interlace.throughput import model_flops_per_token

BENCH = get_benchmark("mfu")
OPTIONS = {
    **BENCH.options,
    "models": "moe-tiny",
    "batch": "4",
    "steps": 1,
    "warmup": 0,
    "compile": False,
    "moe_micro_batches": 2,
    "fp8": False,
}


def test_cpu_smoke_run_measures_trainer_and_loops_for_the_moe_model_and_its_dense_twin():
    result = BENCH.run_local(OPTIONS)
    rows = {(r["model"], r["mode"]): r for r in result["rows"]}
    models = ("moe-tiny", "moe-tiny (dense equivalent)")
    modes = ("trainer", "trainer_micro_batches_2", "loop_fp32", "loop_bf16")
    assert set(rows) == {(m, mode) for m in models for mode in modes}
    moe = shape("moe-tiny", OPTIONS)
    flops = {
        models[0]: model_flops_per_token(moe),
        models[1]: model_flops_per_token(dense_equivalent(moe)),
    }
    for (model, _), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["batch"] == 4
        assert row["model_tflops"] == pytest.approx(flops[model] * row["tokens_per_s"] / 1e12)
        assert row["mfu"] is None  # no peak for the CPU
    doc = {"result": result}
    ratios = [
        rows[(models[0], mode)]["tokens_per_s"] / rows[(models[1], mode)]["tokens_per_s"]
        for mode in modes[:2]
    ]
    versus_loop = (
        rows[(models[0], "trainer")]["tokens_per_s"]
        / rows[(models[0], "loop_bf16")]["tokens_per_s"]
    )
    assert BENCH.headline(doc).startswith(
        f"moe-tiny: Trainer {versus_loop:.2f}x the plain loop, {ratios[0]:.2f}x its dense "
        f"equivalent ({ratios[1]:.2f}x at 2 micro-batches of 4 sequences a step); "
    )
    assert "loop_bf16" in BENCH.table(doc)


def test_batch_is_one_count_for_every_model_or_one_per_model():
    assert batches({"models": "a,b", "batch": "16,8"}) == {"a": 16, "b": 8}
    assert batches({"models": "a,b", "batch": 4}) == {"a": 4, "b": 4}


def test_shapes_pad_the_vocabulary_to_a_multiple_of_128():
    assert shape("gpt2-124m", {"seq_len": 0}).vocab_size == 50304
    assert shape("gpt2-124m", {"seq_len": 256}).seq_len == 256


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"models": "gpt5"}, r"models \['gpt5'\] unknown"),
        ({"batch": "0"}, "batch=0 must be >= 1"),
        ({"batch": "16,8"}, "batch=16,8 gives 2 counts for 3 models"),
        ({"batch": "8,x,8"}, "batch=8,x,8 must be whole numbers"),
        ({"warmup": -1}, "warmup=-1 must be >= 0"),
        ({"moe_micro_batches": 0}, "moe_micro_batches=0 must be >= 1"),
    ],
)
def test_bad_options_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        BENCH.check({**BENCH.options, **change})


def test_each_measurement_compiles_afresh_with_static_sizes():
    """Without a reset, a function compiled for two sizes is compiled a third time with symbolic
    sizes, which every later size reuses; each measurement starts as a new process would."""
    from torch._dynamo.utils import counters

    double = torch.compile(lambda x: x * 2, backend="eager")
    double(torch.ones(3))
    double(torch.ones(4))  # now symbolic in x's size

    def run() -> float:
        before = counters["frames"]["ok"]
        double(torch.ones(5))
        double(torch.ones(6))
        return float(counters["frames"]["ok"] - before)

    assert _afresh(torch.device("cpu"), run)["tokens_per_s"] == 2  # compiled for each size


def test_without_cuda_the_defaults_are_a_cpu_run_of_minutes_and_set_still_wins(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    options = parse_options(BENCH, [])
    assert options == {**BENCH.options, **BENCH.cpu_options}
    assert options["models"] == "demo,moe-demo" and not options["compile"]
    assert parse_options(BENCH, ["models=gpt2-124m"])["models"] == "gpt2-124m"


def test_with_cuda_the_defaults_are_the_gpu_shapes(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_options(BENCH, []) == BENCH.options


def test_the_estimate_is_every_measurement_s_model_flops_over_the_probe_rate():
    options = {**OPTIONS, "models": "demo", "batch": "2", "warmup": 1}
    cost = model_costs(options, torch.device("cpu"), {"fp32": 1e9, "bf16": 1e8})["demo"]
    flops = model_flops_per_token(shape("demo", options)) * 2 * 128 * 2  # 2 steps of 2 x 128
    # the Trainer (fp32 on the CPU) and the fp32 loop, then the bf16 loop
    assert cost.seconds == pytest.approx(flops * (2 / 1e9 + 1 / 1e8) / EFFICIENCY)


def test_the_line_before_a_cpu_run_says_what_where_how_long_and_how_much_memory():
    line = announce(BENCH, BENCH.defaults(), 1, "loopback")  # the probe measured: < 1 s
    assert line.startswith(
        "bench mfu: demo (batch 4), moe-demo (batch 4); 11 measurements of 1 warm-up + 3 timed "
        "steps on cpu: "
    )
    assert line.endswith(", ~0.059 GiB at most")


def test_a_big_shape_on_the_cpu_is_called_out_with_its_time_and_memory(monkeypatch):
    monkeypatch.setattr(mfu_estimate, "probe_rates", lambda device: {"fp32": 1e11, "bf16": 1e11})
    monkeypatch.setattr(mfu_estimate, "memory_bytes", lambda device: 16 * 2**30)
    line = announce(BENCH, {**BENCH.defaults(), "models": "gpt2-1.5b"}, 1, "loopback")
    assert line == (
        "bench mfu: gpt2-1.5b (batch 4); 3 measurements of 1 warm-up + 3 timed steps on cpu: "
        "about 3 h, ~44 GiB at most; warning: gpt2-1.5b on the CPU takes about 3 h and needs "
        "~44 GiB, more than this machine's 16 GiB"
    )


def test_fp8_rows_are_refused_where_there_is_no_float8_and_priced_against_bf16():
    """fp8=true on the CPU stops before any run, saying what it needs; on a GPU the fp8
    Trainer row is measured beside the others, its MFU against the bf16 peak."""
    with pytest.raises(ConfigError, match="fp8=true: needs a CUDA GPU with float8 matmuls"):
        BENCH.check({**BENCH.defaults(), "fp8": True})
    assert "trainer_fp8" in modes({**BENCH.options, "fp8": True}, moe=False)
    assert mode_precision(torch.device("cuda"), "trainer_fp8") == "bf16"


def test_the_torchao_fp8_loop_is_the_fp8_peer_where_torchao_is_installed(monkeypatch):
    fp8 = {**BENCH.options, "fp8": True}
    monkeypatch.setattr(mfu_runs.importlib.util, "find_spec", lambda name: None)
    assert "loop_fp8_torchao" not in modes(fp8, moe=False)
    assert "torchao is not installed" in mfu_runs.fp8_peer_missing()
    monkeypatch.setattr(mfu_runs.importlib.util, "find_spec", lambda name: object())
    assert modes(fp8, moe=False)[-1] == "loop_fp8_torchao"
    assert mode_precision(torch.device("cuda"), "loop_fp8_torchao") == "bf16"


def test_the_fp8_loop_converts_the_blocks_linear_layers_through_torchao(monkeypatch):
    converted = []

    def convert(model, module_filter_fn):
        converted.extend(
            name
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module_filter_fn(module, name)
        )
        return model

    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    float8 = types.ModuleType("torchao.float8")
    float8.convert_to_float8_training = convert
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    config = shape("tiny", {**OPTIONS, "seq_len": None})
    tokens_per_s = time_loop(config, "bf16", False, 2, OPTIONS, float8=True)
    assert tokens_per_s > 0 and converted
    assert all(name.startswith("blocks.") for name in converted)
    linears = [n for n, m in build_model(config).named_modules() if isinstance(m, torch.nn.Linear)]
    assert set(converted) == {n for n in linears if n.startswith("blocks.")}  # not the head
    assert not in_blocks(torch.nn.Linear(8, 32), "blocks.0.mlp.fc")  # no float8 kernel for 8


def test_the_fp8_rows_are_set_against_the_torchao_loop():
    def row(mode, tokens_per_s):
        figures = {"tokens_per_s": tokens_per_s, "model_tflops": 1.0, "mfu": None, "batch": 8}
        return {"model": "m", "mode": mode, **figures}

    rows = [
        row("trainer", 100.0),
        row("trainer_fp8", 150.0),
        row("loop_bf16_compile", 90.0),
        row("loop_fp8_torchao", 120.0),
    ]
    doc = {"result": {"device_name": "gpu", "rows": rows}}
    lines = {line.split()[1]: line for line in BENCH.table(doc).splitlines()[2:]}
    assert " 1.25x " in lines["trainer_fp8"] and " 1.11x " in lines["trainer"]
    assert "fp8 1.50x the bf16 Trainer, 1.25x the torchao fp8 loop" in BENCH.headline(doc)

"""The `interlace` command line: a real training run end to end (console script, one process and
two ranks), `--help`/`--version`, `interlace plan`, and bad input that must fail with exit code
2, one line on stderr and nothing written."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import interlace
from interlace.cli import build_parser, main
from interlace.config_args import add_dataclass_args, dataclass_from_args
from interlace.models.presets import PRESETS
from interlace.train_config import TrainConfig

# The smallest run that exercises everything: tiny model, 4 sequences a step, one eval batch.
FAST = ["--model", "tiny", "--global-batch", "4", "--eval-batches", "1", "--no-progress"]
METRIC_KEYS = {"step", "loss", "lr", "step_time_s", "tokens_per_s", "comm_bytes"}


def train_args(out: Path, steps: int, *extra: str) -> list[str]:
    """`interlace train` arguments (without the program name) for a fast run into `out`."""
    return ["train", *FAST, "--steps", str(steps), "--out", str(out), *extra]


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_files(out: Path) -> dict[str, bytes]:
    """Every file under `out` by relative path, with its bytes."""
    return {
        p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
    }


def expect_usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run `interlace <argv>` in-process; assert exit code 2 and exactly one stderr line
    'interlace: error: ...' containing every needle. Returns that line."""
    capsys.readouterr()  # drop anything printed earlier in the test
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("interlace: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (checkpoint at step 2); copy it before changing anything in it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(train_args(out, 2)) == 0
    return out


@pytest.fixture
def run_copy(finished_run: Path, tmp_path: Path) -> Path:
    """A private copy of `finished_run` that a test may damage."""
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def checkpoint_dir(out: Path) -> Path:
    root = out / "checkpoints"
    return root / (root / "latest").read_text().strip()


# ---------------------------------------------------------------------- real runs


def test_console_script_trains_and_writes_metrics_report_plot_and_checkpoint(tmp_path: Path):
    script = Path(sys.executable).parent / "interlace"
    assert script.is_file(), "the `interlace` console script is not installed beside python"
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(script), *train_args(out, 3)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^done: 3 steps, loss \d+\.\d{3} -> \d+\.\d{3}", proc.stdout, re.M)

    rows = read_rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row.keys() >= METRIC_KEYS, row
        assert math.isfinite(row["loss"]) and row["loss"] > 0
        assert row["lr"] > 0 and row["step_time_s"] > 0 and row["tokens_per_s"] > 0
    assert math.isfinite(rows[-1]["eval_loss"])  # the final step always evaluates

    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 3
    assert report["plan_str"].startswith("dp=1")
    assert report["model"]["params"] == PRESETS["tiny"].num_params() > 0
    assert report["final_loss"] == rows[-1]["loss"]

    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    ckpt = checkpoint_dir(out)
    assert ckpt.name == "step-00000003"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert any(name.endswith(".distcp") for name in manifest)
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 3


def test_two_rank_launch_all_reduces_over_dp_and_writes_one_report(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher would set it in this process
    out = tmp_path / "run"
    assert main(train_args(out, 2, "--nproc", "2")) == 0, capfd.readouterr().err

    rows = read_rows(out)
    assert [row["step"] for row in rows] == [1, 2]  # rank 0 alone writes the metrics
    for row in rows:
        assert math.isfinite(row["loss"])
        assert row["comm_bytes"]["dp"] > 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 2 and report["world_size"] == 2
    assert report["plan_str"].startswith("dp=2")
    ckpt = checkpoint_dir(out)
    assert ckpt.name == "step-00000002"
    assert {"rng-rank0.pt", "rng-rank1.pt", "manifest.json"} <= {p.name for p in ckpt.iterdir()}
    assert len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank


def test_resume_continues_from_checkpoint_and_keeps_earlier_metrics(run_copy: Path):
    before = (run_copy / "metrics.jsonl").read_text()
    assert main(train_args(run_copy, 3, "--resume")) == 0
    after = (run_copy / "metrics.jsonl").read_text()
    assert after.startswith(before)
    assert [row["step"] for row in read_rows(run_copy)] == [1, 2, 3]
    assert checkpoint_dir(run_copy).name == "step-00000003"
    assert json.loads((run_copy / "report.json").read_text())["steps"] == 3


def test_overwrite_replaces_an_earlier_run(run_copy: Path):
    assert main(train_args(run_copy, 3, "--overwrite")) == 0
    assert [row["step"] for row in read_rows(run_copy)] == [1, 2, 3]
    # The old run's step-2 checkpoint is gone, not kept beside the new one.
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == [
        "latest",
        "step-00000003",
    ]


# ---------------------------------------------------------------------- help, version, plan


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"interlace {interlace.__version__}"
    assert interlace.__version__ == importlib.metadata.version("interlace")


@pytest.mark.parametrize(
    ("command", "options"),
    [
        ("train", ["--model", "--nproc", "--plan", "--data", "--steps", "--out", "--resume"]),
        ("train", ["--overwrite", "--global-batch", "--ckpt-every", "--no-progress"]),
        ("plan", ["--model", "--plan", "--nproc", "--list"]),
    ],
)
def test_help_of_each_command_lists_its_options(capsys, command, options):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: interlace {command}")
    for option in options:
        assert option in out, option


def test_train_options_are_the_train_config_fields(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name.replace('_', '-')}" in out, field.name
        assert " ".join(field.metadata["help"].split()) in out, field.name
    defaults = build_parser().parse_args(["train"])
    assert dataclass_from_args(TrainConfig, defaults) == TrainConfig()


def test_train_options_parse_aliases_lists_and_switches():
    argv = ["--preset", "tiny", "--micro-batch", "2", "--tokenizer", "bpe", "--no-progress"]
    argv += ["--split-points", "blocks.1, blocks.2", "--layers-per-stage", "2,1", "--lr", "1e-3"]
    config = dataclass_from_args(TrainConfig, build_parser().parse_args(["train", *argv]))
    assert config == TrainConfig(
        model="tiny",
        micro_batch=2,
        tokenizer="bpe",
        progress=False,
        split_points=("blocks.1", "blocks.2"),
        layers_per_stage=(2, 1),
        lr=1e-3,
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--layers-per-stage", "3,x"], "'3,x': give comma-separated integers"),
        (["--split-points", "blocks.1,"], "'blocks.1,': give comma-separated names"),
    ],
)
def test_badly_typed_train_options_are_usage_errors(capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


def test_unknown_tokenizer_is_refused_naming_the_valid_values(capsys, tmp_path):
    argv = train_args(tmp_path / "run", 1, "--tokenizer", "words")
    expect_usage_error(capsys, argv, "tokenizer 'words'", "byte, bpe", "tokenizer.json")
    assert not (tmp_path / "run").exists()


def test_a_field_without_a_command_line_form_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Odd:
        sizes: list[int] = dataclasses.field(default_factory=list, metadata={"help": "sizes"})

    with pytest.raises(TypeError, match="field 'sizes': no command-line form"):
        add_dataclass_args(argparse.ArgumentParser(), Odd)


def test_plan_describes_gpt3_on_eight_data_parallel_ranks(capsys):
    assert main(["plan", "--model", "gpt3-175b", "--plan", "dp=8", "--nproc", "8"]) == 0
    out = capsys.readouterr().out
    params = PRESETS["gpt3-175b"].num_params()
    assert 170e9 < params < 180e9
    assert f"gpt3-175b: {params:,} parameters" in out
    assert re.search(r"^plan\s+dp=8", out, re.M)
    # fp32 weights + grads + AdamW state = 16 bytes per parameter, unsharded under dp alone.
    assert f"{params * 16 / 2**30:.2f} GiB" in out
    assert re.search(r"^fits\s+no: more than one device", out, re.M)
    assert (
        main(["plan", "--model", "gpt3-175b", "--plan", "pp=8,micro_batches=8", "--nproc", "8"])
        == 0
    )
    assert "fits        no" in capsys.readouterr().out  # 325 GiB a rank: still no device
    assert main(["plan", "--model", "gpt2-124m", "--plan", "dp=8", "--nproc", "8"]) == 0
    assert "fits" not in capsys.readouterr().out


def test_plan_list_names_every_preset(capsys):
    assert main(["plan", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == list(PRESETS)
    assert {"tiny", "gpt3-175b"} <= set(names)
    tiny = lines[names.index("tiny")]
    assert "dense" in tiny and "heads=4" in tiny


def test_plan_rejects_a_plan_that_does_not_fit_the_world_size(capsys):
    args = ["plan", "--model", "tiny", "--plan", "dp=3", "--nproc", "8"]
    expect_usage_error(capsys, args, "dp=3")


# ---------------------------------------------------------------------- bad input: nothing written


def test_world_size_not_matching_plan_fails_before_anything_starts(capsys, tmp_path):
    out = tmp_path / "never"
    line = expect_usage_error(capsys, train_args(out, 2, "--nproc", "1", "--plan", "dp=2"), "dp=2")
    assert "world size is 1" in line
    assert not out.exists()


def test_hidden_size_not_divisible_by_heads_is_refused(capsys, tmp_path):
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    model_file = config_dir / "odd.json"
    model_file.write_text(
        json.dumps({"vocab_size": 256, "seq_len": 32, "d_model": 66, "n_layers": 1, "n_heads": 4})
    )
    out = tmp_path / "never"
    args = train_args(out, 2)
    args[args.index("tiny")] = str(model_file)
    expect_usage_error(capsys, args, "d_model=66", "n_heads=4")
    assert not out.exists()


def test_missing_data_path_is_refused(capsys, tmp_path):
    missing = tmp_path / "no-such-corpus.txt"
    out = tmp_path / "never"
    expect_usage_error(capsys, train_args(out, 2, "--data", str(missing)), str(missing))
    assert not out.exists()


def test_unknown_preset_is_refused_and_valid_ones_are_named(capsys, tmp_path):
    out = tmp_path / "never"
    args = train_args(out, 2)
    args[args.index("tiny")] = "gpt-9000"
    expect_usage_error(capsys, args, "'gpt-9000'", "tiny")
    assert not out.exists()


def test_unimplemented_plan_feature_is_refused_before_launching(capsys, tmp_path):
    out = tmp_path / "never"
    expect_usage_error(
        capsys,
        train_args(out, 4, "--plan", "cp=2,tp3d=1x2x1", "--nproc", "4"),
        "cp=2 with tp3d=1x2x1",
        "not implemented yet",
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("split", "needles"),
    [
        (["--split-points", "blocks.9"], ["'blocks.9' matches no module"]),
        (["--layers-per-stage", "1,3"], ["layers_per_stage=[1, 3]", "2 layers"]),
    ],
)
def test_pipeline_split_naming_no_layer_is_refused_before_launching(
    capsys, tmp_path, split, needles
):
    out = tmp_path / "never"
    plan = ["--nproc", "2", "--plan", "pp=2,micro_batches=2"]
    expect_usage_error(capsys, train_args(out, 2, *plan, *split), *needles)
    assert not out.exists()


def test_pipeline_split_without_a_pipeline_is_refused(capsys, tmp_path):
    out = tmp_path / "never"
    args = train_args(out, 2, "--nproc", "2", "--plan", "dp=2", "--split-points", "blocks.1")
    expect_usage_error(capsys, args, "pp > 1")
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--lr", "nan"], ["lr=nan is not a finite number", "lr=0.002 (the default)"]),
        (["--grad-clip", "nan"], ["grad_clip=nan", "grad_clip=1.0"]),
        (["--weight-decay=-inf"], ["weight_decay=-inf"]),
        (["--min-lr-ratio", "nan"], ["min_lr_ratio=nan"]),
        (["--peak-tflops", "inf"], ["peak_tflops=inf", "leave it unset"]),
        (["--plan", "dp_bucket_mb=nan"], ["dp_bucket_mb=nan", "dp_bucket_mb=25.0"]),
        (["--plan", "dp_bucket_mb=inf"], ["dp_bucket_mb=inf"]),
    ],
)
def test_non_finite_numbers_are_refused_before_anything_starts(capsys, tmp_path, extra, needles):
    out = tmp_path / "never"
    expect_usage_error(capsys, train_args(out, 2, *extra), *needles)
    assert not out.exists()


def test_non_finite_model_field_is_refused(capsys, tmp_path):
    model = {"vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 1, "n_heads": 4}
    model_file = tmp_path / "model.json"
    model_file.write_text(json.dumps({**model, "init_std": math.inf}))  # json writes Infinity
    out = tmp_path / "never"
    args = train_args(out, 2)
    args[args.index("tiny")] = str(model_file)
    expect_usage_error(capsys, args, "init_std=inf is not a finite number")
    assert not out.exists()


def test_file_of_nul_bytes_is_refused_as_data(capsys, tmp_path):
    zeros = tmp_path / "zeros.txt"
    zeros.write_bytes(bytes(10_000))
    out = tmp_path / "never"
    expect_usage_error(capsys, train_args(out, 2, "--data", str(zeros)), "zeros.txt' is not text")
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "value"), [("--timeout", "nan"), ("--timeout", "inf"), ("--cpu-per-rank", "nan")]
)
def test_non_finite_bench_numbers_are_refused(capsys, tmp_path, option, value):
    out = tmp_path / "never"
    args = ["bench", "sketch", "--ranks", "2", "--out", str(out), option, value]
    expect_usage_error(capsys, args, f"{option} {value} must be a finite number")
    assert not out.exists()


def test_out_dir_holding_a_run_is_not_overwritten_without_a_flag(capsys, run_copy):
    before = run_files(run_copy)
    expect_usage_error(capsys, train_args(run_copy, 3), str(run_copy), "--overwrite")
    assert run_files(run_copy) == before


def corrupt_a_shard(out: Path) -> Path:
    """Flip the middle byte of the checkpoint's first .distcp file; returns the checkpoint."""
    ckpt = checkpoint_dir(out)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return ckpt


def test_corrupt_checkpoint_is_refused_into_a_new_out_dir(capsys, run_copy, tmp_path):
    ckpt = corrupt_a_shard(run_copy)
    out = tmp_path / "never"
    args = train_args(out, 3, "--resume", str(ckpt))
    expect_usage_error(capsys, args, "corrupt", ".distcp")
    assert not out.exists()


def test_corrupt_checkpoint_resumed_in_place_leaves_the_run_untouched(capsys, run_copy):
    corrupt_a_shard(run_copy)
    before = run_files(run_copy)
    expect_usage_error(capsys, train_args(run_copy, 3, "--resume"), "corrupt")
    assert run_files(run_copy) == before  # metrics.jsonl included, byte for byte


class _Plant:
    """A pickle that creates the file `path` when it is loaded: what a crafted file runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def reseal(ckpt: Path) -> None:
    """Rewrite the checkpoint's manifest to match its files, as anyone crafting one can."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest:
        data = (ckpt / name).read_bytes()
        manifest[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("target", ["rng-rank0.pt", ".metadata"])
def test_crafted_pickle_in_a_checkpoint_is_refused_without_running(
    capsys, run_copy, tmp_path, target
):
    marker = tmp_path / "ran"
    ckpt = checkpoint_dir(run_copy)
    if target == ".metadata":  # the file torch's DCP reader unpickles with pickle.load
        (ckpt / target).write_bytes(pickle.dumps(_Plant(marker)))
    else:
        torch.save({"torch": _Plant(marker)}, ckpt / target)
    reseal(ckpt)
    out = tmp_path / "never"
    expect_usage_error(capsys, train_args(out, 3, "--resume", str(ckpt)), "refused", target)
    assert not marker.exists()
    assert not out.exists()


def test_checkpoint_of_another_run_setup_is_refused(capsys, run_copy, tmp_path):
    # another data order (a changed global batch or plan is allowed: test_reshard.py)
    out = tmp_path / "never"
    args = train_args(out, 3, "--resume", str(run_copy), "--seed", "1")
    expect_usage_error(capsys, args, "does not match", "data")
    assert not out.exists()


def test_resuming_a_run_that_already_reached_its_steps_is_refused(capsys, run_copy):
    before = run_files(run_copy)
    expect_usage_error(
        capsys, train_args(run_copy, 2, "--resume"), "already at step 2", "--steps=2"
    )
    assert run_files(run_copy) == before


def test_svm_command_fits_a_libsvm_file(capsys):
    from helpers import SVM_DATA

    train, test = SVM_DATA / "heart_scale.tr", SVM_DATA / "heart_scale.t"
    assert main(["svm", str(train), "--test", str(test)]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and "non-zeros" in out


def test_plan_show_stages_prints_one_row_per_pipeline_stage(capsys):
    args = ["plan", "--model", "gpt3-175b", "--plan", "pp=8,dp=8,micro_batches=16", "--nproc", "64"]
    assert main([*args, "--show-stages"]) == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if re.match(r"^\d+\s+\d+\s", line)
    ]
    assert len(rows) == 8
    assert "embed" in rows[0] and "head" in rows[-1]
    assert main(["plan", "--show-stages"]) == 2
    assert "needs a plan with pp > 1" in capsys.readouterr().err

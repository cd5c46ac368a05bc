"""`interlace train --config FILE.toml`: a settings file trains, the command line overrides it,
the run folder's resolved config.toml repeats the run bit for bit and gives `--resume` the run's
own settings back; bad keys and values fail with exit code 2 and one line."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from interlace import __version__, launch
from interlace.cli import main
from interlace.config_file import CONFIG_FILE, to_toml

RUN_TOML = """\
model = "tiny"
steps = 3
seed = 3
plan = "dp=1"
ckpt_every = 1
global_batch = 4
eval_batches = 1
progress = false
"""


def losses(out: Path) -> list[float]:
    rows = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(row)["loss"] for row in rows]


def saved(out: Path) -> dict:
    return tomllib.loads((out / CONFIG_FILE).read_text())


@pytest.fixture(scope="module")
def file_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of RUN_TOML with `--steps 2` given on the command line."""
    folder = tmp_path_factory.mktemp("file_run")
    file, out = folder / "run.toml", folder / "run"
    file.write_text(RUN_TOML)
    assert main(["train", "--config", str(file), "--steps", "2", "--out", str(out)]) == 0
    return out


def test_a_settings_file_trains_and_the_command_line_overrides_it(file_run: Path):
    assert len(losses(file_run)) == 2  # --steps 2 over the file's 3
    settings = saved(file_run)
    assert (settings["model"], settings["seed"], settings["steps"]) == ("tiny", 3, 2)
    assert settings["global_batch"] == 4 and settings["nproc"] == 1
    assert settings["plan"]["dp"] == 1 and settings["plan"]["schedule"] == "1f1b"  # filled in
    assert "seq_len" not in settings  # unset: a comment
    first = (file_run / CONFIG_FILE).read_text().splitlines()[0]
    assert first.startswith("# ") and f"interlace {__version__}, torch " in first


def test_the_run_config_reproduces_the_run_bit_for_bit(file_run: Path, tmp_path: Path):
    again = tmp_path / "again"
    assert main(["train", "--config", str(file_run / CONFIG_FILE), "--out", str(again)]) == 0
    assert losses(again) == losses(file_run)
    assert saved(again) == {**saved(file_run), "out": str(again)}


def test_plan_reads_model_and_plan_from_a_settings_file(file_run: Path, capsys):
    assert main(["plan", "--config", str(file_run / CONFIG_FILE)]) == 0
    printed = capsys.readouterr().out
    assert "plan        dp=1" in printed and "model       tiny:" in printed


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("stpes = 3", ["unknown key 'stpes' = 3", "did you mean 'steps'", "valid keys: model"]),
        ('steps = "ten"', ['steps = "ten" is not an integer']),
        ("progress = 1", ["progress = 1 is not true or false"]),
        ('precision = "fp64"', ['precision = "fp64" is not one of auto']),
        ("split_points = [1]", ["split_points = [1] is not an array of strings"]),
        ("[plan]\ndp_shards = 2", ["unknown key 'plan.dp_shards' = 2", "did you mean 'dp_shard'"]),
        ("[plan]\ntp3d = [2, 2]", ["plan.tp3d = [2, 2] is not an array of 3 integers"]),
        ("plan = 2", ["plan = 2 is neither a plan text"]),
        ("steps = ", ["not valid TOML", "line 2"]),
    ],
)
def test_a_bad_key_or_value_is_one_line_and_exit_code_2(capsys, tmp_path, text, needles):
    file = tmp_path / "run.toml"
    file.write_text(f'model = "tiny"\n{text}\n')
    out = tmp_path / "never"
    capsys.readouterr()
    assert main(["train", "--config", str(file), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"interlace: error: {file}"), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists()


def test_resume_takes_the_run_settings_back_and_says_what_changed(file_run, tmp_path, capsys):
    run = Path(shutil.copytree(file_run, tmp_path / "run"))  # moved: its `out` is stale
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "4"]) == 0
    assert f"resuming with the settings of {run / CONFIG_FILE}; changed: steps 2 -> 4\n" in (
        capsys.readouterr().err
    )
    # seed 3 restored (else the checkpoint's data order would not match), every step
    # checkpointed (ckpt_every = 1: steps 3 and 4 kept; once at the end would keep 2 and 4)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-00000003",
        "step-00000004",
    ]
    settings = saved(run)
    assert (settings["seed"], settings["ckpt_every"], settings["steps"]) == (3, 1, 4)
    assert settings["out"] == str(run)


def test_resume_launches_as_many_ranks_as_the_run_had(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher would set it in this process
    out = tmp_path / "run"
    fast = ["--model", "tiny", "--global-batch", "4", "--eval-batches", "1", "--no-progress"]
    assert main(["train", *fast, "--steps", "1", "--nproc", "2", "--out", str(out)]) == 0
    settings = saved(out)  # written by rank 0
    assert settings["nproc"] == 2 and settings["plan"]["dp"] == 2
    launched = []
    monkeypatch.setattr(launch, "launch_local", lambda *call: launched.append(call))
    assert main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 0
    assert launched == [(2, ["interlace.train", "--out", str(out), "--resume", "--steps", "2"], 0)]


def test_written_toml_reads_back_as_written():
    settings = {
        "text": 'a "quoted" \\ path\twith\x01control',
        "number": 1e-05,
        "count": -3,
        "switch": False,
        "names": ("blocks.1", "blocks.2"),
        "empty": (),
        "unset": None,
        "table": {"dims": (2, 2, 1), "rate": 25.0, "none": None},
    }
    read = tomllib.loads(to_toml(settings, "a comment"))
    expected = {k: v for k, v in settings.items() if k != "unset"}
    expected |= {"names": ["blocks.1", "blocks.2"], "empty": []}
    expected |= {"table": {"dims": [2, 2, 1], "rate": 25.0}}
    assert read == expected

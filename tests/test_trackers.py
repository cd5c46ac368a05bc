"""Experiment trackers: `--tensorboard`'s scalars and an offline `--wandb` run hold the values of
metrics.jsonl at every step; a tracker whose package is missing is refused before launch with
one line and exit code 2."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from interlace.cli import main
from interlace.errors import ConfigError
from interlace.report import METRICS, read_metrics
from interlace.tracking.loggers import TENSORBOARD_FOLDER
from interlace.tracking.scalars import scalars
from interlace.train_config import TrainConfig

# three steps of the tiny model, evaluated at the last one
RUN = ["--model", "tiny", "--global-batch", "4", "--steps", "3", "--eval-every", "3"]
RUN += ["--eval-batches", "1", "--no-progress", "--no-measure-memory"]

# metrics.jsonl's fields and the tracker names they are logged under
TRACKED = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm"}
TRACKED |= {"tokens_per_s": "train/tokens_per_s", "eval_loss": "eval/loss"}


def _train(out: Path, *extra: str) -> list[dict]:
    """Run `interlace train` into `out` with `extra` options; its metrics.jsonl rows."""
    assert main(["train", *RUN, "--out", str(out), *extra]) == 0
    return read_metrics(out / METRICS)


def _assert_logged(rows: list[dict], logged: dict[str, dict[int, float]]) -> None:
    """Every `TRACKED` field of `rows` is in `logged` (tracker name → step → value) at the same
    steps, equal up to float32 rounding (TensorBoard stores float32)."""
    for field, name in TRACKED.items():
        expected = {row["step"]: row[field] for row in rows if field in row}
        assert logged[name] == pytest.approx(expected, rel=1e-6, abs=1e-12), name
    assert sorted(logged["train/loss"]) == [1, 2, 3]


def test_scalars_name_the_numbers_of_a_row():
    row = {
        "step": 4,
        "loss": 2.5,
        "eval_loss": 3,
        "skipped": True,
        "comm_bytes": {"dp": 8},
        "moe": [{"balance_degree": 0.5, "tokens": [1, 2], "replicated": []}],
    }
    assert scalars(row) == {
        "train/loss": 2.5,
        "eval/loss": 3.0,
        "train/comm_bytes/dp": 8.0,
        "train/moe/0/balance_degree": 0.5,
    }


def test_tensorboard_scalars_equal_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    rows = _train(out, "--tensorboard")
    events = EventAccumulator(str(out / TENSORBOARD_FOLDER))
    events.Reload()
    logged = {
        name: {event.step: event.value for event in events.Scalars(name)}
        for name in events.Tags()["scalars"]
    }
    _assert_logged(rows, logged)


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    rows = _train(out, "--wandb", "interlace-test", "--wandb-run-name", "tiny-3")
    [run_file] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("interlace-test", "tiny-3")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["train"]["steps"] == 3
    assert config["plan"]["dp"] == 1
    logged: dict[str, dict[int, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                name = item.key or "/".join(item.nested_key)
                logged.setdefault(name, {})[record.history.step.num] = json.loads(item.value_json)
    _assert_logged(rows, logged)


LOG_BLOCK, LOG_HEADER, FULL, LAST = 32768, 7, 1, 4


def _wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file: after a 7-byte file header (`:W&B`, a magic
    number, a version), a LevelDB log of 32 KiB blocks, each record one FULL chunk or FIRST,
    MIDDLE and LAST ones, each behind a 7-byte header (CRC32, length, type); a block's tail
    too short for a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    raw = path.read_bytes()
    assert raw.startswith(b":W&B")
    records, pending, pos = [], b"", LOG_HEADER
    while pos + LOG_HEADER <= len(raw):
        if LOG_BLOCK - pos % LOG_BLOCK < LOG_HEADER:
            pos += LOG_BLOCK - pos % LOG_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + LOG_HEADER])
        pending += raw[pos + LOG_HEADER : pos + LOG_HEADER + length]
        pos += LOG_HEADER + length
        if kind in (FULL, LAST):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.parametrize(
    ("option", "package"), [(["--tensorboard"], "tensorboard"), (["--wandb", "p"], "wandb")]
)
def test_a_tracker_without_its_package_is_refused(tmp_path, capsys, monkeypatch, option, package):
    monkeypatch.setitem(sys.modules, package, None)  # importing it fails, as when not installed
    out = tmp_path / "run"
    assert main(["train", *RUN, "--out", str(out), *option]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"interlace: error: {package} needs the {package} package: pip install 'interlace[track]'"
    ]
    assert not out.exists()


def test_a_tracker_without_a_run_folder_is_refused():
    with pytest.raises(ConfigError, match="tensorboard needs a run folder"):
        TrainConfig(tensorboard=True, out=None).validate()

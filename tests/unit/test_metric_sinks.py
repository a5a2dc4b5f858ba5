"""Metric sinks (--log.to): choosing them, torchtitan's names, and each sink's files read
back with its own library's reader (TensorBoard's EventAccumulator, MLflow's client, the
W&B run file's records, the csv module)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest

from shardwise.observe import metric_sinks as M
from shardwise.train import options as O

RECORDS = [
    {"step": 1, "loss": 5.5, "lr": 1e-4, "grad_norm": 1.5, "tokens_per_s": 4000.0,
     "tflops": 0.25, "mfu_pct": 12.5, "max_memory_mb": 2048.0, "memory_mb": [1.0, 2.0],
     "time_s": 0.5, "comm_bytes": 1000},
    {"step": 2, "loss": 5.0, "lr": 2e-4, "grad_norm": 1.25, "tokens_per_s": 6000.0,
     "tflops": 0.375, "mfu_pct": 18.75, "max_memory_mb": 3072.0, "memory_mb": [1.0, 2.0],
     "time_s": 1.0, "val_loss": 4.5, "val_accuracy": 0.25, "best": True},
]
WORLD = 2


def test_torchtitan_names() -> None:
    got = M.torchtitan_scalars(RECORDS[1], WORLD)
    assert got == {
        "loss_metrics/global_avg_loss": 5.0, "lr": 2e-4, "grad_norm": 1.25,
        "throughput(tps)": 3000.0,  # per device: 6000 tokens/s over 2 ranks
        "tflops": 0.375, "mfu(%)": 18.75, "memory/max_reserved(GiB)": 3.0, "time_s": 1.0,
        "validation_metrics/loss": 4.5, "validation_metrics/accuracy": 0.25,
    }  # the per-rank list and the flag stay in metrics.jsonl


def test_log_to_is_checked_when_the_config_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown sink 'tensorbord'; choose from tensorboard"):
        O.build({"log.to": "csv,tensorbord"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError) as e:
        O.build({"log.to": "wandb"})
    assert str(e.value) == ("log.to=wandb needs the wandb package, which is not installed: "
                            "pip install wandb")
    assert O.build({"log.to": " CSV, jsonl,csv"}).log.to == " CSV, jsonl,csv"
    assert M.parse_sinks(" CSV, jsonl,csv") == ["csv"]  # jsonl is always written
    with pytest.raises(ValueError, match=r"log.peak_tflops=-1.0 must be >= 0"):
        O.build({"log.peak_tflops": "-1"})


def _write(sink: M.MetricSink) -> None:
    for r in RECORDS:
        sink.log(M.torchtitan_scalars(r, WORLD), r["step"])
    sink.close()


def test_csv_rows_and_a_column_that_appears_later(tmp_path: Path) -> None:
    _write(M.CsvSink(tmp_path))
    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert rows[0]["validation_metrics/loss"] == "" and rows[1]["validation_metrics/loss"] == "4.5"
    assert float(rows[0]["throughput(tps)"]) == 2000.0 and float(rows[1]["mfu(%)"]) == 18.75
    # A resumed run appends under the same header.
    again = M.CsvSink(tmp_path)
    again.log({"loss_metrics/global_avg_loss": 4.0}, 3)
    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3"] and rows[2]["grad_norm"] == ""


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(M.TensorBoardSink(tmp_path))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss_metrics/global_avg_loss", "throughput(tps)", "mfu(%)", "grad_norm",
            "memory/max_reserved(GiB)", "validation_metrics/loss"} <= tags
    loss = [(e.step, e.value) for e in acc.Scalars("loss_metrics/global_avg_loss")]
    assert loss == [(1, 5.5), (2, 5.0)]
    assert [(e.step, e.value) for e in acc.Scalars("validation_metrics/loss")] == [(2, 4.5)]
    assert [e.value for e in acc.Scalars("throughput(tps)")] == [2000.0, 3000.0]


def test_mlflow_file_store_read_back(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    sink = M.MlflowSink(tmp_path, "run-a", {"train.lr": 1e-4})
    run_id = sink.run_id
    _write(sink)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.0001"
    hist = client.get_metric_history(run_id, "loss_metrics/global_avg_loss")
    assert sorted((m.step, m.value) for m in hist) == [(1, 5.5), (2, 5.0)]
    # MLflow forbids parentheses and %: the documented spellings.
    assert [m.value for m in client.get_metric_history(run_id, "mfu_pct")] == [12.5, 18.75]
    assert {m.step: m.value for m in client.get_metric_history(run_id, "throughput_tps")} == {
        1: 2000.0, 2: 3000.0}
    assert M.mlflow_key("memory/max_reserved(GiB)") == "memory/max_reserved_GiB"


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """The history rows of the offline W&B run under `run_dir`, from its .wandb file: a
    7-byte file header (":W&B", id, version), then LevelDB-log records (crc32c, length,
    type; 32 KiB blocks) each holding a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, part, rows = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's zero-filled tail
            pos += left
            continue
        part += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in rec.history.item})
    return rows


def test_wandb_offline_run_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "online")  # the sink is offline whatever this says
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    _write(M.WandbSink(tmp_path, "run-w", {"train.lr": 1e-4}))
    rows = wandb_history(tmp_path)
    assert [r["_step"] for r in rows] == [1, 2]
    assert [r["loss_metrics/global_avg_loss"] for r in rows] == [5.5, 5.0]
    assert rows[1]["validation_metrics/loss"] == 4.5 and rows[0]["mfu(%)"] == 12.5
    assert math.isclose(rows[1]["throughput(tps)"], 3000.0)


def test_resume_writes_each_step_once(tmp_path: Path) -> None:
    """Issue 42: a run resumed from its step-1 checkpoint replays step 2; metrics.csv and
    TensorBoard then held step 2 twice (metrics.jsonl did not)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = M.open_sinks(["csv", "tensorboard"], tmp_path, "r", {})
    _log(first, RECORDS)
    again = M.open_sinks(["csv", "tensorboard"], tmp_path, "r", {}, resumed_at=1)
    _log(again, [{**RECORDS[1], "loss": 4.75}])
    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert rows[1]["loss_metrics/global_avg_loss"] == "4.75"
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("loss_metrics/global_avg_loss")]
    assert loss == [(1, 5.5), (2, 4.75)]


def _log(sinks: list, records: list[dict]) -> None:
    for r in records:
        for s in sinks:
            s.log(M.torchtitan_scalars(r, WORLD), r["step"])
    for s in sinks:
        s.close()

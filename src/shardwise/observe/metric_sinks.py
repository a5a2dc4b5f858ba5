"""Metric sinks: where a run's per-step scalars go besides metrics.jsonl.

`--log.to tensorboard,wandb,mlflow,csv` picks any of them; each writes inside the run folder
and nothing leaves the machine (W&B runs offline; MLflow uses a local file store). A sink's
package is imported only when chosen, and a missing one is a one-line error naming the pip
command, raised while the config is checked (before any process starts).

The scalars carry torchtitan's names (`metrics.jsonl` keeps its own, documented in
docs/training.md), so dashboards built for torchtitan read shardwise runs:

    loss -> loss_metrics/global_avg_loss      tokens_per_s / world -> throughput(tps)
    grad_norm -> grad_norm                    tflops -> tflops, mfu_pct -> mfu(%)
    lr -> lr                                  max_memory_mb / 1024 -> memory/max_reserved(GiB)
    val_loss -> validation_metrics/loss       (any val_X -> validation_metrics/X)

Other numeric fields keep their names; lists and flags stay in metrics.jsonl only.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

# name -> (the module that must be importable, the pip command that installs it)
SINKS: dict[str, tuple[str | None, str]] = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow-skinny"),
    "csv": (None, ""),
    "jsonl": (None, ""),  # metrics.jsonl, written always: accepted so a list can name it
}

_RENAMED = {"loss": "loss_metrics/global_avg_loss", "grad_norm": "grad_norm", "lr": "lr",
            "tflops": "tflops", "mfu_pct": "mfu(%)"}


def parse_sinks(spec: str) -> list[str]:
    """`--log.to`'s comma-separated names -> the sinks besides metrics.jsonl, in order;
    ValueError for an unknown name or a sink whose package is not installed."""
    names = [n.strip().lower() for n in spec.split(",") if n.strip()] if spec else []
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"log.to={spec!r} is not allowed: unknown sink {unknown[0]!r}; "
                         f"choose from {', '.join(SINKS)} (comma-separated)")
    out = []
    for n in dict.fromkeys(names):  # once each, in the order given
        module, pip = SINKS[n]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ValueError(f"log.to={n} needs the {module} package, which is not installed: "
                             f"{pip}")
        if n != "jsonl":
            out.append(n)
    return out


def torchtitan_scalars(record: dict[str, Any], world: int) -> dict[str, float]:
    """A metrics.jsonl record -> scalars named as torchtitan names them (module docstring)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key == "tokens_per_s":
            out["throughput(tps)"] = value / world  # torchtitan's tps is per device
        elif key == "max_memory_mb":
            out["memory/max_reserved(GiB)"] = value / 1024
        elif key.startswith("val_"):
            out[f"validation_metrics/{key[4:]}"] = value
        else:
            out[_RENAMED.get(key, key)] = value
    return {k: float(v) for k, v in out.items()}


class MetricSink(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Event files under <run>/tensorboard/ (`tensorboard --logdir runs/<name>/tensorboard`)."""

    def __init__(self, run_dir: Path, resumed_at: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resume at step N replays the steps after N: purge_step tells TensorBoard to drop
        # the earlier run's events from N + 1 on, so each step shows once.
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=resumed_at + 1 if resumed_at else None)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a crash keeps every step written so far

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """An offline W&B run under <run>/wandb/ (upload later with `wandb sync`)."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        import wandb

        # Offline whatever the environment says: a run never talks to a server.
        os.environ["WANDB_MODE"] = "offline"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardwise"), name=name,
                              dir=str(run_dir), mode="offline", config=config,
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_key(name: str) -> str:
    """MLflow allows letters, digits and `_-. :/` only: `mfu(%)` -> `mfu_pct`,
    `throughput(tps)` -> `throughput_tps`, `memory/max_reserved(GiB)` -> `..._GiB`."""
    name = name.replace("(%)", "_pct").replace("(", "_").replace(")", "")
    return re.sub(r"[^\w\-. :/]", "_", name)


class MlflowSink:
    """An MLflow run in a file store under <run>/mlruns/ (`mlflow ui --backend-store-uri
    runs/<name>/mlruns`); experiment "shardwise", the run named after the run folder."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked; a
        # folder in the run needs no database server or SQLAlchemy. A client bound to this
        # store: no process-wide tracking URI is set.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        exp = self.client.get_experiment_by_name("shardwise")
        exp_id = exp.experiment_id if exp else self.client.create_experiment("shardwise")
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        params = {k: str(v)[:500] for k, v in config.items()}
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in scalars.items()
                   if math.isfinite(v)]  # MLflow's file store rejects NaN
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class CsvSink:
    """<run>/metrics.csv: one row per step, one column per scalar (torchtitan's names).
    A scalar first seen after the header (validation, on its first evaluation step) widens
    the file: it is rewritten once with the new column."""

    def __init__(self, run_dir: Path, resumed_at: int = 0) -> None:
        self.path = run_dir / "metrics.csv"
        self.columns: list[str] = []
        if self.path.exists():  # a resumed run appends under its header
            with self.path.open(newline="") as f:
                self.columns = next(csv.reader(f), [])
            if resumed_at:  # rows after the checkpoint's step are written again: drop them
                self._widen(self.columns, keep_to=resumed_at)

    def log(self, scalars: dict[str, float], step: int) -> None:
        row = {"step": step, **scalars}
        new = [k for k in row if k not in self.columns]
        if new or not self.path.exists():
            self._widen([*(self.columns or ["step"]), *[k for k in new if k != "step"]])
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def _widen(self, columns: list[str], keep_to: int | None = None) -> None:
        """Rewrite the file under `columns` (keep_to: only the rows up to that step)."""
        rows: list[dict[str, str]] = []
        if self.path.exists():
            with self.path.open(newline="") as f:
                rows = list(csv.DictReader(f))
        if keep_to is not None:
            rows = [r for r in rows if _step_of(r) <= keep_to]
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, columns)
            w.writeheader()
            w.writerows(rows)
        tmp.replace(self.path)
        self.columns = columns

    def close(self) -> None:
        pass


def _step_of(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0


def open_sinks(names: list[str], run_dir: Path, name: str, config: dict[str, Any],
               resumed_at: int = 0) -> list[MetricSink]:
    """The chosen sinks, opened on the run folder (rank 0 only). resumed_at: the checkpoint's
    step a resumed run continues from (0: a fresh run); the file-backed sinks forget what
    the earlier run wrote after it, as metrics.jsonl does (rundir.truncate_metrics)."""
    out: list[MetricSink] = []
    for n in names:
        if n == "tensorboard":
            out.append(TensorBoardSink(run_dir, resumed_at))
        elif n == "wandb":
            out.append(WandbSink(run_dir, name, config))
        elif n == "mlflow":
            out.append(MlflowSink(run_dir, name, config))
        elif n == "csv":
            out.append(CsvSink(run_dir, resumed_at))
    return out

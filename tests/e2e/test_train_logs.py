"""A fine-tune as people run one: a local Llama folder, a parquet file of prompt/completion
records, a separate parquet evaluation file, the fine-tuning defaults (no optimizer option
given), logged to TensorBoard and to CSV beside metrics.jsonl. What each sink wrote is read
back with its own reader and must be metrics.jsonl's numbers under torchtitan's names.
One training launch (2 ranks, 4 steps)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import datasets
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shardwise.train.metrics import read_metrics
from tests.e2e.test_train import ok, shardwise_train
from tests.hf_models import save_tiny
from tests.hf_tokenizer import VOCAB_SIZE, save_tokenizer

STEPS = 4


def _records(lo: int, hi: int) -> list[dict[str, str]]:
    return [{"prompt": f"Q{i}: what is {i} doubled?", "completion": f" {2 * i}."}
            for i in range(lo, hi)]


def test_parquet_finetune_with_eval_file_logs_to_tensorboard_and_csv(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path / "llama", vocab_size=VOCAB_SIZE, max_position_embeddings=64)
    save_tokenizer(tmp_path / "llama")
    datasets.Dataset.from_list(_records(0, 300)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(_records(1000, 1040)).to_parquet(str(tmp_path / "eval.parquet"))
    out = ok(shardwise_train(
        "--model.hf", "llama", "--data.path", "train.parquet", "--data.eval_path",
        "eval.parquet", "--name", "ft", "--nproc", "2", "--model.block_size", "32",
        "--train.batch_size", "2", "--train.steps", str(STEPS), "--train.eval_interval", "2",
        "--train.eval_batches", "2", "--log.event_steps", "0", "--log.sample_tokens", "0",
        "--log.to", "tensorboard,csv", cwd=tmp_path))
    assert "topology: 1 node x 2 ranks" in out and "MFU" in out, out
    run = tmp_path / "runs" / "ft"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    evals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert list(evals) == [2, 4] and all(math.isfinite(v) for v in evals.values())
    assert all(r["mfu_pct"] > 0 and r["tflops"] > 0 for r in rows)

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()

    def tb(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in acc.Scalars(tag)}

    def close(a: float, b: float) -> bool:  # TensorBoard stores float32
        return math.isclose(a, b, rel_tol=1e-6)

    loss = tb("loss_metrics/global_avg_loss")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert all(close(loss[r["step"]], r["loss"]) for r in rows)
    val = tb("validation_metrics/loss")
    assert sorted(val) == [2, 4] and all(close(val[s], v) for s, v in evals.items())
    tps = tb("throughput(tps)")
    assert all(close(tps[r["step"]], r["tokens_per_s"] / 2) for r in rows)  # per device
    assert all(close(tb("mfu(%)")[r["step"]], r["mfu_pct"]) for r in rows)
    assert {"grad_norm", "lr", "tflops", "memory/max_reserved(GiB)",
            "validation_metrics/perplexity"} <= set(acc.Tags()["scalars"])

    with (run / "metrics.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(t["step"]) for t in table] == list(range(1, STEPS + 1))
    for t, r in zip(table, rows):
        assert float(t["loss_metrics/global_avg_loss"]) == r["loss"]
        assert float(t["grad_norm"]) == r["grad_norm"] and float(t["lr"]) == r["lr"]
        assert t["validation_metrics/loss"] == (repr(r["val_loss"]) if "val_loss" in r else "")

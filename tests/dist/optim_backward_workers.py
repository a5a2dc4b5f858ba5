"""Workers of tests/dist/test_optim_in_backward.py: `shardwise train`'s loop, in process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from shardwise.train.config import (
    Config,
    DataSection,
    ModelSection,
    ShardSection,
    TrainSection,
)
from shardwise.train.config_outputs import CheckpointSection, LogSection
from shardwise.train.metrics import read_metrics


def config(out_dir: str, name: str, *, in_backward: bool, grad_accum: int = 1, steps: int = 3,
           resume: bool = False, strategy: str = "FULL_SHARD") -> Config:
    return Config(
        name=name, out_dir=out_dir, threads=1, resume=resume,
        model=ModelSection(preset="tiny"), data=DataSection(max_bytes=100_000),
        train=TrainSection(steps=steps, batch_size=2, grad_accum=grad_accum, grad_clip=0.0,
                           warmup_steps=1, eval_interval=0, eval_batches=1,
                           optim_in_backward=in_backward),
        shard=ShardSection(sharding_strategy=strategy),
        checkpoint=CheckpointSection(interval=2, keep=3, best=False),
        log=LogSection(event_steps=0, sample_tokens=0))


def _records(out_dir: str, name: str) -> list[dict[str, Any]]:
    return [{"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"]}
            for r in read_metrics(Path(out_dir) / name / "metrics.jsonl")]


def losses(rank: int, world: int, out_dir: str, runs: list[tuple[str, dict[str, Any]]]
           ) -> dict[str, list[dict[str, Any]]]:
    """Train each (name, config keywords) in turn; rank 0 returns each run's records."""
    from shardwise.train.trainer import run

    out = {}
    for name, kw in runs:
        run(config(out_dir, name, **kw))
        if rank == 0:
            out[name] = _records(out_dir, name)
    return out


def resume(rank: int, world: int, out_dir: str) -> dict[str, list[dict[str, Any]]]:
    """Four steps with the optimizer in backward (checkpoints at 2 and 4); then a copy of the
    run without its step-4 checkpoint, resumed from step 2. Rank 0 returns both records."""
    from shardwise.engine.comm import collectives as Cm
    from shardwise.train.trainer import run

    run(config(out_dir, "whole", in_backward=True, steps=4))
    if rank == 0:
        src, dst = Path(out_dir) / "whole", Path(out_dir) / "resumed"
        shutil.copytree(src, dst)
        shutil.rmtree(dst / "checkpoints" / "step-0000004")
    Cm.barrier(label="copied")
    run(config(out_dir, "resumed", in_backward=True, steps=4, resume=True))
    if rank != 0:
        return {}
    return {"whole": _records(out_dir, "whole"), "resumed": _records(out_dir, "resumed")}

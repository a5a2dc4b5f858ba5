"""Workers for what the training summary reports (run in-process through run_distributed)."""

from __future__ import annotations

from typing import Any

import torch


def peak_with_hungry_sampling(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """A tiny run whose end-of-run sampling takes ~400 MiB more than training did."""
    from shardwise.commands.train import load_config
    from shardwise.train import trainer as T

    cfg = load_config(["--model.preset", "tiny", "--data.max_bytes", "200000",
                       "--train.batch_size", "2", "--train.steps", "2",
                       "--train.eval_interval", "0", "--log.sample_tokens", "4",
                       "--out_dir", out_dir, "--name", "peak"])
    real = T._sample

    def hungry(*args: Any, **kwargs: Any) -> str:
        big = torch.ones(400 * 2**20 // 4)  # touched, so resident
        big.add_(1.0)
        del big
        return real(*args, **kwargs)

    T._sample = hungry
    return T.run(cfg)

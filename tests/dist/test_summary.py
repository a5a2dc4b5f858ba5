"""The summary's peak memory is training's, not end-of-run sampling's (issue 25)."""

from __future__ import annotations

from pathlib import Path

from shardwise.testing import run_distributed
from tests.dist import summary_workers


def test_peak_memory_is_trainings_and_sampling_is_apart(tmp_path: Path) -> None:
    for s in run_distributed(summary_workers.peak_with_hungry_sampling, 1, str(tmp_path)):
        train, sample = s["peak_memory_mb"], s["sample_peak_memory_mb"]
        for before, after in zip(train, sample):
            # Sampling allocated 400 MiB; training's figure must not include it.
            assert after - before > 300, (train, sample)

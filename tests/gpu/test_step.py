"""Inside one step on a GPU: no host-device sync, and exposed waits read from CUDA events."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.gpu import step_workers
from tests.gpu.devices import needs_gpus

CASE_S = 120.0


def _check_no_sync(out: list[dict]) -> None:
    for r in out:
        # The control: without it a build whose sync debug mode never fires would pass.
        assert r["mode_catches_a_sync"], "sync debug mode did not catch .item() here"
        assert r["loss"] == r["loss"], r  # not NaN


@pytest.mark.gpu
@pytest.mark.parametrize("mp", [None, "bf16"])
def test_no_host_sync_in_the_step_world1(mp: str | None) -> None:
    _check_no_sync(run_distributed(step_workers.no_host_sync, 1, mp, backend="nccl",
                                   timeout_s=CASE_S))


@pytest.mark.gpu
@needs_gpus(2)
@pytest.mark.parametrize("mp", [None, "bf16"])
def test_no_host_sync_in_the_step_world2(mp: str | None) -> None:
    _check_no_sync(run_distributed(step_workers.no_host_sync, 2, mp, backend="nccl",
                                   timeout_s=CASE_S))


@pytest.mark.gpu
@needs_gpus(2)
def test_traced_exposed_wait_reads_cuda_events(tmp_path: Path) -> None:
    waits = run_distributed(step_workers.traced_gather_waits, 2, str(tmp_path / "trace"),
                            backend="nccl", timeout_s=CASE_S)
    for rank, ws in enumerate(waits):
        assert ws, f"rank {rank}: the traced step recorded no all-gather"
        assert all(w >= 0 for w in ws), (rank, ws)
    # Rank 1 stood still on the device for about DELAY_S while its host ran on: a host
    # clock around the wait would read ~0 here; the CUDA events read the stall.
    assert max(waits[1]) >= step_workers.DELAY_S / 2, waits

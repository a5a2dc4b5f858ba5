"""Review of the FSDPModule / TP-collectives merge (tests/dist/review_workers.py)."""

from __future__ import annotations

from shardwise.testing import run_distributed
from tests.dist import review_workers as W


def test_stale_params_and_mid_step_state_dict() -> None:
    """A forward without backward, then an optimizer step: the next forward sees the new
    values (failed before: the kept full parameters were stale); a mid-step state_dict/load
    under no_sync with bf16/fp32 changes no number."""
    assert max(run_distributed(W.three_rank_cases, 3)) <= W.TOL


def test_sequence_parallel_partial_grads() -> None:
    """dp 2 x tp 2: SequenceParallel norms/head (Replicate weights, Partial gradients)."""
    assert max(run_distributed(W.seq_parallel, 4, 2, 2)) <= W.TOL

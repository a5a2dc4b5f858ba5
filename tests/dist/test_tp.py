"""Issue 15: FSDP x tensor parallelism (2-D), each case against an unsharded reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import tp_workers as W


@pytest.mark.parametrize("dp,tp,hybrid", [(2, 2, False), (1, 2, False), (2, 1, False),
                                          (2, 2, True)],
                         ids=["dp2xtp2", "dp1xtp2", "dp2xtp1", "hsdp2x1xtp2"])
def test_parity(dp: int, tp: int, hybrid: bool) -> None:
    """Loss every step, clipped norm every step (ours and torch's), params after 3 steps.

    HSDP x TP at 4 ranks fits only as (replicate 2, shard 1, tp 2): a shard group of one.
    """
    for worst in run_distributed(W.parity, dp * tp, dp, tp, hybrid):
        assert max(worst.values()) <= W.TOL, worst


def test_gpt_plan_through_shard_model() -> None:
    """The trainer's GPT with its Megatron plan (tensor_parallel.py), via sw.shard_model."""
    worst = run_distributed(W.gpt_parity, 4, 2, 2)[0]
    assert max(worst.values()) <= W.TOL, worst


def test_bad_input() -> None:
    msgs = run_distributed(W.bad_input, 4)[0]
    assert len(msgs) == 4, msgs
    run_distributed(W.tp_after_shard_dp1, 2)
    run_distributed(W.materialize_refused, 2)


def test_checkpoint_reshard_both_dims(tmp_path: Path) -> None:
    """Saved at dp 2 x tp 2 (shardwise, DCP, safetensors); loaded at dp 4 x tp 1 and
    dp 1 x tp 2, each followed by one more step in parity with a run that never stopped."""
    path = str(tmp_path)
    run_distributed(W.ckpt_save, 4, path)
    for dp, tp in ((4, 1), (1, 2)):
        run_distributed(W.ckpt_load, dp * tp, dp, tp, path)

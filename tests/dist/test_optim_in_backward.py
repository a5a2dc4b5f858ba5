"""Issue 43 part 3: `shardwise train --train.optim_in_backward` ([Note: optimizer in
backward] in shardwise/train/optim.py), 2 ranks of the built-in GPT "tiny"."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from shardwise.train.config import Config, ShardSection, TrainSection
from tests.dist import optim_backward_workers as W


def _close(a: list[dict], b: list[dict], tol: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= tol, (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * max(1.0, y["grad_norm"]), (x, y)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_in_backward_losses_equal_the_default(tmp_path: Path, strategy: str) -> None:
    """Same losses (1e-6) and gradient norms as the optimizer stepped after backward, with
    and without gradient accumulation (the hooks step on the last micro-batch only)."""
    runs = [(f"{mode}-{acc}", {"in_backward": mode == "ib", "grad_accum": acc,
                               "strategy": strategy})
            for acc in (1, 2) for mode in ("default", "ib")]
    got = run_distributed(W.losses, 2, str(tmp_path), runs, timeout_s=300)[0]
    for acc in (1, 2):
        ref, ib = got[f"default-{acc}"], got[f"ib-{acc}"]
        assert len(ref) == 3
        assert ref[0]["loss"] != ref[-1]["loss"]  # it trains
        _close(ib, ref, 1e-6)


def test_in_backward_resumes_bit_identically(tmp_path: Path) -> None:
    """The per-parameter optimizers' state (AdamW's moments and step) is the whole-model
    optimizer's, so it is saved and restored: a run resumed from step 2 repeats steps 3-4
    bit for bit."""
    got = run_distributed(W.resume, 2, str(tmp_path), timeout_s=300)[0]
    assert len(got["whole"]) == 4
    assert got["resumed"] == got["whole"]


def test_in_backward_refuses_clipping_and_skipping() -> None:
    with pytest.raises(ValueError, match=r"train\.optim_in_backward cannot clip: "
                       r"train\.grad_clip=1\.0"):
        TrainSection(optim_in_backward=True)
    with pytest.raises(ValueError, match=r"on_nonfinite='skip'"):
        TrainSection(optim_in_backward=True, grad_clip=0.0, on_nonfinite="skip")
    with pytest.raises(ValueError, match=r"mixed_precision=fp16"):
        Config(train=TrainSection(optim_in_backward=True, grad_clip=0.0),
               shard=ShardSection(mixed_precision="fp16"))

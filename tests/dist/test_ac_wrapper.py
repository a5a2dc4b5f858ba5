"""Issue 36: activation checkpointing wrappers around sharded layers, as in FSDP2.

`fully_shard` on torch's `CheckpointWrapper` whose inner layer is already sharded was refused
("CheckpointWrapper is already sharded": the wrapper forwards attribute lookups to the layer
it wraps). Now it behaves as FSDP2 does, checked against FSDP2 running the same recipe in the
same ranks and an unsharded reference: the wrapper becomes a unit with no parameters of its
own (its state's `_fsdp_param_group` is None), training matches, state-dict keys are the
unsharded model's, and a step issues the same collectives. An unsharded wrapper around a
sharded layer has no state of its own (`fully_shard.state` is None), as in FSDP2.

The Hugging Face Trainer with FSDP activation checkpointing (and with activation offloading)
through Accelerate's FSDP2 path and `sw.patched_fsdp2()` gives FSDP2's losses, grad norms and
parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import ac_wrapper_workers as W
from tests.dist import fsdp2_patch_workers as P
from tests.dist import hf_trainer_workers as T


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_wrapper_around_sharded_layer(world: int) -> None:
    # Counted with gloo's native collectives, the way FSDP2's are (test_collective_counts).
    results = run_distributed(W.wrapper_parity, world, env={"SHARDWISE_GLOO_NATIVE": "1"},
                              timeout_s=300)
    for rank, cases in enumerate(results):
        for name, case in cases.items():
            ours, fsdp2 = case["shardwise"], case["fsdp2"]
            where = f"rank {rank}, {name}"
            assert ours["worst"] <= W.TOL and fsdp2["worst"] <= W.TOL, (where, case)
            assert ours["loss_diff"] <= W.TOL, (where, ours["loss_diff"])
            assert ours["state"] == fsdp2["state"], (where, ours["state"], fsdp2["state"])
            sharded = name.startswith("shard_wrapper=True")
            assert ours["state"] == [(True, False) if sharded else (False, False)] * W.N_LAYERS
            assert ours["keys_match"] and fsdp2["keys_match"], where
            assert ours["counts"] == fsdp2["counts"], (where, ours["counts"], fsdp2["counts"])


def test_hf_trainer_fsdp_activation_checkpointing(tmp_path: Path) -> None:
    results = run_distributed(T.trainer_ac, 2, str(tmp_path), timeout_s=600)
    for rank, runs in enumerate(results):
        for name, run in runs.items():
            ours, fsdp2 = run["shardwise"], run["fsdp2"]
            where = f"rank {rank}, {name}"
            assert len(ours["logs"]) == T.STEPS, (where, ours["logs"])
            for (loss, norm), (ref_loss, ref_norm) in zip(ours["logs"], fsdp2["logs"]):
                assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0), (where, ours, fsdp2)
                assert norm == pytest.approx(ref_norm, rel=1e-6, abs=0), (where, ours, fsdp2)
            assert run["params"] <= 1e-6, (where, run["params"])
            # Same wrappers, sharded (or not) alike, each by its own engine.
            assert [w[:3] for w in ours["wrappers"]] == [w[:3] for w in fsdp2["wrappers"]]
            assert {w[3] for w in fsdp2["wrappers"]} == {"torch"}
            assert {w[3] for w in ours["wrappers"] if w[1]} == {"shardwise"}
            kinds = {w[0] for w in ours["wrappers"]}
            assert kinds == ({"CheckpointWrapper", "OffloadWrapper"} if name == "offload=True"
                             else {"CheckpointWrapper"}), (where, ours["wrappers"])


def test_fsdp2_works_while_patched() -> None:
    """patch_fsdp2() rebinds the name in the module that defines FSDP2's function (issue 36):
    FSDP2 called through a reference taken before the patch still shards and trains, with
    the unsharded numbers, and shardwise's `fully_shard.state` gives FSDP2's state there."""
    for got in run_distributed(P.fsdp2_while_patched, 2, timeout_s=300):
        assert got["rebound"], got
        assert got["state"] == got["layer_state"] == "FSDPState", got
        assert got["worst"] <= W.TOL, got

"""Issue 41: a 0-d parameter keeps shape () everywhere, with the unsharded numbers
(tests/dist/zero_dim_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import zero_dim_workers as W

TOL = 1e-5


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_shape_is_kept_in_parameters_state_dicts_and_optimizer(world: int,
                                                               strategy: str) -> None:
    for res in run_distributed(W.shapes, world, strategy):
        for where in ("parameters", "state_dict", "get_model_state_dict",
                      "get_model_state_dict full", "full_state_dict", "exp_avg",
                      "grad after backward"):
            assert res[where] == [], (where, res)
        assert res["full gate"] != res["ref gate"]  # it trained, and the full value shows
        if strategy == "FULL_SHARD":
            assert W.is_replicate(res["placements"]), res


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("clip", ["torch", "sw"])
def test_adamw_with_clipping_equals_unsharded(world: int, strategy: str, clip: str) -> None:
    """torch.nn.utils.clip_grad_norm_ (and sw.clip_grad_norm_) return the unsharded total
    norm: the replicated 0-d gradient counted once, not once per rank; parameters after
    each AdamW step equal unsharded training; every rank's copy of the gate is the same."""
    results = run_distributed(W.train, world, strategy, clip)
    for res in results:
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5), res
        assert max(res["diffs"]) < TOL, res
        assert res["gates"] == pytest.approx(res["ref_gates"], abs=TOL), res
        assert res["exp_avg"] == pytest.approx(res["ref_exp_avg"], abs=TOL), res
        assert W.bits(res["gates"]) == W.bits(results[0]["gates"]), "copies differ"
    # The norm is above the limit: clipping scaled the gradients.
    assert min(results[0]["ref_norms"]) > W.MAX_NORM


def test_adamw_with_clipping_equals_unsharded_hybrid_2x2() -> None:
    """HYBRID_SHARD 2 x 2: the face is Replicate on both mesh dims; the norm counts the
    gate once (shard rank 0 of each replica, never summed across replicas)."""
    results = run_distributed(W.train, 4, "HYBRID_SHARD", "torch",
                              env={"LOCAL_WORLD_SIZE": "2"})
    for res in results:
        assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-5), res
        assert max(res["diffs"]) < TOL, res
        assert W.bits(res["gates"]) == W.bits(results[0]["gates"]), "copies differ"


def test_dcp_save_at_2_load_at_3_equals_unsharded(tmp_path: Path) -> None:
    path = str(tmp_path / "dcp")
    saved = run_distributed(W.dcp_save, 2, path)
    assert saved[0]["model"] == [] and saved[0]["exp_avg"] == [[], []], saved[0]  # and _sq
    results = run_distributed(W.dcp_load, 3, path, 2)
    for res in results:
        assert res["loaded"] < TOL and res["after"] < TOL, res
        assert res["shape"] == [] and res["exp_avg shape"] == [], res
        assert W.bits(res["gates"]) == W.bits(results[0]["gates"]), "copies differ"


@pytest.mark.parametrize("saved, loaded", [("FULL_SHARD", "FULL_SHARD"),
                                           ("FULL_SHARD", "NO_SHARD"),
                                           ("NO_SHARD", "FULL_SHARD")])
def test_checkpoint_save_at_2_load_at_3_equals_unsharded(tmp_path: Path, saved: str,
                                                          loaded: str) -> None:
    """sw.save_checkpoint at 2 ranks, load_checkpoint at 3 (model and AdamW state, across
    strategies: a DTensor face and a plain one), two more steps: unsharded training."""
    path = str(tmp_path / "ckpt")
    run_distributed(W.ckpt_save, 2, path, saved)
    results = run_distributed(W.ckpt_load, 3, path, 2, loaded)
    for res in results:
        assert res["loaded"] < TOL and res["after"] < TOL, res
        assert res["shape"] == [] and res["exp_avg shape"] == [], res
        assert W.bits(res["gates"]) == W.bits(results[0]["gates"]), "copies differ"


@pytest.mark.parametrize("world", [2, 3])
def test_export_safetensors_and_load_pretrained_keep_shape(world: int,
                                                           tmp_path: Path) -> None:
    for res in run_distributed(W.export_and_load, world, str(tmp_path / "export")):
        assert res["stored"] == [], res
        assert res["diff"] == 0.0 and res["shape"] == [], res
        assert res["gates"] == res["want"], res  # every rank's copy, exactly

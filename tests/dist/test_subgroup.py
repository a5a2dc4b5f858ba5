"""Model-level operations on a model sharded on a subgroup (subgroup_workers.py).

"pair": the model on ranks {1, 2} of 3 (its first rank is 1); "hybrid": a 2 x 2
HYBRID_SHARD mesh on ranks {1, 2, 3, 4} of 5. Rank 0 trains alone and then waits in a
barrier: an operation that still ran over the world hung there (the collective timeout
turns that into an error) or wrote nothing where it should. [Note: model ranks] in
src/shardwise/engine/core/context.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardwise.testing import run_distributed
from tests.dist import subgroup_workers as W

TOL = 1e-5


def _run(layout: str, ops: list[str], tmp_path: Path) -> tuple[list[dict], list[int]]:
    world, ranks = W.LAYOUTS[layout]
    res = run_distributed(W.run, world, layout, ops, str(tmp_path), timeout_s=90,
                          collective_timeout_s=20)
    assert math.isfinite(res[0]["outsider"]), res[0]  # rank 0 went its own way
    return res, ranks


def _close(got: dict) -> None:
    assert got["loss"] <= TOL and got["norm"] <= TOL and got["params"] <= TOL, got


@pytest.mark.parametrize("layout", ["pair", "hybrid"])
def test_materialize_agrees_over_the_model_ranks(layout: str, tmp_path: Path) -> None:
    """Ranks seeded differently start as one model: one seed drawn on the first rank, its
    buffer draw on every rank (replicas of HYBRID_SHARD identical too)."""
    res, ranks = _run(layout, ["materialize"], tmp_path)
    sds = [res[r]["materialize"]["sd"] for r in ranks]
    assert not torch.isnan(torch.tensor(sds[0]["shift"])).any()
    for r, sd in zip(ranks[1:], sds[1:]):
        assert list(sd) == list(sds[0]), r
        for k, v in sd.items():
            assert v == sds[0][k], (r, k)


@pytest.mark.parametrize("layout", ["pair", "hybrid"])
def test_state_dict_from_and_to_the_first_rank(layout: str, tmp_path: Path) -> None:
    res, ranks = _run(layout, ["state_dict"], tmp_path)
    n_keys = len(W.make(0).state_dict())
    for i, r in enumerate(ranks):
        got = res[r]["state_dict"]
        # One group spans the pair; the 2 x 2 mesh goes over its two dims in turn.
        assert got["model ranks"] == ranks and got["groups"] == len(ranks) // 2, got
        if i == 0:  # the model's first rank, global rank 1
            assert got["rank0_only keys"] == n_keys and got["rank0_only exact"], got
        else:
            assert got["rank0_only keys"] == 0, got
        msg = got["sd=None on the first rank"]
        assert "sd=None on rank 1" in msg and "from_rank0=True" in msg, msg
        assert got["loaded exact"], got
        _close(got)


@pytest.mark.parametrize("layout", ["pair", "hybrid"])
def test_grad_scaler_and_clipping_over_the_model_ranks(layout: str, tmp_path: Path) -> None:
    """An inf on the last model rank only skips the step on every rank of the model."""
    res, ranks = _run(layout, ["scaler"], tmp_path)
    for r in ranks:
        got = res[r]["scaler"]
        assert got["skipped"] == 1 and got["scale"] == 32.0, (r, got)
        _close(got)


@pytest.mark.parametrize("layout", ["pair", "hybrid"])
def test_checkpoint_on_a_subgroup(layout: str, tmp_path: Path) -> None:
    """The first rank writes the manifest and the buffer; a refusal is raised on every rank
    of the model; the checkpoint loads (another strategy) and training goes on with parity."""
    res, ranks = _run(layout, ["checkpoint"], tmp_path)
    for r in ranks:
        got = res[r]["checkpoint"]
        assert "step=-1" in got["refused"], got
        assert got["extra"] == {"first": 1} and got["loaded exact"], got
        assert got["params"] <= TOL, got
        assert got["saved_by"]["world_size"] == len(ranks), got


def test_export_and_load_pretrained_on_a_subgroup(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    res, ranks = _run("pair", ["export"], tmp_path)
    want = W.make(0).state_dict()
    for r in ranks:
        got = res[r]["export"]
        assert got["files"] == [str(tmp_path / "export" / "model.safetensors")], got
        assert got["loaded exact"] and not got["missing"], got
    stored = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(stored) == set(want) - {"head.weight"}  # tied: stored once
    for k, v in stored.items():
        assert torch.equal(v, want[k]), k


def test_trace_on_a_subgroup(tmp_path: Path) -> None:
    res, ranks = _run("pair", ["trace"], tmp_path)
    files = res[ranks[0]]["trace"]["files"]
    assert {"trace.json", "overlap.json", "trace_rank1.json", "trace_rank2.json"} <= set(files)
    assert "trace_rank0.json" not in files
    assert all(res[r]["trace"]["rows"] == 2 * len(ranks) for r in ranks), res


def test_no_shard_on_a_subgroup_mesh(tmp_path: Path) -> None:
    """NO_SHARD takes the mesh it is given: gradients are all-reduced over its ranks."""
    res, ranks = _run("pair", ["no_shard"], tmp_path)
    for r in ranks:
        _close(res[r]["no_shard"])


def test_two_models_side_by_side(tmp_path: Path) -> None:
    """Two models on {0, 1} and {2, 3}: state dicts, the scaler, checkpoints of their own."""
    res = run_distributed(W.two_models, 4, str(tmp_path), timeout_s=90, collective_timeout_s=20)
    n_keys = len(W.make(0).state_dict())
    for rank, got in enumerate(res):
        name = "AB"[rank // 2]
        assert got["rank0_only keys"] == (n_keys if rank % 2 == 0 else 0), (rank, got)
        assert got["extra"] == {"model": name} and got["loaded exact"], (rank, got)
        _close(got)

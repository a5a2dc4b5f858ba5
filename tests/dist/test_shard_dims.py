"""Shards on dims other than 0 (issue 36): FSDP2's shard_placement_fn Shard(1) / Shard(2),
torchtitan's experts on a mesh of their own, and balanced shards for 3-D experts with fewer
experts than ranks. Workers: tests/dist/shard_dims_workers.py."""

from __future__ import annotations

import pytest

import tests.dist.shard_dims_view_workers as V
import tests.dist.shard_dims_workers as W
from shardwise.testing import run_distributed


def _cases(world: int) -> list:
    return [
        # FSDP2's own Shard(1) (divides 2 and 3 ranks): shardwise == FSDP2 == unsharded
        ("shard1", 4, W.shard_blocks(1), 1, True),
        # uneven Shard(2) (D = 10 at 3 ranks): FSDP2 refuses it; shardwise pads, as dim 0
        ("shard2", 4, W.shard_blocks(2), 2, world == 2),
        # torchtitan's pattern: experts on their own (here: the same world) mesh, Shard(1)
        ("titan", 4, W.shard_titan(1, W.world_mesh), 1, True),
        # balanced default, 2 experts: dim 0 at 2 ranks (even), dim 1 at 3 ranks
        ("default", 2, W.shard_blocks(None), 0 if world == 2 else 1, False),
    ]


def _parity(rank: int, world: int) -> dict:
    return W.parity(rank, world, _cases(world))


@pytest.mark.parametrize("world", [2, 3])
def test_shard_dims_match_fsdp2_and_unsharded(world: int) -> None:
    results = run_distributed(_parity, world, timeout_s=300)
    # Balanced: 2 experts of (6, 10) at 3 ranks hold 2 rows of dim 1 each: 40 elements on
    # every rank (dim 0 would give 60, 60, 0).
    for r in results:
        assert set(r["default"].values()) == {2 * 6 * 10 // world}


def _view_cases(world: int) -> list:
    return [
        # (name, experts, F, Shard dim or None: the default, shardwise's dim, options)
        ("shard1", 2, 6, 1, 1, "plain"),
        ("default", 2, 6, None, 0 if world == 2 else 1, "plain"),
        ("shard1_bf16_offload_keep", 2, 6, 1, 1, "bf16_offload_keep"),
        # uneven Shard(2), kept gathered from backward to the next forward
        ("shard2_kept", 2, 6, 2, 2, "keep_after_backward"),
    ]


def _view(rank: int, world: int) -> dict:
    return V.view_parity(rank, world, _view_cases(world))


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_expert_weights_are_contiguous_and_view_works(world: int) -> None:
    """Forward sees each Shard(1) / balanced-default expert weight with its original
    contiguous strides (FSDP2's unsharded layout), so `w.view(E * F, D)` in forward runs;
    values match FSDP2 and the unsharded run at 1e-5 (mixed precision with CPU offload
    and no reshard after forward: against FSDP2; uneven Shard(2) kept gathered across
    optimizer steps: against the unsharded run, which the stale check keeps it equal to)."""
    results = run_distributed(_view, world, timeout_s=300)
    for r in results:
        # 2 blocks x 2 weights per forward, 3 steps (SHARD_GRAD_OP style: no re-gather)
        assert all(n == 3 * 2 * 2 for n in r.values()), r


def _hsdp(rank: int, world: int) -> dict:
    cases = [("hsdp_experts", 2, W.shard_titan(1, W.hsdp_experts_mesh), 1, True)]
    # hpZ (k = 2 of 4) with Shard(1), F = 6 uneven at 4 ranks: the kept rows and
    # backward's block gather feed a contiguous weight (against the unsharded run)
    view = V.view_parity(rank, world, [("hpz_shard1", 2, 6, 1, 1, "hpz2")])
    return {**W.parity(rank, world, cases), **view}


def test_experts_on_a_2x2_mesh_dense_on_4_ranks() -> None:
    """Experts sharded on the 2-rank shard dim of a (replicate 2, shard 2) mesh with
    Shard(1), the blocks and root on all 4 ranks: matches FSDP2 and the unsharded run.
    And hpZ with uneven Shard(1) experts used through `view` matches the unsharded run."""
    results = run_distributed(_hsdp, 4, timeout_s=300)
    for r in results:
        assert set(r["hsdp_experts"].values()) == {2 * 6 * 10 // 2}
        assert r["hpz_shard1"] == 3 * 2 * 2


def _save(rank: int, world: int, path: str, dim: int | None) -> dict:
    return W.state_round_trips(rank, world, path, dim)


@pytest.mark.parametrize("save, load", [((3, 2), (2, None)), ((2, None), (3, 2)),
                                        ((3, None), (3, None))])
def test_checkpoints_between_shard_dims(tmp_path, save: tuple, load: tuple) -> None:
    """Saved with experts on one dim (rows on that dim in the manifest), loaded where they
    shard on another: parameters and optimizer state equal what was saved; exported
    safetensors equal the full state dict."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, save[0], path, save[1], timeout_s=240)[0]
    run_distributed(W.load_elsewhere, load[0], path, load[1], saved, timeout_s=240)


def test_bad_placements_are_refused_up_front() -> None:
    msgs = run_distributed(W.bad_placement, 2, timeout_s=120)[0]
    assert "Shard(3)" in msgs[0] and "norm.weight" in msgs[0] and "[-1, 0]" in msgs[0]
    assert "'Shard(1)'" in msgs[1] and "Shard(dim) or None" in msgs[1]

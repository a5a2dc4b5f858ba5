"""Issue 44: FSDP1 code runs unchanged on shardwise, with FSDP1's numbers.

The grid (fsdp1_workers.py) runs one FSDP1 script on PyTorch's FSDP1 and through
`sw.patched_fsdp1()` for every strategy, wrap policy, MixedPrecision, CPUOffload and rank-0
full state dicts, inside one process group per world size. The frameworks
(fsdp1_frameworks_workers.py): the HF Trainer on Accelerate's `fsdp_version: 1` and
Lightning Fabric's `FSDPStrategy`, each on both engines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import fsdp1_frameworks_workers as F
from tests.dist import fsdp1_workers as W

_EXACT = ("loss", "norm", "full", "full_osd", "sharded", "sharded_osd")


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_grid(world: int) -> None:
    """fp32 cases within 1e-5 of FSDP1 on every rank: losses with no_sync accumulation,
    clip_grad_norm_ totals, FULL and SHARDED state dicts with optimizer state. bf16 cases
    within 3x the deviation FSDP1's own bf16 run shows from its fp32 run, per quantity."""
    results = run_distributed(W.grid, world, timeout_s=900)
    for case in W.cases(world):
        name = case["name"]
        for r in results:
            got = r[name]
            if case.get("mp") is None:
                assert max(got.values()) <= W.TOL, (name, got)
                continue
            bound = {k: 3 * max(x[name + "/fsdp1-vs-fp32"][k] for x in results) for k in got}
            assert all(got[k] <= max(bound[k], W.TOL) for k in got), (name, got, bound)
        if case.get("rank0"):
            assert "full" in results[0][name] and "full" not in results[1][name]


def _assert_wrapped(fsdp1: dict, shardwise: dict, units: int) -> None:
    """The reference run's model is wrapped by torch's FSDP1 (one instance per unit, no DDP),
    the other's by shardwise (one wrapper, the same units in `fsdp_modules`, no torch FSDP1)."""
    for got, want in ((fsdp1, {"torch_fsdp1": units, "shardwise": 0, "ddp": 0, "units": units,
                               "unit_engines": ["torch"]}),
                      (shardwise, {"torch_fsdp1": 0, "shardwise": 1, "ddp": 0, "units": units,
                                   "unit_engines": ["shardwise"]})):
        assert {k: got[k] for k in want} == want, got
    for w in (fsdp1, shardwise):  # the Trainer's: Accelerate still on FSDP after training
        assert w.get("distributed_type", "DistributedType.FSDP") == "DistributedType.FSDP", w


def test_hf_trainer_fsdp_version_1(tmp_path: Path) -> None:
    """Accelerate's FSDP1 path (transformer_layer_cls_to_wrap, FULL_SHARD, clipping,
    SHARDED_STATE_DICT checkpoints, resume) gives FSDP1's losses, clipped grad norms and
    parameters, with the model wrapped by FSDP1 in one run and by shardwise in the other.
    Resuming, the step's loss equals FSDP1's and the run ends where the uninterrupted one
    does. FSDP1's own resumed run does not (it ends 6e-3 away): Accelerate's
    `load_fsdp_optimizer` uses `FSDP.optim_state_dict` of the fresh optimizer as DCP's load
    template, which under FSDP1 has no state before the first step, so no optimizer state is
    loaded and AdamW restarts; shardwise's template (DCP's `get_optimizer_state_dict`)
    initialises the state first, so all of it loads."""
    results = run_distributed(F.trainer_fsdp1, 2, str(tmp_path), timeout_s=900)
    for r in results:
        for what in ("train", "resume"):
            run = r[what]
            _assert_wrapped(run["wrapping"]["fsdp1"], run["wrapping"]["shardwise"], units=3)
            # Step, loss and the clipped norm (the total over the ranks, above MAX_NORM).
            assert [x[0] for x in run["fsdp1"]] == [x[0] for x in run["shardwise"]]
            assert [v for x in run["fsdp1"] for v in x[1:]] == pytest.approx(
                [v for x in run["shardwise"] for v in x[1:]], abs=W.TOL)
            assert all(x[2] > F.MAX_NORM for x in run["fsdp1"]), run["fsdp1"]
        assert r["train"]["params"] <= W.TOL, r["train"]
        assert r["shardwise: resume vs train"] <= W.TOL, r
        # FSDP1 loads no optimizer state on resume (see above); shardwise loads all of it.
        loaded = r["resume"]["loaded"]
        assert loaded["fsdp1"]["with_state"] == 0, loaded
        assert loaded["shardwise"]["with_state"] == loaded["shardwise"]["params"] > 0, loaded
        assert r["fsdp1: resume vs train"] > 1e-3, r
    # Every rank logs the same (total) norm on both engines.
    for engine in ("fsdp1", "shardwise"):
        assert results[0]["train"][engine] == results[1]["train"][engine]


def test_lightning_fabric_fsdp_strategy(tmp_path: Path) -> None:
    """Fabric's FSDPStrategy (ModuleWrapPolicy, no_backward_sync, clip_gradients, sharded
    save and load into a fresh model): FSDP1's numbers, with both models wrapped by FSDP1
    (the root and each Block) in one run and by shardwise in the other."""
    for r in run_distributed(F.fabric_fsdp1, 2, str(tmp_path), timeout_s=900):
        assert max(r["loss"], r["norm"], r["params"]) <= W.TOL, r
        assert r["wrappers"] == ("torch.distributed.fsdp.fully_sharded_data_parallel",
                                 "shardwise.fsdp1")
        for a, b in zip(r["wrapping"]["fsdp1"], r["wrapping"]["shardwise"], strict=True):
            _assert_wrapped(a, b, units=4)


def test_hf_trainer_fsdp_version_1_bf16_model_gets_fp32_masters(tmp_path: Path) -> None:
    """A model loaded in bf16, trained by the Trainer with bf16=True on `fsdp_version: 1`:
    Accelerate upcasts every FSDP1 instance's flat parameter to fp32 after wrapping, so the
    optimizer steps fp32 master weights (compute stays bf16). shardwise takes the same
    upcast: fp32 masters, FSDP1's instance count, losses and parameters."""
    for r in run_distributed(F.trainer_bf16_fsdp1, 2, str(tmp_path), timeout_s=900):
        a, b = r["fsdp1"], r["shardwise"]
        assert a["masters"] == ["torch.float32"], a
        assert b["masters"] == ["torch.float32"], b
        assert a["units"] == b["units"], (a, b)
        _assert_wrapped(a["wrapping"], b["wrapping"], units=3)
        assert r["param_dtypes"] == [("torch.float32", "torch.float32")], r
        assert [x[0] for x in a["logs"]] == [x[0] for x in b["logs"]]
        assert [x[1] for x in a["logs"]] == pytest.approx([x[1] for x in b["logs"]],
                                                          abs=W.TOL)
        assert r["params"] <= W.TOL, r


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp1_api_against_fsdp1(world: int) -> None:
    """summon_full_params (read, writeback, rank0_only, with_grads), LOCAL state dicts,
    the full optimizer state functions, meta init with sync_module_states, manual nested
    wrapping and process_group=: FSDP1's numbers within 1e-5 (fsdp1_api_workers.py)."""
    from tests.dist import fsdp1_api_workers as A

    results = run_distributed(A.api_grid, world, timeout_s=900)
    for rank, r in enumerate(results):
        for script, checks in r.items():
            got = checks.pop("shardwise")
            for k, v in checks.items():
                assert v is True or (v is not False and v <= A.TOL), (rank, script, k, v)
            if script == "summon":
                assert got["shapes_ok"]
                assert got["has_rank0"] == (rank == 0)
            if script == "local":
                assert got["again"] == pytest.approx(got["loss"][2:], abs=A.TOL)
            if script == "optim":
                assert got["rank0_empty"] and got["ids"]
                assert got["plain"] <= A.TOL
                for how in ("shard", "scatter", "rekey"):
                    assert got[how] == pytest.approx(got["next"], abs=A.TOL), how
            if script == "meta":
                assert got["init_vs_rank0"] == 0.0
            if script == "nested":
                assert (got["units"], got["roots"]) == (4, 1)

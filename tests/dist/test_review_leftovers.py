"""Review leftovers: tied keys and 0-d parameters in state dicts (review_leftovers_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.testing import run_distributed
from tests.dist import review_leftovers_group_workers as GW
from tests.dist import review_leftovers_workers as W

TOL = 1e-6


def test_tied_keys_with_different_values_load_as_nn_module() -> None:
    """The tied parameter takes its last key's value, as nn.Module.load_state_dict leaves it:
    sw.load_full_state_dict (from every rank or rank 0), torch's set_model_state_dict."""
    for res in run_distributed(W.tied_full_state_dict, 2):
        assert all(v <= TOL for v in res.values()), res


def test_checkpoint_saved_untied_loads_into_tied_model_as_nn_module(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(W.tied_checkpoint_save, 2, path)
    for d in run_distributed(W.tied_checkpoint_load, 3, path):
        assert d <= TOL, d


def _with_head(src: str, dst: Path, shift: float) -> str:
    """A copy of the tied folder `src` that also stores lm_head.weight (embedding + shift)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in Path(src).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(dst / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + shift
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_load_pretrained_refuses_tied_keys_that_differ(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests import hf_models as H

    src = H.save_tiny("qwen2", tmp_path / "qwen2")
    differing = _with_head(src, tmp_path / "differing", 0.5)
    identical = _with_head(src, tmp_path / "identical", 0.0)
    for res in run_distributed(W.tied_pretrained, 2, differing, identical):
        msg = res["refused"]
        assert "model.embed_tokens.weight" in msg and "lm_head.weight" in msg, res
        assert "tie_word_embeddings=False" in msg, msg
        assert res["identical"] == 0.0, res


def test_zero_dim_param_through_set_model_state_dict_full() -> None:
    for res in run_distributed(W.zero_dim_set_full, 2):
        assert res["full"] <= TOL and res["from_rank0"] <= TOL, res
        assert res["from_rank0 meta"] <= TOL, res
        assert res["full gate"] == pytest.approx(0.2), res


def test_zero_dim_param_under_tp_full_state_dict_on_every_rank() -> None:
    for res in run_distributed(W.zero_dim_tp_full, 4):
        assert res["before"] <= TOL and res["after"] <= 1e-5, res


def test_zero_dim_param_under_tp_dcp_across_world_sizes(tmp_path: Path) -> None:
    path = str(tmp_path / "dcp")
    run_distributed(W.zero_dim_tp_dcp_save, 4, path)
    for d in run_distributed(W.zero_dim_tp_dcp_load, 2, 1, 2, path):  # dp 1 x tp 2
        assert d <= TOL, d
    for d in run_distributed(W.zero_dim_tp_dcp_load, 3, 3, 1, path):  # no TP, 3 ranks
        assert d <= TOL, d


@pytest.mark.parametrize("hybrid", [False, True])
def test_model_on_a_subgroup_trains_while_other_ranks_do_something_else(hybrid: bool) -> None:
    """Ranks {0, 1} (1-D mesh) or {0..3} (2 x 2 HYBRID_SHARD) train a sharded TinyLM with
    parity; the next rank trains its own model on its own mesh, and no engine check waits
    for it or meets its checks."""
    n = 4 if hybrid else 2
    res = run_distributed(GW.subgroup_trains, n + 1, hybrid, timeout_s=180,
                          collective_timeout_s=30)
    groups = [[0, 2], [0, 1]] if hybrid else [[0, 1]]  # rank 0's: the mesh's dims in turn
    for got in res[0].values():
        assert got["groups"] == groups, got
    for r in res[:n]:
        for strategy, got in r.items():
            assert got["loss"] <= 1e-5 and got["params"] <= 1e-5, (strategy, got)
    assert res[n]["groups"] == 0, res[n]  # alone on its mesh: nothing to agree on


@pytest.mark.parametrize("frozen", [False, True])
def test_unit_output_needs_grad_on_some_ranks_only_is_named_in_debug_mode(frozen: bool) -> None:
    """Units a1, a2 whose parameters only one rank's data uses (and, `frozen`, a frozen unit
    behind them): the other rank's outputs carry no pre-backward hook for them, so the ranks'
    backward collectives differ. The per-step agreement that used to follow this went with
    issue 35 (FSDP2 does not follow it either, docs/moe.md); SHARDWISE_DEBUG's fingerprints
    name the collective where the ranks part, on every rank, instead of a hang."""
    res = run_distributed(GW.output_grad_on_some_ranks, 2, frozen, timeout_s=60,
                          collective_timeout_s=10, env={"SHARDWISE_DEBUG": "1"})
    for got in res:
        assert got.startswith("CollectiveMismatchError"), res

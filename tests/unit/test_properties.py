"""Properties of the sharding arithmetic, for any shape and any shard-group size.

In one process (hypothesis): shard then gather is the identity, shards are equal-sized,
`torch.chunk` bounds, padding rows are zero. On 2 and 3 real ranks (shapes drawn from a
fixed seed: hypothesis does not drive spawned workers): the padding never reaches a
full state dict, a checkpoint, an export, the optimizer state or the gradient norm.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

import shardwise as sw
from shardwise.engine.core.layout import balanced_shard_dim
from shardwise.engine.core.sharded_param import ParamRef, ShardedParam
from shardwise.testing import run_distributed

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
shapes = st.one_of(
    st.just(()),  # 0-d: one row that every rank holds ([Note: 0-d parameters])
    st.tuples(st.integers(0, 40)),
    st.tuples(st.integers(0, 20), st.integers(1, 5)),
    st.tuples(st.integers(0, 9), st.integers(1, 3), st.integers(1, 3)),
)


def make_param(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    # No zeros in the data, so a zero can only be padding and a lost row shows.
    data = torch.rand(shape, generator=g, dtype=torch.float64) + 1.0
    return nn.Parameter(data.to(dtype))


def shard_on(param: nn.Parameter, rank: int, world: int) -> ShardedParam:
    holder = nn.Module()  # ShardedParam installs its shard in the holder
    holder.register_parameter("w", param)
    return ShardedParam(param, [ParamRef(holder, "w", "w")], rank, world,
                        torch.device("cpu"), None)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, world=st.integers(1, 16), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_shard_then_gather_is_the_identity(shape: tuple[int, ...], world: int,
                                           dtype: torch.dtype, seed: int) -> None:
    full = make_param(shape, dtype, seed).detach()
    rows = full.reshape(-1, *full.shape[1:]) if full.dim() else full.reshape(1)
    dim0 = rows.shape[0]
    sps = [shard_on(make_param(shape, dtype, seed), r, world) for r in range(world)]
    chunk = math.ceil(dim0 / world)
    # Every rank contributes the same number of rows to an all-gather: ceil(D0 / S).
    assert {sp.padded_shard.shape for sp in sps} == {(chunk, *rows.shape[1:])}
    assert all(sp.padded_shard.dtype == dtype for sp in sps)
    # Rows owned are torch.chunk's chunks, then empty shards for the ranks it leaves out.
    # A 0-d parameter: every rank holds its one row (owned by shard rank 0 alone).
    chunks = torch.chunk(rows, world) if dim0 else ()
    if full.dim() == 0:
        chunks = (rows,) * world
    for r, sp in enumerate(sps):
        want = chunks[r] if r < len(chunks) else rows[:0]
        assert torch.equal(sp.local, want)
        assert torch.equal(sp.local_slice(full), want)
        # Padding rows are zero (the data has none).
        assert not sp.padded_shard[sp.local_rows:].any()
        assert sp.owns_rows == (full.dim() > 0 or r == 0)
        assert tuple(sp.sharded.shape) == (tuple(full.shape) if full.dim() == 0
                                           else tuple(want.shape))
    assert sum(sp.local_rows for sp in sps if sp.owns_rows) == dim0
    # Gather, as the all-gather does, into rank 0's unsharded buffer: the original again.
    gathered = torch.cat([sp.padded_shard for sp in sps])
    assert full.dim() == 0 or not gathered[dim0:].any()
    assert gathered.shape[0] - dim0 < world
    assert torch.equal(gathered[:dim0].reshape(full.shape), full)
    sp0 = sps[0]
    sp0.alloc_unsharded()
    sp0.unsharded_rows_view().copy_(gathered.reshape(world, -1))
    assert sp0.unsharded.shape == full.shape and torch.equal(sp0.unsharded.detach(), full)
    sp0.free_unsharded()


@settings(max_examples=200, deadline=None)
@given(shape=shapes, world=st.integers(1, 16), rank=st.integers(0, 15),
       seed=st.integers(0, 2**16))
def test_set_full_writes_the_same_shard_as_sharding(shape: tuple[int, ...], world: int,
                                                    rank: int, seed: int) -> None:
    rank %= world
    full = make_param(shape, torch.float32, seed).detach()
    direct = shard_on(make_param(shape, torch.float32, seed), rank, world)
    later = shard_on(nn.Parameter(torch.zeros(shape)), rank, world)
    later.set_full(full)
    assert torch.equal(later.padded_shard, direct.padded_shard)
    with pytest.raises(ValueError, match="expected"):
        later.set_full(torch.zeros(*shape, 2))


# --- several real ranks ------------------------------------------------------------------


class Bag(nn.Module):
    """Parameters of the given shapes; loss = sum(p^2)/2, so each gradient equals p."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([make_param(s, torch.float32, seed + i)
                                    for i, s in enumerate(shapes)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * p).sum() for p in self.ps) * x / 2


class Scaled(Bag):
    """Bag whose output keeps each parameter's shape: a 0-d parameter seen as (1,) shows."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(p * x for p in self.ps)


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(shapes, min_size=1, max_size=4), seed=st.integers(0, 2**16),
       strategy=st.sampled_from(["FULL_SHARD", "NO_SHARD"]),
       mp=st.sampled_from([None, "bf16"]))
def test_one_rank_model_behaves_like_the_unsharded_one(
        shapes: list[tuple[int, ...]], seed: int, strategy: str, mp: str | None) -> None:
    ref, model = Scaled(shapes, seed), Scaled(shapes, seed)
    sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy=None,
                   mixed_precision=mp)
    x = torch.tensor(1.0)
    want, got = ref(x), model(x)
    for g, w in zip(got, want, strict=True):
        # Shapes exactly; values up to the bf16 cast.
        assert g.shape == w.shape
        torch.testing.assert_close(g.float(), w, rtol=0.02 if mp else 0, atol=0)
    sum(g.float().sum() for g in got).backward()
    sum(w.sum() for w in want).backward()
    norm = sw.clip_grad_norm_(model, float("inf"))
    ref_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1)
                                                   for p in ref.parameters()]))
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    sd, ref_sd = sw.full_state_dict(model), ref.state_dict()
    assert sd.keys() == ref_sd.keys()
    assert all(torch.equal(sd[k], ref_sd[k]) for k in sd)


def drawn_shapes(world: int, seed: int, n: int = 8) -> list[tuple[int, ...]]:
    """Edge cases for `world` ranks, then `n` shapes from a fixed seed."""
    rnd = random.Random(seed)
    out: list[tuple[int, ...]] = [(), (1,), (world - 1, 3), (world + 1,), (0, 2)]
    for _ in range(n):
        rank = rnd.randint(1, 3)
        out.append((rnd.randint(0, 3 * world + 2), *(rnd.randint(1, 4) for _ in range(rank - 1))))
    return out


def no_padding_leaks(rank: int, world: int, shapes: list[tuple[int, ...]], root: str,
                     seed: int) -> dict:
    """Shard, step, state-dict, norm, save and export; check padding on this rank."""
    ref = Bag(shapes, seed)
    model = Bag(shapes, seed)
    sw.shard_model(model, auto_wrap_policy=None)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    sps = [p._sw_param for p in model.parameters()]  # type: ignore[attr-defined]
    model(torch.tensor(1.0)).backward()
    norm = sw.clip_grad_norm_(model, float("inf"))
    want = torch.linalg.vector_norm(
        torch.cat([p.detach().double().reshape(-1) for p in ref.parameters()]))
    for sp, p in zip(sps, ref.parameters()):
        # Each rank's gradient shard is its rows of the full gradient (= p), nothing more
        # (close, not equal: the mean over 3 ranks of p is not exactly p in floating point).
        got, want_rows = sp.shard_grad, sp.local_slice(p.detach())
        assert got.shape == want_rows.shape, sp.fqn
        torch.testing.assert_close(got, want_rows, rtol=1e-6, atol=0)
    sd_before = sw.full_state_dict(model)
    opt.step()
    for sp in sps:
        assert not sp.padded_shard[sp.local_rows:].any(), f"{sp.fqn}: padding changed"
    sd = sw.full_state_dict(model)
    ckpt = os.path.join(root, f"w{world}")
    sw.save_checkpoint(ckpt, model, opt, step=1)
    export = os.path.join(root, f"w{world}.safetensors")
    sw.export_safetensors(export, model)
    return {
        "norm": float(norm), "want": float(want),
        "chunk_rows": [sp.padded_shard.shape[0] for sp in sps],
        "local_rows": [sp.local_rows if sp.owns_rows else 0 for sp in sps],
        "shard_dim": [sp.shard_dim for sp in sps],
        # numpy, not tensors: see tests/dist/ckpt_workers.py
        "before": {k: v.numpy() for k, v in sd_before.items()},
        "after": {k: v.numpy() for k, v in sd.items()},
        "ref": {k: v.detach().numpy() for k, v in ref.state_dict().items()},
        "ckpt": ckpt, "export": export,
    }


def _stored(ckpt: str, name: str, tensors: dict) -> torch.Tensor:
    """A checkpoint tensor, rebuilt from its pieces in the rank files."""
    info = tensors[name]
    parts = [load_file(os.path.join(ckpt, f))[name] for f, _, _ in info["pieces"]]
    for (_, a, b), t in zip(info["pieces"], parts):
        assert t.shape[0] == b - a, f"{name}: a piece holds padding rows"
    if not parts:
        return torch.empty(info["shape"])
    # Pieces are rows of movedim(dim, 0) (checkpoint/manifest.py [Note: checkpoint format]).
    dim = info.get("dim", 0)
    shape = list(info["shape"])
    moved = [shape[dim], *(n for i, n in enumerate(shape) if i != dim)] if shape else []
    return torch.cat(parts).reshape(moved).movedim(0, dim) if shape else \
        torch.cat(parts).reshape(shape)


@pytest.mark.parametrize("world", [2, 3])
def test_padding_never_leaks_on_real_ranks(world: int, tmp_path: Path) -> None:
    seed = 1000 + world
    shapes = drawn_shapes(world, seed)
    res = run_distributed(no_padding_leaks, world, shapes, str(tmp_path), seed)
    r0 = res[0]
    for r in res:
        assert r["norm"] == pytest.approx(r0["want"], rel=1e-6)  # the unsharded norm
        assert r["chunk_rows"] == r0["chunk_rows"]  # equal shards on every rank
    for i, s in enumerate(shapes):
        # Rows are slices along the shard dim: dim 0, or the balanced dim a 3-D shape whose
        # dim 0 splits unevenly takes ([Note: balanced shards]).
        d = r0["shard_dim"][i]
        assert d == (balanced_shard_dim(s, world) if s else 0)
        rows = s[d] if s else 1
        assert sum(r["local_rows"][i] for r in res) == rows
        assert r0["chunk_rows"][i] == math.ceil(rows / world)
    for r in res:
        for k, v in r0["ref"].items():
            assert r["before"][k].shape == v.shape and (r["before"][k] == v).all(), k
            assert r["after"][k].shape == v.shape, k
    ckpt = r0["ckpt"]
    tensors = json.loads(Path(ckpt, "manifest.json").read_text())["tensors"]
    exported = load_file(r0["export"])
    after = {k: torch.from_numpy(v) for k, v in r0["after"].items()}
    for i, s in enumerate(shapes):
        key = f"ps.{i}"
        assert tuple(tensors[f"model/{key}"]["shape"]) == s
        assert torch.equal(_stored(ckpt, f"model/{key}", tensors), after[key])
        for state in ("exp_avg", "exp_avg_sq"):
            name = f"optim/{key}/{state}"
            assert tuple(tensors[name]["shape"]) == s
            assert _stored(ckpt, name, tensors).shape == s
        assert tuple(exported[key].shape) == s and torch.equal(exported[key], after[key])
    assert {n.split("/")[1] for n in tensors} == set(r0["ref"])

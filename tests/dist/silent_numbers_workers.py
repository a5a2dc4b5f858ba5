"""Issue 35 section 7: three silent wrong numbers, each checked against a reference.

- `fully_shard.state(m)` and the FSDP2 state facts frameworks read, side by side with
  torch's own FSDP2 on the same module;
- `sw.materialize` against the same module initialized unsharded with the same seed;
- `sw.clip_grad_norm_` with ignored parameters whose gradients differ per rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise as sw


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(5, 7), nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 5)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(5, 2)  # 2 rows: an empty shard at 3 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


# --- fully_shard.state(m) -----------------------------------------------------------------

def _state_facts(model: nn.Module, impl: str) -> dict[str, Any]:
    """What code written for FSDP2 reads from a module's state, per sharded module."""
    out: dict[str, Any] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    mnames = {id(m): n for n, m in model.named_modules()}
    for mname, m in model.named_modules():
        st = torch_fully_shard.state(m) if impl == "fsdp2" else sw.fully_shard.state(m)
        if st is None:
            out[mname] = None
            continue
        assert st is m._get_fsdp_state(), f"{impl} {mname}: state() vs _get_fsdp_state()"
        groups = st._fsdp_param_groups
        pg = st._fsdp_param_group
        assert groups == [pg], f"{impl} {mname}: _fsdp_param_groups {groups} vs {pg}"
        params = {}
        for fp in pg.fsdp_params:
            params[names[id(fp.sharded_param)]] = {
                "orig_size": tuple(fp._orig_size), "sharded_size": tuple(fp.sharded_size),
                "param_dtype": fp.param_dtype, "reduce_dtype": fp.reduce_dtype,
                "offload_to_cpu": fp.offload_to_cpu, "pin_memory": fp.pin_memory,
                "local": tuple(fp.sharded_param.to_local().shape),
            }
        out[mname] = {
            "mp_policy": pg.mp_policy, "state_mp_policy": st._mp_policy,
            "is_root": st._is_root, "state_modules": [mnames[id(x)] for x in st._modules],
            "state_device": st._device.type,
            "offload_policy": pg.offload_policy,
            "modules": [mnames[id(x)] for x in pg.modules],
            "device": pg.device.type,
            "post_forward_mesh_info is None": pg.post_forward_mesh_info is None,
            "reduce_grads": pg.reduce_grads,
            "reshard_after_backward": pg.reshard_after_backward,
            "params": params,
        }
    return out


def state_vs_fsdp2(rank: int, world: int) -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("defaults", {}, {}),
        ("mp+offload, no reshard", {"mp_policy": mp,
                                    "offload_policy": CPUOffloadPolicy(pin_memory=False),
                                    "reshard_after_forward": False},
         {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.bfloat16)}),
    ]
    for label, block_kw, root_kw in cases:
        facts = {}
        for impl, fs in (("fsdp2", torch_fully_shard), ("shardwise", sw.fully_shard)):
            torch.manual_seed(0)
            model = Net()
            for b in model.blocks:
                fs(b, **block_kw)
            fs(model, **root_kw)
            # FSDP2 fills its parameters' dtypes and the root's facts at lazy init.
            model(torch.randn(3, 4)).float().sum().backward()
            facts[impl] = _state_facts(model, impl)
            # shardwise's own names: its policy objects (None when off).
            if impl == "shardwise":
                st = sw.fully_shard.state(model.blocks[0])
                want_off = block_kw.get("offload_policy")
                got_off = st.offload_policy
                assert (got_off is None) == (want_off is None), (label, got_off)
                if want_off is not None:
                    assert got_off.pin_memory == want_off.pin_memory, (label, got_off)
                want_mp = block_kw.get("mp_policy")
                got_mp = st.mp_policy
                assert (got_mp is None) == (want_mp is None), (label, got_mp)
                if want_mp is not None:
                    assert got_mp.param_dtype == want_mp.param_dtype, (label, got_mp)
                assert sw.fully_shard.state(model).offload_policy is None, label
        assert facts["shardwise"] == facts["fsdp2"], (
            f"{label} (rank {rank}/{world}):\nshardwise {facts['shardwise']}\n"
            f"fsdp2     {facts['fsdp2']}")
        # Torch's own policy classes, as FSDP2 code checks them with isinstance.
        pg = facts["shardwise"]["blocks.0"]["offload_policy"]
        assert isinstance(pg, OffloadPolicy), pg


# --- clip_grad_norm_ with ignored parameters -------------------------------------------------

PER_RANK = 3


def _ref_grads(ref: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    ref.zero_grad()
    (ref(x) ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def clip_with_ignored(rank: int, world: int, norm_type: float, reduced: bool) -> None:
    """The head is ignored (fully_shard(..., ignored_params=...)): its gradients stay on each
    rank, from that rank's own batch. `reduced`: the user averages them over the ranks first
    (then they are the unsharded model's); else they differ per rank."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ignored = {"head.weight", "head.bias"}
    for b in model.blocks:
        sw.fully_shard(b)
    sw.fully_shard(model, ignored_params={model.head.weight, model.head.bias})
    x = torch.randn(PER_RANK * world, 4, generator=torch.Generator().manual_seed(5))
    rows = [slice(r * PER_RANK, (r + 1) * PER_RANK) for r in range(world)]
    (model(x[rows[rank]]) ** 2).mean().backward()
    full = _ref_grads(ref, x)  # the unsharded model's gradients (a mean over all rows)
    own = [_ref_grads(ref, x[s]) for s in rows]  # each rank's ignored gradients
    if reduced:
        for name, p in model.named_parameters():
            if name in ignored:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
    # What each rank holds: the (reduced, shared) sharded gradients and its own ignored ones.
    held = [{n: (own[r][n] if n in ignored and not reduced else g) for n, g in full.items()}
            for r in range(world)]

    def norm_of(grads: dict[str, torch.Tensor]) -> float:
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads.values()]),
            norm_type).item()

    per_rank = [norm_of(h) for h in held]
    # The documented value: the largest over the ranks of the norm of what a rank holds
    # (the unsharded model's norm when the ignored gradients agree).
    want = max(per_rank)
    if reduced:
        assert abs(want - norm_of(full)) <= 1e-5 * want, (want, norm_of(full))
    max_norm = 1e-3
    got = sw.clip_grad_norm_(model, max_norm, norm_type=norm_type).item()
    assert abs(got - want) <= 1e-5 * want, (
        f"rank {rank}: norm {got}, want {want} (each rank's own: {per_rank})")
    coef = min(1.0, max_norm / (want + 1e-6))
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if name not in ignored else p.grad
        expect = held[rank][name] * coef
        assert torch.allclose(g, expect, rtol=1e-5, atol=1e-9), (
            f"rank {rank} {name}: clipped {g.flatten()[:4]} vs {expect.flatten()[:4]}")


# --- materialize ----------------------------------------------------------------------------

class Fan(nn.Module):
    """Initializers that depend on the whole tensor: xavier's fan_out is dim 0 (the sharded
    one), orthogonal_ makes the full matrix orthogonal. Row counts do not divide 2 or 3."""

    def __init__(self) -> None:
        super().__init__()
        self.xav = nn.Parameter(torch.empty(7, 5))
        self.orth = nn.Parameter(torch.empty(9, 4))
        self.lin = nn.Linear(5, 2)  # 2 rows: an empty shard at 3 ranks
        self.norm = nn.LayerNorm(5)

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.xav)
        nn.init.orthogonal_(self.orth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + self.lin(x).sum(-1, keepdim=True) + (x @ self.xav.T).mean()


class Attn(nn.Module):
    """nn.MultiheadAttention initializes in `_reset_parameters` (materialize calls only
    `reset_parameters`); this wrapper's own reset writes its child's and grandchild's
    parameters (in_proj_weight, out_proj.bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(6, 2)

    def reset_parameters(self) -> None:
        self.mha._reset_parameters()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Fan(), Fan()])
        self.attn = Attn()
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _init_all(m: nn.Module) -> None:
    """An init_fn: MultiheadAttention's own init, everyone else's reset_parameters."""
    if isinstance(m, nn.MultiheadAttention):
        m._reset_parameters()
    elif isinstance(m, (nn.Linear, nn.LayerNorm, Fan)):
        m.reset_parameters()


def _unsharded(seed: int, init_fn: Any) -> dict[str, torch.Tensor]:
    """The same model initialized unsharded: to_empty, seed, each module's init in
    `model.modules()` order."""
    with torch.device("meta"):
        ref = Model()
    ref.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in ref.modules():
            if init_fn is not None:
                init_fn(m)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return {k: v.clone() for k, v in ref.state_dict().items()}


def materialize_matches_unsharded(rank: int, world: int, strategy: str,
                                  with_init_fn: bool) -> None:
    init_fn = _init_all if with_init_fn else None
    torch.manual_seed(100 + rank)  # materialize(seed=) must not depend on the ranks' streams
    with torch.device("meta"):
        model = Model()
    sw.shard_model(model, sharding_strategy=strategy,
                   auto_wrap_policy=sw.transformer_policy({Fan, Attn}))
    sw.materialize(model, init_fn, seed=7)
    got = sw.full_state_dict(model)
    want = _unsharded(7, init_fn)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k, v in want.items():
        assert torch.equal(got[k], v), (
            f"rank {rank}/{world} {strategy} init_fn={with_init_fn}: {k} differs from the "
            f"unsharded init by {(got[k] - v).abs().max().item():.3g}")
    w = got["blocks.0.orth"]
    assert torch.allclose(w.T @ w, torch.eye(4), atol=1e-5), "orthogonal_ on the full matrix"
    assert got["attn.mha.in_proj_weight"].abs().max() > 0
    # Trains after: the shards are the optimizer's parameters.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()


def materialize_refuses_unwritten(rank: int, world: int) -> None:
    """nn.MultiheadAttention alone: no reset_parameters covers in_proj_weight/in_proj_bias,
    which stayed at zero (its out_proj is a Linear and gets its own)."""
    with torch.device("meta"):
        mha = nn.MultiheadAttention(6, 2)
    sw.shard_model(mha, auto_wrap_policy=None)
    try:
        sw.materialize(mha, seed=0)
    except ValueError as e:
        msg = str(e)
        assert "in_proj_weight" in msg and "in_proj_bias" in msg, msg
        assert "out_proj" not in msg, msg
    else:
        raise AssertionError(
            "materialize left in_proj_weight unwritten without an error: max "
            f"{mha.in_proj_weight.full_tensor().abs().max().item()}")
    # An init_fn that covers it: accepted, and the values are the unsharded model's.
    with torch.device("meta"):
        mha = nn.MultiheadAttention(6, 2)
    sw.shard_model(mha, auto_wrap_policy=None)
    sw.materialize(mha, _init_all, seed=3)
    with torch.device("meta"):
        ref = nn.MultiheadAttention(6, 2)
    ref.to_empty(device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        for m in ref.modules():
            _init_all(m)
    for k, v in ref.state_dict().items():
        assert torch.equal(sw.full_state_dict(mha)[k], v), k

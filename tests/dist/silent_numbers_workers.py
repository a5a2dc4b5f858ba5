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

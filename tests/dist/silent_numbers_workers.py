"""Issue 35 section 7: three silent wrong numbers, each checked against a reference.

- `fully_shard.state(m)` and the FSDP2 state facts frameworks read, side by side with
  torch's own FSDP2 on the same module;
- `sw.materialize` against the same module initialized unsharded with the same seed;
- `sw.clip_grad_norm_` with ignored parameters whose gradients differ per rank.
"""

from __future__ import annotations

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

"""Issue 44: one FSDP1 script, run on PyTorch's FSDP1 and through `sw.patched_fsdp1()`.

`script` is FSDP1 code as its tutorials write it: it imports `FullyShardedDataParallel` and
its configs from `torch.distributed.fsdp` when it runs, wraps a model with FSDP1's knobs,
trains with `no_sync` accumulation and `clip_grad_norm_`, and takes FULL and SHARDED state
dicts with their optimizer state. `grid` runs it for every case of one world size in one
process group: first on FSDP1 (`device_id=torch.device("cpu")`, gloo), then patched, and
returns the largest difference per quantity. Where FSDP1 cannot run on CPU (`CPUOffload`,
rank-0 FULL state dicts with CPU offload) the shardwise run with the option is compared with
FSDP1's run without it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

import shardwise as sw

D_IN, HIDDEN, D_OUT = 7, 13, 5  # nothing divides by 2 or 3 ranks
TOL = 1e-5



class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("scale", torch.full((d,), 0.75))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x))) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(3))
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def my_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """A user's own FSDP1 policy: look everywhere, wrap Linear layers over 100 parameters."""
    return True if recurse else isinstance(module, nn.Linear) and nonwrapped_numel > 100


def policies() -> dict[str, Any]:
    from torch.distributed.fsdp.wrap import (
        ModuleWrapPolicy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    return {
        "module": ModuleWrapPolicy({Block}),
        "transformer": functools.partial(transformer_auto_wrap_policy,
                                         transformer_layer_cls={Block}),
        # 150: each block's fc (182) is wrapped on its own; what is left of the block (its
        # norm, 26) is not: FSDP1's nonwrapped_numel counts only unwrapped parameters.
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=150),
        "lambda": functools.partial(lambda_auto_wrap_policy,
                                    lambda_fn=lambda m: isinstance(m, Block)),
        "own": my_policy,
        "none": None,
    }


def cases(world: int) -> list[dict[str, Any]]:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

    S = ShardingStrategy
    out: list[dict[str, Any]] = []
    for s in (S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD):
        out.append({"name": s.name, "strategy": s, "policy": "transformer"})
    for s in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
        out.append({"name": f"{s.name}(1, {world})", "strategy": s, "policy": "transformer",
                    "mesh": (1, world)})
        # FSDP1 on a (world, 1) mesh (replicas of one rank each) does not average the
        # gradients across replicas on gloo (each rank trains on its own batches; checked
        # against its FULL_SHARD run): the reference is FSDP1's NO_SHARD, the same topology.
        out.append({"name": f"{s.name}({world}, 1)", "strategy": s, "policy": "transformer",
                    "mesh": (world, 1), "ref": {"strategy": S.NO_SHARD, "mesh": None}})
    for p in ("module", "size", "lambda", "own", "none"):
        out.append({"name": f"policy-{p}", "strategy": S.FULL_SHARD, "policy": p})
    out.append({"name": "flat-params", "strategy": S.FULL_SHARD, "policy": "transformer",
                "orig": False})
    out.append({"name": "mp-bf16", "strategy": S.FULL_SHARD, "policy": "transformer",
                "mp": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     buffer_dtype=torch.bfloat16)})
    out.append({"name": "mp-bf16-cast-all", "strategy": S.SHARD_GRAD_OP, "policy": "module",
                "mp": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                     buffer_dtype=torch.bfloat16, cast_forward_inputs=True),})
    # FSDP1 cannot run these on CPU: shardwise with the option equals FSDP1 without it.
    out.append({"name": "cpu-offload", "strategy": S.FULL_SHARD, "policy": "transformer",
                "offload": CPUOffload(offload_params=True)})
    out.append({"name": "full-rank0-offload", "strategy": S.FULL_SHARD,
                "policy": "transformer", "rank0": True})
    return out


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, D_IN, generator=g)


def _local(v: Any) -> Any:
    """A sharded value's local shard as a plain tensor (FSDP1: ShardedTensor; here DTensor)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(v, ShardedTensor):
        shards = v.local_shards()
        return shards[0].tensor.detach().clone() if shards else torch.empty(0)
    if isinstance(v, DTensor):
        return v.to_local().detach().clone()
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _osd(osd: dict[str, Any]) -> dict[str, Any]:
    return {f"{k}/{n}": _local(t) for k, s in osd.get("state", {}).items() for n, t in s.items()}


def script(case: dict[str, Any], rank: int, world: int, steps: int = 3,
           emulate: bool = False) -> dict[str, Any]:
    """FSDP1 code. `emulate`: drop the options FSDP1 cannot run on CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = Net()
    kwargs: dict[str, Any] = {}
    if case.get("mesh") is not None:
        kwargs["device_mesh"] = init_device_mesh("cpu", case["mesh"])
    if case.get("mp") is not None:
        kwargs["mixed_precision"] = case["mp"]
    if case.get("offload") is not None and not emulate:
        kwargs["cpu_offload"] = case["offload"]
    model = FSDP(model, sharding_strategy=case["strategy"],
                 auto_wrap_policy=policies()[case["policy"]], device_id=torch.device("cpu"),
                 use_orig_params=case.get("orig", True), **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(2):
            ctx = model.no_sync() if micro == 0 else contextlib.nullcontext()
            with ctx:
                loss = model(_batch(rank, step, micro)).float().pow(2).mean() / 2
                loss.backward()
            losses.append(loss.item())
        norms.append(model.clip_grad_norm_(0.5).item())
        opt.step()
        opt.zero_grad()
    rank0 = case.get("rank0", False) and not emulate
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0),
                              FullOptimStateDictConfig(offload_to_cpu=rank0, rank0_only=rank0)):
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        full_osd = _osd(FSDP.optim_state_dict(model, opt))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = {k: _local(v) for k, v in model.state_dict().items()}
        sharded_osd = _osd(FSDP.optim_state_dict(model, opt))
    return {"loss": losses, "norm": norms, "full": full, "full_osd": full_osd,
            "sharded": sharded, "sharded_osd": sharded_osd}


def _diff(a: Any, b: Any, what: str) -> float:
    if isinstance(a, list):
        assert len(a) == len(b), (what, a, b)
        return max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    assert set(a) == set(b), (what, sorted(set(a) ^ set(b)))
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        assert tuple(x.shape) == tuple(y.shape), (what, k, tuple(x.shape), tuple(y.shape))
        assert x.dtype == y.dtype, (what, k, x.dtype, y.dtype)
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def compare(ref: dict[str, Any], got: dict[str, Any], rank: int, case: dict[str, Any]
            ) -> dict[str, float]:
    out = {k: _diff(ref[k], got[k], k) for k in ("loss", "norm", "sharded", "sharded_osd")}
    if case.get("rank0") and rank != 0:
        # FSDP1's rank0_only: the other ranks get empty dicts.
        assert got["full"] == {} and got["full_osd"] == {}, (got["full"], got["full_osd"])
    else:
        out["full"] = _diff(ref["full"], got["full"], "full")
        out["full_osd"] = _diff(ref["full_osd"], got["full_osd"], "full_osd")
    return out


def grid(rank: int, world: int, names: list[str] | None = None) -> dict[str, dict[str, float]]:
    results = {}
    for case in cases(world):
        if names is not None and case["name"] not in names:
            continue
        ref = script({**case, **case.get("ref", {})}, rank, world, emulate=True)
        with sw.patched_fsdp1():
            got = script(case, rank, world)
        results[case["name"]] = compare(ref, got, rank, case)
        if case.get("mp") is not None:
            # The tolerance FSDP1 shows: how far its own bf16 run is from its fp32 run.
            fp32 = script({**case, "mp": None}, rank, world, emulate=True)
            results[case["name"] + "/fsdp1-vs-fp32"] = compare(fp32, ref, rank, case)
    return results


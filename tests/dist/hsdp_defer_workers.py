"""Workers for `set_requires_all_reduce(False)` under HYBRID_SHARD ([Note: deferred
all-reduce] in engine/core/unit.py): micro-batches that reduce-scatter within the shard
group and skip the all-reduce across replicas, then one that all-reduces everything. Side
by side in one set of processes: shardwise deferring, shardwise all-reducing every
micro-batch, FSDP2 deferring, and the unsharded reference on the whole batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise as sw
from tests.dist.hpz_workers import IN, OUT, Net, recording, summary

SYSTEMS = ("defer", "every", "fsdp2")


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        assert g is not None, f"{n} has no gradient"
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float()
    return out


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
            for n, p in model.named_parameters()}


def defer_parity(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Two optimizer steps of `micro` micro-batches each.

    case: mp None | "fp32-reduce" (bf16 params, fp32 reduce) | "bf16-reduce" (bf16 params
    and reductions: FSDP2 accumulates the deferred sums in bf16, and so does shardwise);
    micro: micro-batches per step. Returns per step the all-reduces each system issued in
    each micro-batch's backward, and the worst differences.
    """
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    micro = case.get("micro", 3)
    mp = {None: None,
          "fp32-reduce": TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
          "bf16-reduce": TorchMP(param_dtype=torch.bfloat16)}[case.get("mp")]
    torch.manual_seed(0)
    base = Net(2)
    ref = copy.deepcopy(base)
    models = {s: copy.deepcopy(base) for s in SYSTEMS}
    for s, m in models.items():
        shard = torch_fully_shard if s == "fsdp2" else sw.fully_shard
        kw = {} if mp is None else {"mp_policy": mp}
        for b in m.blocks:
            shard(b, mesh=mesh, **kw)
        shard(m, mesh=mesh, **kw)
    opts = {s: torch.optim.SGD(m.parameters(), lr=0.1) for s, m in models.items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    # Against the unsharded run: bf16 compute is what it is; fp32 is exact to rounding.
    ref_tol = 1e-5 if mp is None else 5e-2
    # Deferring against all-reducing every micro-batch: the same sums in another order,
    # except that bf16 reductions accumulate the deferred sums in bf16 (FSDP2's dtype).
    every_tol = 2e-2 if case.get("mp") == "bf16-reduce" else 1e-5
    per_rank = 2
    g = torch.Generator().manual_seed(1)
    worst = {"ref": 0.0, "every": 0.0, "fsdp2": 0.0}
    all_reduces: list[dict[str, list[int]]] = []
    for step in range(2):
        counts: dict[str, list[int]] = {s: [] for s in SYSTEMS}
        for mb in range(micro):
            last = mb == micro - 1
            x = torch.randn(per_rank * world, IN, generator=g)
            y = torch.randn(per_rank * world, OUT, generator=g)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            (nn.functional.mse_loss(ref(x), y) / micro).backward()
            for s, m in models.items():
                if s != "every":
                    m.set_requires_all_reduce(last)  # type: ignore[operator]
                loss = nn.functional.mse_loss(m(x[mine]).float(), y[mine]) / micro
                seen: dict[str, list] = {}
                with recording(seen, "backward"):
                    loss.backward()
                counts[s].append(sum(n for key, n in summary(seen["backward"]).items()
                                     if key.startswith("all_reduce/") and "bytes" not in key))
        all_reduces.append(counts)
        want = _grads(ref)
        got = {s: _grads(m) for s, m in models.items()}
        for n, w in want.items():
            d = {"ref": (got["defer"][n] - w).abs().max().item(),
                 "every": (got["defer"][n] - got["every"][n]).abs().max().item(),
                 "fsdp2": (got["defer"][n] - got["fsdp2"][n]).abs().max().item()}
            for key, tol in (("ref", ref_tol), ("every", every_tol), ("fsdp2", 1e-5)):
                worst[key] = max(worst[key], d[key])
                assert d[key] <= tol, f"{case} step {step}: {n} grad vs {key} differs {d[key]}"
        for o in [*opts.values(), ref_opt]:
            o.step()
            o.zero_grad()
        p_def, p_fsdp2 = _params(models["defer"]), _params(models["fsdp2"])
        for n, p in ref.named_parameters():
            assert (p_def[n] - p_fsdp2[n]).abs().max().item() <= 1e-5, f"{n} vs FSDP2"
            assert (p_def[n] - p.detach()).abs().max().item() <= ref_tol, f"{n} vs unsharded"
    return {"all_reduces": all_reduces, "worst": worst}


def defer_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {str(sorted(c.items())): defer_parity(rank, world, c) for c in cases}
    out["refusal"] = no_shard_refusal(rank, world)
    return out


def no_shard_refusal(rank: int, world: int) -> str:
    """NO_SHARD has no reduce-scatter to keep: deferring its only reduction is refused at
    the call, before any collective."""
    m = sw.shard_model(Net(1), sharding_strategy="NO_SHARD", auto_wrap_policy=None)
    try:
        m.set_requires_all_reduce(False)  # type: ignore[operator]
    except NotImplementedError as e:
        return str(e)
    return "accepted"

"""Workers for hpZ (`fully_shard(m, reshard_after_forward=k)`, [Note: hpZ] in
engine/core/unit.py): shardwise, PyTorch's FSDP2 and an unsharded reference train the same
model side by side in one set of processes; every collective both sharded systems issue is
recorded with its group size and bytes, per phase (forward / backward)."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.engine.comm import collectives as C

IN, D, OUT = 7, 11, 5  # 11 and 23 (= 2 * 11 + 1) rows split unevenly over 2, 3 and 4 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D + 1)
        self.fc2 = nn.Linear(2 * D + 1, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class Collectives(TorchDispatchMode):
    """Records each c10d collective that reaches the dispatcher. An all-gather's group size
    is its output over its input (`_allgather_base_`: one flat tensor each way)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, int]] = []  # (kind, group size, bytes sent per rank)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            name = func._schema.name.split("::", 1)[1]
            if name.startswith("_allgather_base"):
                out, inp = args[0], args[1]
                self.seen.append(("all_gather", out.numel() // inp.numel(),
                                  inp.numel() * inp.element_size()))
            elif name.startswith("_reduce_scatter_base"):
                out, inp = args[0], args[1]
                self.seen.append(("reduce_scatter", inp.numel() // out.numel(),
                                  inp.numel() * inp.element_size()))
            elif name.startswith("allreduce"):
                t = args[0][0]
                self.seen.append(("all_reduce", 0, t.numel() * t.element_size()))
            elif not name.endswith("wait_tensor"):
                self.seen.append((name, 0, 0))
        return func(*args, **(kwargs or {}))


@contextmanager
def recording(into: dict[str, list], phase: str) -> Iterator[None]:
    mode = Collectives()
    with mode:
        yield
    into.setdefault(phase, []).extend(mode.seen)


def summary(seen: list[tuple[str, int, int]]) -> dict[str, int]:
    """'kind/group' -> count, and 'kind/group bytes' -> bytes sent per rank, summed."""
    out: Counter[str] = Counter()
    for kind, group, nbytes in seen:
        out[f"{kind}/{group}"] += 1
        out[f"{kind}/{group} bytes"] += nbytes
    return dict(out)


def _full(model: nn.Module, fsdp2: bool) -> dict[str, torch.Tensor]:
    if not fsdp2:
        return sw.full_state_dict(model)
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _shard(model: Net, fsdp2: bool, k: object, root_k: object, mp: bool,
           offload: bool) -> None:
    kw: dict[str, Any] = {}
    if mp:
        kw["mp_policy"] = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = TorchOffload(pin_memory=False)
    shard = torch_fully_shard if fsdp2 else sw.fully_shard
    if not fsdp2:
        kw["coalesce_bytes"] = 0  # FSDP2's collectives, counted against it below
    for b in model.blocks:
        shard(b, reshard_after_forward=k, **kw)
    shard(model, reshard_after_forward=root_k, **kw)


def hpz_parity(rank: int, world: int, k: int, case: dict[str, Any]) -> dict[str, Any]:
    """Three steps of shardwise, FSDP2 and the unsharded reference on one global batch.

    case: mp (bf16 params, fp32 reduce), offload (CPU offload policy), root_k (the root's
    reshard_after_forward), prefetch (False: shardwise's prefetch off), set_true_after (a
    step after which set_reshard_after_forward(True) is called on both roots).
    Returns per step and system the collectives by phase, and the worst differences.
    """
    torch.manual_seed(0)
    base = Net()
    ref = copy.deepcopy(base)
    models = {"shardwise": copy.deepcopy(base), "fsdp2": copy.deepcopy(base)}
    for name, m in models.items():
        _shard(m, name == "fsdp2", k, case.get("root_k"), case.get("mp", False),
               case.get("offload", False))
    if case.get("prefetch") is False:
        models["shardwise"].set_prefetch(False)  # type: ignore[operator]
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
            for n, m in models.items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    per_rank, steps = 2, 3
    ref_tol = 3e-2 if case.get("mp") else 1e-5
    worst = {"ref": 0.0, "fsdp2": 0.0}
    counts: list[dict[str, dict[str, dict[str, int]]]] = []
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(per_rank * world, IN, generator=g)
        y = torch.randn(per_rank * world, OUT, generator=g)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        step_counts: dict[str, dict[str, dict[str, int]]] = {}
        losses = {}
        for name, m in models.items():
            seen: dict[str, list] = {}
            with recording(seen, "forward"):
                loss = nn.functional.mse_loss(m(x[mine]).float(), y[mine])
            with recording(seen, "backward"):
                loss.backward()
            step_counts[name] = {ph: summary(v) for ph, v in seen.items()}
            losses[name] = loss.detach().clone()
            opts[name].step()
            opts[name].zero_grad()
        counts.append(step_counts)
        for name, loss in losses.items():
            got = _mean(loss)
            tol = ref_tol * max(1.0, abs(ref_loss.item()))
            assert abs(got - ref_loss.item()) <= tol, (
                f"k={k} {case} step {step}: {name} loss {got} vs unsharded {ref_loss.item()}")
        full = {n: _full(m, n == "fsdp2") for n, m in models.items()}
        for pname, p in ref.named_parameters():
            ours = full["shardwise"][pname].float()
            d_ref = (ours - p.detach().float()).abs().max().item()
            d_fsdp2 = (ours - full["fsdp2"][pname].float()).abs().max().item()
            worst["ref"], worst["fsdp2"] = max(worst["ref"], d_ref), max(worst["fsdp2"], d_fsdp2)
            assert d_ref <= ref_tol, f"k={k} {case} step {step}: {pname} vs unsharded {d_ref}"
            assert d_fsdp2 <= 1e-5, f"k={k} {case} step {step}: {pname} vs FSDP2 {d_fsdp2}"
        if case.get("set_true_after") == step:
            for m in models.values():
                m.set_reshard_after_forward(True)  # type: ignore[operator]
    return {"counts": counts, "worst": worst}


def _mean(x: torch.Tensor) -> float:
    t = x.detach().double().clone().reshape(1)
    C.all_reduce(t, None)
    return t.item() / C.world_size()


def hpz_cases(rank: int, world: int, cases: list[tuple[int, dict[str, Any]]],
              refusals: bool) -> dict[str, Any]:
    """Several `hpz_parity` cases (and the refusals) in one set of processes."""
    out: dict[str, Any] = {f"{k} {sorted(c.items())}": hpz_parity(rank, world, k, c)
                           for k, c in cases}
    if refusals:
        out["refusals"] = hpz_refusals(rank, world)
    return out


def hpz_refusals(rank: int, world: int) -> dict[str, str]:
    """Bad hpZ input raises, naming the value, before any collective."""
    out: dict[str, str] = {}
    for k in (3, 0, 8):
        try:
            sw.fully_shard(Block(), reshard_after_forward=k)
        except ValueError as e:
            out[f"k={k}"] = str(e)
    m = Net()
    for b in m.blocks:
        sw.fully_shard(b, reshard_after_forward=2)
    sw.fully_shard(m)
    try:
        m.set_reshard_after_forward(2)  # type: ignore[operator]
    except ValueError as e:
        out["set 2"] = str(e)
    return out

"""Workers for test_coalesce.py: small units sharing collectives ([Note: coalesced units] in
engine/core/schedule.py), against each unit alone and against unsharded training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.engine.core.context import context_of
from tests.dist.fsdp2.common import record_collectives
from tests.dist.parity import grad_diffs, param_diffs

STEPS = 3
PER_RANK = 3
# Small enough that the model below makes several groups, with its one big block alone.
BUDGET = 1500


class Block(nn.Module):
    def __init__(self, i: int, o: int, ckpt: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(i, o)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt and torch.is_grad_enabled():
            return checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=False)
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Blocks of uneven sizes (none divides by 2 or 3): 7 -> 5 -> 9 -> 11 -> 40 (the big one,
    1,640 parameters: alone at BUDGET) -> 6 -> 5 -> 3, and a head."""

    dims = (7, 5, 9, 11, 40, 6, 5, 3)

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        d = self.dims
        self.blocks = nn.ModuleList(Block(d[i], d[i + 1], ckpt and i % 2 == 1)
                                    for i in range(len(d) - 1))
        self.head = nn.Linear(d[-1], 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class TwiceNet(Net):
    """A square block runs twice per forward after the first block: a unit whose places in
    the order are not one stays alone."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = Block(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = self.extra(self.extra(x))  # the same unit twice
        for b in self.blocks[1:]:
            x = b(x)
        return self.head(x)


def _model(case: str) -> nn.Module:
    torch.manual_seed(0)
    m: nn.Module = TwiceNet() if case == "twice" else Net(ckpt=case == "checkpoint")
    if case == "frozen":
        m.blocks[2].requires_grad_(False)  # type: ignore[index]
        m.blocks[5].lin.bias.requires_grad_(False)  # type: ignore[index]
    return m


def _shard(m: nn.Module, case: str, budget: int | None) -> None:
    raf = case != "grad_op"
    units = list(m.blocks) + ([m.extra] if case == "twice" else [])  # type: ignore[operator]
    for b in units:
        sw.fully_shard(b, reshard_after_forward=raf, coalesce_bytes=budget)
    sw.fully_shard(m, reshard_after_forward=raf, coalesce_bytes=budget)


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = PER_RANK * world
    return torch.randn(n, Net.dims[0], generator=g), torch.randn(n, 2, generator=g)


def _train(model: nn.Module, case: str, rank: int, world: int, sharded: bool,
           logs: list[Any] | None = None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    micro = 2 if case == "no_sync" else 1
    for step in range(STEPS):
        x, y = _batch(step, world)
        if sharded:
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            x, y = x[mine], y[mine]
        with record_collectives() as log:
            for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                if sharded and micro > 1:
                    model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
                # The mean over this rank's batch (micro-batches of uneven sizes add up to
                # it); the ranks' mean of those is the unsharded mean.
                loss = (model(xs) - ys).square().sum() / (len(x) * ys.shape[1])
                loss.backward()
            opt.step()
            if step < STEPS - 1:
                opt.zero_grad()  # the last step's gradients stay, to be compared
        if logs is not None:
            logs.append([(op, n) for op, _, n, _ in log])


def coalesce_cases(rank: int, world: int, cases: list[str]) -> dict[str, Any]:
    """Per case: each budget's differences from unsharded training, the largest difference
    between coalesced and alone, the groups the schedule cut and the last step's
    collectives."""
    out: dict[str, Any] = {}
    for case in cases:
        ref = _model(case)
        _train(ref, case, rank, world, sharded=False)
        res: dict[str, Any] = {}
        finals = {}
        for budget in (0, BUDGET, None):
            m = _model(case)
            _shard(m, case, budget)
            logs: list[Any] = []
            _train(m, case, rank, world, sharded=True, logs=logs)
            diffs = {**param_diffs(m, ref, case), **grad_diffs(m, ref, case)}
            ctx = context_of(m)
            assert ctx is not None
            groups = {id(g): [u.label for u in g.members]
                      for g in ctx.schedule.groups.values()}
            finals[budget] = sw.full_state_dict(m)
            res[str(budget)] = {"worst": max(diffs.values()),
                                # (keys: "<case> frozen param <fqn>")
                                "frozen moved": [k for k, v in diffs.items() if v != 0.0
                                                 and k.split(" ")[1] == "frozen"],
                                "groups": sorted(groups.values()),
                                "last step": logs[-1]}
        res["alone vs coalesced"] = max(
            (finals[0][k] - finals[b][k]).abs().max().item()
            for b in (BUDGET, None) for k in finals[0])
        out[case] = res
    return out


def debug_run(rank: int, world: int) -> list[Any]:
    """The default budget under SHARDWISE_DEBUG's cross-rank fingerprint check: every
    collective of three steps compared on every rank before it is issued."""
    sw.set_debug(True)
    try:
        m = _model("mlp")
        _shard(m, "mlp", None)
        logs: list[Any] = []
        _train(m, "mlp", rank, world, sharded=True, logs=logs)
        return logs
    finally:
        sw.set_debug(False)


class ChangingNet(nn.Module):
    """Six equal blocks whose order changes on odd steps: one skipped ("skip"), all in reverse
    ("reverse"), the last three not run ("tail"); even steps run the recorded order. A group
    cut from one step's order must gather, free and reduce right in another's."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(7, 7) for _ in range(6))
        self.head = nn.Linear(7, 2)
        self.mode, self.step = mode, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = list(range(6))
        if self.step % 2 == 1:
            order = {"skip": [0, 1, 3, 4, 5], "reverse": order[::-1], "tail": order[:3]}[self.mode]
        for i in order:
            x = self.blocks[i](x)
        return self.head(x)


def changing_order(rank: int, world: int, modes: list[str]) -> dict[str, Any]:
    """Per mode and budget: the largest difference from unsharded training after 5 steps,
    and the units left unsharded after any step (none may be)."""
    from shardwise.engine.core.unit import ShardedState

    out: dict[str, Any] = {}
    for mode in modes:
        torch.manual_seed(0)
        ref = ChangingNet(mode)
        for budget in (0, None):
            torch.manual_seed(0)
            m = ChangingNet(mode)
            for b in m.blocks:
                sw.fully_shard(b, coalesce_bytes=budget)
            sw.fully_shard(m, coalesce_bytes=budget)
            ctx = context_of(m)
            assert ctx is not None
            left: list[str] = []
            for model, sharded in ((ref, False), (m, True)):
                if model is ref and budget is None:
                    continue  # trained once, with the first budget
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                for step in range(5):
                    model.step = step
                    x, y = _batch(step, world)
                    x = x[:, :7]
                    if sharded:
                        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                        x, y = x[mine], y[mine]
                    loss = (model(x) - y).square().sum() / (len(x) * y.shape[1])
                    loss.backward()
                    opt.step()
                    if step < 4:
                        opt.zero_grad()
                    if sharded:
                        left += [f"step {step}: {u.label}" for u in ctx.units
                                 if u.state is not ShardedState.SHARDED and not u.is_root]
            diffs = {**param_diffs(m, ref, mode), **grad_diffs(m, ref, mode)}
            out[f"{mode}/{budget}"] = {"worst": max(diffs.values()), "left unsharded": left}
    return out

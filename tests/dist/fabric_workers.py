"""Lightning Fabric's ModelParallelStrategy with a user parallelize function, unchanged.

The parallelize function is the one Lightning's docs show for FSDP2 (`fully_shard` on each
block, then on the root, over the mesh's "data_parallel" axis); only which `fully_shard` it
calls differs. Fabric then drives everything itself: `setup` / `setup_module`, `backward`,
`no_backward_sync` (which finds FSDP by `isinstance(m, FSDPModule)` and calls
`set_requires_gradient_sync`), and `save` / `load` (which find the distributed model by its
DTensor parameters and use DCP's state-dict helpers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.observe.sinks import ListSink, attach_sink

D_IN, HIDDEN, D_OUT = 7, 13, 5  # nothing divides by 2 or 3 ranks
TOL = 1e-5


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(2))
        self.out = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _parallelize(engine: str) -> Any:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    shard = sw.fully_shard if engine == "shardwise" else fsdp2_fully_shard

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        dp = mesh["data_parallel"]
        for block in model.blocks:
            shard(block, mesh=dp)
        shard(model, mesh=dp)
        return model

    return parallelize


def _fabric(engine: str, world: int) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(parallelize_fn=_parallelize(engine),
                                     data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()  # ranks exist already (LOCAL_RANK is set): Fabric joins them
    return fabric


def _batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(2 * world, D_IN, generator=g), torch.randn(2 * world, D_OUT, generator=g)
    return x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]


def _setup(fabric: Any, seed: int = 0) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = fabric.setup_module(Net())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                    weight_decay=0.1, eps=1e-4))
    return model, opt


def _train(fabric: Any, model: nn.Module, opt: Any, steps: int, sink: ListSink | None
           ) -> tuple[list[float], list[int]]:
    """Two microbatches a step; the first under no_backward_sync. Returns the mean loss
    per step and, with a sink, the reduce-scatters each microbatch issued."""
    rank, world = fabric.global_rank, fabric.world_size
    losses, reduces = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(2):
            x, y = _batch(step, micro, rank, world)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = nn.functional.mse_loss(model(x), y) / 2
                fabric.backward(loss)
            if sink is not None:
                events = sink.drain()
                reduces.append(sum(e.collective == "reduce_scatter" for e in events))
            total += fabric.all_reduce(loss.detach(), reduce_op="mean").item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, reduces


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def train_and_save(rank: int, world: int, folder: str) -> dict[str, Any]:
    """FSDP2 and shardwise through the same Fabric code: same losses and parameters; the
    accumulation microbatch issues no reduce-scatter; shardwise's run is then saved."""
    runs = {}
    for engine in ("fsdp2", "shardwise"):
        fabric = _fabric(engine, world)
        model, opt = _setup(fabric)
        sink = None
        if engine == "shardwise":
            sink = ListSink()
            attach_sink(model, sink)
        losses, reduces = _train(fabric, model, opt, 3, sink)
        runs[engine] = (losses, _full(model), reduces, fabric, model, opt)
    ref_losses, ref_params = runs["fsdp2"][:2]
    assert getattr(runs["shardwise"][4], "_sw_unit", None) is not None  # shardwise's units
    assert getattr(runs["fsdp2"][4], "_sw_unit", None) is None
    losses, params, reduces, fabric, model, opt = runs["shardwise"]
    for s, (a, b) in enumerate(zip(ref_losses, losses)):
        assert abs(a - b) <= TOL * max(1.0, abs(a)), f"step {s}: loss {b} vs FSDP2 {a}"
    worst = max((params[n] - t).abs().max().item() for n, t in ref_params.items())
    assert worst <= TOL, f"parameters differ from FSDP2 by {worst:.3g}"
    # 3 units: microbatch 0 (no_backward_sync) reduces nothing, microbatch 1 reduces all.
    assert reduces == [0, 3] * 3, reduces
    fabric.save(folder, {"model": model, "optimizer": opt, "step": 3})
    saved = {n: t.flatten().tolist() for n, t in params.items()}
    load(rank, world, folder, saved)
    return {"params": saved, "worst": worst}


def load(rank: int, world: int, folder: str, saved: dict[str, list[float]]) -> float:
    """Fabric.load at `world` ranks into a fresh shardwise model: the saved parameters and
    optimizer state come back, and training goes on."""
    fabric = _fabric("shardwise", world)
    model, opt = _setup(fabric, seed=5)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(folder, state)
    assert state["step"] == 3, state["step"]
    worst = max((t - torch.tensor(saved[n]).reshape(t.shape)).abs().max().item()
                for n, t in _full(model).items())
    assert worst == 0.0, f"loaded parameters differ by {worst:.3g}"
    steps = {float(s["step"]) for s in opt.state.values()}
    assert steps == {3.0}, steps
    _train(fabric, model, opt, 1, None)
    return worst

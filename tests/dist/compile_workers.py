"""torch.compile with sharding, in every order users write it (issue 12, defect 12)."""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from tests.clients import Block, GPTShape, NanoGPT, gpt_batch
from tests.dist.harness import run_parity

MODES = ("whole_after", "whole_before", "blocks_after", "blocks_before")


def _shard(mode: str, backend: str):
    def shard(m: nn.Module) -> None:
        if mode == "blocks_before":
            for b in m.transformer.h:
                b.compile(backend=backend)
        sw.shard_model(m, auto_wrap_policy=sw.transformer_policy({Block}))
        if mode == "blocks_after":
            for b in m.transformer.h:
                b.compile(backend=backend)
    return shard


class _Compiled(nn.Module):
    """Holds `torch.compile(model)` so the harness can call it like the model."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *a: torch.Tensor) -> torch.Tensor:
        return self.compiled(*a)


def compiled_parity(rank: int, world: int, backend: str, modes: tuple[str, ...]) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    out = {}
    for mode in modes:
        torch._dynamo.reset()
        graphs: list[int] = []

        def loss(m: nn.Module, b: tuple, mode: str = mode) -> torch.Tensor:
            return m(*b)

        def build(mode: str = mode) -> nn.Module:
            return NanoGPT()

        def count(step: int, model: nn.Module, ref: nn.Module, graphs: list = graphs) -> None:
            graphs.append(counters["stats"]["unique_graphs"])

        if mode.startswith("whole"):
            def shard_whole(m: nn.Module, mode: str = mode) -> None:
                if mode == "whole_before":
                    # torch.compile(model) first, then shard what it wraps.
                    m.__dict__["_sw_compiled"] = torch.compile(m, backend=backend)
                    sw.shard_model(m, auto_wrap_policy=sw.transformer_policy({Block}))
                else:
                    sw.shard_model(m, auto_wrap_policy=sw.transformer_policy({Block}))
                    m.__dict__["_sw_compiled"] = torch.compile(m, backend=backend)

            def run(m: nn.Module, b: tuple) -> torch.Tensor:
                return m.__dict__["_sw_compiled"](*b) if "_sw_compiled" in m.__dict__ else m(*b)

            res = run_parity(rank, world, build, shard_whole,
                             lambda s, n: gpt_batch(GPTShape(), 100 + s, n), run, steps=4,
                             between_steps=count, what=f"compile {mode} {backend}")
        else:
            res = run_parity(rank, world, build, _shard(mode, backend),
                             lambda s, n: gpt_batch(GPTShape(), 100 + s, n), loss, steps=4,
                             between_steps=count, what=f"compile {mode} {backend}")
        # graphs[i] is the count before step i: everything compiles during step 0, and the
        # later steps reuse it (no recompilation as engine state changes).
        assert graphs[1] > 0 or mode.startswith("whole"), f"{mode}: nothing compiled"
        assert graphs[1:] == [graphs[1]] * (len(graphs) - 1), (
            f"{mode} {backend}: recompiled after the first step: graphs {graphs}")
        out[mode] = res
    return out

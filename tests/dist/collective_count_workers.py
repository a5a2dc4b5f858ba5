"""Workers for issue 35's "the default path pays what FSDP2 pays": every collective of one
training step, counted for shardwise and for PyTorch's FSDP2 on the same GPT.

Two independent counts are taken of the same step, so that neither can miss a collective
the other sees:
- `python`: every `torch.distributed` collective function, wrapped in this process. The
  wrapper replaces the attribute on `torch.distributed`, on `distributed_c10d` (which calls
  its own functions by global name: `all_gather_into_tensor` calls `all_gather_single`) and
  every alias a loaded `shardwise`/`torch.distributed` module bound at import time
  (`x = dist.all_gather_single`), so the call sites see the wrapper however they reach it.
  Only the outermost call counts: one user-level collective is one count.
- `c10d`: the collective ops that reach the dispatcher (`c10d::`, `_c10d_functional::`),
  seen by a TorchDispatchMode around the step (backward included: autograd carries the mode
  into its hooks). Every collective a backend runs passes there, functional collectives and
  DTensor's too, which never touch the Python functions. (A profiler trace sees the same
  ops, at ten times the cost of the step.)
Kinds are logical for `python` (all_gather_single and all_gather_into_tensor are both
"all_gather"); shardwise's gloo transport moves a gather or a scatter as one all_to_all
([Note: gloo transport] in the engine's comm/transport.py), counted as "all_to_all".
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.train.model import GPT, GPTConfig

# torch.distributed function -> the logical kind it is counted as.
KINDS: dict[str, str] = {
    "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather", "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather", "all_gather_object": "object",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
    "broadcast": "broadcast", "_broadcast_coalesced": "broadcast",
    "broadcast_object_list": "object", "barrier": "barrier", "monitored_barrier": "barrier",
    "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p", "batch_isend_irecv": "p2p",
    "send_object_list": "object", "recv_object_list": "object",
    "gather": "gather", "gather_object": "object", "scatter": "scatter",
    "scatter_object_list": "object", "reduce": "reduce",
}

# Reduced shapes with the structure of the benchmark models (per-layer units + the root):
# 'small' has 4 blocks, bench30m 10 (src/shardwise/bench/runner.py). d_model 48 and the
# 256-row tables divide by neither 3 nor (for qkv, 144 rows) unevenly: padding is exercised.
PRESETS: dict[str, GPTConfig] = {
    "small": GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=48),
    "bench30m": GPTConfig(vocab_size=256, block_size=16, n_layer=10, n_head=8, d_model=48),
}
BATCH = 2
WARMUP = 2  # steps before the counted one: lazy init and the recorded prefetch order


class _Counting:
    """Counts outermost torch.distributed collective calls while installed."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._depth = threading.local()
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        kind = KINDS[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.counts[kind] += 1
            self._depth.n = depth + 1
            try:
                return real(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def install(self) -> None:
        originals = {name: getattr(c10d, name) for name in KINDS if hasattr(c10d, name)}
        wrappers = {id(fn): self._wrap(name, fn) for name, fn in originals.items()}
        owners = [m for n, m in list(sys.modules.items())
                  if m is not None and (n == "torch.distributed" or n.startswith(
                      ("torch.distributed.", "shardwise", "tests.")))]
        for mod in owners:
            for attr, value in list(vars(mod).items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None:
                    self._undo.append((mod, attr, value))
                    setattr(mod, attr, wrapper)

    def uninstall(self) -> None:
        for mod, attr, value in reversed(self._undo):
            setattr(mod, attr, value)
        self._undo.clear()


def _op_kind(op: str) -> str:
    """'c10d::_allgather_base_', '_c10d_functional::all_gather_into_tensor' -> 'all_gather'."""
    name = op.split("::", 1)[1].replace("_", "")
    for prefix, kind in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
                         ("allreduce", "all_reduce"), ("alltoall", "all_to_all"),
                         ("broadcast", "broadcast"), ("barrier", "barrier"),
                         ("send", "p2p"), ("recv", "p2p"), ("gather", "gather"),
                         ("scatter", "scatter"), ("reduce", "reduce")):
        if name.startswith(prefix):
            return kind
    return name


class _BackendOps(TorchDispatchMode):
    """Counts the collective ops that reach the dispatcher: `c10d::` (what every
    torch.distributed function calls) and `_c10d_functional::` (functional collectives and
    DTensor's, which call c10d below this mode and never touch the Python functions)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._schema.name
            if not name.endswith(("wait_tensor", "_wrap_tensor_autograd")):
                self.counts[_op_kind(name)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting() -> Iterator[dict[str, Counter[str]]]:
    """{"python": kind -> calls, "c10d": kind -> backend ops} for the enclosed code."""
    result: dict[str, Counter[str]] = {"python": Counter(), "c10d": Counter()}
    counter = _Counting()
    ops = _BackendOps()
    counter.install()
    try:
        with ops:
            yield result
    finally:
        counter.uninstall()
    result["python"].update(counter.counts)
    result["c10d"].update(ops.counts)


def shard_fsdp2(model: GPT, reshard_after_forward: bool) -> None:
    # torch's own recipe, the same units as shardwise's "transformer" policy: each block,
    # then the root (whose reshard_after_forward stays FSDP2's default for the root).
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model)


def build(system: str, preset: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    if system == "fsdp2":
        shard_fsdp2(model, True)
    elif system == "fsdp2 reshard_after_forward=False":
        shard_fsdp2(model, False)
    elif system.startswith("shardwise"):
        # Each unit alone, as FSDP2 issues them; "coalesced": the default budget ([Note:
        # coalesced units] in engine/core/schedule.py).
        strategy = "SHARD_GRAD_OP" if "SHARD_GRAD_OP" in system else "FULL_SHARD"
        sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                       coalesce_bytes=None if system.endswith("coalesced") else 0)
    else:
        raise ValueError(f"system {system!r} is not one of fsdp2, shardwise and their variants")
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    cfg: GPTConfig = model.cfg  # type: ignore[assignment]
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=g)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()


def step_counts(rank: int, world: int, runs: list[tuple[str, str, bool]]
                ) -> dict[str, dict[str, dict[str, int]]]:
    """For each (system, preset, gloo_native): the collectives of training step WARMUP + 1,
    counted both ways; "system/preset/native|all_to_all" -> {"python": {kind: n},
    "c10d": {kind: n}}.

    gloo_native sets SHARDWISE_GLOO_NATIVE=1 while the model is sharded and trained (a
    shardwise mesh picks its transport when it is made); it does not concern FSDP2.
    """
    import os

    before = os.environ.get("SHARDWISE_GLOO_NATIVE")
    out: dict[str, dict[str, dict[str, int]]] = {}
    try:
        for system, preset, native in runs:
            os.environ["SHARDWISE_GLOO_NATIVE"] = "1" if native else "0"
            model = build(system, preset)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(WARMUP):
                _step(model, opt, rank, step)
            with counting() as got:
                _step(model, opt, rank, WARMUP)
            out[key(system, preset, native)] = {k: dict(v) for k, v in got.items()}
            del model, opt
    finally:
        if before is None:
            os.environ.pop("SHARDWISE_GLOO_NATIVE", None)
        else:
            os.environ["SHARDWISE_GLOO_NATIVE"] = before
    return out


def key(system: str, preset: str, native: bool) -> str:
    return f"{system}/{preset}/{'native' if native else 'all_to_all'}"


# --- issue 41 part 3: the accumulation recipe, HSDP and per-layer MoE units ----------------

MICRO = 3  # micro-batches per step in the accumulation recipe


def _shard_recipe(model: GPT, system: str, hsdp: bool, world: int) -> None:
    """Each block then the root, by FSDP2 or shardwise; HSDP: on a (world, 1) mesh (every
    rank a replica: the reduction is the all-reduce across replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shard = fully_shard if system == "fsdp2" else sw.fully_shard
    kw: dict[str, Any] = {} if system == "fsdp2" else {"coalesce_bytes": 0}
    if hsdp:
        kw["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        shard(block, **kw)
    shard(model, **kw)


def accumulation_counts(rank: int, world: int, systems: list[str], hsdp: bool
                        ) -> dict[str, list[dict[str, int]]]:
    """FSDP2's gradient-accumulation recipe (set_requires_gradient_sync(last),
    set_reshard_after_backward(last)) over MICRO micro-batches: the collectives of each
    micro-batch of the second step (the first warms up), optimizer step in the last one.
    system -> [per micro-batch {kind: n}] (torch.distributed calls; gloo's native
    collectives for shardwise)."""
    import os

    before = os.environ.get("SHARDWISE_GLOO_NATIVE")
    os.environ["SHARDWISE_GLOO_NATIVE"] = "1"
    out: dict[str, list[dict[str, int]]] = {}
    try:
        for system in systems:
            torch.manual_seed(0)
            model = GPT(PRESETS["small"])
            _shard_recipe(model, system, hsdp, world)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            per_micro: list[dict[str, int]] = []
            for step in range(2):
                for i in range(MICRO):
                    last = i == MICRO - 1
                    with counting() as got:
                        model.set_requires_gradient_sync(last)  # type: ignore[operator]
                        model.set_reshard_after_backward(last)  # type: ignore[operator]
                        g = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
                        cfg = model.cfg
                        x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size), generator=g)
                        model(x, x).backward()
                        if last:
                            opt.step()
                            opt.zero_grad()
                    if step == 1:
                        per_micro.append(dict(got["python"]))
            out[system] = per_micro
    finally:
        if before is None:
            os.environ.pop("SHARDWISE_GLOO_NATIVE", None)
        else:
            os.environ["SHARDWISE_GLOO_NATIVE"] = before
    return out


def moe_layer_counts(rank: int, world: int) -> dict[str, Any]:
    """The per-layer MoE recipe (docs/moe.md: each layer a unit, then the root) with routing
    that leaves some expert without tokens on each rank: the collectives of the third step
    and the host reads (`Tensor.tolist`) and host lists made tensors (`torch.tensor`) by the
    engine's unit.py."""
    import os

    from tests.dist import moe_workers as M

    os.environ["SHARDWISE_GLOO_NATIVE"] = "1"
    torch.manual_seed(0)
    model = M.Net()
    M._shard_hand(model, "layers", coalesce_bytes=0)  # each unit's own collectives, counted
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reads, copies = [0], [0]
    real, real_tensor = torch.Tensor.tolist, torch.tensor

    def from_unit() -> bool:
        return sys._getframe(2).f_code.co_filename.endswith("engine/core/unit.py")

    def counted(t: torch.Tensor) -> Any:
        reads[0] += from_unit()
        return real(t)

    def counted_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        copies[0] += from_unit()
        return real_tensor(*args, **kwargs)

    got: dict[str, Counter[str]] = {}
    for step in range(3):
        ids, tgt = M._batch(step, world * M.PER_RANK)
        mine = slice(rank * M.PER_RANK, (rank + 1) * M.PER_RANK)
        if step == 2:
            torch.Tensor.tolist = counted  # type: ignore[method-assign]
            torch.tensor = counted_tensor  # type: ignore[assignment]
            try:
                with counting() as got:
                    M._loss(model, (ids[mine], tgt[mine])).backward()
                    opt.step()
                    opt.zero_grad()
            finally:
                torch.Tensor.tolist = real  # type: ignore[method-assign]
                torch.tensor = real_tensor
        else:
            M._loss(model, (ids[mine], tgt[mine])).backward()
            opt.step()
            opt.zero_grad()
    return {"counts": dict(got["python"]), "c10d": dict(got["c10d"]), "host_reads": reads[0],
            "host_lists_to_device": copies[0]}

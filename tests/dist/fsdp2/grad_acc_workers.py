"""Scenarios of upstream test_fully_shard_training.py's TestFullyShardGradientAccumulation
(and the older test_fully_shard_grad_acc.py) with the axes the first port left out:
set_reshard_after_backward, set_is_last_backward, int reshard_after_forward, HSDP meshes,
asynchronous explicit unshards, and set_requires_gradient_sync with recurse=False.

Counts are of shardwise's own collectives on the units' labels (the layout and freeze checks
are not a unit's). Under HSDP shardwise reduce-scatters within the shard group and then
all-reduces across replicas, as FSDP2 does; a shard group of one rank has nothing to gather
or scatter, so only the all-reduce is issued there.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import shardwise as sw
from tests.dist.fsdp2.common import (
    DataParallelRef,
    Expect,
    check_sharded_parity,
    global_batch,
    randn,
    record_collectives,
    sharded_modules,
    tokens,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.hpz import K, check_blocks, record_gathers
from tests.dist.fsdp2.models import MLP, ModelArgs, Transformer, transformer_blocks


def _fully_shard(*args: Any, **kwargs: Any) -> Any:
    """sw.fully_shard with each unit alone: these scenarios count FSDP2's collectives
    per unit ([Note: coalesced units] in engine/core/schedule.py)."""
    return sw.fully_shard(*args, coalesce_bytes=0, **kwargs)

_MESHES: dict[tuple[int, ...], DeviceMesh] = {}




def make_mesh(kind: str, world: int) -> DeviceMesh | None:
    """'world': None (the default group); 'hsdp_rep': replicate over every rank, shard
    groups of one; 'hsdp_shard': one replica, a 2-D mesh of (1, world); 'hsdp': (2, world/2).
    Meshes are made once per process: each one creates process groups."""
    shape = {"world": (), "hsdp_rep": (world, 1), "hsdp_shard": (1, world),
             "hsdp": (2, world // 2)}[kind]
    if not shape:
        return None
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape,
                                          mesh_dim_names=("dp_replicate", "dp_shard"))
    return _MESHES[shape]


def shard_size_of(mesh: DeviceMesh | None, world: int) -> int:
    return world if mesh is None else mesh.size(mesh.ndim - 1)


def raf_value(raf: str, shard_size: int) -> bool | int:
    """'int' is FSDP2's int form at the shard-group size (the same as True); 'int1' is 1
    (the same as False); 'k2' is 2, hpZ at 4 ranks (tests/dist/fsdp2/hpz.py)."""
    return {"true": True, "false": False, "int": shard_size, "int1": 1, "k2": K}[raf]


def unit_counts(log: list, labels: set[str]) -> dict[str, int]:
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for op, label, _, _ in log:
        if label in labels and op in out:
            out[op] += 1
    return out


def gradient_accumulation(rank: int, world: int, ex: Expect, mesh: str, raf: str, mode: str,
                          reshard_after_backward: bool, offload: bool,
                          reduce_scatter_only: bool = False) -> None:
    """Micro-batches with reductions switched off (all units / the root's own / two MLPs),
    optionally keeping the full parameters after backward; zero_grad alternates set_to_none,
    which mixes accumulation with and without communication."""
    dmesh = make_mesh(mesh, world)
    S = shard_size_of(dmesh, world)
    replicas = world // S
    torch.manual_seed(42)
    num_mlps, microbatches, dim = 3, 3, 9
    model = nn.Sequential(nn.Linear(dim, dim), *[MLP(dim) for _ in range(num_mlps)])
    ref = copy.deepcopy(model)
    policy = sw.CPUOffloadPolicy(pin_memory=False) if offload else None
    value = raf_value(raf, S)
    for m in [*model[1:], model]:
        _fully_shard(m, mesh=dmesh, reshard_after_forward=value, offload_policy=policy)
    labels = {m._sw_unit.label for m in sharded_modules(model)}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    dp = DataParallelRef(ref, world)
    unsynced = {"all": ("",), "some_mlps": ("1.", "2."), "root_only": ("0.",)}[mode]

    def set_flags(last: bool) -> None:
        if mode == "all":
            targets, recurse = [model], True
        elif mode == "some_mlps":
            targets, recurse = list(model[1:3]), True
        else:
            targets, recurse = [model], False
        for t in targets:
            t.set_requires_gradient_sync(last, recurse=recurse)
            if not reshard_after_backward:
                t.set_reshard_after_backward(last, recurse=recurse)
        model.set_is_last_backward(last)

    for it in range(3):
        with record_collectives() as log, record_gathers() as groups:
            for mb in range(microbatches):
                last = mb == microbatches - 1
                set_flags(last)
                xs = global_batch(10 * it + mb, world, randn(2, dim))
                loss = model(xs[rank]).sum()
                loss.backward()
                ref_losses = dp.step(xs, _sum, lambda n, last=last: last or not n.startswith(
                    unsynced))
                ex.close(loss, ref_losses[rank], f"iter {it} mb {mb}: loss")
        got = unit_counts(log, labels)
        rs = num_mlps + 1
        if mode == "some_mlps":
            rs += (num_mlps - 2 + 1) * (microbatches - 1)
        elif mode == "root_only":
            rs += num_mlps * (microbatches - 1)
        ag = num_mlps + 1
        if value is True or (value is not False and value > 1):  # True == 1 in Python
            ag = 2 * (num_mlps + 1) * microbatches
        elif reshard_after_backward:
            ag *= microbatches
        elif mode == "root_only":
            ag += num_mlps * (microbatches - 1)
        want = {"reduce_scatter": rs if S > 1 else 0,
                "all_reduce": rs if replicas > 1 else 0,
                "all_gather": ag if S > 1 else 0}
        for op, n in want.items():
            ex.true(got[op] == n, f"iter {it}: {got[op]} {op}s, expected {n}")
        if raf == "k2":  # every micro-batch's backward gathers within the 2-rank blocks
            check_blocks(ex, groups, world, f"iter {it}", all_in_blocks=True)
        # The mesh is (replicate, shard), row-major: the shard rank is the last coordinate.
        check_sharded_parity(ex, ref, model, rank % S, S, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))
        check_sharded_parity(ex, ref, model, rank % S, S, f"iter {it} after step",
                             grads=False)


def requires_all_reduce_hsdp(rank: int, world: int, ex: Expect) -> None:
    """Upstream's reduce_scatter_only axis: set_requires_all_reduce(False) under HSDP
    reduce-scatters every micro-batch but all-reduces across replicas only on the last one
    (issue 36; tests/dist/test_hsdp_defer.py holds it against FSDP2 and reduce dtypes)."""
    dmesh = make_mesh("hsdp", world)
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(9, 9), MLP(9))
    ref = copy.deepcopy(model)
    _fully_shard(model[1], mesh=dmesh)
    _fully_shard(model, mesh=dmesh)
    labels = {m._sw_unit.label for m in sharded_modules(model)}
    dp = DataParallelRef(ref, world)
    S = dmesh.size(1)
    for mb in range(3):
        last = mb == 2
        model.set_requires_all_reduce(last)
        xs = global_batch(mb, world, randn(2, 9))
        with record_collectives() as log:
            model(xs[rank]).sum().backward()
        dp.step(xs, _sum)
        got = unit_counts(log, labels)
        ex.true(got["reduce_scatter"] == 2, f"mb {mb}: {got}")
        ex.true(got["all_reduce"] == (2 if last else 0), f"mb {mb}: {got}")
    check_sharded_parity(ex, ref, model, rank % S, S, "after the deferred all-reduce")


def requires_gradient_sync_recurse(rank: int, world: int, ex: Expect, raf: str,
                                   offload: bool, recurse: bool) -> None:
    """Older upstream test_requires_gradient_sync_: MLPs only (no root parameters); with
    recurse=False the first two MLPs are switched one by one with recurse=False."""
    torch.manual_seed(42)
    num_mlps, microbatches, dim = 3, 3, 10
    model = nn.Sequential(*[MLP(dim) for _ in range(num_mlps)])
    ref = copy.deepcopy(model)
    policy = sw.CPUOffloadPolicy(pin_memory=False) if offload else None
    value = raf_value(raf, world)
    for m in [*model, model]:
        _fully_shard(m, reshard_after_forward=value, offload_policy=policy)
    labels = {m._sw_unit.label for m in sharded_modules(model)}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    dp = DataParallelRef(ref, world)
    for it in range(4):
        with record_collectives() as log:
            for mb in range(microbatches):
                last = mb == microbatches - 1
                if recurse:
                    model.set_requires_gradient_sync(last)
                else:
                    for mlp in model[:2]:
                        mlp.set_requires_gradient_sync(last, recurse=False)
                xs = global_batch(20 * it + mb, world, randn(2, dim))
                loss = model(xs[rank]).sum()
                loss.backward()
                sync = (lambda n, last=last: last or not n.startswith(("0.", "1."))
                        ) if not recurse else last
                ex.close(loss, dp.step(xs, _sum, sync)[rank], f"iter {it} mb {mb}: loss")
        rs = num_mlps + (0 if recurse else (num_mlps - 2) * (microbatches - 1))
        got = unit_counts(log, labels)["reduce_scatter"]
        ex.true(got == rs, f"iter {it}: {got} reduce-scatters, expected {rs}")
        check_sharded_parity(ex, ref, model, rank, world, f"iter {it}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=bool(it % 2))


def microbatching_1f1b(rank: int, world: int, ex: Expect, unshard: str,
                       reshard_after_backward: bool) -> None:
    """Pipeline-style micro-batches with reshard_after_forward=False, reducing only on the
    last one (set_is_last_backward too); optionally every unit is unsharded up front with
    async handles that are never waited for explicitly (the forward waits), and
    optionally the parameters are kept after each backward but the last."""
    torch.manual_seed(42)
    args = ModelArgs(vocab_size=23, max_seq_len=16)
    model = Transformer(args)
    ref = copy.deepcopy(model)
    for m in [*transformer_blocks(model), model]:
        _fully_shard(m, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp = DataParallelRef(ref, world)
    labels = {m._sw_unit.label for m in sharded_modules(model)}
    for step in range(2):
        handles = []
        if unshard != "none":
            for m in sharded_modules(model):
                handles.append(m.unshard(async_op=unshard == "async"))
        with record_collectives() as log:
            for mb in range(3):
                last = mb == 2
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
                if not reshard_after_backward:
                    model.set_reshard_after_backward(last)
                xs = global_batch(10 * step + mb, world, tokens(23, 2, 16))
                loss = model(xs[rank]).sum()
                loss.backward()
                ex.close(loss, dp.step(xs, _sum, sync=last)[rank],
                         f"step {step} microbatch {mb}: loss")
        if unshard == "async":
            for h in handles:
                h.wait()  # the forward consumed the gather: nothing left to wait for
        # After the last backward every parameter is a shard again (FSDP2's too), so what
        # a user clips next sees the sharded gradients: the total norm is the reference's.
        full = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        ex.true(not full, f"step {step}: parameters left unsharded after backward: {full[:3]}")
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        ex.close(norm, torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1e9),
                 f"step {step}: total gradient norm", rtol=1e-5, atol=1e-5)
        n_units = len(labels)
        ag = unit_counts(log, labels)["all_gather"]
        want = 0 if unshard != "none" else n_units
        if reshard_after_backward:
            want += 2 * n_units  # each later microbatch gathers every unit again
        ex.true(ag == want, f"step {step}: {ag} all-gathers, expected {want}")
        if not full:
            check_sharded_parity(ex, ref, model, rank, world,
                                 f"step {step} after 3 micro-batches")
        opt.step()
        ref_opt.step()
        if not full:
            check_sharded_parity(ex, ref, model, rank, world, f"step {step} after the step",
                                 grads=False)
        opt.zero_grad()
        ref_opt.zero_grad()


def grad_acc_with_reduce_dtype(rank: int, world: int, ex: Expect,
                               reshard_after_forward: bool) -> None:
    """Upstream test_fully_shard_mixed_precision.py's test_grad_acc_with_reduce_dtype as it
    is now: bf16 compute, fp32 reduce, micro-batches without sync, and the full parameters
    kept after each backward but the last unless reshard_after_forward
    (set_reshard_after_backward(last or reshard_after_forward)). The unsharded gradients
    accumulate in fp32, each micro-batch's bf16 gradient upcast."""
    from tests.dist.fsdp2 import mp_training_workers as MP

    MP.grad_acc_with_reduce_dtype(rank, world, ex, reshard_after_forward,
                                  toggle_reshard_after_backward=True)


def interleaved_microbatches(rank: int, world: int, ex: Expect, reshard_after_forward: bool,
                             schedule: str) -> None:
    """A pipeline stage's schedules, beyond upstream's one-at-a-time 1F1B: several
    micro-batches' forwards are outstanding before their backwards run (separate graphs,
    separate backward calls). 'gpipe': F0 F1 F2 B0 B1 B2; '1f1b': F0 F1 B0 F2 B1 B2.
    Gradients are reduced on the last backward only; then one optimizer step."""
    torch.manual_seed(42)
    args = ModelArgs(vocab_size=23, max_seq_len=16)
    model = Transformer(args)
    ref = copy.deepcopy(model)
    for m in [*transformer_blocks(model), model]:
        _fully_shard(m, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    order = {"gpipe": ["F0", "F1", "F2", "B0", "B1", "B2"],
             "1f1b": ["F0", "F1", "B0", "F2", "B1", "B2"]}[schedule]
    for step in range(2):
        dp = DataParallelRef(ref, world)
        batches = [global_batch(10 * step + mb, world, tokens(23, 2, 16)) for mb in range(3)]
        losses: dict[int, torch.Tensor] = {}
        for op in order:
            mb = int(op[1])
            if op[0] == "F":
                losses[mb] = model(batches[mb][rank]).sum()
                continue
            last = mb == 2
            model.set_requires_gradient_sync(last)
            model.set_is_last_backward(last)
            losses[mb].backward()
            ref_losses = dp.step(batches[mb], _sum, sync=last)
            ex.close(losses[mb], ref_losses[rank], f"step {step} {op}: loss")
        check_sharded_parity(ex, ref, model, rank, world, f"step {step} before the optimizer")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    check_sharded_parity(ex, ref, model, rank, world, "after two steps", grads=False)


def accumulation_dtypes(rank: int, world: int, ex: Expect, offload: bool) -> None:
    """Upstream test_fully_shard_pending_grad.py's test_native_accumulation_dtypes, numbers
    only: bf16 compute without a reduce dtype. Reduced gradients add up in the fp32 sharded
    gradient; unsynchronized ones accumulate in bf16 first, so 256 + 1 rounds to 256
    before a later -256 (FSDP2 gives 1 and 3 below)."""
    model = nn.Linear(1, 2, bias=False)
    _fully_shard(model, mp_policy=sw.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                   offload_policy=sw.CPUOffloadPolicy(pin_memory=False) if offload else None)
    for contributions, expected in ((((True, 256), (False, 1), (True, -256)), 1.0),
                                    (((True, 3), (False, 256), (False, 1), (True, -256)), 3.0)):
        model.zero_grad(set_to_none=True)
        for sync, value in contributions:
            model.set_requires_gradient_sync(sync)
            model(torch.full((1, 1), float(value), dtype=torch.bfloat16)).sum().backward()
        g = model.weight.grad
        ex.true(g is not None and g.dtype == torch.float32, f"grad {g!r}")
        if g is not None:
            full = g.full_tensor() if isinstance(g, DTensor) else g
            ex.close(full, torch.full((2, 1), expected), f"{contributions}: accumulated grad",
                     rtol=0, atol=0)

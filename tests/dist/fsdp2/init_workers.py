"""Scenarios of upstream test_fully_shard_init.py: how parameters are sharded and owned,
lazy initialization of the root, meta-device initialization (through sw.materialize and
sw.load_full_state_dict), a 1-D mesh over a subgroup, parameters of several dtypes."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardwise as sw
from shardwise.engine.core.context import units_of
from shardwise.engine.core.dtensor import local_of
from tests.dist.fsdp2.common import (
    Expect,
    check_sharded_parity,
    global_batch,
    randn,
    ref_step,
    shard_rows,
    tokens,
    train_parity,
)
from tests.dist.fsdp2.common import sum_loss as _sum
from tests.dist.fsdp2.models import MLP, ModelArgs, Transformer, transformer_blocks


def shard_tensor_parameters(rank: int, world: int, ex: Expect) -> None:
    """Each rank holds torch.chunk(param, world)[rank] (or nothing), shared modules once."""
    for shared in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
        if shared:
            model[0].in_proj = model[1].in_proj
        orig = [p.detach().clone() for p in model.parameters()]
        sw.fully_shard(model)
        sharded = list(model.parameters())
        ex.true(len(sharded) == len(orig), f"shared={shared}: {len(sharded)} parameters, "
                                           f"expected {len(orig)}")
        for i, (o, p) in enumerate(zip(orig, sharded)):
            chunks = torch.chunk(o, world, dim=0)
            mine = chunks[rank] if rank < len(chunks) else o[:0]
            ex.close(local_of(p.detach()), mine, f"shared={shared}: parameter {i} local shard")


def raise_noncontiguous_parameter(rank: int, world: int, ex: Expect) -> None:
    """A channels-last Conv2d: refused at fully_shard, or sharded with correct numbers."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    try:
        sw.fully_shard(conv)
    except (ValueError, NotImplementedError, RuntimeError):
        return
    x = torch.randn(2, 8, 5, 5, generator=torch.Generator().manual_seed(1))
    ex.close(conv(x).sum(), ref(x).sum(), "output")
    conv(x).sum().backward()
    ref(x).sum().backward()
    check_sharded_parity(ex, ref, conv, rank, world, "channels_last conv")


def invalid_mesh_ndim(rank: int, world: int, ex: Expect) -> None:
    mesh = init_device_mesh("cpu", (world, 1, 1))
    try:
        sw.fully_shard(MLP(8), mesh=mesh)
        ex.true(False, "a 3-D mesh was accepted")
    except ValueError:
        pass


def _nested_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8), MLP(8))
    sw.fully_shard(model[0].in_proj)
    sw.fully_shard(model[0].out_proj)
    sw.fully_shard(model)  # the root gets model[1]
    return model


def is_root_and_fqns(rank: int, world: int, ex: Expect) -> None:
    """After the first forward: the root is the outermost unit; each unit owns the
    parameters of its module that no inner unit owns."""
    model = _nested_model()
    model(torch.randn(2, 8)).sum().backward()
    units = {u.name: u for u in units_of(model)}
    ex.true(set(units) == {"", "0.in_proj", "0.out_proj"}, f"units {sorted(units)}")
    ex.true([u.is_root for u in units.values()].count(True) == 1 and units[""].is_root,
            f"roots: {[n for n, u in units.items() if u.is_root]}")
    by_id = {id(p): n for n, p in model.named_parameters()}
    owned = {name: {by_id.get(id(sp.sharded), "?") for sp in u.params}
             for name, u in units.items()}
    expected = {"": {f"1.{m}.{k}" for m in ("in_proj", "out_proj") for k in ("weight", "bias")},
                "0.in_proj": {"0.in_proj.weight", "0.in_proj.bias"},
                "0.out_proj": {"0.out_proj.weight", "0.out_proj.bias"}}
    ex.true(owned == expected, f"ownership {owned}")


def double_lazy_init(rank: int, world: int, ex: Expect) -> None:
    """A forward through an inner unit first, then through the root: a clear error."""
    model = _nested_model()
    model[0].in_proj(torch.randn(2, 8))
    try:
        model(torch.randn(2, 8))
        ex.true(False, "no error when the root ran after an inner unit was initialized")
    except RuntimeError:
        pass


def managed_states_shared_params_and_buffers(rank: int, world: int, ex: Expect) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(8, with_buffer=True) for _ in range(3)])
    model[0].in_proj.weight = model[1].in_proj.weight
    model[2].in_proj.weight = model[1].in_proj.weight
    model[1].buffer = model[2].buffer
    ref = copy.deepcopy(model)
    sw.fully_shard(model)
    ex.true(len(list(model.parameters())) == len(list(ref.parameters())), "parameter count")
    train_parity(rank, world, ex, model, ref, randn(4, 8), _sum, "shared params", iters=3)


def managed_modules_duplicate(rank: int, world: int, ex: Expect) -> None:
    torch.manual_seed(0)
    mlp = MLP(8)
    model = nn.Sequential(mlp, mlp)
    ref = copy.deepcopy(model)
    sw.fully_shard(model)
    train_parity(rank, world, ex, model, ref, randn(4, 8), _sum, "duplicate module", iters=3)


def meta_device_1d_init(rank: int, world: int, ex: Expect, dim: int, mp: str,
                        under_meta: bool = False) -> None:
    """Built and sharded on the meta device, then sw.materialize: real shards, every
    parameter and buffer initialized, and a training step runs. dim=1 leaves some ranks
    with empty shards."""
    policy = (sw.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp == "bf16" else None)
    with torch.device("meta"):
        model = nn.Sequential(MLP(dim, dim_multiplier=1, with_buffer=True, bias=False),
                              MLP(dim, dim_multiplier=1, bias=False))
        if under_meta:
            for m in (model[0], model[1], model):
                sw.fully_shard(m, mp_policy=policy)
    if not under_meta:
        for m in (model[0], model[1], model):
            sw.fully_shard(m, mp_policy=policy)
    ex.true(all(p.is_meta for p in model.parameters()), "parameters left the meta device")
    sw.materialize(model)
    for n, p in model.named_parameters():
        ex.true(not p.is_meta and p.device.type == "cpu", f"{n} on {p.device}")
        if local_of(p).numel():
            ex.true(bool((local_of(p) != 0).any()), f"{n} was not initialized (all zeros)")
    for n, b in model.named_buffers():
        ex.true(not b.is_meta and bool((b != 0).any()), f"buffer {n} was not initialized")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, dim)).sum().backward()
    opt.step()


def meta_device_buffers_agree(rank: int, world: int, ex: Expect) -> None:
    """After sw.materialize, a replicated (unsharded) buffer is the same on every rank, so
    the ranks train one model. (An addition to upstream's meta-device test.)"""
    with torch.device("meta"):
        model = nn.Sequential(MLP(5, with_buffer=True), MLP(5))
    for m in (model[0], model[1], model):
        sw.fully_shard(m)
    sw.materialize(model)
    buf = model[0].buffer.detach().clone()
    got = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(got, buf)
    ex.true(all(torch.equal(g, got[0]) for g in got), "ranks initialized the buffer "
                                                      f"differently: {[g[:2] for g in got]}")


def invalid_meta_device_init(rank: int, world: int, ex: Expect) -> None:
    """A forward on parameters still on the meta device: an error naming them."""
    with torch.device("meta"):
        model = nn.Sequential(MLP(8, with_buffer=True), MLP(8))
    for m in (model[0], model[1], model):
        sw.fully_shard(m)
    try:
        model(torch.randn(4, 8))
        ex.true(False, "a forward on meta parameters did not raise")
    except (RuntimeError, ValueError) as e:
        ex.true("in_proj.weight" in str(e), f"the error does not name the meta parameters: "
                                            f"{type(e).__name__}: {str(e)[:200]}")


def rank0_broadcast_meta_device_init(rank: int, world: int, ex: Expect) -> None:
    """A meta-device model loaded from rank 0's full state dict by broadcast."""
    args = ModelArgs()
    torch.manual_seed(42)
    ref = Transformer(args)
    full_sd = ref.state_dict() if rank == 0 else None
    with torch.device("meta"):
        model = Transformer(args)
    for m in [*transformer_blocks(model), model]:
        sw.fully_shard(m)
    ex.true(all(p.is_meta for p in model.parameters()), "parameters left the meta device")
    sw.load_full_state_dict(model, full_sd, from_rank0=True)
    ex.true(not any(p.is_meta for p in model.parameters()), "parameters still on meta")
    for k, v in sw.full_state_dict(model).items():
        ex.close(v, ref.state_dict()[k], f"{k} after the broadcast")
    xs = global_batch(3, world, tokens(args.vocab_size, 2, 13))
    loss = model(xs[rank]).sum()
    loss.backward()
    ex.close(loss, ref_step(ref, xs, _sum)[rank], "loss")
    check_sharded_parity(ex, ref, model, rank, world, "after one backward")


def process_group_init_1d(rank: int, world: int, ex: Expect) -> None:
    """fully_shard over a 1-D mesh built from a process group (DeviceMesh.from_group). At 4
    ranks two subgroups {0, 2} and {1, 3} each train their own data."""
    if world == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        members = [r for r in range(world) if r % 2 == rank % 2]
        group, seed = groups[rank % 2], rank % 2
    else:
        group, members, seed = dist.new_group(list(range(world))), list(range(world)), 0
    mesh = DeviceMesh.from_group(group, "cpu")
    me, size = members.index(rank), len(members)
    torch.manual_seed(42)
    model = MLP(8)
    ref = copy.deepcopy(model)
    for m in (model.in_proj, model.out_proj, model):
        sw.fully_shard(m, mesh=mesh)
    xs = global_batch(10 + seed, size, randn(4, 8))
    loss = model(xs[me]).sum()
    loss.backward()
    ex.close(loss, ref_step(ref, xs, _sum)[me], "loss")
    check_sharded_parity(ex, ref, model, me, size, "subgroup mesh")
    for n, p in model.named_parameters():
        ex.close(local_of(p.detach()),
                 shard_rows(dict(ref.named_parameters())[n].detach(), me, size), n)


def bf16_nested_units_step(rank: int, world: int, ex: Expect) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    policy = sw.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for m in [*model, model]:
        sw.fully_shard(m, mp_policy=policy)
        ex.true(isinstance(m, sw.ShardedModule), f"{type(m).__name__} is not a ShardedModule")
    model(torch.randn(8, 16)).sum().backward()
    ex.true(all(p.grad is not None for p in model.parameters()), "missing gradients")


def mixed_dtypes_no_grad_param(rank: int, world: int, ex: Expect) -> None:
    """A frozen bf16 parameter next to a trainable fp32 one in one unit; forward returns
    None and uses neither."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_low = nn.Parameter(torch.zeros((7, 5), dtype=torch.bfloat16),
                                      requires_grad=False)
            self.w_fp32 = nn.Parameter(torch.zeros((7, 5)))

        def forward(self, inp: object) -> None:
            return None

    model = Model()
    sw.fully_shard(model)
    ex.true(model(0) is None, "forward output")

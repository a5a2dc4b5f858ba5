"""Issue 14: FSDP2's module methods and policy objects on a sharded module (2 ranks)."""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.tensor import DTensor

import shardwise as sw
from tests.dist.dtensor_workers import backward, close, make, ref_backward, shard


def _raises(fn: object, *words: str) -> None:
    try:
        fn()  # type: ignore[operator]
    except (ValueError, NotImplementedError) as e:
        for w in words:
            assert w in str(e), (w, str(e))
        return
    raise AssertionError(f"expected an error mentioning {words}")


def api(rank: int, world: int) -> None:
    # Refused with a clear error: an int reshard_after_forward that is not a divisor of the
    # shard group (resharding to a proper sub-group is refused too, at 4+ ranks).
    m = make(0)
    _raises(lambda: sw.fully_shard(m[0], reshard_after_forward=3),
            "reshard_after_forward=3", "divisor")

    # PyTorch's own policy objects are accepted and mean what they mean there.
    m = make(0)
    sw.fully_shard(m[0], mp_policy=TorchMP(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32),
                   offload_policy=TorchOffload(pin_memory=False))
    u = m[0]._sw_unit
    assert u.mp.param_dtype == torch.bfloat16 and u.mp.reduce_dtype == torch.float32
    # The unit keeps no offload policy (it only decides where shards live, at sharding):
    # check what torch's policy translates to.
    assert sw.CPUOffloadPolicy.parse(TorchOffload(pin_memory=False)) == \
        sw.CPUOffloadPolicy(params=True, pin_memory=False)

    model = make(0)
    ref = copy.deepcopy(model)
    shard(model)
    lin = model[0]
    # unshard(async_op=True) -> handle; wait() puts the full parameter on the module.
    handle = lin.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    assert not isinstance(lin.weight, DTensor) and lin.weight.shape == (7, 5)
    close(lin.weight, ref[0].weight, "unsharded weight")
    lin.reshard()
    assert isinstance(lin.weight, DTensor)
    assert lin.unshard() is None and not isinstance(lin.weight, DTensor)
    lin.reshard()

    # set_reshard_after_forward(False): full parameters stay from forward to backward.
    lin.set_reshard_after_forward(False)
    x = torch.randn(2, 5)
    out = model(x)
    assert not isinstance(lin.weight, DTensor)
    out.sum().backward()
    assert isinstance(lin.weight, DTensor)
    lin.set_reshard_after_forward(True)
    model.zero_grad()

    # set_reshard_after_backward(False): full parameters stay after backward.
    model.set_reshard_after_backward(False)
    backward(model, 0, rank, world)
    assert not isinstance(lin.weight, DTensor), "kept unsharded after backward"
    model.set_reshard_after_backward(True)
    model.reshard()
    for mod in model.modules():
        if getattr(mod, "_sw_unit", None) is not None:
            mod.reshard()
    model.zero_grad()

    # set_gradient_divide_factor(1.0) on every unit (not recursive, as in FSDP2): the sum
    # over ranks instead of the mean.
    for mod in model.modules():
        if isinstance(mod, sw.ShardedModule):
            mod.set_gradient_divide_factor(1.0)
    backward(model, 0, rank, world)
    ref_backward(ref, 0)
    refp = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        close(p.grad, refp[name].grad * world, f"summed grad {name}")
    model.zero_grad()

    # Accepted FSDP2 calls with nothing to change here, and their checks.
    model.set_requires_all_reduce(True)
    model.set_requires_all_reduce(False)  # no replicas: nothing to skip
    model.set_is_last_backward(True)
    model.set_modules_to_forward_prefetch([model[2]])
    model.set_modules_to_backward_prefetch([model[0]])
    _raises(lambda: model.set_modules_to_forward_prefetch([model[1]]), "Tanh")
    _raises(lambda: model.set_requires_gradient_sync("no"), "requires_gradient_sync")

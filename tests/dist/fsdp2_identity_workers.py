"""Issue 22: shardwise modules are torch FSDPModules; FSDP2's API on them, run side by side
with torch's own FSDP2 on the same code and against an unsharded reference.

Every rank trains on its slice of one global batch of 12 samples; dim-0 sizes do not divide
the world size (7 rows at 2 and 3 ranks) and the head has 2 rows (an empty shard at 3).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register
from torch.distributed.tensor import DTensor

import shardwise as sw
from tests.dist.fsdp2.common import record_collectives

BATCH = 12
TOL = 1e-5
IMPLS: dict[str, Callable[..., Any]] = {"fsdp2": torch_fully_shard, "shardwise": sw.fully_shard}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(5, 7), nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 5)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        h = self.norm(h)
        return h if skip_head else self.head(h)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """A second forward method on the root (ViT's forward_features)."""
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)


def make() -> Net:
    torch.manual_seed(0)
    return Net()


def shard(model: Net, fs: Callable[..., Any], **kw: Any) -> Net:
    """torchtitan's shape: blocks, then [norm, head] as one unit, then the root."""
    for b in model.blocks:
        fs(b, **kw)
    fs([model.norm, model.head], **kw)
    fs(model, **kw)
    return model


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)


def mine(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = BATCH // world
    return t[rank * n:(rank + 1) * n]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def close_all(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str,
              tol: float = TOL) -> None:
    assert got.keys() == want.keys(), f"{what}: {sorted(got)} != {sorted(want)}"
    for k in want:
        close(got[k], want[k], f"{what} {k}", tol)


# --- torchtitan's gradient-division contract and the chunked loss -------------------------


def _sum_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # torchtitan divides by the global count itself and turns FSDP's division off.
    return ((out - y) ** 2).sum() / (BATCH * 2)


def divide_factor_and_list_form(rank: int, world: int, chunked: bool) -> None:
    """`isinstance(m, FSDPModule)` holds on every shardwise unit; torchtitan's loop turns
    division off; the loss is divided by the global count. Gradients equal the unsharded
    reference's and FSDP2's, with [norm, head] as one unit (chunked: the head runs per chunk
    outside the root's forward)."""
    ref = make()
    results: dict[str, list[dict[str, torch.Tensor]]] = {}
    for name, fs in IMPLS.items():
        model = shard(make(), fs)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        assert len(units) == 5, f"{name}: {len(units)} FSDPModules (blocks, norm, head, root)"
        for m in model.modules():  # torchtitan's disable_fsdp_gradient_division
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                # torchtitan's non-NCCL variant: gloo has no PREMUL_SUM for FSDP2 to use.
                m.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for step in range(3):
            x, y = data(step)
            xm, ym = mine(x, rank, world), mine(y, rank, world)
            if chunked:
                h = model(xm, skip_head=True)
                loss = sum(_sum_loss(model.head(hc), yc)
                           for hc, yc in zip(h.chunk(2), ym.chunk(2)))
            else:
                loss = _sum_loss(model(xm), ym)
            loss.backward()
            steps.append(grads(model))
            opt.step()
            opt.zero_grad()
        steps.append({n: full(p.detach()).clone() for n, p in model.named_parameters()})
        results[name] = steps
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = data(step)
        _sum_loss(ref(x), y).backward()
        want = grads(ref)
        for name, steps in results.items():
            close_all(steps[step], want, f"{name} step {step} grad")
        ref_opt.step()
        ref_opt.zero_grad()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    for name, steps in results.items():
        close_all(steps[-1], want, f"{name} final params")
    close_all(results["shardwise"][0], results["fsdp2"][0], "shardwise vs FSDP2 grads", 1e-6)


# --- state_dict between forward and backward, explicit reshard_after_forward on the root --


def state_dict_mid_step(rank: int, world: int) -> None:
    """model.state_dict() after a forward that kept parameters (and always the root's)
    gives DTensor shards, as FSDP2's hooks do; the backward that follows is unaffected."""
    ref = make()
    x, y = data(0)
    _sum_loss(ref(x), y).backward()  # each rank's loss * world, averaged over ranks
    for name, fs in IMPLS.items():
        for raf in (None, False, True):
            model = shard(make(), fs, reshard_after_forward=raf)
            loss = _sum_loss(model(mine(x, rank, world)), mine(y, rank, world)) * world
            sd = model.state_dict()
            bad = [k for k, v in sd.items() if not isinstance(v, DTensor)]
            assert not bad, f"{name} raf={raf}: plain tensors {bad} between forward/backward"
            for k, v in sd.items():
                close(v.full_tensor(), ref.state_dict()[k], f"{name} raf={raf} {k}")
            loss.backward()
            close_all(grads(model), grads(ref), f"{name} raf={raf} grads after state_dict")
    # An explicit True reshards the root after forward, as torch 2.13's FSDP2 does.
    for name, fs in IMPLS.items():
        for raf, want in ((None, False), (True, True)):
            model = shard(make(), fs, reshard_after_forward=raf)
            model(mine(x, rank, world))
            sharded = isinstance(model.emb.weight, DTensor)
            assert sharded == want, f"{name} raf={raf}: root sharded after forward {sharded}"


# --- the FSDPModule methods shardwise implements -------------------------------------


def _train_step(model: Net, rank: int, world: int, step: int = 0) -> dict[str, torch.Tensor]:
    x, y = data(step)
    nn.functional.mse_loss(model(mine(x, rank, world)), mine(y, rank, world)).backward()
    g = grads(model)
    model.zero_grad()
    return g


def _ref_grads(step: int = 0) -> dict[str, torch.Tensor]:
    ref = make()
    x, y = data(step)
    nn.functional.mse_loss(ref(x), y).backward()
    return grads(ref)


def comm_methods(rank: int, world: int) -> None:
    want = _ref_grads()
    # set_all_reduce_hook: sees the reduced flat shard (divided, or the sum with
    # set_force_sum_reduction_for_comms(True)); in-place changes reach the gradients.
    for force_sum in (False, True):
        seen: dict[str, list[torch.Tensor]] = {}
        for name, fs in IMPLS.items():
            model = shard(make(), fs)
            log = seen[name] = []

            def hook(t: torch.Tensor, log: list = log) -> None:
                log.append(t.clone())
                t.mul_(2.0)

            model.blocks[0].set_force_sum_reduction_for_comms(force_sum)
            model.blocks[0].set_all_reduce_hook(hook)
            g = _train_step(model, rank, world)
            for k, v in want.items():
                scale = 2.0 if k.startswith("blocks.0.") else 1.0
                close(g[k], v * scale, f"{name} force_sum={force_sum} hook-doubled {k}")
        assert len(seen["shardwise"]) == len(seen["fsdp2"]) == 1
        close(seen["shardwise"][0], seen["fsdp2"][0], f"force_sum={force_sum} hook input")

    # set_reduce_scatter_divide_factor (deprecated alias, DeprecationWarning in both).
    for name, fs in IMPLS.items():
        model = shard(make(), fs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    m.set_reduce_scatter_divide_factor(world * 2.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
                assert any(issubclass(x.category, DeprecationWarning) for x in w), name
        g = _train_step(model, rank, world)
        close_all(g, {k: v / 2 for k, v in want.items()}, f"{name} divide factor 2*world")

    # set_custom_all_gather / set_custom_reduce_scatter: FSDP2's Comm protocol objects.
    counts: dict[str, list[int]] = {}
    for name, fs in IMPLS.items():
        model = shard(make(), fs)
        ag, rs = _CountingAllGather(), _CountingReduceScatter()
        model.blocks[1].set_custom_all_gather(ag)
        model.blocks[1].set_custom_reduce_scatter(rs)
        close_all(_train_step(model, rank, world), want, f"{name} custom comms")
        counts[name] = [ag.calls, rs.calls]
    assert counts["shardwise"] == counts["fsdp2"] and counts["shardwise"][1] == 1, counts

    # set_unshard_in_backward(False) on a unit whose backward needs no parameter values is
    # FSDP2's expert knob; here on the root's own parameters only when they were resharded.
    for name, fs in IMPLS.items():
        model = shard(make(), fs, reshard_after_forward=True)
        model.set_unshard_in_backward(False)
        x, y = data(0)
        out = model(mine(x, rank, world))
        with record_collectives() as log:
            nn.functional.mse_loss(out, mine(y, rank, world)).backward()
        if name == "shardwise":
            gathered = [label for op, label, _, _ in log if op == "all_gather"]
            assert "<root>" not in gathered, gathered
        # The root's emb weight is needed in backward only for its input's gradient, which
        # needs none: its gradient (from the saved input) is still right.
        close(full(model.emb.weight.grad), want["emb.weight"], f"{name} emb grad")


class _CountingAllGather:
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor,
                                                        group=group, async_op=async_op)


class _CountingReduceScatter(_CountingAllGather):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,  # type: ignore[override]
                 group: Any, op: Any, async_op: bool = False) -> Any:
        self.calls += 1
        # gloo has no AVG: FSDP2 passes AVG for fp32 by default, shardwise always SUM.
        avg = op == torch.distributed.ReduceOp.AVG
        work = torch.distributed.reduce_scatter_tensor(
            output_tensor, input_tensor, op=torch.distributed.ReduceOp.SUM, group=group)
        if avg:
            output_tensor.div_(group.size())
        return None if not async_op else work


def forward_methods_and_reset(rank: int, world: int) -> None:
    """register_fsdp_forward_method (torch's and shardwise's) on the root's second forward
    method (ViT's forward_features) matches FSDP2 and the reference; reset_iter_state
    after a forward that raised; fully_shard.state; share_comm_ctx."""
    ref = make()
    x, _ = data(0)
    ref.features(x).pow(2).mean().backward()
    want = grads(ref)
    combos = (("fsdp2", torch_fully_shard, torch_register),
              ("shardwise+torch's register", sw.fully_shard, torch_register),
              ("shardwise", sw.fully_shard, sw.register_fsdp_forward_method))
    for label, fs, register in combos:
        model = shard(make(), fs)
        register(model, "features")
        for _ in range(2):
            model.features(mine(x, rank, world)).pow(2).mean().backward()
            close_all(grads(model), want, label)
            model.zero_grad()
    sw.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # unsharded: a no-op

    # reset_iter_state: a forward that raised in the middle leaves units gathered; after
    # the reset the next step matches the reference.
    model = shard(make(), sw.fully_shard)
    boom = model.blocks[1].register_forward_pre_hook(_raise)
    try:
        model(mine(x, rank, world))
    except ZeroDivisionError:
        pass
    boom.remove()
    try:
        model.blocks[0].reset_iter_state()
    except RuntimeError as e:
        assert "root" in str(e)
    else:
        raise AssertionError("reset_iter_state on a non-root unit was accepted")
    model.reset_iter_state()
    close_all(_train_step(model, rank, world), _ref_grads(), "after reset_iter_state")

    # set_post_optim_event: the next root forward waits on it once, then drops it.
    event = _Event()
    model.set_post_optim_event(event)
    _train_step(model, rank, world)
    _train_step(model, rank, world)
    assert event.waited == 1, event.waited
    # Knobs accepted with nothing to change, and the one refused.
    model.set_reduce_scatter_unused_params(True)
    model.set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group(True)
    model.set_allocate_memory_from_process_group_for_comm(True)
    model._set_unshard_async_op(True)
    try:
        model.set_symm_mem_for_comm()
    except NotImplementedError as e:
        assert "symmetric memory" in str(e)
    else:
        raise AssertionError("set_symm_mem_for_comm was accepted")
    close_all(_train_step(model, rank, world), _ref_grads(), "after the accepted knobs")

    st = sw.fully_shard.state(model.blocks[0])
    assert st is model.blocks[0]._get_fsdp_state() and not st.is_root
    assert sw.fully_shard.state(model).is_root and sw.fully_shard.state(model.blocks) is None
    assert sw.fully_shard.state(model.norm) is sw.fully_shard.state(model.head)
    other = shard(make(), sw.fully_shard)
    sw.share_comm_ctx([model, other])
    try:
        sw.share_comm_ctx([model, nn.Linear(2, 2)])
    except ValueError as e:
        assert "sharded" in str(e)
    else:
        raise AssertionError("share_comm_ctx accepted an unsharded module")


class _Event:
    """torch.Event's surface as set_post_optim_event uses it, counting waits."""

    def __init__(self) -> None:
        self.waited = 0

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        self.waited += 1


def _raise(module: nn.Module, args: Any) -> None:
    raise ZeroDivisionError("a forward that fails midway")

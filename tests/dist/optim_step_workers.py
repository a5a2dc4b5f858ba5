"""Issue 23's optimizer cases, kept after the optimizer fast path went (issue 35).

The same sharded model is stepped by torch's optimizer class and by a subclass of it (which the
old fast path left alone, so the two once took different paths), and an unsharded copy by the
same optimizer in one process: both must agree exactly, match the unsharded reference to
1e-6, and leave per-parameter DTensor state behind.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from tests.dist.dtensor_workers import backward, make, ref_backward, shard

TOL = 1e-6


def _via_dtensor(cls: type) -> type:
    return type(f"DTensor{cls.__name__}", (cls,), {})  # not an exact torch class: no fast path


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _optimizers(name: str, fast: list, slow: list, ref: list):
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}[name]
    kw = {"lr": 0.05, "momentum": 0.9} if name == "SGD" else {"lr": 0.05}
    if name == "Adam":
        kw["amsgrad"] = True
    return cls(fast, **kw), _via_dtensor(cls)(slow, **kw), cls(ref, **kw)


def matches_dtensor_and_reference(rank: int, world: int, name: str) -> None:
    model = make(0)
    ref = copy.deepcopy(model)
    slow_model = shard(copy.deepcopy(model))
    model = shard(model)
    fast, slow, reference = _optimizers(name, list(model.parameters()),
                                        list(slow_model.parameters()), list(ref.parameters()))
    for step in range(4):
        for m in (model, slow_model):
            backward(m, step, rank, world)
        ref_backward(ref, step)
        if step == 2:  # a parameter without a gradient this step: every optimizer skips it
            for m in (model, slow_model, ref):
                m[0].bias.grad = None
        fast.step()
        slow.step()
        reference.step()
        for o in (fast, slow, reference):
            o.zero_grad()
    for (n, p), q, r in zip(model.named_parameters(), slow_model.parameters(),
                            ref.parameters()):
        assert isinstance(p, DTensor), n
        assert torch.equal(p.to_local(), q.to_local()), f"{name} {n}: fast path != DTensor"
        diff = (_full(p).detach() - r.detach()).abs().max().item()
        assert diff <= TOL, f"{name} {n}: differs from the unsharded step by {diff}"
        st, sq = fast.state[p], slow.state[q]
        assert st.keys() == sq.keys(), (st.keys(), sq.keys())
        for k, v in st.items():
            assert type(v) is type(sq[k]), (n, k, type(v), type(sq[k]))
            if isinstance(v, DTensor):
                assert v.placements == sq[k].placements
                assert torch.equal(v.to_local(), sq[k].to_local()), (n, k)
        # No alias of the gradient survives the step (zero_grad must be able to free it).
        sp = p._sw_param
        assert getattr(sp, "_opt_face", None) is None or sp._opt_face.grad is None
    # The optimizer's params are the DTensors again: state_dict round-trips.
    sd = fast.state_dict()
    fast.load_state_dict(sd)
    assert all(isinstance(p, DTensor) for g in fast.param_groups for p in g["params"])


def closure_and_failed_step(rank: int, world: int) -> None:
    """A closure keeps DTensor dispatch; a step that raises leaves the optimizer whole."""
    model = shard(make(0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        backward(model, 0, rank, world)
        return torch.zeros(())

    opt.step(closure)
    assert all(isinstance(v, DTensor) for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)

    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("boom")

    backward(model, 1, rank, world)
    handle = opt.register_step_pre_hook(broken)  # runs after the fast path's global pre-hook
    try:
        opt.step()
    except RuntimeError:
        pass
    handle.remove()
    opt.step()  # restores the interrupted swap first, then steps normally
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    assert all(isinstance(k, DTensor) for k in opt.state)

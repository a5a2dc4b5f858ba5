"""Issue 41 part 3: hooks as FSDP2 has them, run side by side with torch's own FSDP2 on the
same code and against an unsharded reference.

- optimizer in backward (PyTorch's recipe): one optimizer per parameter, stepped from
  `register_post_accumulate_grad_hook`, no `opt.step()`; the hooks must run once per step
  on each sharded parameter after its reduced gradient is written (before: never on a
  sharded parameter; under NO_SHARD on the local, unreduced gradient);
- all-gather extension hooks patched onto the shards after the first step gather from the
  next one on (shardwise asked at the first forward only).

Every rank trains on its slice of one global batch of 12 samples; dim-0 sizes do not divide
the world size (7 rows at 2 and 3 ranks) and the head has 2 rows (an empty shard at 3).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise as sw
from tests.dist.fsdp2_identity_workers import BATCH, Net

STEPS = 3


def _full(p: torch.Tensor) -> Any:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().tolist()


def _shard(model: Net, impl: str) -> Net:
    if impl == "fsdp2":
        for b in model.blocks:
            torch_fully_shard(b)
        torch_fully_shard(model)
    elif impl == "shardwise":
        for b in model.blocks:
            sw.fully_shard(b)
        sw.fully_shard(model)
    elif impl == "shardwise NO_SHARD":
        sw.shard_model(model, sharding_strategy="NO_SHARD", auto_wrap_policy=None)
    elif impl != "unsharded":
        raise ValueError(impl)
    return model


def optimizer_in_backward(rank: int, world: int, impl: str) -> dict[str, Any]:
    """Train STEPS steps with AdamW per parameter, stepped (and its gradient freed) from the
    parameter's post-accumulate-grad hook. Returns the hook calls and the full parameters."""
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    params = list(model.parameters())
    opts = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in params}
    calls = [0]

    def step(p: torch.Tensor) -> None:
        calls[0] += 1
        opts[p].step()  # type: ignore[index]
        opts[p].zero_grad()  # type: ignore[index]

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 4, generator=g)
        n = BATCH // world if impl != "unsharded" else BATCH
        mine = x[rank * n:(rank + 1) * n] if impl != "unsharded" else x
        model(mine).square().mean().backward()
    return {"calls": calls[0], "n_params": len(params),
            "grads_left": sum(p.grad is not None for p in params),
            "params": {k: _full(v) for k, v in model.named_parameters()}}


class _Hooked:
    """All-gather hooks (the legacy one-argument form) that gather the shard padded to equal
    rows on every rank, as it is, and count their calls."""

    def __init__(self) -> None:
        self.pre = self.post = 0

    def patch(self, local: torch.Tensor, rows: int) -> None:
        def pre(mesh: Any) -> tuple[tuple[torch.Tensor, ...], None]:
            self.pre += 1
            chunk = -(-rows // mesh.size())
            pad = local.new_zeros((chunk - local.shape[0], *local.shape[1:]))
            return (torch.cat([local, pad]),), None

        def post(outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                 *, out: torch.Tensor | None = None) -> Any:
            self.post += 1
            if out is not None:
                return None  # refreshed in place: `out` views the output
            return outputs[0][:rows], (outputs[0],)

        local.fsdp_pre_all_gather = pre  # type: ignore[attr-defined]
        local.fsdp_post_all_gather = post  # type: ignore[attr-defined]


def extension_patched_after_first_step(rank: int, world: int, impl: str) -> dict[str, Any]:
    """One SGD step, then FSDP2's monkey-patch recipe on the blocks' weights (their shards'
    local tensors get fsdp_pre/post_all_gather), then two more steps. Returns the hook calls
    and the losses."""
    torch.manual_seed(0)
    model = _shard(Net(), impl)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = _Hooked()
    g = torch.Generator().manual_seed(2)
    losses = []
    for step in range(STEPS):
        if step == 1:
            for b in model.blocks:
                for lin in (b.lin1, b.lin2):
                    hooked.patch(lin.weight._local_tensor,  # type: ignore[union-attr]
                                 lin.weight.shape[0])
        x = torch.randn(BATCH, 4, generator=g)
        n = BATCH // world
        loss = model(x[rank * n:(rank + 1) * n]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"pre": hooked.pre, "post": hooked.post, "losses": losses,
            "params": {k: _full(v) for k, v in model.named_parameters()}}


def unsharded_reference(rank: int, world: int) -> dict[str, Any]:
    """The plain model trained with one optimizer on the whole batch (SGD, for the
    extension case)."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 4, generator=g)
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().tolist() for k, v in ref.named_parameters()}


def run_all(rank: int, world: int, case: str, impls: list[str]) -> dict[str, Any]:
    fn = {"optimizer_in_backward": optimizer_in_backward,
          "extension_patched": extension_patched_after_first_step}[case]
    out = {impl: fn(rank, world, impl) for impl in impls}
    if case == "extension_patched":
        out["unsharded"] = {"params": unsharded_reference(rank, world)}
    return out


# --- unused-gradient counts after a backward that raised ----------------------------------


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Parameter(torch.ones(4))  # used where `use_extra` says
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y + self.extra if self.use_extra else y


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fail: bool) -> torch.Tensor:
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.fail:
            raise RuntimeError("backward failed on purpose")
        return g, None


class _Stack(torch.nn.Module):
    """Three layer units; the input's own backward (after every unit's) may raise."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _RaiseInBackward.apply(x, self.fail)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def stale_unused_counts(rank: int, world: int, recover: str) -> dict[str, Any]:
    """Step 1 raises in backward after the last layer's reduction finished (3 pending > 2),
    where rank 0 alone used `layers.2.extra` (its count is kept for the end of backward,
    which never comes); `recover` ("reset_iter_state" or "none") then step 2 uses it on no
    rank: its gradient must be None, as unsharded, and the others equal unsharded's."""
    torch.manual_seed(0)
    model = _Stack()
    ref = copy.deepcopy(model)
    for layer in model.layers:
        sw.fully_shard(layer)
    sw.fully_shard(model)
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(1))
    mine = x[2 * rank: 2 * rank + 2].clone().requires_grad_()
    model.fail = True
    model.layers[2].use_extra = rank == 0
    raised = False
    try:
        model(mine).backward()
    except RuntimeError:
        raised = True
    if recover == "reset_iter_state":
        model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    model.fail = False
    model.layers[2].use_extra = False
    model(x[2 * rank: 2 * rank + 2].clone().requires_grad_()).backward()
    (ref(x.clone().requires_grad_()) / world).backward()
    extra = model.layers[2].extra.grad
    ref_params = dict(ref.named_parameters())
    diff = 0.0
    for n, p in model.named_parameters():
        want = ref_params[n].grad
        if (p.grad is None) != (want is None):
            diff = float("inf")  # a gradient where unsharded has none, or the reverse
        elif want is not None:
            diff = max(diff, float((torch.tensor(_full(p.grad)) - want).abs().max()))
    return {"raised": raised, "extra grad": None if extra is None else _full(extra),
            "diff": diff}

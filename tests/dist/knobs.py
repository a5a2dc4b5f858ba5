"""Workers for the engine's knobs: mixed precision, hybrid sharding, accumulation, meta init."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

import shardwise as sw
from shardwise.observe.sinks import ListSink, attach_sink
from tests.dist.parity import grads_of
from tests.models import loss_fn, make_batch, make_model

PER_RANK = 4


def _train_pair(rank: int, world: int, model: nn.Module, ref: nn.Module, steps: int,
                kind: str = "lm", seed: int = 7, scaler: object | None = None,
                lr: float = 1e-2) -> tuple[float, float]:
    """Train sharded `model` and unsharded `ref` side by side; return (max param diff, loss)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for step in range(steps):
        x, y = make_batch(kind, seed * 100 + step, PER_RANK * world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = loss_fn(kind, model(x[mine]).float(), y[mine])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        loss_fn(kind, ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = sw.full_state_dict(model)
    worst = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return worst, loss.item()


def _pair(kind: str = "lm", seed: int = 0) -> tuple[nn.Module, nn.Module]:
    model = make_model(kind, seed)
    ref = copy.deepcopy(model)
    if kind == "lm":
        ref.head.weight = ref.embed.weight
    return model, ref


def mixed_precision(rank: int, world: int) -> dict[str, float]:
    out = {}
    for preset in ("bf16", "fp16"):
        model, ref = _pair()
        sw.shard_model(model, auto_wrap_policy="transformer", mixed_precision=preset)
        assert all(p.dtype == torch.float32 for p in model.parameters()), "masters must be fp32"
        sink = ListSink()
        attach_sink(model, sink)
        # A modest initial scale: 2**16 overflows fp16 gradients here and skips the first steps.
        scaler = sw.ShardedGradScaler(init_scale=2.0**8) if preset == "fp16" else None
        worst, _ = _train_pair(rank, world, model, ref, steps=4, scaler=scaler)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(p.grad is None for p in model.parameters())
        # All-gathers moved 2-byte elements: half of what fp32 would.
        ag = [e for e in sink.events if e.collective == "all_gather"]
        if world > 1:
            assert ag, "no all-gather events"
        plan = sw.precision_plan(model)
        assert f"compute {preset}" in plan and "master weights fp32" in plan, plan
        out[preset] = worst
    return out


def bf16_matches_emulated_reference(rank: int, world: int) -> dict[str, float]:
    """bf16 compute with fp32 reduction against a reference that emulates it exactly.

    The reference (tests/dist/fsdp2/mp_training_workers.Reference) runs each rank's slice on
    a bf16 copy, sums the ranks' fp32-cast gradients and divides, and steps fp32 masters. So
    gradients, the global norm and parameters are compared at fp32 tolerances: a wrong cast,
    a reduction in bf16 or a lost gradient shows here, where a comparison with an fp32 run
    would need a tolerance as large as what the optimizer moves.
    """
    from tests.dist.fsdp2.mp_training_workers import Reference

    model = make_model("lm", 0)
    ref = Reference(model, torch.bfloat16, torch.float32, world)
    sw.shard_model(model, auto_wrap_policy="transformer", mixed_precision="bf16")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss_of(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_fn("lm", m(b[0]).float(), b[1])

    worst = {"grad": 0.0, "norm": 0.0, "param": 0.0}
    for step in range(4):
        x, y = make_batch("lm", 700 + step, PER_RANK * world)
        batches = [(x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK])
                   for r in range(world)]
        loss_of(model, batches[rank]).backward()
        ref.step(batches, loss_of)
        got = grads_of(model)  # fqn -> (full gradient, whether this rank's shard had none)
        has_grad = {n: p.grad is not None for n, p in model.named_parameters()}
        for n, p in ref.master.named_parameters():
            assert has_grad[n] == (p.grad is not None), f"{n}: gradient presence differs"
            if p.grad is None:
                continue
            d = (got[n][0] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-12)
            worst["grad"] = max(worst["grad"], d)
        norm = sw.clip_grad_norm_(model, 1e9).item()
        want = torch.nn.utils.clip_grad_norm_(ref.master.parameters(), 1e9).item()
        worst["norm"] = max(worst["norm"], abs(norm - want) / want)
        opt.step()
        opt.zero_grad()
        ref.optimizer_step(set_to_none=True)
    full = sw.full_state_dict(model)
    worst["param"] = max((full[n] - p.detach()).abs().max().item()
                         for n, p in ref.master.named_parameters())
    return worst


def precision_plans(rank: int, world: int) -> dict[str, str]:
    """sw.precision_plan under FULL_SHARD and NO_SHARD with fp16 compute."""
    out = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        model, _ = _pair()
        sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer",
                       mixed_precision="fp16")
        out[strategy] = sw.precision_plan(model)
    return out


def traffic_bytes(rank: int, world: int, preset: str | None) -> int:
    model, _ = _pair()
    sw.shard_model(model, auto_wrap_policy="transformer", mixed_precision=preset)
    sink = ListSink()
    attach_sink(model, sink)
    x, y = make_batch("lm", 1, PER_RANK)
    loss_fn("lm", model(x).float(), y).backward()
    return sum(e.bytes for e in sink.events if e.collective == "all_gather")


def mixed_dtypes(rank: int, world: int) -> float:
    """A model whose parameters are not all one dtype: bf16 and fp32 units side by side."""
    model, ref = _pair("mlp")
    model.fc2.to(torch.bfloat16)
    ref.fc2.to(torch.bfloat16)

    class Cast(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x.to(self.inner.weight.dtype)).float()

    model.fc2, ref.fc2 = Cast(model.fc2), Cast(ref.fc2)
    sw.shard_model(model, auto_wrap_policy=None)
    assert {p.dtype for p in model.parameters()} == {torch.float32, torch.bfloat16}
    worst, _ = _train_pair(rank, world, model, ref, steps=3, kind="mlp")
    return worst


def hybrid(rank: int, world: int, use_mesh: bool) -> float:
    model, ref = _pair()
    mesh = None
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    sw.shard_model(model, sharding_strategy="HYBRID_SHARD", auto_wrap_policy="transformer",
                   mesh=mesh)
    sizes = {sp.shard_size for sp in sw_sharded(model)}
    assert sizes == {world // 2}, sizes
    worst, _ = _train_pair(rank, world, model, ref, steps=3)
    norm_model, norm_ref = _pair(seed=3)
    sw.shard_model(norm_model, sharding_strategy="HYBRID_SHARD", mesh=mesh)
    x, y = make_batch("lm", 5, PER_RANK * world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss_fn("lm", norm_model(x[mine]), y[mine]).backward()
    loss_fn("lm", norm_ref(x), y).backward()
    total = sw.clip_grad_norm_(norm_model, 1e9)
    expect = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in norm_ref.parameters() if p.grad is not None]))
    assert abs(total.item() - expect.item()) < 1e-5, (total, expect)
    return worst


def sw_sharded(model: nn.Module) -> list:
    from shardwise.engine.core.context import sharded_params

    return sharded_params(model)


def accumulation(rank: int, world: int) -> dict[str, float]:
    """k micro-batches under no_sync (loss / k) == one batch k times larger."""
    out = {}
    k = 3
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for style in ("context", "setter"):
            model, ref = _pair()
            sw.shard_model(model, sharding_strategy=strategy, auto_wrap_policy="transformer")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            for step in range(2):
                x, y = make_batch("lm", 50 + step, k * PER_RANK * world)
                for micro in range(k):
                    lo = (micro * world + rank) * PER_RANK
                    sl = slice(lo, lo + PER_RANK)
                    last = micro == k - 1
                    if style == "setter":
                        model.set_requires_gradient_sync(last)
                        (loss_fn("lm", model(x[sl]), y[sl]) / k).backward()
                    elif last:
                        (loss_fn("lm", model(x[sl]), y[sl]) / k).backward()
                    else:
                        with sw.no_sync(model):
                            (loss_fn("lm", model(x[sl]), y[sl]) / k).backward()
                grads = grads_of(model)
                loss_fn("lm", ref(x), y).backward()
                named = dict(ref.named_parameters())
                for fqn, (g, _) in grads.items():
                    if named[fqn].requires_grad:
                        diff = (g - named[fqn].grad).abs().max().item()
                        assert diff < 1e-5, f"{strategy}/{style}: {fqn} grad off by {diff}"
                opt.step()
                opt.zero_grad()
                ref_opt.step()
                ref_opt.zero_grad()
            full = sw.full_state_dict(model)
            out[f"{strategy}/{style}"] = max(
                (full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return out


def deferred_init(rank: int, world: int) -> dict[str, float]:
    eager = make_model("lm", 11)
    sd = eager.state_dict() if rank == 0 else None
    with torch.device("meta"):
        meta = make_model("lm", 11)
    sw.shard_model(meta, auto_wrap_policy="transformer")
    sw.load_full_state_dict(meta, sd, from_rank0=True)
    full = sw.full_state_dict(meta)
    for k, v in eager.state_dict().items():
        assert torch.equal(full[k], v), f"{k} differs after load from rank 0"
    # Materialized with reset_parameters(): trains like the eager model.
    with torch.device("meta"):
        fresh = make_model("lm", 12)
    sw.shard_model(fresh, auto_wrap_policy="transformer")
    sw.materialize(fresh, seed=5)
    assert not any(p.is_meta for p in fresh.parameters())
    ref = make_model("lm", 12)
    # The same initializers in the same module order as materialize (the tied weight ends
    # up with the head's init in both), so "trains like it" compares like with like.
    with torch.no_grad():
        for m in ref.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    losses = {}

    def learnable(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 11, (n, 5), generator=torch.Generator().manual_seed(seed))
        return x, (3 * x + 1) % 11  # a rule a tiny LM learns in a few steps

    xe, ye = learnable(999, 64)  # a fixed evaluation batch, the same on every rank
    for name, m in (("meta", fresh), ("eager", ref)):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-2)
        with torch.no_grad():
            first = loss_fn("lm", m(xe), ye).item()
        for step in range(15):
            x, y = learnable(900 + step, PER_RANK * world)
            if name == "meta":
                x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1)
                                                                   * PER_RANK]
            loss_fn("lm", m(x), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            losses[name] = loss_fn("lm", m(xe), ye).item() / first
    # Both fall by a similar fraction (different random draws, same initializers).
    assert losses["meta"] < 0.7, losses
    assert abs(losses["meta"] - losses["eager"]) < 0.15, losses
    return losses


def deferred_peak_memory(rank: int, world: int, width: int) -> dict[str, int]:
    """Peak RSS growth of building + sharding + materializing a meta model on this rank."""
    import resource

    def hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # Warm up once on a small model so lazy imports and allocator arenas are not counted.
    with torch.device("meta"):
        warm = nn.Sequential(nn.Linear(8, 8))
    sw.materialize(sw.shard_model(warm, auto_wrap_policy=None))
    before = hwm()
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    sw.shard_model(model, auto_wrap_policy=lambda m: isinstance(m, nn.Linear))
    sw.materialize(model)
    after = hwm()
    full_bytes = 4 * 4 * (width * width + width)  # 4 fp32 Linear(width, width) layers
    local = sum(p.to_local().numel() * 4 for p in model.parameters())  # DTensor rows
    return {"growth": after - before, "unsharded": full_bytes, "local": local,
            "rank": rank, "pid": os.getpid()}


def ignored(rank: int, world: int) -> None:
    model = make_model("mlp", 2)
    keep = model.fc3.bias
    sw.shard_model(model, auto_wrap_policy=None, ignored_params=[keep])
    assert model.fc3.bias is keep and keep.shape == (5,)
    x, y = make_batch("mlp", rank, PER_RANK)  # different data per rank
    loss_fn("mlp", model(x), y).backward()
    # Not reduced: each rank keeps its own local gradient.
    ref = make_model("mlp", 2)
    loss_fn("mlp", ref(x), y).backward()
    assert torch.allclose(keep.grad, ref.fc3.bias.grad, atol=1e-6)

"""fully_shard(..., mesh=full_spmd_mesh, dp_mesh_dims=...) on shardwise, FSDP2 and unsharded.

The client code is the full-DTensor recipe (torchtitan's `spmd_backend="full_dtensor"`):
every parameter is a DTensor on one named mesh, Replicate on the dp dims and colwise /
rowwise on "tp" (q/k/v/w1 Shard(0), o/w2 Shard(1)); inputs are DTensors Shard(0) on the dp
dims; the loss is a DTensor mean. That loss's backward already averages over the dp ranks,
so FSDP's own division is turned off (`set_gradient_divide_factor(1.0)`, as torchtitan does)
and sums are forced (gloo has no PREMUL_SUM). Both engines run this same code on the same
ranks; the reference runs the plain model on the whole batch. Sizes do not divide evenly
(HIDDEN 10 -> 5 rows per tp rank over 2 dp ranks, DIM 8 over 3 ranks, OUT 5).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims, FSDPModule
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardwise as sw

DIM, HEADS, HIDDEN, OUT, SEQ, PER_RANK = 8, 4, 10, 5, 3, 2
TOL = 1e-5
COLWISE, ROWWISE = ("attn.q", "attn.k", "attn.v", "w1"), ("attn.o", "w2")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tp each rank holds HEADS / tp of them. Written out (not
        # scaled_dot_product_attention: DTensor has no CPU rule for it).
        q, k, v = (p(x).view(B, T, -1, DIM // HEADS).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # (B, h, T, hd)
        att = torch.softmax(q @ k.transpose(-2, -1) * (DIM // HEADS) ** -0.5, dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.attn, self.n2 = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM)
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.w2(F.gelu(self.w1(self.n2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block()])
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build() -> Model:
    torch.manual_seed(0)
    return Model()


def distribute(model: nn.Module, mesh: DeviceMesh, tp: str | None) -> None:
    """Every parameter a DTensor on `mesh`: Replicate, but colwise/rowwise on dim `tp`."""
    for mname, m in model.named_modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            place: object = Replicate()
            if tp is not None and mname.endswith(COLWISE):
                place = Shard(0)
            elif tp is not None and mname.endswith(ROWWISE) and name == "weight":
                place = Shard(1)
            pls = [place if n == tp else Replicate() for n in mesh.mesh_dim_names or ()]
            # src_data_rank=None: every rank built the same seeded weights; no broadcast.
            m._parameters[name] = nn.Parameter(
                distribute_tensor(p.detach(), mesh, pls, src_data_rank=None))


def shard(engine: str, model: Model, mesh: DeviceMesh, dims: DataParallelMeshDims) -> None:
    fully_shard = sw.fully_shard if engine == "shardwise" else fsdp2_fully_shard
    for b in model.blocks:
        fully_shard(b, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def batch(step: int, n: int) -> torch.Tensor:
    return torch.randn(n, SEQ, DIM, generator=torch.Generator().manual_seed(50 + step))


def dp_index(mesh: DeviceMesh, dp: tuple[str, ...]) -> tuple[int, int]:
    """(this rank's index among the dp ranks, their number): mesh order, row-major."""
    names = mesh.mesh_dim_names or ()
    coord = mesh.get_coordinate()
    assert coord is not None
    i, n = 0, 1
    for d, name in enumerate(names):
        if name in dp:
            i, n = i * mesh.size(d) + coord[d], n * mesh.size(d)
    return i, n


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4,
                             foreach=True)


def layout(model: nn.Module) -> list[tuple]:
    """What the user sees of each sharded parameter and its gradient."""
    out = []
    for name, p in model.named_parameters():
        g = p.grad
        out.append((name, type(p).__name__, repr(p.device_mesh), tuple(p.placements),
                    tuple(p.shape), tuple(p.to_local().shape),
                    None if g is None else (repr(g.device_mesh), tuple(g.placements))))
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def train(engine: str, mesh: DeviceMesh, dims: DataParallelMeshDims, tp: str | None,
          steps: int) -> dict:
    """`steps` steps of the client code; losses, clipped norms, step-0 full grads, layout."""
    dp = (*dims.shard_names, *dims.replicate_names)
    model = build()
    distribute(model, mesh, tp)
    shard(engine, model, mesh, dims)
    opt = adamw(model)
    i, n = dp_index(mesh, dp)
    pls = [Shard(0) if name in dp else Replicate() for name in mesh.mesh_dim_names or ()]
    out: dict = {"loss": [], "norm": []}
    for step in range(steps):
        x = batch(step, PER_RANK * n)[i * PER_RANK:(i + 1) * PER_RANK]
        loss = model(DTensor.from_local(x, mesh, pls)).pow(2).mean()
        loss.backward()
        out["loss"].append(loss.full_tensor().item())
        if step == 0:
            out["layout"] = layout(model)
            out["grads"] = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        out["norm"].append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        opt.step()
        opt.zero_grad()
    out["params"] = full_params(model)
    out["model"], out["opt"] = model, opt
    return out


def reference(steps: int, n: int) -> dict:
    model = build()
    opt = adamw(model)
    out: dict = {"loss": [], "norm": []}
    for step in range(steps):
        loss = model(batch(step, PER_RANK * n)).pow(2).mean()
        loss.backward()
        out["loss"].append(loss.item())
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
        out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
    out["params"] = full_params(model)
    return out


def _close(a: dict, b: dict, what: str) -> float:
    worst = 0.0
    for k in ("loss", "norm"):
        for s, (x, y) in enumerate(zip(a[k], b[k], strict=True)):
            d = abs(x - y)
            assert d <= TOL * max(1.0, abs(y)), f"{what}: step {s} {k} {x} vs {y}"
            worst = max(worst, d)
    for k in ("grads", "params"):
        for name, t in b[k].items():
            d = (a[k][name] - t).abs().max().item()
            assert d <= TOL, f"{what}: {k} {name} differs by {d:.3g}"
            worst = max(worst, d)
    return worst


def parity(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...],
           shard: tuple[str, ...], replicate: tuple[str, ...], tp: str | None,
           ckpt: str | None = None) -> dict[str, float]:
    """shardwise vs FSDP2 (same layout, same numbers) vs unsharded, 2 steps."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard=shard or None, replicate=replicate or None)
    steps = 2
    ours = train("shardwise", mesh, dims, tp, steps)
    theirs = train("fsdp2", mesh, dims, tp, steps)
    assert ours["layout"] == theirs["layout"], (ours["layout"], theirs["layout"])
    _, n = dp_index(mesh, (*shard, *replicate))
    ref = reference(steps, n)
    worst = {"fsdp2": _close(ours, theirs, "vs FSDP2"), "ref": _close(ours, ref, "vs ref")}
    got = sw.full_state_dict(ours["model"])
    for name, t in ref["params"].items():
        assert (got[name] - t).abs().max().item() <= TOL, f"sw.full_state_dict {name}"
    if ckpt is not None:
        round_trip(ours["model"], mesh, dims, tp, ckpt)
    return worst


def parity_grid(rank: int, world: int, cases: list[tuple], ckpt: str) -> dict[str, float]:
    """Several meshes over the same ranks, one process group (start-up paid once); the
    first case also round-trips its checkpoint."""
    worst: dict[str, float] = {}
    for i, case in enumerate(cases):
        for k, v in parity(rank, world, *case, ckpt if i == 0 else None).items():
            worst[f"{case[1]} {k}"] = v
    return worst


def round_trip(model: nn.Module, mesh: DeviceMesh, dims: DataParallelMeshDims,
               tp: str | None, path: str) -> None:
    """model.state_dict() through DCP into fresh models sharded by each engine, and
    load_state_dict of the sharded state dict itself."""
    want = full_params(model)
    dcp.save(model.state_dict(), checkpoint_id=path)
    for engine in ("shardwise", "fsdp2"):
        fresh = Model()  # other weights (seed not reset)
        distribute(fresh, mesh, tp)
        shard(engine, fresh, mesh, dims)
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=path)
        fresh.load_state_dict(sd)
        for name, t in full_params(fresh).items():
            assert torch.equal(t, want[name]), f"DCP into {engine}: {name}"
    again = Model()
    distribute(again, mesh, tp)
    shard("shardwise", again, mesh, dims)
    again.load_state_dict(model.state_dict())
    for name, t in full_params(again).items():
        assert torch.equal(t, want[name]), f"load_state_dict: {name}"


def _raised(fn: object, what: str) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except (ValueError, NotImplementedError) as e:
        return e
    raise AssertionError(f"{what}: no error raised")


def bad_input(rank: int, world: int) -> list[str]:
    """Each misuse, on FSDP2 (every rank) and on shardwise (rank 0 alone, so an error
    raised after a collective would hang instead): the same exception type, FSDP2's words
    in shardwise's message, plus the offending value. A (dp=2, tp=2) mesh on 4 ranks."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # Another mesh over the same ranks (init_device_mesh hands back the same object for
    # the same arguments, so another name for the second dim).
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "model"))
    unnamed = init_device_mesh("cpu", (4,))
    dp = DataParallelMeshDims(shard="dp")

    def model(tp: str | None = "tp", plain: str = "", dp_shard: bool = False,
              other_mesh: bool = False) -> Model:
        m = build()
        distribute(m, other if other_mesh else mesh, "model" if other_mesh else tp)
        if plain:
            mod = m.get_submodule(plain.rsplit(".", 1)[0])
            mod._parameters["weight"] = nn.Parameter(torch.ones(mod.weight.shape))
        if dp_shard:
            m.head._parameters["weight"] = nn.Parameter(distribute_tensor(
                torch.ones(OUT, DIM), mesh, [Shard(0), Replicate()], src_data_rank=None))
        return m

    cases = {
        # name: (module to shard, kwargs, what shardwise's message must also name)
        "plain tensor": (lambda: model(plain="head.weight"), {}, "'weight'"),
        "Shard on a dp dim": (lambda: model(dp_shard=True), {}, "Shard(dim=0)"),
        "missing name": (model, {"dp_mesh_dims": DataParallelMeshDims(shard="fsdp")},
                         "('dp', 'tp')"),
        "int reshard_after_forward": (model, {"reshard_after_forward": 2}, "=2"),
        "another mesh object": (lambda: model(other_mesh=True), {}, "mesh="),
        "mesh without names": (model, {"mesh": unnamed}, "mesh="),
    }
    msgs = []
    for name, (make, kwargs, extra) in cases.items():
        kw = {"mesh": mesh, "dp_mesh_dims": dp, **kwargs}
        mine = make()  # on every rank: building it broadcasts nothing, but meshes might
        theirs = _raised(lambda: fsdp2_fully_shard(make().head, **kw), f"FSDP2 {name}")  # noqa: B023
        if rank == 0:
            ours = _raised(lambda: sw.fully_shard(mine.head, **kw), name)  # noqa: B023
            assert type(ours) is type(theirs), (name, ours, theirs)
            head = str(theirs).split(" (")[0].split("'")[0].rstrip(".")
            assert head in str(ours), (name, str(ours), str(theirs))
            assert extra in str(ours), (name, str(ours))
            msgs.append(f"{name}: {ours}")
    # FSDP2 runs replicate-only dims as DDP; shardwise refuses them rather than shard over
    # a dim its parameters call Replicate.
    mine = model()
    if rank == 0:
        ours = _raised(lambda: sw.fully_shard(mine.head, mesh=mesh, dp_mesh_dims=(
            DataParallelMeshDims(replicate="dp"))), "replicate only")
        assert isinstance(ours, NotImplementedError) and "replicate dims only" in str(ours)
        msgs.append(f"replicate only: {ours}")
    torch.distributed.barrier()
    return msgs

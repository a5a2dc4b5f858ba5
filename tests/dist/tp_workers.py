"""Issue 15: FSDP x tensor parallelism against an unsharded single-process reference.

A tiny language model with tied embedding and head, two blocks of attention (q/k/v
colwise, o rowwise) and an MLP (w1 colwise, w2 rowwise), the Megatron plan. The ranks of one
TP group see the same samples; each dp rank its own slice of one global batch, which the
reference sees whole. Sizes are chosen so that dp splits some rows unevenly (vocab 11).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import shardwise as sw
from shardwise.engine.comm import collectives as C

VOCAB, DIM, HEADS, HIDDEN, SEQ = 11, 8, 4, 12, 5
PER_RANK = 2
TOL = 1e-5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.head_dim = DIM // HEADS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under TP each rank holds HEADS / tp of them.
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # (B, h, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = nn.LayerNorm(DIM), Attention(), \
            nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
        "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel()}


def build(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def make_mesh(dp: int, tp: int, hybrid: bool = False) -> DeviceMesh:
    if hybrid:  # HSDP x TP: dp = (replicate, shard)
        return init_device_mesh("cpu", (dp, 1, tp), mesh_dim_names=("rep", "shard", "tp"))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def dp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names or ()
    return mesh[("rep", "shard")] if "rep" in names else mesh["dp"]


def parallelize(model: TinyLM, mesh: DeviceMesh) -> TinyLM:
    """The recipe: TP on each block, then fully_shard per block and on the root."""
    dp = dp_mesh_of(mesh)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], PLAN)
        sw.fully_shard(b, mesh=dp)
    return sw.fully_shard(model, mesh=dp)


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def dp_index(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's dp index, dp size): ranks of one TP group share it."""
    names = mesh.mesh_dim_names or ()
    if "rep" in names:
        r, s = mesh.get_local_rank("rep"), mesh.get_local_rank("shard")
        S = mesh.size(1)
        return r * S + s, mesh.size(0) * S
    return mesh.get_local_rank("dp"), mesh.size(0)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)


def train_ref(ref: nn.Module, opt: torch.optim.Optimizer, steps: int, n: int) -> None:
    """The reference alone, as train_both steps it (global batch of PER_RANK * n)."""
    for step in range(steps):
        x, y = batch(step, PER_RANK * n)
        loss_of(ref, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()


def train_both(model: nn.Module, ref: nn.Module, mesh: DeviceMesh, steps: int, what: str,
               start: int = 0, opts: tuple | None = None) -> dict[str, float]:
    """`steps` AdamW steps with clipping on both; the worst loss and norm differences."""
    opt, ref_opt = opts or (adamw(model), adamw(ref))
    i, n = dp_index(mesh)
    worst = {"loss": 0.0, "norm": 0.0}
    for step in range(start, start + steps):
        x, y = batch(step, PER_RANK * n)
        mine = slice(i * PER_RANK, (i + 1) * PER_RANK)
        out = loss_of(model, x[mine], y[mine])
        out.backward()
        ref_out = loss_of(ref, x, y)
        ref_out.backward()
        got = out.detach().double().reshape(1)
        C.all_reduce(got, None)
        got = got.item() / C.world_size()  # TP ranks repeat their dp rank's loss
        d = abs(got - ref_out.item())
        worst["loss"] = max(worst["loss"], d)
        assert d <= TOL, f"{what} step {step}: loss {got} vs {ref_out.item()}"
        # Both clippers, alternating: ours and PyTorch's on the DTensor parameters.
        if step % 2 == 0:
            norm = sw.clip_grad_norm_(model, 0.5)
        else:
            norm = full(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5))
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert ref_norm > 0.5, "the test must clip"
        d = abs(norm.item() - ref_norm.item())
        worst["norm"] = max(worst["norm"], d)
        assert d <= TOL, f"{what} step {step}: grad norm {norm.item()} vs {ref_norm.item()}"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return worst


def compare_params(model: nn.Module, ref: nn.Module, what: str) -> float:
    """Full parameters two ways: sw.full_state_dict and each DTensor's full_tensor()."""
    got = sw.full_state_dict(model)
    worst = 0.0
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        for how, value in (("full_state_dict", got[name]), ("full_tensor", full(mine[name]))):
            d = (value.detach().float() - p.detach().float()).abs().max().item()
            worst = max(worst, d)
            assert d <= TOL, f"{what}: {name} ({how}) differs by {d:.3g}"
    return worst


def parity(rank: int, world: int, dp: int, tp: int, hybrid: bool = False) -> dict[str, float]:
    mesh = make_mesh(dp, tp, hybrid)
    model = build()
    ref = copy.deepcopy(model)
    parallelize(model, mesh)
    what = f"dp {dp} x tp {tp}{' (HSDP)' if hybrid else ''}"
    # Every parameter is a DTensor on the one (dp, tp) mesh.
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.ndim == (3 if hybrid else 2), name
    worst = train_both(model, ref, mesh, 3, what)
    worst["params"] = compare_params(model, ref, what)
    return worst


def expect_error(fn, *needles: str) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in {msg!r}"
        return msg
    raise AssertionError(f"no error; expected one naming {needles}")


def bad_input(rank: int, world: int) -> list[str]:
    """Each misuse raises a clear error on every rank, before any collective."""
    mesh = make_mesh(2, 2)
    msgs = []
    for bad_mesh, needle in ((None, "mesh=None has no dp dimension"),
                             (mesh["tp"], "is not a dp dimension")):
        model = build()
        parallelize_module(model.blocks[0], mesh["tp"], PLAN)
        msgs.append(expect_error(lambda: sw.fully_shard(model.blocks[0],  # noqa: B023
                                                        mesh=bad_mesh),  # noqa: B023
                                 needle, "mesh['dp']"))
    # shard_model with a TP model and no mesh: the same error.
    model = build()
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], PLAN)
    msgs.append(expect_error(lambda: sw.shard_model(model), "has no dp dimension"))
    # TP applied after fully_shard: refused at the first forward, before its collectives.
    model = build()
    for b in model.blocks:
        sw.fully_shard(b, mesh=mesh["dp"])
    sw.fully_shard(model, mesh=mesh["dp"])
    # With dp > 1 the shards are DTensors on the dp mesh and torch's distribute_tensor
    # refuses to move them to the TP mesh (a local check, before any collective).
    msgs.append(expect_error(lambda: parallelize_module(model.blocks[0], mesh["tp"], PLAN),
                             "Cannot distribute a DTensor"))
    return msgs


def tp_after_shard_dp1(rank: int, world: int) -> str:
    """dp 1 x tp 2: the shards are DTensors on the one-rank dp mesh too (as in FSDP2), so
    parallelize_module after fully_shard is refused as at dp > 1 (it went through before,
    and the first forward refused the replaced parameters)."""
    mesh = make_mesh(1, 2)
    model = build()
    for b in model.blocks:
        sw.fully_shard(b, mesh=mesh["dp"])
    sw.fully_shard(model, mesh=mesh["dp"])
    return expect_error(lambda: parallelize_module(model.blocks[0], mesh["tp"], PLAN),
                        "Cannot distribute a DTensor")


# --- checkpoints: save at dp 2 x tp 2, load at other (dp, tp) -------------------------------

SAVE_STEPS = 2


def ckpt_save(rank: int, world: int, path: str) -> None:
    """Train 2 steps at dp 2 x tp 2; save shardwise's checkpoint, DCP, and safetensors."""
    mesh = make_mesh(2, 2)
    model = build()
    ref = copy.deepcopy(model)
    parallelize(model, mesh)
    opts = (adamw(model), adamw(ref))
    train_both(model, ref, mesh, SAVE_STEPS, "before save", opts=opts)
    sw.save_checkpoint(f"{path}/sw", model, opts[0], step=SAVE_STEPS)
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opts[0])}, checkpoint_id=f"{path}/dcp")
    sw.export_safetensors(f"{path}/export", model)
    if rank == 0:
        got = load_file(f"{path}/export/model.safetensors")
        want = ref.state_dict()
        assert set(got) == set(want) - {"head.weight"}, sorted(got)  # tied: stored once
        for k, v in got.items():
            d = (v - want[k]).abs().max().item()
            assert tuple(v.shape) == tuple(want[k].shape) and d <= TOL, (k, d)


def ckpt_load(rank: int, world: int, dp: int, tp: int, path: str) -> dict:
    """Both formats, in one process group (start-up is the slow part of these tests)."""
    return {kind: ckpt_load_one(dp, tp, path, kind) for kind in ("sw", "dcp")}


def ckpt_load_one(dp: int, tp: int, path: str, kind: str) -> dict:
    """Load what ckpt_save wrote at another (dp, tp); parity, then one more step each."""
    ref = build()
    ref_opt = adamw(ref)
    train_ref(ref, ref_opt, SAVE_STEPS, 2)  # saved at dp 2: the global batch had 2 slices
    mesh = make_mesh(dp, tp)
    model = parallelize(build(seed=5), mesh)  # other weights: all must come from the load
    opt = adamw(model)
    if kind == "sw":
        sw.load_checkpoint(f"{path}/sw", model, opt)
    else:
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=f"{path}/dcp")
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
    what = f"{kind} load at dp {dp} x tp {tp}"
    loaded = compare_params(model, ref, what)
    # The same global batch as before: PER_RANK * 2 samples, split over this dp size.
    worst = resume_step(model, ref, (opt, ref_opt), mesh, what)
    return {"loaded": loaded, **worst}


def resume_step(model: nn.Module, ref: nn.Module, opts: tuple, mesh: DeviceMesh,
                what: str) -> dict[str, float]:
    opt, ref_opt = opts
    i, n = dp_index(mesh)
    per = PER_RANK * 2 // n
    x, y = batch(SAVE_STEPS, PER_RANK * 2)
    out = loss_of(model, x[i * per:(i + 1) * per], y[i * per:(i + 1) * per])
    out.backward()
    ref_out = loss_of(ref, x, y)
    ref_out.backward()
    got = out.detach().double().reshape(1)
    C.all_reduce(got, None)
    d_loss = abs(got.item() / C.world_size() - ref_out.item())
    assert d_loss <= TOL, f"{what}: loss after resume differs by {d_loss}"
    sw.clip_grad_norm_(model, 0.5)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    ref_opt.step()
    return {"loss": d_loss, "params": compare_params(model, ref, what + " after a step")}


# --- the trainer's GPT with its TP plan, through sw.shard_model ------------------------------


def gpt_parity(rank: int, world: int, dp: int, tp: int) -> dict[str, float]:
    from shardwise.train.model import GPT, GPTConfig
    from shardwise.train.tensor_parallel import parallelize_gpt

    mesh = make_mesh(dp, tp)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, d_model=16)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    parallelize_gpt(model, mesh["tp"])
    sw.shard_model(model, mesh=mesh["dp"])
    opts = (adamw(model), adamw(ref))
    i, n = dp_index(mesh)
    worst = {"loss": 0.0}
    for step in range(3):
        x, y = batch(step, PER_RANK * n)
        mine = slice(i * PER_RANK, (i + 1) * PER_RANK)
        out = model(x[mine], y[mine])
        out.backward()
        ref_out = ref(x, y)
        ref_out.backward()
        got = out.detach().double().reshape(1)
        C.all_reduce(got, None)
        d = abs(got.item() / C.world_size() - ref_out.item())
        worst["loss"] = max(worst["loss"], d)
        assert d <= TOL, f"GPT dp {dp} x tp {tp} step {step}: loss differs by {d}"
        sw.clip_grad_norm_(model, 0.5)
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5) > 0.5
        for o in opts:
            o.step()
            o.zero_grad()
    worst["params"] = compare_params(model, ref, f"GPT dp {dp} x tp {tp}")
    return worst


def materialize_refused(rank: int, world: int) -> str:
    """Meta-device init of a TP model is refused before materialize's first collective."""
    mesh = make_mesh(1, 2)
    with torch.device("meta"):
        model = build()
    parallelize(model, mesh)
    return expect_error(lambda: sw.materialize(model), "tensor-parallel parameters",
                        "load_full_state_dict")

"""Randomized differential cases for data-dependent control flow ([Note: lockstep]).

`make_spec(seed, world)` draws a small model and its options: experts (units or not) in an
nn.ModuleList, an nn.ModuleDict or nested containers, layers that are units or not, units
outside any container (a pre block, an auxiliary head whose output reaches the loss only on
some ranks and in some micro-batches), per-rank routing that differs in every micro-batch
(a rank that sends no token to some expert, an expert no rank uses, the first expert called
a second time on every rank, a layer applied twice), activation checkpointing, torch.compile
of layers, no_sync accumulation, reshard_after_forward per unit, SHARD_GRAD_OP,
HYBRID_SHARD 2 x 2 at 4 ranks, NO_SHARD and a float64 compute dtype. Parameter sizes are odd.

`run_case` trains 3 AdamW steps (weight decay on) with clipping and holds the mean loss,
every gradient (present or None alike), the clipped norm and the final parameters against
an unsharded reference that runs every rank's slice, to 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
import random
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.engine.comm import collectives as C

D_IN, CLASSES, PER_RANK, STEPS = 5, 3, 3, 3
Spec = dict[str, Any]


# --- the model ---------------------------------------------------------------------------


def _like(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    """Units may compute in float64 next to float32 ones: inputs follow the module's dtype."""
    return x.to(m.weight.dtype)


class Expert(nn.Module):
    def __init__(self, d: int, f: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, f, bias=bias)
        self.fc2 = nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(_like(x, self.fc1))))


class MoE(nn.Module):
    """Holds the experts' container; never a unit (docs/moe.md)."""

    def __init__(self, d: int, ls: Spec) -> None:
        super().__init__()
        self.router = nn.Linear(d, ls["experts"], bias=False)
        made = [Expert(d, f, b) for f, b in zip(ls["hidden"], ls["bias"])]
        kind = ls["container"]
        if kind == "list":
            self.experts: nn.Module = nn.ModuleList(made)
        elif kind == "dict":  # insertion order is container order, whatever the keys
            self.experts = nn.ModuleDict({f"k{(7 * i) % 11}": e for i, e in enumerate(made)})
        else:  # nested: each inner list is a group of its own
            cut = max(1, len(made) // 2)
            self.experts = nn.ModuleDict({"lo": nn.ModuleList(made[:cut]),
                                          "hi": nn.ModuleList(made[cut:])})
        self.order = made  # container order
        self.shared_twice = ls["shared_twice"]

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(_like(h, self.router)), -1).to(h.dtype)
        out = torch.zeros_like(h)
        for e, ex in enumerate(self.order):
            idx = (route == e).any(1).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue  # this rank sends no token to expert e
            y = ex(h[idx]).to(h.dtype)
            out = out.index_add(0, idx, y * probs[idx, e : e + 1])
        if self.shared_twice:  # the first expert again, on every rank: a second round
            out = out + 0.5 * self.order[0](h).to(h.dtype)
        return out


class Layer(nn.Module):
    def __init__(self, d: int, ls: Spec) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = MoE(d, ls) if ls["moe"] else None
        self.dense = None if ls["moe"] else nn.Linear(d, d)

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        x = self.norm(_like(h, self.norm))
        return h + (self.moe(x, route) if self.moe is not None else torch.tanh(self.dense(x)))


class Block(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, f)
        self.out = nn.Linear(f, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(_like(h, self.fc))))


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        d = spec["d"]
        self.inp = nn.Linear(D_IN, d)
        self.pre = Block(d, spec["pre_f"]) if spec["pre"] else None
        self.layers = nn.ModuleList(Layer(d, ls) for ls in spec["layers"])
        self.aux = Block(d, 3) if spec["aux"] else None
        self.head = nn.Linear(d, CLASSES)
        self.spec = spec

    def forward(self, x: torch.Tensor, routes: torch.Tensor, call_aux: bool,
                use_aux: bool) -> torch.Tensor:
        h = self.inp(_like(x, self.inp))
        if self.pre is not None:
            h = h + self.pre(h)
        for i, (layer, ls) in enumerate(zip(self.layers, self.spec["layers"])):
            for again in range(2 if ls["twice"] else 1):  # routed anew the second time
                route = routes[2 * i + again]
                if ls["ckpt"] and torch.is_grad_enabled():
                    h = checkpoint(layer, h, route, use_reentrant=False)
                else:
                    h = layer(h, route)
        logits = self.head(_like(h, self.head))
        if self.aux is not None and call_aux:
            side = self.aux(h)  # runs on every rank; reaches the loss on some
            if use_aux:
                logits = logits + side.float().mean(-1, keepdim=True)
        return logits


# --- drawing a case ----------------------------------------------------------------------


def make_spec(seed: int, world: int) -> Spec:
    rng = random.Random(seed)
    strategy = "HYBRID_SHARD" if world == 4 else rng.choice(
        ["FULL_SHARD"] * 3 + ["SHARD_GRAD_OP", "NO_SHARD"])
    layers = []
    for _ in range(rng.randint(1, 3)):
        e = rng.randint(2, 5)
        layers.append(dict(
            moe=rng.random() < 0.8, unit=rng.random() < 0.5, experts=e,
            container=rng.choice(["list", "list", "dict", "nested"]),
            expert_units=[rng.random() < 0.85 for _ in range(e)],
            hidden=[rng.choice([1, 2, 3, 5, 7]) for _ in range(e)],
            bias=[rng.random() < 0.7 for _ in range(e)],
            topk=rng.choice([1, 1, 2]), shared_twice=rng.random() < 0.2,
            twice=rng.random() < 0.15, ckpt=rng.random() < 0.2,
            compile=rng.random() < 0.1, dead=rng.random() < 0.4,
            empty_rank=rng.random() < 0.15))
    return dict(
        seed=seed, world=world, strategy=strategy, d=rng.choice([5, 7, 9]),
        pre=rng.random() < 0.5, pre_f=rng.choice([1, 4, 7]), layers=layers,
        aux=rng.random() < 0.5, aux_unit=rng.random() < 0.7, micro=rng.choice([1, 1, 2, 3]),
        no_sync=rng.random() < 0.5, mp=rng.choice([None, None, "f64", "f64-some"]),
        raf=rng.choice(["default", "random", "root-true"]),
        prefetch=rng.random() < 0.85)


def _draw_routes(spec: Spec, step: int, mb: int) -> list[torch.Tensor]:
    """Per rank, (2 * layers, PER_RANK, 2) expert indices (a layer's first and second
    call, top-k slots), -1 for an empty slot."""
    rng = random.Random(spec["seed"] * 7919 + step * 31 + mb)
    world = spec["world"]
    per_rank = [torch.full((2 * len(spec["layers"]), PER_RANK, 2), -1) for _ in range(world)]
    for li in range(2 * len(spec["layers"])):
        ls = spec["layers"][li // 2]
        if not ls["moe"]:
            continue
        e = ls["experts"]
        dead = {rng.randrange(e)} if ls["dead"] else set()
        empty = rng.randrange(world) if ls["empty_rank"] else -1
        # A member called again in the same round (shared_twice) needs every rank to call one
        # before it (docs/moe.md): route to units only there, and drop no rank's tokens.
        units = [x for x in range(e) if ls["expert_units"][x] or not ls["shared_twice"]]
        for r in range(world):
            allowed = [x for x in units if x not in dead and rng.random() < 0.6]
            if "fixed" in ls:  # a hand-made case: [call][rank] -> the experts it routes to
                allowed = ls["fixed"][li % 2 % len(ls["fixed"])][r]
                if not allowed:
                    continue  # all of this rank's tokens dropped
            elif r == empty and not ls["shared_twice"] and not ls["ckpt"]:
                continue  # all of this rank's tokens dropped (docs/moe.md: not under ckpt)
            elif not allowed:
                allowed = [min(set(units) - dead or set(units))]
            for row in range(PER_RANK):
                for slot in range(ls["topk"]):
                    per_rank[r][li, row, slot] = rng.choice(allowed)
    return per_rank


def batch(spec: Spec, step: int, mb: int) -> list[tuple[Any, ...]]:
    """Each rank's slice: (x, y, routes, call_aux, use_aux)."""
    g = torch.Generator().manual_seed(spec["seed"] * 1000 + step * 10 + mb)
    world = spec["world"]
    x = torch.randn(world * PER_RANK, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (world * PER_RANK,), generator=g)
    routes = _draw_routes(spec, step, mb)
    rng = random.Random(spec["seed"] + 17 * step + mb)
    call_aux = rng.random() < 0.7  # the same on every rank: used only in some micro-batches
    uses = [rng.random() < 0.5 for _ in range(world)]
    if "aux_plan" in spec:  # a hand-made case: [micro-batch] -> (call, [use on each rank])
        call_aux, uses = spec["aux_plan"][mb]
    out = []
    for r in range(world):
        rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
        out.append((x[rows], y[rows], routes[r], call_aux, uses[r]))
    return out


def loss_of(model: nn.Module, b: tuple[Any, ...]) -> torch.Tensor:
    x, y, routes, call_aux, use_aux = b
    return nn.functional.cross_entropy(model(x, routes, call_aux, use_aux).float(), y)


def case(world: int, layers: list[Spec], **top: Any) -> Spec:
    """A hand-made spec: each `layers` entry overrides a plain MoE layer of 3 expert units."""
    spec = dict(seed=0, world=world, strategy="FULL_SHARD", d=5, pre=False, pre_f=4, aux=False,
                aux_unit=True, micro=1, no_sync=False, mp=None, raf="default", prefetch=True)
    spec.update(top)
    spec["layers"] = []
    for over in layers:
        e = over.get("experts", 3)
        ls = dict(moe=True, unit=False, experts=e, container="list", expert_units=[True] * e,
                  hidden=[3] * e, bias=[True] * e, topk=1, shared_twice=False, twice=False,
                  ckpt=False, compile=False, dead=False, empty_rank=False)
        ls.update(over)
        spec["layers"].append(ls)
    return spec


# --- sharding ----------------------------------------------------------------------------


def shard(model: Net, spec: Spec) -> None:
    rng = random.Random(spec["seed"] + 5)
    strategy = spec["strategy"]
    mesh = None
    if strategy in ("HYBRID_SHARD", "NO_SHARD"):
        from torch.distributed.device_mesh import init_device_mesh

        w = spec["world"]
        shape = (2, w // 2) if strategy == "HYBRID_SHARD" else (w, 1)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))

    def opts() -> dict[str, Any]:
        raf: bool | None = strategy != "SHARD_GRAD_OP"
        if spec["raf"] == "random":
            raf = rng.random() < 0.5
        mp = None
        if spec["mp"] == "f64" or (spec["mp"] == "f64-some" and rng.random() < 0.5):
            mp = sw.MixedPrecisionPolicy(torch.float64, rng.choice([None, torch.float32]),
                                         torch.float32)
        elif spec["mp"] == "f64-some":  # inputs from a float64 unit are cast back
            mp = sw.MixedPrecisionPolicy(torch.float32)
        return dict(mesh=mesh, reshard_after_forward=raf, mp_policy=mp)

    for layer, ls in zip(model.layers, spec["layers"]):
        if layer.moe is not None:
            for ex, unit in zip(layer.moe.order, ls["expert_units"]):
                if unit:
                    sw.fully_shard(ex, **opts())
        if ls["unit"]:
            sw.fully_shard(layer, **opts())
        if ls["compile"]:
            layer.compile(backend="eager")
    if model.pre is not None:
        sw.fully_shard(model.pre, **opts())
    if model.aux is not None and spec["aux_unit"]:
        sw.fully_shard(model.aux, **opts())
    root = opts()
    if spec["raf"] == "default":
        root["reshard_after_forward"] = None if strategy != "SHARD_GRAD_OP" else False
    sw.fully_shard(model, **root)
    if not spec["prefetch"]:
        from shardwise.engine.inspect import context_of

        ctx = context_of(model)
        assert ctx is not None
        ctx.schedule.prefetch = False


# --- training against the reference ------------------------------------------------------


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mean(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    C.all_reduce(t, None)
    return t.item() / C.world_size()


def run_case(rank: int, world: int, spec: Spec, tol: float = 1e-5) -> list[str]:
    """Train; return the disagreements (empty: parity). The same list on every rank."""
    torch.manual_seed(spec["seed"])
    model = Net(spec)
    ref = copy.deepcopy(model)
    shard(model, spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    bad: list[str] = []
    k = spec["micro"]
    for step in range(STEPS):
        got = want = 0.0
        for mb in range(k):
            pieces = batch(spec, step, mb)
            quiet = spec["no_sync"] and mb < k - 1
            with sw.no_sync(model) if quiet else contextlib.nullcontext():
                loss = loss_of(model, pieces[rank]) / k
                loss.backward()
            got += _mean(loss.item())
            ref_loss = sum(loss_of(ref, p) for p in pieces) / (world * k)
            ref_loss.backward()
            want += ref_loss.item()
        if abs(got - want) > tol * max(1.0, abs(want)):
            bad.append(f"step {step}: loss {got} vs {want}")
        ref_named = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g, rg = _full(p.grad), ref_named[name].grad
            if (g is None) != (rg is None):
                bad.append(f"step {step}: {name}.grad is "
                           f"{'None' if g is None else 'set'}, reference "
                           f"{'None' if rg is None else 'set'}")
            elif g is not None and (d := (g - rg).abs().max().item()) > tol:
                bad.append(f"step {step}: {name}.grad differs by {d:.3g}")
        norm = sw.clip_grad_norm_(model, 0.5).item()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
        if abs(norm - ref_norm) > tol * max(1.0, ref_norm):
            bad.append(f"step {step}: norm {norm} vs {ref_norm}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = sw.full_state_dict(model)
    for name, p in ref.named_parameters():
        if (d := (full[name] - p.detach()).abs().max().item()) > tol:
            bad.append(f"param {name} differs by {d:.3g}")
    return bad


def run_specs(rank: int, world: int, specs: dict[str, Spec]) -> dict[str, list[str]]:
    """Each spec's disagreements, by name (one process group for all of them)."""
    return {name: run_case(rank, world, spec) for name, spec in specs.items()}

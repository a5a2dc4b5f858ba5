"""Mixture-of-experts models whose routing differs by rank ([Note: data-dependent units]).

Each rank's tokens are drawn so that some expert gets no token on that rank for every step
("skewed"), or so that every rank routes tokens to every expert ("balanced"): a hand-written
MoE (experts in an nn.ModuleList, a ModuleDict of lists, or stored as 3-D tensors) routed by
token id, and Hugging Face Mixtral / Qwen2-MoE built from configs with their own learned
routers (transformers 5 stores each layer's experts as 3-D tensors; "per-expert" puts them
back into an nn.ModuleList of expert MLPs, transformers 4's layout, which FSDP2 users shard
one unit per expert). Compared against the unsharded model on the whole batch by
tests/dist/harness.py, parameters and gradients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard

import shardwise as sw
from shardwise.engine.core.context import context_of
from tests.dist.harness import run_parity

VOCAB, E, D, F = 40, 4, 12, 10
PER_RANK = 2


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, F)
        self.fc2 = nn.Linear(F, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Stacked(nn.Module):
    """All experts of a layer as 3-D tensors (transformers 5 style); E is uneven for 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, F, D) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, D, F) * 0.3)

    def forward(self, h: torch.Tensor, route: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in range(E):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel():  # an expert with no token here leaves its slice's gradient zero
                y = torch.tanh(h[idx] @ self.w1[e].t()) @ self.w2[e].t()
                out = out.index_add(0, idx, y * probs[idx, e : e + 1])
        return out


class MoE(nn.Module):
    def __init__(self, stacked: bool, nested: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts: nn.Module = Stacked() if stacked else nn.ModuleList(
            Expert() for _ in range(E))
        if nested:  # experts split into lists inside a dict
            half = E // 2
            self.experts = nn.ModuleDict({"lo": nn.ModuleList(Expert() for _ in range(half)),
                                          "hi": nn.ModuleList(Expert() for _ in range(half))})

    def expert(self, e: int) -> nn.Module:
        if isinstance(self.experts, nn.ModuleDict):
            half = E // 2
            return self.experts["lo" if e < half else "hi"][e % half]
        return self.experts[e]

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h), -1)  # (N, E)
        if isinstance(self.experts, Stacked):
            return self.experts(h, route, probs)  # one call, as transformers 5's experts
        out = torch.zeros_like(h)
        for e in range(E):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue  # this rank sends no token to expert e: it is not called
            y = self.expert(e)(h[idx])
            out = out.index_add(0, idx, y * probs[idx, e : e + 1])
        return out


class Layer(nn.Module):
    def __init__(self, i: int, stacked: bool, nested: bool = False, twice: bool = False,
                 frozen: bool = False) -> None:
        super().__init__()
        self.i = i
        self.twice = twice
        self.frozen = frozen
        self.norm = nn.LayerNorm(D)
        self.moe = MoE(stacked, nested)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # Layer 0 routes by id % E, layer 1 by (id // E) % E: the data decides both.
        route = (ids if self.i == 0 else ids // E) % E
        if self.frozen and self.i == 0:
            # The MoE's input needs no gradient (a frozen embedding): its experts' inputs
            # neither, so they reduce in the final callback.
            return h + self.moe(h, route)
        h = h + self.moe(self.norm(h), route)
        if self.twice:  # the same MoE layer called again in one forward
            h = h + self.moe(self.norm(h), (route + 1) % E)
        return h


class Net(nn.Module):
    """`frozen`: the embedding frozen, layer 0's MoE fed by it; `rounds`: the layer stack run
    that many times per forward (a container whose members each run several times per
    call of their holder)."""

    def __init__(self, stacked: bool = False, nested: bool = False, twice: bool = False,
                 frozen: bool = False, rounds: int = 1) -> None:
        super().__init__()
        self.rounds = rounds
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Layer(i, stacked, nested, twice, frozen)
                                    for i in range(2))
        self.head = nn.Linear(D, VOCAB)
        if frozen:
            self.embed.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        h = self.embed(flat)
        for _ in range(self.rounds):
            for layer in self.layers:
                h = layer(h, flat)
        return self.head(h)


def skipped_at_layer0(rank: int) -> set[int]:
    """Rank r sends no token to expert r at layer 0; rank 0 none to the last expert either
    (so the group's last member is skipped too, and used elsewhere)."""
    return {rank % E, E - 1} if rank == 0 else {rank % E}


def _batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + step)
    rows = []
    for i in range(n):
        allowed = torch.tensor([t for t in range(VOCAB)
                                if t % E not in skipped_at_layer0(i // PER_RANK)])
        rows.append(allowed[torch.randint(0, len(allowed), (6,), generator=g)])
    ids = torch.stack(rows)
    return ids, torch.roll(ids, 1, dims=1)


def _balanced_batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
    """Every row routes a token to every expert at both layers: ids 0, 5, 10, 15 cover
    each residue of id % E and of (id // E) % E (E = 4), then 2 random tokens."""
    g = torch.Generator().manual_seed(400 + step)
    base = torch.tensor([0, 5, 10, 15])
    rows = [torch.cat([base[torch.randperm(E, generator=g)],
                       torch.randint(0, VOCAB, (2,), generator=g)]) for _ in range(n)]
    ids = torch.stack(rows)
    return ids, torch.roll(ids, 1, dims=1)


def _loss(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(m(b[0]), b[1].reshape(-1))


def _experts(layer: nn.Module) -> list[nn.Module]:
    return [layer.moe.expert(e) for e in range(E)]


def _shard_hand(m: nn.Module, units: str, coalesce_bytes: int | None = None) -> None:
    """"layers": one unit per layer; "stacked": 3-D experts as their own unit; "experts":
    per-expert units, the layer not a unit (their container under a non-unit);
    "experts+layers": per-expert units inside layer units (under a unit);
    "experts-grad-op": the same, experts kept gathered from forward to backward.
    `coalesce_bytes`: fully_shard's (None: the default budget)."""
    c = {"coalesce_bytes": coalesce_bytes}
    for layer in m.layers:
        if units.startswith("experts"):
            for ex in _experts(layer):
                sw.fully_shard(ex, reshard_after_forward=units != "experts-grad-op", **c)
        if units.startswith("stacked"):
            # FSDP2's argument: dim 0 (the experts) for the 3-D weights.
            sw.fully_shard(layer.moe.experts, shard_placement_fn=lambda p: Shard(0),
                           reshard_after_forward=units == "stacked", **c)
        if units != "experts":
            sw.fully_shard(layer, reshard_after_forward=units != "stacked-grad-op", **c)
    sw.fully_shard(m, reshard_after_forward=units != "stacked-grad-op", **c)


def hand_moe(rank: int, world: int, debug: bool, cases: tuple[str, ...],
             balanced: bool = False, nested: bool = False, twice: bool = False,
             frozen: bool = False, rounds: int = 1) -> dict[str, object]:
    """Parity (parameters and gradients) of the hand-written MoE for each way of sharding
    it in `cases`, and the schedule's decisions in its first two steps (which unit gathers,
    waits, reshards, reduces, in order), for the ranks to compare."""
    sw.set_debug(debug)
    out: dict[str, object] = {}
    batch = _balanced_batch if balanced else _batch
    for units in cases:
        stacked = units.startswith("stacked")
        logs: list[list[tuple[str, str]]] = []
        out[units] = run_parity(rank, world,
                                lambda s=stacked: Net(s, nested, twice, frozen, rounds),
                                lambda m, u=units: _shard_hand(m, u), batch, _loss,
                                steps=3, per_rank=PER_RANK, what=f"hand MoE {units}",
                                grads=True, between_steps=lambda s, m, r, logs=logs:
                                _take_log(m, logs))
        out[f"{units}/log"] = logs
    sw.set_debug(False)
    return out


def _take_log(model: nn.Module, logs: list[list[tuple[str, str]]]) -> None:
    """The decisions the schedule logged since the last call; start a new log."""
    sched = context_of(model).schedule  # type: ignore[union-attr]
    if sched.log is not None:
        logs.append([(what, u.label) for what, u in sched.log])
    sched.log = []


class TwoLists(nn.Module):
    """The same expert units in two containers: refused on every rank at the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList(Expert() for _ in range(2))
        self.b = nn.ModuleList([self.a[1], Expert()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a[0](x) + self.b[0](x) + self.b[1](x)


def refused_positions(rank: int, world: int) -> dict[str, str]:
    """What each rank gets for a unit held in two containers."""
    torch.manual_seed(0)
    m = TwoLists()
    for ex in (m.a[0], m.a[1], m.b[1]):
        sw.fully_shard(ex)
    sw.fully_shard(m)
    try:
        m(torch.randn(3, D)).sum().backward()
    except RuntimeError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": "", "message": ""}


# --- Hugging Face ------------------------------------------------------------------------

HF_VOCAB = 37


def _hf(kind: str) -> nn.Module:
    import transformers as tf

    common = dict(vocab_size=HF_VOCAB, hidden_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                  attn_implementation="eager", tie_word_embeddings=False)
    if kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=12, num_local_experts=5,
                               num_experts_per_tok=2, **common)
        return tf.MixtralForCausalLM(cfg)
    cfg = tf.Qwen2MoeConfig(intermediate_size=20, moe_intermediate_size=12,
                            shared_expert_intermediate_size=14, num_experts=5,
                            num_experts_per_tok=2, decoder_sparse_step=1, **common)
    return tf.Qwen2MoeForCausalLM(cfg)


def _hf_batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, HF_VOCAB, (n, 3), generator=g)
    return ids, ids.clone()


def _hf_loss(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return m(input_ids=b[0], labels=b[1]).loss


class ExpertMLP(nn.Module):
    """One expert of transformers 4's Mixtral / Qwen2-MoE: gate and up, then down."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: nn.Module) -> None:
        super().__init__()
        self.gate_up = nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False)
        self.down = nn.Linear(down.shape[1], down.shape[0], bias=False)
        with torch.no_grad():
            self.gate_up.weight.copy_(gate_up)
            self.down.weight.copy_(down)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class ExpertList(nn.ModuleList):
    """transformers 5's experts module (same call, same numbers) with one module per
    expert: the loop over the experts hit, in ascending order, as both versions run it."""

    @classmethod
    def of(cls, experts: nn.Module) -> ExpertList:
        return cls(ExpertMLP(experts.gate_up_proj[e], experts.down_proj[e], experts.act_fn)
                   for e in range(experts.num_experts))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=len(self)).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit.reshape(-1).tolist():  # an expert no token chose is not called
            pos, idx = torch.where(mask[e])
            y = self[e](hidden[idx]) * top_k_weights[idx, pos, None]
            out.index_add_(0, idx, y.to(out.dtype))
        return out


def hf_moe(rank: int, world: int, cases: tuple[tuple[str, str], ...]) -> dict[str, object]:
    """Mixtral and Qwen2-MoE: decoder layers as units ("layers"), the 3-D experts as their
    own units ("experts"), or one unit per expert in an nn.ModuleList and each layer
    ("per-expert"). Returns the experts each rank routed tokens to, per step and layer
    (router hooks)."""
    out: dict[str, object] = {}
    for kind, units in cases:
        seen: list[tuple[int, list[int]]] = []
        mine: set[int] = set()

        def build(kind: str = kind, units: str = units, seen: list = seen) -> nn.Module:
            m = _hf(kind)
            for layer in m.model.layers:
                layer.mlp.gate.register_forward_hook(
                    lambda mod, a, o, seen=seen: seen.append(
                        (id(mod), sorted(set(o[2].reshape(-1).tolist())))))
                if units == "per-expert":
                    layer.mlp.experts = ExpertList.of(layer.mlp.experts)
            return m

        def shard(m: nn.Module, units: str = units, mine: set = mine) -> None:
            for layer in m.model.layers:
                mine.add(id(layer.mlp.gate))  # the reference (a deep copy) has others
                if units == "experts":
                    sw.fully_shard(layer.mlp.experts)
                if units == "per-expert":
                    for ex in layer.mlp.experts:
                        sw.fully_shard(ex)
                sw.fully_shard(layer)
            sw.fully_shard(m)

        out[f"{kind}/{units}"] = run_parity(rank, world, build, shard, _hf_batch, _hf_loss,
                                            steps=2, per_rank=1, what=f"{kind} {units}",
                                            grads=True)
        # Experts this rank routed tokens to, per (step, layer).
        out[f"{kind}/{units}/used"] = [u for i, u in seen if i in mine]
    return out

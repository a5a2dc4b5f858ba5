"""Mixture-of-experts models whose routing differs by rank ([Note: lockstep]).

Each rank's tokens are drawn so that some expert gets no token on that rank for every step:
a hand-written MoE (experts in an nn.ModuleList, or stored as 3-D tensors) routed by token id,
and Hugging Face Mixtral / Qwen2-MoE built from configs (transformers 5 stores each layer's
experts as 3-D tensors) with their own learned routers. Compared against the unsharded model
on the whole batch by tests/dist/harness.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard

import shardwise as sw
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
    def __init__(self, stacked: bool) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts: nn.Module = Stacked() if stacked else nn.ModuleList(
            Expert() for _ in range(E))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h), -1)  # (N, E)
        if isinstance(self.experts, Stacked):
            return self.experts(h, route, probs)  # one call, as transformers 5's experts
        out = torch.zeros_like(h)
        for e in range(E):
            idx = (route == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue  # this rank sends no token to expert e: it is not called
            y = self.experts[e](h[idx])
            out = out.index_add(0, idx, y * probs[idx, e : e + 1])
        return out


class Layer(nn.Module):
    def __init__(self, i: int, stacked: bool) -> None:
        super().__init__()
        self.i = i
        self.norm = nn.LayerNorm(D)
        self.moe = MoE(stacked)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # Layer 0 routes by id % E, layer 1 by (id // E) % E: the data decides both.
        route = (ids if self.i == 0 else ids // E) % E
        return h + self.moe(self.norm(h), route)


class Net(nn.Module):
    def __init__(self, stacked: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Layer(i, stacked) for i in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        h = self.embed(flat)
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


def _loss(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(m(b[0]), b[1].reshape(-1))


def _shard_hand(m: nn.Module, units: str) -> None:
    for layer in m.layers:
        if units in ("experts", "experts+layers"):
            for ex in layer.moe.experts:
                sw.fully_shard(ex)
        if units == "stacked":
            # FSDP2's argument: dim 0 (the experts) for the 3-D weights.
            sw.fully_shard(layer.moe.experts, shard_placement_fn=lambda p: Shard(0))
        if units != "experts":
            sw.fully_shard(layer)
    sw.fully_shard(m)


def hand_moe(rank: int, world: int, debug: bool, cases: tuple[str, ...]
             ) -> dict[str, dict[str, float]]:
    """Per-layer units ("layers"), per-expert units with and without layer units ("experts",
    "experts+layers", "experts-grad-op") and 3-D experts ("stacked", "stacked-grad-op")."""
    sw.set_debug(debug)
    out = {}
    for units in cases:
        stacked = units.startswith("stacked")

        def shard(m: nn.Module, units: str = units) -> None:
            if units == "experts-grad-op":  # experts kept gathered from forward to backward
                for layer in m.layers:
                    for ex in layer.moe.experts:
                        sw.fully_shard(ex, reshard_after_forward=False)
                    sw.fully_shard(layer)
                sw.fully_shard(m)
            elif units == "stacked-grad-op":
                for layer in m.layers:
                    sw.fully_shard(layer.moe.experts, reshard_after_forward=False)
                    sw.fully_shard(layer, reshard_after_forward=False)
                sw.fully_shard(m, reshard_after_forward=False)
            else:
                _shard_hand(m, units)

        out[units] = run_parity(rank, world, lambda s=stacked: Net(s), shard, _batch, _loss,
                                steps=3, per_rank=PER_RANK, what=f"hand MoE {units}")
    sw.set_debug(False)
    return out


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


def hf_moe(rank: int, world: int, cases: tuple[tuple[str, str], ...]) -> dict[str, object]:
    """Mixtral and Qwen2-MoE: decoder layers as units ("layers"), and the 3-D experts as their
    own units ("experts"). Returns the experts each rank routed tokens to, per step and layer
    (router hooks)."""
    out: dict[str, object] = {}
    for kind, units in cases:
        if True:
            seen: list[tuple[int, list[int]]] = []
            mine: set[int] = set()

            def build(kind: str = kind, seen: list = seen) -> nn.Module:
                m = _hf(kind)
                for layer in m.model.layers:
                    layer.mlp.gate.register_forward_hook(
                        lambda mod, a, o, seen=seen: seen.append(
                            (id(mod), sorted(set(o[2].reshape(-1).tolist())))))
                return m

            def shard(m: nn.Module, units: str = units, mine: set = mine) -> None:
                for layer in m.model.layers:
                    mine.add(id(layer.mlp.gate))  # the reference (a deep copy) has others
                    if units == "experts":
                        sw.fully_shard(layer.mlp.experts)
                    sw.fully_shard(layer)
                sw.fully_shard(m)

            out[f"{kind}/{units}"] = run_parity(rank, world, build, shard, _hf_batch, _hf_loss,
                                                steps=2, per_rank=1, what=f"{kind} {units}")
            # Experts this rank routed tokens to, per (step, layer).
            out[f"{kind}/{units}/used"] = [u for i, u in seen if i in mine]
    return out


# --- a unit that gets no gradient on some ranks only ---------------------------------------


class Branchy(nn.Module):
    """Every rank runs every unit; which side outputs reach the loss depends on the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.a, self.aux1, self.b, self.aux2 = (Expert() for _ in range(4))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, use: int) -> torch.Tensor:
        h = self.a(self.embed(ids))
        side1 = self.aux1(h)
        out = self.b(h)
        side2 = self.aux2(out)
        if use == 0:
            out = out + side1  # rank 0: aux1 gets a gradient, aux2 none
        elif use == 1:
            out = out + side2  # rank 1: the other way round; rank 2: neither
        return self.head(out)


def _branch_batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (n, 5), generator=g)
    use = torch.arange(n) // PER_RANK  # the rank each row goes to
    return ids, torch.roll(ids, 1, dims=1), use


def _branch_loss(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ids, labels, use = b
    losses = [nn.functional.cross_entropy(
        m(ids[i : i + PER_RANK], int(use[i])).reshape(-1, VOCAB),
        labels[i : i + PER_RANK].reshape(-1)) for i in range(0, len(ids), PER_RANK)]
    return torch.stack(losses).mean()


def no_grad_on_some_ranks(rank: int, world: int) -> dict[str, dict[str, float]]:
    out = {}
    for strategy in (True, False):
        def shard(m: nn.Module, raf: bool = strategy) -> None:
            for u in (m.a, m.aux1, m.b, m.aux2):
                sw.fully_shard(u, reshard_after_forward=raf)
            sw.fully_shard(m, reshard_after_forward=raf)

        out[str(strategy)] = run_parity(rank, world, Branchy, shard, _branch_batch,
                                        _branch_loss, steps=3, per_rank=PER_RANK,
                                        what=f"no gradient on some ranks raf={strategy}")
    return out

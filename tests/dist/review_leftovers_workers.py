"""Review leftovers: state dicts with tied keys and 0-d parameters, against nn.Module.

- Tied keys holding different values: the unsharded module's `load_state_dict` copies every
  key in turn, so the tied parameter ends with its *last* key's value. shardwise's loaders
  kept the first. `sw.load_full_state_dict`, `sw.load_checkpoint` and torch's
  `set_model_state_dict` now end as nn.Module does; `sw.load_pretrained` refuses (from its
  side `from_pretrained` unties such keys, which a model sharded tied cannot).
- A 0-d parameter through `set_model_state_dict(full_state_dict=True)`: torch hands 0-d
  values over as they are, and the sharded face had shape (1,): a size mismatch on every
  rank. The load now takes them, broadcast from rank 0 or not, into a meta model too (the
  face is now a `Replicate()` DTensor of shape (), issue 41).
- A 0-d parameter under dp x tp kept a plain face ((1,) on one dp rank, (0,) on the other),
  which torch's tools read as the whole value: `get_model_state_dict(full_state_dict=True)`
  and `dcp.save` lost it on some ranks.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

import shardwise as sw
from tests.dist import tp_workers as TPW
from tests.models import make_model

FULL = StateDictOptions(full_state_dict=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest difference over `want`'s keys (0-d and (1,) compare as the same value)."""
    worst = 0.0
    for k, v in want.items():
        g = got[k]
        g = g.full_tensor() if isinstance(g, DTensor) else g
        assert g.numel() == v.numel(), (k, tuple(g.shape), tuple(v.shape))
        worst = max(worst, (g.detach().reshape(-1).float() - v.reshape(-1).float())
                    .abs().max().item())
    return worst


def _lm(seed: int = 0, meta: bool = False) -> nn.Module:
    if meta:
        with torch.device("meta"):
            model = make_model("lm", seed)
    else:
        model = make_model("lm", seed)
    return sw.shard_model(model, auto_wrap_policy="transformer")


# --- tied keys ----------------------------------------------------------------------------


def tied_full_state_dict(rank: int, world: int) -> dict[str, float]:
    """TinyLM's `head.weight` is `embed.weight`; the state dict holds other values under
    `head.weight` (its last key). Each loader's result against nn.Module's on the same dict."""
    src = {k: v.clone() for k, v in make_model("lm", 3).state_dict().items()}
    sd = dict(src, **{"head.weight": src["embed.weight"] + 1.0})
    ref = make_model("lm", 0)
    ref.load_state_dict(sd)
    want = ref.state_dict()
    assert torch.equal(want["embed.weight"], sd["head.weight"])  # nn.Module: the last key
    out = {}
    loaders = {
        "sw": lambda m: sw.load_full_state_dict(m, dict(sd)),
        "sw from_rank0": lambda m: sw.load_full_state_dict(
            m, dict(sd) if rank == 0 else None, from_rank0=True),
        "torch full": lambda m: set_model_state_dict(m, dict(sd), options=FULL),
        "torch from_rank0": lambda m: set_model_state_dict(
            m, dict(sd) if rank == 0 else {}, options=FROM_RANK0),
    }
    for name, load in loaders.items():
        model = _lm()
        load(model)
        out[name] = _diff(sw.full_state_dict(model), want)
    # strict=False with only the head's key: the value comes from it (as nn.Module).
    ref = make_model("lm", 0)
    ref.load_state_dict({"head.weight": sd["head.weight"]}, strict=False)
    model = _lm()
    sw.load_full_state_dict(model, {"head.weight": sd["head.weight"]}, strict=False)
    out["sw head only"] = _diff(sw.full_state_dict(model), ref.state_dict())
    # Identical tied copies (a Hugging Face state dict) load as before.
    model = _lm()
    sw.load_full_state_dict(model, src)
    out["identical copies"] = _diff(sw.full_state_dict(model), src)
    return out


def untie(model: nn.Module) -> nn.Module:
    model.head.weight = nn.Parameter(model.embed.weight.detach() + 1.0)
    return model


def tied_checkpoint_save(rank: int, world: int, path: str) -> None:
    """A checkpoint of the same model untied: `head.weight` stored apart from the embedding."""
    model = sw.shard_model(untie(make_model("lm", 3)), auto_wrap_policy="transformer")
    sw.save_checkpoint(path, model)


def tied_checkpoint_load(rank: int, world: int, path: str) -> float:
    """That checkpoint into the tied model: as nn.Module loads the untied state dict."""
    ref = make_model("lm", 0)
    ref.load_state_dict(untie(make_model("lm", 3)).state_dict())
    model = _lm()
    sw.load_checkpoint(path, model)
    return _diff(sw.full_state_dict(model), ref.state_dict())


def tied_pretrained(rank: int, world: int, differing: str, identical: str) -> dict:
    """A tied Qwen2 folder that stores `lm_head.weight` too: refused when it differs from
    the embedding (naming both keys), loaded as from_pretrained when it is a copy."""
    from tests import hf_models as H

    model = H.meta_model(differing)
    sw.shard_model(model, auto_wrap_policy="transformer")
    try:
        sw.load_pretrained(model, differing)
        refused = ""
    except ValueError as e:
        refused = str(e)
    model = H.meta_model(identical)
    sw.shard_model(model, auto_wrap_policy="transformer")
    sw.load_pretrained(model, identical)
    ref = H.reference(identical)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight  # tied by from_pretrained
    return {"refused": refused,
            "identical": _diff(sw.full_state_dict(model), ref.state_dict())}


# --- 0-d parameters through set_model_state_dict ------------------------------------------


def zero_dim_set_full(rank: int, world: int) -> dict[str, float]:
    """An unsharded model's full state dict (0-d gates) through set_model_state_dict, with
    and without broadcast_from_rank0, into a real and a meta-built sharded model."""
    want = make_model("lm", 3).state_dict()
    for i in range(3):  # other values than the model's own (every TinyLM starts at 0.7)
        want[f"blocks.{i}.gate"] = torch.tensor(0.1 * (i + 1))
    out = {}
    for name, opts, meta in (("full", FULL, False), ("from_rank0", FROM_RANK0, False),
                             ("from_rank0 meta", FROM_RANK0, True)):
        model = _lm(meta=meta)
        sd = {k: v.clone() for k, v in want.items()}  # torch writes into the dict it gets
        set_model_state_dict(model, sd if rank == 0 or opts is FULL else {}, options=opts)
        out[name] = _diff(sw.full_state_dict(model), want)
        out[name + " gate"] = float(sw.full_state_dict(model)["blocks.1.gate"])
    return out


# --- 0-d parameters under dp x tp ---------------------------------------------------------


class GatedBlock(TPW.Block):
    def __init__(self, gate: float) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.tensor(gate))  # 0-d, inside a TP-parallelized block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * (super().forward(x) - x)


def gated_lm(seed: int = 0) -> TPW.TinyLM:
    torch.manual_seed(seed)
    model = TPW.TinyLM()
    model.blocks = nn.ModuleList([GatedBlock(0.3 + seed), GatedBlock(0.6 + seed)])
    return model


def _tp_model(dp: int, tp: int, seed: int = 0) -> tuple[nn.Module, object]:
    if tp == 1:  # no tensor parallelism: plain FSDP over the world
        model = gated_lm(seed)
        for b in model.blocks:
            sw.fully_shard(b)
        return sw.fully_shard(model), None
    mesh = TPW.make_mesh(dp, tp)
    return TPW.parallelize(gated_lm(seed), mesh), mesh


def zero_dim_tp_full(rank: int, world: int) -> dict[str, float]:
    """dp 2 x tp 2: get_model_state_dict(full_state_dict=True) on every rank, then two
    training steps (torch's and sw's clipping see the gate) and the full state dict again."""
    model, mesh = _tp_model(2, 2)
    ref = gated_lm()
    before = _diff(get_model_state_dict(model, options=FULL), ref.state_dict())
    gate = model.blocks[0].gate
    assert isinstance(gate, DTensor) and tuple(gate.shape) == (), (type(gate), gate.shape)
    assert all(isinstance(pl, Replicate) for pl in gate.placements), gate.placements
    TPW.train_both(model, ref, mesh, 2, "gated dp 2 x tp 2")
    return {"before": before,
            "after": _diff(get_model_state_dict(model, options=FULL), ref.state_dict())}


def zero_dim_tp_dcp_save(rank: int, world: int, path: str) -> None:
    model, _ = _tp_model(2, 2)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)


def zero_dim_tp_dcp_load(rank: int, world: int, dp: int, tp: int, path: str) -> float:
    """What dp 2 x tp 2 saved, loaded at another (dp, tp) into other weights."""
    model, _ = _tp_model(dp, tp, seed=5)
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    return _diff(sw.full_state_dict(model), gated_lm().state_dict())

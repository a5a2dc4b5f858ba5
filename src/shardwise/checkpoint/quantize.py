"""A frozen base quantized to NF4 as it loads (QLoRA): each rank quantizes only its rows.

[Note: NF4 by rows] torchao's `to_nf4(w, block_size, scaler_block_size)` cuts the flattened
weight into blocks of `block_size` values, each scaled by its absmax; the absmaxes ("scalers")
are then double-quantized to int8 in blocks of `scaler_block_size`, after subtracting their
mean over the *whole* tensor. Everything but that mean is local to a block. So a rank holding
dim-0 rows that are whole scaler blocks (NF4's own sharding rule, FSDP2's too) computes its
block absmaxes, all-gathers them over its shard group (numel / block_size values, 1/32 of
the weight's bf16 bytes), takes their mean exactly as torchao does, and double-quantizes
its own blocks: the shard equals `torch.chunk(to_nf4(w), S)[rank]` bit for bit, without
any rank reading more than its rows of the checkpoint. The quantized base is frozen: only
tensors that do not require grad are quantized.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..engine.comm import collectives as C

if TYPE_CHECKING:  # the engine's core stays unimported by `export --hf` (train/qlora.py)
    from ..engine.core.sharded_param import ShardedParam

QUANTIZE_KINDS = ("nf4",)
_PIECE = 1 << 16  # values quantized at once (a multiple of the block size)


@dataclass(frozen=True)
class NF4:
    """NF4 (QLoRA) quantization of a model's frozen linear weights, for `load_pretrained`.

    block_size / scaler_block_size: torchao's `to_nf4` arguments (its defaults 64 and 256).
    skip: module names (a full name, or its last parts after a dot) whose weight stays in
    the model's dtype; the output head by default, as transformers' 4-bit loading keeps it.
    """

    block_size: int = 64
    scaler_block_size: int = 256
    skip: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        for name in ("block_size", "scaler_block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2 or v % 2:
                raise ValueError(f"NF4.{name}={v!r} is not allowed: an even int >= 2")
        if isinstance(self.skip, str) or not all(isinstance(s, str) for s in self.skip):
            raise ValueError(f"NF4.skip={self.skip!r} is not allowed: a tuple of module names")

    @property
    def whole(self) -> int:
        """Values per scaler block: each shard must hold a multiple of it."""
        return self.block_size * self.scaler_block_size


def resolve(quantize: object) -> NF4 | None:
    """`load_pretrained`'s `quantize` argument as a spec (None: no quantization)."""
    if quantize is None or isinstance(quantize, NF4):
        return quantize
    if quantize == "nf4":
        return NF4()
    raise ValueError(f"quantize={quantize!r} is not allowed: None, 'nf4' or sw.NF4(...)")


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    # peft wraps an adapted linear: its frozen weight is `<name>.base_layer`'s, which the
    # user names as the module they adapt (`q_proj`, not `q_proj.base_layer`).
    names = {name, name.removesuffix(".base_layer")}
    return any(n == s or n.endswith("." + s) for n in names for s in skip)


def frozen_linears(model: nn.Module, spec: NF4) -> list[tuple[str, nn.Linear]]:
    """(module name, module) of every `nn.Linear` outside `spec.skip` whose weight is frozen:
    the weights NF4 quantizes (the loader, on the sharded model; the planner, on the meta
    model before sharding)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not _skipped(name, spec.skip)
            and not m.weight.requires_grad]


def splits_evenly(rows: int, cols: int, shard_size: int, spec: NF4) -> bool:
    """NF4's own sharding rule: dim 0 divisible by the ranks, each rank's rows whole scaler
    blocks (rows / rank x columns a multiple of block_size x scaler_block_size)."""
    return rows % shard_size == 0 and (rows // shard_size * cols) % spec.whole == 0


def refusal(bad: list[str], shard_size: int, spec: NF4) -> ValueError:
    """The error naming every weight NF4 cannot shard over `shard_size` ranks, and the ways
    out (from the library and from `shardwise train` / `shardwise plan`)."""
    return ValueError(
        f"quantize=nf4 cannot shard {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''} "
        f"over {shard_size} ranks: NF4 splits a weight only evenly, and each rank's rows must "
        f"hold whole scaler blocks (dim 0 divisible by the ranks, rows/rank x columns a "
        f"multiple of block_size x scaler_block_size = {spec.whole}). Use another number "
        f"of ranks, smaller blocks (sw.NF4(block_size=..., scaler_block_size=...); "
        f"shardwise train: --model.nf4_block_size / --model.nf4_scaler_block_size), or "
        f"leave those modules in the model's dtype (sw.NF4(skip=...); shardwise train: "
        f"--model.nf4_skip)")


def nf4_bytes(numel: int, spec: NF4, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of `numel` values as torchao's NF4Tensor stores them (its `__tensor_flatten__`
    names), quantized from `dtype`: 4-bit codes two to a byte, one int8 scaler per block of
    block_size values, one factor in `dtype` per scaler block of block_size x
    scaler_block_size values, the scalers' mean and the 16 NF4 levels in `dtype`. The
    all-gather moves the first three ([Note: all-gather extensions])."""
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    return {"quantized_data": numel // 2, "quantized_scalers": numel // spec.block_size,
            "quantization_factor": numel // spec.whole * size, "scaler_mean": size,
            "nf4": 16 * size}


def targets(model: nn.Module, spec: NF4) -> dict[str, ShardedParam]:
    """state-dict key -> sharded parameter, for every frozen `nn.Linear` weight outside
    `spec.skip`. ValueError (before any collective) naming every weight NF4 cannot shard
    as it stands: not 2-D rows of whole scaler blocks per rank, tensor parallel, already a
    subclass."""
    out: dict[str, ShardedParam] = {}
    bad: list[str] = []
    S = 1
    for name, m in frozen_linears(model, spec):
        sp = getattr(m.weight, "_sw_param", None)
        if sp is None or sp.requires_grad:
            continue  # not sharded (ignored) or trained: stays as it is
        key = f"{name}.weight"
        S = sp.shard_size
        rows, cols = sp.global_shape
        if sp.tp is not None or sp.subclass or getattr(sp, "shard_dim", 0) != 0:
            bad.append(f"{key} (tensor parallel, already a tensor subclass, or sharded on "
                       "another dim)")
        elif not splits_evenly(rows, cols, S, spec):
            bad.append(f"{key} {[rows, cols]}")
        else:
            out[key] = sp
    if bad:
        raise refusal(bad, S, spec)
    if not out:
        raise ValueError("quantize=nf4 found no frozen nn.Linear weight to quantize: freeze "
                         "the base first (peft's get_peft_model does), or load without it")
    return out


@functools.cache
def _lut(dtype: torch.dtype) -> torch.Tensor:
    """torchao's 16 NF4 levels in `dtype` (read off a tiny to_nf4, not restated here)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4(torch.ones(4, dtype=dtype), 2, 2).nf4


def rows_part(local: torch.Tensor, spec: NF4) -> tuple[torch.Tensor, torch.Tensor]:
    """(NF4 codes, block absmaxes) of this rank's rows `local` ((rows, cols), the
    parameter's dtype): the part of [Note: NF4 by rows] that needs no other rank, so the
    rows can be freed as soon as they are read."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
        NF4Tensor,
        get_block_absmax,
    )

    flat = local.reshape(-1)
    bs = spec.block_size
    absmax = get_block_absmax(flat, bs)  # (numel / bs,)
    lut = _lut(local.dtype).to(local.device)
    # Codes depend on their own block alone: made a piece at a time, torchao's temporaries
    # (several bytes a value) stay bounded by the piece instead of the weight.
    codes = torch.empty(flat.numel() // 2, dtype=torch.uint8, device=local.device)
    step = max(bs, _PIECE // bs * bs)
    for start in range(0, flat.numel(), step):
        piece = flat[start:start + step]
        codes[start // 2:(start + piece.numel()) // 2] = \
            NF4Tensor.convert_to_norm_float_weight(piece, piece.numel() // bs, bs, lut)
    return codes, absmax


def finish(sp: ShardedParam, codes: torch.Tensor, absmax: torch.Tensor, spec: NF4,
           dtype: torch.dtype) -> torch.Tensor:
    """This rank's NF4 shard from `rows_part`'s output: equal to torchao's chunk of the
    whole weight quantized in one process. One all-gather over the parameter's shard
    group: every rank of it calls this for the same parameters in the same order."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import (
        NF4Tensor,
        SubclassTensorArgs,
        get_block_absmax,
    )

    S, sbs = sp.shard_size, spec.scaler_block_size
    n_local = absmax.numel()
    every = torch.empty(n_local * S, dtype=absmax.dtype, device=absmax.device)
    group = sp.owner.mesh.shard_group if sp.owner is not None else None
    C.all_gather(every, absmax, group, False, label=f"nf4 scalers {sp.fqn}").wait()
    mean = every.mean()  # the whole tensor's, as to_nf4 takes it
    centered = (absmax - mean).view(-1, sbs)  # (scaler blocks, sbs)
    factor = 256 / (2 * get_block_absmax(centered.reshape(-1), sbs))  # (scaler blocks,)
    scalers = (centered * factor.unsqueeze(-1)).round().clamp(-128, 127)
    shape = torch.Size((sp.local_rows, *sp.rest))
    meta = SubclassTensorArgs(shape, (shape[1], 1), 0, dtype, absmax.device, False)
    return NF4Tensor(meta, spec.block_size, n_local * S, sbs,
                     scalers.flatten().to(torch.int8), factor.contiguous(), mean, codes,
                     _lut(dtype).to(absmax.device))

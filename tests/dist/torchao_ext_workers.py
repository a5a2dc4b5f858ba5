"""torchao's quantized weights through FSDP2's all-gather extension, on torch's FSDP2 and on
shardwise with the same client code (helpers in all_gather_ext_workers.py).

- QLoRA: frozen `NF4Tensor` base weights (torchtune's recipe: `nn.Parameter(to_nf4(w),
  requires_grad=False)`, computed with `linear_nf4`) plus trainable LoRA adapters, sharded
  per block and at the root. NF4 gathers three inner tensors of three dtypes (int8
  scalers, float factors, uint8 codes): one all-gather of bytes. NF4 splits only evenly
  (FSDP2 too), so every dim 0 divides 2 and 3 ranks and every shard its blocks.
- float8 training: `convert_to_float8_training(model, config=Float8LinearConfig(
  enable_fsdp_float8_all_gather=True, emulate=True))`: the weights gather as float8 bytes
  through the legacy hook, whose amax all-reduce runs inside it.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

import shardwise as sw
from tests.dist.all_gather_ext_workers import (
    IMPLS,
    Failures,
    Net,
    batches,
    knobs,
    local_types,
    reference,
    shard,
    sq_loss,
    train,
)

# Small NF4 blocks so that tiny weights split: one scaler per 32 values, one factor per 8
# scalers, so a shard must hold a multiple of 256 values.
BLOCK, SCALER_BLOCK = 32, 8
D, H = 48, 96  # (96, 48) and (48, 96) weights: 4608 values, 18 factors, 6 | 18, 6 | 48


class QLoRALinear(nn.Module):
    """A frozen NF4 weight and a rank-r LoRA adapter beside it."""

    def __init__(self, d_in: int, d_out: int, r: int = 4) -> None:
        super().__init__()
        w = torch.randn(d_out, d_in) / math.sqrt(d_in)
        self.weight = nn.Parameter(to_nf4(w, BLOCK, SCALER_BLOCK), requires_grad=False)
        self.lora_a = nn.Linear(d_in, r, bias=False)
        self.lora_b = nn.Linear(r, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.05)  # both adapters move from step 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


class QBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = QLoRALinear(D, H), QLoRALinear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class QNet(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([QBlock() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _qnet(seed: int) -> QNet:
    torch.manual_seed(seed)
    return QNet()


def nf4_bytes(model: nn.Module) -> int:
    """Bytes of the NF4 weights' quantized data, scalers and factors held here."""
    total = 0
    for n, p in model.named_parameters():
        if n.endswith(".weight") and not n.endswith(("lora_a.weight", "lora_b.weight")):
            t = getattr(p, "_local_tensor", p)
            total += sum(x.numel() * x.element_size() for x in
                         (t.quantized_data, t.quantized_scalers, t.quantization_factor))
    return total


def qlora_parity(rank: int, world: int, cases: list[tuple[bool, bool, bool]]) -> None:
    """cases: (reshard_after_forward, bf16 mixed precision, CPU offload)."""
    fails = Failures()
    whole = nf4_bytes(_qnet(0))
    data = batches(3, world, 2, D)
    for raf, mp, offload in cases:
        what = f"QLoRA raf={raf} mp={mp} offload={offload}"
        got = {}
        for impl in IMPLS:
            model = _qnet(0)  # rebuilt from the seed: a deepcopy would re-quantize
            shard(impl, model, list(model.blocks), knobs(raf, mp, offload))
            lora = [p for n, p in model.named_parameters() if "lora" in n]
            got[impl] = train(model, data, rank, world, sq_loss, params=lora)
            kinds = local_types(model, "up.weight") | local_types(model, "down.weight")
            fails.check(kinds == {"NF4Tensor"}, f"{what} {impl}: NF4 shards are {kinds}")
            mine = nf4_bytes(model)
            fails.check(mine * world == whole,
                        f"{what} {impl}: {mine} bytes of NF4 here, {whole} in all")
        fails.close(got["shardwise"], got["fsdp2"], f"{what}: shardwise vs FSDP2")
        if not mp:
            ref = _qnet(0)
            ref_losses = reference(ref, data, sq_loss, world)
            fails.close(got["shardwise"], ref_losses, f"{what}: shardwise vs unsharded")
    fails.raise_any(rank)


def qlora_state_dict(rank: int, world: int, path: str) -> None:
    """NF4 shards through `state_dict()` / `load_state_dict` and DCP save / load: a model
    built from another seed computes what the first one does after taking its weights."""
    import torch.distributed.checkpoint as dcp

    fails = Failures()
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(5))
    for impl in IMPLS:
        a, b, c = _qnet(0), _qnet(1), _qnet(2)
        for m in (a, b, c):
            shard(impl, m, list(m.blocks), {})
        want = a(x).detach()
        sd = a.state_dict()
        kinds = {type(v._local_tensor).__name__ for k, v in sd.items()
                 if k.endswith(("up.weight", "down.weight"))}
        fails.check(kinds == {"NF4Tensor"}, f"{impl}: state dict NF4 shards are {kinds}")
        b.load_state_dict(sd)
        fails.check(torch.equal(b(x).detach(), want), f"{impl}: load_state_dict round trip")
        dcp.save(a.state_dict(), checkpoint_id=f"{path}/{impl}")
        sd_c = c.state_dict()
        dcp.load(sd_c, checkpoint_id=f"{path}/{impl}")
        c.load_state_dict(sd_c)
        fails.check(torch.equal(c(x).detach(), want), f"{impl}: DCP save / load")
    # shardwise's own full state dicts and checkpoints hold plain tensors: NF4 is refused by
    # name on every rank (same point of the state dict everywhere), the adapters alone save.
    for what, call in (("full_state_dict", lambda: sw.full_state_dict(a)),
                       ("save_checkpoint", lambda: sw.save_checkpoint(f"{path}/sw", a))):
        try:
            call()
            fails.check(False, f"sw.{what} accepted NF4 parameters")
        except NotImplementedError as e:
            fails.check("blocks.0.up.weight" in str(e) and "NF4Tensor" in str(e),
                        f"sw.{what}: the refusal does not name the NF4 weight: {e}")
    sw.save_checkpoint(f"{path}/lora", a, trainable_only=True)
    fails.raise_any(rank)


# --- float8 training -----------------------------------------------------------------------


def _float8_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = Net(D, H)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    return convert_to_float8_training(model, config=config)


def float8_parity(rank: int, world: int, cases: list[tuple[bool, bool]]) -> None:
    """cases: (reshard_after_forward, precompute the scales after each step, torchtitan's
    `precompute_float8_dynamic_scale_for_fsdp`)."""
    fails = Failures()
    data = batches(3, world, 2, D)
    for raf, precompute in cases:
        what = f"float8 raf={raf} precompute={precompute}"
        after = precompute_float8_dynamic_scale_for_fsdp if precompute else None
        got = {}
        for impl in IMPLS:
            model = _float8_net(0)
            shard(impl, model, list(model.blocks), knobs(raf, False, False))
            got[impl] = train(model, data, rank, world, sq_loss, after_step=after)
            kinds = local_types(model, "weight")
            fails.check(kinds == {"WeightWithDynamicFloat8CastTensor"},
                        f"{what} {impl}: weight shards are {kinds}")
        fails.close(got["shardwise"], got["fsdp2"], f"{what}: shardwise vs FSDP2")
        ref_losses = reference(_float8_net(0), data, sq_loss, world)
        fails.close(got["shardwise"], ref_losses, f"{what}: shardwise vs unsharded float8")
    fails.raise_any(rank)

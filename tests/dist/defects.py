"""Workers for issue 12's defects: each one failed before its fix (see test_defects.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardwise as sw
from tests.clients import Block as GPTBlock
from tests.clients import DCBlock, DCNet, GPTShape, NanoGPT, add_lora, gpt_batch
from tests.dist.harness import compare_params, run_parity

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


def _gpt_loss(m: nn.Module, b: tuple) -> torch.Tensor:
    return m(*b)


def _gpt_batch(step: int, n: int) -> tuple:
    return gpt_batch(GPTShape(), 100 + step, n)


def _shard_gpt(strategy: str):
    return lambda m: sw.shard_model(m, sharding_strategy=strategy,
                                    auto_wrap_policy=sw.transformer_policy({GPTBlock}))


def frozen_in_units(rank: int, world: int) -> dict:
    """LoRA (base frozen) and attention-frozen/MLP-trained, in every unit, with clipping."""
    def lora() -> nn.Module:
        return add_lora(NanoGPT())

    def attn_frozen() -> nn.Module:
        m = NanoGPT()
        for b in m.transformer.h:
            b.attn.requires_grad_(False)
        return m

    def second_block_frozen() -> nn.Module:
        # A unit with frozen weights that follows a trainable one in backward order.
        m = NanoGPT()
        m.transformer.h[1].attn.requires_grad_(False)
        m.transformer.h[1].ln_1.requires_grad_(False)
        return m

    out = {}
    for name, build in (("lora", lora), ("attn_frozen", attn_frozen),
                        ("second_block_frozen", second_block_frozen)):
        for strategy in STRATEGIES:
            out[f"{name}/{strategy}"] = run_parity(
                rank, world, build, _shard_gpt(strategy), _gpt_batch, _gpt_loss,
                what=f"{name} {strategy}")
    return out


def requires_grad_after_sharding(rank: int, world: int) -> dict:
    """Freeze block 0 after sharding (steps 1-2), unfreeze it again (steps 3-4)."""
    def toggle(step: int, model: nn.Module, ref: nn.Module) -> None:
        if step in (1, 3):
            frozen = step == 1
            model.transformer.h[0].requires_grad_(not frozen)
            ref.transformer.h[0].requires_grad_(not frozen)
        if step == 2:
            # Frozen for a whole step: no gradient anywhere in block 0.
            for p in model.transformer.h[0].parameters():
                assert p.grad is None, "a frozen parameter got a gradient"

    out = {}
    for strategy in STRATEGIES:
        out[strategy] = run_parity(rank, world, NanoGPT, _shard_gpt(strategy), _gpt_batch,
                                   _gpt_loss, steps=5, between_steps=toggle,
                                   what=f"freeze after sharding {strategy}")
    return out


class UnusedNet(nn.Module):
    """A Linear never called, and a block whose output never reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 9)
        self.never = nn.Linear(9, 5)
        self.side = nn.Sequential(nn.Linear(9, 4))
        self.b = nn.Sequential(nn.Linear(9, 9), nn.Tanh())
        self.head = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.side(h)  # computed, thrown away: no gradient reaches it
        return self.head(self.b(h))


def unused_params(rank: int, world: int) -> dict:
    def shard(m: nn.Module) -> None:
        sw.fully_shard(m.side)
        sw.fully_shard(m.b)
        sw.fully_shard(m)

    def check(step: int, model: nn.Module, ref: nn.Module) -> None:
        if step == 0:
            return
        for name in ("never.weight", "never.bias", "side.0.weight", "side.0.bias"):
            p = model.get_parameter(name)
            assert p.grad is None, f"{name}: unused, yet its gradient is {p.grad}"

    def batch(step: int, n: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        return torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)

    return run_parity(rank, world, UnusedNet, shard, batch,
                      lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), steps=3,
                      between_steps=check, what="unused parameters")


def load_after_forward(rank: int, world: int) -> float:
    """load_full_state_dict after a forward with grad and no backward takes effect."""
    torch.manual_seed(0)
    model, other = NanoGPT(), NanoGPT()
    ref = copy.deepcopy(other)
    _shard_gpt("FULL_SHARD")(model)
    x, y = _gpt_batch(0, 2)
    model(x, y)  # grad enabled, no backward: the root stays unsharded
    sw.load_full_state_dict(model, other.state_dict())
    with torch.no_grad():
        got, want = model(x, y).item(), ref(x, y).item()
    assert abs(got - want) < 1e-5, f"after load: loss {got}, loaded weights give {want}"
    compare_params(model, ref, 0.0, "loaded")
    return got


def no_sync_accumulates_in_reduce_dtype(rank: int, world: int) -> float:
    """Four micro-batches under no_sync in bf16 with fp32 reduction == four synced ones."""
    mp = sw.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def make() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 3))
        sw.fully_shard(m[0], mp_policy=mp)
        sw.fully_shard(m[2], mp_policy=mp)
        sw.fully_shard(m, mp_policy=mp)
        return m

    acc, each = make(), make()
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 16, generator=g) for _ in range(4)]
    for i, x in enumerate(xs):
        acc.set_requires_gradient_sync(i == len(xs) - 1)
        acc(x).float().pow(2).mean().backward()
        each(x).float().pow(2).mean().backward()  # reduced every time, summed in fp32
    worst = 0.0
    compared = 0
    for (n, p), q in zip(acc.named_parameters(), each.parameters()):
        # A gradient lost under no_sync must fail here, not be skipped as "no gradient".
        assert (p.grad is None) == (q.grad is None), \
            f"{n}: accumulated grad is {p.grad is None and 'None' or 'set'}, reference's is " \
            f"{q.grad is None and 'None' or 'set'}"
        if q.grad is None:
            continue
        compared += 1
        d = (p.grad - q.grad).abs().max().item() / max(q.grad.abs().max().item(), 1e-12)
        worst = max(worst, d)
        # bf16 accumulation is off by ~1e-3 relative; fp32 accumulation by rounding only.
        assert d < 2e-5, f"{n}: accumulated gradient off by {d:.2e} (relative)"
    assert compared == len(list(each.parameters())), f"compared {compared} gradients"
    return worst


def dataclass_activations(rank: int, world: int) -> dict:
    def shard(m: nn.Module) -> None:
        sw.shard_model(m, auto_wrap_policy=sw.transformer_policy({DCBlock}))

    def batch(step: int, n: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)

    return run_parity(rank, world, DCNet, shard, batch,
                      lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), what="dataclass")


class CkptGPT(NanoGPT):
    """Each sharded block is called through torch.utils.checkpoint from outside (as
    checkpoint_wrapper does), so its recomputation runs the unit's hooks again."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.transformer.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)).float(),
                                           targets.view(-1))


def checkpointed_mixed_precision(rank: int, world: int) -> dict:
    """Activation checkpointing under bf16: the recomputation casts inputs as forward did."""
    # Blocks compute in bf16 and hand fp32 back; the root stays fp32, so every block's
    # input arrives in fp32 and must be cast again when the block is recomputed.
    # bf16 compute against an fp32 reference: bf16 rounding, not a reduction-order bound.
    return run_parity(rank, world, CkptGPT, _bf16_blocks_fp32_root, _gpt_batch, _gpt_loss,
                      tol=5e-2, what="checkpoint + bf16")


def _bf16_blocks_fp32_root(m: nn.Module) -> None:
    mp = sw.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    for b in m.transformer.h:
        sw.fully_shard(b, mp_policy=mp)
    sw.fully_shard(m)


def per_unit_output_dtype(rank: int, world: int) -> dict:
    """A bf16 block that hands fp32 to an fp32 root (output_dtype on a non-root unit)."""
    return run_parity(rank, world, NanoGPT, _bf16_blocks_fp32_root, _gpt_batch, _gpt_loss, tol=5e-2,
                      what="per-unit output_dtype")

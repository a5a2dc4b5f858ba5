"""QLoRA from a Hugging Face folder: `sw.load_pretrained(..., quantize=sw.NF4(...))` into a
meta-built peft model sharded with shardwise, against torchao's `to_nf4` of the whole weights
in one process, an unsharded QLoRA model, and torch's FSDP2 running the same client code.

The tiny Llama (hidden 48, MLP 96, 2 kv heads) has linear weights whose dim 0 divides 2 and
3 ranks and whose per-rank rows hold whole scaler blocks of 16 x 4 values (NF4's own
sharding rule); its embedding and output head (53 rows) split unevenly and stay plain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.engine.comm import collectives as C

SPEC = dict(block_size=16, scaler_block_size=4)
SHAPE = dict(hidden_size=48, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2)
TARGETS = ["q_proj", "v_proj"]
STEPS, PER_RANK, SEQ = 3, 2, 8


def save_folder(folder: str) -> str:
    from tests.hf_models import save_tiny

    return save_tiny("llama", folder, **SHAPE)


def _peft(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                            lora_dropout=0.0))


def _sharded(folder: str) -> nn.Module:
    import transformers as tf

    cfg = tf.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = _peft(tf.AutoModelForCausalLM.from_config(cfg))
    sw.shard_model(model, auto_wrap_policy="transformer")
    sw.materialize(model, init_fn=model.get_base_model()._init_weights, seed=0)
    return model


def _quantize_linears(model: nn.Module) -> None:
    """torchtune's recipe on one process: every Linear weight but the head to_nf4, frozen."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not name.endswith("lm_head") and \
                not m.weight.requires_grad:
            m.weight = nn.Parameter(to_nf4(m.weight.detach(), **SPEC), requires_grad=False)


def _reference(folder: str, adapters: dict[str, torch.Tensor]) -> nn.Module:
    """from_pretrained, peft, the sharded run's adapters, base linears quantized whole."""
    from transformers import AutoModelForCausalLM

    model = _peft(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in adapters:
                p.copy_(adapters[n])
    _quantize_linears(model)
    return model


def _batch(step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 53, (n, SEQ + 1), generator=g)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _train(model: nn.Module, rank: int, world: int, sharded: bool) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        full = _batch(step, PER_RANK * world)
        x = full[rank * PER_RANK:(rank + 1) * PER_RANK] if sharded else full
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sharded:
            t = loss.detach().double().reshape(1)
            C.all_reduce(t, None)
            losses.append(t.item() / world)
        else:
            losses.append(loss.item())
    return losses


def _inner(t: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: getattr(t, k) for k in ("quantized_scalers", "quantization_factor",
                                       "quantized_data", "scaler_mean")}


def load_nf4(rank: int, world: int, folder: str) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4

    out: dict = {}
    # torchao's default blocks (64 x 256 = 16384 values per rank) fit no weight here:
    # refused on every rank, naming the weights, before anything is read.
    model = _sharded(folder)
    try:
        sw.load_pretrained(model, folder, strict=False, quantize="nf4")
    except ValueError as e:
        out["refused"] = str(e)
    res = sw.load_pretrained(model, folder, strict=False, quantize=sw.NF4(**SPEC))
    out["quantized"] = sorted(res.quantized_keys)
    stored = load_file(f"{folder}/model.safetensors")
    # Each rank's shard equals torchao's chunk of the whole weight quantized in one
    # process, bit for bit, and holds 1/N of its bytes.
    mismatched, nbytes, whole_bytes = [], 0, 0
    for key in res.quantized_keys:
        local = model.get_parameter(key).to_local()
        assert isinstance(local, NF4Tensor), (key, type(local))
        src = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        whole = to_nf4(stored[src].float(), **SPEC)
        mine = torch.chunk(whole, world)[rank]
        for k, v in _inner(local).items():
            if not torch.equal(v, _inner(mine)[k]):
                mismatched.append(f"{key}.{k}")
        nbytes += sum(v.numel() * v.element_size() for k, v in _inner(local).items()
                      if k != "scaler_mean")
        whole_bytes += sum(v.numel() * v.element_size() for k, v in _inner(whole).items()
                           if k != "scaler_mean")
    out["mismatched"] = mismatched
    out["byte_share"] = nbytes / whole_bytes
    # Gathered for compute, the weights are torchao's dequantized whole weights.
    dequant_diff = 0.0
    for block in model.get_base_model().model.layers:
        block.unshard()
        for name, m in block.named_modules():
            if isinstance(m, nn.Linear) and isinstance(m.weight, NF4Tensor):
                key = f"model.layers.{block.self_attn.layer_idx}.{name}".replace(
                    ".base_layer", "") + ".weight"
                ref = to_nf4(stored[key].float(), **SPEC).get_original_weight()
                dequant_diff = max(dequant_diff,
                                   (m.weight.get_original_weight() - ref).abs().max().item())
        block.reshard()
    out["dequant_diff"] = dequant_diff

    adapters = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    ref = _reference(folder, adapters)
    x = _batch(99, 2)
    with torch.no_grad():
        out["logits_diff"] = (model(input_ids=x[:, :-1], use_cache=False).logits
                              - ref(input_ids=x[:, :-1], use_cache=False).logits
                              ).abs().max().item()
    fsdp2 = _reference(folder, adapters)
    for layer in fsdp2.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(fsdp2)
    out["sw"] = _train(model, rank, world, sharded=True)
    out["fsdp2"] = _train(fsdp2, rank, world, sharded=True)
    out["ref"] = _train(ref, rank, world, sharded=False)
    trained = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    out["adapter_diff"] = max((trained[n] - p.detach()).abs().max().item()
                              for n, p in ref.named_parameters() if n in trained)
    return out

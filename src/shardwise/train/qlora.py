"""QLoRA for `shardwise train --model.hf PATH --lora.rank R --model.quantize nf4`.

What a QLoRA run quantizes is decided in one place (`SPEC`), used by the loader (build_hf:
`sw.load_pretrained(..., quantize=SPEC)`) and by `export --hf`, which must merge the
adapters into the weights the run computed with: the base's NF4 values, dequantized.

[Note: QLoRA checkpoints] The base is frozen and re-created bit for bit from model.hf at
every start (each rank quantizes its rows, checkpoint/quantize.py), so a checkpoint holds
what trains: the adapters and their optimizer state (save_checkpoint(trainable_only=True),
as for LoRA), plus the run's config, which names the base folder and the quantization.
The NF4 bytes are not saved: they would add half a byte per base parameter to every
checkpoint and could only ever equal what model.hf gives again. A resume whose base folder
changed is refused with the data/tokenizer identity check (identity.py) like any LoRA run.
"""

from __future__ import annotations

import torch

from ..checkpoint.quantize import NF4
from ..engine.ext.materialize import lora_adapters
from .hf_deps import missing

# torchao's default blocks (64 values per scaler, 256 scalers per factor), as torchtune's
# and peft's QLoRA recipes quantize; the output head stays in the model's dtype. A run's own
# spec is its config's (ModelSection.nf4: --model.nf4_block_size and the rest).
SPEC = NF4()


def check_quantize(kind: str, lora_rank: int, strategy: str) -> None:
    """model.quantize's cross-checks: LoRA adapters to train, a sharded strategy (NF4
    gathers through FSDP2's all-gather hooks, which need a shard mesh), torchao installed."""
    if not lora_rank:
        raise ValueError(f"model.quantize={kind!r} needs lora.rank > 0: the NF4 base is "
                         "frozen, so a QLoRA run trains LoRA adapters beside it (e.g. "
                         "--lora.rank 8)")
    if strategy == "NO_SHARD":
        raise ValueError(f"model.quantize={kind!r} with shard.sharding_strategy=NO_SHARD is "
                         "not supported: NF4 weights gather through FSDP2's all-gather hooks; "
                         "use FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD")
    if missing("torchao"):
        raise ValueError(f"model.quantize={kind!r} needs torchao, which is not installed: "
                         "pip install 'shardwise[qlora]'")


def quantized_keys(keys: list[str], linears: list[str], spec: NF4 = SPEC) -> set[str]:
    """The stored keys a QLoRA run held in NF4: the weights of `linears` (the base model's
    nn.Linear module names) outside spec.skip (the run's model.nf4_skip)."""
    names = {f"{n}.weight" for n in linears
             if not any(n == s or n.endswith("." + s) for s in spec.skip)}
    return {k for k in keys if k in names or any(n.endswith("." + k) or k.endswith("." + n)
                                                 for n in names)}


def as_trained(t: torch.Tensor, dtype: torch.dtype, spec: NF4 = SPEC) -> torch.Tensor:
    """The values a QLoRA run computed with for base weight `t`: to_nf4 of it in the run's
    model dtype, dequantized (what the sharded NF4 shards gather to, bit for bit)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4(t.to(dtype).contiguous(), spec.block_size,
                  spec.scaler_block_size).get_original_weight()


def qlora_dtype(cfg: object, stored: torch.dtype) -> torch.dtype:
    """The dtype `export --hf` writes a stored tensor in: a QLoRA run's merged model is bf16
    (its floating tensors; the NF4 base has no float32 values to keep), others as stored."""
    quantize = getattr(getattr(cfg, "model", None), "quantize", "")
    return torch.bfloat16 if quantize and stored.is_floating_point else stored


def linear_names(src: str) -> list[str]:
    """The nn.Linear module names of the model in folder `src` (built on the meta device)."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    return [n for n, m in skeleton.named_modules() if isinstance(m, nn.Linear)]


def mark_bf16(folder: str) -> None:
    """Record bf16 as the exported model's dtype in its config.json, as save_pretrained of a
    bf16 model does (`from_pretrained(dtype="auto")` then loads it as bf16)."""
    import json
    import os

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for k in keys:
        config[k] = "bfloat16"
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """[Note: QLoRA build] The adapters of a meta-built peft model, made on the host and
    initialized before sharding, by peft's own init (A Kaiming-uniform, B zero), layer by
    layer in module order from `seed`. A QLoRA build then skips `sw.materialize`, which
    would allocate every base shard in model.dtype first (measured: +149 MiB RSS after
    loading per rank, benchmarks/qlora_memory.py) only for load_pretrained to replace it
    with NF4: the base goes from meta straight to its NF4 shards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m, name, init in lora_adapters(model):
            m.lora_A[name].to_empty(device="cpu")
            m.lora_B[name].to_empty(device="cpu")
            m.reset_lora_parameters(name, init)

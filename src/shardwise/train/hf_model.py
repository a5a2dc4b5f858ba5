"""A Hugging Face causal LM for `shardwise train --model.hf PATH`: built on the meta device,
optionally adapted with LoRA (peft), sharded, then each rank reads only its rows of the
pretrained weights (`sw.load_pretrained`).

The model is the library's own class (`AutoModelForCausalLM.from_config`), unwrapped, so its
state-dict keys are Hugging Face's (and, with LoRA, peft's `base_model.model.` ones): the
checkpoints and exports name tensors as `from_pretrained` and peft expect them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

from .config import Config, ModelSection
from .config_outputs import LoraSection
from .qlora import init_adapters

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORE = -100  # a target the loss does not count (prompt tokens, padding)


def lora_config(cfg: Config) -> Any:
    return _lora_config(cfg.lora, cfg.model.hf)


def _lora_config(lo: LoraSection, base: str) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=lo.rank, lora_alpha=lo.scale(), lora_dropout=lo.dropout,
                      target_modules=lo.target_list(), task_type="CAUSAL_LM",
                      base_model_name_or_path=base or None)


def check_targets(model: nn.Module, targets: list[str], given: str = "") -> None:
    """Every name in `targets` matches a module of `model`, as peft matches a list (the
    module's full name, or its tail after a dot); else a ValueError naming the unmatched
    ones and the adaptable layers' names. peft itself refuses only when no name matches, so
    `q_proj,nonexistent` would silently adapt q_proj alone."""
    names = [n for n, _ in model.named_modules() if n]
    unmatched = [t for t in targets
                 if not any(n == t or n.endswith("." + t) for n in names)]
    if not unmatched:
        return
    # What LoRA can adapt: leaf layers holding a matrix (Linear, GPT-2's Conv1D, Embedding).
    layers = sorted({n.rpartition(".")[2] for n, m in model.named_modules()
                     if n and not any(True for _ in m.children())
                     and getattr(getattr(m, "weight", None), "dim", lambda: 0)() >= 2})
    raise ValueError(f"lora.targets={given or ','.join(targets)!r}: "
                     f"{', '.join(map(repr, unmatched))} match{'es' if len(unmatched) == 1 else ''}"
                     f" no module of the model; its adaptable layers are: {', '.join(layers)}")


def _meta_model(cfg: Config) -> nn.Module:
    return meta_model(cfg.model, cfg.lora)


def meta_model(model_section: ModelSection, lora: LoraSection,
               hf_config: Any = None) -> nn.Module:
    """The run's model on the meta device, as `build_hf` starts from it (and `shardwise
    plan` plans it): the folder's architecture (or `hf_config`, a transformers config) in
    model.dtype, with the run's LoRA adapters (peft; the base frozen)."""
    import transformers as tf

    if hf_config is None:
        hf_config = tf.AutoConfig.from_pretrained(model_section.hf, local_files_only=True)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(hf_config,
                                                    dtype=DTYPES[model_section.dtype])
    if lora.rank:
        from peft import get_peft_model

        check_targets(model, lora.target_list() or [], lora.targets)
        try:
            model = get_peft_model(model, _lora_config(lora, model_section.hf))
        except ValueError as e:  # e.g. a target that matches no module
            raise ValueError(f"lora.targets={lora.targets!r}: {e}") from None
    return model


def build_hf(cfg: Config) -> nn.Module:
    """The folder's model, sharded over the world and loaded: each rank holds its rows."""
    model = _meta_model(cfg)
    if cfg.train.activation_checkpointing:
        # Non-reentrant: the unit's hooks run again in the recomputation (engine/core/hooks.py).
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.model.quantize:
        init_adapters(model, cfg.train.seed)
    model.config.use_cache = False  # no KV cache while training
    s = cfg.shard
    sw.shard_model(
        model, sharding_strategy=s.sharding_strategy,
        auto_wrap_policy=None if s.auto_wrap_policy == "none" else s.auto_wrap_policy,
        mixed_precision=None if s.mixed_precision == "fp32" else s.mixed_precision,
        cpu_offload=s.cpu_offload, coalesce_bytes=s.coalesce_bytes)
    inner = model.get_base_model() if cfg.lora.rank else model
    # Everything the checkpoint does not hold (adapters, computed buffers such as rotary
    # inv_freq) gets the model's own initialization; LoRA's B starts at zero (materialize
    # re-runs peft's adapter init), so the adapted model starts as the base model.
    # QLoRA made its adapters before sharding ([Note: QLoRA build] in qlora.py).
    if not cfg.model.quantize:
        sw.materialize(model, init_fn=inner._init_weights, seed=cfg.train.seed)
    # Each rank reads only its rows. With LoRA the adapters are not in the folder (strict
    # would refuse them): they keep the init above. peft froze the base before sharding.
    # QLoRA: the frozen base linears become NF4 as they load (qlora.py), each rank
    # quantizing its own rows; the plain shards materialize made are dropped.
    sw.load_pretrained(model, cfg.model.hf, strict=not cfg.lora.rank,
                       quantize=cfg.model.nf4() if cfg.model.quantize else None)
    return model


# [Note: packed attention] Position ids that restart inside a row make transformers'
# masking_utils build a block-diagonal causal mask (find_packed_sequence_indices), for eager,
# sdpa and flash attention alike, but only without a KV cache: hence use_cache=False on every
# call. Without that function (older transformers releases) the restart would reach the
# rotary embedding alone and documents would still see each other: check_packing refuses it.


def check_packing() -> None:
    """A ValueError when the installed transformers cannot isolate packed documents."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import transformers

        raise ValueError(
            f"data.packing=true needs a transformers release whose masking_utils has "
            f"find_packed_sequence_indices (installed: {transformers.__version__}; 5.x has it) "
            "to keep packed documents from attending to each other: upgrade it, or set "
            "data.packing=false") from None


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
         pos: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy over the counted targets of (B, T) inputs and targets; `pos`:
    position ids that restart at each packed document (token_parts.py [Note: packing])."""
    logits = model(input_ids=x, position_ids=pos, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                           ignore_index=IGNORE)


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
             pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, number of counted targets) of (B, T) inputs and targets: a
    batch whose targets are all masked sums to 0 instead of a mean's NaN."""
    logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                            ignore_index=IGNORE, reduction="sum")
    return total, (y != IGNORE).sum()


def logits(model: nn.Module, x: torch.Tensor,
           pos: torch.Tensor | None = None) -> torch.Tensor:
    return model(input_ids=x, position_ids=pos, use_cache=False).logits


def n_params(model: nn.Module) -> tuple[int, int]:
    """(all parameters, trainable ones), counted from the global shapes."""
    total = trainable = 0
    for p in model.parameters():
        n = p.numel()  # a DTensor reports its global size
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable

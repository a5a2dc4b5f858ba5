"""The model of a run, whatever it is: the built-in GPT or a Hugging Face folder, sharded,
with activation checkpointing and torch.compile when asked; and how the trainer computes its
loss, logits and parameter counts (one interface for both)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import shardwise as sw

from .config import Config
from .model import GPT
from .tensor_parallel import parallelize_gpt

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Built:
    model: nn.Module
    loss: Callable[..., torch.Tensor]  # (x, y[, positions]) -> mean loss
    logits: Callable[..., torch.Tensor]  # (B, T)[, positions (B, T)] -> (B, T, V)
    n_params: int  # every parameter (global shapes)
    n_trainable: int
    # Masked targets (--model.hf data: prompts, padding): (x, y) -> (summed loss, counted
    # targets), so a step weighs each micro-batch by what it counts (trainer.py).
    # Packed --model.hf batches carry position ids as a third tensor (token_parts.py).
    loss_sum: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def build_gpt(cfg: Config, mesh: DeviceMesh | None = None) -> GPT:
    """The GPT built on the meta device, sharded with the config's knobs, then materialized:
    each rank allocates and initializes only its own shards.

    With a (dp, tp) `mesh` the model is built whole on every rank (same seed, same
    weights), split by the TP plan, then sharded over dp: materialize's per-shard streams
    would give the TP ranks' different heads identical initial values.
    """
    torch.manual_seed(cfg.train.seed)
    with torch.device("meta" if mesh is None else "cpu"):
        model = GPT(cfg.model.gpt())
    if cfg.model.dtype != "fp32":
        model.to(_DTYPES[cfg.model.dtype])
    model.checkpointing = cfg.train.activation_checkpointing
    if mesh is not None:
        parallelize_gpt(model.to(mesh.device_type), mesh["tp"])
    s = cfg.shard
    sw.shard_model(
        model,
        sharding_strategy=s.sharding_strategy,
        auto_wrap_policy=None if s.auto_wrap_policy == "none" else s.auto_wrap_policy,
        mixed_precision=None if s.mixed_precision == "fp32" else s.mixed_precision,
        cpu_offload=s.cpu_offload,
        mesh=None if mesh is None else mesh["dp"],
        coalesce_bytes=s.coalesce_bytes,
    )
    if mesh is None:
        sw.materialize(model, seed=cfg.train.seed)
    return model


def _compile_blocks(model: nn.Module) -> None:
    """Each block compiled after sharding (the order docs/training.md recommends: the
    engine's hooks stay eager between the compiled blocks, [Note: compile])."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    names |= set(getattr(inner, "_no_split_modules", None) or [])
    for m in model.modules():
        if type(m).__name__ in names:
            m.compile()


def build(cfg: Config, mesh: DeviceMesh | None = None) -> Built:
    if cfg.model.hf:
        from . import hf_model

        model = hf_model.build_hf(cfg)
        total, trainable = hf_model.n_params(model)
        built = Built(model, lambda x, y, pos=None: hf_model.loss(model, x, y, pos),
                      lambda x, pos=None: hf_model.logits(model, x, pos), total, trainable,
                      lambda x, y, pos=None: hf_model.loss_sum(model, x, y, pos))
    else:
        gpt = build_gpt(cfg, mesh)
        n = cfg.model.gpt().num_params()
        built = Built(gpt, lambda x, y: gpt(x, y), lambda x: gpt(x), n, n)
    if cfg.train.compile:
        _compile_blocks(built.model)
    return built

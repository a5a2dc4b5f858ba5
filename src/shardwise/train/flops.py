"""Model FLOPs per token and MFU (model FLOPs utilization, PaLM's definition).

MFU = the FLOPs the model needs per token x tokens per second per device / the device's
peak FLOP/s. The FLOPs per token are the planner's (planner/shape.py, the built-in GPT's
`GPTConfig.flops_per_token`): 6 per matmul weight (2 forward, 4 backward: input and weight
gradients), the output head included, and causal attention at 6 x seq_len x q_dim per
layer. torchtitan counts attention without the causal half (12 x ...), so its MFU runs
slightly higher for long sequences; recomputation (activation checkpointing) is not model
FLOPs in either. Under LoRA the frozen weights need no weight gradient: 4 per frozen matmul
weight, 6 per adapter weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..observe.peak_flops import peak_flops
from .config import Config

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def flops_per_token(cfg: Config, n_trainable: int = 0) -> tuple[float | None, str]:
    """(training FLOPs per token, what they were counted from); (None, why) when the model's
    architecture is one the planner cannot read (MFU is then not reported)."""
    if not cfg.model.hf:
        g = cfg.model.gpt()
        return float(g.flops_per_token()), f"GPT '{cfg.model.preset}'"
    from ..planner.hf_config import load_shape

    try:
        shape, _ = load_shape(cfg.model.hf)
    except ValueError as e:
        return None, f"FLOPs per token unknown: {e}"
    flops = shape.flops_per_token(cfg.model.seq_len())
    if cfg.lora.rank:
        # Everything but the adapters is frozen: no weight gradient (2 of the 6).
        matmul = shape.n_layers * shape.block_matmul_params() + shape.vocab_size * shape.d_model
        flops += -2 * matmul + 6 * n_trainable
    return float(flops), f"{shape.n_layers} layers, d={shape.d_model}"


def compute_dtype(cfg: Config) -> torch.dtype:
    """The dtype matmuls run in: the mixed-precision one, else the weights' own."""
    mp = cfg.shard.mixed_precision
    return _DTYPES[mp if mp != "fp32" else cfg.model.dtype]


@dataclass(frozen=True)
class Utilization:
    """What turns a step's tokens per second into TFLOP/s and MFU (per device)."""

    flops_per_token: float | None
    peak_flops: float  # one device's, for the run's compute dtype
    peak_source: str
    world: int

    @classmethod
    def for_run(cls, cfg: Config, n_trainable: int, device: torch.device, world: int
                ) -> Utilization:
        """Count the model's FLOPs and find the peak. Called on every rank at once: a
        measured CPU peak is then measured under the load of the other ranks, as training
        runs."""
        flops, _ = flops_per_token(cfg, n_trainable)
        if flops is None:
            return cls(None, 0.0, "", world)
        peak, source = peak_flops(device, compute_dtype(cfg), cfg.log.peak_tflops)
        return cls(flops, peak, source, world)

    def figures(self, tokens_per_s: float) -> dict[str, float]:
        """`tflops` (achieved per device) and `mfu_pct`, from all ranks' tokens/s."""
        if self.flops_per_token is None or not self.peak_flops:
            return {}
        achieved = self.flops_per_token * tokens_per_s / self.world
        return {"tflops": achieved / 1e12, "mfu_pct": 100.0 * achieved / self.peak_flops}

    def info(self) -> dict[str, Any]:
        return {"flops_per_token": self.flops_per_token, "peak_tflops": self.peak_flops / 1e12,
                "peak_source": self.peak_source}

"""The caution panel: what the chosen configuration would cost in interconnect bandwidth.

The toy run moves a few kilobytes per step, which says nothing about real hardware. So the
page scales the chosen configuration (strategy, world size, mixed precision) up to a real
model and real links: bytes each rank sends per step, and how long that takes on common
interconnects, beside the compute time of the same step. The numbers come from the
project's planner (`sw.plan`) when it is available; until then from the communication
volume formulas below, and the page says which one it shows.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# The reference job the toy configuration is scaled to (stated on the page).
REF_PARAMS = 7_000_000_000
REF_TOKENS_PER_RANK = 4096  # tokens per rank per step
REF_GPU_FLOPS = 989e12  # H100 SXM dense bf16 peak, FLOP/s
REF_MFU = 0.4  # fraction of peak a well-tuned step reaches
# One direction, per GPU, in bytes/s: the figures vendors quote, rounded.
LINKS = (
    ("NVLink 4 (inside a node)", 450e9),
    ("InfiniBand NDR 400 Gb/s", 50e9),
    ("PCIe Gen4 x16", 25e9),
    ("100 Gb Ethernet", 12.5e9),
)
_DTYPE_BYTES = {"none": 4, "bf16": 2, "fp16": 2}


def comm_bytes_per_rank(params: int, strategy: str, world: int, local_world: int,
                        precision: str) -> dict[str, float]:
    """Bytes one rank sends per step, per collective, with ring collectives.

    A ring all-gather or reduce-scatter over S ranks sends (S-1)/S of the full buffer from
    each rank; a ring all-reduce sends twice that. Parameters travel in the compute dtype;
    gradients are reduced in fp32 (the engine's mixed-precision presets reduce in fp32).
    """
    pb, gb = _DTYPE_BYTES[precision], 4
    if strategy == "NO_SHARD":
        return {"all_reduce": 2 * (world - 1) / world * params * gb}
    shard = local_world if strategy == "HYBRID_SHARD" else world
    frac = (shard - 1) / shard
    gathers = 2 if strategy in ("FULL_SHARD", "HYBRID_SHARD") else 1  # forward (+ backward)
    out = {"all_gather": gathers * frac * params * pb,
           "reduce_scatter": frac * params * gb}
    replicas = world // shard
    if replicas > 1:
        out["all_reduce"] = 2 * (replicas - 1) / replicas * (params / shard) * gb
    return out


def _from_planner(cfg: dict) -> dict[str, Any] | None:
    """The planner's numbers for the reference job, or None while there is no planner."""
    try:
        import shardwise as sw

        plan = getattr(sw, "plan", None)
        if plan is None:
            return None
        result = plan(REF_PARAMS, world_size=cfg["world_size"],
                      sharding_strategy=cfg["strategy"],
                      mixed_precision=None if cfg["mixed_precision"] == "none"
                      else cfg["mixed_precision"])
    except Exception:  # noqa: BLE001 - the page falls back to its own formulas
        log.debug("planner unavailable for %s", cfg, exc_info=True)
        return None
    as_dict = result.to_dict() if hasattr(result, "to_dict") else dict(vars(result))
    return {k: v for k, v in as_dict.items() if isinstance(v, (int, float, str, bool))}


def caution(cfg: dict) -> dict[str, Any]:
    """Everything the caution panel shows, as JSON."""
    world, local = cfg["world_size"], cfg["local_world_size"]
    per = comm_bytes_per_rank(REF_PARAMS, cfg["strategy"], world, local, cfg["mixed_precision"])
    total = sum(per.values())
    compute_s = 6 * REF_PARAMS * REF_TOKENS_PER_RANK / (REF_GPU_FLOPS * REF_MFU)
    links = [{"name": name, "bytes_per_s": bw, "seconds": total / bw,
              "hidden": total / bw <= compute_s} for name, bw in LINKS]
    planner = _from_planner(cfg)
    return {
        "source": "planner" if planner else "formula",
        "planner": planner,
        "ref_params": REF_PARAMS,
        "ref_tokens_per_rank": REF_TOKENS_PER_RANK,
        "compute_s": compute_s,
        "bytes_per_rank": per,
        "total_bytes_per_rank": total,
        "links": links,
    }

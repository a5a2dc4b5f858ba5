"""The caution panel: what the chosen configuration would cost in interconnect bandwidth.

The toy run moves a few kilobytes per step, which says nothing about real hardware. So the
page scales the chosen configuration (strategy, world size, mixed precision) up to a real
model and real links: bytes each rank sends per step, and how long that takes on common
interconnects, beside the compute time of the same step. The numbers come from the
project's planner (shardwise.planner) when it is importable; otherwise from the ring
volume formulas below, and the page says which one it shows.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# The reference job the toy configuration is scaled to (stated on the page): a GPT of
# Llama-7B-like shape, one 4096-token sequence per rank per step, on H100s.
REF_SHAPE = {"n_layers": 32, "d_model": 4096, "n_heads": 32, "vocab_size": 32000}
REF_PARAMS = 6_573_789_184  # that shape's parameter count (tied embedding)
REF_MODEL = "GPT, 32 layers x 4096 wide (6.6B parameters)"
REF_BATCH, REF_SEQ = 1, 4096
REF_DEVICE_NAME = "H100 80GB"
PLANNER_DEVICE = "h100-80gb"
# (label, planner interconnect profile, ranks per node: "all" = one node, else across).
PLANNER_LINKS = (
    ("NVLink 4, all ranks in one node", None, "all"),
    ("InfiniBand 400 Gb/s between nodes", "ib-400g", "across"),
    ("InfiniBand 200 Gb/s between nodes", "ib-200g", "across"),
    ("100 Gb Ethernet between nodes", "eth-100g", "across"),
)
# Fallback formula only (no planner): H100 dense peaks (bf16/fp16 tensor cores, fp32) and
# the fraction of peak a well-tuned step reaches.
REF_GPU_FLOPS = {"none": 67e12, "bf16": 989e12, "fp16": 989e12}
REF_MFU = 0.4
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
    """The planner's numbers for the reference job on each link, or None without a planner.

    "Inside one node": every rank on one NVLink-connected machine. "Between nodes": one
    rank per node (HYBRID_SHARD: one shard group per node), so every collective (or, for
    HYBRID_SHARD, the cross-node all-reduce) crosses the named link.
    """
    try:
        from ..planner import plan
    except ImportError:
        return None
    world, local = cfg["world_size"], cfg["local_world_size"]
    across = local if cfg["strategy"] == "HYBRID_SHARD" else 1
    rows, first = [], None
    try:
        for name, link, per_node in PLANNER_LINKS:
            p = plan(REF_PARAMS, world_size=world, sharding_strategy=cfg["strategy"],
                     auto_wrap_policy="transformer" if cfg["wrap"] == "layer" else None,
                     mixed_precision=None if cfg["mixed_precision"] == "none"
                     else cfg["mixed_precision"],
                     batch_size=REF_BATCH, seq_len=REF_SEQ, device=PLANNER_DEVICE,
                     interconnect=link, ranks_per_node=world if per_node == "all" else across,
                     shape=REF_SHAPE)
            t = p.time
            if t is None:
                return None
            first = first or p
            rows.append({"name": name, "seconds": t.comm_s, "compute_s": t.compute_s,
                         "step_s": t.step_s, "bound": t.bound,
                         "hidden": t.bound == "compute", "bytes": p.comm.sent_bytes})
    except Exception:  # noqa: BLE001 - a planner still in flux must not break the page
        log.debug("planner failed for %s", cfg, exc_info=True)
        return None
    assert first is not None and first.time is not None
    return {
        "source": "planner",
        "compute_s": first.time.compute_s,
        "total_bytes_per_rank": first.comm.sent_bytes,
        "bytes_per_rank": {"all_gather": first.comm.all_gather_bytes,
                           "reduce_scatter": first.comm.reduce_scatter_bytes,
                           "all_reduce": first.comm.all_reduce_bytes},
        "memory_per_rank": first.per_rank.total_bytes,
        "fits": first.fits,
        "links": rows,
        "notes": list(first.notes),
    }


def _from_formula(cfg: dict) -> dict[str, Any]:
    world, local = cfg["world_size"], cfg["local_world_size"]
    per = comm_bytes_per_rank(REF_PARAMS, cfg["strategy"], world, local, cfg["mixed_precision"])
    total = sum(per.values())
    flops = REF_GPU_FLOPS[cfg["mixed_precision"]] * REF_MFU
    compute_s = 6 * REF_PARAMS * REF_BATCH * REF_SEQ / flops
    links = [{"name": name, "seconds": total / bw, "compute_s": compute_s,
              "step_s": max(compute_s, total / bw), "bound": "compute"
              if total / bw <= compute_s else "interconnect", "hidden": total / bw <= compute_s,
              "bytes": total} for name, bw in LINKS]
    return {"source": "formula", "compute_s": compute_s, "total_bytes_per_rank": total,
            "bytes_per_rank": per, "memory_per_rank": None, "fits": None, "links": links,
            "notes": []}


def caution(cfg: dict) -> dict[str, Any]:
    """Everything the caution panel shows, as JSON (planner numbers when there is one)."""
    out = _from_planner(cfg) or _from_formula(cfg)
    return {**out, "ref_params": REF_PARAMS, "ref_model": REF_MODEL,
            "ref_tokens_per_rank": REF_BATCH * REF_SEQ, "ref_device": REF_DEVICE_NAME}

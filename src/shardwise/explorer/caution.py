"""The caution panel: what the chosen configuration would cost in interconnect bandwidth.

The toy run moves a few kilobytes per step, which says nothing about real hardware. So the
page scales the chosen configuration (strategy, world size, mixed precision) up to a real
model and real links: bytes each rank sends per step, and how long that takes on common
interconnects, beside the compute time of the same step. The numbers come from the
project's planner (shardwise.planner).
"""

from __future__ import annotations

from typing import Any

from ..planner import plan

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


def caution(cfg: dict) -> dict[str, Any]:
    """Everything the caution panel shows, as JSON: the planner's numbers for the reference
    job on each link.

    "Inside one node": every rank on one NVLink-connected machine. "Between nodes": one
    rank per node (HYBRID_SHARD: one shard group per node), so every collective (or, for
    HYBRID_SHARD, the cross-node all-reduce) crosses the named link.
    """
    world, local = cfg["world_size"], cfg["local_world_size"]
    across = local if cfg["strategy"] == "HYBRID_SHARD" else 1
    plans = [(name, plan(REF_PARAMS, world_size=world, sharding_strategy=cfg["strategy"],
                         auto_wrap_policy="transformer" if cfg["wrap"] == "layer" else None,
                         mixed_precision=None if cfg["mixed_precision"] == "none"
                         else cfg["mixed_precision"],
                         batch_size=REF_BATCH, seq_len=REF_SEQ, device=PLANNER_DEVICE,
                         interconnect=link,
                         ranks_per_node=world if per_node == "all" else across,
                         shape=REF_SHAPE))
             for name, link, per_node in PLANNER_LINKS]
    rows = []
    for name, p in plans:
        t = p.time
        assert t is not None  # a device, a batch and a length always give a time
        rows.append({"name": name, "seconds": t.comm_s, "compute_s": t.compute_s,
                     "step_s": t.step_s, "bound": t.bound, "hidden": t.bound == "compute",
                     "bytes": p.comm.sent_bytes})
    first = plans[0][1]
    assert first.time is not None
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
        "ref_params": REF_PARAMS, "ref_model": REF_MODEL,
        "ref_tokens_per_rank": REF_BATCH * REF_SEQ, "ref_device": REF_DEVICE_NAME,
    }
